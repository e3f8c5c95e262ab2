#!/usr/bin/env bash
# Session 8's GPU calls (each under the device tool's 600 s limit):
#   OUT=dir bash benchmarks/gpu_s8.sh explore  # dequantize with size hints (vector stores), K/V not repeated
#                                              # (sdpa_gqa): one AGoQ step's flushes per launch configuration
#                                              # (tune_kernels --what s8), bench_agoq twice as is and once with
#                                              # sdpa_gqa=false, the multi-tensor tests compiled
#   OUT=dir bash benchmarks/gpu_s8.sh record   # + the dequantize tile 4096 x 4 warps x 2: bench_agoq four times,
#                                              # the step's flushes again, the CUDA-time profile, FORGE part (a)
#                                              # with --product (bf16 W + SR + int8 states) at T = 512, 2048,
#                                              # the AGoQ and multi-tensor tests compiled
#   OUT=dir bash benchmarks/gpu_s8.sh final    # the same code: bench_agoq three more times (the last one also as
#                                              # a context manager and without replay), FORGE's update-only
#                                              # kernel per tile with int8 states (tune_kernels --what forge_int8)
#   OUT=dir bash benchmarks/gpu_s8.sh forge    # the update kernel's new tiles: the FORGE tests compiled, part (a)
#                                              # with --product at T = 512, 2048, part (b) at B = 1, 4, 16
#   OUT=dir bash benchmarks/gpu_s8.sh nccl     # (nvidia-h200-x2) the NCCL smoke test on 2 GPUs (ShardedOptimizer,
#                                              # SDP4Bit, FORGE data parallel, FORGE + AGoQ, the int8 DDP hook),
#                                              # then the trainer under torchrun: FORGE + AGoQ on 2 GPUs and on
#                                              # one with the same global batch (small preset, 30 steps)
#   OUT=dir bash benchmarks/gpu_s8.sh train1b  # the 1b preset through the trainer, B = 8, 8 steps: the baseline
#                                              # (torch AdamW, pure bf16), FORGE (bf16 + SR, fp32 states) + AGoQ,
#                                              # FORGE (bf16 + SR, int8 states) + AGoQ: summary.json of each
#   OUT=dir bash benchmarks/gpu_s8.sh why      # why FORGE + AGoQ trains at half the baseline's tokens/s in the
#                                              # trainer: profile_step agoq_forge (B = 8) without and with the
#                                              # trainer's clip (est_global), and the trainer with --forge.clip none
set -u -o pipefail
PART=${1:-explore}
D=$OUT/$PART
mkdir -p "$D"
source "$(dirname "$0")/gpu_lib.sh"
{
  case "$PART" in
    explore)
      gpuinfo
      log "tune s8: one AGoQ step's flushes"
      timeout 200 python3 benchmarks/tune_kernels.py --what s8 --out "$D" 2>&1 | grep -v '"flushes"' | tail -30
      export FLAT=1
      AGOQ_ARGS="--variants=" agoqrun a 85
      AGOQ_ARGS="--variants= --model sdpa_gqa=false" agoqrun nogqa 85
      AGOQ_ARGS="--variants=" agoqrun b 85
      log "gpu tests: multi"
      gputest 100 tests/ops/test_multi.py ;;
    record)
      gpuinfo
      export FLAT=1
      AGOQ_ARGS="--variants=" agoqrun r1 85
      AGOQ_ARGS="--variants=" agoqrun r2 85
      log "tune s8: one AGoQ step's flushes"
      timeout 200 python3 benchmarks/tune_kernels.py --what s8 --out "$D" 2>&1 | grep -v '"flushes"' | tail -30
      AGOQ_ARGS="--variants=" agoqrun r3 85
      AGOQ_ARGS="--variants=" agoqrun r4 85
      log "profile agoq B=8 forward+backward"
      timeout 90 python3 benchmarks/profile_step.py --config agoq --batch 8 --no-opt --out "$D" 2>&1 | grep -v Warn | tail -1
      log "forge part (a), --product, T = 512, 2048"
      mkdir -p "$D/forge"
      timeout 150 python3 benchmarks/bench_forge.py --part a --product --tokens 512 2048 --timeout-a 140 --out "$D/forge" 2>&1 | tail -16
      rm -f "$D"/forge/*.md; mv "$D"/forge/* "$D"/ && rmdir "$D/forge"  # (at most 8 files come back: the .md is made from the .json)
      log "gpu tests: agoq, multi"
      gputest 170 tests/agoq tests/ops/test_multi.py ;;
    final)
      gpuinfo
      export FLAT=1
      AGOQ_ARGS="--variants=" agoqrun f1 85
      log "tune forge_int8: the update kernel per tile, int8 states"
      timeout 200 python3 benchmarks/tune_kernels.py --what forge_int8 --out "$D" 2>&1 | tail -50
      AGOQ_ARGS="--variants=" agoqrun f2 85
      AGOQ_ARGS="--variants ctx,noreplay" agoqrun f3 130 ;;
    forge)
      gpuinfo
      log "gpu tests: forge, state8"
      gputest 150 tests/forge tests/ops/test_state8.py
      for part in a b; do
        log "bench forge part $part"
        mkdir -p "$D/$part"
        if [ $part = a ]; then
          timeout 150 python3 benchmarks/bench_forge.py --part a --product --tokens 512 2048 --timeout-a 140 \
            --out "$D/a" 2>&1 | grep -v Warn | tail -14
        else
          timeout 300 python3 benchmarks/bench_forge.py --part b --batches 1 4 16 --timeout 45 --out "$D/b" 2>&1 \
            | grep -v Warn | tail -24
        fi
        for f in "$D/$part"/*; do mv "$f" "$D/forge_${part}.${f##*.}"; done
        rmdir "$D/$part"
      done ;;
    nccl)
      gpuinfo
      nvidia-smi topo -m | head -4
      log "torchrun NCCL smoke, 2 GPUs"
      timeout 240 torchrun --standalone --nproc-per-node 2 tests/dist/torchrun_smoke.py 2>&1 | grep -v Warn | grep -v "^  return" | tail -14
      ARGS="--preset small --steps 30 --forge --agoq --train.eval-every 10 --train.log-every 5"
      log "trainer, torchrun 2 GPUs, NCCL: $ARGS --data.batch-size 8"
      timeout 200 torchrun --standalone --nproc-per-node 2 -m leantrain train $ARGS --data.batch-size 8 --out "$D/ddp2" 2>&1 | grep -v Warn | tail -8
      log "trainer, one GPU, the same global batch: $ARGS --data.batch-size 16"
      timeout 120 python3 -m leantrain train $ARGS --data.batch-size 16 --out "$D/one" 2>&1 | grep -v Warn | tail -5
      for r in ddp2 one; do cp "$D/$r/metrics.jsonl" "$D/metrics_$r.jsonl" 2>/dev/null; rm -rf "$D/$r"; done ;;
    train1b)
      gpuinfo
      COMMON="--preset 1b --steps 8 --data.batch-size 8 --data.max-corpus-mb 6 --train.eval-every 0 --train.ckpt-every 0"
      COMMON="$COMMON --optim.warmup-steps 2 --train.sample-tokens 0 --train.progress false"
      for r in "baseline:--baseline" "forge_agoq:--forge --agoq" "forge_int8_agoq:--forge --forge.state-dtype int8 --agoq"; do
        name=${r%%:*}
        log "train 1b $name: $COMMON ${r#*:}"
        timeout 170 python3 -m leantrain train $COMMON ${r#*:} --out "$D/$name" 2>&1 | grep -v Warn | tail -3
        cp "$D/$name/summary.json" "$D/train1b_$name.json" 2>/dev/null; rm -rf "$D/$name"
      done ;;
    why)
      gpuinfo
      for clip in none est_global; do
        log "profile agoq_forge B=8 clip=$clip"
        timeout 100 python3 benchmarks/profile_step.py --config agoq_forge --batch 8 --clip $clip --out "$D" 2>&1 | grep -v Warn | tail -1
      done
      COMMON="--preset 1b --steps 8 --data.batch-size 8 --data.max-corpus-mb 6 --train.eval-every 0 --train.ckpt-every 0"
      COMMON="$COMMON --optim.warmup-steps 2 --train.sample-tokens 0 --train.progress false"
      log "train 1b forge + agoq, --forge.clip none"
      timeout 150 python3 -m leantrain train $COMMON --forge --agoq --forge.clip none --out "$D/noclip" 2>&1 | grep -v Warn | tail -2
      cp "$D/noclip/summary.json" "$D/train1b_forge_agoq_noclip.json" 2>/dev/null; rm -rf "$D/noclip" ;;
  esac
} 2>&1 | tee "$D/run.log"

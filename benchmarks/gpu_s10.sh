#!/usr/bin/env bash
# Session 10's GPU calls (under the device tool's 600 s limit; one tarball comes back):
#   OUT=dir bash benchmarks/gpu_s10.sh main    # the LM head + loss fused (leantrain/losses.py): its tests and the
#                                            # clip kernel's (64-bit offsets) compiled; the torchrun NCCL smoke test
#                                            # when 2 GPUs are there (FORGE data parallel now updates the head from
#                                            # the slices); bench_agoq twice fused, once unfused (fused_loss=false);
#                                            # the 1b trainer, 16 steps: baseline, FORGE + AGoQ, FORGE int8 + AGoQ
#   OUT=dir bash benchmarks/gpu_s10.sh second  # the fused loss's logits in fp32 from the GEMM (no bf16 rounding, no bf16
#                                            # copy) and dh by addmm with beta = 1: its GPU tests; bench_agoq twice, and
#                                            # with loss_chunk=512; peak_trace.py (where the peak is) for AGoQ and the
#                                            # baseline; the 1b trainer again: baseline, FORGE + AGoQ
#   OUT=dir bash benchmarks/gpu_s10.sh third   # the fused loss's element-wise passes as Triton kernels (ops/xent.py):
#                                            # their tests and the fused loss's compiled; bench_agoq fused twice and
#                                            # unfused once (the same host); the 1b trainer: baseline, FORGE + AGoQ,
#                                            # and baseline unfused; 125m, 1000 steps: baseline and AGoQ (loss curves)
#   OUT=dir bash benchmarks/gpu_s10.sh fourth  # AGoQ derives silu(g) and the down projection's input (Policy.derive):
#                                            # its tests on CUDA; bench_agoq twice, and once with derive= (off);
#                                            # peak_trace agoq; the 1b trainer: baseline, FORGE + AGoQ, FORGE int8 +
#                                            # AGoQ; 125m, 1000 steps, AGoQ (its curve against third's baseline)
#   OUT=dir bash benchmarks/gpu_s10.sh fifth   # derived saves rebuilt from the replay plan (no graph walk): bench_agoq
#                                            # derive on, off, on; the 1b trainer: baseline, FORGE + AGoQ, FORGE int8
#                                            # + AGoQ (every step logged)
#   OUT=dir bash benchmarks/gpu_s10.sh sixth   # the final code: GPU tests of AGoQ, FORGE, the fused loss and its kernels,
#                                            # the model; bench_agoq three more times (the step-time spread)
# Work goes to /tmp/s10w/PART; $OUT/PART.tgz is rewritten after each stage (what a time-out leaves comes back).
set -u -o pipefail
PART=${1:-main}
D=/tmp/s10w/$PART
mkdir -p "$D"
source "$(dirname "$0")/gpu_lib.sh"
snap() { tar czf "$OUT/$PART.tgz" -C /tmp/s10w "$PART"; }
c125() {  # $1 name, rest: trainer arguments (125m, 1000 steps, the earlier curves' settings)
  local name=$1
  shift
  log "125m, 1000 steps: $name: $*"
  timeout 140 python3 -m leantrain train --preset 125m --steps 1000 "$@" --out "$D/c125_$name" --data.max-corpus-mb 16 \
    --train.eval-every 200 --train.ckpt-every 0 --train.sample-tokens 0 --train.log-every 50 --train.progress false \
    2>&1 | grep -v Warn | tail -2
  find "$D/c125_$name" -mindepth 1 -not -name metrics.jsonl -not -name summary.json -exec rm -rf {} + 2>/dev/null
}
{
  case "$PART" in
    main)
      gpuinfo
      log "gpu tests: the fused loss, the clip kernel (64-bit offsets), the model, AGoQ's save path"
      gputest 150 tests/test_losses.py tests/forge/test_forge_clip.py tests/test_model.py tests/agoq/test_agoq_hooks.py
      snap
      if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
        log "torchrun NCCL smoke test (2 GPUs)"
        timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node=2 tests/dist/torchrun_smoke.py 2>&1 \
          | grep -v Warn | tail -14
        snap
      fi
      export FLAT=1
      AGOQ_ARGS="--variants=" agoqrun fused1 70
      AGOQ_ARGS="--variants=" agoqrun fused2 70
      AGOQ_ARGS="--variants= --model fused_loss=false" agoqrun unfused 70
      snap
      train1b_trio ;;
    second)
      gpuinfo
      log "gpu tests: the fused loss"
      gputest 120 tests/test_losses.py
      snap
      export FLAT=1
      AGOQ_ARGS="--variants=" agoqrun fused3 70
      AGOQ_ARGS="--variants=" agoqrun fused4 70
      AGOQ_ARGS="--variants= --model loss_chunk=512" agoqrun fused_chunk512 70
      snap
      for c in agoq baseline; do
        log "peak_trace $c"
        timeout 70 python3 benchmarks/peak_trace.py --config $c --out "$D" 2>&1 | grep -v Warn | tail -12
      done
      snap
      train1b baseline --baseline
      train1b forge_agoq --forge --agoq ;;
    third)
      gpuinfo
      log "gpu tests: the fused loss and its kernels"
      gputest 120 tests/test_losses.py tests/ops/test_xent.py
      snap
      export FLAT=1
      AGOQ_ARGS="--variants=" agoqrun fused5 70
      AGOQ_ARGS="--variants= --model fused_loss=false" agoqrun unfused2 70
      AGOQ_ARGS="--variants=" agoqrun fused6 70
      snap
      train1b baseline --baseline
      train1b forge_agoq --forge --agoq
      train1b baseline_unfused --baseline --model.fused-loss false
      snap
      for r in "baseline:--baseline" "agoq:--agoq"; do
        c125 ${r%%:*} ${r#*:}
        snap
      done ;;
    fourth)
      gpuinfo
      log "gpu tests: AGoQ's derived saves, the save path"
      gputest 120 tests/agoq/test_agoq_derive.py tests/agoq/test_agoq_hooks.py
      snap
      export FLAT=1
      AGOQ_ARGS="--variants=" agoqrun derive1 70
      AGOQ_ARGS="--variants= --policy derive=" agoqrun noderive 70
      AGOQ_ARGS="--variants=" agoqrun derive2 70
      snap
      log "peak_trace agoq"
      timeout 70 python3 benchmarks/peak_trace.py --config agoq --out "$D" 2>&1 | grep -v Warn | tail -12
      snap
      train1b_trio
      snap
      c125 agoq --agoq ;;
    fifth)
      gpuinfo
      export FLAT=1
      AGOQ_ARGS="--variants=" agoqrun derive3 70
      AGOQ_ARGS="--variants= --policy derive=" agoqrun noderive2 70
      AGOQ_ARGS="--variants=" agoqrun derive4 70
      snap
      train1b_trio ;;
    sixth)
      gpuinfo
      log "gpu tests: agoq, forge, losses, xent, model (compiled)"
      gputest 170 tests/agoq tests/forge tests/test_losses.py tests/ops/test_xent.py tests/test_model.py
      snap
      export FLAT=1
      for r in final1 final2 final3; do AGOQ_ARGS="--variants=" agoqrun $r 50; done ;;
  esac
} 2>&1 | tee "$D/run.log"
snap

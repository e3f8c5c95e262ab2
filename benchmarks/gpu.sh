#!/usr/bin/env bash
# Every GPU test and benchmark of leantrain in one run, on a machine where nothing can be installed:
#   OUT=dir bash benchmarks/gpu.sh [quick] [SECTION ...]
# SECTION is any of: tests ops forge step accum agoq comm scapefidelity finetune lowmem convergence fsdp speed memory scale
# (default: all of them, in that order; comm = sdp4bit giftcost scapecost, fsdp = fsdp1b fsdp8b; CONV_RECIPES and
# SPEED_CONFIGS narrow convergence's recipes and speed's configurations); `quick` runs fewer sizes and shapes.
#   OUT=dir BASE=dir bash benchmarks/gpu.sh verify   (the GPU tests of ops, forge, agoq, model, runtime
#       (VERIFY_TESTS=0: none), then the 1b step through the trainer for this tree and for the tree under
#       $BASE/src, in alternation: a change's correctness and its step time against a baseline in one run;
#       a baseline tree: `mkdir base && git archive <commit> src | tar -x -C base`)
# Runs from the repository root with PYTHONPATH=src. Writes $OUT/run.log, $OUT/tests/gpu_tests.txt and
# each topic's result files under $OUT/<topic>/ (<date>_<hardware>[_what].json and .md). To commit a
# result, copy it to benchmarks/results/<topic>/ and run `python benchmarks/report.py`.
set -u -o pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export LEANTRAIN_TEST_GPU=1 PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
Q=""; [ "${1:-}" = quick ] && { Q="--quick"; shift; }
SECTIONS=${*:-tests ops forge step accum agoq comm scapefidelity finetune lowmem convergence fsdp speed memory scale}
for s in $SECTIONS; do
  case $s in tests|ops|forge|step|accum|agoq|comm|sdp4bit|giftcost|scapecost|scapefidelity|finetune|lowmem|convergence|fsdp|fsdp1b|fsdp8b|speed|memory|scale|verify) ;; *) echo "gpu.sh: no section '$s'" >&2; exit 2;; esac
done
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
log() { echo "=== $(date +%T) $*"; }
train1b() {  # $1 name, rest: trainer arguments; the 1b preset, B = 8, 16 steps, every step logged
  local name=$1; shift
  timeout 300 python3 -m leantrain train --preset 1b --steps 16 --data.batch-size 8 --data.max-corpus-mb 6 \
    --train.eval-every 0 --train.ckpt-every 0 --optim.warmup-steps 2 --train.sample-tokens 0 \
    --train.progress false --train.log-every 1 "$@" --out "$OUT/step/train-1b/$name" 2>&1 | tail -3
}

warm() {  # $1 preset, rest: trainer arguments; one step, so the preset's tokenizer is made once, before
  # runs that read it side by side (runs that find none would each make it)
  local p=$1; shift
  python3 -m leantrain train --preset "$p" --steps 1 --train.eval-every 0 --train.ckpt-every 0 --train.sample-tokens 0 \
    --train.progress false "$@" --out "$OUT/warm-$p" > /dev/null 2>&1
  rm -rf "$OUT/warm-$p"
}

verify() {
  if [ "${VERIFY_TESTS:-1}" = 1 ]; then
    log "GPU tests of the kernels and the step"
    mkdir -p "$OUT/tests"
    timeout 320 python3 -m pytest tests/ops tests/forge tests/agoq tests/model tests/runtime -q -m gpu -x \
      -p no:cacheprovider -o addopts="" 2>&1 | tail -25 | tee "$OUT/tests/gpu_tests.txt"
  fi
  log "1b step through the trainer, this tree against \$BASE"
  timeout 420 python3 benchmarks/bench_step.py --base "$BASE" --rounds "${VERIFY_ROUNDS:-3}" --out "$OUT/step" 2>&1 | tail -8
}

tests() {
  log "GPU tests"
  mkdir -p "$OUT/tests"
  timeout 900 python3 -m pytest tests -q -m gpu -p no:cacheprovider -o addopts="" 2>&1 | tail -40 \
    | tee "$OUT/tests/gpu_tests.txt"
}

ops() {
  log "ops: kernel bandwidth; RMSNorm and RoPE"
  timeout 600 python3 benchmarks/bench_ops.py --sizes 256,2048 --rep 60 $Q --out "$OUT/ops" 2>&1 | tail -30
  timeout 300 python3 benchmarks/bench_ops.py norm --tokens 65536 --out "$OUT/ops" 2>&1 | tail -8
}

forge() {
  log "forge: one linear, every kernel path (part a)"
  timeout 600 python3 benchmarks/bench_forge.py --part a $Q --out "$OUT/forge" 2>&1 | tail -40
  log "forge: the update kernel with 8-bit states, by tile and register cap (the static counts: bench_forge --part sass)"
  TUNE_INT8_KINDS=int8,int8p,fp8 TUNE_INT8_TILES="16,64,2;16,64,2,144;16,64,2,128;32,64,2;16,64,1" \
    timeout 300 python3 benchmarks/tools/tune_kernels.py --what forge_int8 --out "$OUT/forge" 2>&1 | tail -14
}

step() {
  log "step: the whole 1b step, FORGE against torch, graphed (bench_forge part b)"
  timeout 600 python3 benchmarks/bench_forge.py --part b --batches 1 4 16 --timeout 70 $Q --out "$OUT/step" 2>&1 | tail -24
  log "step: the 1b preset through the trainer"
  train1b baseline --baseline
  train1b forge_agoq --forge --agoq
  train1b forge_int8_agoq --forge --forge.state-dtype int8 --agoq
  train1b compiled --train.compile true
}

accum() {
  log "accum: 4 micro-batches a step (1b, B = 2 each): torch, FORGE's split path, the tile kernel's accumulation (bf16, int8)"
  local A="--data.grad-accum 4"
  timeout 540 python3 benchmarks/bench_step.py --preset 1b --batch 2 --steps 12 --rounds 1 --name forge-accum \
    --recipe "torch=--baseline $A" --recipe "forge_split=--forge $A" --recipe "forge_tiles=--forge --forge.kernel tiles $A" \
    --recipe "forge_tiles_int8=--forge --forge.kernel tiles --forge.accum-dtype int8 $A" --out "$OUT/step" 2>&1 | tail -8
}

agoq() {
  log "agoq: saved activations, peak, step time (1b, B = 8)"
  timeout 600 python3 benchmarks/bench_agoq.py --steps 16 --graph --variants= --out "$OUT/agoq" 2>&1 | tail -6
}

comm() { sdp4bit; giftcost; scapecost; }

sdp4bit() {
  log "sdp4bit: the compression path"
  timeout 300 python3 benchmarks/bench_comm.py --out "$OUT/comm" 2>&1 | tail -20
}

scapecost() {
  log "scapecost: SCAPE's compute as rank 0 of 32, Llama-1.8B-sized"
  timeout 300 python3 benchmarks/bench_comm.py scape-cost --params 1.8e9 --world 32 --out "$OUT/comm" 2>&1 | tail -8
}

scapefidelity() {  # SCAPE_SEEDS narrows the seeds of the 300-step tiny runs
  log "scapefidelity: SCAPE 90 % / 99 % against dense AdamS, one process on the GPU (tiny 300 and 1000 steps, small 300)"
  local F="$OUT/comm/$(date +%F)_$(cd benchmarks && python3 -c 'import harness; print(harness.hardware())')"
  local R='sharded-adams,sharded-scape90,sharded-scape99@comm.scape.warmup=200'
  warm tiny; warm small  # (the runs below go side by side)
  timeout 240 python3 benchmarks/bench_convergence.py --scape-fidelity --ranks 1 --jobs 9 --preset tiny --steps 300 \
    --seeds "${SCAPE_SEEDS:-1337,1,2,3,4,5}" --scape-recipes "$R" --out "${F}_scape-fidelity-1proc.json" 2>&1 | tail -4
  timeout 200 python3 benchmarks/bench_convergence.py --scape-fidelity --ranks 1 --jobs 9 --preset small --steps 300 \
    --seeds 1337,1,2 --scape-recipes "$R" --out "${F}_scape-small-1proc.json" 2>&1 | tail -4
  timeout 200 python3 benchmarks/bench_convergence.py --scape-fidelity --ranks 1 --jobs 9 --preset tiny --steps 1000 \
    --seeds 1337,1,2 --scape-recipes "$R" --out "${F}_scape-1000steps-1proc.json" 2>&1 | tail -4
}

giftcost() {
  log "giftcost: GIFT's transforms against the 1b step"
  timeout 300 python3 benchmarks/bench_comm.py gift-cost --preset 1b --batch 4 --out "$OUT/comm" 2>&1 | tail -20
}

finetune() {
  log "finetune: every method on a random 1b model saved as a Hugging Face directory, 50 steps"
  timeout 540 python3 benchmarks/bench_finetune.py --hf-preset 1b --steps 50 --batch-size 8 --seq-len 256 \
    --eval-examples 64 --out "$OUT/finetune/hf-1b" 2>&1 | tail -8
  rm -rf "$OUT/finetune/hf-1b/hf_model" "$OUT/finetune/hf-1b/runs"
}

lowmem() {
  log "lowmem: the 7b preset fine-tuned under memory budgets (the plan picked, allocator peak, tokens/s)"
  timeout 420 python3 benchmarks/bench_finetune.py --preset 7b --budgets ${LOWMEM_BUDGETS:-30GB 22GB 14.5GiB 13.8GiB} \
    --steps 12 --batch-size 1 --seq-len 1024 --eval-examples 16 --out "$OUT/finetune/budgets-7b" 2>&1 | tail -6
  rm -rf "$OUT/finetune/budgets-7b/runs"
}

convergence() {
  log "convergence: the memory-first recipes against full AdamW on 125m (2000 steps of training, then 500 of each)"
  local D="$OUT/finetune/lowmem-125m"
  timeout 300 python3 -m leantrain train --preset 125m --steps 2000 --data.batch-size 8 --data.seq-len 512 \
    --train.eval-every 0 --train.ckpt-every 2000 --train.sample-tokens 0 --train.progress false --out "$D/source" 2>&1 | tail -2
  timeout 900 python3 benchmarks/bench_finetune.py --lowmem --preset 125m --from "$D/source" --steps 500 --seeds 0 \
    --batch-size 8 --seq-len 512 --lr 6e-4 --lr-of chunkft4=1.5e-4 chunkft4-forge=1.5e-4 chunkft8-forge=1.5e-4 \
    --recipes ${CONV_RECIPES:-full forge-bf16 forge-int8-agoq forge-int8-ckpt chunkft4 chunkft4-forge chunkft8-forge} --out "$D" 2>&1 | tail -10
  rm -rf "$D/source" "$D/runs"
}

fsdp() { fsdp1b; fsdp8b; }

fsdp1b() {
  log "fsdp: the 1b preset under FSDP2 on one GPU (bf16 all-gathers), and with AGoQ, against the baseline"
  local F="--dist.mode fsdp --dist.param-dtype bf16 --train.weights fp32"
  timeout 420 python3 benchmarks/bench_step.py --preset 1b --batch 8 --steps 16 --rounds 1 --name fsdp-1gpu \
    --recipe "baseline=--baseline" --recipe "fsdp=$F" --recipe "fsdp_agoq=$F --agoq" --out "$OUT/step" 2>&1 | tail -6
}

fsdp8b() {
  local F="--dist.mode fsdp --dist.param-dtype bf16 --train.weights fp32"
  log "fsdp: the 8b preset under FSDP2 on one GPU with FORGE + AGoQ (fp32 shards and states: 96 GB, an H200's)"
  timeout 600 python3 benchmarks/bench_step.py --preset 8b --batch 1 --steps 6 --rounds 1 --name fsdp-8b-1gpu \
    --recipe "fsdp_forge_agoq=$F --forge --agoq" \
    --out "$OUT/step" 2>&1 | tail -6
}

speed() {
  log "speed: FORGE's small-batch step on 7b / 8b (32k vocabulary): bf16 / int8 / fp8 states, AGoQ, eager and graphed, against torch"
  timeout 1500 python3 benchmarks/bench_memory.py --presets 7b 8b --vocab 32000 --batches 1 2 4 --seqs 1024 \
    --configs ${SPEED_CONFIGS:-torch_bf16 torch_bf16_graph torch_fp32_master_autocast forge_bf16_states forge_int8_states \
    forge_fp8_states forge_fp8_states_graph forge_int8_states_agoq forge_fp8_states_agoq forge_fp8_states_agoq_graph} \
    --out "$OUT/memory" --name speed 2>&1 | tail -40
}

memory() {
  log "memory: the whole step of 7b / 8b (32k vocabulary, then 8b's own 128k) under every way to fit it"
  local sel="--batches 1 2 4 --largest"
  [ -n "$Q" ] && sel="--batches 1 --configs torch_bf16 torchtune_recipe forge_int8_states_agoq chunkft32_ckpt chunkft_fused_ckpt chunkft_fused64_ckpt"
  timeout 3600 python3 benchmarks/bench_memory.py --presets 7b 8b --vocab 32000 $sel --seqs 1024 \
    --out "$OUT/memory" 2>&1 | tail -40
  [ -n "$Q" ] && sel="--configs torch_bf16_ckpt torchtune_recipe chunkft_fused64_ckpt chunkft_fused128_ckpt chunkft_fused64_offload chunkft_fused128_offload"
  timeout 1800 python3 benchmarks/bench_memory.py --presets 8b --batches 2 --seqs 2048 ${Q:+$sel} --out "$OUT/memory" \
    --name memory-8b-128k 2>&1 | tail -20
  log "memory: where the small-batch step's time goes (7b, B = 1, profiled)"
  timeout 600 python3 benchmarks/bench_memory.py --presets 7b --batches 1 --configs torch_bf16 torch_fp32_master_autocast \
    forge_bf16_states forge_int8_states forge_fp8_states forge_int8_states_agoq forge_fp8_states_agoq --profile \
    --out "$OUT/memory" --name profile-7b 2>&1 | tail -12
}

scale() {
  [ "$NGPU" -ge 2 ] || { log "scale: skipped (one GPU)"; return; }
  log "scale: NCCL smoke test and the trainer on 2 GPUs against 1 at the same global batch"
  smoke=$(find tests -name torchrun_smoke.py | head -1)
  [ -n "$smoke" ] && timeout 300 torchrun --standalone --nproc-per-node 2 "$smoke" 2>&1 | tail -14
  A="--preset small --steps 30 --forge --agoq --train.eval-every 10 --train.log-every 5"
  timeout 300 torchrun --standalone --nproc-per-node 2 -m leantrain train $A --data.batch-size 8 --out "$OUT/scale/two" 2>&1 | tail -4
  timeout 300 python3 -m leantrain train $A --data.batch-size 16 --out "$OUT/scale/one" 2>&1 | tail -4
  log "scale: the cluster benchmark's grid over NCCL on $NGPU GPUs, 1b (cluster.py sweep --local)"
  warm 1b --data.batch-size 1 --data.max-corpus-mb 6  # (the ranks below read the tokenizer side by side)
  # (SIGINT: the sweep then ends its runs' process groups; a partial JSON still goes through `cluster.py report`)
  timeout -s INT 540 python3 benchmarks/cluster/cluster.py sweep --local --ranks-per-node "$NGPU" --steps 8 \
    --allow-busy --busy-wait 0 --out "$OUT/comm-cluster" -- --preset 1b --data.batch-size 4 --data.max-corpus-mb 6 \
    2>&1 | tail -14
}

{
  log "environment"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
  for s in $SECTIONS; do "$s"; done
  log "done"
} 2>&1 | tee "$OUT/run.log"

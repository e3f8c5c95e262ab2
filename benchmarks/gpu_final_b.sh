#!/usr/bin/env bash
# GPU part B: FORGE whole step (b), AGoQ on 1b, 125m AGoQ-vs-baseline 1000-step curves.
#   OUT=dir bash benchmarks/gpu_final_b.sh
set -u -o pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 LEANTRAIN_CACHE=/tmp/ltc
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT/b"
log() { echo "=== $(date +%T) $*"; }
{
  log "125m, 1000 steps: baseline vs agoq"
  timeout 330 python3 benchmarks/bench_convergence.py --preset 125m --steps 1000 --eval-every 100 \
    --recipes baseline,agoq --set data.max_corpus_mb=16 --out "$OUT/b/conv125m" 2>&1 | tail -6
  log "bench agoq (1b, B=8)"
  timeout 120 python3 benchmarks/bench_agoq.py --out "$OUT/b" 2>&1 | tail -4
  log "bench forge (b)"
  timeout 200 python3 benchmarks/bench_forge.py --part b --batches 1 4 16 --steps 4 --warmup 2 --timeout 60 --out "$OUT/b/forge_b" 2>&1 | tail -4
  log done
} 2>&1 | tee "$OUT/b/run.log"

#!/usr/bin/env bash
# GPU part B1: compiled tests of this session's new kernel paths, 125m baseline-vs-AGoQ 1000-step
# curves through the trainer, AGoQ on 1b (B=8).   OUT=dir bash benchmarks/gpu_final_b1.sh
set -u -o pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 LEANTRAIN_CACHE=/tmp/ltc
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT/b1"
log() { echo "=== $(date +%T) $*"; }
{
  log "GPU tests (compiled): nvfp4, FORGE kernel + non-fused-parameter kernel path, AGoQ unpack cache"
  LEANTRAIN_TEST_GPU=1 timeout 90 python3 -m pytest tests/ops/test_nvfp4_triton.py tests/forge/test_forge_kernel.py \
    tests/forge/test_forge_rest_kernel.py tests/agoq/test_agoq_unpack_cache.py -q -p no:cacheprovider -o addopts="" 2>&1 | tail -6
  for r in baseline agoq; do
    log "125m, 1000 steps: $r"
    flag=--baseline; [ $r = agoq ] && flag=--agoq
    timeout 170 python3 -m leantrain train --preset 125m --steps 1000 $flag --out /tmp/c125_$r \
      --data.max-corpus-mb 16 --train.eval-every 200 --train.ckpt-every 0 --train.sample-tokens 0 \
      --train.log-every 50 2>&1 | grep -v "^step" | tail -4
    mkdir -p "$OUT/b1/c125_$r"; cp /tmp/c125_$r/metrics.jsonl /tmp/c125_$r/summary.json /tmp/c125_$r/config.json "$OUT/b1/c125_$r/" 2>/dev/null
  done
  log "bench agoq (1b, B=8)"
  timeout 110 python3 benchmarks/bench_agoq.py --out "$OUT/b1" 2>&1 | tail -4
  log done
} 2>&1 | tee "$OUT/b1/run.log"

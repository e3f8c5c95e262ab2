#!/usr/bin/env bash
# GPU part A of a session's record run: compiled-kernel tests, ops bandwidth sweep, FORGE (a).
#   OUT=dir bash benchmarks/gpu_final_a.sh
set -u -o pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 LEANTRAIN_CACHE=/tmp/ltc
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT/a"
log() { echo "=== $(date +%T) $*"; }
{
  log env; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  log "GPU tests (compiled kernels): tests/ops tests/forge tests/agoq"
  LEANTRAIN_TEST_GPU=1 timeout 200 python3 -m pytest tests/ops tests/forge tests/agoq -q -p no:cacheprovider -o addopts="" 2>&1 | grep -v "^\.*$" | tail -30
  log "nvfp4 dequantize debug"; timeout 60 python3 benchmarks/.nvfp4_debug.py 2>&1 | tail -20
  log "bench ops 256,1024,2048 MiB"
  timeout 170 python3 benchmarks/bench_ops.py --sizes 256,1024,2048 --rep 100 --out "$OUT/a/ops.json" 2>&1 | tail -5
  log "bench forge (a)"
  timeout 140 python3 benchmarks/bench_forge.py --part a --timeout-a 130 --out "$OUT/a/forge_a" 2>&1 | tail -4
  log done
} 2>&1 | tee "$OUT/a/run.log"

#!/usr/bin/env bash
# Session 3 record run on one H200: compiled tests of the batched AGoQ path and the pairwise
# stochastic rounding, kernel bandwidth (256 MiB and 2 GiB), AGoQ on 1b (B = 8), step profiles,
# and the 125m AGoQ 1000-step curve (benchmarks/run_125m_agoq.sh).   OUT=dir bash benchmarks/gpu_final_s3.sh
set -u -o pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 LEANTRAIN_CACHE=/tmp/ltc
mkdir -p "$OUT/s3"
log() { echo "=== $(date +%T) $*"; }
{
  log env; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  log "GPU tests (compiled): tests/agoq, dequant-sum-requant"
  LEANTRAIN_TEST_GPU=1 timeout 70 python3 -m pytest tests/agoq tests/ops/test_reduce_bits_nvfp4.py -k "not nvfp4" \
    -q -p no:cacheprovider -o addopts="" 2>&1 | tail -3
  log "bench ops 256, 2048 MiB"
  timeout 110 python3 benchmarks/bench_ops.py --sizes 256,2048 --rep 60 --out "$OUT/s3/ops.json" 2>&1 | tail -3
  log "bench agoq (1b, B=8)"
  timeout 100 python3 benchmarks/bench_agoq.py --out "$OUT/s3" 2>&1 | tail -2
  for c in torch_bf16 agoq; do
    log "profile $c B=8 forward+backward"
    timeout 60 python3 benchmarks/profile_step.py --config $c --batch 8 --no-opt --out "$OUT/s3" 2>&1 | grep -v Warn | tail -1
  done
  log "125m, 1000 steps: agoq"
  bash benchmarks/run_125m_agoq.sh 0 "$OUT/s3/c125_agoq"
  log done
} 2>&1 | tee "$OUT/s3/run.log"

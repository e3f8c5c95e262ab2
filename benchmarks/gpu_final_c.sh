#!/usr/bin/env bash
# GPU part C: re-check of two fixed tests on compiled kernels; whole 1b step, FORGE bf16 (+SR, fp32
# states, split path) vs torch pure-bf16 AdamW(fused) at B = 1, 4, 16 (profile_step.py, median of 5).
set -u -o pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 LEANTRAIN_CACHE=/tmp/ltc
mkdir -p "$OUT/c"
{
  LEANTRAIN_TEST_GPU=1 timeout 60 python3 -m pytest tests/ops/test_nvfp4_triton.py tests/forge/test_forge_rest_kernel.py \
    -q -p no:cacheprovider -o addopts="" 2>&1 | tail -4
  for b in 16 4 1; do for c in torch_bf16 forge_bf16; do
    timeout 45 python3 benchmarks/profile_step.py --config $c --batch $b --out "$OUT/c" 2>&1 | grep -v -i warn | tail -1
  done; done
} 2>&1 | tee "$OUT/c/run.log"

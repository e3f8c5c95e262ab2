#!/usr/bin/env bash
# Session 4's GPU calls (each under the device tool's 600 s limit):
#   OUT=dir bash benchmarks/gpu_s4.sh fast   # FAST bits / tiles-per-program sweep, then the ops and AGoQ tests compiled
set -u -o pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 LEANTRAIN_CACHE=/tmp/ltc
PART=${1:-fast}
mkdir -p "$OUT/$PART"
log() { echo "=== $(date +%T) $*"; }
gputest() { LEANTRAIN_TEST_GPU=1 timeout "$1" python3 -m pytest -q -p no:cacheprovider -o addopts="" "${@:2}" 2>&1 | tail -15; }
{
  if [ "$PART" = fast ]; then
    log "tune fast"
    timeout 200 python3 benchmarks/tune_kernels.py --what fast --out "$OUT/fast" 2>&1 | grep -v Warn
    log "gpu tests: ops"
    gputest 200 tests/ops/test_quant.py tests/ops/test_multi.py tests/ops/test_reduce_bits_nvfp4.py tests/ops/test_fp8.py tests/ops/test_hadamard.py tests/ops/test_nvfp4_triton.py
    log "gpu tests: agoq"
    gputest 120 tests/agoq
  fi
  log done
} 2>&1 | tee "$OUT/$PART/run.log"

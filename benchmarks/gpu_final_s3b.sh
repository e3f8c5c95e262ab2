#!/usr/bin/env bash
# Session 3, part B: the 125m AGoQ 1000-step run with two more stochastic-rounding seeds
# (run-to-run spread of AGoQ's validation loss).   OUT=dir bash benchmarks/gpu_final_s3b.sh
set -u -o pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 LEANTRAIN_CACHE=/tmp/ltc
mkdir -p "$OUT/s3b"
log() { echo "=== $(date +%T) $*"; }
{
  for s in 1 2; do
    log "125m, 1000 steps: agoq seed $s"
    bash benchmarks/run_125m_agoq.sh $s "$OUT/s3b/c125_agoq_seed$s"
  done
  log done
} 2>&1 | tee "$OUT/s3b/run.log"

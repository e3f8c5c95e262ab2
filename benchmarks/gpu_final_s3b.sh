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
    timeout 165 python3 -m leantrain train --preset 125m --steps 1000 --agoq --agoq.seed $s --out /tmp/c125_agoq_s$s \
      --data.max-corpus-mb 16 --train.eval-every 200 --train.ckpt-every 0 --train.sample-tokens 0 \
      --train.log-every 50 2>&1 | grep -v "^step" | tail -2
    mkdir -p "$OUT/s3b/c125_agoq_seed$s"; cp /tmp/c125_agoq_s$s/metrics.jsonl "$OUT/s3b/c125_agoq_seed$s/" 2>/dev/null
  done
  log done
} 2>&1 | tee "$OUT/s3b/run.log"

#!/usr/bin/env bash
# The GPU measurements session 3 could not make (no device time left), in two calls of the
# device tool (each under its 600 s limit):
#   OUT=dir bash benchmarks/gpu_next.sh agoq    # AGoQ with the final code: bench, profile, 125m seeds 0-2
#   OUT=dir bash benchmarks/gpu_next.sh forge   # FORGE part (b): all six configurations, B = 1, 4, 16
set -u -o pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 LEANTRAIN_CACHE=/tmp/ltc
PART=${1:-agoq}
mkdir -p "$OUT/$PART"
log() { echo "=== $(date +%T) $*"; }
{
  if [ "$PART" = agoq ]; then
    log "bench agoq (1b, B=8)"
    timeout 100 python3 benchmarks/bench_agoq.py --out "$OUT/agoq" 2>&1 | tail -2
    for c in torch_bf16 agoq; do
      timeout 60 python3 benchmarks/profile_step.py --config $c --batch 8 --no-opt --out "$OUT/agoq" 2>&1 | grep -v Warn | tail -1
    done
    for s in 0 1; do
      log "125m, 1000 steps: agoq seed $s"
      bash benchmarks/run_125m_agoq.sh $s "$OUT/agoq/c125_agoq_seed$s"
    done
  else
    log "bench forge (b): six configurations, B = 1, 4, 16"
    timeout 560 python3 benchmarks/bench_forge.py --part b --batches 1 4 16 --timeout 60 --out "$OUT/forge" 2>&1 | tail -12
  fi
  log done
} 2>&1 | tee "$OUT/$PART/run.log"

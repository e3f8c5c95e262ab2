#!/usr/bin/env bash
# Session 7's GPU calls (each under the device tool's 600 s limit):
#   OUT=dir bash benchmarks/gpu_s7.sh replay   # AGoQ's replayed save path: bench_agoq twice (baseline, apply with replay,
#                                              # the context manager, apply without replay), a cProfile of the AGoQ
#                                              # forward + backward, and the AGoQ / multi tests compiled
set -u -o pipefail
PART=${1:-replay}
D=$OUT/$PART
mkdir -p "$D"
source "$(dirname "$0")/gpu_lib.sh"
agoqrun() {  # $1 name, $2 time limit
  log "bench agoq (1b, B=8, 16 steps) $1"
  mkdir -p "$D/agoq_$1"
  timeout "$2" python3 benchmarks/bench_agoq.py --steps 16 --out "$D/agoq_$1" 2>&1 | tail -1
}
{
  case "$PART" in
    replay)
      gpuinfo
      agoqrun run1 130
      agoqrun run2 130
      log "profile agoq B=8 forward+backward, cProfile"
      timeout 90 python3 benchmarks/profile_step.py --config agoq --batch 8 --no-opt --cprofile --out "$D" 2>&1 | grep -v Warn | tail -1
      log "gpu tests: agoq, multi"
      gputest 150 tests/agoq tests/ops/test_multi.py ;;
  esac
} 2>&1 | tee "$D/run.log"

#!/usr/bin/env bash
# Session 13's GPU calls (under the device tool's 600 s limit; one tarball comes back):
#   OUT=dir bash benchmarks/gpu_s13.sh first   # CUDA graphs: tests/test_graphs.py compiled (a replay equals the eager
#                                            # step, baseline and AGoQ); bench_agoq --graph three times (1b, B = 8):
#                                            # the step eager and captured as one graph, baseline and AGoQ
# Work goes to /tmp/s13w/PART; $OUT/PART.tgz is rewritten after each stage (what a time-out leaves comes back).
set -u -o pipefail
PART=${1:-first}
D=/tmp/s13w/$PART
mkdir -p "$D"
source "$(dirname "$0")/gpu_lib.sh"
snap() { tar czf "$OUT/$PART.tgz" -C /tmp/s13w "$PART"; }
{
  case "$PART" in
    first)
      gpuinfo
      log "gpu tests: graphs (compiled)"
      gputest 150 tests/test_graphs.py
      snap
      export FLAT=1
      for r in g1 g2 g3; do AGOQ_ARGS="--graph --variants=" agoqrun $r 120; snap; done ;;
    *) echo "unknown part $PART" ;;
  esac
} 2>&1 | tee "$D/log.txt"
snap

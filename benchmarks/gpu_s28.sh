#!/usr/bin/env bash
# The next session's GPU call (written in session 27, not yet run):
#   OUT=dir bash benchmarks/gpu_s28.sh first  # the graphed 1b step (bench_forge part (b), T = 1024, B = 1, 2) with and
#                                           # without every linear through the ws kernel, now that ws.auto_config
#                                           # picks its schedule per shape (session 26 measured one fixed schedule:
#                                           # slower than the split path); then the graphed-step test, whose last
#                                           # 2 cases s27 fourth/ did not reach
#   OUT=dir bash benchmarks/gpu_s28.sh second # bench_forge.py part (a), whose ws columns now run auto_config
# Work goes to /tmp/s28w/PART; $OUT/PART.tgz is rewritten after each stage (what a time-out leaves comes back).
set -u -o pipefail
source "$(dirname "$0")/gpu_lib.sh"
gpu_part /tmp/s28w "${1:-first}"
{
  case "$PART" in
    first)
      gpuinfo
      forgeb_ws
      log "graphed-step test"
      gputest 120 tests/test_graphs.py::test_graphed_forge_equals_eager_forge
      ;;
    second)  # the issue's part (a) file with the ws kernel under auto_config (its "ws" and "layer_ws" columns)
      gpuinfo
      log "bench_forge part (a)"
      timeout 330 python3 benchmarks/bench_forge.py --part a --out "$D/a" 2>&1 | grep -v Warn | tail -30
      ;;
  esac
} 2>&1 | tee "$D/log.txt"
snap

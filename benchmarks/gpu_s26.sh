#!/usr/bin/env bash
# Session 26's GPU calls:
#   OUT=dir bash benchmarks/gpu_s26.sh first  # the ws kernel's new options: EVICT (W / state evict-first), BN=256
#                                           # tiles with two MMA warp groups (a quarter fewer dY / X bytes a dW
#                                           # element), with STATE_TMA; MODE 1 and cuBLAS alone as the GEMM's
#                                           # share; a sweep on 2048x5632 and 32000x2048, then the bits
#   OUT=dir bash benchmarks/gpu_s26.sh second # STATE_TMA the default, device scalars: the tests, the 1b step as
#                                           # CUDA graphs (bench_forge part (b), B = 1, 2) with and without the ws
#                                           # kernel, a sweep of the state ring
#   OUT=dir bash benchmarks/gpu_s26.sh third  # the graphed-step test (second/ ran out of time before it), 128x256
#                                           # tiles with 8 update warps
# Work goes to /tmp/s26w/PART; $OUT/PART.tgz is rewritten after each stage (what a time-out leaves comes back).
set -u -o pipefail
source "$(dirname "$0")/gpu_lib.sh"
gpu_part /tmp/s26w "${1:-first}"
W256='"BN": 256, "MMA_WARPS": 8, "mma_regs": 168, "num_warps": 4, "SUB": 8'
{
  case "$PART" in
    first)
      gpuinfo
      log "ws sweep"
      tunews 240 sweep time --shapes 2048x5632,32000x2048 --tokens 512,2048 --configs \
        '{}' '{"STATE_TMA": 1, "SUB": 16}' '{"EVICT": 1}' '{"STATE_TMA": 1, "SUB": 16, "EVICT": 1}' \
        "{$W256, \"BT\": 64, \"STAGES\": 2}" "{$W256, \"BT\": 32, \"STAGES\": 3}" "{$W256, \"BT\": 32, \"STAGES\": 4}" \
        "{$W256, \"BT\": 32, \"STAGES\": 2, \"STATE_TMA\": 1}" "{$W256, \"BT\": 64, \"STAGES\": 2, \"EVICT\": 1}" \
        '{"MODE": 1}' "{$W256, \"BT\": 64, \"STAGES\": 2, \"MODE\": 1}"
      snap
      log "ws check (bits) of the new options"
      timeout 200 python3 benchmarks/tune_ws.py check --configs '{"EVICT": 1}' "{$W256, \"BT\": 64, \"STAGES\": 2}" \
        "{$W256, \"BT\": 32, \"STAGES\": 2, \"STATE_TMA\": 1}" > "$D/check.jsonl" 2> "$D/check.err"
      echo "rc=$?"; grep -c '"ok": true' "$D/check.jsonl"; grep '"ok": false\|check_failures' "$D/check.jsonl" | head; tail -3 "$D/check.err" ;;
    second)  # after first/: STATE_TMA the default, device scalars (CUDA graphs) in the ws kernel
      gpuinfo
      log "ws tests (pytest)"
      gputest 200 tests/forge/test_forge_ws.py
      snap
      forgeb_ws  # (gpu_lib.sh: the same two runs as written here when this ran)
      log "ws sweep (state ring variants)"
      tunews 100 sweep time --shapes 2048x5632,32000x2048 --tokens 512,2048 --configs \
        '{}' '{"STAGES": 2, "SSTAGES": 3}' '{"SUB": 8, "SSTAGES": 4}' '{"BT": 32, "STAGES": 4, "SSTAGES": 3}' ;;
    third)  # after second/ (its pytest stage ran out of time before the graphed-step test): that test, a sweep
      gpuinfo
      log "ws tests (pytest: the graphed step)"
      gputest 100 tests/test_graphs.py -k test_graphed_forge_equals_eager_forge
      snap
      log "ws sweep: 128x256 tiles with 8 update warps beside two MMA warp groups"
      W8='"BN": 256, "MMA_WARPS": 8, "num_warps": 8, "SUB": 8, "BT": 32, "STATE_TMA": 1, "mma_regs": 160'
      tunews 150 sweep time --shapes 2048x5632,32000x2048 --tokens 512,2048 --configs \
        '{}' "{$W8, \"STAGES\": 2}" "{$W8, \"STAGES\": 3, \"SSTAGES\": 1}" '{"BM": 64, "SSTAGES": 3}' \
        '{"MODE": 1}' "{$W8, \"STAGES\": 2, \"MODE\": 1}"
      snap
      ;;
  esac
} 2>&1 | tee "$D/log.txt"
snap

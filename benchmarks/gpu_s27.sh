#!/usr/bin/env bash
# Session 27's GPU calls:
#   OUT=dir bash benchmarks/gpu_s27.sh first  # where the ws kernel's time goes: the GEMM alone (probe mode 2) and
#                                           # the update alone (probe mode 3) beside the fused kernel, for 128x128
#                                           # tiles and 128x256 tiles (two MMA warp groups, 8 update warps);
#                                           # fewer programs than SMs (CTAS: the last wave's tail), 64-row tiles;
#                                           # the probes' test and the graphed-step test (s26 third/, not run)
#   OUT=dir bash benchmarks/gpu_s27.sh second # the kernel's clock stamps (tune_ws.py trace); the tail options on
#                                           # the four shapes at T = 512 / 1024 / 2048; the ws tests
#   OUT=dir bash benchmarks/gpu_s27.sh third  # deeper operand rings (a smaller state ring or plain state loads)
#   OUT=dir bash benchmarks/gpu_s27.sh fourth # auto_config on the four shapes, T = 512 ... 16384; the tests
#   OUT=dir bash benchmarks/gpu_s27.sh fifth  # state rings for 64-row tiles, evict-first with the deep ring
# Work goes to /tmp/s27w/PART; $OUT/PART.tgz is rewritten after each stage (what a time-out leaves comes back).
set -u -o pipefail
source "$(dirname "$0")/gpu_lib.sh"
gpu_part /tmp/s27w "${1:-first}"
W8='"BN": 256, "MMA_WARPS": 8, "num_warps": 8, "SUB": 8, "BT": 32, "STATE_TMA": 1, "mma_regs": 160, "STAGES": 2'
{
  case "$PART" in
    first)
      gpuinfo
      log "ws sweep: fused, the GEMM alone (2), the update alone (3); 128x128 and 128x256 tiles"
      tunews 260 sweep time --shapes 2048x5632,32000x2048 --tokens 512,2048 --configs \
        '{}' '{"MODE": 2}' '{"MODE": 3}' '{"MODE": 1}' "{$W8}" "{$W8, \"MODE\": 2}" "{$W8, \"MODE\": 3}" \
        '{"CTAS": 128}' '{"BALANCE": 1}' '{"CTAS": 88}' '{"BM": 64, "SSTAGES": 3}' '{"BM": 64, "MODE": 2}'
      snap
      log "ws tests (pytest: the probes, the graphed step)"
      gputest 150 tests/forge/test_forge_ws.py -k "probes or compiles or graphed_forge_equals" tests/test_graphs.py::test_graphed_forge_equals_eager_forge
      ;;
    second)  # after first/: the kernel's own clock stamps (where each program's time goes), then every
      # target shape at T = 512 / 1024 / 2048 for the tail options that first/ found faster, then the tests
      gpuinfo
      log "ws trace"
      tunews 90 trace trace --shapes 2048x5632,32000x2048 --tokens 512,2048 --configs \
        '{}' '{"BALANCE": 1}' '{"BM": 64}' '{"MODE": 2}'
      snap
      log "ws sweep: the four shapes"
      tunews 200 sweep time --shapes 2048x2048,2048x5632,5632x2048,32000x2048 \
        --tokens 512,1024,2048 --configs '{}' '{"BALANCE": 1}' '{"BM": 64}' '{"BM": 64, "BALANCE": 1}' \
        '{"BM": 64, "SSTAGES": 3}'
      snap
      log "ws tests (pytest)"
      gputest 200 tests/forge/test_forge_ws.py
      ;;
    third)  # after second/ (the GEMM beside the update takes 1.7-1.9x its time alone at T = 2048; fewer
      # operand stages were slower in s26 second/): deeper operand rings, paid for with a smaller state ring
      gpuinfo
      log "ws sweep: deeper operand rings"
      tunews 240 sweep time --shapes 2048x5632,5632x2048,32000x2048 --tokens 512,1024,2048 \
        --configs '{}' '{"STAGES": 4, "SUB": 8}' '{"STAGES": 4, "SSTAGES": 1}' '{"STATE_TMA": 0, "SUB": 32, "STAGES": 5}' \
        '{"BT": 32, "STAGES": 8, "SSTAGES": 1}' '{"STAGES": 4, "SUB": 8, "BALANCE": 1}' '{"BM": 64, "STAGES": 6}' \
        '{"BM": 64, "STAGES": 7, "SUB": 8}'
      snap
      log "ws trace"
      tunews 60 trace trace --shapes 2048x5632 --tokens 512,2048 --configs \
        '{"STAGES": 4, "SUB": 8}' '{"STATE_TMA": 0, "SUB": 32, "STAGES": 5}' '{"BM": 64, "STAGES": 7, "SUB": 8}'
      ;;
    fourth)  # after third/: launch_ws picks its schedule by shape (auto_config); every target shape and T
      gpuinfo
      log "ws sweep: auto_config against the default, the issue's shapes and token counts"
      tunews 240 sweep time --shapes 2048x2048,2048x5632,5632x2048,32000x2048 \
        --tokens 512,1024,2048,4096,16384 --configs auto '{}' '{"BT": 32, "STAGES": 8, "SSTAGES": 1, "BALANCE": 1}' \
        '{"BM": 64, "STAGES": 6, "BALANCE": 1}'
      snap
      log "ws tests (pytest) and the graphed step"
      gputest 240 tests/forge/test_forge_ws.py tests/test_graphs.py::test_graphed_forge_equals_eager_forge
      ;;
    fifth)  # after fourth/ (the last device minutes): state rings for 64-row tiles at T = 1024, evict-first
      # stores with the deep ring at T = 2048, and their bits
      gpuinfo
      log "ws sweep"
      C='{"BM": 64, "STAGES": 5, "SSTAGES": 3}|{"BM": 64, "STAGES": 6, "SUB": 8, "SSTAGES": 4}|{"BM": 64, "STAGES": 4, "SSTAGES": 4}|{"BT": 32, "STAGES": 8, "SSTAGES": 1, "EVICT": 1}'
      IFS='|' read -r -a CS <<< "$C"
      tunews 80 sweep time --shapes 2048x5632,5632x2048 --tokens 1024,2048 --configs auto "${CS[@]}"
      snap
      log "ws check (bits)"
      timeout 60 python3 benchmarks/tune_ws.py check --configs "${CS[@]}" > "$D/check.jsonl" 2> "$D/check.err"
      echo "rc=$?"; grep -c '"ok": true' "$D/check.jsonl"; grep '"ok": false\|check_failures' "$D/check.jsonl" | head
      ;;
  esac
} 2>&1 | tee "$D/log.txt"
snap

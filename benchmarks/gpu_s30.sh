#!/usr/bin/env bash
# Session 30's GPU calls:
#   OUT=dir bash benchmarks/gpu_s30.sh first  # FORGE's ws kernel with the grouped tile order (GROUP_M): its bits
#                                           # (pytest, tune_ws check), then torch / ws on the four shapes of the
#                                           # issue at T = 512 ... 2048 against auto_config's row-major order,
#                                           # and the kernel's clock stamps on 2048x5632; a probe: the update's
#                                           # sqrt / divisions approximate (APPROX), without their slow-path branches
#   OUT=dir bash benchmarks/gpu_s30.sh second # the tests of GROUP_M and fast_math (bits, tolerance against the exact
#                                           # kernels and torch), bench_forge.py part (a) with its fast_math columns,
#                                           # and tune_ws's sweep of auto_config (now grouped on 2048x5632 at T = 2048)
#                                           # with and without APPROX, a second time
#   OUT=dir bash benchmarks/gpu_s30.sh third  # IEEE_FAST (then the ws kernel's default; reverted in 391b907, so its
#                                           # tests and config no longer exist): the fast paths' bits against
#                                           # CUDA's IEEE division / sqrt, fused == dW + the exact update kernel, the
#                                           # tests of second/ again; tune_ws's sweep (IEEE_FAST against the branchy
#                                           # rule and APPROX); bench_forge.py part (a)
# Work goes to /tmp/s30w/PART; $OUT/PART.tgz is rewritten after each stage (what a time-out leaves comes back).
set -u -o pipefail
source "$(dirname "$0")/gpu_lib.sh"
gpu_part /tmp/s30w "${1:-first}"
{
  case "$PART" in
    first)
      gpuinfo
      log "pytest: the grouped order's bits, the compile test"
      gputest 150 tests/forge/test_forge_ws.py -k "grouped or compiles"
      snap
      log "tune_ws check: GROUP_M"
      tunews 60 check check --configs '{"GROUP_M": 8}' '{"DW16": 1, "BT": 32, "STAGES": 8, "SSTAGES": 2, "GROUP_M": 16}'
      snap
      # (APPROX: a probe, the rule's sqrt / divisions by the hardware's approximations, no slow-path branches)
      CS=(auto16 '{"AUTO": 16, "GROUP_M": 8}' '{"AUTO": 16, "GROUP_M": 16}' '{"AUTO": 16, "APPROX": 1}'
          '{"AUTO": 16, "GROUP_M": 16, "APPROX": 1}' auto '{"AUTO": 32, "GROUP_M": 8}')
      log "sweep: T <= 2048, row-major against grouped"
      tunews 300 sweep time --shapes 2048x5632,5632x2048,32000x2048,2048x2048 --tokens 512,1024,2048 \
        --configs "${CS[@]}"
      snap
      log "trace: 2048x5632"
      tunews 60 trace trace --shapes 2048x5632 --tokens 1024,2048 --configs auto16 '{"AUTO": 16, "GROUP_M": 16}' \
        '{"AUTO": 16, "APPROX": 1}'
      ;;
    second)
      gpuinfo
      log "pytest: GROUP_M and fast_math on the GPU"
      gputest 240 tests/forge/test_forge_ws.py tests/forge/test_forge_kernel.py \
        -k "grouped or fast_math or auto_config or compiles or fused_equals or matches_torch"
      snap
      log "bench_forge part (a), with ws_fast / ws16_fast"
      timeout 260 python3 benchmarks/bench_forge.py --part a --out "$D/a" 2>&1 | grep -v Warn | tail -40
      snap
      log "sweep: auto_config with and without APPROX"
      tunews 160 sweep time --shapes 2048x5632,5632x2048,32000x2048,2048x2048 --tokens 512,1024,2048 \
        --configs auto16 '{"AUTO": 16, "APPROX": 1}' auto '{"AUTO": 32, "APPROX": 1}'
      ;;
    third)
      gpuinfo
      log "pytest: IEEE_FAST's bits, GROUP_M, fast_math"
      gputest 200 tests/forge/test_forge_ws.py tests/forge/test_forge_kernel.py \
        -k "fast_paths or ieee_fast or grouped or fast_math or fused_equals"
      snap
      log "sweep: IEEE_FAST against the branchy rule (IEEE_FAST 0) and APPROX"
      tunews 170 sweep time --shapes 2048x5632,5632x2048,32000x2048,2048x2048 --tokens 512,1024,2048 \
        --configs auto16 '{"AUTO": 16, "IEEE_FAST": 0}' '{"AUTO": 16, "APPROX": 1}' auto '{"AUTO": 32, "IEEE_FAST": 0}'
      snap
      log "bench_forge part (a)"
      timeout 200 python3 benchmarks/bench_forge.py --part a --out "$D/a" 2>&1 | grep -v Warn | tail -30
      ;;
  esac
} 2>&1 | tee "$D/log.txt"
snap

#!/usr/bin/env bash
# The next session's GPU call (written in session 27, not yet run):
#   OUT=dir bash benchmarks/gpu_s28.sh first  # the graphed 1b step (bench_forge part (b), T = 1024, B = 1, 2) with and
#                                           # without every linear through the ws kernel, now that ws.auto_config
#                                           # picks its schedule per shape (session 26 measured one fixed schedule:
#                                           # slower than the split path); then the graphed-step test, whose last
#                                           # 2 cases s27 fourth/ did not reach
#   OUT=dir bash benchmarks/gpu_s28.sh second # bench_forge.py part (a), whose ws columns now run auto_config
#   OUT=dir bash benchmarks/gpu_s28.sh third  # the bf16 dW hand-over (DW16): its bits (pytest, tune_ws check), then
#                                           # its rings against auto (fp32 dW) on the four shapes, T = 512 ... 16384
#   OUT=dir bash benchmarks/gpu_s28.sh fourth # DW16's tests (bits, the optimizer's bf16 hand-over), auto16 (DEEP16 from
#                                           # T = 1024) against auto, and the graphed 1b step of session 21's FORGE
#                                           # configuration (bf16 dW, fused layout) with its linears on the split path or ws
#   OUT=dir bash benchmarks/gpu_s28.sh fifth  # bf16 W + SR and bf16 states (what fourth/'s step runs): auto16 against
#                                           # rings sized for the smaller state slices, on the 1b step's fused shapes
#   OUT=dir bash benchmarks/gpu_s28.sh sixth  # the tests of ws_tokens' routing (fp32 states only) and the graphed step
#   OUT=dir bash benchmarks/gpu_s28.sh seventh # bench_forge.py part (a) with its bf16-dW columns (split16, ws16)
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
    third)
      gpuinfo
      log "pytest: DW16 bits"
      gputest 150 tests/forge/test_forge_ws.py -k "other_read_schedules or bf16_dw_tile or compiles"
      snap
      log "tune_ws check: DW16"
      tunews 60 check check --configs '{"DW16": 1}' '{"DW16": 1, "BT": 32, "STAGES": 8, "SSTAGES": 2}'
      snap
      CS=('{"DW16": 1, "STAGES": 4}' '{"DW16": 1, "BT": 32, "STAGES": 8, "SSTAGES": 2}'
          '{"DW16": 1, "BT": 32, "STAGES": 10, "SSTAGES": 1}' '{"DW16": 1, "BM": 64, "STAGES": 6}'
          '{"DW16": 1, "BN": 256, "MMA_WARPS": 8, "mma_regs": 160, "BT": 32, "STAGES": 4, "SUB": 8, "SSTAGES": 2}')
      log "sweep: T <= 2048"
      tunews 200 sweep time --tokens 512,1024,2048 --configs auto auto16 "${CS[@]}"
      snap
      log "sweep: T = 4096, 16384"
      tunews 120 sweep_long time --tokens 4096,16384 --configs auto auto16 "${CS[@]}"
      snap
      log "trace: DW16 with the deep ring and a 2-slot state ring"
      tunews 40 trace trace --shapes 2048x5632 --tokens 512,2048 --configs auto auto16 "${CS[1]}"
      ;;
    fourth)
      gpuinfo
      log "pytest: DW16 bits, the optimizer's ws path with grad_dtype"
      gputest 120 tests/forge/test_forge_ws.py -k "bf16_dw or below_ws_tokens"
      snap
      log "sweep: auto16 (DEEP16 from T = 1024) against auto"
      tunews 100 sweep time --tokens 512,1024,2048 --configs auto auto16
      snap
      F=forge_bf16_sr_bf16_states_bf16_dw_fp_sw_graph
      LEANTRAIN_FORGE_WS_TOKENS=0 forgeb_cfg b_ws0 110 "1 2" torch_bf16_fp_sw_graph $F
      snap
      LEANTRAIN_FORGE_WS_TOKENS=4096 forgeb_cfg b_ws4096 70 "1 2" $F
      ;;
    fifth)
      gpuinfo
      log "sweep (bf16 W + SR, bf16 states): the 1b step's shapes (fused q/k/v and gate/up)"
      tunews 240 sweep16 time --dtype bf16 --shapes 2560x2048,2048x2048,11264x2048,2048x5632,32000x2048 \
        --tokens 1024,2048 --configs auto16 '{"DW16": 1, "BT": 32, "STAGES": 8, "SSTAGES": 4}' \
        '{"DW16": 1, "STAGES": 4, "SSTAGES": 4}' '{"DW16": 1, "BM": 64, "STAGES": 6, "SSTAGES": 4}' \
        '{"DW16": 1, "BT": 32, "STAGES": 10, "SSTAGES": 2}'
      ;;
    sixth)
      gpuinfo
      log "pytest: ws_tokens routing, the graphed step through ws"
      gputest 200 tests/forge/test_forge_ws.py tests/test_graphs.py -k "below_ws_tokens or graphed_forge_equals"
      ;;
    seventh)
      gpuinfo
      log "bench_forge part (a), with split16 / ws16"
      timeout 220 python3 benchmarks/bench_forge.py --part a --out "$D/a" 2>&1 | grep -v Warn | tail -40
      ;;
  esac
} 2>&1 | tee "$D/log.txt"
snap

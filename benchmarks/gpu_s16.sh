#!/usr/bin/env bash
# The next GPU calls (written in session 15, when no device time was left to run them):
#   OUT=dir bash benchmarks/gpu_s16.sh first   # FORGE kernel / rest / device-scalar / graph tests compiled (EARLY_LOADS
#                                            # bit for bit); tune_kernels forge_update16 with and without EARLY_LOADS for
#                                            # bf16 / fp32 states and fp32 W
#   OUT=dir bash benchmarks/gpu_s16.sh second  # part (b) graphed at B = 1, 4, 16: torch bf16, FORGE bf16 / int8 states,
#                                            # with and without LEANTRAIN_FORGE_EARLY_LOADS=1; the 1b trainer graphed
#   OUT=dir bash benchmarks/gpu_s16.sh third   # int8p (packed 8-bit states): FORGE / state tests compiled; the update
#                                            # kernel's int8 / int8p tiles (tune_kernels forge_int8)
#   OUT=dir bash benchmarks/gpu_s16.sh fourth  # int8p's cheaper absmax read: tests, tiles; part (b) at B = 1, 4, 16: torch bf16, FORGE bf16 (the new default tiles),
#                                            # int8, int8p, graphed and eager; the graphed step profiled at B = 1
#   OUT=dir bash benchmarks/gpu_s16.sh fifth   # int8p's store without block reductions, four warps: tests, tiles,
#                                            # part (b) int8 / int8p graphed at B = 1, 4, 16 and eager at 16
#   OUT=dir bash benchmarks/gpu_s16.sh sixth   # int8p back at two warps (fifth/'s sweep): its tests, part (b) graphed
#                                            # at B = 1, 4, 16 against torch bf16, eager at 16
# Work goes to /tmp/s16w/PART; $OUT/PART.tgz is rewritten after each stage (what a time-out leaves comes back).
set -u -o pipefail
source "$(dirname "$0")/gpu_lib.sh"
gpu_part /tmp/s16w "${1:-first}"
{
  case "$PART" in
    first)
      gpuinfo
      log "gpu tests: FORGE kernel, rest kernel, device scalars, graphs (compiled)"
      gputest 200 tests/forge/test_forge_kernel.py tests/forge/test_forge_rest_kernel.py \
        tests/forge/test_forge_device_scalars.py tests/test_graphs.py
      snap
      for prec in wbf16_sbf16 wbf16_sfp32 wfp32_sfp32; do
        log "tune forge_update16 $prec, each tile with and without EARLY_LOADS"
        TUNE_TAG=_$prec TUNE_UPDATE16_PREC=$prec TUNE_UPDATE16_EARLY=1 \
          TUNE_UPDATE16_TILES="16,128,8;32,64,8;32,128,16;16,64,4;64,64,8" \
          timeout 100 python3 benchmarks/tune_kernels.py --what forge_update16 --out "$D" 2>&1 | grep -v Warn | tail -1
        snap
      done ;;
    second)
      gpuinfo
      forgeb_cfg b_default 200 "1 4 16" torch_bf16_graph forge_bf16_sr_bf16_states_bf16_dw_graph \
        forge_bf16_sr_int8_states_graph
      snap
      LEANTRAIN_FORGE_EARLY_LOADS=1 forgeb_cfg b_early 150 "1 4 16" forge_bf16_sr_bf16_states_bf16_dw_graph \
        forge_bf16_sr_int8_states_graph
      snap
      train1b forge_graph --forge --train.cuda-graph true
      LEANTRAIN_FORGE_EARLY_LOADS=1 train1b forge_graph_early --forge --train.cuda-graph true
      snap ;;
    third)
      gpuinfo
      log "gpu tests: FORGE kernel, rest kernel, device scalars, torch backend, states, graphs (compiled)"
      gputest 240 tests/forge/test_forge_kernel.py tests/forge/test_forge_rest_kernel.py \
        tests/forge/test_forge_device_scalars.py tests/forge/test_forge_torch.py tests/forge/test_state.py tests/test_graphs.py
      snap
      log "tune forge_int8: int8 and int8p states"
      TUNE_INT8_KINDS=int8,int8p TUNE_INT8_TILES="16,64,2;16,64,4;32,64,4;16,128,4;32,64,2;16,128,8" \
        timeout 150 python3 benchmarks/tune_kernels.py --what forge_int8 --out "$D" 2>&1 | grep -v Warn | grep -v '"case"' | tail -3
      snap ;;
    fourth)
      gpuinfo
      log "gpu tests: int8p (compiled)"
      gputest 120 tests/forge/test_forge_kernel.py tests/forge/test_forge_rest_kernel.py \
        tests/forge/test_forge_device_scalars.py -k "int8p or packed"
      log "tune forge_int8: int8p states (the absmax read from 32 codes, not the tile)"
      TUNE_INT8_KINDS=int8p TUNE_INT8_TILES="16,64,2;16,64,4;32,64,4" \
        timeout 100 python3 benchmarks/tune_kernels.py --what forge_int8 --out "$D" 2>&1 | grep -v Warn | grep -v '"case"' | tail -3
      snap
      forgeb_cfg b_graph 300 "1 4 16" torch_bf16_graph forge_bf16_sr_bf16_states_bf16_dw_graph \
        forge_bf16_sr_int8_states_graph forge_bf16_sr_int8p_states_graph
      snap
      forgeb_cfg b_eager 150 "16" torch_bf16 forge_bf16_sr_bf16_states_bf16_dw forge_bf16_sr_int8_states \
        forge_bf16_sr_int8p_states
      snap
      prof forge_bf16_states_bf16_dw 1 --graph
      snap ;;
    fifth)
      gpuinfo
      log "gpu tests: FORGE kernel, rest kernel, device scalars, states, graphs (compiled; int8p's store mask)"
      gputest 200 tests/forge/test_forge_kernel.py tests/forge/test_forge_rest_kernel.py \
        tests/forge/test_forge_device_scalars.py tests/forge/test_state.py tests/test_graphs.py
      snap
      log "tune forge_int8: int8p"
      TUNE_INT8_KINDS=int8p TUNE_INT8_TILES="16,64,4;16,64,2;32,64,4;16,128,8" \
        timeout 100 python3 benchmarks/tune_kernels.py --what forge_int8 --out "$D" 2>&1 | grep -v Warn | grep -v '"case"' | tail -3
      snap
      forgeb_cfg b_graph 200 "1 4 16" torch_bf16_graph forge_bf16_sr_int8_states_graph forge_bf16_sr_int8p_states_graph
      snap
      forgeb_cfg b_eager 60 "16" forge_bf16_sr_int8p_states
      snap ;;
    sixth)
      gpuinfo
      log "gpu tests: int8p (compiled), the final kernel"
      gputest 120 tests/forge/test_forge_kernel.py tests/forge/test_forge_rest_kernel.py \
        tests/forge/test_forge_device_scalars.py -k "int8p or packed or heuristic"
      snap
      forgeb_cfg b_graph 150 "1 4 16" torch_bf16_graph forge_bf16_sr_int8p_states_graph
      snap
      forgeb_cfg b_eager 60 "16" forge_bf16_sr_int8p_states
      snap ;;
  esac
  log done
} 2>&1 | tee "$D/log.txt"
snap

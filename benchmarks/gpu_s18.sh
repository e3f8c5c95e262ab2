#!/usr/bin/env bash
# The next GPU call (written in session 17, when no device time was left to run it):
#   OUT=dir bash benchmarks/gpu_s18.sh first   # int8p's cheaper head-code arithmetic (session 17, SASS 214.8 -> 204.8
#                                            # instructions an element): the int8p / state / rest-kernel / graph tests
#                                            # compiled; the int8 / int8p update kernel's tiles (tune_kernels forge_int8);
#                                            # part (b) graphed at B = 1, 4, 16: torch bf16, FORGE int8, int8p
#   OUT=dir bash benchmarks/gpu_s18.sh second  # the fused dW + update kernel at 64 x 64 tiles with 2-4 programs an SM
#                                            # (register caps) and 64 x 32 / 32 x 32 tiles (4+ programs an SM, sass_count.py), against the split path
#   OUT=dir bash benchmarks/gpu_s18.sh third   # the split path's updates as programmatic dependent launches
#                                            # (LEANTRAIN_FORGE_PDL=1): tests, one linear, part (b) graphed. Ran at
#                                            # 497f38e; PDL was removed after it (no faster in the step)
#   OUT=dir bash benchmarks/gpu_s18.sh fourth  # the fused 64 x 64 tile's register cap (heuristic_config): kernel /
#                                            # loss / Llama tests compiled; fused with and without the cap, fp32 and
#                                            # bf16 W and states (tune forge_split); the 256 x 2048 layers fused
#   OUT=dir bash benchmarks/gpu_s18.sh fifth   # the host work before a replay cut (the next table made after the
#                                            # launch): graph / device-scalar / overlap tests; part (b) graphed
#   OUT=dir bash benchmarks/gpu_s18.sh sixth   # part (b) graphed at B = 1, 4: torch and FORGE alternately, three
#                                            # processes each (the gap against the calls' noise)
#   OUT=dir bash benchmarks/gpu_s18.sh seventh # what one update launch a layer costs in a graph (tune forge_group)
# Work goes to /tmp/s18w/PART; $OUT/PART.tgz is rewritten after each stage (what a time-out leaves comes back).
set -u -o pipefail
source "$(dirname "$0")/gpu_lib.sh"
gpu_part /tmp/s18w "${1:-first}"
{
  case "$PART" in
    first)
      gpuinfo
      log "gpu tests: FORGE kernel, rest kernel, device scalars, states, graphs (compiled)"
      gputest 220 tests/forge/test_forge_kernel.py tests/forge/test_forge_rest_kernel.py \
        tests/forge/test_forge_device_scalars.py tests/forge/test_state.py tests/test_graphs.py
      snap
      log "tune forge_int8: int8 and int8p"
      TUNE_INT8_KINDS=int8,int8p TUNE_INT8_TILES="16,64,2;16,64,4;32,64,4" \
        timeout 120 python3 benchmarks/tune_kernels.py --what forge_int8 --out "$D" 2>&1 | grep -v Warn | grep -v '"case"' | tail -3
      snap
      forgeb_cfg b_graph 260 "1 4 16" torch_bf16_graph forge_bf16_sr_int8_states_graph forge_bf16_sr_int8p_states_graph
      snap ;;
    second)
      gpuinfo
      log "tune forge (fused dW + update) at 2, 3, 4 programs an SM (sass_count.py forge --mode fused)"
      TUNE_FORGE_CASES="2048,5632,512;2048,5632,2048;5632,2048,1024;32000,2048,2048" \
        TUNE_FORGE_CFGS="64,64,64,4,3;64,64,32,4,2;64,64,64,4,3,168;64,64,32,4,2,168;64,64,32,4,2,128;32,64,64,4,3;64,32,64,4,3;64,32,32,4,4;64,32,64,4,4;64,32,128,4,2;32,32,64,4,3;32,32,64,2,3" \
        timeout 240 python3 benchmarks/tune_kernels.py --what forge --out "$D" 2>&1 | grep -v Warn | tail -3
      snap ;;
    third)
      gpuinfo
      log "gpu tests: the updates as programmatic dependent launches (compiled)"
      gputest 200 tests/forge/test_forge_pdl.py
      snap
      log "tune forge_split: bf16 dW split path, plain and PDL, do_bench and graph replays"
      TUNE_SPLIT_CFGS=none timeout 150 python3 benchmarks/tune_kernels.py --what forge_split --out "$D" 2>&1 \
        | grep -v Warn | tail -2 | cut -c1-400
      snap
      forgeb_cfg b_graph 200 "1 4 16" torch_bf16_graph forge_bf16_sr_bf16_states_bf16_dw_graph
      snap
      LEANTRAIN_FORGE_PDL=1 forgeb_cfg b_graph_pdl 120 "1 4 16" forge_bf16_sr_bf16_states_bf16_dw_graph
      snap
      LEANTRAIN_FORGE_PDL=1 forgeb_cfg b_eager_pdl 60 "16" forge_bf16_sr_bf16_states_bf16_dw
      snap ;;
    fourth)
      gpuinfo
      log "gpu tests: FORGE kernel (the fused tile's register cap), losses, Llama (compiled)"
      gputest 240 tests/forge/test_forge_kernel.py tests/test_losses.py tests/forge/test_forge_llama.py
      snap
      log "tune forge_split: the fused 64 x 64 tile with and without the register cap, fp32 and bf16 W / states"
      TUNE_SPLIT_CFGS="64,64,64,4,3;64,64,64,4,3,168;64,64,64,4,3,192" timeout 200 python3 benchmarks/tune_kernels.py \
        --what forge_split --out "$D" 2>&1 | grep -v Warn | tail -1 | cut -c1-300
      snap
      log "tune forge: the small layers (256 x 2048) fused against split"
      TUNE_FORGE_CASES="256,2048,1024;256,2048,4096;2048,2048,1024" TUNE_FORGE_CFGS="64,64,64,4,3;64,64,64,4,3,168" \
        timeout 100 python3 benchmarks/tune_kernels.py --what forge --out "$D" 2>&1 | grep -v Warn | tail -1 | cut -c1-300
      snap ;;
    fifth)
      gpuinfo
      log "gpu tests: graphs, device scalars, overlap (compiled; the next replay's table made after the launch)"
      gputest 200 tests/test_graphs.py tests/forge/test_forge_device_scalars.py tests/forge/test_forge_overlap.py
      snap
      forgeb_cfg b_graph 260 "1 4 16" torch_bf16_graph forge_bf16_sr_bf16_states_bf16_dw_graph forge_bf16_sr_int8p_states_graph
      snap ;;
    sixth)
      gpuinfo
      forgeb_cfg b_ab 330 "1 4" torch_bf16_graph forge_bf16_sr_bf16_states_bf16_dw_graph torch_bf16_graph \
        forge_bf16_sr_bf16_states_bf16_dw_graph torch_bf16_graph forge_bf16_sr_bf16_states_bf16_dw_graph
      snap ;;
    seventh)
      gpuinfo
      log "tune forge_group: the 1b layers' updates as one graph, one launch a layer / a block / three in all"
      timeout 150 python3 benchmarks/tune_kernels.py --what forge_group --out "$D" 2>&1 | grep -v Warn | tail -4
      snap ;;
  esac
  log done
} 2>&1 | tee "$D/log.txt"
snap

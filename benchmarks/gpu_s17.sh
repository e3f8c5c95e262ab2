#!/usr/bin/env bash
# Session 17's GPU calls:
#   OUT=dir bash benchmarks/gpu_s17.sh first   # the updates on a side stream (attach(overlap=True)): its tests and the
#                                            # graph / loss / grad-dtype tests compiled; part (b) graphed at B = 1, 4, 16:
#                                            # torch bf16, FORGE bf16 with and without overlap (LEANTRAIN_FORGE_OVERLAP=0)
#   OUT=dir bash benchmarks/gpu_s17.sh second  # overlap's tests (the stream checked); part (b) graphed at B = 1, 4: torch
#                                            # bf16, FORGE bf16 in line / overlap / overlap on a high-priority stream;
#                                            # eager at B = 16 in line and high-priority overlap
#   OUT=dir bash benchmarks/gpu_s17.sh third   # the update's loads evict-first and stores streaming (LEANTRAIN_FORGE_STREAM),
#                                            # graph prepare / advance split: FORGE tests compiled; part (b) graphed
#                                            # at B = 1, 4, 16 with and without the hints; eager B = 16 both ways
#   OUT=dir bash benchmarks/gpu_s17.sh fourth  # (the hints removed: no difference) the graphed step profiled, torch bf16
#                                            # and FORGE bf16, at B = 1 and 4
#   OUT=dir bash benchmarks/gpu_s17.sh fifth   # the final code's GPU tests (overlap, graphs, device scalars, losses, ...)
# Work goes to /tmp/s17w/PART; $OUT/PART.tgz is rewritten after each stage (what a time-out leaves comes back).
set -u -o pipefail
source "$(dirname "$0")/gpu_lib.sh"
gpu_part /tmp/s17w "${1:-first}"
{
  case "$PART" in
    first)
      gpuinfo
      log "gpu tests: overlap, graphs, losses, grad dtype, device scalars (compiled)"
      gputest 200 tests/forge/test_forge_overlap.py tests/test_graphs.py tests/test_losses.py \
        tests/forge/test_forge_grad_dtype.py tests/forge/test_forge_device_scalars.py
      snap
      forgeb_cfg b_graph 200 "1 4 16" torch_bf16_graph forge_bf16_sr_bf16_states_bf16_dw_graph
      snap
      LEANTRAIN_FORGE_OVERLAP=0 forgeb_cfg b_graph_inline 100 "1 4 16" forge_bf16_sr_bf16_states_bf16_dw_graph
      snap ;;
    second)
      gpuinfo
      log "gpu tests: overlap (the updates' stream checked)"
      gputest 100 tests/forge/test_forge_overlap.py
      snap
      forgeb_cfg b_graph 120 "1 4" torch_bf16_graph forge_bf16_sr_bf16_states_bf16_dw_graph
      snap
      LEANTRAIN_FORGE_OVERLAP=0 forgeb_cfg b_graph_inline 60 "1 4" forge_bf16_sr_bf16_states_bf16_dw_graph
      snap
      LEANTRAIN_FORGE_SIDE_PRIORITY=-1 forgeb_cfg b_graph_prio 60 "1 4" forge_bf16_sr_bf16_states_bf16_dw_graph
      snap
      LEANTRAIN_FORGE_OVERLAP=0 forgeb_cfg b_eager_inline 60 "16" forge_bf16_sr_bf16_states_bf16_dw
      snap
      LEANTRAIN_FORGE_SIDE_PRIORITY=-1 forgeb_cfg b_eager_prio 60 "16" forge_bf16_sr_bf16_states_bf16_dw
      snap ;;
    third)
      gpuinfo
      log "gpu tests: FORGE kernel (streaming loads / stores), overlap, device scalars, graphs, rest kernel (compiled)"
      gputest 220 tests/forge/test_forge_kernel.py tests/forge/test_forge_overlap.py \
        tests/forge/test_forge_device_scalars.py tests/test_graphs.py tests/forge/test_forge_rest_kernel.py
      snap
      forgeb_cfg b_graph 200 "1 4 16" torch_bf16_graph forge_bf16_sr_bf16_states_bf16_dw_graph
      snap
      LEANTRAIN_FORGE_STREAM=0 forgeb_cfg b_graph_nostream 100 "1 4 16" forge_bf16_sr_bf16_states_bf16_dw_graph
      snap
      forgeb_cfg b_eager 60 "16" forge_bf16_sr_bf16_states_bf16_dw
      LEANTRAIN_FORGE_STREAM=0 forgeb_cfg b_eager_nostream 60 "16" forge_bf16_sr_bf16_states_bf16_dw
      snap ;;
    fourth)
      gpuinfo
      for b in 1 4; do
        prof torch_bf16 $b --graph
        prof forge_bf16_states_bf16_dw $b --graph
        snap
      done ;;
    fifth)
      gpuinfo
      log "gpu tests of the final code: overlap, graphs, device scalars, losses, grad dtype, FORGE on the Llama (compiled)"
      gputest 300 tests/forge/test_forge_overlap.py tests/test_graphs.py tests/forge/test_forge_device_scalars.py \
        tests/test_losses.py tests/forge/test_forge_grad_dtype.py tests/forge/test_forge_llama.py
      snap ;;
  esac
  log done
} 2>&1 | tee "$D/log.txt"
snap

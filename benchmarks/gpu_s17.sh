#!/usr/bin/env bash
# Session 17's GPU calls:
#   OUT=dir bash benchmarks/gpu_s17.sh first   # the updates on a side stream (attach(overlap=True)): its tests and the
#                                            # graph / loss / grad-dtype tests compiled; part (b) graphed at B = 1, 4, 16:
#                                            # torch bf16, FORGE bf16 with and without overlap (LEANTRAIN_FORGE_OVERLAP=0)
#   OUT=dir bash benchmarks/gpu_s17.sh second  # part (b) eager at B = 1, 4, 16 with and without overlap; int8 / int8p
#                                            # graphed with overlap; the graphed step profiled at B = 1
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
      forgeb_cfg b_eager 200 "1 4 16" torch_bf16 forge_bf16_sr_bf16_states_bf16_dw
      snap
      LEANTRAIN_FORGE_OVERLAP=0 forgeb_cfg b_eager_inline 100 "1 4 16" forge_bf16_sr_bf16_states_bf16_dw
      snap
      forgeb_cfg b_graph8 200 "1 4 16" forge_bf16_sr_int8_states_graph forge_bf16_sr_int8p_states_graph
      snap
      prof forge_bf16_states_bf16_dw 1 --graph
      snap ;;
  esac
  log done
} 2>&1 | tee "$D/log.txt"
snap

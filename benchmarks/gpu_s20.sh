#!/usr/bin/env bash
# The next GPU call (written in session 19, when no device time was left to run it):
#   OUT=dir bash benchmarks/gpu_s20.sh first   # model.fused_proj (q/k/v and gate/up as one linear each):
#                                            # part (b) graphed at B = 1, 4: torch and FORGE, separate and fused
#                                            # projections, alternating twice; with model.fused_swiglu too;
#                                            # B = 16 once each
# Work goes to /tmp/s20w/PART; $OUT/PART.tgz is rewritten after each stage (what a time-out leaves comes back).
set -u -o pipefail
source "$(dirname "$0")/gpu_lib.sh"
gpu_part /tmp/s20w "${1:-first}"
{
  case "$PART" in
    first)
      gpuinfo
      log "gpu tests: the model, FORGE's Llama test, graphs (compiled)"
      gputest 120 tests/test_model.py tests/ops/test_swiglu.py tests/forge/test_forge_llama.py tests/test_graphs.py
      snap
      forgeb_cfg b_ab 250 "1 4" torch_bf16_graph forge_bf16_sr_bf16_states_bf16_dw_graph torch_bf16_fp_graph \
        forge_bf16_sr_bf16_states_bf16_dw_fp_graph torch_bf16_graph forge_bf16_sr_bf16_states_bf16_dw_graph \
        torch_bf16_fp_graph forge_bf16_sr_bf16_states_bf16_dw_fp_graph
      snap
      forgeb_cfg b_sw 120 "1 4" torch_bf16_fp_sw_graph forge_bf16_sr_bf16_states_bf16_dw_fp_sw_graph
      snap
      forgeb_cfg b16 90 "16" torch_bf16_graph forge_bf16_sr_bf16_states_bf16_dw_graph torch_bf16_fp_graph \
        forge_bf16_sr_bf16_states_bf16_dw_fp_graph
      snap ;;
  esac
  log done
} 2>&1 | tee "$D/log.txt"
snap

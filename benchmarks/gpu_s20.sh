#!/usr/bin/env bash
# The next GPU call (written in session 19, when no device time was left to run it):
#   OUT=dir bash benchmarks/gpu_s20.sh first   # model.fused_proj (q/k/v and gate/up as one linear each):
#                                            # part (b) graphed at B = 1, 4: torch and FORGE, separate and fused
#                                            # projections, alternating twice; with model.fused_swiglu too;
#                                            # B = 16 once each
#   OUT=dir bash benchmarks/gpu_s20.sh second  # model.fused_swiglu with separate and fused projections,
#                                            # B = 1, 4 alternating twice, B = 16; profiles at B = 4 (fp_sw)
#   OUT=dir bash benchmarks/gpu_s20.sh third   # the default layout: AGoQ / model / trainer / SwiGLU tests compiled;
#                                            # the 1b trainer: baseline, FORGE + AGoQ, FORGE int8 + AGoQ
#   OUT=dir bash benchmarks/gpu_s20.sh fourth  # attach(defer=True): its tests compiled; torch / FORGE / FORGE
#                                            # deferred, B = 1, 4 three rounds, B = 16; a profile at B = 4
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
    second)  # SwiGLU as one function with separate and fused projections, alternating; B = 16; where B = 4's gap is
      log "gpu tests: swiglu (compiled; the fp32 tolerance on CUDA)"
      gputest 60 tests/ops/test_swiglu.py
      snap
      forgeb_cfg b_sw 230 "1 4" torch_bf16_sw_graph forge_bf16_sr_bf16_states_bf16_dw_sw_graph torch_bf16_fp_sw_graph \
        forge_bf16_sr_bf16_states_bf16_dw_fp_sw_graph torch_bf16_sw_graph forge_bf16_sr_bf16_states_bf16_dw_sw_graph \
        torch_bf16_fp_sw_graph forge_bf16_sr_bf16_states_bf16_dw_fp_sw_graph
      snap
      forgeb_cfg b16_sw 90 "16" torch_bf16_sw_graph forge_bf16_sr_bf16_states_bf16_dw_sw_graph torch_bf16_fp_sw_graph \
        forge_bf16_sr_bf16_states_bf16_dw_fp_sw_graph
      snap
      prof torch_bf16_fp_sw 4 --graph
      prof forge_bf16_states_bf16_dw_fp_sw 4 --graph
      snap ;;
    third)  # the new default layout (fused projections and SwiGLU): compiled tests of what it touches; the 1b trainer
      log "gpu tests: AGoQ, the model, the trainer, SwiGLU (compiled, the default layout)"
      gputest 250 tests/ops/test_swiglu.py tests/test_model.py tests/agoq tests/test_trainer.py
      snap
      train1b_trio
      snap ;;
    fourth)  # attach(defer=True) (LEANTRAIN_FORGE_DEFER=1): the update after the kernels between two layers
      # (run at commit ce05bae: the option was removed after it; on later code d1-d3 run in line)
      log "gpu tests: deferred and side-stream updates (compiled)"
      gputest 100 tests/forge/test_forge_defer.py tests/forge/test_forge_overlap.py
      snap
      T=torch_bf16_fp_sw_graph F=forge_bf16_sr_bf16_states_bf16_dw_fp_sw_graph
      for r in 1 2 3; do
        forgeb_cfg "r$r" 90 "1 4" $T $F
        LEANTRAIN_FORGE_DEFER=1 forgeb_cfg "d$r" 60 "1 4" $F
        snap
      done
      forgeb_cfg r16 60 "16" $T $F
      LEANTRAIN_FORGE_DEFER=1 forgeb_cfg d16 40 "16" $F
      snap
      LEANTRAIN_FORGE_DEFER=1 prof forge_bf16_states_bf16_dw_fp_sw 4 --graph
      snap ;;
  esac
  log done
} 2>&1 | tee "$D/log.txt"
snap

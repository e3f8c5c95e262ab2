#!/usr/bin/env bash
# Session 21's GPU calls:
#   OUT=dir bash benchmarks/gpu_s21.sh first   # the rest buckets (step() steps the small 1-D non-fused parameters
#                                            # of a kind in one launch): their tests and the rest kernel's compiled;
#                                            # part (b) graphed, _fp_sw, B = 1, 4: torch, FORGE, FORGE with one
#                                            # launch a parameter (LEANTRAIN_FORGE_REST_BUCKETS=0), three rounds
#   OUT=dir bash benchmarks/gpu_s21.sh second  # B = 16 the same three; profiles of FORGE at B = 4 with and without
#   OUT=dir bash benchmarks/gpu_s21.sh third   # the 1b trainer graphed: baseline, --forge (fp32 / int8 / bf16 states)
#   OUT=dir bash benchmarks/gpu_s21.sh fourth  # update_many shared with lt.optim: compiled tests; trainer --agoq, --forge
#   OUT=dir bash benchmarks/gpu_s21.sh fifth   # the final code: tests/forge, graphs, optim, losses compiled
#   OUT=dir bash benchmarks/gpu_s21.sh sixth   # test_graphs.py compiled again after its fix
#   OUT=dir bash benchmarks/gpu_s21.sh seventh # param groups, frozen layers, unfused biases: compiled
# Work goes to /tmp/s21w/PART; $OUT/PART.tgz is rewritten after each stage (what a time-out leaves comes back).
set -u -o pipefail
source "$(dirname "$0")/gpu_lib.sh"
gpu_part /tmp/s21w "${1:-first}"
T=torch_bf16_fp_sw_graph F=forge_bf16_sr_bf16_states_bf16_dw_fp_sw_graph
{
  case "$PART" in
    first)
      gpuinfo
      log "gpu tests: rest buckets, rest kernel, device scalars, direct launches (compiled)"
      gputest 120 tests/forge/test_forge_rest_bucket.py tests/forge/test_forge_rest_kernel.py \
        tests/forge/test_forge_device_scalars.py tests/forge/test_forge_kernel.py -k "bucket or rest or device or direct"
      snap
      for r in 1 2 3; do
        forgeb_cfg "r$r" 90 "1 4" $T $F
        LEANTRAIN_FORGE_REST_BUCKETS=0 forgeb_cfg "n$r" 60 "1 4" $F
        snap
      done ;;
    second)
      forgeb_cfg r16 70 "16" $T $F
      LEANTRAIN_FORGE_REST_BUCKETS=0 forgeb_cfg n16 45 "16" $F
      snap
      LEANTRAIN_FORGE_REST_BUCKETS=0 prof forge_bf16_states_bf16_dw_fp_sw 4 --graph
      mv "$D/prof/profile_forge_bf16_states_bf16_dw_fp_sw_b4_graph.txt" "$D/prof/profile_forge_bf16_states_bf16_dw_fp_sw_b4_graph_nobucket.txt" 2>/dev/null
      prof forge_bf16_states_bf16_dw_fp_sw 4 --graph
      snap ;;
    third)  # the 1b trainer, B = 8, 16 steps, graphed (--train.cuda-graph true): baseline, --forge (its defaults:
      # bf16 + SR, fp32 states, est_global clip), --forge with int8 states, --forge with bf16 states
      train1b baseline_graph --baseline --train.cuda-graph true
      train1b forge_graph --forge --train.cuda-graph true
      snap
      train1b forge_int8_graph --forge --forge.state-dtype int8 --train.cuda-graph true
      train1b forge_bf16_graph --forge --forge.state-dtype bf16 --train.cuda-graph true
      snap ;;
    fourth)  # kernel.update_many shared by FORGE's step() and lt.optim.Optimizer: compiled tests; the trainer with
      # --agoq alone (lt.optim's kernel path: its norms now in one launch) and --forge, graphed
      gpuinfo
      log "gpu tests: rest buckets, rest kernel, lt.optim's kernel path (compiled)"
      gputest 150 tests/forge/test_forge_rest_bucket.py tests/forge/test_forge_rest_kernel.py tests/test_optim.py
      snap
      train1b agoq_graph --agoq --train.cuda-graph true
      train1b forge_graph --forge --train.cuda-graph true
      snap ;;
    fifth)  # the final code: FORGE's, the graphs', lt.optim's and the fused loss's tests compiled
      gpuinfo
      log "gpu tests: tests/forge, test_graphs, test_optim, test_losses (compiled)"
      gputest 520 tests/forge tests/test_graphs.py tests/test_optim.py tests/test_losses.py
      snap ;;
    sixth)  # after fifth: test_graphs' FORGE test named q_proj, which the default layout (fused q/k/v) lacks
      gputest 200 tests/test_graphs.py
      snap ;;
    seventh)  # attach(param_groups=...), frozen layers, unfused biases: compiled
      gputest 150 tests/forge/test_forge_kernel.py tests/forge/test_forge_torch.py -k "model_triton or param_groups or frozen or shared_bias or without_their"
      snap ;;
  esac
  log done
} 2>&1 | tee "$D/log.txt"
snap

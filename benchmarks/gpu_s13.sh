#!/usr/bin/env bash
# Session 13's GPU calls (under the device tool's 600 s limit; one tarball comes back):
#   OUT=dir bash benchmarks/gpu_s13.sh first   # CUDA graphs: tests/test_graphs.py compiled (a replay equals the eager
#                                            # step, baseline and AGoQ); bench_agoq --graph three times (1b, B = 8):
#                                            # the step eager and captured as one graph, baseline and AGoQ
#   OUT=dir bash benchmarks/gpu_s13.sh second  # the trainer with train.cuda_graph: tests/test_graphs.py compiled; 1b, B = 8,
#                                            # 16 steps: baseline and AGoQ, eager and graphed; bench_agoq --graph once
#                                            # (the graph's memory now counted without the eager steps' gradients)
#   OUT=dir bash benchmarks/gpu_s13.sh third   # lt.optim.Optimizer on FORGE's update-only kernel (optim.backend auto):
#                                            # tests/test_optim.py + test_graphs.py compiled; the 1b trainer, B = 8:
#                                            # AGoQ (kernel optimizer), AGoQ graphed, AGoQ with optim.backend torch
#                                            # (the op-by-op step), baseline, baseline graphed; bench_agoq --graph x2
#   OUT=dir bash benchmarks/gpu_s13.sh fourth  # the kernel step reads bf16 gradients as stored: test_optim, the FORGE kernel
#                                            # and update-only tests compiled; the 1b trainer: AGoQ, AGoQ graphed;
#                                            # bench_forge part (b) at B = 16: torch bf16, FORGE bf16 + SR with bf16
#                                            # states (torch's state precision) and with fp32 states, twice, alternating
#   OUT=dir bash benchmarks/gpu_s13.sh fifth   # FORGE grad_dtype="bf16" (the split path's dW in bf16): its tests and the
#                                            # FORGE kernel tests compiled; bench_forge part (b): torch bf16, FORGE bf16 +
#                                            # SR with bf16 states, with bf16 states and bf16 dW, at B = 16 twice, B = 1, 4
#                                            # once; the 1b trainer with FORGE + AGoQ, fp32 and bf16 dW
#   OUT=dir bash benchmarks/gpu_s13.sh sixth   # tests/test_graphs.py compiled (with the trainer's evaluation, checkpoints and
#                                            # resume between replays)
#   OUT=dir bash benchmarks/gpu_s13.sh seventh # each replay rounds with new noise (the salt XORed into AGoQ's keys in the
#                                            # graph): tests/test_graphs.py compiled; bench_agoq --graph once
#   OUT=dir bash benchmarks/gpu_s13.sh eighth  # the trainer without the per-step non-finite check (a sync): 1b, B = 8:
#                                            # baseline, AGoQ, AGoQ graphed, FORGE + AGoQ
# Work goes to /tmp/s13w/PART; $OUT/PART.tgz is rewritten after each stage (what a time-out leaves comes back).
set -u -o pipefail
PART=${1:-first}
D=/tmp/s13w/$PART
mkdir -p "$D"
source "$(dirname "$0")/gpu_lib.sh"
snap() { tar czf "$OUT/$PART.tgz" -C /tmp/s13w "$PART"; }
{
  case "$PART" in
    first)
      gpuinfo
      log "gpu tests: graphs (compiled)"
      gputest 150 tests/test_graphs.py
      snap
      export FLAT=1
      for r in g1 g2 g3; do AGOQ_ARGS="--graph --variants=" agoqrun $r 120; snap; done ;;
    second)
      gpuinfo
      log "gpu tests: graphs (compiled)"
      gputest 200 tests/test_graphs.py
      snap
      train1b baseline --baseline
      train1b baseline_graph --baseline --train.cuda-graph true
      snap
      train1b agoq --agoq
      train1b agoq_graph --agoq --train.cuda-graph true
      snap
      export FLAT=1
      AGOQ_ARGS="--graph --variants=" agoqrun g4 120 ;;
    third)
      gpuinfo
      log "gpu tests: optimizer kernel backend, graphs (compiled)"
      gputest 200 tests/test_optim.py tests/test_graphs.py
      snap
      train1b agoq --agoq
      train1b agoq_graph --agoq --train.cuda-graph true
      train1b agoq_torch_opt --agoq --optim.backend torch
      snap
      train1b baseline --baseline
      train1b baseline_graph --baseline --train.cuda-graph true
      snap
      export FLAT=1
      for r in g5 g6; do AGOQ_ARGS="--graph --variants=" agoqrun $r 120; snap; done ;;
    fourth)
      gpuinfo
      log "gpu tests: optimizer kernel backend, FORGE kernel and update-only kernel (compiled)"
      gputest 240 tests/test_optim.py tests/forge/test_forge_kernel.py tests/forge/test_forge_rest_kernel.py
      snap
      train1b agoq --agoq
      train1b agoq_graph --agoq --train.cuda-graph true
      snap
      for r in 1 2; do
        log "forge part (b), B = 16, run $r"
        timeout 200 python3 benchmarks/bench_forge.py --part b --batches 16 --timeout 60 --configs torch_bf16 \
          forge_bf16_sr_bf16_states forge_bf16_sr_fp32_states --out "$D/b16_$r" 2>&1 | grep -v Warn | tail -6
        snap
      done ;;
    fifth)
      gpuinfo
      log "gpu tests: FORGE grad_dtype, kernel (compiled)"
      gputest 200 tests/forge/test_forge_grad_dtype.py tests/forge/test_forge_kernel.py
      snap
      for r in 1 2; do
        log "forge part (b), B = 16, run $r"
        timeout 200 python3 benchmarks/bench_forge.py --part b --batches 16 --timeout 60 --configs torch_bf16 \
          forge_bf16_sr_bf16_states forge_bf16_sr_bf16_states_bf16_dw --out "$D/b16_$r" 2>&1 | grep -v Warn | tail -6
        snap
      done
      log "forge part (b), B = 1, 4"
      timeout 200 python3 benchmarks/bench_forge.py --part b --batches 1 4 --timeout 60 --configs torch_bf16 \
        forge_bf16_sr_bf16_states forge_bf16_sr_bf16_states_bf16_dw --out "$D/b14" 2>&1 | grep -v Warn | tail -9
      snap
      train1b forge_agoq --forge --agoq
      train1b forge_agoq_bf16dw --forge --agoq --forge.grad-dtype bf16 ;;
    sixth)
      gpuinfo
      log "gpu tests: graphs (compiled)"
      gputest 240 tests/test_graphs.py ;;
    seventh)
      gpuinfo
      log "gpu tests: graphs (compiled)"
      gputest 240 tests/test_graphs.py
      snap
      export FLAT=1
      AGOQ_ARGS="--graph --variants=" agoqrun g7 120 ;;
    eighth)
      gpuinfo
      train1b baseline --baseline
      train1b agoq --agoq
      snap
      train1b agoq_graph --agoq --train.cuda-graph true
      train1b forge_agoq --forge --agoq ;;
    *) echo "unknown part $PART" ;;
  esac
} 2>&1 | tee "$D/log.txt"
snap

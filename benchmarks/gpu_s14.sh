#!/usr/bin/env bash
# Session 14's GPU calls (under the device tool's 600 s limit; one tarball comes back):
#   OUT=dir bash benchmarks/gpu_s14.sh first   # FORGE captured in a CUDA graph (device scalars): tests/test_graphs.py,
#                                            # test_forge_device_scalars.py and the FORGE kernel tests compiled;
#                                            # bench_forge part (b) at B = 1 and 4: torch bf16 and FORGE bf16 + SR with
#                                            # bf16 states, each eager and graphed
#   OUT=dir bash benchmarks/gpu_s14.sh second  # the graphed-FORGE tests again (a test kept an eager graph alive); the 1b
#                                            # trainer, B = 8: baseline and FORGE, eager and graphed; bench_forge part (b)
#                                            # graphed: bf16 dW, int8 and fp32 states at B = 1, 4; B = 16: torch bf16 eager
#                                            # and graphed, FORGE bf16 states graphed (fp32 and bf16 dW)
#   OUT=dir bash benchmarks/gpu_s14.sh third   # the graphed-FORGE tests (the test now drops its eager loss); profile_step
#                                            # at B = 1, torch bf16 and FORGE (GPU time by kernel); the 1b trainer, B = 8:
#                                            # FORGE + AGoQ eager and graphed
#   OUT=dir bash benchmarks/gpu_s14.sh fourth  # the host's table upload vectorized: graphed-FORGE tests (fp32 weights, lr
#                                            # changed every step); bench_forge part (b) at B = 1, 4: torch bf16 eager and
#                                            # graphed, FORGE bf16 states graphed (fp32 / bf16 dW); at B = 16 twice; the
#                                            # 1b trainer with FORGE eager and graphed again
#   OUT=dir bash benchmarks/gpu_s14.sh fifth   # each FORGE launch's last program sums its tiles (no reduction launch a
#                                            # layer): FORGE kernel, clip, graph and optimizer tests compiled; part (b) at
#                                            # B = 1, 4, 16 eager / graphed; the 1b trainer: FORGE eager and graphed,
#                                            # FORGE + AGoQ graphed
#   OUT=dir bash benchmarks/gpu_s14.sh sixth   # activation checkpointing: bench_forge part (b) at B = 1, 4, 16: torch bf16
#                                            # without and with it, FORGE bf16 + SR (bf16 / int8 states) with it
# Work goes to /tmp/s14w/PART; $OUT/PART.tgz is rewritten after each stage (what a time-out leaves comes back).
set -u -o pipefail
PART=${1:-first}
D=/tmp/s14w/$PART
mkdir -p "$D"
source "$(dirname "$0")/gpu_lib.sh"
snap() { tar czf "$OUT/$PART.tgz" -C /tmp/s14w "$PART"; }
forgeb_cfg() {  # $1 name, $2 limit, $3 batches (quoted list), rest: configurations
  local name=$1 lim=$2 batches=$3
  shift 3
  log "forge part (b) $name: B = $batches: $*"
  timeout "$lim" python3 benchmarks/bench_forge.py --part b --batches $batches --timeout 70 --configs "$@" \
    --out "$D/$name" 2>&1 | grep -v Warn | tail -12
}
{
  case "$PART" in
    first)
      gpuinfo
      log "gpu tests: graphs with FORGE, device scalars, FORGE kernel (compiled)"
      gputest 240 tests/test_graphs.py tests/forge/test_forge_device_scalars.py tests/forge/test_forge_kernel.py
      snap
      forgeb_cfg b14 300 "1 4" torch_bf16 torch_bf16_graph forge_bf16_sr_bf16_states forge_bf16_sr_bf16_states_graph
      snap ;;
    second)
      gpuinfo
      log "gpu tests: graphed FORGE (compiled)"
      gputest 120 tests/test_graphs.py -k forge
      snap
      train1b baseline --baseline
      train1b baseline_graph --baseline --train.cuda-graph true
      train1b forge --forge
      train1b forge_graph --forge --train.cuda-graph true
      snap
      forgeb_cfg b14g 150 "1 4" forge_bf16_sr_bf16_states_bf16_dw_graph forge_bf16_sr_int8_states_graph \
        forge_bf16_sr_fp32_states_graph
      snap
      forgeb_cfg b16 150 16 torch_bf16 torch_bf16_graph forge_bf16_sr_bf16_states_graph \
        forge_bf16_sr_bf16_states_bf16_dw_graph
      snap ;;
    third)
      gpuinfo
      log "gpu tests: graphed FORGE (compiled)"
      gputest 120 tests/test_graphs.py -k forge
      snap
      for c in torch_bf16 forge_bf16; do
        log "profile $c B=1 (GPU time by kernel)"
        timeout 90 python3 benchmarks/profile_step.py --config $c --batch 1 --out "$D" 2>&1 | grep -v Warn | tail -1
      done
      snap
      train1b forge_agoq --forge --agoq
      train1b forge_agoq_graph --forge --agoq --train.cuda-graph true
      snap ;;
    fourth)
      gpuinfo
      log "gpu tests: graphed FORGE (compiled)"
      gputest 150 tests/test_graphs.py -k forge
      snap
      forgeb_cfg b14 150 "1 4" torch_bf16 torch_bf16_graph forge_bf16_sr_bf16_states_graph \
        forge_bf16_sr_bf16_states_bf16_dw_graph
      snap
      for r in 1 2; do
        forgeb_cfg b16_$r 120 16 torch_bf16 torch_bf16_graph forge_bf16_sr_bf16_states_bf16_dw_graph
        snap
      done
      train1b forge --forge
      train1b forge_graph --forge --train.cuda-graph true
      snap ;;
    fifth)
      gpuinfo
      log "gpu tests: FORGE kernel (its last program sums the tiles), rest kernel, clip, graphs, optimizer (compiled)"
      gputest 200 tests/forge/test_forge_kernel.py tests/forge/test_forge_rest_kernel.py tests/forge/test_forge_clip.py \
        tests/forge/test_forge_device_scalars.py tests/test_graphs.py tests/test_optim.py
      snap
      forgeb_cfg b14 140 "1 4" torch_bf16 torch_bf16_graph forge_bf16_sr_bf16_states_graph \
        forge_bf16_sr_bf16_states_bf16_dw_graph
      snap
      forgeb_cfg b16 90 16 torch_bf16 torch_bf16_graph forge_bf16_sr_bf16_states_bf16_dw_graph
      snap
      train1b forge --forge
      train1b forge_graph --forge --train.cuda-graph true
      train1b forge_agoq_graph --forge --agoq --train.cuda-graph true
      snap ;;
    sixth)
      gpuinfo
      forgeb_cfg ck 230 "1 4 16" torch_bf16 torch_bf16_ckpt forge_bf16_sr_bf16_states_ckpt \
        forge_bf16_sr_int8_states_ckpt
      snap ;;
    *) echo "unknown part $PART" ;;
  esac
} 2>&1 | tee "$D/log.txt"
snap

#!/usr/bin/env bash
# Session 6's GPU calls (each under the device tool's 600 s limit):
#   OUT=dir bash benchmarks/gpu_s6.sh explore  # tune_kernels --what s6 (state8 encode tiles, mixed-launch register cap /
#                                              # split launches of the multi-tensor quantize, FORGE chunked split path),
#                                              # then bench_agoq with the multi-tensor variants (env knobs)
#   OUT=dir bash benchmarks/gpu_s6.sh record   # record at the session's kernel code: bench_ops (256 MiB, 2 GiB), bench_agoq
#                                              # twice (16 steps each: the spread between runs), the changed kernels' tests
#   OUT=dir bash benchmarks/gpu_s6.sh host     # host time of the multi-tensor calls, launch tables from pageable vs
#                                              # page-locked memory; bench_agoq with each (host and final set
#                                              # LEANTRAIN_PINNED_TABLE, a knob removed after them: run them at b90e036)
#   OUT=dir bash benchmarks/gpu_s6.sh final    # page-locked tables by default: host probe, bench_ops, bench_agoq twice each with
#                                              # and without split launches + register cap, compiled tests
#   OUT=dir bash benchmarks/gpu_s6.sh gcprobe  # bench_agoq with the forward's host time per step, with and without
#                                              # Python's garbage collector in the timed steps
#   OUT=dir bash benchmarks/gpu_s6.sh last     # record at the session's last code: bench_ops (with each call's GPU time)
#                                              # and bench_agoq
#   OUT=dir bash benchmarks/gpu_s6.sh forge    # bench_forge part (b): the six configurations at B = 1, 4, 16
set -u -o pipefail
PART=${1:-explore}
D=$OUT/$PART
mkdir -p "$D"
source "$(dirname "$0")/gpu_lib.sh"
agoqvar() { agoqrun "$@"; }  # (gpu_lib.sh)
{
  case "$PART" in
    explore)
      gpuinfo
      log "tune s6"
      timeout 230 python3 benchmarks/tune_kernels.py --what s6 --out "$D" 2>&1 | grep -v Warn
      agoqvar default 85 LEANTRAIN_Q_MAXNREG=0
      agoqvar maxnreg128 85 LEANTRAIN_Q_MAXNREG=128
      agoqvar split 85 LEANTRAIN_Q_SPLIT=1 ;;
    record)
      gpuinfo
      opsbench 110
      agoqvar run1 85 LEANTRAIN_Q_MAXNREG=0
      agoqvar run2 85 LEANTRAIN_Q_MAXNREG=0
      log "gpu tests: state8, multi (both launch modes), kernel paths, forge optimizer"
      gputest 150 tests/ops/test_state8.py tests/ops/test_multi.py tests/ops/test_kernel_paths.py tests/forge
      log "gpu tests: multi with the split launches"
      LEANTRAIN_Q_SPLIT=1 LEANTRAIN_Q_MAXNREG=128 gputest 60 tests/ops/test_multi.py ;;
    host)
      gpuinfo
      log "tune host"
      timeout 120 python3 benchmarks/tune_kernels.py --what host --out "$D" 2>&1 | grep -v Warn
      agoqvar pageable 85 LEANTRAIN_PINNED_TABLE=0
      agoqvar pinned1 85 LEANTRAIN_PINNED_TABLE=1
      agoqvar pinned2 85 LEANTRAIN_PINNED_TABLE=1 ;;
    final)
      gpuinfo
      log "tune host"
      timeout 100 python3 benchmarks/tune_kernels.py --what host --out "$D" 2>&1 | grep -v Warn | head -12
      opsbench 110
      agoqvar pinned_a 85 LEANTRAIN_PINNED_TABLE=1
      agoqvar split_cap_a 85 LEANTRAIN_Q_SPLIT=1 LEANTRAIN_Q_MAXNREG=128
      agoqvar pinned_b 85 LEANTRAIN_PINNED_TABLE=1
      agoqvar split_cap_b 85 LEANTRAIN_Q_SPLIT=1 LEANTRAIN_Q_MAXNREG=128
      log "gpu tests: multi, state8, agoq"
      gputest 130 tests/ops/test_multi.py tests/ops/test_state8.py tests/agoq ;;
    gcprobe)
      gpuinfo
      agoqvar plain 85 LEANTRAIN_Q_MAXNREG=0
      AGOQ_ARGS=--gc-off agoqvar gcoff_a 85 LEANTRAIN_Q_MAXNREG=0
      AGOQ_ARGS=--gc-off agoqvar gcoff_b 85 LEANTRAIN_Q_MAXNREG=0 ;;
    last)
      gpuinfo
      opsbench 170
      agoqvar last 85 LEANTRAIN_Q_MAXNREG=0 ;;
    forge)
      gpuinfo
      log "bench forge part b"
      timeout 570 python3 benchmarks/bench_forge.py --part b --batches 1 4 16 --timeout 45 --out "$D" 2>&1 | grep -v Warn ;;
  esac
  log done
} 2>&1 | tee "$D/run.log"

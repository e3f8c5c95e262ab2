#!/usr/bin/env bash
# Session 7's GPU calls (each under the device tool's 600 s limit):
#   OUT=dir bash benchmarks/gpu_s7.sh replay   # AGoQ's replayed save path: bench_agoq twice (baseline, apply with replay,
#                                              # the context manager, apply without replay), a cProfile of the AGoQ
#                                              # forward + backward, and the AGoQ / multi tests compiled
#   OUT=dir bash benchmarks/gpu_s7.sh flat     # + flat batch buffers: the host-time variants (agoq_host_gpu.py),
#                                              # bench_agoq twice as is and twice with the split quantize launches,
#                                              # the AGoQ / multi tests compiled
#   OUT=dir bash benchmarks/gpu_s7.sh record   # the session's last code: bench_agoq four times (the first also as a
#                                              # context manager and without replay), the host-time variants, the
#                                              # CUDA-time profile, the AGoQ / multi / kernel-path tests compiled
#   OUT=dir bash benchmarks/gpu_s7.sh final    # + exp / log inside the kernels for the log-softmax: bench_agoq three
#                                              # times, the CUDA-time profile, the AGoQ / quant / multi tests compiled
#   OUT=dir bash benchmarks/gpu_s7.sh launches # split quantize launches by default: bench_agoq with each launch knob
#                                              # (dequantize split by width and dtype, register cap, no split), the
#                                              # CUDA-time profile of an AGoQ step, the multi tests compiled
set -u -o pipefail
PART=${1:-replay}
D=$OUT/$PART
mkdir -p "$D"
source "$(dirname "$0")/gpu_lib.sh"
{
  case "$PART" in
    replay)
      gpuinfo
      agoqrun run1 130
      agoqrun run2 130
      log "profile agoq B=8 forward+backward, cProfile"
      timeout 90 python3 benchmarks/profile_step.py --config agoq --batch 8 --no-opt --cprofile --out "$D" 2>&1 | grep -v Warn | tail -1
      log "gpu tests: agoq, multi"
      gputest 150 tests/agoq tests/ops/test_multi.py ;;
    flat)
      gpuinfo
      log "agoq host variants"
      timeout 100 python3 benchmarks/agoq_host_gpu.py --out "$D" 2>&1 | grep -v Warn
      AGOQ_ARGS="--variants noreplay" agoqrun run1 100
      AGOQ_ARGS="--variants=" agoqrun split1 80 LEANTRAIN_Q_SPLIT=1
      AGOQ_ARGS="--variants=" agoqrun run2 80
      AGOQ_ARGS="--variants=" agoqrun split2 80 LEANTRAIN_Q_SPLIT=1
      log "gpu tests: agoq, multi"
      gputest 150 tests/agoq tests/ops/test_multi.py ;;
    launches)
      gpuinfo
      AGOQ_ARGS="--variants=" agoqrun split_a 80
      AGOQ_ARGS="--variants=" agoqrun dqsplit_a 80 LEANTRAIN_DQ_SPLIT=1
      AGOQ_ARGS="--variants=" agoqrun cap128 80 LEANTRAIN_Q_MAXNREG=128
      AGOQ_ARGS="--variants=" agoqrun nosplit 80 LEANTRAIN_Q_SPLIT=0
      AGOQ_ARGS="--variants=" agoqrun split_b 80
      AGOQ_ARGS="--variants=" agoqrun dqsplit_b 80 LEANTRAIN_DQ_SPLIT=1
      log "profile agoq B=8 forward+backward"
      timeout 90 python3 benchmarks/profile_step.py --config agoq --batch 8 --no-opt --out "$D" 2>&1 | grep -v Warn | tail -1
      log "gpu tests: multi"
      gputest 100 tests/ops/test_multi.py ;;
    record)
      gpuinfo
      export FLAT=1
      AGOQ_ARGS="--variants ctx,noreplay" agoqrun r1 110
      AGOQ_ARGS="--variants=" agoqrun r2 80
      AGOQ_ARGS="--variants=" agoqrun r3 80
      AGOQ_ARGS="--variants=" agoqrun r4 80
      log "agoq host variants"
      timeout 100 python3 benchmarks/agoq_host_gpu.py --out "$D" 2>&1 | grep -v Warn
      log "profile agoq B=8 forward+backward"
      timeout 90 python3 benchmarks/profile_step.py --config agoq --batch 8 --no-opt --out "$D" 2>&1 | grep -v Warn | tail -1
      log "gpu tests: agoq, multi, kernel paths"
      gputest 200 tests/agoq tests/ops/test_multi.py tests/ops/test_kernel_paths.py ;;
    final)
      gpuinfo
      export FLAT=1
      AGOQ_ARGS="--variants=" agoqrun f1 80
      AGOQ_ARGS="--variants=" agoqrun f2 80
      AGOQ_ARGS="--variants=" agoqrun f3 80
      log "profile agoq B=8 forward+backward"
      timeout 90 python3 benchmarks/profile_step.py --config agoq --batch 8 --no-opt --out "$D" 2>&1 | grep -v Warn | tail -1
      log "gpu tests: agoq, quant, multi"
      gputest 200 tests/agoq tests/ops/test_quant.py tests/ops/test_multi.py ;;
  esac
} 2>&1 | tee "$D/run.log"

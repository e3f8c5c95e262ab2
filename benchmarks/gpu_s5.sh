#!/usr/bin/env bash
# Session 5's GPU calls (each under the device tool's 600 s limit):
#   OUT=dir bash benchmarks/gpu_s5.sh explore  # FAST bits 8/16 + tile sweeps (tune_kernels --what fast2), the ops
#                                              # and AGoQ tests compiled, bench_agoq
#   OUT=dir bash benchmarks/gpu_s5.sh final    # record: bench_agoq, profiles, bench_ops (256 MiB, 2 GiB), the rest of
#                                              # the compiled tests, a cProfile of the AGoQ step
#   OUT=dir bash benchmarks/gpu_s5.sh multi    # multi-tensor quantize with sizes hinted %16: tiles, clean-tile branch;
#                                              # then bench_agoq, profiles, bench_ops, its tests compiled
#   OUT=dir bash benchmarks/gpu_s5.sh record   # record at the session's last kernel code: bench_agoq, profiles, bench_ops,
#                                              # the changed kernels' tests compiled, 125m AGoQ 1000 steps (seed 0)
#   OUT=dir bash benchmarks/gpu_s5.sh forge    # bench_forge part (b): the six configurations at B = 1, 4, 16
set -u -o pipefail
PART=${1:-explore}
D=$OUT/$PART
mkdir -p "$D"
source "$(dirname "$0")/gpu_lib.sh"
{
  case "$PART" in
    explore)
      gpuinfo
      log "tune fast2"
      timeout 200 python3 benchmarks/tune_kernels.py --what fast2 --out "$D" 2>&1 | grep -v Warn
      log "gpu tests: ops, agoq"
      gputest 260 tests/ops tests/agoq
      agoqbench 130 ;;
    final)
      gpuinfo
      agoqbench 150
      profiles
      opsbench 120
      log "gpu tests: the part the explore run's time limit cut (agoq, multi, reduce, rng, state8)"
      gputest 150 tests/agoq tests/ops/test_multi.py tests/ops/test_reduce_bits_nvfp4.py tests/ops/test_rng_sr.py \
        tests/ops/test_state8.py tests/ops/test_kernel_paths.py
      log "cProfile of the AGoQ step"
      timeout 80 python3 benchmarks/profile_step.py --config agoq --batch 8 --no-opt --cprofile --out "$D/cprof" 2>&1 \
        | grep -v Warn | tail -1 ;;
    multi)
      gpuinfo
      log "tune multi"
      timeout 150 python3 benchmarks/tune_kernels.py --what multi --out "$D" 2>&1 | grep -v Warn
      agoqbench 150
      profiles
      opsbench 120
      log "gpu tests: multi, kernel paths, agoq batch"
      gputest 100 tests/ops/test_multi.py tests/ops/test_kernel_paths.py tests/agoq/test_agoq_batch.py ;;
    record)
      gpuinfo
      agoqbench 120
      profiles
      opsbench 100
      log "gpu tests: quant, multi, kernel paths, agoq"
      gputest 170 tests/ops/test_quant.py tests/ops/test_multi.py tests/ops/test_kernel_paths.py tests/agoq
      log "125m, 1000 steps: agoq seed 0"
      bash benchmarks/run_125m_agoq.sh 0 "$D/c125_agoq_seed0" ;;
    forge)
      gpuinfo
      log "bench forge part b"
      timeout 560 python3 benchmarks/bench_forge.py --part b --batches 1 4 16 --timeout 60 --out "$D" 2>&1 | tail -12 ;;
  esac
  log done
} 2>&1 | tee "$D/run.log"

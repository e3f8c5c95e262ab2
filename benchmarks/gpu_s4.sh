#!/usr/bin/env bash
# Session 4's GPU calls (each under the device tool's 600 s limit):
#   OUT=dir bash benchmarks/gpu_s4.sh fast   # FAST bits / tiles-per-program sweep, then the ops and AGoQ tests compiled
#   OUT=dir bash benchmarks/gpu_s4.sh words  # + the 32-bit word path: tests, sweep, bench_ops, bench_agoq, profiles
#   OUT=dir bash benchmarks/gpu_s4.sh tune2  # tiles of the word path, TPP pairs, cProfile of the AGoQ step
#   OUT=dir bash benchmarks/gpu_s4.sh host   # one launch per flush (dtypes mixed), one allocation per call: bench + profiles
#   OUT=dir bash benchmarks/gpu_s4.sh final  # record: bench_ops, bench_agoq (persistent apply + per-step context), profiles, 125m seeds 0-1
set -u -o pipefail
PART=${1:-fast}
D=$OUT/$PART
mkdir -p "$D"
source "$(dirname "$0")/gpu_lib.sh"
tune() { log "tune fast"; timeout 200 python3 benchmarks/tune_kernels.py --what fast --out "$D" 2>&1 | grep -v Warn; }
benches() {  # bench_ops (256 MiB, 2 GiB), bench_agoq (1b, B = 8), profiles
  opsbench 110
  agoqbench 150
  profiles "$@"
}
{
  case "$PART" in
    fast)
      tune
      log "gpu tests: ops"
      gputest 200 tests/ops/test_quant.py tests/ops/test_multi.py tests/ops/test_reduce_bits_nvfp4.py tests/ops/test_fp8.py \
        tests/ops/test_hadamard.py tests/ops/test_nvfp4_triton.py
      log "gpu tests: agoq"
      gputest 120 tests/agoq ;;
    words)
      log "gpu tests: word paths, multi, agoq"
      gputest 100 tests/ops/test_quant.py -k "word or bit_exact or extreme" tests/ops/test_multi.py tests/agoq
      tune
      benches ;;
    tune2)
      log "gpu tests: word paths, multi"
      gputest 100 tests/ops/test_quant.py -k "word or bit_exact" tests/ops/test_multi.py
      tune
      log "profile agoq B=8 with cProfile"
      timeout 90 python3 benchmarks/profile_step.py --config agoq --batch 8 --no-opt --cprofile --out "$D" 2>&1 | grep -v Warn | tail -1 ;;
    host)
      log "gpu tests: multi, agoq batch"
      gputest 100 tests/ops/test_multi.py tests/agoq/test_agoq_batch.py
      benches --cprofile ;;
    final)
      log env; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      log "gpu tests: dequant-sum-requant"
      gputest 60 tests/ops/test_reduce_bits_nvfp4.py  # (the record run had -k "not nvfp4" here: it selected nothing)
      benches
      for s in 0 1; do
        log "125m, 1000 steps: agoq seed $s"
        bash benchmarks/run_125m_agoq.sh $s "$D/c125_agoq_seed$s"
      done ;;
  esac
  log done
} 2>&1 | tee "$D/run.log"

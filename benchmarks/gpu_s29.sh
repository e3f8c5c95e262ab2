#!/usr/bin/env bash
# Session 29's GPU call:
#   OUT=dir bash benchmarks/gpu_s29.sh first  # the ops codecs' new options on the compiled kernels (NVFP4: stochastic
#                                           # rounding, scales rounded up, NaN blocks; FP8: NaN groups), bit for bit
#                                           # against torch; then GIFT's compute on the 1b preset (bench_gift_cost.py)
#   OUT=dir bash benchmarks/gpu_s29.sh second # after first/: GIFT's statistics and transforms in TF32, the transforms
#                                           # in three passes, the eigen-solves batched over a root's layers
#                                           # (CholeskyQR2): its GPU tests, then bench_gift_cost.py again
#   OUT=dir bash benchmarks/gpu_s29.sh third  # after second/: transforms back in fp32 with their thin products split by
#                                           # hand, the random columns drawn on the device, Rayleigh-Ritz on the CPU
#   OUT=dir bash benchmarks/gpu_s29.sh fourth # the final code (third/'s hand split removed: slower): GIFT's GPU tests,
#                                           # bench_gift_cost.py at B = 4 and 16
#   OUT=dir bash benchmarks/gpu_s29.sh fifth  # NVFP4 with one fp32 scale per 4096 elements (one pass; GIFT's messages):
#                                           # the NVFP4 kernels' tests, GIFT's GPU tests, bench_gift_cost.py at B = 4
#   OUT=dir bash benchmarks/gpu_s29.sh sixth  # the same after fifth/: one division a block (a reciprocal) in the NVFP4
#                                           # encode, the stochastic interval's width exact, the one-word hash
#   OUT=dir bash benchmarks/gpu_s29.sh seventh # bench_gift_cost.py (B = 4) with the codecs timed by CUDA events
#   OUT=dir bash benchmarks/gpu_s29.sh eighth # bench_gift_cost.py (B = 4) at rank 32 and 16: what a lower rank saves
#   OUT=dir bash benchmarks/gpu_s29.sh ninth  # after the review (coefficients cached, _tf32 simplified): GIFT's GPU
#                                           # tests and bench_gift_cost.py (B = 4)
# Work goes to /tmp/s29w/PART; $OUT/PART.tgz is rewritten after each stage (what a time-out leaves comes back).
set -u -o pipefail
source "$(dirname "$0")/gpu_lib.sh"
gpu_part /tmp/s29w "${1:-first}"
giftcost() {  # bench_gift_cost.py on the 1b preset, T = 1024: $1 time limit, $2 batch, $3 output folder, $4 rank (64)
  log "bench_gift_cost: 1b, B = $2, T = 1024, rank ${4:-64}"
  timeout "$1" python3 benchmarks/bench_gift_cost.py --preset 1b --batch "$2" --seq 1024 --rank "${4:-64}" --out "$3" \
    2>&1 | grep -v Warn | tail -40
}
{
  case "$PART" in
    first)
      gpuinfo
      log "pytest: the NVFP4 and FP8 kernels against torch"
      gputest 240 tests/ops/test_nvfp4_triton.py tests/ops/test_fp8.py
      snap
      giftcost 300 4 "$D"
      ;;
    fifth|sixth)
      gpuinfo
      log "pytest: the NVFP4 kernels against torch, GIFT on CUDA"
      gputest 200 tests/ops/test_nvfp4_triton.py tests/comm/test_gift_gpu.py
      snap
      giftcost 200 4 "$D"
      ;;
    ninth)
      gpuinfo
      log "pytest: GIFT on CUDA"
      gputest 120 tests/comm/test_gift_gpu.py
      snap
      giftcost 200 4 "$D"
      ;;
    eighth)
      gpuinfo
      for r in 32 16; do
        giftcost 200 4 "$D/rank$r" $r
        snap
      done
      ;;
    seventh)
      gpuinfo
      giftcost 200 4 "$D"
      ;;
    fourth)
      gpuinfo
      log "pytest: GIFT on CUDA"
      gputest 120 tests/comm/test_gift_gpu.py
      snap
      for b in 4 16; do
        giftcost 200 $b "$D/b$b"
        snap
      done
      ;;
    second|third)
      gpuinfo
      log "pytest: GIFT on CUDA"
      gputest 120 tests/comm/test_gift_gpu.py
      snap
      giftcost 300 4 "$D"
      ;;
  esac
} 2>&1 | tee "$D/log.txt"
snap

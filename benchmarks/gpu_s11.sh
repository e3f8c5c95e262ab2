#!/usr/bin/env bash
# Session 11's GPU calls (under the device tool's 600 s limit; one tarball comes back):
#   OUT=dir bash benchmarks/gpu_s11.sh main    # RMSNorm as one function (ops/norm.py, ModelConfig.fused_norm): its tests
#                                            # compiled, with the model's, AGoQ's save path and the fused loss's;
#                                            # bench_norm (1b shape: ours, op by op, F.rms_norm); bench_agoq twice,
#                                            # and once with fused_norm=false (the same host); FORGE part (b)
#   OUT=dir bash benchmarks/gpu_s11.sh second  # the norm's kernels on 2-D tiles, RoPE as one function (ops/rope.py): the
#                                            # tests compiled; bench_norm (norm and RoPE) at 8192 and 65536 tokens;
#                                            # bench_agoq three times, once with both fusions off; the 1b trainer,
#                                            # 16 steps: baseline, FORGE + AGoQ, FORGE int8 + AGoQ
#   OUT=dir bash benchmarks/gpu_s11.sh third   # AGoQ's dequantize groups bounded on their own (Policy.unpack_mib): bench_agoq
#                                            # at batch_mib 128 (the default), 512, 1024; FORGE part (b), final model
#   OUT=dir bash benchmarks/gpu_s11.sh final   # the final code (batch_mib 512): its new GPU tests; bench_agoq three
#                                            # times; the 1b trainer: baseline, FORGE + AGoQ, FORGE int8 + AGoQ;
#                                            # FORGE part (b)
# Work goes to /tmp/s11w/PART; $OUT/PART.tgz is rewritten after each stage (what a time-out leaves comes back).
set -u -o pipefail
PART=${1:-main}
D=/tmp/s11w/$PART
mkdir -p "$D"
source "$(dirname "$0")/gpu_lib.sh"
snap() { tar czf "$OUT/$PART.tgz" -C /tmp/s11w "$PART"; }
{
  case "$PART" in
    main)
      gpuinfo
      log "gpu tests: the norm, the model, AGoQ's save path, the fused loss"
      gputest 130 tests/ops/test_norm.py tests/test_model.py tests/agoq/test_agoq_hooks.py tests/test_losses.py
      snap
      log "bench_norm (1b shape, bf16)"
      timeout 60 python3 benchmarks/bench_norm.py --out "$D" 2>&1 | grep -v Warn | tail -5
      snap
      export FLAT=1
      AGOQ_ARGS="--variants=" agoqrun norm1 70
      AGOQ_ARGS="--variants= --model fused_norm=false" agoqrun plainnorm 70
      AGOQ_ARGS="--variants=" agoqrun norm2 70
      snap
      forgeb 200 ;;
    second)
      gpuinfo
      log "gpu tests: the norm, RoPE, the model, AGoQ's save path, the fused loss"
      gputest 130 tests/ops/test_norm.py tests/ops/test_rope.py tests/test_model.py tests/agoq/test_agoq_hooks.py \
        tests/test_losses.py
      snap
      for n in 8192 65536; do
        log "bench_norm (1b shapes, bf16, $n tokens)"
        timeout 60 python3 benchmarks/bench_norm.py --tokens $n --out "$D" 2>&1 | grep -v Warn | tail -6
      done
      snap
      export FLAT=1
      AGOQ_ARGS="--variants=" agoqrun fused1 70
      AGOQ_ARGS="--variants= --model fused_norm=false --model fused_rope=false" agoqrun plain 70
      AGOQ_ARGS="--variants=" agoqrun fused2 70
      snap
      train1b_trio ;;
    third)
      gpuinfo
      export FLAT=1
      AGOQ_ARGS="--variants=" agoqrun b128 70
      AGOQ_ARGS="--variants= --policy batch_mib=512" agoqrun b512 70
      AGOQ_ARGS="--variants= --policy batch_mib=1024" agoqrun b1024 70
      AGOQ_ARGS="--variants= --policy batch_mib=512" agoqrun b512_2 70
      snap
      forgeb 200 ;;
    final)
      gpuinfo
      log "gpu tests: AGoQ's batches (bounded unpack), the norm, RoPE (compiled)"
      gputest 90 tests/agoq/test_agoq_batch.py tests/ops/test_norm.py tests/ops/test_rope.py
      snap
      export FLAT=1
      for r in final1 final2 final3; do AGOQ_ARGS="--variants=" agoqrun $r 60; done
      snap
      train1b_trio
      snap
      forgeb 230 ;;
  esac
} 2>&1 | tee "$D/run.log"
snap

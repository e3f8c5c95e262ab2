#!/usr/bin/env bash
# Session 12's GPU calls (under the device tool's 600 s limit; one tarball comes back):
#   OUT=dir bash benchmarks/gpu_s12.sh first   # session 11's unverified commits compiled (norm / RoPE / AGoQ batch /
#                                            # model tests); the CUDA-time profile of the 1b step, torch bf16 and
#                                            # AGoQ (where AGoQ's time goes); bench_agoq twice; one forward's host time
#   OUT=dir bash benchmarks/gpu_s12.sh trace   # trace_step.py: the GPU's idle gaps in one step, torch bf16 and AGoQ (and
#                                            # AGoQ's Chrome trace); profile_step --cprofile of AGoQ (host time by function)
#   OUT=dir bash benchmarks/gpu_s12.sh second  # derived saves cached, per-path batches: their tests compiled; trace_step
#                                            # (torch, AGoQ at batch_mib 512 and 1024); bench_agoq at 512 twice, 1024
#                                            # once; one forward's host time
#   OUT=dir bash benchmarks/gpu_s12.sh third   # the two batches flushed by their total waiting bytes (the fullest one):
#                                            # bench_agoq at batch_mib 512 and 1024, twice each, alternating; trace_step;
#                                            # one forward's host time with its cProfile
#   OUT=dir bash benchmarks/gpu_s12.sh fourth  # bench_agoq with the back-to-back timing: batch_mib 512 twice, 1024 once
#   OUT=dir bash benchmarks/gpu_s12.sh fifth   # Python's garbage collector: trace_step with its collections counted (torch,
#                                            # AGoQ, AGoQ after gc.freeze); bench_agoq with and without --gc-off, --gc-freeze
#   OUT=dir bash benchmarks/gpu_s12.sh sixth   # flush_host_gpu.py: one batch flush's host time, GPU idle and busy
#   OUT=dir bash benchmarks/gpu_s12.sh seventh # FlatLayout (a batch's buffer laid out as saves come): its tests compiled; one
#                                            # forward's host time, this code and the previous commit's (benchmarks/
#                                            # _old_tree.tgz, made by git archive, not committed) alternating (that half
#                                            # failed: the archived script had no --quick); bench_agoq x2
#   OUT=dir bash benchmarks/gpu_s12.sh eighth  # the trainer without a sync per step: 1b, B = 8, 16 steps: baseline, AGoQ,
#                                            # FORGE + AGoQ; AGoQ with the previous commit's trainer (benchmarks/_old_tree.tgz,
#                                            # git archive HEAD~1 src, not committed)
# Work goes to /tmp/s12w/PART; $OUT/PART.tgz is rewritten after each stage (what a time-out leaves comes back).
set -u -o pipefail
PART=${1:-first}
D=/tmp/s12w/$PART
mkdir -p "$D"
source "$(dirname "$0")/gpu_lib.sh"
snap() { tar czf "$OUT/$PART.tgz" -C /tmp/s12w "$PART"; }
traces() {  # trace_step: torch bf16, AGoQ, AGoQ at batch_mib 1024
  for c in torch_bf16 agoq; do
    log "trace $c"
    timeout 90 python3 benchmarks/trace_step.py --config $c --out "$D" 2>&1 | grep -v Warn | tail -1
  done
  log "trace agoq, batch_mib 1024"
  timeout 90 python3 benchmarks/trace_step.py --config agoq --policy batch_mib=1024 --out "$D/b1024" 2>&1 | tail -1
}
{
  case "$PART" in
    first)
      gpuinfo
      log "gpu tests: norm, RoPE, AGoQ batches, the model (compiled)"
      gputest 150 tests/ops/test_norm.py tests/ops/test_rope.py tests/agoq/test_agoq_batch.py tests/test_model.py
      snap
      profiles
      snap
      export FLAT=1
      for r in a1 a2; do AGOQ_ARGS="--variants=" agoqrun $r 60; done
      snap
      log "one forward's host time"
      timeout 90 python3 benchmarks/agoq_host_gpu.py --out "$D" 2>&1 | grep -v Warn | tail -12 ;;
    trace)
      gpuinfo
      for c in torch_bf16 agoq; do
        log "trace $c"
        timeout 90 python3 benchmarks/trace_step.py --config $c --chrome --out "$D" 2>&1 | grep -v Warn | tail -2
        snap
      done
      log "trace agoq, batch_mib 1024"
      timeout 90 python3 benchmarks/trace_step.py --config agoq --policy batch_mib=1024 --out "$D/b1024" 2>&1 \
        | grep -v Warn | tail -2
      snap
      profiles --cprofile ;;
    second)
      gpuinfo
      log "gpu tests: AGoQ batches, derived saves (compiled)"
      gputest 100 tests/agoq/test_agoq_batch.py tests/agoq/test_agoq_derive.py
      snap
      traces
      snap
      export FLAT=1
      for r in a1 a2; do AGOQ_ARGS="--variants=" agoqrun $r 60; done
      AGOQ_ARGS="--variants= --policy batch_mib=1024" agoqrun b1024 60
      snap
      log "one forward's host time"
      timeout 90 python3 benchmarks/agoq_host_gpu.py --out "$D" 2>&1 | grep -v Warn | tail -12 ;;
    third)
      gpuinfo
      log "gpu tests: AGoQ batches (compiled)"
      gputest 60 tests/agoq/test_agoq_batch.py
      snap
      export FLAT=1
      for r in 1 2; do
        AGOQ_ARGS="--variants=" agoqrun b512_$r 60
        AGOQ_ARGS="--variants= --policy batch_mib=1024" agoqrun b1024_$r 60
      done
      snap
      traces
      snap
      log "one forward's host time"
      timeout 120 python3 benchmarks/agoq_host_gpu.py --cprofile --out "$D" 2>&1 | grep -v Warn | tail -12 ;;
    fourth)
      gpuinfo
      export FLAT=1
      AGOQ_ARGS="--variants=" agoqrun b512_1 70
      AGOQ_ARGS="--variants= --policy batch_mib=1024" agoqrun b1024_1 70
      AGOQ_ARGS="--variants=" agoqrun b512_2 70 ;;
    fifth)
      gpuinfo
      for c in torch_bf16 agoq; do
        log "trace $c"
        timeout 90 python3 benchmarks/trace_step.py --config $c --out "$D" 2>&1 | grep -v Warn | tail -1
      done
      log "trace agoq, gc.freeze() after the warm-up"
      timeout 90 python3 benchmarks/trace_step.py --config agoq --gc-freeze --out "$D/freeze" 2>&1 | tail -1
      snap
      export FLAT=1
      AGOQ_ARGS="--variants=" agoqrun gc_on_1 70
      AGOQ_ARGS="--variants= --gc-off" agoqrun gc_off_1 70
      AGOQ_ARGS="--variants= --gc-freeze" agoqrun gc_freeze_1 70
      AGOQ_ARGS="--variants= --gc-off" agoqrun gc_off_2 70
      AGOQ_ARGS="--variants=" agoqrun gc_on_2 70 ;;
    sixth)
      gpuinfo
      log "one flush's host time"
      timeout 100 python3 benchmarks/flush_host_gpu.py --out "$D" 2>&1 | grep -v Warn | tail -5 ;;
    seventh)
      gpuinfo
      log "gpu tests: flat buffers, AGoQ batches (compiled)"
      gputest 90 tests/ops/test_multi.py tests/agoq/test_agoq_batch.py -k "flat or batch"
      snap
      OLD=/tmp/s12old; mkdir -p $OLD && tar xzf benchmarks/_old_tree.tgz -C $OLD
      for r in 1 2; do
        log "host time, this code ($r)"
        timeout 70 python3 benchmarks/agoq_host_gpu.py --quick --out "$D/host_new_$r" 2>&1 | grep -v Warn | tail -3
        log "host time, the previous commit ($r)"
        (cd $OLD && PYTHONPATH=$OLD/src timeout 70 python3 benchmarks/agoq_host_gpu.py --quick --out "$D/host_old_$r" 2>&1 \
          | grep -v Warn | tail -3)
      done
      snap
      export FLAT=1
      for r in 1 2; do AGOQ_ARGS="--variants=" agoqrun new_$r 70; done ;;
    eighth)
      gpuinfo
      OLD=/tmp/s12old; mkdir -p $OLD && tar xzf benchmarks/_old_tree.tgz -C $OLD
      train1b agoq --agoq
      PYTHONPATH=$OLD/src train1b agoq_old_trainer --agoq
      snap
      train1b baseline --baseline
      train1b forge_agoq --forge --agoq ;;
  esac
} 2>&1 | tee "$D/run.log"
snap

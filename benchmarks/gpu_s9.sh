#!/usr/bin/env bash
# Session 9's GPU call (under the device tool's 600 s limit; one tarball comes back):
#   OUT=dir bash benchmarks/gpu_s9.sh main  # FORGE's clip scale in one launch (gradsums.py) and the chunked
#                                           # loss (model.loss_chunk): the clip tests compiled; profile_step
#                                           # agoq_forge B = 8 with clip est_global and none; the 1b preset
#                                           # through the trainer (baseline, FORGE + AGoQ, FORGE int8 + AGoQ);
#                                           # bench_agoq three times and once with loss_chunk=0 (the one-piece loss)
#   OUT=dir bash benchmarks/gpu_s9.sh third   # the loss's chunks back to split-like (one concatenation): 125m AGoQ,
#                                           # 1000 steps, seeds 0 and 1 and with the one-piece loss (is the gap to
#                                           # the baseline seen in 'second' noise?); the 1b trainer, 16 steps:
#                                           # FORGE + AGoQ and FORGE int8 + AGoQ (step logs kept)
#   OUT=dir bash benchmarks/gpu_s9.sh fourth  # the clip kernel's per-launch ints no longer specialized (no compile
#                                           # at step 2): its tests compiled, then the 1b trainer, 16 steps, every
#                                           # step logged: baseline, FORGE + AGoQ, FORGE int8 + AGoQ
#   OUT=dir bash benchmarks/gpu_s9.sh fifth   # what sets AGoQ's peak: bench_agoq with loss_chunk 512 and 256, with
#                                           # policy batch_mib 256, and both (512 + 256)
#   OUT=dir bash benchmarks/gpu_s9.sh second  # the loss's chunk gradients written into one buffer as they come:
#                                           # bench_agoq three times, the 1b trainer (baseline, FORGE + AGoQ);
#                                           # then 125m, 1000 steps: baseline, AGoQ, FORGE + AGoQ (loss curves)
# Work goes to /tmp/s9w/PART; $OUT/PART.tgz is rewritten after each stage (what a time-out leaves comes back).
set -u -o pipefail
PART=${1:-main}
D=/tmp/s9w/$PART
mkdir -p "$D"
source "$(dirname "$0")/gpu_lib.sh"
snap() { tar czf "$OUT/$PART.tgz" -C /tmp/s9w "$PART"; }
train1b() {  # $1 name, rest: trainer arguments (1b, B = 8, 8 steps)
  local name=$1
  shift
  local common="--preset 1b --steps ${STEPS1B:-8} --data.batch-size 8 --data.max-corpus-mb 6 --train.eval-every 0 --train.ckpt-every 0"
  common="$common --optim.warmup-steps 2 --train.sample-tokens 0 --train.progress false"
  log "train 1b $name: $common $*"
  timeout 80 python3 -m leantrain train $common "$@" --out "$D/$name" 2>&1 | grep -v Warn | tail -3
  cp "$D/$name/summary.json" "$D/train1b_$name.json" 2>/dev/null
  [ -n "${KEEPLOG:-}" ] && cp "$D/$name/metrics.jsonl" "$D/train1b_${name}_metrics.jsonl" 2>/dev/null
  rm -rf "$D/$name"
}
c125() {  # $1 name, rest: trainer arguments (125m, 1000 steps, the 2026-11-29 curves' settings)
  local name=$1
  shift
  log "125m, 1000 steps: $name: $*"
  timeout 130 python3 -m leantrain train --preset 125m --steps 1000 "$@" --out "$D/c125_$name" --data.max-corpus-mb 16 \
    --train.eval-every 200 --train.ckpt-every 0 --train.sample-tokens 0 --train.log-every 50 --train.progress false \
    2>&1 | grep -v Warn | tail -2
  find "$D/c125_$name" -mindepth 1 -not -name metrics.jsonl -not -name summary.json -exec rm -rf {} + 2>/dev/null
}
{
  case "$PART" in
    main)
      gpuinfo
      log "gpu tests: forge clip (the scale kernel compiled), the FORGE kernel's clip test, model"
      gputest 120 tests/forge/test_forge_clip.py tests/forge/test_forge_kernel.py tests/test_model.py -k "clip or scale or est or chunk"
      for clip in est_global none; do
        log "profile agoq_forge B=8 clip=$clip"
        timeout 70 python3 benchmarks/profile_step.py --config agoq_forge --batch 8 --clip $clip --out "$D" 2>&1 | grep -v Warn | tail -1
      done
      train1b baseline --baseline
      train1b forge_agoq --forge --agoq
      train1b forge_int8_agoq --forge --forge.state-dtype int8 --agoq
      export FLAT=1
      AGOQ_ARGS="--variants=" agoqrun m1 70
      AGOQ_ARGS="--variants= --model loss_chunk=0" agoqrun onepiece 70
      AGOQ_ARGS="--variants=" agoqrun m2 70
      AGOQ_ARGS="--variants=" agoqrun m3 70 ;;
    second)
      gpuinfo
      export FLAT=1
      for r in s1 s2 s3; do AGOQ_ARGS="--variants=" agoqrun $r 70; snap; done
      train1b baseline --baseline
      train1b forge_agoq --forge --agoq
      snap
      for r in "baseline:--baseline" "agoq:--agoq" "agoq_forge:--agoq --forge"; do
        c125 ${r%%:*} ${r#*:}
        snap
      done ;;
    third)
      gpuinfo
      for r in "agoq:--agoq" "agoq_seed1:--agoq --agoq.seed 1" "agoq_onepiece:--agoq --model.loss-chunk 0"; do
        c125 ${r%%:*} ${r#*:}
        snap
      done
      export STEPS1B=16 KEEPLOG=1
      train1b forge_agoq --forge --agoq --train.log-every 1
      train1b forge_int8_agoq --forge --forge.state-dtype int8 --agoq --train.log-every 1 ;;
    fourth)
      gpuinfo
      log "gpu tests: forge clip (the scale kernel compiled), the FORGE kernel's clip test"
      gputest 90 tests/forge/test_forge_clip.py tests/forge/test_forge_kernel.py -k "clip or scale or est"
      snap
      rm -rf "${TRITON_CACHE_DIR:-$HOME/.triton/cache}"  # the trainer runs compile what they use, as a user's would
      export STEPS1B=16 KEEPLOG=1
      train1b baseline --baseline --train.log-every 1
      train1b forge_agoq --forge --agoq --train.log-every 1
      train1b forge_int8_agoq --forge --forge.state-dtype int8 --agoq --train.log-every 1 ;;
    fifth)
      gpuinfo
      export FLAT=1
      AGOQ_ARGS="--variants= --model loss_chunk=512" agoqrun chunk512 70; snap
      AGOQ_ARGS="--variants= --model loss_chunk=256" agoqrun chunk256 70; snap
      AGOQ_ARGS="--variants= --policy batch_mib=256" agoqrun batch256 70; snap
      AGOQ_ARGS="--variants= --model loss_chunk=512 --policy batch_mib=256" agoqrun chunk512_batch256 70 ;;
  esac
} 2>&1 | tee "$D/run.log"
snap

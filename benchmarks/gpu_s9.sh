#!/usr/bin/env bash
# Session 9's GPU call (under the device tool's 600 s limit; one tarball comes back):
#   OUT=dir bash benchmarks/gpu_s9.sh main  # FORGE's clip scale in one launch (gradsums.py) and the chunked
#                                           # loss (model.loss_chunk): the clip tests compiled; profile_step
#                                           # agoq_forge B = 8 with clip est_global and none; the 1b preset
#                                           # through the trainer (baseline, FORGE + AGoQ, FORGE int8 + AGoQ);
#                                           # bench_agoq three times and once with loss_chunk=0 (the one-piece loss)
set -u -o pipefail
PART=${1:-main}
D=$OUT/$PART
mkdir -p "$D"
source "$(dirname "$0")/gpu_lib.sh"
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
      COMMON="--preset 1b --steps 8 --data.batch-size 8 --data.max-corpus-mb 6 --train.eval-every 0 --train.ckpt-every 0"
      COMMON="$COMMON --optim.warmup-steps 2 --train.sample-tokens 0 --train.progress false"
      for r in "baseline:--baseline" "forge_agoq:--forge --agoq" "forge_int8_agoq:--forge --forge.state-dtype int8 --agoq"; do
        name=${r%%:*}
        log "train 1b $name: $COMMON ${r#*:}"
        timeout 80 python3 -m leantrain train $COMMON ${r#*:} --out "$D/$name" 2>&1 | grep -v Warn | tail -3
        cp "$D/$name/summary.json" "$D/train1b_$name.json" 2>/dev/null; rm -rf "$D/$name"
      done
      export FLAT=1
      AGOQ_ARGS="--variants=" agoqrun m1 70
      AGOQ_ARGS="--variants= --model loss_chunk=0" agoqrun onepiece 70
      AGOQ_ARGS="--variants=" agoqrun m2 70
      AGOQ_ARGS="--variants=" agoqrun m3 70 ;;
  esac
} 2>&1 | tee "$D/run.log"
tar czf "$OUT/$PART.tgz" -C "$OUT" "$PART" && rm -rf "$D"

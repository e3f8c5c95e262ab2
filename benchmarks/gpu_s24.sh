#!/usr/bin/env bash
# Session 24's GPU calls:
#   OUT=dir bash benchmarks/gpu_s24.sh first  # ChunkFT (state arena + copy stream, norms without a piece-sized
#                                           # temporary): tests compiled; 1b peak and time, AdamW against
#                                           # ChunkFT with 4, 8 and 16 chunks (interval 1) and 4 chunks interval 4
#   OUT=dir bash benchmarks/gpu_s24.sh second # the same, 20 steps, after the host block became one buffer
#                                           # page-locked at construction (first/: each chunk's pinned buffer,
#                                           # allocated at its first swap, stalled the first pass)
#   OUT=dir bash benchmarks/gpu_s24.sh third  # SCAPE's tests (its CUDA reference test; the gloo ones on CPU)
#                                           # and the fine-tuning tests, on the GPU machine
#   OUT=dir bash benchmarks/gpu_s24.sh fourth # finetune --resume on CUDA: ChunkFT (its page-locked host block
#                                           # loaded) and AdamW, 4 steps straight against 2 + resume to 4
# Work goes to /tmp/s24w/PART; $OUT/PART.tgz is rewritten after each stage (what a time-out leaves comes back).
set -u -o pipefail
source "$(dirname "$0")/gpu_lib.sh"
gpu_part /tmp/s24w "${1:-first}"
{
  case "$PART" in
    first|second)
      steps=12 every=4
      [ "$PART" = second ] && steps=20 every=1
      gpuinfo
      log "chunkft tests"
      gputest 120 tests/finetune/test_chunkft.py
      for m in full:1:1 chunkft:4:1 chunkft:8:1 chunkft:16:1 chunkft:4:4; do  # (method:chunks:interval)
        name=b1_${m//:/_}
        IFS=: read -r meth n iv <<< "$m"
        log "finetune: 1b, random weights, $m"
        timeout 120 python3 -m leantrain finetune --method $meth --num-chunks $n --interval $iv --task compare \
          --preset 1b --steps $steps --batch-size 16 --eval-examples 64 --log-every $every --out "$D/$name" \
          --data.max-corpus-mb 6 2>&1 | tail -2
        rm -rf "$D/$name/checkpoints" "$D/$name/tokenizer.json"
        snap
      done ;;
    third)
      gpuinfo
      log "scape and finetune tests"
      gputest 400 tests/comm/test_scape.py tests/finetune ;;
    fourth)
      gpuinfo
      for meth in chunkft full; do
        log "finetune --resume on CUDA: $meth"
        common="finetune --method $meth --task compare --preset tiny --batch-size 8 --eval-examples 32 --log-every 1"
        common="$common --num-chunks 3 --data.max-corpus-mb 6"
        python3 -m leantrain $common --steps 4 --out "$D/${meth}_a" 2>&1 | tail -1
        python3 -m leantrain $common --steps 2 --out "$D/${meth}_b" 2>&1 | tail -1
        python3 -m leantrain $common --steps 4 --resume --out "$D/${meth}_b" 2>&1 | tail -1
        python3 - "$D/${meth}_a" "$D/${meth}_b" <<'PY'
import sys
from safetensors.torch import load_file
a, b = (load_file(f"{d}/checkpoints/step_0000004/model.safetensors") for d in sys.argv[1:])
diff = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
print(f"resumed == straight, bit for bit: {all((a[k] == b[k]).all() for k in a)}; max |difference| {diff:.3g}")
PY
        rm -rf "$D/${meth}_a/checkpoints" "$D/${meth}_b/checkpoints" "$D"/*/tokenizer.json
        snap
      done ;;
  esac
} 2>&1 | tee "$D/log.txt"
snap

#!/usr/bin/env bash
# Session 23's GPU calls:
#   OUT=dir bash benchmarks/gpu_s23.sh first   # the split path in row chunks, each chunk's update on a second
#                                            # stream beside the next chunk's GEMM, the GEMM told to leave SMs
#                                            # free (cuBLASLt's SM count target): tune_kernels.py --what forge_carve
#   OUT=dir bash benchmarks/gpu_s23.sh second  # the same timed as CUDA graph replays (GPU time), host time of a GEMM
#   OUT=dir bash benchmarks/gpu_s23.sh third   # ChunkFT: tests compiled, tiny compare accuracy, 1b peak memory
#                                            # (carry runs/s23ft: the last checkpoint, config.json and tokenizer.json of make train STEPS=300)
#   OUT=dir bash benchmarks/gpu_s23.sh fourth  # ChunkFT with its state arena and copy stream: tests, 1b peak and time
# Work goes to /tmp/s23w/PART; $OUT/PART.tgz is rewritten after each stage (what a time-out leaves comes back).
set -u -o pipefail
source "$(dirname "$0")/gpu_lib.sh"
gpu_part /tmp/s23w "${1:-first}"
{
  case "$PART" in
    first)
      gpuinfo
      log "forge carve"
      timeout 400 python3 benchmarks/tune_kernels.py --what forge_carve --out "$D" 2>&1 | grep -v Warn \
        | cut -c1-1500 | tail -16
      snap ;;
    second)  # the same as CUDA graph replays (GPU time: first/'s chunks paid ~0.14 ms of host time each), and
      # the host time of one dW GEMM call with cuBLAS and cuBLASLt
      gpuinfo
      log "forge carve, graphed"
      TUNE_CARVE_GRAPH=1 TUNE_CARVE_CHUNKS=2,3,4,8 TUNE_CARVE_SMS=8,16,24,32,48 timeout 500 python3 \
        benchmarks/tune_kernels.py --what forge_carve --out "$D" 2>&1 | grep -v Warn | cut -c1-1500 | tail -16
      snap ;;
    third)  # ChunkFT: its tests compiled (the pinned-memory offload), the tiny run of make train (carried as
      # runs/s23ft, 300 steps) on compare against AdamW, then the 1b preset from random weights, 10 steps each:
      # the allocator's peak of back-propagation with AdamW against ChunkFT's with 4 and 8 chunks
      gpuinfo
      log "chunkft tests"
      gputest 120 tests/finetune/test_chunkft.py
      log "finetune: tiny, compare, 3 seeds"
      timeout 200 python3 benchmarks/bench_finetune.py --from runs/s23ft --task compare --methods \
        chunkft:1e-4,3e-4 full:1e-4 --out "$D/tiny" 2>&1 | tail -5
      rm -rf "$D/tiny/runs"
      snap
      for m in full:4 chunkft:4 chunkft:8; do  # (method:chunks; full ignores the chunks)
        name=b1_${m/:/}
        log "finetune: 1b, random weights, $m"
        timeout 120 python3 -m leantrain finetune --method ${m%%:*} --num-chunks ${m#*:} --task compare --preset 1b \
          --steps 10 --batch-size 16 --eval-examples 64 --log-every 5 --out "$D/$name" --data.max-corpus-mb 6 2>&1 \
          | tail -2
        rm -rf "$D/$name/checkpoints"
        snap
      done ;;
    fourth)  # ChunkFT after its state moved to one device arena swapped on a copy stream, and its norms taken
      # without a piece-sized temporary: the tests compiled, 1b peak and time with 4 and 8 chunks (interval 1),
      # and 4 chunks with interval 4
      gpuinfo
      log "chunkft tests"
      gputest 120 tests/finetune/test_chunkft.py
      for m in chunkft:4:1 chunkft:8:1 chunkft:4:4; do  # (method:chunks:interval)
        name=b1_${m//:/_}
        IFS=: read -r meth n iv <<< "$m"
        log "finetune: 1b, random weights, $m"
        timeout 120 python3 -m leantrain finetune --method $meth --num-chunks $n --interval $iv --task compare \
          --preset 1b --steps 12 --batch-size 16 --eval-examples 64 --log-every 4 --out "$D/$name" \
          --data.max-corpus-mb 6 2>&1 | tail -2
        rm -rf "$D/$name/checkpoints"
        snap
      done ;;
  esac
} 2>&1 | tee "$D/log.txt"
snap

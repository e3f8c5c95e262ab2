#!/usr/bin/env bash
# Session 25's GPU calls:
#   OUT=dir bash benchmarks/gpu_s25.sh first  # the warp-specialized Gluon kernel (forge/ws.py): bits against its
#                                           # own dW + the update kernel (every rule, fp32 / bf16 + SR), then
#                                           # one linear, fp32 W / m / v, against torch and the split path;
#                                           # a tile sweep on the MLP and head shapes
#   OUT=dir bash benchmarks/gpu_s25.sh second # the bits again (first/: FMA contraction on), the tests, bench_forge
#                                           # part (a) with the ws columns, a short tile sweep
#   OUT=dir bash benchmarks/gpu_s25.sh third  # not run in session 25: the 8-warp default, PREFETCH and STATE_TMA:
#                                           # sweep, tests, part (a)
# Work goes to /tmp/s25w/PART; $OUT/PART.tgz is rewritten after each stage (what a time-out leaves comes back).
set -u -o pipefail
source "$(dirname "$0")/gpu_lib.sh"
gpu_part /tmp/s25w "${1:-first}"
{
  case "$PART" in
    first)
      gpuinfo
      log "ws check"
      timeout 150 python3 benchmarks/tune_ws.py check > "$D/check.jsonl" 2> "$D/check.err"
      echo "rc=$?"; tail -3 "$D/check.jsonl"; tail -5 "$D/check.err"
      snap
      log "ws tests (pytest)"
      gputest 200 tests/forge/test_forge_ws.py
      snap
      if grep -q '"check_failures": 0' "$D/check.jsonl"; then
        log "ws time: default tile, every shape and T"
        timeout 200 python3 benchmarks/tune_ws.py time > "$D/time.jsonl" 2> "$D/time.err"
        echo "rc=$?"; tail -3 "$D/time.err"
        snap
        log "ws sweep"
        timeout 120 python3 benchmarks/tune_ws.py time --shapes 2048x5632 --tokens 512,2048 --configs \
          '{}' '{"STAGES": 4}' '{"num_warps": 8}' '{"SUB": 16}' '{"BM": 64}' \
          '{"BT": 32, "STAGES": 4}' '{"num_warps": 8, "SUB": 16}' > "$D/sweep.jsonl" 2> "$D/sweep.err"
        echo "rc=$?"; tail -3 "$D/sweep.err"
      fi ;;
    second)  # after first/ (FMA contraction was on): the tests, bench_forge part (a), a short sweep
      gpuinfo
      log "ws tests (pytest: the bits of every rule and dtype, the layer path, the clip scale, a NaN tile)"
      gputest 110 tests/forge/test_forge_ws.py
      snap
      log "bench_forge part (a)"
      timeout 290 python3 benchmarks/bench_forge.py --part a --timeout-a 280 --tokens 512 1024 2048 16384 --out "$D" 2>&1 | grep -v Warn | tail -30
      snap
      log "ws sweep"
      timeout 50 python3 benchmarks/tune_ws.py time --shapes 2048x5632 --tokens 2048 --configs \
        '{}' '{"num_warps": 8}' '{"BM": 64}' '{"STAGES": 4}' > "$D/sweep.jsonl" 2> "$D/sweep.err"
      echo "rc=$?"; cat "$D/sweep.jsonl" ;;
    third)  # after second/ (4 update warps: slower than the split path): 8 warps, slices read one ahead; a sweep,
      # the tests, part (a)
      gpuinfo
      log "ws sweep"
      timeout 110 python3 benchmarks/tune_ws.py time --shapes 2048x5632,32000x2048 --tokens 512,2048 --configs \
        '{}' '{"BM": 64}' '{"STATE_TMA": 1, "SUB": 16}' '{"PREFETCH": 1, "SUB": 16}' > "$D/sweep.jsonl" 2> "$D/sweep.err"
      echo "rc=$?"; cat "$D/sweep.jsonl"
      snap
      log "ws tests (pytest)"
      gputest 160 tests/forge/test_forge_ws.py
      snap
      log "bench_forge part (a)"
      timeout 100 python3 benchmarks/bench_forge.py --part a --timeout-a 95 --tokens 512 1024 2048 16384 --out "$D" 2>&1 \
        | grep -v Warn | grep -A30 "warp-specialized" ;;
  esac
} 2>&1 | tee "$D/log.txt"
snap

#!/usr/bin/env bash
# GPU part B2: FORGE whole training step of the 1b preset at B = 1, 4, 16.   OUT=dir bash benchmarks/gpu_final_b2.sh
set -u -o pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 LEANTRAIN_CACHE=/tmp/ltc
mkdir -p "$OUT/b2"
timeout 200 python3 benchmarks/bench_forge.py --part b --batches 1 4 16 --steps 3 --warmup 2 --timeout 40 \
  --out "$OUT/b2" 2>&1 | tail -30 | tee "$OUT/b2/run.log"

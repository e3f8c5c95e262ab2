# Session 3 exploration 4: multi-tensor kernel variants (alignment hints, typed 16-bit pointers).
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 LEANTRAIN_CACHE=/tmp/ltc
mkdir -p $OUT/e
timeout 60 python3 benchmarks/host_overhead.py --out $OUT/e/host_overhead.json 2>&1 | grep -v Warn
timeout 200 python3 benchmarks/tune_kernels.py --what agoq --out $OUT/e 2>&1 | grep -v Warn | cut -c1-150

# Session 3 exploration 5: AGoQ step after the alignment choice: profile, host cProfile, bench.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 LEANTRAIN_CACHE=/tmp/ltc
mkdir -p $OUT/e
timeout 150 python3 benchmarks/profile_step.py --config agoq --batch 8 --no-opt --cprofile --out $OUT/e 2>&1 | grep -v Warn | tail -1
timeout 200 python3 benchmarks/bench_agoq.py --out $OUT/e 2>&1 | grep -v Warn | tail -2

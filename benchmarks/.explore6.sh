# Session 3 exploration 2: host time per call of AGoQ's save path; cProfile of AGoQ steps.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 LEANTRAIN_CACHE=/tmp/ltc
mkdir -p $OUT/h
timeout 120 python3 benchmarks/host_overhead.py --out $OUT/h/host_overhead.json 2>&1 | grep -v Warn
timeout 200 python3 benchmarks/profile_step.py --config agoq --batch 8 --no-opt --cprofile --out $OUT/h 2>&1 | grep -v Warn | tail -1

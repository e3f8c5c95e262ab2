# Session 3 exploration 3: batched AGoQ packing: host time, step profile, tile sweep of the
# multi-tensor kernels, and the AGoQ benchmark (1b, B = 8).
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 LEANTRAIN_CACHE=/tmp/ltc
mkdir -p $OUT/e
timeout 60 python3 benchmarks/host_overhead.py --out $OUT/e/host_overhead.json 2>&1 | grep -v Warn
timeout 100 python3 benchmarks/profile_step.py --config agoq --batch 8 --no-opt --out $OUT/e 2>&1 | grep -v Warn | tail -1
timeout 150 python3 benchmarks/tune_kernels.py --what agoq --out $OUT/e 2>&1 | grep -v Warn | cut -c1-160
timeout 200 python3 benchmarks/bench_agoq.py --out $OUT/e 2>&1 | grep -v Warn | tail -4
LEANTRAIN_TEST_GPU=1 timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/ops/test_multi.py tests/agoq/test_agoq_batch.py tests/agoq/test_agoq_unpack_cache.py 2>&1 | tail -5

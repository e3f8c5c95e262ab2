# Session 3 exploration 7: pairwise stochastic rounding (one hash per 4-bit byte).
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 LEANTRAIN_CACHE=/tmp/ltc
mkdir -p $OUT/e
timeout 150 python3 benchmarks/tune_kernels.py --what agoq --out $OUT/e 2>&1 | grep -v Warn | cut -c1-140
timeout 100 python3 benchmarks/profile_step.py --config agoq --batch 8 --no-opt --out $OUT/e 2>&1 | grep -v Warn | tail -1
timeout 150 python3 benchmarks/bench_agoq.py --out $OUT/e 2>&1 | grep -v Warn | tail -1
LEANTRAIN_TEST_GPU=1 timeout 170 python3 -m pytest -q -x -p no:cacheprovider tests/ops/test_quant.py tests/ops/test_multi.py tests/ops/test_rng_sr.py tests/ops/test_hadamard.py 2>&1 | tail -3

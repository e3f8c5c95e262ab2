# Session 3 exploration 6: mixed-bit batches, unpinned asynchronous tables, 2048-element tiles.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 LEANTRAIN_CACHE=/tmp/ltc
mkdir -p $OUT/e
LEANTRAIN_TEST_GPU=1 timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/ops/test_multi.py tests/agoq/test_agoq_batch.py 2>&1 | tail -2
for c in torch_bf16 agoq; do
timeout 100 python3 benchmarks/profile_step.py --config $c --batch 8 --no-opt --out $OUT/e 2>&1 | grep -v Warn | tail -1
done
timeout 200 python3 benchmarks/bench_agoq.py --out $OUT/e 2>&1 | grep -v Warn | tail -1

set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 LEANTRAIN_CACHE=/tmp/ltc
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p $OUT/x
( LEANTRAIN_TEST_GPU=1 timeout 240 python3 -m pytest tests/ops tests/forge -q -x -p no:cacheprovider -o addopts="" 2>&1 | tail -25 ) > $OUT/x/gpu_tests.log
( timeout 150 python3 benchmarks/tune_kernels.py --what ops --out $OUT/x 2>&1 | tail -70 ) > $OUT/x/ops.log
for c in "forge_bf16 4" "torch_bf16 4" "agoq 8"; do
  set -- $c
  timeout 80 python3 benchmarks/profile_step.py --config $1 --batch $2 --out $OUT/x 2>&1 | grep -v Warn | tail -2
done
tail -3 $OUT/x/gpu_tests.log

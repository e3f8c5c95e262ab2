set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 LEANTRAIN_CACHE=/tmp/ltc
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p $OUT/x
( timeout 200 python3 benchmarks/tune_kernels.py --what ops --out $OUT/x 2>&1 | tail -60 ) > $OUT/x/ops.log
( timeout 260 python3 benchmarks/tune_kernels.py --what forge --out $OUT/x 2>&1 | tail -40 ) > $OUT/x/forge.log
for c in "torch_bf16 4" "forge_bf16 4" "torch_bf16 8" "agoq 8"; do
  set -- $c
  timeout 90 python3 benchmarks/profile_step.py --config $1 --batch $2 --out $OUT/x 2>&1 | tail -3
done
ls $OUT/x

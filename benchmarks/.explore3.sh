set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 LEANTRAIN_CACHE=/tmp/ltc
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p $OUT/x
( timeout 120 python3 benchmarks/tune_kernels.py --what forge_paths --out $OUT/x 2>&1 | tail -40 ) > $OUT/x/forge_paths.log
python3 - > $OUT/x/ops_small.log 2>&1 <<'PY'
import torch, importlib, json
from triton.testing import do_bench
from leantrain import ops
n = 64 << 20
x = torch.randn(n, device="cuda"); xb = x.bfloat16(); y = torch.empty_like(x)
copy = do_bench(lambda: y.copy_(x), rep=100); cg = 8 * n / copy / 1e6
codec = ops.StateCodec8(signed=True); codec_u = ops.StateCodec8(signed=False)
xs = x[: 1 << 22]
for c in (codec, codec_u):
    a, _ = c.encode(xs, backend="triton"); b, _ = c.encode(xs, backend="torch"); print("state8 exact", c.signed, bool(torch.equal(a, b)))
cases = [("state8 encode", lambda: codec.encode(x, backend="triton"), 5 * n),
         ("hq int8 fp32", lambda: ops.hadamard_quantize(x, block=32, bits=8, backend="triton"), 5 * n),
         ("hq int4 SR fp32", lambda: ops.hadamard_quantize(x, block=32, bits=4, stochastic=True, backend="triton"), 4.5 * n),
         ("hadamard b32 fp32", lambda: ops.hadamard(x, block=32, backend="triton"), 8 * n),
         ("hadamard b256 fp32", lambda: ops.hadamard(x, block=256, backend="triton"), 8 * n),
         ("q int4 SR bf16", lambda: ops.quantize(xb, bits=4, stochastic=True, backend="triton"), 2.5 * n),
         ("dq int4 ->bf16", (lambda q: lambda: ops.dequantize(q))(ops.quantize(xb, bits=4, backend="triton")), 2.5 * n)]
print("copy GB/s", round(cg))
for name, fn, nb in cases:
    ms = do_bench(fn, rep=100); print(name, round(ms, 4), "frac", round(nb / ms / 1e6 / cg, 3))
PY
for c in "forge_bf16 4" "torch_bf16 4" "forge_bf16 16" "torch_bf16 16" "agoq 8"; do
  set -- $c
  timeout 80 python3 benchmarks/profile_step.py --config $1 --batch $2 --out $OUT/x 2>&1 | grep -v Warn | tail -1
done
cat $OUT/x/ops_small.log

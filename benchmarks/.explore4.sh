set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 LEANTRAIN_CACHE=/tmp/ltc
mkdir -p $OUT/x
python3 - > $OUT/x/ops4.log 2>&1 <<'PY'
import torch
from triton.testing import do_bench
from leantrain import ops
n = 64 << 20
x = torch.randn(n, device="cuda"); xb = x.bfloat16(); y = torch.empty_like(x)
copy = do_bench(lambda: y.copy_(x), rep=100); cg = 8 * n / copy / 1e6
xs = x[:4097]
for sym in (True, False):
    for sr in (False, True):
        a = ops.quantize(xs, bits=4, symmetric=sym, stochastic=sr, backend="triton"); b = ops.quantize(xs, bits=4, symmetric=sym, stochastic=sr, backend="torch")
        print("exact", sym, sr, bool(torch.equal(a.data, b.data) and torch.equal(a.scale, b.scale)), bool(torch.equal(ops.dequantize(a), ops.dequantize(b, backend="torch"))))
q4 = ops.quantize(x, bits=4, backend="triton"); q4b = ops.quantize(xb, bits=4, backend="triton")
cases = [("q int4 g128 fp32", lambda: ops.quantize(x, bits=4, backend="triton"), 4.5 * n),
         ("q int4 SR bf16", lambda: ops.quantize(xb, bits=4, stochastic=True, backend="triton"), 2.5 * n),
         ("q int8 SR bf16", lambda: ops.quantize(xb, bits=8, stochastic=True, backend="triton"), 3 * n),
         ("dq int4 ->fp32", lambda: ops.dequantize(q4), 4.5 * n),
         ("dq int4 ->bf16", lambda: ops.dequantize(q4b), 2.5 * n),
         ("q int4 g2048 SR fp32", lambda: ops.quantize(x, bits=4, group_size=2048, stochastic=True, backend="triton"), 4.5 * n),
         ("hq int4 SR fp32", lambda: ops.hadamard_quantize(x, block=32, bits=4, stochastic=True, backend="triton"), 4.5 * n)]
print("copy GB/s", round(cg))
for name, fn, nb in cases:
    ms = do_bench(fn, rep=100); print(name, round(ms, 4), "frac", round(nb / ms / 1e6 / cg, 3))
PY
timeout 80 python3 benchmarks/profile_step.py --config agoq --batch 8 --out $OUT/x 2>&1 | grep -v Warn | tail -1
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 80 python3 benchmarks/profile_step.py --config torch_bf16 --batch 8 --out $OUT/x/exp 2>&1 | grep -v Warn | tail -1
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 80 python3 benchmarks/profile_step.py --config agoq --batch 8 --out $OUT/x/exp 2>&1 | grep -v Warn | tail -1
timeout 80 python3 benchmarks/profile_step.py --config torch_bf16 --batch 8 --out $OUT/x 2>&1 | grep -v Warn | tail -1
cat $OUT/x/ops4.log

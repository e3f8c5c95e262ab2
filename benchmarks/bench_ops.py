"""Effective bandwidth of leantrain.ops' Triton kernels, next to a device-to-device copy.

    PYTHONPATH=src python3 benchmarks/bench_ops.py --out benchmarks/results/ops-<date>-<gpu>.json
    PYTHONPATH=src python3 benchmarks/bench_ops.py --quick            # one size, fewer reps

Effective bandwidth = (bytes the kernel must read + write) / median time
(``triton.testing.do_bench``). The copy (``y.copy_(x)``) is measured in the same run on the
same input, so "fraction of copy" is independent of clocks and driver. Inputs are fp32
(bf16 where stated); sizes are the input tensor's size in MiB.

do_bench times a call from the host, so a call whose host work outlasts its kernels (the
multi-tensor calls at small sizes) is timed by its host. Each row therefore also has
``gpu_ms``: the GPU time of one call (every kernel and copy it launched, from
``torch.profiler``, mean of 10 calls) and ``gpu_frac_copy`` from it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import torch  # noqa: E402


def _cases(n: int, dev: str):
    """(name, fn, bytes moved) for an fp32 input of n elements."""
    from leantrain import ops

    x = torch.randn(n, device=dev)
    xb = x.to(torch.bfloat16)
    out = []

    def q(bits, gs=128):
        return lambda: ops.quantize(x, bits=bits, group_size=gs, backend="triton")

    for bits in (8, 4):
        qq = ops.quantize(x, bits=bits, backend="triton")
        out.append((f"quantize int{bits} g128 fp32", q(bits), 4 * n + n * bits // 8 + 4 * n // 128))
        out.append((f"dequantize int{bits} g128 ->fp32",
                    lambda qq=qq: ops.dequantize(qq, backend="triton"), 4 * n + n * bits // 8 + 4 * n // 128))
    out.append(("quantize int8 g128 SR bf16",
                lambda: ops.quantize(xb, bits=8, stochastic=True, seed=1, backend="triton"),
                2 * n + n + 4 * n // 128))
    q4b = ops.quantize(xb, bits=4, stochastic=True, seed=1, backend="triton")
    out.append(("quantize int4 g128 SR bf16 (AGoQ)",
                lambda: ops.quantize(xb, bits=4, stochastic=True, seed=1, backend="triton"),
                2 * n + n // 2 + 4 * n // 128))
    out.append(("dequantize int4 g128 ->bf16 (AGoQ)", lambda: ops.dequantize(q4b, backend="triton"),
                2 * n + n // 2 + 4 * n // 128))
    from leantrain.ops.multi import dequantize_many, quantize_many
    xs = list(xb.split((n // 10) // 64 * 64))  # AGoQ's batched path: ~ten tensors (16-byte aligned) in one launch
    qs = quantize_many(xs, bits=4, stochastic=True, seeds=list(range(len(xs))))
    out.append(("quantize_many 10 tensors int4 g128 SR bf16 (AGoQ)",
                lambda: quantize_many(xs, bits=4, stochastic=True, seeds=list(range(len(xs)))),
                2 * n + n // 2 + 4 * n // 128))
    out.append(("dequantize_many 10 tensors int4 g128 ->bf16 (AGoQ)", lambda: dequantize_many(qs),
                2 * n + n // 2 + 4 * n // 128))
    out.append(("quantize int4 g2048 SR fp32",
                lambda: ops.quantize(x, bits=4, group_size=2048, stochastic=True, backend="triton"),
                4 * n + n // 2 + 4 * n // 2048))
    q8 = ops.quantize_fp8(x, backend="triton")
    out.append(("quantize_fp8 e4m3 g128", lambda: ops.quantize_fp8(x, backend="triton"), 5 * n + 4 * n // 128))
    out.append(("dequantize_fp8 e4m3 ->fp32", lambda: ops.dequantize_fp8(q8, backend="triton"), 5 * n + 4 * n // 128))
    q4 = ops.quantize_nvfp4(x, backend="triton")  # quantize = 2 reads of x (amax pass + encode pass)
    out.append(("quantize_nvfp4 fp32 (amax+encode, 2 reads)", lambda: ops.quantize_nvfp4(x, backend="triton"),
                8 * n + n // 2 + n // 16))
    out.append(("dequantize_nvfp4 ->fp32", lambda: ops.dequantize_nvfp4(q4, backend="triton"), n // 2 + n // 16 + 4 * n))
    for b in (32, 256):
        out.append((f"hadamard b{b} fp32", lambda b=b: ops.hadamard(x, block=b, backend="triton"), 8 * n))
    out.append(("hadamard b32 bf16", lambda: ops.hadamard(xb, block=32, backend="triton"), 4 * n))
    out.append(("hadamard_quantize b32 int8 g128",
                lambda: ops.hadamard_quantize(x, block=32, bits=8, backend="triton"), 5 * n + 4 * n // 128))
    out.append(("hadamard_quantize b32 int4 g128 SR",
                lambda: ops.hadamard_quantize(x, block=32, bits=4, stochastic=True, backend="triton"),
                4 * n + n // 2 + 4 * n // 128))
    k = 8
    m = n // k  # k peers of m elements: the k*m int8 codes are as many bytes as x has elements
    qk = ops.QTensor.stack([ops.quantize(x[i * m:(i + 1) * m], bits=8, backend="triton") for i in range(k)])
    out.append((f"dequant_sum_requant k={k} int8->int4",
                lambda: ops.dequant_sum_requant(qk, bits_out=4, stochastic=True, backend="triton"),
                k * m + 4 * k * m // 128 + m // 2 + 4 * m // 128))
    out.append(("bf16_stochastic_round", lambda: ops.bf16_stochastic_round(x, seed=1, backend="triton"), 6 * n))
    codec = ops.StateCodec8(signed=True)
    codes, absmax = codec.encode(x, backend="triton")
    out.append(("state8 encode", lambda: codec.encode(x, backend="triton"), 5 * n + 4 * n // 256))
    out.append(("state8 decode", lambda: codec.decode(codes, absmax, backend="triton"), 5 * n + 4 * n // 256))
    mask = x > 0
    out.append(("pack_bits", lambda: ops.pack_bits(mask, backend="triton"), n + n // 8))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="256,512,1024,2048", help="input sizes in MiB, comma-separated")
    p.add_argument("--quick", action="store_true", help="one size (256 MiB), fewer repetitions")
    p.add_argument("--out", default=None, help="JSON file (*.json) or directory (then <date>_<hardware>.json)")
    p.add_argument("--rep", type=int, default=200, help="do_bench repetition time in ms")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_ops: needs a CUDA GPU (Triton kernels); nothing measured", file=sys.stderr)
        return 1
    import triton
    from triton.testing import do_bench

    sizes = [256] if a.quick else [int(s) for s in a.sizes.split(",")]
    rep = 50 if a.quick else a.rep
    dev = "cuda"
    res = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "metric": "effective GB/s = (bytes read + written) / median time; frac = / copy GB/s",
        "sizes": [],
    }
    for mib in sizes:
        n = mib * (1 << 20) // 4
        x = torch.randn(n, device=dev)
        y = torch.empty_like(x)
        ms = do_bench(lambda x=x, y=y: y.copy_(x), warmup=25, rep=rep, return_mode="median")
        copy_gbps = 8 * n / ms / 1e6
        del x, y
        row = {"size_mib": mib, "copy_gbps": round(copy_gbps, 1), "kernels": {}}
        print(f"\n== input {mib} MiB fp32 ({n} elements): copy {copy_gbps:8.1f} GB/s")
        print(f"{'kernel':42s} {'ms':>9s} {'GB/s':>9s} {'of copy':>8s}")
        for name, fn, nbytes in _cases(n, dev):
            fn()
            torch.cuda.synchronize()
            ms = do_bench(fn, warmup=25, rep=rep, return_mode="median")
            gbps = nbytes / ms / 1e6
            g_ms = gpu_ms(fn)
            g_gbps = nbytes / g_ms / 1e6 if g_ms > 0 else 0.0
            row["kernels"][name] = {"ms": round(ms, 4), "gbps": round(gbps, 1), "frac_copy": round(gbps / copy_gbps, 3),
                                    "gpu_ms": round(g_ms, 4), "gpu_frac_copy": round(g_gbps / copy_gbps, 3)}
            print(f"{name:42s} {ms:9.3f} {gbps:9.1f} {gbps / copy_gbps:8.1%}   GPU {g_ms:7.3f} ms {g_gbps / copy_gbps:6.1%}")
        res["sizes"].append(row)
        torch.cuda.empty_cache()
    if a.out:
        path = a.out if a.out.endswith(".json") else os.path.join(a.out, harness.stem() + ".json")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        print(f"\nwrote {path}")
    return 0


def gpu_ms(fn, calls: int = 10) -> float:
    """GPU time of one call of ``fn``: the device time of everything it launched (profiler)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    tot = 0.0
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0.0)
        tot += t
    return tot / 1e3 / calls


if __name__ == "__main__":
    if sys.argv[1:2] == ["norm"]:  # RMSNorm and RoPE against op by op and torch (parts/norm.py)
        from parts.norm import main as norm

        sys.exit(norm(sys.argv[2:]))
    sys.exit(main())

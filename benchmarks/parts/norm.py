"""RMSNorm and RoPE forward + backward at the 1b preset's shapes: leantrain's one-function
norm (``ops.norm``, Triton), the op-by-op module (``fused_norm=false``), torch's ``F.rms_norm``;
RoPE (``ops.rope``) against the op-by-op form (``fused_rope=false``) on q of 32 heads of 64.

    PYTHONPATH=src python3 benchmarks/bench_ops.py norm --out DIR        # CUDA

For each: median time of forward, of forward + backward (CUDA events, after warm-up), and the
bytes autograd keeps for backward (unique storages seen by a saved-tensor hook, the weight
excluded). Writes ``DIR/norm_<date>.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import harness  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def saved_bytes(fn) -> int:
    seen = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def timed(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--sweep", action="store_true", help="also time ops.norm at other tile rows / warps")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_ops norm: needs CUDA")
        return 1
    from leantrain.model import RMSNorm

    dt = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    x = torch.randn(a.tokens, a.dim, device="cuda", dtype=dt, requires_grad=True)
    g = torch.randn(a.tokens, a.dim, device="cuda", dtype=dt)
    fused = RMSNorm(a.dim, fused=True).cuda().to(dt)
    plain = RMSNorm(a.dim, fused=False).cuda().to(dt)
    tw = torch.ones(a.dim, device="cuda", dtype=dt, requires_grad=True)
    impls = {
        "leantrain (ops.norm)": lambda: fused(x),
        "op by op (fused_norm=false)": lambda: plain(x),
        "torch F.rms_norm": lambda: F.rms_norm(x, (a.dim,), tw, 1e-5),
    }
    rows = []
    for name, f in impls.items():
        for _ in range(5):
            f().backward(g)
        fwd = timed(f, a.reps)
        both = timed(lambda f=f: f().backward(g), a.reps)
        y = f()
        node = type(y.grad_fn).__name__
        rows.append({"impl": name, "forward_ms": fwd, "forward_backward_ms": both, "saved_bytes": saved_bytes(f),
                     "grad_fn": node})
    sweep = []
    if a.sweep:  # the kernels' tile rows R and warps, forward + backward
        import leantrain.ops.norm as N

        rows0, warps0 = N._rows, N._warps
        for r in (1, 2, 4, 8, 16):
            for w in (4, 8, 16):
                N._rows, N._warps = (lambda b, r=r: r), (lambda e, w=w: w)
                for _ in range(3):
                    fused(x).backward(g)
                sweep.append({"rows": r, "warps": w, "forward_ms": timed(lambda: fused(x), a.reps),
                              "forward_backward_ms": timed(lambda: fused(x).backward(g), a.reps)})
                print(f"sweep R={r:2d} warps={w:2d}: fwd {sweep[-1]['forward_ms']:.3f} ms, "
                      f"fwd+bwd {sweep[-1]['forward_backward_ms']:.3f} ms")
        N._rows, N._warps = rows0, warps0
    from leantrain.model import rope_tables
    from leantrain.ops.rope import rope, rope_ref

    B, H, hd = max(1, a.tokens // 1024), a.dim // 64, 64
    T = a.tokens // B
    cos, sin = (t.cuda() for t in rope_tables(hd, T, 10000.0))
    q = torch.randn(B, T, H * hd, device="cuda", dtype=dt, requires_grad=True)
    gq = torch.randn(B, H, T, hd, device="cuda", dtype=dt)
    for name, f in {"rope: leantrain (ops.rope)": lambda: rope(q.view(B, T, H, hd).transpose(1, 2), cos, sin),
                    "rope: op by op (fused_rope=false)": lambda: rope_ref(q.view(B, T, H, hd).transpose(1, 2), cos, sin)
                    }.items():
        for _ in range(5):
            f().backward(gq)
        rows.append({"impl": name, "forward_ms": timed(f, a.reps),
                     "forward_backward_ms": timed(lambda f=f: f().backward(gq), a.reps),
                     "saved_bytes": saved_bytes(f), "grad_fn": type(f().grad_fn).__name__})
    with torch.no_grad():
        ref = plain(x).float()
        diff = (fused(x).float() - ref).abs().max().item() / ref.abs().max().item()
    res = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "tokens": a.tokens, "dim": a.dim, "dtype": a.dtype,
           "command": "PYTHONPATH=src python3 benchmarks/bench_ops.py norm " + " ".join(argv if argv is not None else sys.argv[1:]),
           "max_rel_diff_forward_vs_op_by_op": diff, "rows": rows, "sweep": sweep}
    print(f"{'impl':34s} {'fwd ms':>8s} {'fwd+bwd ms':>11s} {'saved MiB':>10s}  grad_fn")
    for r in rows:
        print(f"{r['impl']:34s} {r['forward_ms']:8.3f} {r['forward_backward_ms']:11.3f} "
              f"{r['saved_bytes'] / 2**20:10.1f}  {r['grad_fn']}")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, harness.stem("norm-rope") + ".json"), "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

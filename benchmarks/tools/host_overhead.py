"""Host time per call of AGoQ's save path on a GPU (what makes a step host-bound).

    PYTHONPATH=src python3 benchmarks/tools/host_overhead.py [--out FILE]

Each case is called many times on small tensors (so the GPU is never the bound) and the
host time per call is the wall time of the loop before the final synchronize, divided by
the number of calls. Prints one line per case and the state of ``ops.launch``'s direct path.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))

import torch  # noqa: E402


def per_call_us(fn, n=400) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / n * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import leantrain as lt
    from leantrain import ops

    B = importlib.import_module("leantrain.ops._backend")
    P = importlib.import_module("leantrain.agoq.pack")
    H = importlib.import_module("leantrain.agoq.packer")
    dev = "cuda"
    x = torch.randn(64, 1024, device=dev, dtype=torch.bfloat16)
    xr = x.clone().requires_grad_()
    y = xr * 2  # a non-leaf that requires grad, as saved activations are
    q4 = ops.quantize(x, bits=4, stochastic=True, seed=1)
    rows = {}

    def case(name, fn):
        rows[name] = per_call_us(fn)
        print(f"{name:48s} {rows[name]:8.1f} us/call", flush=True)

    case("torch.empty (1 tensor)", lambda: torch.empty(65536, device=dev, dtype=torch.uint8))
    case("torch.mul (one elementwise launch)", lambda: x * 2)
    case("ops.quantize int4 SR bf16", lambda: ops.quantize(x, bits=4, stochastic=True, seed=1))
    case("ops.dequantize int4 -> bf16", lambda: ops.dequantize(q4))
    case("agoq pack 4-bit", lambda: P.pack(x, 4, seed=3))
    pk4 = P.pack(x, 4, seed=3)
    case("agoq unpack 4-bit", lambda: P._unpack(pk4))
    model = torch.nn.Linear(8, 8).to(dev)
    packer = H.Packer(model, lt.agoq.Policy(min_numel=0))
    packer.begin()
    packer._roles.append("mlp_in")

    def hook():
        packer._dedup.clear()
        return packer.pack_hook(y)

    case("Packer.pack_hook (4-bit, role mlp_in)", hook)
    w = model.weight
    case("Packer.pack_hook (a parameter: kept)", lambda: packer.pack_hook(w))
    case("Packer.unpack_hook", lambda: packer.unpack_hook(pk4))
    case("_mix seed", lambda: H._mix(1, 2, 3))
    M = importlib.import_module("leantrain.ops.multi")
    xs = [x.clone() for _ in range(10)]
    case("quantize_many (10 tensors, int4 SR)", lambda: M.quantize_many(xs, bits=4, stochastic=True, seeds=list(range(10))))
    qs = M.quantize_many(xs, bits=4, stochastic=True, seeds=list(range(10)))
    case("dequantize_many (10 tensors)", lambda: M.dequantize_many(qs))
    case("the launch table of 10 tensors", lambda: M.launch_table([[0] * 8 for _ in range(10)], [1] * 10, x.device))
    rows["direct_launch"] = B._DIRECT[0]
    rows["direct_cache_entries"] = len(B._FAST)
    print("direct launch:", B._DIRECT[0], "cached kernels:", len(B._FAST))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

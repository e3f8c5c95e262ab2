"""Host time of one quantize_many + dequantize_many call pair, on the CPU, kernels stubbed out.

    PYTHONPATH=src python3 benchmarks/multi_host_cpu.py [--tensors 42]

AGoQ flushes ~40 saved tensors per call, 32 calls a step on the 1b preset at B = 8, and its
forward is host-bound on the H200: the Python around the launch (validation, allocations, the
launch table) is the cost measured here. ``launch`` is replaced by a no-op under the Triton
interpreter, so the host path is the GPU's. Prints the minimum over 25 rounds of 20 call pairs
(robust to a noisy machine), for ``quantize_many`` given kernel keys, given seeds (what AGoQ's
batches passed until session 7), and ``quantize_flat`` + ``dequantize_flat`` (AGoQ's batches
since: one buffer, no view or QTensor per tensor), timed in alternating rounds.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"  # (CPU tensors take the Triton host path; the launch is stubbed)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensors", type=int, default=42)
    a = ap.parse_args(argv)
    M = importlib.import_module("leantrain.ops.multi")
    from leantrain.ops.rng import kernel_key

    M.launch = lambda *args, **meta: None
    torch.manual_seed(0)
    xs = [torch.randn(4096 * (1 + i % 3), dtype=torch.bfloat16) for i in range(a.tensors)]
    bits = [4 if i % 4 else 8 for i in range(a.tensors)]
    keys = [kernel_key(i) for i in range(a.tensors)]

    seeds = list(range(a.tensors))

    def many_keys():
        M.dequantize_many(M.quantize_many(xs, bits=bits, stochastic=True, keys=keys, backend="triton"),
                          backend="triton")

    def many_seeds():
        M.dequantize_many(M.quantize_many(xs, bits=bits, stochastic=True, seeds=seeds, backend="triton"),
                          backend="triton")

    def flat():
        buf, lay = M.quantize_flat(xs, bits, seeds, stochastic=True, backend="triton")
        M.dequantize_flat(buf, [(o, x.shape, x.dtype, b) for o, x, b in zip(lay, xs, bits)], backend="triton")

    cases = {"quantize_many + dequantize_many (keys)": many_keys,
             "quantize_many + dequantize_many (seeds)": many_seeds,
             "quantize_flat + dequantize_flat (seeds)": flat}
    for f in cases.values():
        for _ in range(20):
            f()
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(25):
        for name, f in cases.items():
            t = time.perf_counter()
            for _ in range(20):
                f()
            best[name] = min(best[name], (time.perf_counter() - t) / 20)
    for name, b in best.items():
        print(f"{name:42s} host time, {a.tensors} tensors: {b * 1e6:.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Host time of one quantize_many + dequantize_many call pair, on the CPU, kernels stubbed out.

    PYTHONPATH=src python3 benchmarks/multi_host_cpu.py [--tensors 42]

AGoQ flushes ~40 saved tensors per call, 32 calls a step on the 1b preset at B = 8, and its
forward is host-bound on the H200: the Python around the launch (validation, allocations, the
launch table) is the cost measured here. ``launch`` is replaced by a no-op under the Triton
interpreter, so the host path is the GPU's. Prints the minimum over 25 rounds of 20 call pairs
(robust to a noisy machine).
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

    def pair():
        M.dequantize_many(M.quantize_many(xs, bits=bits, stochastic=True, keys=keys, backend="triton"),
                          backend="triton")

    for _ in range(20):
        pair()
    best = float("inf")
    for _ in range(25):
        t = time.perf_counter()
        for _ in range(20):
            pair()
        best = min(best, (time.perf_counter() - t) / 20)
    print(f"quantize_many + dequantize_many host time, {a.tensors} tensors: {best * 1e6:.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())

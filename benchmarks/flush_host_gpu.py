"""Host time of one AGoQ batch flush on the GPU (``PackBatch.flush``: quantize_flat's table,
allocation and launch), with the GPU idle and with it busy behind queued work.

    PYTHONPATH=src python3 benchmarks/flush_host_gpu.py --out DIR

14 bf16 tensors of one 1b layer's 4-bit saves (8192 x 2048, and the two 8192 x 5632), packed
by one batch; median host µs of 50 flushes (no sync inside a timed flush); then the same with
~20 ms of matmuls queued before each flush; then one ``launch`` of the quantize kernel alone
(the table made beforehand) and one 8192 x 2048 bf16 ``torch.empty`` + copy for scale.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args(argv)
    from leantrain.agoq.pack import PackBatch

    dev = "cuda"
    shapes = [(8192, 2048)] * 5 + [(8192, 5632)] * 2
    xs = [torch.randn(s, device=dev, dtype=torch.bfloat16) for s in shapes] * 2  # 14 members
    a_mm = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    def one_flush(busy: bool) -> float:
        if busy:
            for _ in range(8):  # ~20 ms of GPU work queued
                a_mm @ a_mm
        b = PackBatch(128, True, True, "auto")
        ps = [b.register(x, 4, i) for i, x in enumerate(xs)]
        t = time.perf_counter()
        b.flush()
        dt = time.perf_counter() - t
        del ps
        return dt * 1e6

    res = {}
    for busy in (False, True):
        ts = []
        for i in range(a.reps + 3):
            torch.cuda.synchronize()
            dt = one_flush(busy)
            if i >= 3:
                ts.append(dt)
        torch.cuda.synchronize()
        res["flush_us_gpu_busy" if busy else "flush_us_gpu_idle"] = {"median": statistics.median(ts), "min": min(ts)}
    for busy in (False, True):  # a 2 KiB pageable host-to-device copy, the table's path
        ts = []
        for _ in range(a.reps):
            torch.cuda.synchronize()
            if busy:
                for _ in range(8):
                    a_mm @ a_mm
            h = torch.frombuffer(bytearray(2048), dtype=torch.int64)
            t = time.perf_counter()
            h.to(dev, non_blocking=True)
            ts.append((time.perf_counter() - t) * 1e6)
        torch.cuda.synchronize()
        res["h2d_2KiB_us_" + ("busy" if busy else "idle")] = {"median": statistics.median(ts), "min": min(ts)}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "flush_host.json"), "w") as f:
        json.dump(res, f, indent=1)
    for k, v in res.items():
        print(f"{k:28s} median {v['median']:8.1f} us  min {v['min']:8.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Host time of a graphed FORGE step's bookkeeping around the replay, on the CPU.

    PYTHONPATH=src python3 benchmarks/forge_graph_host.py [--layers 155] [--out FILE]

``GraphedStep`` calls ``ForgeOptimizer._graph_prepare`` before each replay (the replay guard and
the device scalar table's upload: host time there delays the replay, the GPU waits) and
``_graph_advance`` after launching it (the step counts: hidden behind the GPU). This times both
with ``--layers`` fused layers (155: the 1b preset's), the table on the CPU (the upload's device
copy is not counted), the median and minimum over 30 rounds of 50 calls.
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
from torch import nn  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=155)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import leantrain as lt
    from leantrain.forge.optimizer import _DynTable

    model = nn.Sequential(*[nn.Linear(16, 16, bias=False) for _ in range(a.layers)])
    opt = lt.forge.attach(model, lt.optim.AdamW(lr=1e-3), state_dtype="bf16", backend="torch")
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    opt._dyn = _DynTable(len(opt.layers), "cpu")
    opt._graph_slots = [layer.slot for layer in opt.layers]
    prep, adv = [], []
    for r in range(35):
        tp = ta = 0.0
        for _ in range(50):
            t = time.perf_counter()
            opt._graph_prepare()
            tp += time.perf_counter() - t
            t = time.perf_counter()
            opt._graph_advance()
            ta += time.perf_counter() - t
            opt._step_id += 1  # (what opt.step() does)
        if r >= 5:  # (warm-up rounds)
            prep.append(tp / 50 * 1e6)
            adv.append(ta / 50 * 1e6)
    row = {"layers": a.layers, "prepare_us_median": statistics.median(prep), "prepare_us_min": min(prep),
           "advance_us_median": statistics.median(adv), "advance_us_min": min(adv)}
    print(json.dumps(row))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(row, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""AGoQ's gradient error and saved bytes with and without derived saves (``Policy.derive``), CPU.

    PYTHONPATH=src python3 benchmarks/tools/agoq_derive_error.py --out DIR

Tiny preset, one batch B = 8, T = 128 (as ``bench_agoq.py --errors``). For ``derive`` in "",
"silu", "silu,mul" and three rounding-noise seeds: the relative error of all parameters'
gradients together (``gradient_error``'s total), the worst down_proj layer's, and the bytes
the packer holds. Writes ``agoq_derive_error.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))


def main(argv=None) -> int:
    import torch

    from leantrain.agoq import Policy, gradient_error, quantize_activations
    from leantrain.agoq.calibrate import param_grads
    from leantrain.config import preset
    from leantrain.model import Llama

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seeds", type=int, default=3)
    a = ap.parse_args(argv)
    cfg = preset("tiny").model
    torch.manual_seed(0)
    m = Llama(cfg)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, cfg.vocab_size, (8, 128), generator=g),
                torch.randint(0, cfg.vocab_size, (8, 128), generator=g))]
    ref = param_grads(m, batches)
    rows = []
    for derive in ("", "silu", "silu,mul"):
        r = {"derive": derive, "total": [], "down_proj_worst": []}
        for seed in range(a.seeds):
            pol = Policy(derive=derive, seed=seed)
            e = gradient_error(m, batches, pol, reference=ref)
            r["total"].append(e["total"])
            r["down_proj_worst"].append(max(v for k, v in e["per_param"].items() if "down_proj" in k))
        with quantize_activations(m, Policy(derive=derive)) as pk:
            m(*batches[0])
        r["bytes_kept"] = pk.summary()["bytes_kept"]
        r["bytes_raw"] = pk.summary()["bytes_raw"]
        rows.append(r)
        print(json.dumps(r))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "agoq_derive_error.json").write_text(json.dumps(rows, indent=1))
    lines = ["# AGoQ derived saves: gradient error and bytes (tiny, B = 8, T = 128, CPU)", "",
             "`PYTHONPATH=src python3 benchmarks/tools/agoq_derive_error.py --out DIR`; error = |g_AGoQ - g| / |g| over "
             f"the parameters named, for {a.seeds} rounding-noise seeds.", "",
             "| derive | error, all parameters | worst down_proj layer | bytes held / raw |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r['derive'] or '(off)'}` | " + ", ".join(f"{x:.4f}" for x in r["total"]) + " | "
                     + ", ".join(f"{x:.4f}" for x in r["down_proj_worst"])
                     + f" | {r['bytes_kept'] / 2**20:.2f} / {r['bytes_raw'] / 2**20:.2f} MiB |")
    (out / "agoq_derive_error.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How an fp8 (e4m3) second moment changes AdamW's update, on the states of a real run.

    PYTHONPATH=src python3 benchmarks/parts/fp8_second_moment.py --runs RUN [RUN ...] --out FILE.json

``RUN``: the directory of a training run (e.g. the bf16-state runs that ``bench_convergence.py
--state-fidelity`` leaves in the directory it prints). For each it reads the last checkpoint (the
AdamW states of every 2-D parameter of at least ``MIN_NUMEL`` elements, the ones that get 8-bit
states) and stores each
second moment ``v`` in the 16 x 16 blocks of ``"fp8"`` two ways: the e4m3 of ``v`` itself, and the
e4m3 of ``sqrt(v)`` (what ``StateStorage("fp8")`` keeps). Reported per way: the share of nonzero
``v`` that decode to 0 (e4m3 holds ``2**-9 / 448 ~ 4.4e-6`` of a block's max at the least, so ``v``
itself loses what lies below that, its root only what lies below ``~2e-11`` in ``v``), the share of
elements whose update ``|m / (sqrt(v) + eps)|`` grows more than 2x, the largest such growth, and
the relative L2 error of the update per tensor (first moments exact here: only ``v`` is encoded).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from leantrain.optim.state import MIN_NUMEL, dequantize_fp8, quantize_fp8
from leantrain.runtime.checkpoint import unflatten

EPS = 1e-8  # AdamW's eps (lt.optim.AdamW's default, the trainer's)


def _moments(step_dir: Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(m, v)`` in fp32 of every 2-D parameter with 8-bit-sized states, from a checkpoint directory."""
    tensors = load_file(str(step_dir / "state.rank0.safetensors"))
    state = unflatten(json.loads((step_dir / "state.rank0.json").read_text()), tensors)
    out = []
    for st in state["optimizer"]["state"].values():
        m, v = st.get("exp_avg"), st.get("exp_avg_sq")
        if m is not None and m.dim() == 2 and m.numel() >= MIN_NUMEL:
            out.append((m.float(), v.float()))
    return out


def _effect(pairs, root: bool) -> dict:
    n = flushed = grown = 0
    worst, errors = 1.0, []
    for m, v in pairs:
        # (unsigned: StateStorage's "fp8", the root; signed: the e4m3 of v itself, v >= 0 taken as is)
        codes, absmax = quantize_fp8(v, signed=not root)
        vq = dequantize_fp8(codes, absmax, not root, v.shape)
        u, uq = m / (v.sqrt() + EPS), m / (vq.sqrt() + EPS)
        ratio = (uq.abs() / u.abs())[m != 0]
        n += v.numel()
        flushed += int(((vq == 0) & (v > 0)).sum())
        grown += int((ratio > 2).sum())
        worst = max(worst, float(ratio.max()))
        errors.append(float((uq - u).norm() / u.norm()))
    return {"elements": n, "v_flushed_share": flushed / n, "update_grown_2x_share": grown / n,
            "update_worst_growth": worst, "update_rel_l2_max": max(errors),
            "update_rel_l2_mean": sum(errors) / len(errors)}


def second_moment_encoding(step_dir: Path) -> dict:
    """The two encodings of ``v`` (module docstring) on the states saved in ``step_dir``."""
    pairs = _moments(Path(step_dir))
    return {"e4m3_of_v": _effect(pairs, root=False), "e4m3_of_sqrt_v": _effect(pairs, root=True)}


def main(argv=None) -> int:
    import argparse
    import sys

    from leantrain.runtime.checkpoint import latest

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    runs = {Path(r).name: second_moment_encoding(latest(r)) for r in args.runs}
    result = {"what": "AdamW second moments of real runs' last checkpoints stored as fp8 (16 x 16 blocks): e4m3 of v "
                      "vs e4m3 of sqrt(v); v flushed to 0, growth of the update |m / (sqrt(v) + eps)|, its relative "
                      "L2 error per tensor",
              "command": "PYTHONPATH=src python3 benchmarks/parts/fp8_second_moment.py --runs "
                         + " ".join(Path(r).name for r in args.runs) + f" --out {args.out}",
              "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for name, r in runs.items():
        for way, e in r.items():
            print(f"{name} {way:>15}: v flushed {100 * e['v_flushed_share']:.3f} %, update > 2x "
                  f"{100 * e['update_grown_2x_share']:.3f} % (worst {e['update_worst_growth']:.3g}x), "
                  f"update rel. L2 mean {e['update_rel_l2_mean']:.3g} / max {e['update_rel_l2_max']:.3g}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

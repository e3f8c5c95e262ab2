"""Validation (and training) loss curves of several runs in one plot.

    python3 benchmarks/tools/plot_loss.py --out loss.png LABEL=metrics.jsonl [LABEL=metrics.jsonl ...]

Reads the trainer's ``metrics.jsonl`` (one JSON object per logged step; ``val_loss`` at
evaluation steps) and prints the validation losses as a table.
"""

from __future__ import annotations

import argparse
import json
import sys


def read(path: str) -> tuple[dict[int, float], dict[int, float]]:
    train, val = {}, {}
    with open(path) as f:
        for line in f:
            d = json.loads(line)
            if "loss" in d:
                train[d["step"]] = d["loss"]
            if "val_loss" in d:
                val[d["step"]] = d["val_loss"]
    return train, val


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="")
    ap.add_argument("runs", nargs="+", help="LABEL=path/to/metrics.jsonl")
    a = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4.5))
    runs = []
    for spec in a.runs:
        label, _, path = spec.partition("=")
        train, val = read(path)
        runs.append((label, val))
        s = sorted(train)
        ax0.plot(s, [train[i] for i in s], label=label, lw=0.8)
        v = sorted(val)
        ax1.plot(v, [val[i] for i in v], marker="o", label=label)
    ax0.set(xlabel="step", ylabel="training loss", title="training loss")
    ax1.set(xlabel="step", ylabel="validation loss", title="validation loss")
    for ax in (ax0, ax1):
        ax.grid(alpha=0.3)
        ax.legend()
    if a.title:
        fig.suptitle(a.title)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    steps = sorted(set().union(*(v.keys() for _, v in runs)))
    print("| step | " + " | ".join(label for label, _ in runs) + " |")
    print("|---" * (len(runs) + 1) + "|")
    for s in steps:
        print(f"| {s} | " + " | ".join(f"{v[s]:.4f}" if s in v else "" for _, v in runs) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The whole training step through the trainer: tokens/s and peak memory of recipes on a preset,
for this source tree and, optionally, a baseline tree (``--base DIR``, holding ``src/``), run in
alternation so that both see the same machine state.

    PYTHONPATH=src python3 benchmarks/bench_step.py --out benchmarks/results/step [--base DIR]
        [--preset 1b] [--steps 12] [--batch 4] [--rounds 3] [--recipe NAME=FLAGS ...]

Each run is ``python -m leantrain train`` in a subprocess (its own CUDA context); its
``summary.json`` gives tokens/s (the timed steps: the first is a warm-up) and the allocator's peak.
Writes ``<date>_<hardware>_trainer[-vs-base].json`` and ``.md``: every run, and per recipe the
median tokens/s of each tree and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import harness

RECIPES = {"baseline": "--baseline", "forge_agoq": "--forge --agoq"}


def run_one(src: Path, preset: str, steps: int, batch: int, flags: str, out: Path) -> dict:
    cmd = [sys.executable, "-m", "leantrain", "train", "--preset", preset, "--steps", str(steps),
           "--data.batch-size", str(batch), "--data.max-corpus-mb", "2", "--train.eval-every", "0",
           "--train.ckpt-every", "0", "--optim.warmup-steps", "2", "--train.sample-tokens", "0",
           "--train.progress", "false", "--out", str(out), *flags.split()]
    env = {**os.environ, "PYTHONPATH": str(src)}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        return {"error": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"}
    s = json.loads((out / "summary.json").read_text())
    return {"recipe_name": s.get("recipe"),
            **{k: s.get(k) for k in ("tokens_per_second", "peak_memory_bytes", "final_loss")}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/step")
    ap.add_argument("--base", help="a directory holding the baseline tree's src/")
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--recipe", action="append", help="NAME=FLAGS (default: baseline and forge_agoq)")
    ap.add_argument("--name", help="the result files' name (default: trainer, or trainer-vs-base with --base)")
    a = ap.parse_args(argv)
    recipes = dict(r.split("=", 1) for r in a.recipe) if a.recipe else RECIPES
    trees = {"this": harness.ROOT / "src"}
    if a.base:
        trees["base"] = Path(a.base).resolve() / "src"
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(a.rounds):
            for tree, src in trees.items():
                for name, flags in recipes.items():
                    res = run_one(src, a.preset, a.steps, a.batch, flags, Path(tmp) / f"{tree}-{name}-{rnd}")
                    runs.append({"tree": tree, "recipe": name, "round": rnd, **res})
                    print(f"{tree:5s} {name:12s} round {rnd}: {res}", flush=True)
    table = {}
    for name in recipes:
        row = {}
        for tree in trees:
            tps = [r["tokens_per_second"] for r in runs if r["recipe"] == name and r["tree"] == tree
                   and r.get("tokens_per_second")]
            row[tree] = statistics.median(tps) if tps else None
        if row.get("base") and row.get("this"):
            row["this_over_base"] = row["this"] / row["base"]
        losses = {t: [r.get("final_loss") for r in runs if r["recipe"] == name and r["tree"] == t] for t in trees}
        if a.base:
            row["same_final_losses"] = losses["this"] == losses["base"]
        table[name] = row
    what = a.name or ("trainer-vs-base" if a.base else "trainer")
    res = {"what": f"the {a.preset} step through the trainer, B = {a.batch}, {a.steps} steps, median of "
                   f"{a.rounds} alternated rounds", "command": harness.command(),
           "env": harness.env(), "recipes": recipes, "median_tokens_per_second": table, "runs": runs}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / harness.stem(what)
    stem.with_suffix(".json").write_text(json.dumps(res, indent=1))
    lines = [f"# {res['what']}", "", "| recipe | " + " | ".join(f"{t} tok/s" for t in trees)
             + (" | this / base | same losses |" if a.base else " | peak GiB |"),
             "|---" * (len(trees) + 2 + bool(a.base)) + "|"]
    for name, row in table.items():
        cells = [f"{row[t]:.0f}" if row[t] else "-" for t in trees]
        if not a.base:
            peaks = [r["peak_memory_bytes"] for r in runs if r["recipe"] == name and r.get("peak_memory_bytes")]
            cells.append(f"{max(peaks) / 2**30:.2f}" if peaks else "-")
        if a.base:
            cells.append(f"{row['this_over_base']:.3f}" if "this_over_base" in row else "-")
            cells.append("yes" if row.get("same_final_losses") else "no")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

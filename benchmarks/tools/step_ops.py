"""Aten ops and host syncs per training step through the trainer, for this tree and optionally a
base tree (``--base DIR``, holding ``src/``): what a change adds to each step, on the CPU or a GPU.

    python3 benchmarks/tools/step_ops.py [--base DIR] [--out FILE] -- train --preset tiny --baseline \
        --steps 12 --train.eval-every 0 --train.ckpt-every 0 --train.sample-tokens 0 --train.progress false

Each tree runs ``leantrain <args>`` in a subprocess (``PYTHONPATH=<tree>/src``, a fresh ``--out``)
under a ``TorchDispatchMode``. A step is the span from one call of the LR scheduler's ``step`` to
the next (the trainer calls it once a step, at its end), so the count needs nothing of a tree's
internals; step ``s``'s span holds the loop's bookkeeping after step ``s - 1`` and step ``s``.
A host sync is an op that reads a value on the host: ``aten::_local_scalar_dense`` (``.item()``,
``float(t)``, ``bool(t)``), ``is_nonzero``, ``equal``, ``nonzero``, ``masked_select``, a copy of a
device tensor to the CPU, or a ``Tensor.tolist`` call (on a CPU tensor no aten op). Prints per tree
the ops and syncs of steps 2 .. n (step 1 holds the setup), the syncs' call sites, and the ops of
the median step in which the trees differ; ``--out`` writes them as JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SYNC_OPS = ("_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select")


def count_child(out_json: str, argv: list[str]) -> None:
    """Run ``leantrain argv`` in this process and write the per-step counts to ``out_json``."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from leantrain import cli

    ops: list[collections.Counter] = [collections.Counter()]
    syncs: list[collections.Counter] = [collections.Counter()]
    sites: collections.Counter = collections.Counter()

    def site() -> str:
        frames = [f for f in traceback.extract_stack()[:-3] if "leantrain" in f.filename or "torch/optim" in f.filename
                  or "torch/nn" in f.filename]
        return " <- ".join(f"{f.filename.split('site-packages/')[-1].split('/src/')[-1]}:{f.lineno}" for f in frames[-3:])

    def sync(name: str) -> None:
        syncs[-1][name] += 1
        sites[(len(syncs) - 1, name, site())] += 1

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = str(func)
            ops[-1][name] += 1
            to_host = "_to_copy" in name and str(kwargs.get("device")) == "cpu" and any(
                isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in args)
            if to_host or any(s in name for s in SYNC_OPS):
                sync(name)
            return func(*args, **kwargs)

    real_tolist, real_sched_step = torch.Tensor.tolist, torch.optim.lr_scheduler.LRScheduler.step

    def tolist(t):
        sync("Tensor.tolist")
        return real_tolist(t)

    def sched_step(self, *a, **k):
        out = real_sched_step(self, *a, **k)
        ops.append(collections.Counter())
        syncs.append(collections.Counter())
        return out

    torch.Tensor.tolist, torch.optim.lr_scheduler.LRScheduler.step = tolist, sched_step
    with Count():
        try:
            cli.main(argv)
        except SystemExit:
            pass
    # span 0: the run up to the scheduler's construction (its own first call); 1: the rest of the
    # setup and step 1; s: step s; the last: after the last step. Steps 2 .. n are kept.
    steps = list(range(2, len(ops) - 1))
    Path(out_json).write_text(json.dumps({
        "first_step": 2, "ops": [dict(ops[i]) for i in steps], "syncs": [dict(syncs[i]) for i in steps],
        "sites": [[i, name, where, n] for (i, name, where), n in sites.items() if i in steps]}))


def run_tree(src: Path, args: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "counts.json"
        cmd = [sys.executable, __file__, "--child", str(out), "--", *args, "--out", str(Path(tmp) / "run")]
        r = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(src)}, capture_output=True, text=True)
        if r.returncode != 0 or not out.exists():
            raise SystemExit(f"{src}: {r.stderr.strip()[-2000:]}")
        return json.loads(out.read_text())


def report(name: str, res: dict) -> list[str]:
    n_ops = [sum(c.values()) for c in res["ops"]]
    n_syncs = [sum(c.values()) for c in res["syncs"]]
    first = res["first_step"]
    lines = [f"== {name}: steps {first} .. {first + len(n_ops) - 1}", f"aten ops per step:   {n_ops}",
             f"host syncs per step: {n_syncs}", "host syncs by call site (over those steps):"]
    by_site = collections.Counter()
    for _, op, where, n in res["sites"]:
        by_site[(op, where)] += n
    for (op, where), n in by_site.most_common():
        lines.append(f"  {n:4d} {op} at {where}")
    return lines


def median_step(res: dict) -> collections.Counter:
    n_ops = [sum(c.values()) for c in res["ops"]]
    return collections.Counter(res["ops"][n_ops.index(statistics.median_low(n_ops))])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        count_child(argv[1], argv[3:])
        return 0
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", help="a directory holding the base tree's src/")
    ap.add_argument("--out", help="a JSON file for the counts")
    a = ap.parse_args(argv[:split])
    args = argv[split + 1:] or ["train", "--preset", "tiny", "--baseline", "--steps", "12", "--train.eval-every", "0",
                                "--train.ckpt-every", "0", "--train.sample-tokens", "0", "--train.progress", "false"]
    trees = {"this": ROOT / "src", **({"base": Path(a.base).resolve() / "src"} if a.base else {})}
    results = {name: run_tree(src, args) for name, src in trees.items()}
    lines = [line for name, res in results.items() for line in report(name, res)]
    if a.base:
        this, base = median_step(results["this"]), median_step(results["base"])
        lines.append(f"== median step's ops, this - base: {dict(this - base)}; base - this: {dict(base - this)}")
    print("\n".join(lines))
    if a.out:
        Path(a.out).write_text(json.dumps({"args": args, "trees": {k: str(v) for k, v in trees.items()},
                                           "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Fine-tuning methods side by side: MeZO, GRZO and back-propagation (AdamW) on a generated task,
each at a few learning rates and seeds, from one trained checkpoint.

    PYTHONPATH=src python3 benchmarks/bench_finetune.py --from runs/default --task compare \\
        --out benchmarks/results/DIR [--methods mezo:1e-4,3e-4 grzo:3e-6,1e-5 full:1e-4] [--seeds 0 1 2]

Every run is ``leantrain.train.finetune.finetune`` (the CLI's code); its ``summary.json`` goes to
``DIR/runs/<task>-<method>-<lr>-s<seed>/``. ``finetune.json`` holds every summary and
``finetune.md`` a table: accuracy before and after (mean and each seed), seconds a step, the
counted memory against the weights, and on CUDA the allocator's peak against inference's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from leantrain.train.finetune import finetune  # noqa: E402

DEFAULT_METHODS = ["mezo:3e-5,1e-4,3e-4", "grzo:3e-6,1e-5,3e-5", "full:1e-4"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--from", dest="source", help="run or checkpoint directory (default: random weights)")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--task", default="compare")
    ap.add_argument("--methods", nargs="*", default=DEFAULT_METHODS, help="method:lr,lr,...")
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--eval-examples", type=int, default=512)
    ap.add_argument("--device")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    t0 = time.time()
    for spec in a.methods:
        method, lrs = spec.split(":")
        for lr in (float(x) for x in lrs.split(",")):
            for seed in a.seeds:
                name = f"{a.task}-{method}-{lr:g}-s{seed}"
                s = finetune(method=method, task=a.task, out=str(out / "runs" / name), source=a.source,
                             preset=a.preset, steps=a.steps, lr=lr, batch_size=a.batch_size,
                             eval_examples=a.eval_examples, seed=seed, log_every=max(1, a.steps // 4),
                             device=a.device, log=lambda *x: None)
                rows.append(s)
                print(f"[{time.time() - t0:6.0f}s] {name}: accuracy {s['accuracy_before']:.3f} -> "
                      f"{s['accuracy_after']:.3f}, loss {s['eval_loss_after']:.4f}", flush=True)
    (out / "finetune.json").write_text(json.dumps(rows, indent=1))
    lines = [f"# Fine-tuning on `{a.task}`, {a.steps} steps of {a.batch_size} examples, seeds {a.seeds}",
             "", f"From: {rows[0]['from']}; device {rows[0]['device']}.", "",
             "| method | lr | accuracy before | accuracy after (mean) | after, each seed | eval loss after (mean) "
             "| s / step | (weights + method) / weights | peak / inference peak (CUDA) |",
             "|---|---|---|---|---|---|---|---|---|"]
    groups: dict = {}
    for s in rows:
        groups.setdefault((s["method"], s["lr"]), []).append(s)
    for (method, lr), ss in groups.items():
        acc = [s["accuracy_after"] for s in ss]
        peak = [s["peak_vs_inference"] for s in ss if "peak_vs_inference" in s]
        lines.append(
            f"| {method} | {lr:g} | {ss[0]['accuracy_before']:.3f} | {statistics.mean(acc):.3f} | "
            f"{', '.join(f'{x:.3f}' for x in acc)} | {statistics.mean(s['eval_loss_after'] for s in ss):.4f} | "
            f"{statistics.mean(s['seconds_per_step'] for s in ss):.3f} | {ss[0]['memory_vs_weights']:.3f} | "
            f"{f'{max(peak):.3f}' if peak else '—'} |")
    (out / "finetune.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

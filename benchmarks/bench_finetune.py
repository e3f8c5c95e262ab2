"""Fine-tuning methods side by side: MeZO, GRZO, ChunkFT and back-propagation (AdamW, FORGE) on a
generated task, each at a few learning rates and seeds, from one trained checkpoint.

    PYTHONPATH=src python3 benchmarks/bench_finetune.py --from runs/default --task compare \\
        --out benchmarks/results/DIR [--methods mezo:1e-4,3e-4 grzo:3e-6,1e-5 full:1e-4] [--seeds 0 1 2]

Every run is ``leantrain finetune --task`` (the CLI, through the trainer); its ``summary.json`` goes
to ``DIR/runs/<task>-<method>-<lr>-s<seed>/``. ``finetune.json`` holds every summary and
``finetune.md`` a table: accuracy before and after (mean and each seed), seconds a step, the
counted memory against the weights, and on CUDA the allocator's peak against the weights.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from leantrain.cli import main as leantrain  # noqa: E402

DEFAULT_METHODS = ["mezo:3e-5,1e-4,3e-4", "grzo:3e-6,1e-5,3e-5", "full:1e-4"]


def counted_bytes(s: dict) -> int:
    """Weights plus what the method holds: its own count (ChunkFT, MeZO, GRZO), else the ledger's
    gradients and optimizer states."""
    mem = s["memory"]
    return mem["weights"] + s.get("method_bytes", mem["grads"] + mem["optimizer_states"])


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
                run = out / "runs" / name
                args = ["finetune", "--method", method, "--task", a.task, "--preset", a.preset, "--steps", str(a.steps),
                        "--optim.lr", str(lr), "--train.seed", str(seed), "--data.batch-size", str(a.batch_size),
                        "--finetune.eval-examples", str(a.eval_examples), "--train.progress", "false",
                        "--out", str(run), "--overwrite"]
                args += (["--from", a.source] if a.source else []) + (["--train.device", a.device] if a.device else [])
                with contextlib.redirect_stdout(io.StringIO()):
                    if leantrain(args) != 0:
                        raise SystemExit(f"{name} failed")
                s = {**json.loads((run / "summary.json").read_text()), "method": method, "lr": lr, "seed": seed,
                     "source": a.source or f"random weights of the {a.preset} preset",
                     "seconds_per_step": _seconds_per_step(run)}
                rows.append(s)
                print(f"[{time.time() - t0:6.0f}s] {name}: accuracy {s['initial_val_accuracy']:.3f} -> "
                      f"{s['val_accuracy']:.3f}, loss {s['val_loss']:.4f}", flush=True)
    (out / "finetune.json").write_text(json.dumps(rows, indent=1))
    lines = [f"# Fine-tuning on `{a.task}`, {a.steps} steps of {a.batch_size} examples, seeds {a.seeds}",
             "", f"From: {rows[0]['source']}; device {rows[0]['device']}.", "",
             "| method | lr | accuracy before | accuracy after (mean) | after, each seed | eval loss after (mean) "
             "| s / step | (weights + method) / weights | allocator peak / weights (CUDA) |",
             "|---|---|---|---|---|---|---|---|---|"]
    groups: dict = {}
    for s in rows:
        groups.setdefault((s["method"], s["lr"]), []).append(s)
    for (method, lr), ss in groups.items():
        acc = [s["val_accuracy"] for s in ss]
        peak = [s["peak_memory_bytes"] / s["memory"]["weights"] for s in ss if s["device"].startswith("cuda")]
        lines.append(
            f"| {method} | {lr:g} | {ss[0]['initial_val_accuracy']:.3f} | {statistics.mean(acc):.3f} | "
            f"{', '.join(f'{x:.3f}' for x in acc)} | {statistics.mean(s['val_loss'] for s in ss):.4f} | "
            f"{statistics.mean(s['seconds_per_step'] for s in ss):.3f} | "
            f"{counted_bytes(ss[0]) / ss[0]['memory']['weights']:.3f} | {f'{max(peak):.3f}' if peak else '—'} |")
    (out / "finetune.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def _seconds_per_step(run: Path) -> float:
    """The median of the steps' seconds, from ``metrics.jsonl``'s tokens a second (the first steps
    pay one-time costs; the median leaves them out)."""
    cfg = json.loads((run / "config.json").read_text())
    tokens = cfg["data"]["seq_len"] * cfg["data"]["batch_size"] * cfg["data"]["grad_accum"]
    rates = sorted(json.loads(line)["tokens_per_second"] for line in (run / "metrics.jsonl").read_text().splitlines())
    return tokens / rates[len(rates) // 2]


if __name__ == "__main__":
    sys.exit(main())

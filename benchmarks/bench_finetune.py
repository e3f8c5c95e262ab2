"""Fine-tuning methods side by side: MeZO, GRZO, ChunkFT and back-propagation (AdamW, FORGE) on a
generated task, each at a few learning rates and seeds, from one trained checkpoint.

    PYTHONPATH=src python3 benchmarks/bench_finetune.py --from runs/default --task compare \\
        --out benchmarks/results/DIR [--methods mezo:1e-4,3e-4 grzo:3e-6,1e-5 full:1e-4] [--seeds 0 1 2]

Every run is ``leantrain finetune --task`` (the CLI, through the trainer); its ``summary.json`` goes
to ``DIR/runs/<task>-<method>-<lr>-s<seed>/``. ``finetune.json`` holds every summary and
``finetune.md`` a table: accuracy before and after (mean and each seed), seconds a step, the
counted memory against the weights, and on CUDA the allocator's peak against the weights.

``--hf-preset P``: the path of a user's own model instead: a random model of preset ``P`` saved as
a Hugging Face directory (with the embedded corpus's tokenizer), fine-tuned by every method of
``--hf-methods`` on instruct JSONL written from the task's examples (``--eval-data``: its
multiple-choice form), one seed; ``hf.json`` holds each method's allocator peak (CUDA), tokens a
second, counted memory and validation loss and accuracy before and after::

    PYTHONPATH=src python3 benchmarks/bench_finetune.py --hf-preset 1b --steps 50 --batch-size 8 --out DIR

``--budgets B ...``: the ``--preset`` model fine-tuned on ``--task`` under each memory budget
(``--train.memory-budget``): ``budgets.json`` holds the plan each budget picked, its estimated
peak and the run's allocator peak and tokens/s::

    PYTHONPATH=src python3 benchmarks/bench_finetune.py --preset 7b --budgets 22GB 14.5GiB --steps 12 \
        --batch-size 1 --seq-len 1024 --eval-examples 16 --out DIR

``--lowmem``: the memory-first recipes (FORGE with bf16 weights and bf16 or int8 states, with AGoQ
or activation checkpointing; ChunkFT, and ChunkFT stepping inside backward) against full AdamW
(fp32), each continuing the training of ``--from`` on the embedded corpus (``leantrain train
--from``) at ``--lr`` for ``--steps`` steps, each seed of ``--seeds``: ``lowmem.json`` holds per
recipe and seed the validation loss and its ratio to full AdamW's of the same seed, and per recipe
the mean ratio; ``--flags "..."`` adds trainer flags to every run (``--train.dtype bf16``, ...)::

    PYTHONPATH=src python3 benchmarks/bench_finetune.py --lowmem --from runs/default --steps 200 --out DIR
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
sys.path.insert(0, str(SRC))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

from leantrain.cli import main as leantrain  # noqa: E402

DEFAULT_METHODS = ["mezo:3e-5,1e-4,3e-4", "grzo:3e-6,1e-5,3e-5", "full:1e-4"]
BF16 = ["--train.weights", "bf16"]
CKPT = ["--model.activation-checkpointing", "true"]
CHUNKFT_FORGE = ["--finetune.method", "chunkft", "--forge", *BF16, "--finetune.chunk-state-dtype", "bf16", *CKPT]
LOWMEM_RECIPES = {  # (flags of leantrain train)
    "full": [],
    "forge-bf16": ["--forge", *BF16, "--forge.state-dtype", "bf16"],
    "forge-int8-agoq": ["--forge", *BF16, "--forge.state-dtype", "int8", "--agoq"],
    "forge-int8-ckpt": ["--forge", *BF16, "--forge.state-dtype", "int8", *CKPT],
    "chunkft4": ["--finetune.method", "chunkft", "--finetune.num-chunks", "4"],
    "chunkft4-forge": [*CHUNKFT_FORGE, "--finetune.num-chunks", "4"],
    "chunkft8-forge": [*CHUNKFT_FORGE, "--finetune.num-chunks", "8"],
}
HF_METHODS = ["full", "forge", "forge+agoq", "chunkft", "mezo", "grzo"]


def write_task_jsonl(task: str, out: Path, n_train: int, n_eval: int, seed: int = 0) -> tuple[Path, Path]:
    """The task's examples as instruct lines (``train.jsonl``) and held-out multiple-choice lines
    (``val.jsonl``)."""
    from leantrain.data import tasks

    train, val = out / "train.jsonl", out / "val.jsonl"
    with open(train, "w") as f:
        for e in tasks.examples(task, n_train, seed=seed):
            f.write(json.dumps({"prompt": e.prompt, "response": e.candidates[e.label]}) + "\n")
    with open(val, "w") as f:
        for e in tasks.examples(task, n_eval, seed=seed + 1_000_003):
            f.write(json.dumps({"prompt": e.prompt, "choices": e.candidates, "answer": e.label}) + "\n")
    return train, val


def hf_model_dir(preset: str, out: Path) -> Path:
    """A random model of ``preset`` saved as a Hugging Face directory with the embedded corpus's tokenizer."""
    import torch

    from leantrain import config as config_mod
    from leantrain import data as data_mod
    from leantrain.model import Llama
    from leantrain.model.hf import save_hf

    cfg = config_mod.build(preset, overrides={"data.max_corpus_mb": "6"})  # (the tokenizer's sample)
    tok = data_mod.load(cfg.data, log=lambda *a: None).tokenizer
    cfg.model.vocab_size = tok.vocab_size
    torch.manual_seed(0)
    return save_hf(Llama(cfg.model), out, tokenizer=tok, overwrite=True)


def run_hf(a) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    hf = hf_model_dir(a.hf_preset, out / "hf_model")
    train, val = write_task_jsonl(a.task, out, n_train=max(a.steps * a.batch_size, 1024), n_eval=a.eval_examples)
    rows = []
    for method in a.hf_methods:
        name, *extra = method.split("+")
        run = out / "runs" / method
        args = ["finetune", "--from", str(hf), "--data", str(train), "--eval-data", str(val), "--method", name,
                *[f"--{x}" for x in extra], "--steps", str(a.steps), "--data.batch-size", str(a.batch_size),
                "--data.seq-len", str(a.seq_len), "--train.progress", "false", "--out", str(run), "--overwrite"]
        args += ["--train.device", a.device] if a.device else []
        t0 = time.time()
        rc = _own_process(args)  # (an allocator peak of its own: nothing left from the methods before)
        if rc != 0:
            rows.append({"method": method, "error": f"exit status {rc}"})
            _save_hf_result(a, out, rows)
            continue
        s = json.loads((run / "summary.json").read_text())
        rows.append({"method": method, "seconds": time.time() - t0, "steps": s["steps"],
                     "tokens_per_second": s["tokens_per_second"], "peak_memory_bytes": s["peak_memory_bytes"],
                     "counted_bytes": counted_bytes(s), "memory": s["memory"], "device": s["device"],
                     "initial_val_loss": s["initial_val_loss"], "val_loss": s["val_loss"],
                     "initial_val_accuracy": s.get("initial_val_accuracy"), "val_accuracy": s.get("val_accuracy")})
        r = rows[-1]
        print(f"{method}: peak {r['peak_memory_bytes'] / 2**30:.2f} GiB, {r['tokens_per_second']:.0f} tok/s, "
              f"val loss {r['initial_val_loss']:.4f} -> {r['val_loss']:.4f}", flush=True)
        shutil.rmtree(run / "checkpoints", ignore_errors=True)  # (the weights are not results)
        _save_hf_result(a, out, rows)
    return 0


def _own_process(args: list[str]) -> int:
    """``leantrain ARGS`` in a process of its own (its CUDA allocator's peak is its own); the exit
    status, the last lines of its output printed when it fails."""
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "leantrain", *args], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        print("\n".join((r.stdout + r.stderr).strip().splitlines()[-3:]), flush=True)
    return r.returncode


def _save_hf_result(a, out: Path, rows: list) -> None:
    """``hf.json``, written after every method: a run stopped by a time limit keeps what it finished."""
    result = {"command": harness.command(), "env": harness.env(),
              "preset": a.hf_preset, "task": a.task, "steps": a.steps, "batch_size": a.batch_size, "seq_len": a.seq_len,
              "methods": rows}
    (out / "hf.json").write_text(json.dumps(result, indent=1))


def _write_lowmem(a, out: Path, rows: list) -> dict:
    """Write ``lowmem.json`` from the runs so far; returns each recipe's mean ratio to full AdamW's
    validation loss over the seeds whose full run has finished."""
    full = {r["seed"]: r["val_loss"] for r in rows if r["recipe"] == "full"}
    for r in rows:
        if r["seed"] in full:
            r["ratio_to_full"] = r["val_loss"] / full[r["seed"]]
    ratios: dict[str, list[float]] = {}
    for r in rows:
        if "ratio_to_full" in r:
            ratios.setdefault(r["recipe"], []).append(r["ratio_to_full"])
    means = {name: statistics.mean(v) for name, v in ratios.items()}
    result = {"command": harness.command(), "env": harness.env(),
              "preset": a.preset, "data": "the embedded corpus", "steps": a.steps, "lr": a.lr, "batch_size": a.batch_size,
              "seq_len": a.seq_len, "seeds": a.seeds,
              "source": a.source or f"random weights of the {a.preset} preset", "runs": rows,
              "mean_ratio_to_full": means}
    (out / "lowmem.json").write_text(json.dumps(result, indent=1))
    return means


def run_lowmem(a) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    t0 = time.time()
    recipes = {name: LOWMEM_RECIPES[name] for name in (a.recipes or LOWMEM_RECIPES)}
    lrs = {name: float(lr) for name, lr in (x.split("=") for x in a.lr_of or [])}
    extra = shlex.split(a.flags)
    for seed in a.seeds:
        for name, flags in recipes.items():
            run = out / "runs" / f"{name}-s{seed}"
            args = ["train", "--preset", a.preset, "--steps", str(a.steps), "--train.seed", str(seed),
                    "--optim.lr", str(lrs.get(name, a.lr)), "--data.batch-size", str(a.batch_size), "--data.seq-len", str(a.seq_len),
                    "--train.eval-every",
                    str(a.steps), "--train.eval-batches", "32", "--train.progress", "false", "--train.ckpt-every", "0",
                    "--train.sample-tokens", "0", "--out", str(run), "--overwrite", *flags, *extra]
            args += (["--from", a.source] if a.source else []) + (["--train.device", a.device] if a.device else [])
            with contextlib.redirect_stdout(io.StringIO()):
                if leantrain(args) != 0:
                    raise SystemExit(f"{name} seed {seed} failed")
            s = json.loads((run / "summary.json").read_text())
            rows.append({"recipe": name, "seed": seed, "flags": [*flags, *extra], "lr": lrs.get(name, a.lr), "val_loss": s["val_loss"],
                         "counted_bytes": counted_bytes(s), "tokens_per_second": s["tokens_per_second"]})
            print(f"[{time.time() - t0:6.0f}s] {name} seed {seed}: val loss {s['val_loss']:.4f}", flush=True)
            means = _write_lowmem(a, out, rows)  # (after every run: a run cut short keeps what finished)
    for name, m in means.items():
        print(f"{name}: validation loss / full AdamW's = {m:.4f} (mean of {len(a.seeds)} seeds)")
    return 0


def run_budgets(a) -> int:
    """``--budgets``: the ``--preset`` model fine-tuned on ``--task`` under each memory budget: the
    plan the budget picked, its estimate, and the run's allocator peak and tokens/s."""
    from leantrain import config as config_mod
    from leantrain.train import budget

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for b in a.budgets:
        run = out / "runs" / f"{a.preset}-{b}"
        args = ["finetune", "--preset", a.preset, "--task", a.task, "--steps", str(a.steps), "--data.batch-size",
                str(a.batch_size), "--data.seq-len", str(a.seq_len), "--finetune.eval-examples", str(a.eval_examples),
                "--data.max-corpus-mb", "6", "--train.memory-budget", b, "--train.progress", "false",
                "--train.ckpt-every", "0", "--out", str(run), "--overwrite"]
        cfg = config_mod.build(a.preset, overrides={"data.batch_size": str(a.batch_size),
                                                    "data.seq_len": str(a.seq_len), "train.memory_budget": b})
        row = {"budget": b, "budget_bytes": budget.parse_bytes(b)}
        try:
            row["plan"] = budget.fit(cfg, log=lambda *_: None)
            est = budget.estimate(cfg)
            row["estimate"] = vars(est) | {"total": est.total}
        except config_mod.ConfigError as e:
            row["refused"] = str(e)
        t0 = time.time()
        rc = _own_process(args)
        row["seconds"] = time.time() - t0
        if rc == 0:
            s = json.loads((run / "summary.json").read_text())
            row.update({k: s.get(k) for k in ("recipe", "peak_memory_bytes", "tokens_per_second", "method_bytes",
                                              "initial_val_loss", "val_loss", "memory", "device")})
            print(f"{b}: {row['plan']}: peak {s['peak_memory_bytes'] / 2**30:.2f} GiB (estimate "
                  f"{row['estimate']['total'] / 2**30:.2f}), {s['tokens_per_second']:.0f} tok/s", flush=True)
        else:
            row["error"] = f"exit status {rc}"
            print(f"{b}: {row.get('refused', row['error'])}", flush=True)
        shutil.rmtree(run / "checkpoints", ignore_errors=True)
        rows.append(row)
        result = {"command": harness.command(), "env": harness.env(),
                  "preset": a.preset, "task": a.task, "steps": a.steps, "batch_size": a.batch_size,
                  "seq_len": a.seq_len, "runs": rows}
        (out / "budgets.json").write_text(json.dumps(result, indent=1))
    return 0


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
    ap.add_argument("--hf-preset", help="fine-tune a random model of this preset saved as a Hugging Face directory")
    ap.add_argument("--hf-methods", nargs="*", default=HF_METHODS, help="with --hf-preset: method[+agoq]")
    ap.add_argument("--seq-len", type=int, default=64, help="with --hf-preset or --lowmem: data.seq_len")
    ap.add_argument("--lowmem", action="store_true", help="the memory-first recipes against full AdamW, each seed")
    ap.add_argument("--lr", type=float, default=1e-3, help="with --lowmem: optim.lr")
    ap.add_argument("--recipes", nargs="*", choices=list(LOWMEM_RECIPES), help="with --lowmem: these (full first)")
    ap.add_argument("--lr-of", nargs="*", metavar="RECIPE=LR", help="with --lowmem: a recipe's own optim.lr")
    ap.add_argument("--flags", default="", help="with --lowmem: trainer flags added to every run (one string)")
    ap.add_argument("--budgets", nargs="*", help="fine-tune --preset under each of these memory budgets (24GB, ...)")
    a = ap.parse_args(argv)
    if a.hf_preset:
        return run_hf(a)
    if a.lowmem:
        return run_lowmem(a)
    if a.budgets:
        return run_budgets(a)
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

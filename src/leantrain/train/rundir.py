"""A run directory: what a run writes there, and the checks that keep two runs from mixing.

``prepare`` refuses a directory that holds a previous run unless the run resumes it or replaces
it (``--overwrite``). ``resume_mismatch`` compares the newest checkpoint's config with this run's
before anything is written: fields that may change on resume (``RESUMABLE``) are listed; any
other difference is named with the flag that would match the checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from leantrain.config import ConfigError

# what a run writes into its directory (``--overwrite`` removes these and nothing else)
RUN_FILES = ("metrics.jsonl", "config.json", "summary.json", "loss.png", "tokenizer.json", "checkpoints",
             "tensorboard", "wandb", "wandb_id.txt")  # (the last three: train.loggers, leantrain/train/trackers.py)

# config fields a resumed run may change: how long it runs (the schedule ends at the new
# train.steps), how it logs, evaluates, checkpoints and reports, and the collective timeout
RESUMABLE = (
    "train.steps", "train.log_every", "train.eval_every", "train.eval_batches", "train.ckpt_every",
    "train.keep_checkpoints", "train.sample_tokens", "train.progress", "train.threads", "train.loggers",
    "train.wandb_project", "dist.timeout_s",
)


def prepare(out: Path, *, resume: bool, overwrite: bool) -> None:
    """Make ``out`` ready for this run: refused when it is a file, or holds a previous run and
    neither ``resume`` nor ``overwrite`` is given; ``overwrite`` removes the previous run's files."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a directory; give a directory for the run")
    previous = [name for name in RUN_FILES if (out / name).exists()]
    if previous and not resume and not overwrite:
        raise ConfigError(f"{out} holds a previous run ({', '.join(previous)}): pass --resume to continue it, "
                          "--overwrite to replace it, or another --out")
    if previous and overwrite and not resume:
        for name in previous:
            p = out / name
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    out.mkdir(parents=True, exist_ok=True)


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else k
        out.update(_flat(v, key) if isinstance(v, dict) else {key: v})
    return out


def _flag_value(v) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, list | tuple):
        return ",".join(str(x) for x in v)
    return str(v)


# fields that may change with the number of processes when the checkpoint reshards
# (``checkpoint.reshardable``): the global batch, data.batch_size x processes, is checked instead
RESHARDABLE = ("data.batch_size", "dist.replicate")


def resume_mismatch(saved: dict, current: dict, *, world: int = 1, saved_world: int = 1,
                    reshard: bool = False) -> list[str]:
    """The fields (``section.field``) in which two ``Config.to_dict()`` trees differ, outside
    ``RESUMABLE``, each as "field saved (this run: value; pass --flag saved)"; and the number of
    processes, which may differ for a checkpoint that reshards (``reshard``) when the global
    batch stays the same."""
    a, b = _flat(saved), _flat(current)
    resharded = reshard and world != saved_world
    free = RESUMABLE + (RESHARDABLE if resharded else ())
    out = []
    for key in sorted(set(a) | set(b)):
        if key in free or key == "model.vocab_size":  # (vocab: set from the data, checked by its tokenizer)
            continue
        va, vb = a.get(key), b.get(key)
        if isinstance(va, list):
            va = tuple(va)
        if isinstance(vb, list):
            vb = tuple(vb)
        if va != vb and key in a:
            flag = "--preset" if key == "preset" else "--" + key.replace("_", "-")
            out.append(f"{key} {_flag_value(va)} (this run: {_flag_value(vb)}; pass {flag} {_flag_value(va)})")
    if world != saved_world and not reshard:
        out.append(f"{saved_world} processes (this run: {world}; run torchrun --nproc-per-node {saved_world})")
    elif resharded and "data.batch_size" in a:
        saved_batch, batch = a["data.batch_size"] * saved_world, b.get("data.batch_size", 0) * world
        if saved_batch != batch:
            fits = f"pass --data.batch-size {saved_batch // world}" if saved_batch % world == 0 else \
                f"use a number of processes that divides {saved_batch}"
            out.append(f"a global batch of {saved_batch} sequences (data.batch_size x processes; this run: "
                       f"{batch}; {fits})")
    return out


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the rows of ``metrics.jsonl`` up to ``step`` (a resumed run replays the later ones)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if line.strip() and json.loads(line)["step"] <= step:
                kept.append(line)
        except (ValueError, KeyError):
            continue  # (a line cut by an interrupted write)
    path.write_text("".join(x + "\n" for x in kept))

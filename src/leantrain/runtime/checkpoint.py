"""Checkpoints: safetensors for tensors, JSON for everything else, written atomically.

A checkpoint is a directory ``<out>/checkpoints/step_<N>/`` holding
``model.safetensors``, ``state.rank<R>.safetensors`` + ``state.rank<R>.json``
(the optimizer, scheduler and RNG state of rank R, as a nested structure
whose tensors live in the safetensors file and are referenced from the JSON
by key) and ``meta.json``. The directory is written under a temporary name and
renamed into place, so a crash never leaves a half-written checkpoint that
looks complete; ``latest()`` only considers directories with ``meta.json``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

_TENSOR = "__tensor__"


def flatten(obj, tensors: dict, prefix: str = "t"):
    """Replace every tensor in a nested structure by a reference; collect the tensors."""
    if isinstance(obj, torch.Tensor):
        key = f"{prefix}{len(tensors)}"
        tensors[key] = obj.detach().contiguous().cpu()
        return {_TENSOR: key}
    if isinstance(obj, dict):
        if not all(isinstance(k, (str, int)) for k in obj):
            raise TypeError(f"checkpoint: dict keys must be str or int, got {[type(k) for k in obj]}")
        return {"__dict__": [[k, flatten(v, tensors, prefix)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"__list__" if isinstance(obj, list) else "__tuple__": [flatten(v, tensors, prefix) for v in obj]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"checkpoint: cannot store a value of type {type(obj).__name__}")


def unflatten(obj, tensors: dict, device=None):
    if isinstance(obj, dict):
        if _TENSOR in obj:
            t = tensors[obj[_TENSOR]]
            return t.to(device) if device is not None else t
        if "__dict__" in obj:
            return {k: unflatten(v, tensors, device) for k, v in obj["__dict__"]}
        if "__list__" in obj:
            return [unflatten(v, tensors, device) for v in obj["__list__"]]
        if "__tuple__" in obj:
            return tuple(unflatten(v, tensors, device) for v in obj["__tuple__"])
    return obj


def save(out_dir: str | Path, step: int, model_state: dict, rank_state: dict, meta: dict, *,
         rank: int = 0, world: int = 1, barrier=lambda: None, keep: int = 2) -> Path:
    """Save one checkpoint. Every rank calls it; rank 0 writes the model and renames the directory."""
    root = Path(out_dir) / "checkpoints"
    final = root / f"step_{step:07d}"
    tmp = root / f".tmp_step_{step:07d}"
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    barrier()
    tensors: dict = {}
    tree = flatten(rank_state, tensors)
    save_file(tensors, str(tmp / f"state.rank{rank}.safetensors"))
    (tmp / f"state.rank{rank}.json").write_text(json.dumps(tree))
    if rank == 0:
        shared = _dedupe_shared(model_state)
        save_file(shared, str(tmp / "model.safetensors"))
    barrier()
    if rank == 0:
        (tmp / "meta.json").write_text(json.dumps({**meta, "step": step, "world_size": world}, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _prune(root, keep)
    barrier()
    return final


def _dedupe_shared(state: dict) -> dict:
    """safetensors refuses aliased tensors (tied weights): store each storage once, contiguous."""
    out, seen = {}, {}
    for k, v in state.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
        if key in seen:
            continue
        seen[key] = k
        out[k] = v.detach().contiguous().cpu().clone()
    return out


def _prune(root: Path, keep: int) -> None:
    steps = sorted(p for p in root.glob("step_*") if (p / "meta.json").exists())
    for p in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(p, ignore_errors=True)


def latest(out_dir: str | Path) -> Path | None:
    root = Path(out_dir) / "checkpoints"
    if not root.exists():
        return None
    steps = sorted(p for p in root.glob("step_*") if (p / "meta.json").exists())
    return steps[-1] if steps else None


def load(path: str | Path, *, rank: int = 0, device=None) -> tuple[dict, dict, dict]:
    """(model state, this rank's state, meta) of a checkpoint directory."""
    model_state, meta = load_model_state(path)
    return model_state, load_rank_state(path, rank=rank, device=device)[0], meta


def load_model_state(path: str | Path) -> tuple[dict, dict]:
    """(model state, meta) of a checkpoint directory, without any rank's state."""
    path = Path(path)
    return load_file(str(path / "model.safetensors")), json.loads((path / "meta.json").read_text())


def load_rank_state(path: str | Path, *, rank: int = 0, device=None) -> tuple[dict, dict]:
    """(this rank's state, meta) of a checkpoint directory, without the model's weights."""
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    f = path / f"state.rank{rank}.safetensors"
    if not f.exists():
        raise FileNotFoundError(
            f"checkpoint {path} has no state for rank {rank} (saved with world size {meta.get('world_size')}); "
            "resume with the same number of processes"
        )
    tensors = load_file(str(f))
    tree = json.loads((path / f"state.rank{rank}.json").read_text())
    return unflatten(tree, tensors, device), meta

"""Checkpoints: safetensors for tensors, JSON for everything else, written atomically and verified.

A checkpoint is a directory ``<out>/checkpoints/step_<N>/`` holding
``model.safetensors``, ``state.rank<R>.safetensors`` + ``state.rank<R>.json``
(the optimizer, scheduler and RNG state of rank R, as a nested structure
whose tensors live in the safetensors file and are referenced from the JSON
by key) and ``meta.json``. A checkpoint of sharded weights (``"format": "dcp"`` in its
``meta.json``, :mod:`leantrain.runtime.dcp`) holds the files of ``torch.distributed.checkpoint``
and the per-rank ``state.rank<R>.*`` without the optimizer, instead of ``model.safetensors``.

``meta.json`` carries the manifest: the step, the world size and the byte size
and sha256 of every other file of the directory (sha256: ``sha256sum`` checks a file by
hand; blake2b is not reliably faster, both hash about 500 MB/s on one CPU core:
``hash_mb_per_s`` in ``benchmarks/results/data/2026-12-04_cpu.json``). Writing order: every file is written and fsynced, then
``meta.json`` (a temporary file, fsynced, renamed), then the directory, written under
a temporary name, is renamed into place. A crash or a full disk therefore never
leaves a directory that looks complete, and the previous checkpoint is untouched
until the new one is in place.

Checkpoints are ordered by the step recorded in ``meta.json``, never by name.
``latest_intact()`` verifies the newest and falls back to the newest intact older
one, naming each skipped checkpoint and what is wrong with it; ``load()`` verifies
the files it reads and raises ``CheckpointError`` (one sentence naming the file and
the checkpoint) for damaged ones.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

_TENSOR = "__tensor__"
META = "meta.json"
HASH = "sha256"
DCP_FORMAT = "dcp"  # meta.json's "format" of a torch.distributed.checkpoint checkpoint (leantrain.runtime.dcp)
DCP_MODEL = "model"  # the model's part of a DCP checkpoint's state dict (keys "model.<parameter name>")
_READ_BLOCK = 8 * 2**20


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read: the message is one sentence naming the file and the checkpoint."""


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


# ---------------------------------------------------------------- files


def file_digest(path: Path) -> str:
    """The hex sha256 of a file, read in blocks (memory independent of the file's size)."""
    h = hashlib.new(HASH)
    with open(path, "rb") as f:
        while block := f.read(_READ_BLOCK):
            h.update(block)
    return h.hexdigest()


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        _fsync_file(path)
    except OSError:  # (some filesystems cannot fsync a directory; the rename is still atomic)
        pass


def _write_json(path: Path, obj) -> None:
    """Write JSON through a temporary file, fsynced, renamed into place."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _manifest(directory: Path) -> dict:
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.name != META and not p.name.endswith(".tmp"))
    return {"hash": HASH, "files": {p.name: {"bytes": p.stat().st_size, HASH: file_digest(p)} for p in files}}


def _read_meta(path: Path) -> tuple[dict | None, str]:
    """(meta, "") or (None, what is wrong with the checkpoint's ``meta.json``)."""
    try:
        meta = json.loads((path / META).read_text())
    except FileNotFoundError:
        return None, f"no manifest ({META}): written by an interrupted save"
    except (OSError, ValueError) as e:
        return None, f"{META} cannot be read ({e})"
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        return None, f"{META} records no step"
    return meta, ""


def read_meta(path: str | Path) -> dict:
    """The ``meta.json`` of a checkpoint directory; ``CheckpointError`` when it is missing or unreadable."""
    meta, wrong = _read_meta(Path(path))
    if meta is None:
        raise CheckpointError(f"checkpoint {path}: {wrong}")
    return meta


def problems(path: str | Path, *, names=None, checksums: bool = True) -> list[str]:
    """What is wrong with a checkpoint directory (an empty list: intact).

    ``names``: check only these files of the manifest (all when None); ``checksums=False``
    compares sizes only. A checkpoint without a manifest in its ``meta.json`` (an older
    format) is checked for presence of the files only.
    """
    path = Path(path)
    meta, wrong = _read_meta(path)
    if meta is None:
        return [wrong]
    manifest = meta.get("manifest")
    if manifest is None:
        wanted = names if names is not None else ["model.safetensors"]
        return [f"{n} is missing" for n in wanted if not (path / n).is_file()]
    out = []
    for name, rec in manifest["files"].items():
        if names is not None and name not in names:
            continue
        f = path / name
        if not f.is_file():
            out.append(f"{name} is missing")
            continue
        size = f.stat().st_size
        if size != rec["bytes"]:
            out.append(f"{name} is {'truncated' if size < rec['bytes'] else 'larger than written'} "
                       f"({size} of {rec['bytes']} bytes)")
        elif checksums and file_digest(f) != rec[manifest.get("hash", HASH)]:
            out.append(f"checksum mismatch in {name}")
    for name in names or ():
        if name not in manifest["files"]:
            out.append(f"{name} is not in the manifest")
    return out


def verify(path: str | Path, *, names=None) -> None:
    """Raise ``CheckpointError`` naming the checkpoint and its damaged files, if any."""
    found = problems(path, names=names)
    if found:
        raise CheckpointError(f"checkpoint {path} is damaged: {'; '.join(found)}")


# ---------------------------------------------------------------- order


def _step_dirs(root: Path) -> list[Path]:
    return [p for p in root.glob("step_*") if p.is_dir()] if root.is_dir() else []


def checkpoints(out_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, directory) of every checkpoint with a readable ``meta.json``, oldest step first."""
    found = []
    for p in _step_dirs(Path(out_dir) / "checkpoints"):
        meta, _ = _read_meta(p)
        if meta is not None:
            found.append((meta["step"], p))
    return sorted(found, key=lambda sp: (sp[0], sp[1].name))


def latest(out_dir: str | Path) -> Path | None:
    """The checkpoint with the highest step in its ``meta.json`` (not verified; see ``latest_intact``)."""
    found = checkpoints(out_dir)
    return found[-1][1] if found else None


def latest_intact(out_dir: str | Path, *, checksums: bool = True) -> tuple[Path | None, list[str]]:
    """(the newest checkpoint whose files match its manifest, one warning per checkpoint skipped).

    Checkpoints are tried from the highest step down; each damaged one newer than the one
    returned, and each directory without a manifest (an interrupted save), gets a warning
    naming its path and what is wrong. ``(None, warnings)`` when no checkpoint is intact.
    """
    warnings = []
    for p in _step_dirs(Path(out_dir) / "checkpoints"):
        meta, wrong = _read_meta(p)
        if meta is None:
            warnings.append(f"skipping checkpoint {p}: {wrong}")
    for _, p in reversed(checkpoints(out_dir)):
        found = problems(p, checksums=checksums)
        if not found:
            return p, warnings
        warnings.append(f"skipping checkpoint {p}: {'; '.join(found)}")
    return None, warnings


def resolve(source: str | Path, log=print) -> Path | None:
    """A checkpoint directory as given, or the newest intact checkpoint of a run directory (each
    damaged one skipped is logged); None when ``source`` is neither."""
    path = Path(source)
    if (path / "meta.json").exists():
        return path
    ckpt, warnings = latest_intact(path)
    for w in warnings:
        log(f"warning: {w}")
    return ckpt


# ---------------------------------------------------------------- save


def save(out_dir: str | Path, step: int, model_state: dict, rank_state: dict, meta: dict, *,
         rank: int = 0, world: int = 1, barrier=lambda: None, keep: int = 2) -> Path:
    """Save one checkpoint. Every rank calls it; rank 0 writes the model and the manifest and renames the directory.

    A failed write (a full disk, say) removes the partial temporary directory, leaves the
    previous checkpoints as they were and raises ``CheckpointError`` saying which step is intact.
    ``keep`` > 0 keeps the checkpoint just written and the ``keep - 1`` newest intact others (by step).
    Under several ranks the rank whose write fails raises; the others wait at ``barrier`` until
    the launcher ends the job (torchrun ends every rank when one exits with an error). Rank 0
    hashes every rank's files for the manifest, so the ranks must share the filesystem.
    """

    def write(tmp: Path) -> None:
        write_rank_state(tmp, rank, rank_state)
        if rank == 0:
            _save_tensors(_dedupe_shared(model_state), tmp / "model.safetensors")

    return save_with(write, out_dir, step, meta, rank=rank, world=world, barrier=barrier, keep=keep)


def save_with(write, out_dir: str | Path, step: int, meta: dict, *, rank: int = 0, world: int = 1,
              barrier=lambda: None, keep: int = 2) -> Path:
    """The atomic save of :func:`save` around ``write(tmp_dir)``, which every rank calls to write
    its files into the checkpoint's temporary directory (flat: the manifest lists its files)."""
    root = Path(out_dir) / "checkpoints"
    final = root / f"step_{step:07d}"
    tmp = root / f".tmp_step_{step:07d}"
    if rank == 0:
        try:
            for stale in root.glob(".tmp_step_*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir(parents=True)
        except OSError as e:
            _write_failed(e, step, root, tmp)
    barrier()
    try:
        write(tmp)
    except OSError as e:
        _write_failed(e, step, root, tmp)
    barrier()
    if rank == 0:
        try:
            _write_json(tmp / META, {**meta, "step": step, "world_size": world, "manifest": _manifest(tmp)})
            _fsync_dir(tmp)
            _install(tmp, final)
            _fsync_dir(root)
        except OSError as e:
            _write_failed(e, step, root, tmp)
        prune(root.parent, keep, written=final)
    barrier()
    return final


def write_rank_state(directory: Path, rank: int, state: dict) -> None:
    """``state.rank<R>.safetensors`` + ``state.rank<R>.json``: a nested structure, its tensors apart."""
    tensors: dict = {}
    tree = flatten(state, tensors)
    _save_tensors(tensors, directory / f"state.rank{rank}.safetensors")
    _write_json(directory / f"state.rank{rank}.json", tree)


def _save_tensors(tensors: dict, path: Path) -> None:
    save_file(tensors, str(path))
    _fsync_file(path)


def _install(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``; an existing ``final`` (the same step saved again) is replaced only after."""
    if not final.exists():
        os.replace(tmp, final)
        return
    old = final.with_name(".old_" + final.name)
    shutil.rmtree(old, ignore_errors=True)
    os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def _write_failed(err: OSError, step: int, root: Path, tmp: Path):
    shutil.rmtree(tmp, ignore_errors=True)
    reason = os.strerror(err.errno) if err.errno else str(err)
    previous = next((s for s, p in reversed(checkpoints(root.parent)) if not problems(p, checksums=False)), None)
    kept = (f"the checkpoint of step {previous} is intact" if previous is not None
            else "there is no earlier checkpoint")
    raise CheckpointError(f"could not write checkpoint step {step} to {root}: {reason}; {kept}") from err


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


def prune(out_dir: str | Path, keep: int, *, written: Path | None = None) -> list[Path]:
    """Remove old checkpoints, keeping ``written`` and the ``keep - 1`` newest intact others (by step).

    Intact here means every file of the manifest has its recorded size (no checksums: pruning
    runs after every save). Damaged checkpoints are removed with the old ones. Returns the
    removed directories; ``keep`` <= 0 removes nothing.
    """
    if keep <= 0:
        return []
    kept, removed = 1 if written is not None else 0, []
    for _, p in reversed(checkpoints(out_dir)):
        if written is not None and p == written:
            continue
        if kept < keep and not problems(p, checksums=False):
            kept += 1
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


# ---------------------------------------------------------------- load


def load(path: str | Path, *, rank: int = 0, device=None, verify_files: bool = True) -> tuple[dict, dict, dict]:
    """(model state, this rank's state, meta) of a checkpoint directory.

    The files read are verified against the manifest first (``verify_files=False`` skips the
    checksums, e.g. right after ``latest_intact``); a damaged file raises ``CheckpointError``.
    """
    model_state, meta = load_model_state(path, verify_files=verify_files)
    return model_state, load_rank_state(path, rank=rank, device=device, verify_files=verify_files)[0], meta


def load_model_state(path: str | Path, *, verify_files: bool = True) -> tuple[dict, dict]:
    """(model state, meta) of a checkpoint directory, without any rank's state; a sharded
    (``"format": "dcp"``) checkpoint's weights are put together whole, in this process."""
    path = Path(path)
    meta = read_meta(path)
    if meta.get("format") == DCP_FORMAT:
        if verify_files:
            verify(path)
        return dcp_model_state(path), meta
    if verify_files:
        verify(path, names=["model.safetensors"])
    return _load_tensors(path, "model.safetensors"), meta


def dcp_model_state(path: str | Path) -> dict:
    """The whole weights of a DCP checkpoint (parameter name -> CPU tensor), read in this process
    alone (no process group needed, none used when there is one)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    prefix = DCP_MODEL + "."
    state = {key: torch.empty(md.size, dtype=md.properties.dtype)
             for key, md in metadata.state_dict_metadata.items()
             if key.startswith(prefix) and isinstance(md, TensorStorageMetadata)}
    if not state:
        raise CheckpointError(f"checkpoint {path}: its DCP files hold no model weights")
    with warnings.catch_warnings():  # (DCP warns that it loads in one process: that is the intent)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return {key[len(prefix):]: t for key, t in state.items()}


def reshardable(meta: dict) -> bool:
    """Whether a checkpoint (its ``meta.json``) can be loaded at another world size."""
    return meta.get("format") == DCP_FORMAT


def load_rank_state(path: str | Path, *, rank: int = 0, device=None, verify_files: bool = True) -> tuple[dict, dict]:
    """(this rank's state, meta) of a checkpoint directory, without the model's weights."""
    path = Path(path)
    meta = read_meta(path)
    f = path / f"state.rank{rank}.safetensors"
    if not f.exists():
        raise FileNotFoundError(
            f"checkpoint {path} has no state for rank {rank} (saved with world size {meta.get('world_size')}); "
            "resume with the same number of processes"
        )
    names = [f.name, f"state.rank{rank}.json"]
    if verify_files:
        verify(path, names=names)
    tensors = _load_tensors(path, f.name)
    try:
        tree = json.loads((path / names[1]).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: {names[1]} cannot be read ({e})") from None
    return unflatten(tree, tensors, device), meta


def _load_tensors(path: Path, name: str) -> dict:
    try:
        return load_file(str(path / name))
    except (SafetensorError, OSError) as e:
        what = os.strerror(e.errno) if isinstance(e, OSError) and e.errno else str(e)
        raise CheckpointError(f"checkpoint {path}: {name} cannot be read ({what})") from None


"""Checkpoint files: manifests, ordering by step, damaged checkpoints, full disks and pruning."""

import errno
import json

import pytest
import safetensors.torch
import torch

from leantrain.runtime import checkpoint
from leantrain.runtime.checkpoint import CheckpointError


def _save(out, step, keep=0, value=None, **kw):
    model = {"w": torch.full((64, 64), float(step if value is None else value)), "b": torch.arange(8.0)}
    rank_state = {"step": step, "optimizer": {"m": torch.ones(16) * step, "lr": 0.1}}
    return checkpoint.save(out, step, model, rank_state, {"config": {"name": "t"}}, keep=keep, **kw)


def test_manifest_records_step_world_and_every_file(tmp_path):
    path = _save(tmp_path, 5)
    meta = json.loads((path / "meta.json").read_text())
    assert meta["step"] == 5 and meta["world_size"] == 1 and meta["config"] == {"name": "t"}
    files = meta["manifest"]["files"]
    assert set(files) == {"model.safetensors", "state.rank0.safetensors", "state.rank0.json"}
    for name, rec in files.items():
        assert rec["bytes"] == (path / name).stat().st_size
        assert rec["sha256"] == checkpoint.file_digest(path / name)
    assert checkpoint.problems(path) == []
    assert not list((tmp_path / "checkpoints").glob(".*"))  # no temporary left behind
    model, state, meta = checkpoint.load(path)
    assert torch.equal(model["w"], torch.full((64, 64), 5.0)) and torch.equal(state["optimizer"]["m"], torch.ones(16) * 5)


def test_latest_orders_by_recorded_step_not_by_name(tmp_path):
    for step in (200, 9_000_000, 12_000_000):
        _save(tmp_path, step)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_0000200", "step_12000000", "step_9000000"]  # by name, 12 M would not be the newest
    assert checkpoint.latest(tmp_path).name == "step_12000000"
    assert [s for s, _ in checkpoint.checkpoints(tmp_path)] == [200, 9_000_000, 12_000_000]
    # a directory whose name disagrees with its step: the recorded step decides
    (tmp_path / "checkpoints" / "step_12000000").rename(tmp_path / "checkpoints" / "step_0000001")
    assert checkpoint.latest(tmp_path).name == "step_0000001"


def test_truncated_newest_falls_back_to_older_with_a_warning(tmp_path):
    _save(tmp_path, 10)
    newest = _save(tmp_path, 20)
    f = newest / "model.safetensors"
    size = f.stat().st_size
    f.write_bytes(f.read_bytes()[:1234])
    path, warnings = checkpoint.latest_intact(tmp_path)
    assert path.name == "step_0000010"
    assert warnings == [f"skipping checkpoint {newest}: model.safetensors is truncated (1234 of {size} bytes)"]
    with pytest.raises(CheckpointError) as e:
        checkpoint.load(newest)
    msg = str(e.value)
    assert "model.safetensors" in msg and str(newest) in msg and "truncated" in msg and "\n" not in msg
    assert checkpoint.load(path)[2]["step"] == 10


def test_flipped_byte_is_a_checksum_mismatch(tmp_path):
    older = _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    f = newest / "state.rank0.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0x01
    f.write_bytes(bytes(raw))
    path, warnings = checkpoint.latest_intact(tmp_path)
    assert path == older
    assert warnings == [f"skipping checkpoint {newest}: checksum mismatch in state.rank0.safetensors"]
    checkpoint.load_model_state(newest)  # the model file itself is intact
    with pytest.raises(CheckpointError, match="checksum mismatch in state.rank0.safetensors"):
        checkpoint.load_rank_state(newest)
    assert checkpoint.latest_intact(tmp_path, checksums=False)[0] == newest  # sizes alone do not see it


def test_directory_without_manifest_is_an_interrupted_save(tmp_path):
    older = _save(tmp_path, 3)
    partial = tmp_path / "checkpoints" / "step_0000004"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"\0" * 10)
    assert checkpoint.latest(tmp_path) == older
    path, warnings = checkpoint.latest_intact(tmp_path)
    assert path == older
    assert warnings == [f"skipping checkpoint {partial}: no manifest (meta.json): written by an interrupted save"]
    with pytest.raises(CheckpointError, match="no manifest"):
        checkpoint.load(partial)


def test_no_intact_checkpoint(tmp_path):
    assert checkpoint.latest_intact(tmp_path) == (None, [])
    only = _save(tmp_path, 7)
    (only / "model.safetensors").unlink()
    path, warnings = checkpoint.latest_intact(tmp_path)
    assert path is None and warnings == [f"skipping checkpoint {only}: model.safetensors is missing"]


def test_unreadable_safetensors_without_manifest_is_a_checkpoint_error(tmp_path):
    """A checkpoint of the format without a manifest is read unverified; a broken file still gives one sentence."""
    path = _save(tmp_path, 1)
    meta = json.loads((path / "meta.json").read_text())
    del meta["manifest"]
    (path / "meta.json").write_text(json.dumps(meta))
    (path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"model.safetensors cannot be read") as e:
        checkpoint.load(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("fail_on", ["model.safetensors", "state.rank0.json", "meta.json"])
def test_full_disk_keeps_the_previous_checkpoint(tmp_path, monkeypatch, fail_on):
    previous = _save(tmp_path, 100)
    real_save, real_write = safetensors.torch.save_file, checkpoint._write_json

    def save_file(tensors, filename, *a, **kw):
        if filename.endswith(fail_on):
            with open(filename, "wb") as f:  # half a file, then the disk is full
                f.write(b"\0" * 100)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(tensors, filename, *a, **kw)

    def write_json(path, obj):
        if path.name == fail_on:
            path.with_name(path.name + ".tmp").write_text("{")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(path, obj)

    monkeypatch.setattr(checkpoint, "save_file", save_file)
    monkeypatch.setattr(checkpoint, "_write_json", write_json)
    root = tmp_path / "checkpoints"
    with pytest.raises(CheckpointError) as e:
        _save(tmp_path, 200, keep=1)
    assert str(e.value) == (f"could not write checkpoint step 200 to {root}: No space left on device; "
                            "the checkpoint of step 100 is intact")
    assert sorted(p.name for p in root.iterdir()) == ["step_0000100"]  # the partial directory is gone
    assert checkpoint.latest_intact(tmp_path) == (previous, [])
    assert checkpoint.load(previous)[2]["step"] == 100


def test_full_disk_without_previous_checkpoint(tmp_path, monkeypatch):
    def save_file(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_file", save_file)
    with pytest.raises(CheckpointError, match="step 3 .*No space left on device; there is no earlier checkpoint"):
        _save(tmp_path, 3)
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_saving_the_same_step_again_replaces_it(tmp_path):
    _save(tmp_path, 4, value=1.0)
    path = _save(tmp_path, 4, value=2.0)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_0000004"]
    assert checkpoint.load(path)[0]["w"][0, 0] == 2.0


def test_pruning_keeps_the_newest_by_step_and_the_one_just_written(tmp_path):
    for step in (200, 9_000_000, 12_000_000):
        _save(tmp_path, step, keep=2)
    assert [s for s, _ in checkpoint.checkpoints(tmp_path)] == [9_000_000, 12_000_000]
    # a run writing a lower step than what is there (a directory reused): its checkpoint stays
    _save(tmp_path, 50, keep=2)
    assert [s for s, _ in checkpoint.checkpoints(tmp_path)] == [50, 12_000_000]
    _save(tmp_path, 60, keep=1)
    assert [s for s, _ in checkpoint.checkpoints(tmp_path)] == [60]


def test_pruning_never_removes_the_only_intact_older_checkpoint(tmp_path):
    intact = _save(tmp_path, 10, keep=2)
    damaged = _save(tmp_path, 20, keep=2)
    (damaged / "model.safetensors").write_bytes(b"\0" * 3)
    _save(tmp_path, 30, keep=2)  # keeps 30 and the newest intact other (10); the damaged 20 goes
    assert [s for s, _ in checkpoint.checkpoints(tmp_path)] == [10, 30]
    assert intact.exists() and not damaged.exists()


def test_tied_weights_are_stored_once(tmp_path):
    w = torch.randn(4, 4)
    path = checkpoint.save(tmp_path, 1, {"emb": w, "head": w}, {}, {})
    model, _ = checkpoint.load_model_state(path)
    assert list(model) == ["emb"] and torch.equal(model["emb"], w)

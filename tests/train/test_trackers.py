"""Experiment trackers (``train.loggers``): what TensorBoard and W&B receive, read back from their
files; nothing on ranks other than 0 or with only jsonl; one sentence naming the extra to install
when a package is missing; unknown logger names refused when the config is built."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from leantrain import config as C
from leantrain.config import ConfigError
from leantrain.train.trackers import WANDB_ID_FILE, open_trackers

SRC = str(Path(__file__).resolve().parents[2] / "src")

ROWS = [
    {"step": 1, "loss": 4.5, "lr": 1e-3, "tokens_per_second": 1000.0, "grad_norm": 2.0},
    {"step": 2, "loss": 4.25, "lr": 2e-3, "tokens_per_second": 1100.0, "grad_norm": 1.5, "skipped": True},
    {"step": 3, "loss": 4.0, "lr": 3e-3, "tokens_per_second": 1200.0, "val_loss": 4.125, "note": "text"},
]


def _events(log_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _scalars(acc, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in acc.Scalars(tag)}


def test_tensorboard_gets_each_numeric_field_at_its_step_and_the_config(tmp_path):
    pytest.importorskip("tensorboard")
    cfg = C.build("tiny", overrides={"train.loggers": "jsonl,tensorboard", "optim.lr": "0.0125"})
    with open_trackers(cfg, tmp_path, rank=0, resume=False) as trackers:
        for row in ROWS:
            trackers.log(row)
    acc = _events(tmp_path / "tensorboard")
    assert _scalars(acc, "train/loss") == {1: 4.5, 2: 4.25, 3: 4.0}
    assert _scalars(acc, "train/grad_norm") == {1: 2.0, 2: 1.5}
    assert _scalars(acc, "train/skipped") == {2: 1.0}
    assert _scalars(acc, "val/val_loss") == {3: 4.125}
    assert "train/note" not in acc.Tags()["scalars"] and "train/step" not in acc.Tags()["scalars"]
    (config_event,) = acc.Tensors("config/text_summary")
    text = config_event.tensor_proto.string_val[0].decode()
    assert text.startswith("```json\n") and text.endswith("\n```")
    assert json.loads(text.removeprefix("```json\n").removesuffix("\n```")) == json.loads(json.dumps(cfg.to_dict()))


def test_tensorboard_resumed_run_replaces_the_steps_after_its_checkpoint(tmp_path):
    pytest.importorskip("tensorboard")
    cfg = C.build("tiny", overrides={"train.loggers": "tensorboard"})
    with open_trackers(cfg, tmp_path, rank=0, resume=False) as trackers:
        for row in ROWS:
            trackers.log(row)
    with open_trackers(cfg, tmp_path, rank=0, resume=True, start_step=2) as trackers:
        trackers.log({"step": 3, "loss": 3.5})
        trackers.log({"step": 4, "loss": 3.25})
    events = _events(tmp_path / "tensorboard").Scalars("train/loss")
    assert [(e.step, e.value) for e in events] == [(1, 4.5), (2, 4.25), (3, 3.5), (4, 3.25)]


@pytest.mark.parametrize("rank,loggers", [(1, "jsonl,tensorboard,wandb"), (0, "jsonl"), (0, "")])
def test_other_ranks_and_jsonl_alone_write_nothing(tmp_path, rank, loggers):
    cfg = C.build("tiny", overrides={"train.loggers": loggers})
    trackers = open_trackers(cfg, tmp_path, rank=rank, resume=False)
    for row in ROWS:
        trackers.log(row)
    trackers.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("package,modules", [
    ("tensorboard", ("tensorboard", "torch.utils.tensorboard")),
    ("wandb", ("wandb",)),
])
def test_a_missing_package_names_the_extra_to_install(tmp_path, monkeypatch, package, modules):
    for name in list(sys.modules):  # (a later import finds the None below, as if not installed)
        if any(name == m or name.startswith(m + ".") for m in modules):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, modules[0], None)
    cfg = C.build("tiny", overrides={"train.loggers": f"jsonl,{package}"})
    with pytest.raises(ConfigError, match=rf"train.loggers {package} needs the {package} package: "
                                          rf"pip install 'leantrain\[{package}\]'"):
        open_trackers(cfg, tmp_path, rank=0, resume=False)
    assert not (tmp_path / "tensorboard").exists()


@pytest.mark.parametrize("loggers,bad", [("jsonl,mlflow", "'mlflow'"), ("tensorbord", "'tensorbord'")])
def test_unknown_logger_names_are_refused_with_the_valid_ones(loggers, bad):
    with pytest.raises(ConfigError, match=rf"train.loggers names the unknown logger\(s\) {bad}; "
                                          "choose a comma-separated list of jsonl, tensorboard, wandb"):
        C.build("tiny", overrides={"train.loggers": loggers})
    assert C.build("tiny", overrides={"train.loggers": " jsonl , tensorboard,wandb"}).train.loggers


def test_importing_the_trainer_imports_no_tracker_package():
    code = ("import sys, leantrain.train.trainer, leantrain.train.trackers; "
            "print([m for m in ('tensorboard', 'torch.utils.tensorboard', 'wandb') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"}, check=True)
    assert out.stdout.strip() == "[]"


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """W&B offline, silent, its settings and caches in the test's directory."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))
    return wandb


def test_wandb_offline_run_holds_the_rows_and_resume_continues_its_id(tmp_path, wandb_offline):
    cfg = C.build("tiny", overrides={"train.loggers": "jsonl,wandb", "train.wandb_project": "trackers-test"})
    out = tmp_path / "run"
    out.mkdir()
    with open_trackers(cfg, out, rank=0, resume=False) as trackers:
        run_id = trackers.wandb_run.id
        assert trackers.wandb_run.project == "trackers-test"
        assert trackers.wandb_run.config["optim"]["lr"] == cfg.optim.lr
        for row in ROWS:
            trackers.log(row)
    assert (out / WANDB_ID_FILE).read_text().strip() == run_id
    (run_file,) = (out / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    keys = (b"train/loss", b"val/val_loss", b"tokens_per_second")
    deadline = time.time() + 60  # W&B's service process writes the offline file after finish() returns
    while not all(k in run_file.read_bytes() for k in keys) and time.time() < deadline:
        time.sleep(0.2)
    data = run_file.read_bytes()
    assert all(k in data for k in keys)

    with open_trackers(cfg, out, rank=0, resume=True, start_step=3) as trackers:
        assert trackers.wandb_run.id == run_id
        trackers.log({"step": 4, "loss": 3.5})
    with open_trackers(cfg, out, rank=0, resume=False) as trackers:  # (a new run: a new W&B run)
        new_id = trackers.wandb_run.id
    assert new_id != run_id and (out / WANDB_ID_FILE).read_text().strip() == new_id

"""Experiment trackers: the rows of ``metrics.jsonl`` sent to TensorBoard and / or Weights & Biases.

``train.loggers`` lists them, comma-separated: ``jsonl`` (the run's ``metrics.jsonl``, which the
trainer always writes, so it adds nothing here), ``tensorboard`` and ``wandb``. Only rank 0 logs.

- ``tensorboard``: ``torch.utils.tensorboard.SummaryWriter`` writing to ``<out>/tensorboard``; each
  numeric field of a row is a scalar ``train/<field>`` at the row's step (``val_*`` fields:
  ``val/<field>``); the resolved config is a text entry ``config`` (JSON) at the step the run starts
  from. A resumed run drops the events after its checkpoint's step (``purge_step``): the trainer
  logs those steps again.
- ``wandb``: one W&B run in project ``train.wandb_project`` with the resolved config, its files
  under ``<out>/wandb``. Its id is kept in ``<out>/wandb_id.txt``: a resumed run continues the same
  W&B run (W&B ignores a step below the last one it has, so it keeps the first values of steps
  logged again after a resume). W&B's own settings apply: ``WANDB_MODE=offline`` logs without a
  network or an account (``wandb sync <out>/wandb/offline-run-*`` uploads it later).

Both packages are optional extras (``pip install 'leantrain[tensorboard]'``, ``'leantrain[wandb]'``)
and are imported by ``open_trackers`` only when asked for.
"""

from __future__ import annotations

import json
import numbers
import secrets
from pathlib import Path

from leantrain.config import Config, ConfigError, logger_names

WANDB_ID_FILE = "wandb_id.txt"


class Trackers:
    """The open trackers of a run (none: ``log`` and ``close`` do nothing). Made by ``open_trackers``;
    a context manager that closes them."""

    def __init__(self, *, tensorboard=None, wandb_run=None):
        self.tensorboard, self.wandb_run = tensorboard, wandb_run

    def log(self, row: dict) -> None:
        """Send one row of ``metrics.jsonl`` (``"step"`` and its fields) to every tracker. Numeric
        fields (bools as 0 / 1) are sent as ``train/<field>``, ``val_*`` fields as ``val/<field>``;
        other values are skipped."""
        if self.tensorboard is None and self.wandb_run is None:
            return
        step = int(row["step"])
        scalars = {f"{'val' if key.startswith('val_') else 'train'}/{key}": float(value)
                   for key, value in row.items() if key != "step" and isinstance(value, numbers.Real)}
        if self.tensorboard is not None:
            for tag, value in scalars.items():
                self.tensorboard.add_scalar(tag, value, global_step=step)
        if self.wandb_run is not None:
            self.wandb_run.log(scalars, step=step)

    def close(self) -> None:
        """Write out and close every tracker (the W&B run is finished)."""
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_trackers(cfg: Config, out_dir: Path, *, rank: int, resume: bool, start_step: int = 0) -> Trackers:
    """The trackers ``cfg.train.loggers`` names, logging into the run directory ``out_dir``; on a
    rank other than 0, or with only ``jsonl``, a ``Trackers`` that does nothing.

    ``resume``: the run continues ``out_dir``'s previous run from step ``start_step`` (TensorBoard
    drops that run's events after ``start_step``; W&B continues the run whose id ``wandb_id.txt``
    holds). A missing package raises ``ConfigError`` naming the extra to install."""
    names = set(logger_names(cfg.train.loggers))
    if rank != 0 or not names & {"tensorboard", "wandb"}:
        return Trackers()
    out_dir = Path(out_dir)
    tensorboard = None
    if "tensorboard" in names:
        tensorboard = _open_tensorboard(cfg, out_dir, resume=resume, start_step=start_step)
    try:
        wandb_run = _open_wandb(cfg, out_dir, resume=resume) if "wandb" in names else None
    except BaseException:
        if tensorboard is not None:
            tensorboard.close()
        raise
    return Trackers(tensorboard=tensorboard, wandb_run=wandb_run)


def _missing(package: str, error: ImportError) -> ConfigError:
    return ConfigError(f"train.loggers {package} needs the {package} package: pip install 'leantrain[{package}]' "
                       f"(importing it failed: {error})")


def _open_tensorboard(cfg: Config, out_dir: Path, *, resume: bool, start_step: int):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise _missing("tensorboard", e) from e
    # events after the checkpoint's step are logged again by the resumed run
    purge_step = start_step + 1 if resume else None
    writer = SummaryWriter(str(out_dir / "tensorboard"), purge_step=purge_step)
    config_json = json.dumps(cfg.to_dict(), indent=1)
    writer.add_text("config", f"```json\n{config_json}\n```", global_step=start_step)
    return writer


def _open_wandb(cfg: Config, out_dir: Path, *, resume: bool):
    try:
        import wandb
    except ImportError as e:
        raise _missing("wandb", e) from e
    id_file = out_dir / WANDB_ID_FILE
    if resume and id_file.is_file() and id_file.read_text().strip():
        run_id = id_file.read_text().strip()
    else:
        run_id = secrets.token_hex(8)
        out_dir.mkdir(parents=True, exist_ok=True)
        id_file.write_text(run_id + "\n")
    try:
        return wandb.init(project=cfg.train.wandb_project, dir=str(out_dir), config=cfg.to_dict(),
                          id=run_id, resume="allow")
    except wandb.errors.Error as e:
        raise ConfigError(f"train.loggers wandb could not start a W&B run ({e}): log in with `wandb login`, "
                          "or set WANDB_MODE=offline to log without an account") from e

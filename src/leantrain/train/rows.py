"""The run's per-step bookkeeping: the rows of ``metrics.jsonl`` (:class:`StepRows`, which also
feed the progress line and the trackers) and the stop signals (:class:`StopSignals`)."""

from __future__ import annotations

import json
import math
import signal
import threading
import time

import torch
import torch.distributed as dist

from leantrain.train.progress import Progress
from leantrain.train.trackers import Trackers


class StopSignals:
    """SIGINT / SIGTERM ask the run to stop after the current step (a second SIGINT stops it at
    once: the default handler again). Installed in the main thread only. Under torchrun the ranks
    agree on the step: ``requested`` all-reduces the signal number, so a signal to any one rank (or
    to torchrun, which passes it to every rank) stops every rank after the same step."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum = 0
        self._old = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.signum = signum
        signal.signal(signal.SIGINT, signal.default_int_handler)  # (a second Ctrl-C: at once)

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def requested(self, world: int, device) -> bool:
        if world == 1:
            return self.signum != 0
        signum = torch.tensor([float(self.signum)], device=device)
        dist.all_reduce(signum, op=dist.ReduceOp.MAX)
        agreed = int(signum.item())
        # a signal whose handler ran as the all-reduce returned (Python runs it after the blocking
        # call) is not in this round's result: it stays in self.signum for the next check
        if agreed:
            self.signum = agreed
        return agreed != 0


class StepRows:
    """The rows of ``metrics.jsonl``. A step's loss (and grad norm, non-finite count) stay on the
    device until a log step: ``add`` keeps each step's row pending, and once the step after a log
    step (``every``) has been issued, the rows up to the log step are read together (one wait for
    the device, none on the steps between) and written; the host does not wait for each backward,
    and issues the next step while the device runs the last. ``flush`` writes every pending row
    (before an evaluation or a checkpoint, and at the end). A row's ``tokens_per_second`` is
    measured on the host between one step's ``add`` and the next. A non-finite loss (not a skipped
    step) raises ``stop(step, loss)`` when its row is written, after the rows before it."""

    def __init__(self, path, *, append: bool, tokens_per_step: int, progress: Progress, peak, stop,
                 trackers: Trackers | None = None, every: int = 1):
        self.file = open(path, "a" if append else "w") if path is not None else None
        self.trackers = trackers or Trackers()
        self.tokens_per_step, self.progress, self.peak, self.stop = tokens_per_step, progress, peak, stop
        self.every = max(every, 1)
        self.pending: list[tuple[int, dict, float]] = []  # (step, info, tokens/s) of the rows not written
        self.t_last = time.perf_counter()  # when the last step's row was added
        self.losses: list[float] = []
        self.val_at: dict[int, dict] = {}  # step -> its evaluation's figures

    def add(self, step: int, info: dict) -> None:
        """Step ``step`` was issued: keep its row; write the rows through the previous step if it was a log step."""
        now = time.perf_counter()
        rate = self.tokens_per_step / max(now - self.t_last, 1e-9)
        self.t_last = now
        self.pending.append((step, info, rate))
        if (step - 1) % self.every == 0 and len(self.pending) > 1:
            self._write(self.pending[:-1])
            self.pending = self.pending[-1:]

    def flush(self) -> None:
        """Write every pending row."""
        pending, self.pending = self.pending, []
        self._write(pending)

    def _write(self, pending: list) -> None:
        if not pending:
            return
        values = read_scalars([v for _, info, _ in pending for v in info.values() if isinstance(v, torch.Tensor)])
        for step, info, rate in pending:
            info = {k: (next(values) if isinstance(v, torch.Tensor) else v) for k, v in info.items()}
            self._write_row(step, info, rate)

    def _write_row(self, step: int, info: dict, rate: float) -> None:
        if not math.isfinite(info["loss"]) and not info.get("skipped"):  # (train.on_nonfinite=stop)
            # (this model stepped on it, and the next step may be issued: resume from the checkpoint)
            raise self.stop(step, info["loss"])
        if not info.get("nonfinite_layers", 1):
            del info["nonfinite_layers"]
        self.losses.append(info["loss"])
        row = {"step": step, "loss": info["loss"], "lr": info.pop("lr"), "tokens_per_second": rate}
        row.update({k: v for k, v in info.items() if k not in row})
        if step in self.val_at:
            row.update(val_row(self.val_at.pop(step)))
        if self.file:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        self.trackers.log(row)
        self.progress.update(row, self.peak)

    def close(self) -> None:
        self.progress.close()
        self.trackers.close()
        if self.file:
            self.file.close()


def read_scalars(tensors: list[torch.Tensor]):
    """The values of one-element tensors, as ``.item()`` gives them, in order (an iterator): one
    stack and one copy to the host per device and dtype, instead of a wait for each tensor."""
    tensors = [t.full_tensor() if hasattr(t, "full_tensor") else t for t in tensors]  # (FSDP's DTensor norms, as .item())
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    values: list = [None] * len(tensors)
    for idx in groups.values():
        for i, v in zip(idx, torch.stack([tensors[i].detach().reshape(()) for i in idx]).tolist(), strict=True):
            values[i] = v
    return iter(values)


def val_row(metrics: dict) -> dict:
    """An evaluation's figures as ``metrics.jsonl`` / ``summary.json`` fields: ``val_loss``, ``val_accuracy``, ..."""
    return {f"val_{k}": v for k, v in metrics.items() if k in ("loss", "accuracy", "accuracy_norm", "perplexity")}


__all__ = ["StepRows", "StopSignals", "read_scalars", "val_row"]

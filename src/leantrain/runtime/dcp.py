"""Checkpoints of sharded weights and optimizer state through ``torch.distributed.checkpoint`` (DCP).

The directory is the one of :mod:`leantrain.runtime.checkpoint` (``checkpoints/step_<N>/``,
written under a temporary name and renamed, ``meta.json`` with the sha256 manifest, so
``latest_intact``, ``resolve`` and pruning work unchanged) with ``"format": "dcp"`` and:

- DCP's files: ``.metadata`` and one ``__<rank>_0.distcp`` per rank, holding the state dict
  ``{"model": ..., "optim": ...}`` of ``torch.distributed.checkpoint.state_dict.get_state_dict``
  (keys are parameter names, each tensor stored as the shards the ranks held);
- ``state.rank<R>.*``: the run's other state (scheduler, RNG, step, the techniques' own), one
  file pair per rank. A resume at the same world size reads each rank's own; at another, every
  rank reads rank 0's (the scheduler, RNG and step are the same on every rank; a technique's
  per-rank state continues from rank 0's).

DCP reshards on load: every rank reads the pieces of the shards it now owns, so a run saved
at 4 ranks resumes at 2 or 1 (:func:`leantrain.runtime.checkpoint.reshardable`).
:func:`leantrain.runtime.checkpoint.load_model_state` reads the whole weights in one process,
without a process group (``leantrain export``, ``--from RUN``).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from leantrain.runtime import checkpoint
from leantrain.runtime.checkpoint import DCP_FORMAT, CheckpointError

MODEL, OPTIM = checkpoint.DCP_MODEL, "optim"  # the two parts of the saved state dict


class DcpCheckpointer:
    """Save and load a model and optimizer whose state is sharded across ranks (a
    :class:`leantrain.technique.Checkpointer`); every rank calls :meth:`save` and :meth:`load`."""

    format = DCP_FORMAT

    def __init__(self, *, rank: int, world: int, keep: int = 2, barrier=lambda: None):
        self.rank, self.world, self.keep, self.barrier = rank, world, keep, barrier

    def save(self, out_dir: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer, extra_state: dict,
             meta: dict) -> Path:
        model_state, optim_state = get_state_dict(model, opt)

        def write(tmp: Path) -> None:
            dcp.save({MODEL: model_state, OPTIM: optim_state}, checkpoint_id=tmp)
            checkpoint.write_rank_state(tmp, self.rank, extra_state)

        return checkpoint.save_with(write, out_dir, step, {**meta, "format": DCP_FORMAT}, rank=self.rank,
                                    world=self.world, barrier=self.barrier, keep=self.keep)

    def load(self, path: Path, model: nn.Module, opt: torch.optim.Optimizer) -> dict:
        meta = checkpoint.read_meta(path)
        if meta.get("format") != DCP_FORMAT:
            raise CheckpointError(f"checkpoint {path} holds whole weights, not DCP shards; resume it with the "
                                  "dist.mode it was saved with")
        wrong = checkpoint.problems(path, checksums=False)  # (the checksums: the trainer's latest_intact)
        if wrong:
            raise CheckpointError(f"checkpoint {path} is damaged: {'; '.join(wrong)}")
        model_state, optim_state = get_state_dict(model, opt)
        state = {MODEL: model_state, OPTIM: optim_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state[MODEL], optim_state_dict=state[OPTIM])
        same_world = meta.get("world_size") == self.world
        return checkpoint.load_rank_state(path, rank=self.rank if same_world else 0, verify_files=False)[0]


__all__ = ["DcpCheckpointer"]

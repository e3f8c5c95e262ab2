"""Checkpoints of sharded weights and optimizer state through ``torch.distributed.checkpoint`` (DCP).

The directory is the one of :mod:`leantrain.runtime.checkpoint` (``checkpoints/step_<N>/``,
written under a temporary name and renamed, ``meta.json`` with the sha256 manifest, so
``latest_intact``, ``resolve`` and pruning work unchanged) with ``"format": "dcp"`` and:

- DCP's files: ``.metadata`` and one ``__<rank>_0.distcp`` per rank, holding the state dict
  ``{"model": ..., "optim": ...}`` of ``torch.distributed.checkpoint.state_dict.get_state_dict``
  (keys are parameter names, each tensor stored as the shards the ranks held; only ``"model"``
  for an optimizer without state per parameter, ``whole_optimizer``);
- ``state.rank<R>.*``: the run's other state (scheduler, RNG, step, the techniques' own; the
  ``whole_optimizer``'s state dict), one file pair per rank. A resume at the same world size
  reads each rank's own; at another, every rank reads rank 0's (the scheduler, RNG and step are
  the same on every rank; a technique's per-rank state continues from rank 0's).

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
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from leantrain.runtime import checkpoint
from leantrain.runtime.checkpoint import DCP_FORMAT, CheckpointError

MODEL, OPTIM = checkpoint.DCP_MODEL, "optim"  # the two parts of the saved state dict


class DcpCheckpointer:
    """Save and load a model and optimizer whose state is sharded across ranks (a
    :class:`leantrain.technique.Checkpointer`); every rank calls :meth:`save` and :meth:`load`."""

    format = DCP_FORMAT

    def __init__(self, *, rank: int, world: int, keep: int = 2, barrier=lambda: None, whole_optimizer: bool = False):
        """``whole_optimizer``: the optimizer keeps no state per parameter (a zeroth-order method's
        step count and seed, the same on every rank) or keeps it in a layout of its own (ChunkFT's
        rows of its chunks, which its ``load_state_dict`` checks): its ``state_dict()`` is saved
        whole with each rank's state (``"optimizer"``), not through DCP, which steps an optimizer
        without state to create some."""
        self.rank, self.world, self.keep, self.barrier = rank, world, keep, barrier
        self.whole_optimizer = whole_optimizer

    def _state(self, model: nn.Module, opt: torch.optim.Optimizer) -> dict:
        """The state dict DCP saves and loads: ``{"model": ...}``, with ``"optim"`` unless ``whole_optimizer``."""
        if self.whole_optimizer:
            return {MODEL: get_model_state_dict(model)}
        model_state, optim_state = get_state_dict(model, opt)
        return {MODEL: model_state, OPTIM: optim_state}

    def save(self, out_dir: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer, extra_state: dict,
             meta: dict) -> Path:
        state = self._state(model, opt)
        if self.whole_optimizer:
            extra_state = {**extra_state, "optimizer": opt.state_dict()}

        def write(tmp: Path) -> None:
            dcp.save(state, checkpoint_id=tmp)
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
        state = self._state(model, opt)
        dcp.load(state, checkpoint_id=path)
        same_world = meta.get("world_size") == self.world
        rank_state = checkpoint.load_rank_state(path, rank=self.rank if same_world else 0, verify_files=False)[0]
        if self.whole_optimizer:
            set_model_state_dict(model, state[MODEL])
            opt.load_state_dict(rank_state["optimizer"])
        else:
            set_state_dict(model, opt, model_state_dict=state[MODEL], optim_state_dict=state[OPTIM])
        return rank_state


__all__ = ["DcpCheckpointer"]

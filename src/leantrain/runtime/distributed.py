"""Device and process group of a run: one code path for CPU, one GPU and ``torchrun``."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

# Imported before any process group exists: ``torch.distributed.nn.functional`` binds
# ``group.WORLD`` as the default argument of its functions when it is first imported, and DDP
# imports it. Imported after ``init_process_group`` it would keep the world group alive past
# ``destroy_process_group``, and with it gloo's worker threads, which then die with the
# interpreter: a thread that drops its last tensor while Python shuts down aborts the process
# ("terminate called without an active exception").
import torch.distributed.nn  # noqa: F401, E402

from leantrain.config import ConfigError
from leantrain.runtime import collectives


def setup(device: str = "auto", timeout_s: float = 120.0) -> tuple[torch.device, int, int]:
    """``(device, rank, world size)`` from the environment (torchrun sets RANK / WORLD_SIZE /
    LOCAL_RANK); the process group is made once, NCCL on CUDA, gloo on CPU. ``device``: auto
    (CUDA when present), cpu or cuda."""
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is available; use --train.device cpu")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    dev = torch.device(f"cuda:{torch.cuda.current_device()}" if use_cuda else "cpu")
    return dev, collectives.rank(), collectives.world_size()


def ensure_group(device: torch.device) -> None:
    """A process group for code that needs one even in a run of one process (FSDP, DCP): when none
    exists, a group of this process alone (an in-memory store, no network), NCCL on CUDA, gloo on CPU."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)

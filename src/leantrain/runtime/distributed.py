"""Device and process group of a run: one code path for CPU, one GPU and ``torchrun``."""

from __future__ import annotations

import gc
import os
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

# Imported before any process group exists: ``torch.distributed.nn.functional`` binds
# ``group.WORLD`` as the default argument of its functions when it is first imported, and DDP
# imports it. Imported after ``init_process_group`` it would keep the world group alive past
# ``destroy_process_group`` (see ``close``).
import torch.distributed.nn  # noqa: F401

from leantrain.config import ConfigError
from leantrain.runtime import collectives

_meshes: weakref.WeakSet = weakref.WeakSet()  # the device meshes made by device_mesh (see close)


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


def device_mesh(device_type: str, shape: tuple[int, ...], dim_names: tuple[str, ...]):
    """``init_device_mesh``, the mesh remembered so that ``close`` can let go of its groups."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, shape, mesh_dim_names=dim_names)
    _meshes.add(mesh)
    return mesh


def close(together: bool) -> None:
    """Shut the process groups down before the interpreter exits.

    When every rank ended the same way (the command succeeded, or all stopped at one step on a
    signal), each first waits for the others: a rank that exits while another still runs its last
    collectives can abort it in the process group's threads, and torchrun ends the whole job when
    the first rank exits with an error, which would cut rank 0's summary, plot and closing line short.

    A group must also be gone once this returns. A gloo group that outlives
    ``destroy_process_group`` keeps its worker threads until the interpreter shuts down, and a
    worker that drops its last tensor then aborts the rank ("terminate called without an active
    exception") after a run that succeeded. DTensor's sharding caches keep the device mesh of an
    FSDP run alive, and the mesh keeps its groups: they are released from the mesh here.
    """
    if dist.is_available() and dist.is_initialized():
        if together:
            dist.barrier()
        dist.destroy_process_group()
    for mesh in list(_meshes):
        getattr(mesh, "_pg_registry", {}).clear()  # (a private dict of torch's DeviceMesh; absent in some versions)
    gc.collect()  # (a model, its hooks and its optimizer that hold a group in reference cycles)

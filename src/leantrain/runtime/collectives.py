"""Counted collectives: thin wrappers over ``torch.distributed`` that record bytes sent.

Every byte leantrain puts on the wire goes through these functions, so the
communication ledger (:mod:`leantrain.runtime.ledger`) is a count of real calls with
real tensor sizes. They take the same arguments as their ``torch.distributed``
namesakes plus ``scope`` (``"intra"``, ``"inter"`` or ``"world"``), the label
the ledger files the bytes under. With one rank (or no process group) they
are local no-ops that send nothing.

Only collectives that gloo and NCCL both implement are used (``all_to_all``
with lists is NCCL-only, so it is not here).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from leantrain.runtime.ledger import record_comm


def world_size(group=None) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def rank(group=None) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(t: Tensor, *, op=None, group=None, scope: str = "world", async_op: bool = False):
    n = world_size(group)
    if n == 1:
        return None
    record_comm("all_reduce", 2 * (n - 1) * _nbytes(t) // n, scope)
    return dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=group, async_op=async_op)


# torch's names for the two flat-tensor collectives: ``*_single`` from torch 2.13 (which warns on the older
# names), ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` before; the same arguments
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def reduce_scatter_tensor(out: Tensor, inp: Tensor, *, op=None, group=None, scope: str = "world", async_op: bool = False):
    n = world_size(group)
    if n == 1:
        out.copy_(inp.view_as(out))
        return None
    record_comm("reduce_scatter", (n - 1) * _nbytes(inp) // n, scope)
    return _REDUCE_SCATTER(out, inp, op=op or dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_gather_into_tensor(out: Tensor, inp: Tensor, *, group=None, scope: str = "world", async_op: bool = False):
    n = world_size(group)
    if n == 1:
        out.copy_(inp.view_as(out))
        return None
    record_comm("all_gather", (n - 1) * _nbytes(inp), scope)
    return _ALL_GATHER(out, inp, group=group, async_op=async_op)


def all_to_all_single(
    out: Tensor,
    inp: Tensor,
    *,
    output_split_sizes=None,
    input_split_sizes=None,
    group=None,
    scope: str = "world",
    async_op: bool = False,
):
    n = world_size(group)
    if n == 1:
        out.copy_(inp.view_as(out))
        return None
    me = rank(group)
    row = _nbytes(inp) // max(inp.shape[0], 1) if inp.dim() > 0 else 0
    if input_split_sizes is None:
        own = _nbytes(inp) // n
    else:
        own = int(input_split_sizes[me]) * row
    record_comm("all_to_all", _nbytes(inp) - own, scope)
    return dist.all_to_all_single(
        out, inp, output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes, group=group, async_op=async_op
    )


def broadcast(t: Tensor, src: int, *, group=None, scope: str = "world", async_op: bool = False):
    n = world_size(group)
    if n == 1:
        return None
    if rank() == src:
        record_comm("broadcast", _nbytes(t), scope)
    return dist.broadcast(t, src, group=group, async_op=async_op)


def all_gather_object(obj, *, group=None) -> list:
    """Gather a small picklable object from every rank (control traffic, not counted)."""
    n = world_size(group)
    if n == 1:
        return [obj]
    out = [None] * n
    dist.all_gather_object(out, obj, group=group)
    return out


def barrier(group=None) -> None:
    if world_size(group) > 1:
        dist.barrier(group=group)


__all__ = [
    "world_size",
    "rank",
    "all_reduce",
    "reduce_scatter_tensor",
    "all_gather_into_tensor",
    "all_to_all_single",
    "broadcast",
    "all_gather_object",
    "barrier",
]

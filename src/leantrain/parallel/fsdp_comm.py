"""FSDP2's collectives through leantrain's counted ones, and the compressed reduce-scatter a
communication technique offers, installed with FSDP2's public ``FSDPModule`` methods
``set_custom_all_gather``, ``set_custom_reduce_scatter`` and ``set_all_reduce_hook``.

FSDP2 hands a custom comm the very buffers it would hand its default one: it ``allocate``\\ s
them, copies the shards (all-gather) or the padded gradients (reduce-scatter) in, and calls
``comm(output_tensor, input_tensor, group, ...)`` on its own stream. :class:`CountedAllGather`
and :class:`CountedReduceScatter` make the same ``torch.distributed`` call as FSDP2's default
through :mod:`leantrain.runtime.collectives`, which files the real bytes of those tensors in the
comm ledger (scope ``world``):

- ``all_gather``: every ``fully_shard``ed module's parameters, before its forward and again
  before its backward (and before every evaluation forward): ``(n - 1)`` x this rank's flat
  shard in ``dist.param_dtype``;
- ``reduce_scatter``: its gradients as its backward ends (not in ``no_sync`` micro-batches):
  ``(n - 1) / n`` x the padded flat gradients in ``dist.reduce_dtype``;
- ``all_reduce`` (HSDP): the reduce-scattered shard across the ``R`` replicas, counted by an
  all-reduce hook, which FSDP2 runs after that all-reduce with its output: ``2 (R - 1) / R`` x
  the shard's bytes.

With a compressor (``Run.compression``) the reduce-scatter is the compressor's
(:func:`leantrain.comm.fsdp.fsdp_reduce_scatter`): :class:`leantrain.comm.Int8ReduceScatter`, whose
all-to-all is filed under ``world``, or :class:`leantrain.comm.SDP4BitReduceScatter` (SDP4Bit's
gradient half), whose all-to-alls are filed under ``intra`` /
``inter`` as the sharded optimizer files them.
"""

from __future__ import annotations

import torch
from torch import nn

from leantrain.comm.fsdp import fsdp_reduce_scatter
from leantrain.runtime import collectives
from leantrain.runtime.ledger import record_comm


class _Allocate:
    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class CountedAllGather(_Allocate):
    """FSDP2's all-gather (torch's flat all-gather), counted."""

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        return collectives.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class CountedReduceScatter(_Allocate):
    """FSDP2's reduce-scatter (torch's flat reduce-scatter with FSDP2's op), counted."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        return collectives.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


class ReplicaAllReduceCount:
    """An HSDP all-reduce hook: files the all-reduce FSDP2 has just run across ``replicas`` ranks."""

    def __init__(self, replicas: int):
        self.replicas = replicas

    def __call__(self, reduce_output: torch.Tensor) -> None:
        n = self.replicas
        record_comm("all_reduce", 2 * (n - 1) * reduce_output.numel() * reduce_output.element_size() // n, "world")


def install(modules: list[nn.Module], mesh, *, compression=None, intra_node_size: int | None = None):
    """Give every ``fully_shard``ed module of ``modules`` the counted all-gather, the reduce-scatter
    (``compression``'s, else the counted one) and, under HSDP (a ``replicate`` mesh dimension),
    the all-reduce count. Every rank calls it (the compressed reduce-scatter may create the
    intra- / inter-node subgroups of the mesh's shard group, ``intra_node_size`` ranks per node).
    Returns the compressed reduce-scatter, whose ``state_dict`` seeds its rounding, or None."""
    gather = CountedAllGather()
    compressed = None
    if compression is not None:
        compressed = fsdp_reduce_scatter(compression, group=mesh.get_group("shard"), intra_node_size=intra_node_size)
    scatter = compressed or CountedReduceScatter()
    replicate = "replicate" in (mesh.mesh_dim_names or ())
    hook = ReplicaAllReduceCount(mesh.size(mesh.mesh_dim_names.index("replicate"))) if replicate else None
    for module in modules:
        module.set_custom_all_gather(gather)
        module.set_custom_reduce_scatter(scatter)
        if hook is not None:
            module.set_all_reduce_hook(hook)
    return compressed


__all__ = ["CountedAllGather", "CountedReduceScatter", "ReplicaAllReduceCount", "install"]

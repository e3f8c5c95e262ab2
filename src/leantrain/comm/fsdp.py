"""SDP4Bit's gradient path inside PyTorch FSDP2, through ``set_custom_reduce_scatter``.

    from torch.distributed.fsdp import fully_shard
    model = fully_shard(model, mesh=mesh)
    model.set_custom_reduce_scatter(lt.comm.SDP4BitReduceScatter(lt.comm.SDP4Bit(), intra_node_size=8))

FSDP2 hands the custom comm its flat reduce-scatter input (``world`` contiguous chunks, one
per rank, already padded by FSDP) and output. The compressed two-level all-to-all of
:class:`SDP4Bit` runs on it, so the bytes are filed as ``intra``/``inter`` in the ledger.
``op`` may be ``SUM`` or ``AVG``; FSDP asks for ``PREMUL_SUM`` only when a gradient divide
factor other than the world size is set -- call ``set_force_sum_reduction_for_comms(True)``
then, and FSDP divides before/after the comm itself.

Weight path: FSDP2 all-gathers the *sharded parameters themselves* before every forward and
backward (ZeRO-3), and keeps no full copy between steps, so SDP4Bit's weight-difference
all-gather (which needs the previous full weights on every rank) does not map onto
``set_custom_all_gather`` without adding a full model copy per rank. It is not offered here;
use :class:`leantrain.parallel.ShardedOptimizer` for the weight half.

The call is synchronous (FSDP2 already runs it on its reduce-scatter stream and ignores the
return value); it returns ``None``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from leantrain.comm.sdp4bit import SDP4Bit
from leantrain.comm.topology import get_topology

try:
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatterBase
except ImportError:  # pragma: no cover - torch without the FSDP2 comm API
    _ReduceScatterBase = object


class SDP4BitReduceScatter(_ReduceScatterBase):
    """An FSDP2 ``ReduceScatter`` that runs :class:`SDP4Bit`'s compressed gradient path.

    Args:
        compressor: the :class:`SDP4Bit` whose gradient settings are used (default: paper's).
        group: build the topology (and its subgroups) for this group now, on every rank, rather
            than lazily inside the first backward. Pass the FSDP mesh's group.
        intra_node_size: ranks per node (default ``LOCAL_WORLD_SIZE`` or one node).
    """

    def __init__(self, compressor: SDP4Bit | None = None, *, group=None, intra_node_size: int | None = None):
        self.compressor = compressor or SDP4Bit()
        self.intra_node_size = intra_node_size
        self.calls = 0
        if group is not None or (dist.is_available() and dist.is_initialized()):
            get_topology(group, intra_node_size)

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        topo = get_topology(group, self.intra_node_size)
        if op == dist.ReduceOp.SUM:
            div = 1.0
        elif op == dist.ReduceOp.AVG:
            div = float(topo.world)
        else:
            raise ValueError(
                f"SDP4BitReduceScatter supports ReduceOp.SUM and AVG, got {op}; with a custom "
                "gradient divide factor call model.set_force_sum_reduction_for_comms(True)"
            )
        shard = self.compressor.start_reduce_scatter(input_tensor.reshape(-1), topo, seed=self.calls).wait()
        self.calls += 1
        if div != 1.0:
            shard = shard / div
        output_tensor.reshape(-1).copy_(shard)
        return None


__all__ = ["SDP4BitReduceScatter"]

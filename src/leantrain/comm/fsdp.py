"""SDP4Bit's gradient path inside PyTorch FSDP2, through ``FSDPModule.set_custom_reduce_scatter``.

    from torch.distributed.fsdp import fully_shard
    model = fully_shard(model, mesh=mesh)
    model.set_custom_reduce_scatter(lt.comm.SDP4BitReduceScatter(lt.comm.SDP4Bit(), intra_node_size=8))

The trainer does this for every ``fully_shard``ed module with ``--dist.mode fsdp --comm.method
sdp4bit`` (:mod:`leantrain.parallel.fsdp`). FSDP2 hands the custom comm its flat reduce-scatter
input (``world`` contiguous chunks, one per rank of the shard group, already padded by FSDP) and
output. The compressed two-level all-to-all of :class:`SDP4Bit` runs on it, so the bytes are
filed as ``intra``/``inter`` in the ledger. ``op`` may be ``SUM`` or ``AVG`` (FSDP's choice for
fp32 and bf16 gradients); FSDP asks for ``PREMUL_SUM`` only when a gradient divide factor other
than the world size is set -- call ``set_force_sum_reduction_for_comms(True)`` then, and FSDP
divides before/after the comm itself.

FSDP2 calls the comm through two methods, ``allocate(size, dtype=, device=)`` and
``__call__(output_tensor, input_tensor, group, op, async_op=False)`` (the ``ReduceScatter``
interface it documents); it checks no base class, so this class has none.

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


class SDP4BitReduceScatter:
    """An FSDP2 reduce-scatter that runs :class:`SDP4Bit`'s compressed gradient path.

    Args:
        compressor: the :class:`SDP4Bit` whose gradient settings are used (default: paper's).
        group: build the topology (and its subgroups) for this group now, on every rank, rather
            than lazily inside the first backward. Pass the FSDP mesh's shard group.
        intra_node_size: ranks per node of that group (default ``LOCAL_WORLD_SIZE`` or one node).

    ``calls`` counts the reduce-scatters run; it seeds each one's stochastic rounding, so a
    resumed run that restores it (``state_dict``) draws the same numbers as an uninterrupted one.
    One instance may serve every ``fully_shard``ed module of a model.
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

    def state_dict(self) -> dict:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.calls = int(state["calls"])


__all__ = ["SDP4BitReduceScatter"]

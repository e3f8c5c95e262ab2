"""Compressed reduce-scatters inside PyTorch FSDP2, through ``FSDPModule.set_custom_reduce_scatter``:
SDP4Bit's gradient path (:class:`SDP4BitReduceScatter`) and AGoQ's 8-bit one (:class:`Int8ReduceScatter`).

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

The int8 path (``--dist.mode fsdp --comm.method int8``): each rank quantizes every chunk of the
flat input (one fp32 scale per 256 elements, a chunk padded to a multiple of it) and sends chunk
``i`` to rank ``i`` in one all-to-all; the owner adds its own chunk unquantized and sums in fp32
(:func:`leantrain.comm.int8_allreduce.int8_reduce_scatter`). Bytes: ``(1 + 4/256) / 2`` of a bf16
reduce-scatter's (a quarter of an fp32 one's), filed as ``all_to_all`` under scope ``world``.

The calls are synchronous (FSDP2 already runs them on its reduce-scatter stream and ignores the
return value); they return ``None``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from leantrain.comm.int8_allreduce import int8_reduce_scatter
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
        div = _divisor(op, topo.world, "SDP4BitReduceScatter")
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


def _divisor(op, world: int, name: str) -> float:
    """What FSDP's ``op`` divides the sum by (SUM: 1, AVG: the world size); other ops refused."""
    if op == dist.ReduceOp.SUM:
        return 1.0
    if op == dist.ReduceOp.AVG:
        return float(world)
    raise ValueError(f"{name} supports ReduceOp.SUM and AVG, got {op}; with a custom gradient divide factor "
                     "call model.set_force_sum_reduction_for_comms(True)")


class Int8ReduceScatter:
    """An FSDP2 reduce-scatter through int8 codes and fp32 scales (the module doc).

    Args:
        group_size: elements sharing one fp32 scale (even).
        stochastic: round stochastically (unbiased; seeded by ``seed`` and the call count).
        seed: the rounding's base seed.

    ``calls`` counts the reduce-scatters run (``state_dict``): it varies the stochastic rounding's
    seed, so a resumed run draws the numbers an uninterrupted one draws. It keeps no other state
    (the DDP int8 all-reduce has no error feedback either). One instance may serve every
    ``fully_shard``ed module of a model.
    """

    def __init__(self, *, group_size: int = 256, stochastic: bool = False, seed: int = 0):
        self.group_size, self.stochastic, self.seed = group_size, stochastic, seed
        self.calls = 0

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        div = _divisor(op, dist.get_world_size(group), "Int8ReduceScatter")
        self.calls += 1
        int8_reduce_scatter(output_tensor.reshape(-1), input_tensor.reshape(-1), group, group_size=self.group_size,
                            average=div != 1.0, stochastic=self.stochastic, seed=self.seed * 1_000_003 + self.calls)
        return None

    def state_dict(self) -> dict:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.calls = int(state["calls"])


def fsdp_reduce_scatter(compression, *, group=None, intra_node_size: int | None = None):
    """The FSDP2 reduce-scatter of a run's compressor (``Run.compression``): an :class:`SDP4Bit`'s
    gradient half (its topology built now for ``group``), or an :class:`Int8ReduceScatter` as it is."""
    if isinstance(compression, SDP4Bit):
        return SDP4BitReduceScatter(compression, group=group, intra_node_size=intra_node_size)
    if isinstance(compression, Int8ReduceScatter):
        return compression
    raise TypeError(f"FSDP has no reduce-scatter for the compressor {type(compression).__name__}; "
                    "use --comm.method sdp4bit or int8 with --dist.mode fsdp")


__all__ = ["Int8ReduceScatter", "SDP4BitReduceScatter", "fsdp_reduce_scatter"]

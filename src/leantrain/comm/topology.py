"""Node topology of a data-parallel group: which ranks share a node, and their subgroups.

A group of ``n = inter * intra`` ranks is cut into ``inter`` nodes of ``intra`` consecutive
group ranks (the layout ``torchrun`` gives: node ``k`` holds ranks ``k*intra .. k*intra+intra-1``).
Group rank ``r`` is ``(node, local) = divmod(r, intra)``. Two kinds of subgroups:

- ``intra_group``: the ranks of my node (all-to-all over NVLink),
- ``inter_group``: the ranks with my ``local`` index on every node (one per node; over the NIC).

``intra`` comes from ``intra_node_size``, else ``LOCAL_WORLD_SIZE`` (set by ``torchrun``),
else the whole group is one node. On CPU, ``intra_node_size=2`` makes 4 gloo processes stand
for 2 nodes x 2 GPUs.

Subgroups are made with ``dist.new_group``. For the default (world) group every rank creates
every subgroup in the same order, as ``new_group`` requires; for a sub-group (e.g. the data-
parallel group of a TP x DP job) each rank creates only its own two subgroups with
``use_local_synchronization=True``. Topologies are cached per (group, intra), so the
optimizer, FSDP hooks and tests share the same communicators.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class Topology:
    group: object  # the data-parallel ProcessGroup (None = world)
    world: int
    rank: int  # rank within ``group``
    intra: int  # ranks per node
    inter: int  # nodes
    intra_group: object  # None when intra == 1
    inter_group: object  # None when inter == 1

    @property
    def node(self) -> int:
        return self.rank // self.intra

    @property
    def local(self) -> int:
        return self.rank % self.intra


_CACHE: dict = {}


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def resolve_intra(world: int, intra_node_size: int | None) -> int:
    """Ranks per node: the argument, else ``LOCAL_WORLD_SIZE`` if it divides ``world``, else ``world``."""
    if intra_node_size is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        intra = int(env) if env and env.isdigit() and int(env) > 0 and world % int(env) == 0 else world
    else:
        intra = int(intra_node_size)
    if intra < 1 or world % intra:
        raise ValueError(
            f"intra_node_size={intra} must divide the data-parallel world size {world} "
            "(ranks per node; pass intra_node_size=None for one node)"
        )
    return intra


def get_topology(group=None, intra_node_size: int | None = None) -> Topology:
    """The (cached) :class:`Topology` of ``group`` with ``intra_node_size`` ranks per node.

    Must be called on every rank of the default group the first time (it may create groups).
    """
    if not _initialized():
        return Topology(group, 1, 0, 1, 1, None, None)
    world = dist.get_world_size(group)
    intra = resolve_intra(world, intra_node_size)
    key = (id(group) if group is not None and group is not dist.group.WORLD else "world", intra)
    if key in _CACHE:
        return _CACHE[key]
    rank = dist.get_rank(group)
    inter = world // intra
    default = group is None or group is dist.group.WORLD
    ranks = list(range(world)) if default else dist.get_process_group_ranks(group)
    is_world = default or world == dist.get_world_size()  # every process is a member
    intra_sets = [ranks[k * intra:(k + 1) * intra] for k in range(inter)]
    inter_sets = [ranks[j::intra] for j in range(intra)]
    node, local = divmod(rank, intra)
    intra_group = inter_group = None
    if intra > 1:
        if inter == 1:
            intra_group = group
        elif is_world:
            for k, rs in enumerate(intra_sets):  # every rank creates every group, same order
                g = dist.new_group(rs)
                if k == node:
                    intra_group = g
        else:
            intra_group = dist.new_group(intra_sets[node], use_local_synchronization=True)
    if inter > 1:
        if intra == 1:
            inter_group = group
        elif is_world:
            for j, rs in enumerate(inter_sets):
                g = dist.new_group(rs)
                if j == local:
                    inter_group = g
        else:
            inter_group = dist.new_group(inter_sets[local], use_local_synchronization=True)
    topo = Topology(group, world, rank, intra, inter, intra_group, inter_group)
    _CACHE[key] = topo
    return topo


def clear_cache() -> None:
    """Forget cached topologies (after ``destroy_process_group``)."""
    _CACHE.clear()


__all__ = ["Topology", "get_topology", "resolve_intra", "clear_cache"]

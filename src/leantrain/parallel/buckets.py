"""Flat, padded gradient buckets and their shards (the layout of :class:`ShardedOptimizer`).

Parameters are taken in reverse registration order over all param groups (backward produces
the last layers' gradients first) and packed into buckets of at most ``bucket_bytes`` of fp32
(a larger parameter gets a bucket of its own); a bucket also ends where the parameter dtype
changes. A bucket of ``numel`` elements is padded to ``padded = world * shard`` with
``shard`` a multiple of ``align`` (the compressor's alignment); rank ``r`` owns elements
``[r * shard, (r + 1) * shard)``. Parameters of different param groups may share a bucket:
``segments`` lists, in shard-local coordinates, the runs of this rank's shard that belong to
each group (padding belongs to none and stays zero).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor


@dataclass(eq=False)
class Bucket:
    index: int
    params: list[Tensor]
    pids: list[int]  # global parameter indices (order of the flattened param_groups)
    groups: list[int]  # param-group index of each parameter
    offsets: list[int]  # element offset of each parameter in the flat bucket
    numel: int  # elements of real parameters
    padded: int  # world * shard
    shard: int  # elements per rank
    start: int  # this rank's first element
    segments: list[tuple[int, int, int]] = field(default_factory=list)  # (lo, hi, group) local
    pending: object = None  # in-flight reduce-scatter (comm.Pending)
    dirty: bool = False  # .grad changed after the launch
    ready: set = field(default_factory=set)  # ids of params whose gradient is complete


def build_buckets(param_groups: list[dict], *, world: int, rank: int, align: int, bucket_bytes: int) -> list[Bucket]:
    flat = []  # (pid, param, group index)
    for gi, g in enumerate(param_groups):
        for p in g["params"]:
            flat.append((len(flat), p, gi))
    order = list(reversed(flat))
    buckets: list[Bucket] = []
    cur: list = []
    size = 0

    def close():
        nonlocal cur, size
        if not cur:
            return
        offsets, off = [], 0
        for _, p, _ in cur:
            offsets.append(off)
            off += p.numel()
        unit = world * align
        padded = max(unit, -(-off // unit) * unit)
        shard = padded // world
        b = Bucket(len(buckets), [p for _, p, _ in cur], [i for i, _, _ in cur], [gi for _, _, gi in cur],
                   offsets, off, padded, shard, rank * shard)
        lo_me, hi_me = b.start, b.start + shard
        for (_, p, gi), o in zip(cur, offsets, strict=True):
            lo, hi = max(o, lo_me), min(o + p.numel(), hi_me)
            if lo >= hi:
                continue
            lo, hi = lo - lo_me, hi - lo_me
            if b.segments and b.segments[-1][2] == gi and b.segments[-1][1] == lo:
                b.segments[-1] = (b.segments[-1][0], hi, gi)
            else:
                b.segments.append((lo, hi, gi))
        buckets.append(b)
        cur, size = [], 0

    for item in order:
        p = item[1]
        if cur and (size + 4 * p.numel() > bucket_bytes or p.dtype != cur[0][1].dtype):
            close()
        cur.append(item)
        size += 4 * p.numel()
    close()
    return buckets


__all__ = ["Bucket", "build_buckets"]

"""Compressed collectives (``lt.comm``).

- :class:`SDP4Bit`: 4-bit weight-difference all-gather and two-level (8-bit intra-node,
  4-bit inter-node) Hadamard-smoothed gradient reduce-scatter, for
  :class:`leantrain.parallel.ShardedOptimizer` (``compression=lt.comm.SDP4Bit()``) and, for the
  gradient half, FSDP2 (:class:`SDP4BitReduceScatter`).
- :class:`Int8ReduceScatter`: FSDP2's gradient reduce-scatter through AGoQ's int8 codes
  (``int8_reduce_scatter``, the first phase of the 8-bit all-reduce).
- :class:`SCAPE`: sparse gradient and weight communication over a global mask from the
  first moment (AdamS), for :class:`leantrain.parallel.ShardedOptimizer`.
- :class:`GIFT`: the data-parallel gradient all-reduce in FP8 E4M3 or NVFP4, in K-FAC-whitened
  coordinates (``comm/gift.py``); ``fp8_all_reduce`` / ``nvfp4_all_reduce``: its two-phase all-reduces.
- ``Int8AllReduceState`` / ``int8_allreduce_hook`` / ``int8_all_reduce``: AGoQ's
  precision-preserving 8-bit all-reduce and its DDP comm hook (``comm/int8_allreduce.py``).
- :func:`estimate_time`: alpha-beta model from ledger bytes to seconds.
- :func:`get_topology`: nodes and intra/inter subgroups of a data-parallel group.

See docs/sdp4bit.md, docs/scape.md, docs/gift.md and docs/int8-allreduce.md for the schemes, bytes per parameter and measured numbers.
"""

import importlib

from leantrain.comm.cost import estimate_time
from leantrain.comm.fsdp import Int8ReduceScatter, SDP4BitReduceScatter
from leantrain.comm.scape import SCAPE
from leantrain.comm.sdp4bit import NoCompression, Pending, SDP4Bit, bytes_per_element
from leantrain.comm.topology import Topology, get_topology

_LAZY = {
    "GIFT": "gift",
    "fp8_all_reduce": "gift",
    "nvfp4_all_reduce": "fp4",
    "Int8AllReduceState": "int8_allreduce",
    "int8_allreduce_hook": "int8_allreduce",
    "int8_all_reduce": "int8_allreduce",
    "int8_reduce_scatter": "int8_allreduce",
}


def __getattr__(name):
    if name in _LAZY:
        mod = importlib.import_module(f"{__name__}.{_LAZY[name]}")
        val = getattr(mod, name)
        globals()[name] = val
        return val
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "SDP4Bit",
    "SCAPE",
    "NoCompression",
    "Pending",
    "SDP4BitReduceScatter",
    "Int8ReduceScatter",
    "Topology",
    "get_topology",
    "estimate_time",
    "bytes_per_element",
    *_LAZY,
]

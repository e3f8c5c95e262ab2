"""Distributed training on ``torch.distributed`` (``lt.dist``).

- :class:`ShardedOptimizer`: Megatron-style distributed optimizer (sharded fp32 master weights
  and optimizer state, bucketed reduce-scatter overlapped with backward, weight all-gather),
  optionally with a compressor such as ``lt.comm.SDP4Bit()``.
- ``ColumnParallelLinear`` / ``RowParallelLinear``: tensor-parallel linears (``dist/tp.py``),
  imported on first use.
"""

import importlib

from leantrain.parallel.sharded import ShardedOptimizer

_LAZY = {"ColumnParallelLinear": "tp", "RowParallelLinear": "tp"}


def __getattr__(name):
    if name in _LAZY:
        mod = importlib.import_module(f"{__name__}.{_LAZY[name]}")
        val = getattr(mod, name)
        globals()[name] = val
        return val
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ShardedOptimizer", *_LAZY]

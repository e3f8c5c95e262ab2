"""Tensor parallelism (Megatron-style) with optional sequence parallelism.

- :class:`ColumnParallelLinear` holds rows ``[r·N/p, (r+1)·N/p)`` of ``W: [N, K]`` (and of the
  bias). Input: replicated (``copy_to_tp``: identity forward, all-reduce of dX backward) or,
  with ``sequence_parallel``, sharded along the sequence dimension and all-gathered before the
  matmul (``gather_sequence``; backward reduce-scatters dX). Output: this rank's N/p features
  (or all N with ``gather_output``).
- :class:`RowParallelLinear` holds columns ``[r·K/p, (r+1)·K/p)`` of ``W``. Input: this rank's
  K/p features. Output: the partial products summed over ranks (all-reduce) or, with
  ``sequence_parallel``, reduce-scattered along the sequence dimension. The bias is added
  after the reduction, so it is a replicated parameter outside the matmul.

Both are ``nn.Linear`` subclasses whose matmul goes through ``self.linear_fn(x, W, b)``: FORGE
replaces that one call, so the weight shard is updated from ``dW_shard = dYᵀ X`` where X holds
*all* tokens (after the sequence all-gather): each shard's gradient is complete, no reduction
over the TP group is needed and the update equals the unsharded layer's.

Replicated parameters inside a sequence-parallel region (norm weights, the row-parallel bias)
see only this rank's tokens, so their gradients are partial sums: mark them with
:func:`mark_sequence_parallel` (the row-parallel bias is marked automatically). FORGE sums
them over the TP group in ``step()``; with another optimizer call
:func:`allreduce_sequence_parallel_grads` before ``step()``.

All traffic goes through :mod:`leantrain.runtime.collectives` (counted in the communication ledger).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from leantrain.runtime import collectives as C


def _ws(group) -> int:
    return C.world_size(group)


def _to_front(x: Tensor, dim: int) -> Tensor:
    return x if dim == 0 else x.movedim(dim, 0)


def _from_front(x: Tensor, dim: int) -> Tensor:
    return x if dim == 0 else x.movedim(0, dim)


def _all_gather(x: Tensor, dim: int, group) -> Tensor:
    n = _ws(group)
    if n == 1:
        return x
    xf = _to_front(x, dim).contiguous()
    out = xf.new_empty((n * xf.shape[0], *xf.shape[1:]))
    C.all_gather_into_tensor(out, xf, group=group)
    return _from_front(out, dim).contiguous()


def _reduce_scatter(x: Tensor, dim: int, group) -> Tensor:
    n = _ws(group)
    if n == 1:
        return x
    xf = _to_front(x, dim).contiguous()
    if xf.shape[0] % n:
        raise ValueError(f"sequence parallel: dimension {dim} of size {xf.shape[0]} is not divisible by {n} ranks")
    out = xf.new_empty((xf.shape[0] // n, *xf.shape[1:]))
    C.reduce_scatter_tensor(out, xf, group=group)
    return _from_front(out, dim).contiguous()


def _all_reduce(x: Tensor, group) -> Tensor:
    if _ws(group) == 1:
        return x
    x = x.contiguous().clone()
    C.all_reduce(x, group=group)
    return x


def _split_last(x: Tensor, group) -> Tensor:
    n = _ws(group)
    if n == 1:
        return x
    return x.chunk(n, dim=-1)[C.rank(group)].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter(g, ctx.dim, ctx.group), None, None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.dim, ctx.group), None, None


class _GatherLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, x.dim() - 1, group)

    @staticmethod
    def backward(ctx, g):
        return _split_last(g, ctx.group), None


class _ScatterLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, g.dim() - 1, ctx.group), None


def copy_to_tp(x: Tensor, group=None) -> Tensor:
    """Identity; backward all-reduces the gradient over the TP group."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: Tensor, group=None) -> Tensor:
    """All-reduce (sum) over the TP group; backward is the identity."""
    return _ReduceFromTP.apply(x, group)


def gather_sequence(x: Tensor, group=None, dim: int = 0) -> Tensor:
    """Sequence-parallel all-gather along ``dim``; backward reduce-scatters."""
    return _GatherSeq.apply(x, dim, group)


def scatter_sequence(x: Tensor, group=None, dim: int = 0) -> Tensor:
    """Sequence-parallel reduce-scatter along ``dim``; backward all-gathers."""
    return _ReduceScatterSeq.apply(x, dim, group)


def split_sequence(x: Tensor, group=None, dim: int = 0) -> Tensor:
    """This rank's slice of a replicated tensor along ``dim`` (no communication, no autograd)."""
    n = _ws(group)
    return x if n == 1 else x.chunk(n, dim=dim)[C.rank(group)].contiguous()


def mark_sequence_parallel(param: nn.Parameter, group=None) -> nn.Parameter:
    """Flag a replicated parameter used on sequence-sharded activations (partial gradients)."""
    param._lt_sp_group = group if group is not None else torch.distributed.group.WORLD
    return param


def allreduce_sequence_parallel_grads(model: nn.Module) -> None:
    """Sum the partial gradients of every marked parameter over its TP group (unfused optimizers)."""
    for p in model.parameters():
        group = getattr(p, "_lt_sp_group", None)
        if group is not None and p.grad is not None:
            C.all_reduce(p.grad, group=group)


class ColumnParallelLinear(nn.Linear):
    """``nn.Linear(in_features, out_features)`` with the output features split over the TP group."""

    linear_fn = staticmethod(F.linear)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group=None,
                 sequence_parallel: bool = False, gather_output: bool = False, seq_dim: int = 0,
                 device=None, dtype=None):
        n = _ws(group)
        if out_features % n:
            raise ValueError(f"ColumnParallelLinear: out_features={out_features} is not divisible by {n} ranks")
        super().__init__(in_features, out_features // n, bias, device=device, dtype=dtype)
        self.tp_group = group if group is not None else (torch.distributed.group.WORLD if n > 1 else None)
        self.full_out_features = out_features
        self.sequence_parallel, self.gather_output, self.seq_dim = sequence_parallel, gather_output, seq_dim

    def forward(self, x: Tensor) -> Tensor:
        g = self.tp_group
        x = gather_sequence(x, g, self.seq_dim) if self.sequence_parallel else copy_to_tp(x, g)
        y = self.linear_fn(x, self.weight, self.bias)
        return _GatherLast.apply(y, g) if self.gather_output else y

    @classmethod
    def from_linear(cls, lin: nn.Linear, group=None, **kw) -> ColumnParallelLinear:
        """This rank's shard of a full ``nn.Linear`` (same values as the unsharded layer)."""
        m = cls(lin.in_features, lin.out_features, lin.bias is not None, group=group,
                device=lin.weight.device, dtype=lin.weight.dtype, **kw)
        r, n = C.rank(group), _ws(group)
        with torch.no_grad():
            m.weight.copy_(lin.weight.chunk(n, 0)[r])
            if lin.bias is not None:
                m.bias.copy_(lin.bias.chunk(n, 0)[r])
        return m


class RowParallelLinear(nn.Linear):
    """``nn.Linear(in_features, out_features)`` with the input features split over the TP group."""

    linear_fn = staticmethod(F.linear)
    forge_fuse_bias = False  # the bias is added after the reduction, outside the matmul

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group=None,
                 sequence_parallel: bool = False, input_is_parallel: bool = True, seq_dim: int = 0,
                 device=None, dtype=None):
        n = _ws(group)
        if in_features % n:
            raise ValueError(f"RowParallelLinear: in_features={in_features} is not divisible by {n} ranks")
        super().__init__(in_features // n, out_features, bias, device=device, dtype=dtype)
        self.tp_group = group if group is not None else (torch.distributed.group.WORLD if n > 1 else None)
        self.full_in_features = in_features
        self.sequence_parallel, self.input_is_parallel, self.seq_dim = sequence_parallel, input_is_parallel, seq_dim
        if bias and sequence_parallel and n > 1:
            mark_sequence_parallel(self.bias, self.tp_group)

    def forward(self, x: Tensor) -> Tensor:
        g = self.tp_group
        if not self.input_is_parallel:
            x = _ScatterLast.apply(x, g)
        y = self.linear_fn(x, self.weight, None)
        y = scatter_sequence(y, g, self.seq_dim) if self.sequence_parallel else reduce_from_tp(y, g)
        return y if self.bias is None else y + self.bias

    @classmethod
    def from_linear(cls, lin: nn.Linear, group=None, **kw) -> RowParallelLinear:
        m = cls(lin.in_features, lin.out_features, lin.bias is not None, group=group,
                device=lin.weight.device, dtype=lin.weight.dtype, **kw)
        r, n = C.rank(group), _ws(group)
        with torch.no_grad():
            m.weight.copy_(lin.weight.chunk(n, 1)[r])
            if lin.bias is not None:
                m.bias.copy_(lin.bias)
        return m


__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "copy_to_tp", "reduce_from_tp", "gather_sequence",
    "scatter_sequence", "split_sequence", "mark_sequence_parallel", "allreduce_sequence_parallel_grads",
]

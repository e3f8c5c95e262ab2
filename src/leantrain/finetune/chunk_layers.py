"""ChunkFT's layers: ``F.linear`` and ``F.embedding`` whose backward computes the weight gradient
of the optimizer's active rows only and hands it over (``ChunkFT.add_grad``); the input gradient is
always computed in full (and before the optimizer may step the weight inside backward)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from leantrain.ops._backend import mm_fp32


class _ChunkLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, opt) -> Tensor:
        # the weight is held as the parameter itself: its gradient rows are found by its identity,
        # which a tensor unpacked by saved_tensors_hooks (the ledger's meter, AGoQ) need not keep
        ctx.opt, ctx.bias, ctx.weight = opt, bias, weight
        ctx.save_for_backward(x)  # (through saved_tensors_hooks: the ledger, AGoQ)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy: Tensor):
        (x,), weight = ctx.saved_tensors, ctx.weight
        dx = dy.matmul(weight.to(dy.dtype)) if ctx.needs_input_grad[0] else None
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        opt = ctx.opt

        def dw(lo: int, hi: int) -> Tensor:
            out = torch.empty(hi - lo, x2.shape[1], dtype=torch.float32, device=x2.device)
            mm_fp32(dy2[:, lo:hi].t(), x2.to(dy2.dtype), out, allow_upcast=True)
            return out

        opt.add_grad(weight, dw)
        if ctx.bias is not None:
            opt.add_grad(ctx.bias, lambda lo, hi: dy2[:, lo:hi].float().sum(0))
        return dx, None, None, None


class _ChunkEmbeddingFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, idx: Tensor, weight: Tensor, padding_idx: int | None, opt) -> Tensor:
        ctx.opt, ctx.padding_idx, ctx.weight = opt, padding_idx, weight  # (by identity, as _ChunkLinearFn's)
        ctx.save_for_backward(idx)
        return F.embedding(idx, weight, padding_idx)

    @staticmethod
    def backward(ctx, dy: Tensor):
        (idx,), weight = ctx.saved_tensors, ctx.weight
        flat, d = idx.reshape(-1), dy.reshape(-1, dy.shape[-1])

        def rows(lo: int, hi: int) -> Tensor:
            sel = (flat >= lo) & (flat < hi)
            if ctx.padding_idx is not None:
                sel &= flat != ctx.padding_idx
            # autograd's own embedding backward on the tokens in [lo, hi): deterministic on CUDA too
            # (index_add_'s atomics there change the sums' order from run to run)
            return torch.ops.aten.embedding_dense_backward(d[sel].float(), flat[sel] - lo, hi - lo, -1, False)

        ctx.opt.add_grad(weight, rows)
        return None, None, None, None


class LinearForward:
    def __init__(self, module: nn.Linear, opt):
        self.module, self.opt = module, opt

    def __call__(self, x: Tensor) -> Tensor:
        m = self.module
        return chunk_linear(self.opt, x, m.weight, m.bias)


class LinearFn:
    def __init__(self, opt):
        self.opt = opt

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        return chunk_linear(self.opt, x, weight, bias)


class EmbeddingForward:
    def __init__(self, module: nn.Embedding, opt):
        self.module, self.opt = module, opt

    def __call__(self, idx: Tensor) -> Tensor:
        m = self.module
        if not torch.is_grad_enabled() or not m.weight.requires_grad:
            return F.embedding(idx, m.weight, m.padding_idx)
        return _ChunkEmbeddingFn.apply(idx, m.weight, m.padding_idx, self.opt)


def chunk_linear(opt, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear`` whose backward gives the weight (and bias) gradient of the active rows only."""
    if not torch.is_grad_enabled() or not (weight.requires_grad or (bias is not None and bias.requires_grad)):
        return F.linear(x, weight, bias)
    return _ChunkLinearFn.apply(x, weight, bias, opt)

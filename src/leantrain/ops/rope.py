"""Rotary position embedding in one pass forward and one backward.

For ``x [B, H, T, hd]`` (any strides over B, H, T; the last dim contiguous) and the tables
``cos, sin [T_max, hd / 2]`` (fp32), with ``x1, x2`` the two halves of the last dim (the
Hugging Face layout) and ``c, s`` the tables' row ``t`` rounded to ``x``'s dtype::

    y = (x1·c - x2·s, x2·c + x1·s)

each product and each sum rounded to ``x``'s dtype, as the op-by-op form computes it, so the
forward equals it bit for bit (the Triton kernel too: no contraction into FMAs). ``y`` is
contiguous ``[B, H, T, hd]`` (what the op-by-op form's ``cat`` gives). Backward is the rotation by
``-θ``, ``dx = (dy1·c + dy2·s, dy2·c - dy1·s)`` in fp32, rounded once, written in ``x``'s own
layout (the transposed view of a projection's output: no copy when autograd views it back).

The op-by-op form is ~9 kernels forward and more backward over ``q`` and ``k`` in every
layer (casts, two halves, four products, a sum, a difference, ``cat``), each a launch of host
time; this is one each. Nothing is saved but the two tables (buffers).

Kernel: tiles of ``R`` rows (a row: one ``(b, h, t)``) × the half width; the row's input and
output addresses from its (b, h, t) and the strides. Bytes: ``x`` read and ``y`` written once
(2·B·H·T·hd·s each way), the tables' rows read per row (from L2: T·hd·4 distinct bytes). The
torch reference is the op-by-op form.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from leantrain.ops._backend import HAS_TRITON, interpreting, launch, next_pow2, resolve
from leantrain.ops.tiles import FAST_HW_CAST

__all__ = ["rope", "rope_ref"]


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The op-by-op form (``leantrain.model``'s before this module)."""
    T = x.shape[-2]
    cos, sin = cos[:T].to(x.dtype), sin[:T].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _rope_bwd_ref(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout) -> torch.Tensor:
    T = dy.shape[-2]
    c, s = cos[:T].to(dy.dtype).float(), sin[:T].to(dy.dtype).float()
    d1, d2 = dy.float().chunk(2, dim=-1)
    dx = torch.cat((d1 * c + d2 * s, d2 * c - d1 * s), dim=-1).to(dy.dtype)
    return _in_layout(dx, layout)


def _layout(x: torch.Tensor):
    """``x``'s strides when a tensor laid out like it is dense (a contiguous tensor or the
    transposed view of one, as a projection's output split into heads is), else None."""
    if x.is_contiguous() or x.transpose(1, 2).is_contiguous():
        return x.stride()
    return None


def _in_layout(t: torch.Tensor, stride) -> torch.Tensor:
    if stride is None or t.stride() == tuple(stride):
        return t
    out = torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device)
    return out.copy_(t)


def _check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if x.dim() != 4 or x.shape[-1] % 2:
        raise ValueError(f"rope: x must be [B, H, T, head_dim] with an even head_dim, got {tuple(x.shape)}")
    half = x.shape[-1] // 2
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != half or cos.shape[0] < x.shape[-2]:
        raise ValueError(f"rope: cos / sin must be [>= {x.shape[-2]}, {half}], got {tuple(cos.shape)} / {tuple(sin.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"rope: x must be fp32 / bf16 / fp16, got {x.dtype}")


def _launch(src: torch.Tensor, dst: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> None:
    B, H, T, hd = src.shape
    n = B * H * T
    if not n:
        return
    half = hd // 2
    bh = next_pow2(half)
    r = max(1, min(64, 4096 // bh))
    launch(_rope_kernel, (-(-n // r),), src, cos, sin, dst, n, H, T, *src.stride()[:3], *dst.stride()[:3],
           HALF=half, BH=bh, R=r, BACKWARD=backward, FAST=0 if interpreting() else FAST_HW_CAST, num_warps=4)


class RopeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        _launch(x, y, cos.contiguous(), sin.contiguous(), backward=False)
        ctx.save_for_backward(cos, sin)
        ctx.layout = _layout(x)
        return y

    @staticmethod
    @once_differentiable  # (the kernels are not differentiable: a double backward raises)
    def backward(ctx, dy: torch.Tensor):
        cos, sin = ctx.saved_tensors
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        st = ctx.layout
        dx = (torch.empty_strided(dy.shape, st, dtype=dy.dtype, device=dy.device) if st is not None
              else torch.empty(dy.shape, dtype=dy.dtype, device=dy.device))
        _launch(dy, dx, cos.contiguous(), sin.contiguous(), backward=True)
        return dx, None, None


class RopeRefFn(torch.autograd.Function):
    """The torch path as one function too (the same saves as on CUDA: the two tables)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.layout = _layout(x)
        return rope_ref(x, cos, sin)

    @staticmethod
    @once_differentiable  # (the kernels are not differentiable: a double backward raises)
    def backward(ctx, dy: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rope_bwd_ref(dy, cos, sin, ctx.layout), None, None


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Rotate ``x [B, H, T, hd]`` by the position tables ``cos, sin [>= T, hd / 2]`` (module docstring)."""
    _check(x, cos, sin)
    if resolve(backend, x, cos, sin) == "torch":
        return RopeRefFn.apply(x, cos, sin)
    return RopeFn.apply(x, cos, sin)


if HAS_TRITON:
    import triton
    import triton.language as tl

    from leantrain.ops.tl_helpers import cast_out_tl

    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, N, H, T, sb, sh, st, ob, oh, ot, HALF: tl.constexpr,
                     BH: tl.constexpr, R: tl.constexpr, BACKWARD: tl.constexpr, FAST: tl.constexpr):
        rows = tl.program_id(0) * R + tl.arange(0, R)
        live = rows < N
        t = rows % T
        bh = rows // T
        h = (bh % H).to(tl.int64)
        b = (bh // H).to(tl.int64)
        t64 = t.to(tl.int64)
        src = b * sb + h * sh + t64 * st
        dst = b * ob + h * oh + t64 * ot
        cols = tl.arange(0, BH)
        m = live[:, None] & (cols < HALF)[None, :]
        dt = x_ptr.dtype.element_ty
        x1 = tl.load(x_ptr + src[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + src[:, None] + HALF + cols[None, :], mask=m, other=0.0).to(tl.float32)
        tab = t64[:, None] * HALF + cols[None, :]
        c = cast_out_tl(tl.load(cos_ptr + tab, mask=m, other=0.0).to(tl.float32), dt, FAST).to(tl.float32)
        s = cast_out_tl(tl.load(sin_ptr + tab, mask=m, other=0.0).to(tl.float32), dt, FAST).to(tl.float32)
        if BACKWARD:  # the rotation by -theta, fp32, one rounding
            y1 = cast_out_tl(x1 * c + x2 * s, dt, FAST)
            y2 = cast_out_tl(x2 * c - x1 * s, dt, FAST)
        else:  # every product and sum rounded, as the op-by-op form does
            a = cast_out_tl(x1 * c, dt, FAST).to(tl.float32)
            bb = cast_out_tl(x2 * s, dt, FAST).to(tl.float32)
            y1 = cast_out_tl(a - bb, dt, FAST)
            a = cast_out_tl(x2 * c, dt, FAST).to(tl.float32)
            bb = cast_out_tl(x1 * s, dt, FAST).to(tl.float32)
            y2 = cast_out_tl(a + bb, dt, FAST)
        tl.store(y_ptr + dst[:, None] + cols[None, :], y1, mask=m)
        tl.store(y_ptr + dst[:, None] + HALF + cols[None, :], y2, mask=m)

"""RMSNorm in one pass forward and one pass backward, saving only ``x`` and ``rstd``.

``out = round_x(x · rstd) · w`` with ``rstd = 1 / sqrt(mean(x²) + eps)`` over the last dim, the
product computed in fp32 and ``round_x`` the rounding to ``x``'s dtype (Llama's reference:
normalize in fp32, cast back, scale); ``out`` has the promoted dtype of ``x`` and ``w``.

Op by op in torch this is ~8 kernels forward (cast, square, mean, add, rsqrt, multiply, cast,
multiply) and more backward, and autograd keeps an fp32 copy of ``x`` *and* the normalized
``x`` for backward: at 1b, B = 8 that is 6 bytes an element of the residual stream per norm
(45 norms), where this keeps ``x`` (2 bytes in bf16) and ``rstd`` (one fp32 a row).

:func:`rms_norm` is an autograd function; its forward saves ``(x, rstd, w)`` with
``ctx.save_for_backward``, so saved-tensor hooks (the memory ledger, AGoQ's ``norm`` role:
``x`` packed, ``rstd`` a statistic kept exact) see exactly those.

Backward, with ``g = dout · w`` in fp32:
``dx = rstd · (g - x · rstd² · mean(g · x))`` (in ``x``'s dtype) and
``dw = Σ_rows dout · round_x(x · rstd)`` (fp32 sums, then ``w``'s dtype). The cast ``round_x``
is taken as the identity in backward, as autograd does.

Kernels: tiles of ``R`` rows × ``BLOCK`` columns (whole rows in registers, ``BLOCK`` the next
power of two ≥ D, ``R · BLOCK`` ≈ 8192); forward, one program per tile; backward, two
programs per SM striding over the tiles, each accumulating its share of ``dw`` in registers and
writing it to a ``[programs, D]`` fp32 buffer summed by torch. Bytes (N rows, element size
s): forward reads ``x`` and writes ``out`` (2·N·D·s) and ``rstd`` (4N); backward reads ``x`` and
``dout`` and writes ``dx`` (3·N·D·s), plus ``4·programs·D`` for ``dw``'s partial sums. The torch
reference computes the forward exactly as the op-by-op module (bit-identical on CPU) and the
backward by the formulas above; the Triton kernels differ from it by summation order.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from leantrain.ops._backend import HAS_TRITON, interpreting, launch, next_pow2, resolve
from leantrain.ops.tiles import FAST_HW_CAST

__all__ = ["rms_norm", "rms_norm_fwd", "rms_norm_bwd", "MAX_DIM"]

MAX_DIM = 16384  # the kernels hold whole rows in registers (16 warps: 32 values a thread); wider: torch


def rms_norm_fwd_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd).to(x.dtype) * w, rstd


def rms_norm_bwd_ref(dout: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, w: torch.Tensor):
    xf, gf = x.float(), dout.float()
    y = (xf * rstd).to(x.dtype).float()
    dw = (gf * y).reshape(-1, x.shape[-1]).sum(0).to(w.dtype)
    g = gf * w.float()
    c = (g * xf).sum(-1, keepdim=True) / x.shape[-1]
    dx = rstd * (g - xf * (rstd * rstd) * c)
    return dx.to(x.dtype), dw


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _check(x: torch.Tensor, w: torch.Tensor) -> None:
    if x.dtype not in _FLOATS or w.dtype not in _FLOATS:
        raise TypeError(f"rms_norm: x and weight must be fp32 / bf16 / fp16, got {x.dtype} and {w.dtype}")
    if w.dim() != 1 or x.dim() < 1 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"rms_norm: weight {tuple(w.shape)} must be [D] with D = x's last dim, x is {tuple(x.shape)}")
    if x.device != w.device:
        raise ValueError(f"rms_norm: x on {x.device}, weight on {w.device}")


def _warps(elems: int) -> int:
    """Warps of a program holding ``elems`` fp32 values per operand (~32 each a thread)."""
    return 1 if elems <= 256 else 4 if elems <= 2048 else 8 if elems <= 8192 else 16


def _rows(block: int) -> int:
    """Rows a program takes at once: ~8192 elements a tile (more loads in flight per program)."""
    return max(1, min(16, 8192 // block))


def rms_norm_fwd(x: torch.Tensor, w: torch.Tensor, eps: float, *, backend: str = "auto"):
    """``(out, rstd)``: the normalized, scaled ``x`` and ``rstd`` of shape ``x.shape[:-1] + (1,)`` (fp32)."""
    _check(x, w)
    d = x.shape[-1]
    if d > MAX_DIM:
        if backend == "triton":
            raise ValueError(f"rms_norm: the Triton kernels take D <= {MAX_DIM}, got {d} (use backend='torch' or 'auto')")
        backend = "torch"
    if resolve(backend, x, w) == "torch":
        return rms_norm_fwd_ref(x, w, eps)
    x2 = x.reshape(-1, d)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    n = x2.shape[0]
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, w.dtype), device=x.device)
    rstd = torch.empty(*x.shape[:-1], 1, dtype=torch.float32, device=x.device)
    if n:
        block = next_pow2(d)
        r = _rows(block)
        launch(_fwd_kernel, (-(-n // r),), x2, w.contiguous(), out, rstd, n, d, float(eps), R=r, BLOCK=block,
               FAST=0 if interpreting() else FAST_HW_CAST, num_warps=_warps(block * r))
    return out, rstd


def rms_norm_bwd(dout: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, w: torch.Tensor, *,
                 backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dw)`` of :func:`rms_norm_fwd` for the output gradient ``dout``."""
    d = x.shape[-1]
    if d > MAX_DIM or resolve(backend, x, w) == "torch":
        return rms_norm_bwd_ref(dout, x, rstd, w)
    x2 = x.reshape(-1, d).contiguous()
    g2 = dout.reshape(-1, d).contiguous()
    n = x2.shape[0]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if not n:
        return dx, torch.zeros_like(w)
    block = next_pow2(d)
    r = _rows(block)
    tiles = -(-n // r)
    progs = min(tiles, _programs(x.device))
    part = torch.empty(progs, d, dtype=torch.float32, device=x.device)
    launch(_bwd_kernel, (progs,), g2, x2, w.contiguous(), rstd, dx, part, n, d, tiles, R=r, BLOCK=block,
           FAST=0 if interpreting() else FAST_HW_CAST, num_warps=_warps(block * r))
    return dx, part.sum(0).to(w.dtype)


_SMS: dict = {}


def _programs(device: torch.device) -> int:
    """Backward programs: two per SM (each sums its tiles' share of dw)."""
    if device.type != "cuda":
        return 4
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SMS:
        _SMS[key] = 2 * torch.cuda.get_device_properties(key).multi_processor_count
    return _SMS[key]


class RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, eps: float, backend: str) -> torch.Tensor:
        out, rstd = rms_norm_fwd(x, w, eps, backend=backend)
        ctx.backend = backend
        ctx.save_for_backward(x, rstd, w)
        return out

    @staticmethod
    @once_differentiable  # (the kernels are not differentiable: a double backward raises)
    def backward(ctx, dout: torch.Tensor):
        x, rstd, w = ctx.saved_tensors
        dx, dw = rms_norm_bwd(dout, x, rstd, w, backend=ctx.backend)
        return (dx if ctx.needs_input_grad[0] else None), (dw if ctx.needs_input_grad[1] else None), None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, *, backend: str = "auto") -> torch.Tensor:
    """RMSNorm of ``x`` over its last dim, scaled by ``weight`` (module docstring). Autocast does
    not cast its inputs (a custom function): the output dtype is the promotion of ``x``'s and
    ``weight``'s. Rows wider than :data:`MAX_DIM` take the torch reference under ``"auto"``."""
    return RMSNormFn.apply(x, weight, eps, backend)


if HAS_TRITON:
    import triton
    import triton.language as tl

    from leantrain.ops.tl_helpers import (
        cast_out_tl,  # (round to nearest even, under the interpreter too)
    )

    @triton.jit(do_not_specialize=["eps"])
    def _fwd_kernel(x_ptr, w_ptr, out_ptr, rstd_ptr, N, D, eps, R: tl.constexpr, BLOCK: tl.constexpr,
                    FAST: tl.constexpr):
        rows = tl.program_id(0) * R + tl.arange(0, R)
        cols = tl.arange(0, BLOCK)
        live = rows < N
        m = live[:, None] & (cols < D)[None, :]
        off = rows.to(tl.int64)[:, None] * D + cols[None, :]
        x = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) / D + eps)
        y = cast_out_tl(x * r[:, None], x_ptr.dtype.element_ty, FAST).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        tl.store(out_ptr + off, cast_out_tl(y * w[None, :], out_ptr.dtype.element_ty, FAST), mask=m)
        tl.store(rstd_ptr + rows, r, mask=live)

    @triton.jit
    def _bwd_kernel(g_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, part_ptr, N, D, TILES, R: tl.constexpr,
                    BLOCK: tl.constexpr, FAST: tl.constexpr):
        pid = tl.program_id(0)
        progs = tl.num_programs(0)
        cols = tl.arange(0, BLOCK)
        cmask = cols < D
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK], tl.float32)
        for t in range(pid, TILES, progs):  # tiles of R rows, strided over the programs
            rows = t * R + tl.arange(0, R)
            live = rows < N
            m = live[:, None] & cmask[None, :]
            off = rows.to(tl.int64)[:, None] * D + cols[None, :]
            x = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
            g0 = tl.load(g_ptr + off, mask=m, other=0.0).to(tl.float32)
            r = tl.load(rstd_ptr + rows, mask=live, other=0.0)[:, None]
            y = cast_out_tl(x * r, x_ptr.dtype.element_ty, FAST).to(tl.float32)
            dw += tl.sum(g0 * y, axis=0)
            g = g0 * w[None, :]
            c = tl.sum(g * x, axis=1)[:, None] / D
            dx = r * (g - x * (r * r) * c)
            tl.store(dx_ptr + off, cast_out_tl(dx, dx_ptr.dtype.element_ty, FAST), mask=m)
        tl.store(part_ptr + pid.to(tl.int64) * D + cols, dw, mask=cmask)

"""SwiGLU, ``h = silu(g) · u``, as one function: one pass forward, one backward.

Autograd's op-by-op form (``F.silu(g) * u``) saves three tensors of the MLP's intermediate width
for backward: ``g`` (for silu) and ``silu(g)``, ``u`` (for the product). This saves two, ``g`` and
``u``, and recomputes ``sigmoid(g)`` in backward: a third less of those bytes (at 1b, B = 8, by
arithmetic, 5632 x 8192 bf16 values a layer). It takes ``g`` and ``u`` as two tensors or as the two halves of one
(``swiglu(gu)``: the output of ``model.fused_proj``'s ``gate_up_proj``), and then writes their
gradient as one tensor (no ``cat`` of the halves' gradients).

In fp32, each result rounded once to the inputs' dtype (with ``s = sigmoid(g)``)::

    h  = g·s·u
    du = dh·g·s
    dg = dh·u·s·(1 + g·(1 - s))

The op-by-op form rounds ``silu(g)`` to the dtype before the product: in bf16 the two differ by
that rounding (the same function). The torch path computes these formulas op by op (CPU and the
tests' reference); on CUDA one Triton kernel reads ``g``, ``u`` (and ``dh``) once and writes ``h``
(``dg``, ``du``) once, for rows of any stride (the last dim contiguous).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from leantrain.ops._backend import HAS_TRITON, launch, next_pow2, resolve

__all__ = ["swiglu", "swiglu_ref"]


def swiglu_ref(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The op-by-op form (``leantrain.model``'s MLP without ``fused_swiglu``)."""
    return torch.nn.functional.silu(g) * u


def _fwd_torch(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    gf = g.float()
    return (gf * torch.sigmoid(gf) * u.float()).to(g.dtype)


def _bwd_torch(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gf, uf, dhf = g.float(), u.float(), dh.float()
    s = torch.sigmoid(gf)
    return (dhf * uf * s * (1 + gf * (1 - s))).to(g.dtype), (dhf * gf * s).to(u.dtype)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as [rows, width] with a contiguous last dim (a view when its strides allow)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(-1, t.shape[-1])


def _launch(g, u, x, dg=None, du=None) -> None:
    M, N = g.shape
    if not M * N:
        return
    bn = min(1024, next_pow2(N))
    bm = max(1, 2048 // bn)
    back = dg is not None
    launch(_swiglu_kernel, (-(-M // bm), -(-N // bn)), g, u, x, dg if back else x, du if back else x, M, N,
           g.stride(0), u.stride(0), x.stride(0), dg.stride(0) if back else 0, du.stride(0) if back else 0,
           BACKWARD=back, BM=bm, BN=bn, num_warps=4)


class SwigluFn(torch.autograd.Function):
    """``g``, ``u`` [..., N] (or ``gu`` [..., 2N] with ``u=None``: its halves) -> ``h`` [..., N]."""

    @staticmethod
    def forward(ctx, g: torch.Tensor, u: torch.Tensor | None, triton: bool) -> torch.Tensor:
        ctx.halves, ctx.triton = u is None, triton
        gu = g
        if ctx.halves:
            g, u = gu.chunk(2, dim=-1)
        if triton:
            h = torch.empty(g.shape, dtype=g.dtype, device=g.device)
            _launch(_rows(g), _rows(u), h.view(-1, h.shape[-1]))
        else:
            h = _fwd_torch(g, u)
        ctx.save_for_backward(*((gu,) if ctx.halves else (g, u)))
        return h

    @staticmethod
    @once_differentiable  # (the kernel is not differentiable: a double backward raises)
    def backward(ctx, dh: torch.Tensor):
        saved = ctx.saved_tensors
        g, u = saved[0].chunk(2, dim=-1) if ctx.halves else saved
        if ctx.triton:
            if ctx.halves:  # both halves' gradients in one tensor, as the fused output's gradient
                dgu = torch.empty(saved[0].shape, dtype=g.dtype, device=g.device)
                dg, du = dgu.chunk(2, dim=-1)
            else:
                dg = torch.empty(g.shape, dtype=g.dtype, device=g.device)
                du = torch.empty(u.shape, dtype=u.dtype, device=u.device)
            # (outputs as views: the kernel must write into them, never into a copy)
            _launch(_rows(g), _rows(u), _rows(dh), dg.view(-1, dg.shape[-1]), du.view(-1, du.shape[-1]))
        else:
            dg, du = _bwd_torch(dh, g, u)
            if ctx.halves:
                dgu = torch.cat((dg, du), dim=-1)
        if ctx.halves:
            return dgu, None, None
        return dg, du, None


def swiglu(g: torch.Tensor, u: torch.Tensor | None = None, *, backend: str = "auto") -> torch.Tensor:
    """``silu(g) · u``, saving ``g`` and ``u`` only (module docstring). With ``u=None``, ``g`` holds
    both: its last dim's first half is the gate, the second the up projection."""
    if g.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"swiglu: inputs must be fp32 / bf16 / fp16, got {g.dtype}")
    if u is None:
        if g.shape[-1] % 2:
            raise ValueError(f"swiglu: one input holds both halves: its last dim must be even, got {tuple(g.shape)}")
    elif u.shape != g.shape or u.dtype != g.dtype or u.device != g.device:
        raise ValueError(f"swiglu: g and u must match, got {tuple(g.shape)} {g.dtype} / {tuple(u.shape)} {u.dtype}")
    tensors = (g,) if u is None else (g, u)
    return SwigluFn.apply(g, u, resolve(backend, *tensors) == "triton")


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _swiglu_kernel(G, U, X, DG, DU, M, N, s_g, s_u, s_x, s_dg, s_du, BACKWARD: tl.constexpr, BM: tl.constexpr,
                       BN: tl.constexpr):
        """A BM x BN tile of rows: forward h (into X) from g, u; backward dg, du from g, u and dh (X)."""
        rm = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)[:, None]
        rn = (tl.program_id(1) * BN + tl.arange(0, BN))[None, :]
        mask = (rm < M) & (rn < N)
        g = tl.load(G + rm * s_g + rn, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + rm * s_u + rn, mask=mask, other=0.0).to(tl.float32)
        s = 1.0 / (1.0 + tl.exp(-g))
        if BACKWARD:
            dh = tl.load(X + rm * s_x + rn, mask=mask, other=0.0).to(tl.float32)
            tl.store(DU + rm * s_du + rn, (dh * g * s).to(DU.dtype.element_ty), mask=mask)
            tl.store(DG + rm * s_dg + rn, (dh * u * s * (1.0 + g * (1.0 - s))).to(DG.dtype.element_ty), mask=mask)
        else:
            tl.store(X + rm * s_x + rn, (g * s * u).to(X.dtype.element_ty), mask=mask)

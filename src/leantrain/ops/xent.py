"""The element-wise passes of the fused LM head + cross-entropy (:mod:`leantrain.model.losses`), one
read of a logits slice each.

For a slice ``z [N, C]`` (fp32, contiguous: columns ``j0 .. j0 + C`` of the vocabulary):

- :func:`slice_lse`: per row, ``log Σ_c exp(z_c)`` over the slice's columns, and the target's
  logit ``z[t - j0]`` where the target ``t`` is in the slice (0 elsewhere, and for
  ``ignore_index``). The caller folds the slices' log-sum-exps with ``logaddexp``.
- :func:`softmax_grad`: ``dz = g · (exp(z - lse) - [c == t - j0])`` in the output dtype (bf16 for
  a bf16 model): the cross-entropy's gradient for these columns, rounded once.

Torch does each in 4-6 passes over the slice (max, subtract, exp, sum; exp, one-hot, scale,
cast), each a read and most a write of ``N × C × 4`` bytes; the Triton kernels read it once
(and ``softmax_grad`` writes ``dz`` once). At 1b, B = 8 that is ~1 GiB per pass and step.

Kernels: ``slice_lse``, one program per row, a running (max, sum of exp) per lane over
``BLOCK``-column steps, combined at the end (-inf-safe: a row of -inf gives -inf);
``softmax_grad``, one program per (row, ``BLOCK`` columns). 64-bit offsets. The torch
reference computes the same formulas (``exp`` may differ in the last bits between the two).
"""

from __future__ import annotations

import torch

from leantrain.ops._backend import HAS_TRITON, launch, next_pow2, resolve

__all__ = ["slice_lse", "softmax_grad"]


def slice_lse_ref(z: torch.Tensor, targets: torch.Tensor, j0: int, ignore_index: int):
    c = z.shape[1]
    inside = (targets != ignore_index) & (targets >= j0) & (targets < j0 + c)
    zt = torch.where(inside, z.gather(1, torch.where(inside, targets - j0, 0).unsqueeze(1)).squeeze(1), 0.0)
    m = z.amax(1)
    m = torch.where(torch.isfinite(m), m, 0.0)  # a row of -inf: exp gives 0, its log-sum-exp -inf
    part = (z - m.unsqueeze(1)).exp_().sum(1).log_().add_(m)
    return part, zt


def softmax_grad_ref(z, lse, g, targets, j0: int, out_dtype):
    p = (z - lse.view(-1, 1)).exp_()
    c = z.shape[1]
    inside = (targets >= j0) & (targets < j0 + c)
    p.scatter_add_(1, torch.where(inside, targets - j0, 0).unsqueeze(1), inside.float().neg_().unsqueeze(1))
    return p.mul_(g.view(-1, 1)).to(out_dtype)


def _check(z: torch.Tensor, targets: torch.Tensor) -> None:
    if z.dim() != 2 or z.dtype != torch.float32 or not z.is_contiguous():
        raise ValueError(f"xent: z must be a contiguous fp32 [N, C] slice, got {z.dtype} {tuple(z.shape)}")
    if targets.shape != z.shape[:1]:
        raise ValueError(f"xent: targets {tuple(targets.shape)} must be [{z.shape[0]}]")


def slice_lse(z: torch.Tensor, targets: torch.Tensor, j0: int, ignore_index: int = -100, *,
              backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(per-row log-sum-exp of ``z``, the target's logit or 0): two fp32 ``[N]`` tensors."""
    _check(z, targets)
    if resolve(backend, z) == "torch":
        return slice_lse_ref(z, targets, j0, ignore_index)
    n, c = z.shape
    part = torch.empty(n, dtype=torch.float32, device=z.device)
    zt = torch.empty(n, dtype=torch.float32, device=z.device)
    block = min(2048, next_pow2(c))
    launch(_lse_kernel, (n,), z, targets, part, zt, c, j0, ignore_index, BLOCK=block,
           num_warps=8 if block >= 2048 else 4)
    return part, zt


def softmax_grad(z: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, targets: torch.Tensor, j0: int,
                 out_dtype: torch.dtype, *, backend: str = "auto") -> torch.Tensor:
    """``g · (exp(z - lse) - onehot(t - j0))`` in ``out_dtype``; ``lse``, ``g`` fp32 ``[N]`` (``g``
    0 for ignored rows: their one-hot never matches, the product is 0)."""
    _check(z, targets)
    if resolve(backend, z) == "torch":
        return softmax_grad_ref(z, lse, g, targets, j0, out_dtype)
    n, c = z.shape
    dz = torch.empty(n, c, dtype=out_dtype, device=z.device)
    block = min(1024, next_pow2(c))
    launch(_grad_kernel, (n, -(-c // block)), z, lse.contiguous(), g.contiguous(), targets, dz, c, j0, BLOCK=block,
           num_warps=4)
    return dz


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["j0", "ignore"])
    def _lse_kernel(z_ptr, t_ptr, part_ptr, zt_ptr, C, j0, ignore, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = z_ptr + row.to(tl.int64) * C
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        for c0 in range(0, C, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < C, other=float("-inf"))
            m_new = tl.maximum(m, x)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp(m - m_safe) + tl.exp(x - m_safe)
            m = m_new
        mx = tl.max(m, axis=0)
        mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
        tot = tl.sum(s * tl.exp(m - mx_safe), axis=0)
        tl.store(part_ptr + row, mx_safe + tl.log(tot))
        t = tl.load(t_ptr + row)
        inside = (t != ignore) & (t >= j0) & (t < j0 + C)
        zt = tl.load(base + tl.where(inside, t - j0, 0), mask=inside, other=0.0)
        tl.store(zt_ptr + row, zt)

    @triton.jit(do_not_specialize=["j0"])
    def _grad_kernel(z_ptr, lse_ptr, g_ptr, t_ptr, dz_ptr, C, j0, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < C
        off = row.to(tl.int64) * C + cols
        x = tl.load(z_ptr + off, mask=mask, other=0.0)
        lse = tl.load(lse_ptr + row)
        g = tl.load(g_ptr + row)
        t = tl.load(t_ptr + row)
        p = tl.exp(x - lse)
        p = tl.where(cols == t - j0, p - 1.0, p)
        tl.store(dz_ptr + off, (p * g).to(dz_ptr.dtype.element_ty), mask=mask)

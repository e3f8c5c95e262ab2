"""The fused loss's element-wise kernels (``leantrain.ops.xent``) against their torch references:
random slices with ignored, outside-the-slice and in-slice targets, -inf logits, odd widths."""

from __future__ import annotations

import pytest
import torch
from _opslib import DEVICE, triton_runnable

from leantrain.ops.xent import slice_lse, slice_lse_ref, softmax_grad, softmax_grad_ref


def _slice(n, c, j0, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(n, c, generator=g) * 4).to(DEVICE)
    t = torch.randint(j0 - c, j0 + 2 * c, (n,), generator=g)  # a third inside the slice
    t[::7] = -100
    z[3, :] = float("-inf")  # a row of -inf (a masked vocabulary)
    z[5, : c // 2] = float("-inf")
    return z, t.clamp_min(-100).to(DEVICE)


needs_triton = pytest.mark.skipif(not triton_runnable(), reason="Triton: neither the interpreter nor CUDA")


@needs_triton
@pytest.mark.parametrize("n,c,j0", [(9, 37, 0), (16, 300, 128), (7, 2500, 4096)])
def test_slice_lse_matches_reference(n, c, j0):
    z, t = _slice(n, c, j0)
    part, zt = slice_lse(z, t, j0, backend="triton")
    rpart, rzt = slice_lse_ref(z, t, j0, -100)
    assert torch.equal(zt, rzt)  # a gather: exact
    assert part[3] == float("-inf") and rpart[3] == float("-inf")
    fin = torch.isfinite(rpart)
    assert torch.allclose(part[fin], rpart[fin], rtol=1e-6, atol=1e-6)


@needs_triton
@pytest.mark.parametrize("n,c,j0", [(9, 37, 0), (16, 300, 128), (7, 2500, 4096)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_grad_matches_reference(n, c, j0, dtype):
    z, t = _slice(n, c, j0, seed=1)
    z[3, :] = 0.0  # (a -inf row has lse -inf: exp(nan); not a case backward meets with a finite loss)
    lse = torch.logsumexp(z, 1) + 0.5  # other slices' share of the row
    g = torch.rand(n, device=z.device)
    g[t == -100] = 0.0
    dz = softmax_grad(z, lse, g, t, j0, dtype, backend="triton")
    ref = softmax_grad_ref(z, lse, g, t, j0, dtype)
    assert dz.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    assert torch.allclose(dz.float(), ref.float(), rtol=tol, atol=1e-7)
    rows = (t >= j0) & (t < j0 + c)
    assert (dz.float()[rows].sum(1) < 0).all() or not rows.any()  # the one-hot was subtracted


def test_bad_input():
    z = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="fp32"):
        slice_lse(z.double(), torch.zeros(4, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="targets"):
        softmax_grad(z, torch.zeros(4), torch.zeros(4), torch.zeros(3, dtype=torch.long), 0, torch.float32)

"""RMSNorm as one function (``leantrain.ops.norm``): the Triton kernels against the torch
reference, the reference against autograd through the op-by-op module, the saves, bad input."""

from __future__ import annotations

import pytest
import torch
from _opslib import DEVICE, triton_runnable

import leantrain.ops.norm as N
from leantrain.model import RMSNorm

needs_triton = pytest.mark.skipif(not triton_runnable(), reason="Triton: neither the interpreter nor CUDA")
F32, BF16 = torch.float32, torch.bfloat16


def _inputs(shape, dt, wdt, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g) * 3).to(dt).to(DEVICE)
    w = (1 + 0.2 * torch.randn(shape[-1], generator=g)).to(wdt).to(DEVICE)
    dout = torch.randn(*shape, generator=g).to(torch.promote_types(dt, wdt)).to(DEVICE)
    return x, w, dout


def _close(a, b, rel):
    """max |a - b| <= rel * max |b|: a few roundings of the output dtype."""
    a, b = a.float(), b.float()
    return (a - b).abs().max().item() <= rel * b.abs().max().item() + 1e-30


@needs_triton
@pytest.mark.parametrize("shape", [(1, 127), (5, 33), (3, 7, 100), (2, 300), (21, 64), (300, 64), (3, 4097)])
@pytest.mark.parametrize("dt,wdt", [(F32, F32), (BF16, BF16), (BF16, F32), (F32, BF16)])
def test_kernels_match_reference(shape, dt, wdt):
    x, w, dout = _inputs(shape, dt, wdt)
    out, rstd = N.rms_norm_fwd(x, w, 1e-5, backend="triton")
    rout, rrstd = N.rms_norm_fwd_ref(x, w, 1e-5)
    assert out.dtype == rout.dtype == torch.promote_types(dt, wdt) and rstd.shape == (*shape[:-1], 1)
    assert torch.allclose(rstd, rrstd, rtol=1e-6, atol=0)
    rel = 1e-6 if dt == F32 else 2 ** -7  # bf16 x: one rounding apart where rstd's last bit differs
    assert _close(out, rout, rel)
    dx, dw = N.rms_norm_bwd(dout, x, rstd, w, backend="triton")
    rdx, rdw = N.rms_norm_bwd_ref(dout, x, rrstd, w)
    assert dx.dtype == dt and dw.dtype == wdt and dw.shape == w.shape
    assert _close(dx, rdx, 1e-5 if dt == F32 else 2 ** -7)
    assert _close(dw, rdw, 1e-5 if wdt == F32 else 2 ** -7)


@pytest.mark.parametrize("dt,wdt", [(F32, F32), (BF16, BF16), (BF16, F32)])
def test_function_equals_op_by_op_module(dt, wdt):
    """The one-function norm against autograd through the op-by-op module: the same forward
    (bit for bit with the torch reference), gradients within a few roundings."""
    x, w, dout = _inputs((4, 9, 48), dt, wdt, seed=1)
    ref = RMSNorm(48, fused=False).to(DEVICE)
    ours = RMSNorm(48, fused=True).to(DEVICE)
    with torch.no_grad():
        ref.weight.copy_(w.float())
        ours.weight.copy_(w.float())
    ref.to(wdt)
    ours.to(wdt)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ref(xa), ours(xb)
    if DEVICE == "cpu":
        assert torch.equal(ya, yb)
    else:
        assert _close(yb, ya, 1e-6 if dt == F32 else 2 ** -7)
    ya.backward(dout)
    yb.backward(dout)
    # the op-by-op backward rounds dout * w to bf16 before its fp32 math; ours does not
    tol = 2e-6 if dt == F32 and wdt == F32 else 2 ** -6
    assert _close(xb.grad, xa.grad, tol)
    assert _close(ours.weight.grad, ref.weight.grad, tol)


def test_saves_x_and_rstd_only():
    """What autograd keeps: ``x`` (its own dtype), ``rstd`` (fp32, one a row) and the weight; the
    op-by-op module also keeps an fp32 copy of ``x`` and the normalized ``x``."""
    def saved(fused):
        m = RMSNorm(64, fused=fused).to(DEVICE).to(BF16)
        x = torch.randn(8, 16, 64, device=DEVICE, dtype=BF16, requires_grad=True)
        seen = {}

        def pack(t):
            if not isinstance(t, torch.nn.Parameter):
                seen[(t.data_ptr(), t.dtype, tuple(t.shape))] = t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = m(x)
        return seen, y

    fused, _ = saved(True)
    plain, _ = saved(False)
    assert sorted((str(k[1]), k[2]) for k in fused) == [("torch.bfloat16", (8, 16, 64)), ("torch.float32", (8, 16, 1))]
    assert sum(fused.values()) == 8 * 16 * (64 * 2 + 4)
    assert sum(plain.values()) >= 8 * 16 * (64 * (4 + 2) + 4)  # fp32 copy + normalized x + rstd


def test_no_grad_for_weight_or_input():
    x, w, dout = _inputs((3, 16), F32, F32)
    w.requires_grad_()
    y = N.rms_norm(x, w)  # x needs no grad
    y.backward(dout)
    assert w.grad is not None and x.grad is None


def test_bad_input():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="weight"):
        N.rms_norm(x, torch.ones(7))
    with pytest.raises(TypeError, match="fp32"):
        N.rms_norm(x.double(), torch.ones(8))
    with pytest.raises(TypeError, match="fp32"):
        N.rms_norm(torch.ones(4, 8, dtype=torch.int64), torch.ones(8))


@needs_triton
def test_empty_input():
    x, w, _ = _inputs((0, 32), F32, F32)
    out, rstd = N.rms_norm_fwd(x, w, 1e-5, backend="triton")
    assert out.shape == (0, 32) and rstd.shape == (0, 1)
    dx, dw = N.rms_norm_bwd(out, x, rstd, w, backend="triton")
    assert dx.shape == (0, 32) and torch.equal(dw, torch.zeros_like(w))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
@pytest.mark.parametrize("dt", [BF16, F32])
def test_cuda_llama_shapes(dt):
    """The 1b preset's width, a batch of tokens: compiled kernels against the reference."""
    x, w, dout = _inputs((2, 1024, 2048), dt, dt, seed=3)
    x, w, dout = x.cuda(), w.cuda(), dout.cuda()
    out, rstd = N.rms_norm_fwd(x, w, 1e-5, backend="triton")
    rout, rrstd = N.rms_norm_fwd_ref(x, w, 1e-5)
    assert torch.allclose(rstd, rrstd, rtol=1e-6, atol=0)
    rel = 1e-6 if dt == F32 else 2 ** -7
    assert _close(out, rout, rel)
    dx, dw = N.rms_norm_bwd(dout, x, rstd, w, backend="triton")
    rdx, rdw = N.rms_norm_bwd_ref(dout, x, rrstd, w)
    assert _close(dx, rdx, 1e-5 if dt == F32 else 2 ** -7)
    assert _close(dw, rdw, 1e-5 if dt == F32 else 2 ** -7)


def test_double_backward_raises():
    """The backward is a kernel, not differentiable again: asked for, it raises instead of
    silently returning zeros."""
    x, w, dout = _inputs((3, 16), F32, F32)
    x.requires_grad_()
    y = N.rms_norm(x, w)
    (gx,) = torch.autograd.grad(y, x, dout, create_graph=True)
    with pytest.raises(RuntimeError):
        gx.sum().backward()


def test_rows_wider_than_the_kernels_take_the_reference(monkeypatch):
    monkeypatch.setattr(N, "MAX_DIM", 32)
    x, w, _ = _inputs((3, 48), F32, F32)
    out, rstd = N.rms_norm_fwd(x, w, 1e-5)  # auto: the torch reference
    rout, rrstd = N.rms_norm_fwd_ref(x, w, 1e-5)
    assert torch.equal(out, rout) and torch.equal(rstd, rrstd)
    if triton_runnable():
        with pytest.raises(ValueError, match="MAX_DIM|D <="):
            N.rms_norm_fwd(x, w, 1e-5, backend="triton")

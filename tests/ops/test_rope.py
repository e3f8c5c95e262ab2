"""RoPE as one function (``leantrain.ops.rope``): the Triton kernel's forward equals the op-by-op
form bit for bit, backward equals autograd through it within one rounding, gradients keep the
input's layout, the model gives the same loss either way, bad input."""

from __future__ import annotations

import pytest
import torch
from _opslib import DEVICE, triton_runnable

from leantrain.config import ModelConfig
from leantrain.model import Llama, rope_tables
from leantrain.ops.rope import rope, rope_ref

needs_triton = pytest.mark.skipif(not triton_runnable(), reason="Triton: neither the interpreter nor CUDA")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _heads(B, T, H, hd, dtype, seed=0):
    """q as the model makes it: a projection's output [B, T, H * hd] viewed as heads, transposed."""
    g = torch.Generator().manual_seed(seed)
    flat = (torch.randn(B, T, H * hd, generator=g) * 2).to(dtype).to(DEVICE)
    return flat.view(B, T, H, hd).transpose(1, 2)


def _close(a, b, rel):
    a, b = a.float(), b.float()
    return (a - b).abs().max().item() <= rel * b.abs().max().item()


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,H,hd,tmax", [(2, 7, 3, 8, 16), (1, 16, 4, 12, 16), (3, 5, 2, 64, 9)])
def test_kernel_forward_bitwise_backward_close(dtype, B, T, H, hd, tmax):
    cos, sin = (t.to(DEVICE) for t in rope_tables(hd, tmax, 10000.0))
    x = _heads(B, T, H, hd, dtype)
    xa, xb = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    ya, yb = rope_ref(xa, cos, sin), rope(xb, cos, sin, backend="triton")
    assert yb.is_contiguous() and yb.dtype == dtype
    assert torch.equal(ya, yb)  # every product and sum rounded as the op-by-op form rounds it
    dy = torch.randn(B, H, T, hd, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    ya.backward(dy)
    yb.backward(dy)
    assert _close(xb.grad, xa.grad, 1e-6 if dtype == torch.float32 else 2 ** -7)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_gradient_keeps_the_input_layout(backend):
    cos, sin = (t.to(DEVICE) for t in rope_tables(16, 8, 10000.0))
    flat = torch.randn(2, 8, 3 * 16, device=DEVICE, requires_grad=True)
    q = flat.view(2, 8, 3, 16).transpose(1, 2)
    seen = {}

    def keep(g):
        seen["stride"] = g.stride()

    q.register_hook(keep)
    rope(q, cos, sin, backend=backend).sum().backward()
    assert seen["stride"] == q.stride()  # written where the transposed view lives: no copy back
    # and the rotation is orthogonal: the gradient of sum(y) has the norm of sum's gradient (1s)
    assert torch.allclose(flat.grad.norm(), torch.ones_like(flat).norm(), rtol=1e-5)


def test_torch_function_backward_equals_autograd():
    cos, sin = rope_tables(8, 16, 10000.0)
    x = _heads(2, 9, 2, 8, torch.float32).cpu()
    xa, xb = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    dy = torch.randn(2, 2, 9, 8)
    rope_ref(xa, cos, sin).backward(dy)
    rope(xb, cos, sin, backend="torch").backward(dy)
    assert torch.allclose(xa.grad, xb.grad, rtol=1e-6, atol=1e-6)


def test_model_same_loss_with_either_form():
    cfg = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)
    torch.manual_seed(0)
    a = Llama(ModelConfig(**cfg, fused_rope=False))
    b = Llama(ModelConfig(**cfg, fused_rope=True))
    b.load_state_dict(a.state_dict())
    idx = torch.randint(0, 64, (2, 16))
    la, lb = a(idx, idx), b(idx, idx)
    assert torch.equal(la, lb)
    la.backward()
    lb.backward()
    for (n, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.allclose(pa.grad, pb.grad, rtol=1e-5, atol=1e-7), n


def test_bad_input():
    cos, sin = rope_tables(8, 4, 10000.0)
    with pytest.raises(ValueError, match="head_dim"):
        rope(torch.zeros(1, 2, 4, 7), cos, sin)
    with pytest.raises(ValueError, match="cos / sin"):
        rope(torch.zeros(1, 2, 5, 8), cos, sin)  # T beyond the tables
    with pytest.raises(TypeError, match="fp32"):
        rope(torch.zeros(1, 2, 4, 8, dtype=torch.float64), cos, sin)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
def test_cuda_llama_shapes():
    """The 1b preset's q and k (32 and 4 heads of 64, T = 1024, B = 2): compiled, bit for bit forward."""
    cos, sin = (t.cuda() for t in rope_tables(64, 2048, 10000.0))
    for H in (32, 4):
        x = _heads(2, 1024, H, 64, torch.bfloat16).cuda()
        xa, xb = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
        ya, yb = rope_ref(xa, cos, sin), rope(xb, cos, sin)
        assert torch.equal(ya, yb)
        dy = torch.randn_like(ya)
        ya.backward(dy)
        yb.backward(dy)
        assert _close(xb.grad, xa.grad, 2 ** -7)


@needs_triton
def test_model_with_the_kernels_equals_the_torch_path(monkeypatch):
    """A tiny Llama whose norm and RoPE run the Triton kernels (the interpreter on CPU) against the
    same model on the torch references: the layouts the model hands them (q / k as transposed
    views of the projections, the residual stream) go through the kernels as on a GPU."""
    import leantrain.model.llama as model_mod
    import leantrain.ops.norm as norm_mod
    import leantrain.ops.rope as rope_mod

    cfg = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)
    torch.manual_seed(0)
    ref = Llama(ModelConfig(**cfg)).to(DEVICE)
    idx = torch.randint(0, 64, (2, 16), device=DEVICE)
    la = ref(idx, idx)
    la.backward()
    grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    ref.zero_grad()
    monkeypatch.setattr(model_mod, "rms_norm", lambda x, w, eps: norm_mod.rms_norm(x, w, eps, backend="triton"))
    monkeypatch.setattr(model_mod, "rope", lambda x, c, s: rope_mod.rope(x, c, s, backend="triton"))
    kern = Llama(ModelConfig(**cfg)).to(DEVICE)
    kern.load_state_dict(ref.state_dict())
    lb = kern(idx, idx)
    lb.backward()
    assert torch.allclose(la, lb, rtol=1e-5, atol=1e-6)
    for n, p in kern.named_parameters():
        assert torch.allclose(p.grad, grads[n], rtol=1e-4, atol=1e-6), n

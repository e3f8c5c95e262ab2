"""SwiGLU as one function (ops/swiglu.py): the torch path and the Triton kernel (the interpreter
on CPU) against autograd's op-by-op form, for two inputs and for the halves of one; fewer saved
bytes; the model with it."""

import pytest
import torch

from leantrain.ops._backend import HAS_TRITON, interpreting
from leantrain.ops.swiglu import swiglu, swiglu_ref

needs_triton = pytest.mark.skipif(not (HAS_TRITON and (interpreting() or torch.cuda.is_available())),
                                  reason="needs Triton (the interpreter on CPU)")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _grads(fn, *xs):
    xs = [x.detach().clone().requires_grad_(True) for x in xs]
    h = fn(*xs)
    dh = torch.randn(h.shape, generator=torch.Generator().manual_seed(7)).to(h.device, h.dtype)
    h.backward(dh)
    return h.detach(), [x.grad for x in xs]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 5, 24), (3, 1000), (1, 1, 1)])
def test_equals_op_by_op(backend, dtype, shape):
    """h, dg, du against F.silu(g) * u: to fp32 rounding in fp32; in bf16 to the op-by-op form's
    own rounding of silu(g) (a few bf16 ulps). Two inputs and one holding both halves agree."""
    torch.manual_seed(0)
    g = (torch.randn(shape) * 3).to(DEV, dtype)
    u = torch.randn(shape).to(DEV, dtype)
    h0, (dg0, du0) = _grads(swiglu_ref, g.float(), u.float())
    h1, (dg1, du1) = _grads(lambda a, b: swiglu(a, b, backend=backend), g, u)
    h2, (dgu,) = _grads(lambda a: swiglu(a, backend=backend), torch.cat((g, u), -1))
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for a, b in ((h1, h0), (dg1, dg0), (du1, du0)):
        assert a.dtype == dtype and a.shape == g.shape
        torch.testing.assert_close(a.float(), b, **tol)
    tight = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(h1, h2, **tight)  # (CPU: torch's exp on a strided view may differ in its last bit)
    torch.testing.assert_close(torch.cat((dg1, du1), -1), dgu, **tight)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_torch_path(dtype):
    """The kernel computes the torch path's formulas in its order: equal up to exp's last bits,
    on strided halves (a view of a wider tensor) too. Compiled for a GPU, the kernel's exp is
    the hardware's approximate one: one fp32 element of 16800 was 2.5e-7 (4e-6 relative) off
    torch's on an H200, so the fp32 tolerance is wider there."""
    torch.manual_seed(1)
    gu = (torch.randn(4, 7, 2 * 300) * 2).to(DEV, dtype)
    hk, (dk,) = _grads(lambda a: swiglu(a, backend="triton"), gu)
    ht, (dt,) = _grads(lambda a: swiglu(a, backend="torch"), gu)
    fp32_tol = dict(rtol=1e-5, atol=1e-6) if DEV == "cuda" else dict(rtol=1e-6, atol=1e-7)
    tol = fp32_tol if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(hk, ht, **tol)
    torch.testing.assert_close(dk, dt, **tol)


def test_saves_two_tensors_not_three():
    """Autograd's form saves g, silu(g) and u; this saves g and u (or the one tensor holding both)."""
    from leantrain.runtime.ledger import SavedActivationMeter

    g, u = torch.randn(8, 64, requires_grad=True), torch.randn(8, 64, requires_grad=True)
    unit = 8 * 64 * 4
    for fn, want in ((lambda: swiglu_ref(g * 1, u * 1), 3 * unit), (lambda: swiglu(g * 1, u * 1), 2 * unit),
                     (lambda: swiglu(torch.cat((g, u), -1)), 2 * unit)):
        with SavedActivationMeter([]) as meter:
            h = fn()
        h.sum().backward()
        assert meter.bytes == want


def test_bad_input():
    with pytest.raises(ValueError, match="even"):
        swiglu(torch.randn(2, 3))
    with pytest.raises(ValueError, match="match"):
        swiglu(torch.randn(2, 4), torch.randn(2, 3))
    with pytest.raises(TypeError, match="fp32"):
        swiglu(torch.ones(2, 4, dtype=torch.int32))


@pytest.mark.parametrize("fused_proj", [False, True])
def test_model_with_fused_swiglu(fused_proj):
    """model.fused_swiglu: the loss and gradients of the op-by-op MLP (fp32), fewer saved bytes."""
    from leantrain.config import ModelConfig
    from leantrain.model import Llama
    from leantrain.runtime.ledger import SavedActivationMeter

    base = dict(vocab_size=97, dim=48, n_layers=2, n_heads=6, n_kv_heads=2, ffn_dim=64, max_seq_len=32,
                fused_proj=fused_proj)
    torch.manual_seed(0)
    a = Llama(ModelConfig(**base, fused_swiglu=False))
    b = Llama(ModelConfig(**base, fused_swiglu=True))
    b.load_state_dict(a.state_dict())
    x = torch.randint(0, 97, (3, 16))
    out = {}
    for name, m in (("ref", a), ("fused", b)):
        with SavedActivationMeter(m.parameters()) as meter:
            loss = m(x, x)
        loss.backward()
        out[name] = (loss.item(), meter.bytes)
    assert abs(out["ref"][0] - out["fused"][0]) < 1e-5
    assert out["ref"][1] - out["fused"][1] == 2 * 3 * 16 * 64 * 4  # one fp32 [B, T, ffn] tensor a layer
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=n)

"""The fused LM head + cross-entropy (``leantrain.model.losses``) against the unfused form: losses,
gradients (h, W, bias; fp32, bf16, autocast), ignored and out-of-range targets, what backward
keeps (nothing of the vocabulary's size), the Llama with and without it, FORGE's update of
the head from the slices (torch backend; Triton under the interpreter) and AGoQ's roles."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import leantrain as lt
from leantrain.config import ModelConfig
from leantrain.model import Llama
from leantrain.model.losses import linear_cross_entropy, slice_cols
from leantrain.ops._backend import interpreting


def _data(n=37, d=24, v=300, bias=False, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).to(dtype)
    w = (torch.randn(v, d, generator=g) * 0.3).to(dtype)
    b = (torch.randn(v, generator=g) * 0.1).to(dtype) if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    t[::5] = -100
    gout = torch.rand(n, generator=g)  # a non-uniform upstream gradient (reduction="none" callers)
    return h, w, b, t, gout


def _grads(fn, h, w, b, t, gout):
    leaves = [x.detach().clone().requires_grad_(True) if x is not None else None for x in (h, w, b)]
    loss = fn(*leaves, t)
    (loss * gout).sum().backward()
    return loss.detach(), [x.grad if x is not None else None for x in leaves]


def _unfused(h, w, b, t):
    return F.cross_entropy(F.linear(h, w, b).float(), t, reduction="none")


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


def test_slice_cols():
    assert slice_cols(100, 1000, 0) == 1000 and slice_cols(100, 1000, 100) == 1000  # one slice
    assert slice_cols(8192, 32000, 1024) == 4096  # 1b, B = 8: 4000 rounded up to 128s, 8 slices
    assert slice_cols(37, 300, 3) == 32  # ceil(900 / 37) = 25 -> 32 (8s below 128)
    assert slice_cols(65536, 32000, 1024) == 512


@pytest.mark.parametrize("budget", [0, 3, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_equals_cross_entropy(budget, bias):
    h, w, b, t, gout = _data(bias=bias)
    l0, g0 = _grads(_unfused, h, w, b, t, gout)
    l1, g1 = _grads(lambda h, w, b, t: linear_cross_entropy(h, w, t, bias=b, budget=budget), h, w, b, t, gout)
    assert torch.equal(l1 == 0, t == -100)
    assert (l1 - l0).abs().max() <= 2e-6 * l0.abs().max()
    for a, r in zip(g1, g0):
        if r is not None:
            assert _rel(a, r) <= 2e-6
    assert (g1[1].abs().sum(1) > 0).all()  # every vocabulary row got its softmax share


def _fp32_of(h, w, b, t):
    """The exact form's reference on the same (rounded) inputs: every product and sum in fp32."""
    return F.cross_entropy(F.linear(h.float(), w.float(), None if b is None else b.float()), t, reduction="none")


def test_bf16_equals_fp32_math_of_bf16_inputs():
    """bf16 h and W: the logits in fp32 from fp32 accumulation (not rounded to bf16 as F.linear's
    output is), ``dz`` rounded to bf16 once, dW and dh accumulated in fp32 and returned in bf16."""
    h, w, b, t, gout = _data(dtype=torch.bfloat16, v=200)
    l0, g0 = _grads(_fp32_of, h, w, b, t, gout)
    l1, g1 = _grads(lambda h, w, b, t: linear_cross_entropy(h, w, t, budget=5), h, w, b, t, gout)
    assert l1.dtype == torch.float32 and (l1 - l0).abs().max() <= 2e-6 * l0.abs().max()
    assert g1[0].dtype == g1[1].dtype == torch.bfloat16
    assert _rel(g1[0], g0[0]) <= 1e-2 and _rel(g1[1], g0[1]) <= 1e-2  # dz's and the result's bf16 rounding
    lu, _ = _grads(_unfused, h, w, b, t, gout)  # the unfused bf16 form: its logits rounded to bf16
    assert (lu - l0).abs().max() > (l1 - l0).abs().max()


def test_autocast_fp32_weight():
    """Under bf16 autocast with an fp32 weight: dW comes back fp32 (fp32 accumulation of bf16
    products), h's gradient in h's dtype; close to the fp32 math of the bf16-rounded operands."""
    h, w, b, t, gout = _data(v=160)
    hb, wb = h.bfloat16().float(), w.bfloat16().float()
    l0, g0 = _grads(_fp32_of, hb, wb, b, t, gout)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        l1, g1 = _grads(lambda h, w, b, t: linear_cross_entropy(h, w, t, budget=4), h, w, b, t, gout)
    assert g1[1].dtype == torch.float32 and g1[0].dtype == torch.float32
    assert (l1 - l0).abs().max() <= 2e-6 * l0.abs().max()
    assert _rel(g1[0], g0[0]) <= 1e-2 and _rel(g1[1], g0[1]) <= 1e-2


def test_backward_keeps_nothing_vocab_sized():
    """Saved for backward: h, the weight, the targets, the log-sum-exp [N, 1]: no [N, V] tensor."""
    n, d, v = 64, 16, 1000
    h, w, _, t, _ = _data(n, d, v)
    w.requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(tuple(x.shape)) or x, lambda x: x):
        loss = linear_cross_entropy(h.requires_grad_(True), w, t, budget=8)
    assert sorted(saved) == sorted([(n, d), (v, d), (n,), (n, 1)])
    loss.sum().backward()


def test_bad_target_gives_nan_not_silence():
    h, w, _, t, _ = _data()
    t[3] = 300  # == V
    t[4] = -7
    loss = linear_cross_entropy(h, w, t, budget=3)
    assert torch.isnan(loss[3]) and torch.isnan(loss[4]) and torch.isfinite(loss[5:]).all()


def test_shape_errors():
    h, w, _, t, _ = _data()
    with pytest.raises(ValueError, match="must be"):
        linear_cross_entropy(h, w[:, :5], t)
    with pytest.raises(ValueError, match="targets"):
        linear_cross_entropy(h, w, t[:-1])
    with pytest.raises(ValueError, match="budget"):
        linear_cross_entropy(h, w, t, budget=-1)


def _cfg(**kw):
    return ModelConfig(**{**dict(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                                 max_seq_len=32, loss_chunk=4), **kw})


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_llama_fused_equals_unfused(tie):
    torch.manual_seed(0)
    m0 = Llama(_cfg(tie_embeddings=tie, fused_loss=False))
    m1 = Llama(_cfg(tie_embeddings=tie))
    m1.load_state_dict(m0.state_dict())
    x = torch.randint(0, 96, (3, 20))
    tgt = x.roll(-1, 1)
    tgt[1, :7] = -100
    for m in (m0, m1):
        m(x, tgt).backward()
    assert m1(x, tgt).item() == pytest.approx(m0(x, tgt).item(), rel=1e-6)
    assert torch.allclose(m1(x, tgt, reduction="none"), m0(x, tgt, reduction="none"), rtol=1e-6, atol=1e-6)
    for (n, a), (_, b) in zip(m1.named_parameters(), m0.named_parameters()):
        assert _rel(a.grad, b.grad) <= 1e-5, n
    assert torch.equal(m1(x), m0(x))  # no targets: the logits, the same matmul


def _train(model, opt, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, 96, (2, 16), generator=g)
        model(idx[:, :-1], idx[:, 1:]).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("clip", ["none", "est_global", "layer"])
def test_forge_head_updated_from_slices(clip):
    """FORGE: the fused head hands its dW to the layer's update (workspace, clip, rule) slice by
    slice; the weights follow the unfused loss's run within the slices' rounding."""
    torch.manual_seed(0)
    m0 = Llama(_cfg(fused_loss=False))
    m1 = Llama(_cfg())
    m1.load_state_dict(m0.state_dict())
    # SGD + momentum: linear in the gradient, so the bound below is the gradients' (Adam's
    # 1/sqrt(v) turns a last-bit gradient difference of a near-zero element into ~lr)
    rule = lt.optim.SGD(lr=0.1, momentum=0.9, weight_decay=0.01)
    kw = {} if clip == "none" else {"clip": clip, "clip_value": 0.5}
    o0 = lt.forge.attach(m0, rule, backend="torch", **kw)
    o1 = lt.forge.attach(m1, rule, backend="torch", **kw)
    assert any(layer.name == "lm_head" for layer in o1.layers)
    start = {n: p.detach().clone() for n, p in m1.named_parameters()}
    _train(m0, o0, 4)
    _train(m1, o1, 4)
    assert m1.lm_head.weight.grad is None
    for (n, a), (_, b) in zip(m1.named_parameters(), m0.named_parameters()):
        a, b = a.detach(), b.detach()
        moved = (b - start[n]).abs().max()
        assert moved > 0 and (a - b).abs().max() <= 1e-5 * moved + 1e-6 * b.abs().max(), n  # (+ W's last bits)


@pytest.mark.skipif(torch.cuda.is_available() and not interpreting(),
                    reason="the Triton interpreter on CPU tensors")
def test_forge_head_triton_backend():
    """The fused head's FORGE update on the Triton kernels (interpreted) follows the torch backend's;
    one block beside it (each block's layers only add interpreted tiles)."""
    torch.manual_seed(1)
    m0 = Llama(_cfg(n_layers=1))
    m1 = copy.deepcopy(m0)
    rule = lt.optim.SGD(lr=0.1, momentum=0.9)
    o0 = lt.forge.attach(m0, rule, backend="torch")
    o1 = lt.forge.attach(m1, rule, backend="triton", clip="est_global", clip_value=100.0)
    _train(m0, o0, 2)
    _train(m1, o1, 2)
    for (n, a), (_, b) in zip(m1.named_parameters(), m0.named_parameters()):
        assert _rel(a, b) <= 1e-5, n


def test_agoq_packs_head_input_once():
    """AGoQ on the fused head: its input packed under head_in; no log-softmax (role logits) saved;
    the gradients stay within the default policy's bound of the exact ones."""
    from leantrain.agoq import Policy, quantize_activations

    torch.manual_seed(0)
    m = Llama(_cfg(vocab_size=256, dim=64, loss_chunk=2))
    x = torch.randint(0, 256, (2, 24))
    with quantize_activations(m, Policy(), record=True) as pk:
        loss = m(x, x.roll(-1, 1))
    roles = [e["role"] for e in pk.log if e["why"] == "packed"]
    assert roles.count("head_in") == 1 and "logits" not in roles
    loss.backward()
    g = m.lm_head.weight.grad.clone()
    m.zero_grad()
    m(x, x.roll(-1, 1)).backward()
    assert _rel(g, m.lm_head.weight.grad) <= 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_equals_fp32_math(dtype):
    """On CUDA: the fp32-output GEMMs (mm / addmm with out_dtype) give the same bounds as on CPU."""
    torch.backends.cuda.matmul.allow_tf32 = False
    h, w, b, t, gout = (x.cuda() if x is not None else None for x in _data(n=300, d=64, v=1000, bias=True, dtype=dtype))
    l0, g0 = _grads(_fp32_of, h, w, b, t, gout)
    l1, g1 = _grads(lambda h, w, b, t: linear_cross_entropy(h, w, t, bias=b, budget=50), h, w, b, t, gout)
    assert (l1 - l0).abs().max() <= 2e-6 * l0.abs().max()
    for a, r in zip(g1, g0):
        assert _rel(a, r) <= (2e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_forge_head_triton():
    """On CUDA, FORGE's compiled Triton update of the head from the slices, bf16 weights + SR and
    est_global: the weights follow the unfused loss's run (the same kernel on a one-GEMM dW).
    SGD + momentum: linear in the gradient (Adam's first steps are sign-like: a gradient's
    rounding difference flips near-zero elements by 2 lr)."""
    torch.manual_seed(0)
    m0 = Llama(_cfg(vocab_size=4000, dim=64, loss_chunk=8, fused_loss=False)).cuda().bfloat16()
    m1 = copy.deepcopy(m0)
    m1.cfg = _cfg(vocab_size=4000, dim=64, loss_chunk=8)
    rule = lt.optim.SGD(lr=0.1, momentum=0.9, weight_decay=0.01)
    o0 = lt.forge.attach(m0, rule, clip="est_global", clip_value=1.0)
    o1 = lt.forge.attach(m1, rule, clip="est_global", clip_value=1.0)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        idx = torch.randint(0, 4000, (4, 32), generator=g).cuda()
        for m, o in ((m0, o0), (m1, o1)):
            m(idx[:, :-1], idx[:, 1:]).backward()
            o.step()
            o.zero_grad()
    assert m1.lm_head.weight.grad is None
    for (n, a), (_, b) in zip(m1.named_parameters(), m0.named_parameters()):
        assert _rel(a, b) <= 2e-2, n  # bf16 weights, SR: the same seeds; dW's rounding differs


def _dp_head_worker(rank, world):
    torch.manual_seed(0)
    m = Llama(_cfg())
    opt = lt.forge.attach(m, lt.optim.SGD(lr=0.1, momentum=0.9), backend="torch")
    assert opt.dp_group is not None and any(layer.name == "lm_head" for layer in opt.layers)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        idx = torch.randint(0, 96, (4, 16), generator=g).chunk(world)[rank]
        m(idx[:, :-1], idx[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().numpy().copy() for k, v in m.state_dict().items()}


@pytest.mark.distributed
def test_forge_head_data_parallel_equals_single_process():
    """2 gloo ranks, each on half the batch: the fused head's dW, filled slice by slice into
    FORGE's workspace, is all-reduced with the layer's other gradients before the update; the
    weights equal one process on the whole batch."""
    from dist_utils import run_distributed

    torch.manual_seed(0)
    ref = Llama(_cfg())
    start = {k: v.clone() for k, v in ref.state_dict().items()}
    opt = lt.forge.attach(ref, lt.optim.SGD(lr=0.1, momentum=0.9), backend="torch")
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        idx = torch.randint(0, 96, (4, 16), generator=g)
        ref(idx[:, :-1], idx[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    for sd in run_distributed(_dp_head_worker, 2):
        for k, v in ref.state_dict().items():
            got = torch.from_numpy(sd[k])
            moved = (v - start[k]).abs().max()
            assert (got - v).abs().max() <= 1e-5 * moved + 1e-6 * v.abs().max(), k

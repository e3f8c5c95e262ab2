"""Batched packing (CUDA's default): one quantize launch per batch, one dequantize per batch's
first unpack, codes and gradients equal to packing each tensor at once with the same kernel
math, the waiting bytes bounded, in-place changes before the flush refused, permuted views
unpacked with their strides. On CPU the batches run through the Triton interpreter."""

import importlib

import pytest
import torch

from leantrain.agoq import Policy, quantize_activations
from leantrain.agoq.hooks import Packer
from leantrain.agoq.pack import PackBatch, pack, unpack
from leantrain.config import ModelConfig
from leantrain.model import Llama
from leantrain.ops import dequantize, quantize
from leantrain.ops._backend import interpreting

CUDA = torch.cuda.is_available() and not interpreting()
DEV = "cuda" if CUDA else "cpu"
TINY = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
pack_mod = importlib.import_module("leantrain.agoq.pack")  # the package attribute is the function


@pytest.fixture
def batching(monkeypatch):
    """Batches on this device, through Triton (compiled on CUDA, interpreted on CPU)."""
    if not CUDA and not interpreting():
        pytest.skip("needs CUDA or the Triton interpreter")
    monkeypatch.setattr(Packer, "batch_devices", (DEV,))
    monkeypatch.setattr(Packer, "batch_backend", "triton")


def _reference_ops(monkeypatch):
    """Eager packing through the ops reference (the hash RNG the batch kernel draws from)."""
    monkeypatch.setattr(pack_mod, "quantize_q", lambda x, bits, **kw: quantize(x, bits=bits, backend="torch", **kw))
    monkeypatch.setattr(pack_mod, "dequantize_q", lambda q, dtype=None: dequantize(q, dtype=dtype, backend="torch"))


def _grads(model, idx, tgt, policy):
    for p in model.parameters():
        p.grad = None
    with quantize_activations(model, policy) as pk:
        loss = model(idx, tgt)
    loss.backward()
    return pk, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_eager_equal(monkeypatch, m, idx, tgt, pol, loss_b, g_b):
    """Eager packing (no batches) with the same seeds and rounding math: the same loss and
    gradients, bit for bit, as the batched run that gave ``loss_b``, ``g_b``."""
    monkeypatch.setattr(importlib.import_module("leantrain.agoq.packer"), "_PACKERS", iter(range(100, 200)))
    monkeypatch.setattr(Packer, "batch_devices", ())
    _, loss_e, g_e = _grads(m, idx, tgt, pol)
    assert torch.equal(loss_b, loss_e)
    for name in g_b:
        assert torch.equal(g_b[name], g_e[name]), name


def test_batched_gradients_equal_eager_packing(batching, monkeypatch):
    torch.manual_seed(0)
    m = Llama(TINY).to(DEV)
    idx = torch.randint(0, 256, (2, 32), device=DEV)
    tgt = torch.randint(0, 256, (2, 32), device=DEV)
    calls = {"q": 0, "dq": 0}
    real_q, real_dq = pack_mod.quantize_flat, pack_mod.dequantize_flat

    def q(*a, **kw):
        calls["q"] += 1
        return real_q(*a, **kw)

    def dq(*a, **kw):
        calls["dq"] += 1
        return real_dq(*a, **kw)

    monkeypatch.setattr(pack_mod, "quantize_flat", q)
    monkeypatch.setattr(pack_mod, "dequantize_flat", dq)
    _reference_ops(monkeypatch)  # the eagerly packed log-softmax: the same RNG in both runs
    pol = Policy(min_numel=16, seed=5)
    hooks_mod = importlib.import_module("leantrain.agoq.packer")
    monkeypatch.setattr(hooks_mod, "_PACKERS", iter(range(100, 200)))
    pk, loss_b, g_b = _grads(m, idx, tgt, pol)
    n_packed = pk.stats["packed"]  # (the fused loss saves no log-softmax)
    assert n_packed > 10  # (18 on CUDA, where SDPA's fused backends save q, k, v and out; more on the CPU)
    assert calls["q"] == 1  # one flush at the end of the forward: one batch (4 and 8 bits)
    assert calls["dq"] == 1  # one dequantize launch for the batch
    _assert_eager_equal(monkeypatch, m, idx, tgt, pol, loss_b, g_b)


def test_bf16_word_path_batched_apart(batching, monkeypatch):
    """bf16 saves at 4 bits (the quantize kernel's word path) and the others (8-bit attention
    saves) go to two batches: each flush is one launch of one path; the gradients equal eager
    packing."""
    torch.manual_seed(0)
    m = Llama(TINY).to(DEV).to(torch.bfloat16)
    idx = torch.randint(0, 256, (2, 32), device=DEV)
    calls = []
    real_q = pack_mod.quantize_flat

    def q(xs, bits, *a, **kw):
        calls.append({(b, x.dtype) for x, b in zip(xs, bits)})
        return real_q(xs, bits, *a, **kw)

    monkeypatch.setattr(pack_mod, "quantize_flat", q)
    _reference_ops(monkeypatch)
    pol = Policy(min_numel=16, seed=5)
    hooks_mod = importlib.import_module("leantrain.agoq.packer")
    monkeypatch.setattr(hooks_mod, "_PACKERS", iter(range(100, 200)))
    pk, loss_b, g_b = _grads(m, idx, idx, pol)
    assert sorted(map(sorted, calls), key=str) == sorted([[(4, torch.bfloat16)], [(8, torch.bfloat16)]], key=str)
    _assert_eager_equal(monkeypatch, m, idx, idx, pol, loss_b, g_b)


def test_batch_bytes_bound_the_waiting_tensors(batching, monkeypatch):
    torch.manual_seed(0)
    m = Llama(TINY).to(DEV)
    idx = torch.randint(0, 256, (2, 32), device=DEV)
    flushes = []
    real = PackBatch.flush

    def flush(self):
        flushes.append(sum(t[0].numel() * t[0].element_size() for t in self._todo))
        real(self)

    monkeypatch.setattr(PackBatch, "flush", flush)
    limit = 40_000
    with quantize_activations(m, Policy(min_numel=16, batch_mib=limit / 2**20)) as pk:
        loss = m(idx, idx)
    loss.backward()
    waiting = [b for b in flushes if b]
    assert len(waiting) > 3
    # a batch is flushed when its waiting bytes reach the limit: at most the limit plus one tensor
    biggest = 2 * 32 * TINY.ffn_dim * 4
    assert max(waiting) <= limit + biggest
    assert pk.stats["packed"] > 0


def test_in_place_change_before_the_flush_is_refused(batching):
    x = torch.randn(4, 256, device=DEV)
    b = PackBatch(128, True, True, backend="triton")
    p = pack(x, 4, seed=1, batch=b)
    assert p.payload is None and p.nbytes == 4 * 256 // 2 + 4 * 8
    x.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        b.flush()


def test_unpack_before_flush_and_shared_uses(batching):
    x = torch.randn(3, 300, device=DEV)
    y = torch.randn(128, device=DEV)
    b = PackBatch(128, True, False, backend="triton")
    p, r = pack(x, 8, seed=1, batch=b), pack(y, 8, seed=2, batch=b)
    p.uses = 2
    a = unpack(p)  # flushes the batch, dequantizes both members
    assert p.payload is not None and r.cache is not None and p.cache is a
    assert torch.equal(a, dequantize(quantize(x, bits=8, backend="torch"), backend="torch"))
    assert unpack(p) is a and p.cache is None
    assert torch.equal(unpack(r), dequantize(quantize(y, bits=8, backend="torch"), backend="torch"))
    assert r.cache is None
    again = unpack(p)  # retain_graph: a third unpack dequantizes anew, same values
    assert again is not a and torch.equal(again, a) and p.cache is None


def test_retain_graph_backward_twice_under_batching(batching):
    torch.manual_seed(0)
    m = Llama(TINY).to(DEV)
    idx = torch.randint(0, 256, (2, 32), device=DEV)
    with quantize_activations(m, Policy(min_numel=16)):
        loss = m(idx, idx)
    loss.backward(retain_graph=True)
    first = {n: p.grad.clone() for n, p in m.named_parameters()}
    for p in m.parameters():
        p.grad = None
    loss.backward()
    for n, p in m.named_parameters():
        assert torch.equal(p.grad, first[n]), n


@pytest.mark.parametrize("batched", [False, True])
def test_permuted_view_is_packed_in_logical_order(batched):
    """Groups run along the last dim of the saved tensor (within one attention head), not along
    the memory of a transposed view, whose groups would mix heads."""
    if batched and not CUDA and not interpreting():
        pytest.skip("needs CUDA or the Triton interpreter")
    base = torch.randn(2, 16, 4, 32, device=DEV) * torch.tensor([1.0, 100.0, 1.0, 100.0], device=DEV)[:, None]
    x = base.transpose(1, 2)  # [B, H, T, D] view of [B, T, H, D] memory, as attention saves
    b = PackBatch(128, True, False, backend="triton") if batched else None
    p = pack(x, 8, stochastic=False, batch=b)
    v = unpack(p)
    assert v.shape == x.shape
    ref = dequantize(quantize(x.contiguous(), bits=8, backend="torch"), backend="torch")
    assert torch.equal(v, ref)
    # each group holds one head's values: the small heads keep their own scale
    small = (x[:, 0] - v[:, 0]).abs().max() / x[:, 0].abs().max()
    assert small < 1 / 127


def test_unpack_dequantizes_at_most_unpack_bytes(batching, monkeypatch):
    """A member's first unpack dequantizes it and the members saved before it (backward's next
    ones) up to ``unpack_bytes`` of results, in one launch; the others wait for their own."""
    calls = []
    real_dq = pack_mod.dequantize_flat

    def dq(buf, members, **kw):
        calls.append(len(members))
        return real_dq(buf, members, **kw)

    monkeypatch.setattr(pack_mod, "dequantize_flat", dq)
    xs = [torch.randn(64, 128, device=DEV) for _ in range(5)]  # 32 KiB each in fp32
    results = {}
    for cap in (0, 70 * 1024):
        b = PackBatch(128, True, False, "triton", unpack_bytes=cap)
        ps = [b.register(x, 4, seed=i) for i, x in enumerate(xs)]
        b.flush()
        calls.clear()
        out = [None] * 5
        out[4] = unpack(ps[4])
        if cap:
            assert calls == [2] and ps[3].cache is not None and ps[2].cache is None and ps[1].cache is None
        else:
            assert calls == [5]
        for i in (3, 2, 1, 0):
            out[i] = unpack(ps[i])
        assert calls == ([2, 2, 1] if cap else [5])
        assert all(p.cache is None for p in ps)
        results[cap] = out
    for a, b_ in zip(results[0], results[70 * 1024], strict=True):
        assert torch.equal(a, b_)

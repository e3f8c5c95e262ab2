"""Saves AGoQ recomputes instead of storing (``Policy.derive``): SwiGLU's ``silu(g)`` from its input's
packed copy, the down projection's input ``silu(g)·u`` from those two (through the 2-D view
``F.linear`` saves), or from the fused SwiGLU's saves (``swiglu``). The gradients equal a
hand-written backward that reads the dequantized ``ĝ``, ``û``, ``x̂`` (round to nearest: no seeds
involved); the bytes held drop by exactly the derived tensors' packed sizes; replay and the
trainer's persistent ``apply`` derive the same."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leantrain.agoq import Policy, apply, quantize_activations
from leantrain.agoq.pack import pack, unpack
from leantrain.ops.swiglu import swiglu

D, H = 32, 256  # every tensor a multiple of the group size (128)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(D, H, bias=False)
        self.up_proj = nn.Linear(D, H, bias=False)
        self.down_proj = nn.Linear(H, D, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = MLP()
        self.register_buffer("c", torch.randn(D))  # loss = sum(y * c): dY = c, nothing else saved

    def forward(self, x):
        return (self.mlp(x) * self.c).sum()


class SwigluMLP(nn.Module):
    """The MLP with SwiGLU as one function (``model.fused_swiglu``): over two linears' outputs, or
    over the halves of one fused gate/up linear (``model.fused_proj``)."""

    def __init__(self, halves: bool):
        super().__init__()
        self.halves = halves
        if halves:
            self.gate_up_proj = nn.Linear(D, 2 * H, bias=False)
        else:
            self.gate_proj = nn.Linear(D, H, bias=False)
            self.up_proj = nn.Linear(D, H, bias=False)
        self.down_proj = nn.Linear(H, D, bias=False)

    def forward(self, x):
        if self.halves:
            return self.down_proj(swiglu(self.gate_up_proj(x)))
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))

    def separate(self) -> MLP:
        """The op-by-op MLP with these weights."""
        m = MLP()
        with torch.no_grad():
            if self.halves:
                m.gate_proj.weight.copy_(self.gate_up_proj.weight[:H])
                m.up_proj.weight.copy_(self.gate_up_proj.weight[H:])
            else:
                m.gate_proj.weight.copy_(self.gate_proj.weight)
                m.up_proj.weight.copy_(self.up_proj.weight)
            m.down_proj.weight.copy_(self.down_proj.weight)
        return m


def _rtn(t):
    return unpack(pack(t.detach(), 4, group_size=128, stochastic=False, symmetric=True))


def _manual(net, x):
    """The backward with every saved tensor read back as AGoQ stores it under derive="silu,mul"."""
    m = net.mlp
    wg, wu, wd = m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight
    with torch.no_grad():
        x2 = x.reshape(-1, D)
        g, u = x2 @ wg.T, x2 @ wu.T
        xh, gh, uh = _rtn(x2), _rtn(g), _rtn(u)
        sg = F.silu(gh)
        dy = net.c.expand(x2.shape[0], D)
        dwd = dy.T @ (sg * uh)
        da = dy @ wd
        du = da * sg
        dg = da * uh * torch.sigmoid(gh) * (1 + gh * (1 - torch.sigmoid(gh)))  # silu'(ĝ)
        return {"gate": dg.T @ xh, "up": du.T @ xh, "down": dwd, "x": (dg @ wg + du @ wu).reshape(x.shape)}


def _grads(net, x, policy):
    x = x.clone().requires_grad_(True)
    for p in net.parameters():
        p.grad = None
    with quantize_activations(net, policy, record=True) as pk:
        loss = net(x)
    loss.backward()
    m = net.mlp
    return {"gate": m.gate_proj.weight.grad, "up": m.up_proj.weight.grad, "down": m.down_proj.weight.grad,
            "x": x.grad}, pk


@pytest.mark.parametrize("shape", [(64, D), (2, 32, D)], ids=["2d", "3d-view"])
def test_derived_gradients_equal_hand_backward(shape):
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(*shape)
    got, pk = _grads(net, x, Policy(stochastic=False, mlp_in=4))
    assert pk.stats["derived"] == 2  # silu(g); the down projection's input (or its 2-D view)
    ref = _manual(net, x)
    for k in ref:
        assert torch.allclose(got[k], ref[k], rtol=1e-5, atol=1e-5), k


def test_bytes_drop_by_the_two_packed_tensors():
    torch.manual_seed(0)
    net, x = Net(), torch.randn(64, D)
    _, pk0 = _grads(net, x, Policy(stochastic=False, derive=""))
    _, pk1 = _grads(net, x, Policy(stochastic=False, derive="silu"))
    _, pk2 = _grads(net, x, Policy(stochastic=False))
    one = pack(torch.randn(64, H), 4, group_size=128, stochastic=False, symmetric=True).nbytes
    kept = [p.summary()["bytes_kept"] for p in (pk0, pk1, pk2)]
    assert kept[0] - kept[1] == one and kept[1] - kept[2] == one
    assert [p.stats.get("derived", 0) for p in (pk0, pk1, pk2)] == [0, 1, 2]
    assert pk0.summary()["bytes_raw"] == pk2.summary()["bytes_raw"]  # what the model saved is unchanged


def test_nothing_derived_without_a_packed_source():
    """silu's input kept as is (its role at 16 bits): silu(g) is packed, never recomputed."""
    torch.manual_seed(0)
    net, x = Net(), torch.randn(64, D)
    _, pk = _grads(net, x, Policy(gate_up=16))
    assert pk.stats.get("derived", 0) == 0


@pytest.mark.parametrize("mlp, derived", [("op-by-op", 2), ("fused-swiglu-halves", 1)])
def test_replay_derives_the_same(mlp, derived):
    torch.manual_seed(0)
    net, x = Net(), torch.randn(2, 32, D)
    if mlp != "op-by-op":
        net.mlp = SwigluMLP(halves=True)
    pk = apply(net, Policy(stochastic=False))
    out = []
    for _ in range(3):  # the first forward records its plan, the next follow it
        for p in net.parameters():
            p.grad = None
        net(x).backward()
        out.append([p.grad.clone() for p in net.parameters()])
    assert pk.stats["derived"] == 3 * derived and pk.stats.get("replay:diverged", 0) == 0
    for a, b in zip(out[0], out[2]):
        assert torch.equal(a, b)


def test_silu_computed_once_a_backward(monkeypatch):
    """``silu(ĝ)`` feeds two backward nodes (the product's and, through ``silu(ĝ)·û``, the down
    projection's): computed once a backward, its cache and every dequantized source released by
    the end; with ``retain_graph`` the second backward computes it again, the same."""
    import leantrain.agoq.hooks as H

    calls = []

    def silu(t):
        calls.append(1)
        return F.silu(t)

    monkeypatch.setitem(importlib.import_module("leantrain.agoq.saved").DERIVABLE, "SiluBackward0", ("silu", silu))
    held = []  # every packed and derived save of the forward
    def keeping(f):
        def keep(self, *a, **k):
            out = f(self, *a, **k)
            held.append(out)
            return out
        return keep

    for name in ("_store", "_store_derived"):
        monkeypatch.setattr(H.Packer, name, keeping(getattr(H.Packer, name)))
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(64, D, requires_grad=True)
    with quantize_activations(net, Policy(stochastic=False)) as pk:
        loss = net(x)
    assert pk.stats["derived"] == 2 and len(held) >= 5
    grads = []
    for _ in range(2):
        x.grad = None
        loss.backward(retain_graph=True)
        grads.append(x.grad.clone())
        assert len(calls) == 1, len(calls)
        calls.clear()
        assert all(h.cache is None for h in held)
    assert torch.equal(grads[0], grads[1])
    ref = _manual(net, x.detach())
    assert torch.allclose(grads[0], ref["x"], rtol=1e-5, atol=1e-5)


def test_derived_cache_counts():
    """A :class:`Derived` with two consumers: one computation a round, its source used once."""
    from leantrain.agoq.hooks import Derived

    src = pack(torch.randn(256), 4, group_size=128, stochastic=False, symmetric=True)
    n = []

    def fn(t):
        n.append(1)
        return t * 2

    d = Derived(fn, (src,))
    d.add_use()
    d.add_use()
    assert d.uses == 2 and src.uses == 2  # (pack's own use, and the derivation's one)
    a, b = d.unpack(), d.unpack()
    assert a is b and len(n) == 1 and d.cache is None
    c = d.unpack()
    assert len(n) == 2 and d.cache is not None and torch.equal(c, a)
    d.unpack()
    assert d.cache is None


@pytest.mark.parametrize("halves", [False, True], ids=["two-inputs", "halves"])
@pytest.mark.parametrize("shape", [(64, D), (2, 32, D)], ids=["2d", "3d-view"])
def test_fused_swiglu_input_of_down_derived(halves, shape):
    """``swiglu``: the down projection's input, SwiGLU's output as one function, is recomputed
    from the packed g and u (or the packed gate/up output holding both), not stored; the
    gradients equal the hand backward on ĝ, û; the bytes held drop by one packed [T, H] tensor."""
    torch.manual_seed(0)
    net = Net()
    net.mlp = SwigluMLP(halves)
    x = torch.randn(*shape, requires_grad=True)
    with quantize_activations(net, Policy(stochastic=False, mlp_in=4), record=True) as pk:
        loss = net(x)
    loss.backward()
    assert pk.stats["derived"] == 1
    assert [r["why"] for r in pk.log if r["role"] == "down_in" and r["why"] != "param"] == ["derived"]
    ref_net = Net()
    ref_net.c.copy_(net.c)
    ref_net.mlp = net.mlp.separate()
    ref = _manual(ref_net, x.detach())
    m = net.mlp
    got = {"down": m.down_proj.weight.grad, "x": x.grad}
    got.update(zip(("gate", "up"), m.gate_up_proj.weight.grad.chunk(2)) if halves
               else (("gate", m.gate_proj.weight.grad), ("up", m.up_proj.weight.grad)))
    for k in ref:
        assert torch.allclose(got[k], ref[k], rtol=1e-5, atol=1e-5), k
    with quantize_activations(net, Policy(stochastic=False, mlp_in=4, derive="silu,mul"), record=True) as pk0:
        net(x)
    one = pack(torch.randn(64, H), 4, group_size=128, stochastic=False, symmetric=True).nbytes
    assert pk0.stats.get("derived", 0) == 0
    assert pk0.summary()["bytes_kept"] - pk.summary()["bytes_kept"] == one


def test_policy_rejects_unknown_derivation():
    with pytest.raises(ValueError, match="derive"):
        Policy(derive="silu,gelu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_derived_on_cuda_batches():
    """On CUDA the sources are packed in batches (one launch) and dequantized per batch: the
    derived saves read them the same way (the hand backward, round to nearest)."""
    torch.manual_seed(0)
    net = Net().cuda()
    x = torch.randn(4, 64, D, device="cuda")
    got, pk = _grads(net, x, Policy(stochastic=False, mlp_in=4))
    assert pk.stats["derived"] == 2
    ref = _manual(net, x)
    for k in ref:
        assert torch.allclose(got[k], ref[k], rtol=1e-4, atol=1e-4), k

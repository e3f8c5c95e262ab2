"""A packed tensor shared by several backward nodes is dequantized once, then released."""

import importlib

import torch

from leantrain.agoq import Policy, quantize_activations
from leantrain.agoq.pack import pack, unpack


def test_shared_unpack_is_computed_once_and_released():
    x = torch.randn(4, 256)
    p = pack(x, 4, group_size=128, stochastic=False)
    p.uses = 3
    a = unpack(p)
    assert p.cache is a and p.taken == 1
    assert unpack(p) is a and p.taken == 2
    assert unpack(p) is a and p.cache is None  # the last node took it: nothing kept
    again = unpack(p)  # retain_graph: dequantized anew, same values
    assert again is not a and torch.equal(again, a)


def test_qkv_share_one_packed_input_and_gradients_match_uncached(monkeypatch):
    torch.manual_seed(0)
    lin = torch.nn.ModuleDict({n: torch.nn.Linear(128, 128, bias=False) for n in ("q_proj", "k_proj", "v_proj")})
    x = torch.randn(16, 128, requires_grad=True)

    def run():
        for prm in lin.parameters():
            prm.grad = None
        with quantize_activations(lin, Policy(stochastic=False, min_numel=16)) as pk:
            y = sum(m(x).square().sum() for m in lin.values())
        y.backward()
        return pk, [m.weight.grad.clone() for m in lin.values()]

    pk, cached = run()
    assert pk.stats["dedup"] == 2  # x saved by three linears: packed once
    pack_mod = importlib.import_module("leantrain.agoq.pack")  # the package attribute is the function
    calls = []
    real = pack_mod._unpack
    monkeypatch.setattr(pack_mod, "_unpack", lambda p: calls.append(p.uses) or real(p))
    _, again = run()
    # x (shared by the three linears) is dequantized once; each square's input once
    assert sorted(calls) == [1, 1, 1, 3]
    for a, b in zip(cached, again, strict=True):
        assert torch.equal(a, b)

"""FORGE on a whole tiny Llama, against the unfused reference optimizer; saved-tensor visibility."""

from __future__ import annotations

import copy

import pytest
import torch
from _forge_util import max_rel

import leantrain as lt
from leantrain.config import ModelConfig
from leantrain.model import Llama
from leantrain.ops._backend import interpreting


def _cfg(tie=False):
    return ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32,
                       tie_embeddings=tie)


def _train(model, opt, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, 64, (2, 16), generator=g)
        loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_llama_forge_equals_reference(tie):
    torch.manual_seed(0)
    m0 = Llama(_cfg(tie))
    m1 = copy.deepcopy(m0)
    rule = lt.optim.AdamW(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    ref = lt.optim.Optimizer(m0.parameters(), rule)
    opt = lt.forge.attach(m1, rule, backend="torch")
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in m1.modules())
    assert len(opt.layers) == n_linear - (1 if tie else 0)  # a tied head is stepped unfused
    l0 = _train(m0, ref, 6)
    l1 = _train(m1, opt, 6)
    assert l1[-1] < l1[0]
    assert l0 == pytest.approx(l1, rel=1e-6)
    for (n, a), (_, b) in zip(m0.named_parameters(), m1.named_parameters()):
        assert max_rel(b, a) <= 1e-6, n


@pytest.mark.skipif(torch.cuda.is_available() and not interpreting(),
                    reason="the Triton interpreter on CPU tensors; compiled kernels: test_forge_kernel.py on the GPU")
def test_llama_forge_triton_interpreter():
    torch.manual_seed(1)
    m0 = Llama(_cfg())
    m1 = copy.deepcopy(m0)
    rule = lt.optim.SGD(lr=0.1, momentum=0.9)
    o0 = lt.forge.attach(m0, rule, backend="torch")
    o1 = lt.forge.attach(m1, rule, backend="triton")
    _train(m0, o0, 2)
    _train(m1, o1, 2)
    for (n, a), (_, b) in zip(m0.named_parameters(), m1.named_parameters()):
        assert max_rel(b, a) <= 1e-5, n


def test_saved_tensors_go_through_hooks():
    """FORGE saves with ctx.save_for_backward: a saved_tensors_hooks packer sees the input
    (the weight too, which packers recognise as a parameter and leave alone)."""
    lin = torch.nn.Linear(8, 4)
    lt.forge.attach(lin, lt.optim.SGD(lr=0.1), backend="torch")
    seen = []

    def pack(t):
        seen.append(t)
        return t

    x = torch.randn(3, 8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = lin(x)
    assert any(t is x for t in seen) and any(t is lin.weight for t in seen)
    from leantrain.runtime.ledger import SavedActivationMeter

    with SavedActivationMeter(lin.parameters()) as meter:
        y = lin(x)
    assert meter.bytes == x.numel() * 4
    y.sum().backward()
    assert lin.weight.grad is None and x.grad is not None

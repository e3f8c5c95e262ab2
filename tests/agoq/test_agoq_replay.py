"""Replay (persistent ``apply``): the second forward with a signature follows the first one's
recorded slots with the role hooks removed; it packs the same tensors at the same widths (the
same gradients, bit for bit, with round-to-nearest), counts the same, and a forward that departs
from its plan falls back to the full path, is counted, and is recorded anew."""

import pytest
import torch
import torch.nn.functional as F
from _agoqlib import count_saved
from torch import nn

from leantrain.agoq import Policy, apply, remove
from leantrain.config import ModelConfig
from leantrain.model import Llama
from leantrain.runtime.ledger import SavedActivationMeter

SMALL = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64)
NEAREST = Policy(stochastic=False)


def _batch(B=2, T=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (B, T), generator=g), torch.randint(0, 256, (B, T), generator=g)


def _step(m, idx, tgt):
    for p in m.parameters():
        p.grad = None
    loss = m(idx, tgt)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}


def _n_saved(m, *args) -> int:
    return count_saved(lambda: m(*args))[0]


def _role_hooks(m) -> int:
    return sum(len(mod._forward_pre_hooks) for mod in m.modules() if mod is not m)


def test_replay_packs_and_counts_as_the_full_path():
    torch.manual_seed(0)
    m = Llama(SMALL)
    idx, tgt = _batch()
    n_saved = _n_saved(m, idx, tgt)
    pk = apply(m, NEAREST)
    assert _role_hooks(m) > 0
    loss1, g1 = _step(m, idx, tgt)  # records
    first, raw1, kept1 = dict(pk.stats), dict(pk.bytes_raw), dict(pk.bytes_kept)
    assert first["saved"] == n_saved and len(pk._plans) == 1
    loss2, g2 = _step(m, idx, tgt)  # replays, without the role hooks
    assert _role_hooks(m) == 0
    assert {k: pk.stats[k] - first.get(k, 0) for k in pk.stats} == first  # every count, once more
    assert {r: pk.bytes_raw[r] - raw1[r] for r in raw1} == raw1
    assert {r: pk.bytes_kept[r] - kept1[r] for r in kept1} == kept1
    assert "replay:diverged" not in pk.stats
    assert torch.equal(loss1, loss2)
    for n in g1:  # round-to-nearest: the same codes, the same gradients
        assert torch.equal(g1[n], g2[n]), n

    # the same against a packer that never replays
    torch.manual_seed(0)
    m2 = Llama(SMALL)
    apply(m2, NEAREST, replay=False)
    _step(m2, idx, tgt)
    _, g3 = _step(m2, idx, tgt)
    assert _role_hooks(m2) > 0
    for n in g1:
        assert torch.equal(g2[n], g3[n]), n
    remove(m)
    assert not m._forward_pre_hooks and _role_hooks(m) == 0


def test_new_signature_records_and_old_plan_is_kept():
    torch.manual_seed(0)
    m = Llama(SMALL)
    a, b = _batch(T=32), _batch(T=16)
    n_a = _n_saved(m, *a)
    pk = apply(m, Policy())
    _step(m, *a)
    _step(m, *b)  # new shape: recorded with the role hooks back
    assert len(pk._plans) == 2
    saved = pk.stats["saved"]
    _step(m, *a)
    assert _role_hooks(m) == 0 and pk.stats["saved"] - saved == n_a
    pk.policy = Policy(attn=4)  # a new policy is a new signature
    before = pk.stats["bits8"]
    _step(m, *a)
    assert len(pk._plans) == 3 and pk.stats["bits8"] - before < 2 * SMALL.n_layers * 4
    assert "replay:diverged" not in pk.stats


class _Toggle(nn.Module):
    """Saves one more tensor when ``extra`` is set (a change the signature cannot see)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.extra = False

    def forward(self, x):
        y = self.lin(x)
        if self.extra:
            y = torch.tanh(y) * 1.5
        return torch.relu(y).sum()


def test_a_departing_forward_falls_back_and_records_again():
    torch.manual_seed(0)
    m = _Toggle()
    x = torch.randn(8, 64, requires_grad=True)
    m.extra = True
    n_extra = _n_saved(m, x)  # linear (input, weight), tanh (output), relu (output)
    m.extra = False
    assert _n_saved(m, x) == n_extra - 1
    pk = apply(m, NEAREST.replace(min_numel=0))
    m(x).backward()
    m(x).backward()  # replayed
    before = dict(pk.stats)
    m.extra = True
    out = m(x)  # departs after the linear's saves
    out.backward()
    assert pk.stats["replay:diverged"] == 1
    d = {k: pk.stats[k] - before.get(k, 0) for k in pk.stats}
    assert d["saved"] == n_extra
    assert d["packed"] + d.get("dedup", 0) + sum(v for k, v in d.items() if k.startswith("kept:")) == d["saved"]
    assert not pk._plans  # dropped: the next forward records
    m(x).backward()
    assert len(pk._plans) == 1 and pk.stats["replay:diverged"] == 1
    m(x).backward()  # the new plan replays
    assert pk.stats["replay:diverged"] == 1 and _role_hooks(m) == 0
    assert torch.isfinite(x.grad).all()
    m.extra = False  # fewer saves than the plan (the extra tanh gone): a departure, counted, dropped
    before = dict(pk.stats)
    m(x).backward()
    d = {k: pk.stats[k] - before.get(k, 0) for k in pk.stats}
    assert pk.stats["replay:diverged"] == 2 and not pk._plans and d["saved"] == n_extra - 1
    assert d["packed"] + d.get("dedup", 0) + sum(v for k, v in d.items() if k.startswith("kept:")) == d["saved"]


class _Loss(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 32)
        self.soft = True

    def forward(self, x, t):
        z = self.lin(x)
        if self.soft:
            return F.cross_entropy(z, t)
        return F.mse_loss(torch.tanh(z), torch.zeros_like(z)) + 0.0 * t.sum()


def test_a_log_softmax_slot_takes_only_a_log_softmax(monkeypatch):
    """A slot recorded as a log-softmax (stored as probabilities) never packs another tensor."""
    import leantrain.agoq.packer as P

    made = []

    class Counted(P.ProbPacked):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            made.append(self.dtype)

    monkeypatch.setattr(P, "ProbPacked", Counted)
    torch.manual_seed(0)
    m = _Loss()
    x, t = torch.randn(16, 64, requires_grad=True), torch.randint(0, 32, (16,))
    pk = apply(m, Policy(min_numel=0))
    m(x, t).backward()
    assert len(made) == 1
    m.soft = False  # tanh's output (same shape and dtype) where the log-softmax was
    m(x, t).backward()
    assert len(made) == 1  # not stored as probabilities
    assert pk.stats["replay:diverged"] == 1 and torch.isfinite(x.grad).all()


def test_metered_forward_takes_the_full_path():
    torch.manual_seed(0)
    m = Llama(SMALL)
    idx, tgt = _batch()
    pk = apply(m, Policy())
    _step(m, idx, tgt)
    kept = sum(pk.bytes_kept.values())
    with SavedActivationMeter(m.parameters()) as meter:
        loss = m(idx, tgt)
    assert _role_hooks(m) > 0 and meter.bytes > 0  # the ledger saw every kept byte
    assert meter.bytes == sum(pk.bytes_kept.values()) - kept
    loss.backward()
    with SavedActivationMeter(m.parameters()) as again:
        m(idx, tgt).backward()
    assert again.bytes == meter.bytes


def test_a_failed_forward_leaves_no_plan():
    torch.manual_seed(0)
    m = Llama(SMALL)
    pk = apply(m, Policy())
    idx = torch.randint(0, 256, (2, 65))  # longer than max_seq_len: the forward raises
    with pytest.raises(ValueError):
        m(idx, idx)
    assert not pk._plans and not pk._ctx


def test_apply_returns_its_packer_and_is_idempotent():
    """apply returns the Packer; packer_of finds it; applying an equal policy at the same stage
    again returns the same packer (no second set of hooks); another policy replaces it; remove
    forgets it. Nothing is stored on the model."""
    from leantrain.agoq import packer_of

    m = torch.nn.Sequential(torch.nn.Linear(8, 8))
    assert packer_of(m) is None
    pk = apply(m, Policy(min_numel=1))
    hooks = len(m._forward_hooks) + len(m._forward_pre_hooks)
    assert packer_of(m) is pk and "_agoq_packer" not in vars(m)
    assert apply(m, Policy(min_numel=1)) is pk
    assert len(m._forward_hooks) + len(m._forward_pre_hooks) == hooks
    other = apply(m, Policy(min_numel=1, qkv_in=8))
    assert other is not pk and packer_of(m) is other
    assert len(m._forward_hooks) + len(m._forward_pre_hooks) == hooks
    assert apply(m, Policy(min_numel=1, qkv_in=8), stage=1) is not other
    remove(m)
    assert packer_of(m) is None and len(m._forward_hooks) + len(m._forward_pre_hooks) == 0

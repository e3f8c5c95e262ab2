"""Small 1-D non-fused parameters (norms) stepped together in one update launch (``rest_buckets``):
the same bits as one launch each, every rule and state kind, SR, the clip modes, a non-finite
gradient in one of them."""

import copy

import pytest
import torch
from _forge_util import RULES, assert_same_run
from torch import nn

import leantrain as lt
from leantrain.ops._backend import HAS_TRITON, interpreting

pytestmark = pytest.mark.skipif(not (HAS_TRITON and (interpreting() or torch.cuda.is_available())),
                                reason="needs Triton (interpreter or CUDA)")
DEV = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"  # compiled on a GPU


class NormsNet(nn.Module):
    """An embedding of ``vocab`` tokens, three LayerNorms of ``width`` features (six 1-D parameters)
    and a linear head. ``odd``: one more norm of 24 features (not a multiple of 16: its own launch)."""

    def __init__(self, width=32, odd=False, vocab=40):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(3))
        self.odd = nn.Sequential(nn.Linear(width, 24), nn.LayerNorm(24), nn.Linear(24, width)) if odd else None
        self.fc = nn.Linear(width, vocab)

    def forward(self, idx):
        h = self.emb(idx)
        for norm in self.norms:
            h = h + torch.tanh(norm(h))
        if self.odd is not None:
            h = h + self.odd(h)
        return self.fc(h)


def _run(base, rule, buckets, steps=3, nan_at=None, dtype=torch.float32, **kw):
    """Train a copy of ``base`` with FORGE on Triton, ``rest_buckets`` on or off. Returns the model,
    the optimizer and the number of bucket and single launches of step()."""
    m = copy.deepcopy(base).to(DEV, dtype)
    opt = lt.forge.attach(m, RULES[rule](), backend="triton", **kw)
    opt.rest_buckets = buckets
    calls = {"bucket": 0, "single": 0}
    real_b, real_s = opt._step_rest_bucket, opt._step_rest_kernel
    opt._step_rest_bucket = lambda *a: calls.__setitem__("bucket", calls["bucket"] + 1) or real_b(*a)
    opt._step_rest_kernel = lambda *a: calls.__setitem__("single", calls["single"] + 1) or real_s(*a)
    g = torch.Generator().manual_seed(1)
    for s in range(steps):
        idx = torch.randint(0, base.emb.num_embeddings, (3, 7), generator=g).to(DEV)
        if nan_at is not None and s == steps - 1:
            h = m.norms[1].weight.register_hook(
                lambda gr: torch.where(torch.arange(gr.numel(), device=gr.device) == nan_at, float("nan"), gr))
        loss = nn.functional.cross_entropy(m(idx).flatten(0, 1).float(), idx.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if nan_at is not None:
        h.remove()
    return m, opt, calls


@pytest.mark.parametrize("rule", ["adamw", "sgd_mom", "lion", "adams"])
def test_bucket_equals_one_launch_each(rule):
    torch.manual_seed(0)
    base = NormsNet(odd=True)
    a, oa, ca = _run(base, rule, True)
    b, ob, cb = _run(base, rule, False)
    assert ca == {"bucket": 3, "single": 3 * 3}  # the six 32-wide parameters together; emb, the odd norm's two alone
    assert cb == {"bucket": 0, "single": 3 * 9}
    assert_same_run(a, oa, b, ob)


@pytest.mark.parametrize("state_dtype,width,vocab", [("bf16", 32, 40), ("int8p", 256, 16), ("fp32", 48, 40)])
def test_bucket_bf16_weights_with_stochastic_rounding(state_dtype, width, vocab):
    """bf16 weights: each parameter draws its own launch's rounding bits (its key, its own offsets).
    (int8p packs whole 256-element blocks: norms of 256 features; there a vocabulary of 16 keeps the
    embedding's and the head's interpreted tiles, stepped outside the bucket, to a third.)"""
    torch.manual_seed(0)
    base = NormsNet(width, vocab=vocab)
    a, oa, ca = _run(base, "adamw", True, dtype=torch.bfloat16, state_dtype=state_dtype)
    b, ob, _ = _run(base, "adamw", False, dtype=torch.bfloat16, state_dtype=state_dtype)
    assert ca["bucket"] == 3
    assert_same_run(a, oa, b, ob)
    assert not torch.equal(a.norms[0].weight, base.norms[0].weight.to(DEV, torch.bfloat16))  # it did step


@pytest.mark.parametrize("clip", ["layer", "prev_global", "est_global"])
def test_bucket_under_clipping(clip):
    """Per-parameter scales (clip="layer"), one scale for all (the global modes)."""
    torch.manual_seed(0)
    base = NormsNet()
    a, oa, ca = _run(base, "adamw", True, steps=4, clip=clip, clip_value=0.05)
    b, ob, _ = _run(base, "adamw", False, steps=4, clip=clip, clip_value=0.05)
    assert ca["bucket"] == 4
    assert_same_run(a, oa, b, ob)


def test_nonfinite_gradient_in_a_bucket_leaves_only_that_parameter():
    torch.manual_seed(0)
    base = NormsNet()
    ref, _, _ = _run(base, "adamw", True, steps=2)  # the first two steps, clean
    a, oa, ca = _run(base, "adamw", True, steps=3, nan_at=5)
    b, ob, _ = _run(base, "adamw", False, steps=3, nan_at=5)
    assert ca["bucket"] == 3
    assert_same_run(a, oa, b, ob)
    assert torch.equal(a.norms[1].weight, ref.norms[1].weight)  # one NaN element: nothing of it stepped
    assert oa.state[a.norms[1].weight]["step"] == 3  # (step counts advance, as for a fused layer)
    assert not torch.equal(a.norms[0].weight, ref.norms[0].weight)  # its bucket neighbours did step
    assert not torch.equal(a.norms[1].bias, ref.norms[1].bias)
    assert oa.last_nonfinite == ["norms.1.weight"]


def test_bucket_checkpoint_resumes_bit_identically():
    torch.manual_seed(0)
    base = NormsNet()
    full, of, _ = _run(base, "adamw", True, steps=4)
    half, oh, _ = _run(base, "adamw", True, steps=2)
    m = copy.deepcopy(base).to(DEV)
    m.load_state_dict(half.state_dict())
    opt = lt.forge.attach(m, RULES["adamw"](), backend="triton")
    opt.load_state_dict(copy.deepcopy(oh.state_dict()))
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 40, (3, 7), generator=g).to(DEV) for _ in range(4)]
    for idx in batches[2:]:
        nn.functional.cross_entropy(m(idx).flatten(0, 1), idx.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert_same_run(m, opt, full, of)


def test_buckets_split_at_their_element_limit(monkeypatch):
    """A launch takes at most update_launch.BUCKET_TOTAL elements: six 32-element parameters under a
    limit of 70 go in three launches of two, with the same bits as one launch each."""
    from leantrain.forge import launch as K
    from leantrain.ops import update_launch

    monkeypatch.setattr(update_launch, "BUCKET_TOTAL", 70)
    sizes = []
    real = K.update_many
    monkeypatch.setattr(K, "update_many", lambda ws, *a, **k: sizes.append([w.numel() for w in ws]) or real(ws, *a, **k))
    torch.manual_seed(0)
    base = NormsNet()
    a, oa, ca = _run(base, "adamw", True, steps=2)
    b, ob, _ = _run(base, "adamw", False, steps=2)
    assert ca["bucket"] == 3 * 2 and sizes == [[32, 32]] * 6
    assert_same_run(a, oa, b, ob)

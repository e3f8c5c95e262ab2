"""MeZO and GRZO: the estimators point along the gradient, the weights come back, GRZO never
touches them during its forwards, its signs are not degenerate, state round-trips, and a tiny
Llama learns a generated task."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from helpers import CharTok
from leantrain import config as C
from leantrain.data import tasks
from leantrain.finetune import GRZO, MeZO
from leantrain.finetune import zo as zo_mod
from leantrain.model import Llama


def _quadratic(d: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    theta = nn.Parameter(torch.randn(d, generator=g))
    c = torch.randn(d, generator=g)
    return theta, c


def test_mezo_estimate_points_along_the_gradient():
    """E[(zᵀg) z] = g: the mean of many MeZO steps from one point is -lr·∇L (cosine > 0.98)."""
    theta, c = _quadratic()
    start = theta.detach().clone()
    opt = MeZO([theta], lr=1.0, eps=1e-3, seed=3)
    total = torch.zeros_like(start)
    n = 3000
    for _ in range(n):
        with torch.no_grad():
            theta.copy_(start)
        opt.step(lambda: 0.5 * float(((theta - c) ** 2).sum()))
        total += theta.detach() - start
    grad = start - c
    cos = float(torch.dot(-total, grad) / (total.norm() * grad.norm()))
    assert cos > 0.98, cos
    # and the size: E[Δθ] = -lr·g, within the estimate's noise (relative error ~ sqrt(d / n))
    assert abs(float(total.norm() / n / grad.norm()) - 1.0) < 0.15


def test_mezo_restores_the_weights_when_it_does_not_move():
    """lr = 0: perturbed by +εz, -2εz, +εz, the weights are back within a few ulps (not bit for
    bit: the subtraction rounds), and the closure saw two different points."""
    torch.manual_seed(0)
    lin = nn.Linear(33, 17)
    before = [p.detach().clone() for p in lin.parameters()]
    seen = []
    x = torch.randn(5, 33)
    opt = MeZO(lin.parameters(), lr=0.0, eps=1e-2, seed=1)
    opt.step(lambda: seen.append(lin.weight.detach().clone()) or float(lin(x).square().mean()))
    assert len(seen) == 2 and not torch.equal(seen[0], seen[1])
    for b, p in zip(before, lin.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), b, rtol=0, atol=6e-8)  # a few ulps of |θ ± εz| (~0.1)
    assert opt.last["loss_plus"] != opt.last["loss_minus"]


def test_mezo_refuses_bf16_weights():
    with pytest.raises(ValueError, match="fp32 parameters, or use GRZO"):
        MeZO([nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))], lr=1e-3)


def test_mezo_state_dict_resumes_bit_identically():
    torch.manual_seed(0)
    lin = nn.Linear(300, 9)  # 2700 weights: one noise block; the bias another parameter
    x = torch.randn(4, 300)

    def run(model, opt, steps):
        for _ in range(steps):
            opt.step(lambda: float(model(x).square().mean()))

    ref = nn.Linear(300, 9)
    ref.load_state_dict(lin.state_dict())
    opt_ref = MeZO(ref.parameters(), lr=1e-2, eps=1e-3, weight_decay=0.1, seed=7)
    run(ref, opt_ref, 6)
    a = nn.Linear(300, 9)
    a.load_state_dict(lin.state_dict())
    opt_a = MeZO(a.parameters(), lr=1e-2, eps=1e-3, weight_decay=0.1, seed=7)
    run(a, opt_a, 3)
    sd = opt_a.state_dict()
    b = nn.Linear(300, 9)
    b.load_state_dict(a.state_dict())
    opt_b = MeZO(b.parameters(), lr=5.0, eps=0.5, seed=99)  # everything is overwritten by the load
    opt_b.load_state_dict(sd)
    run(b, opt_b, 3)
    for p, q in zip(ref.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def test_mezo_noise_blocks_cover_large_parameters():
    """A parameter over a noise block is perturbed block by block, each block with its own noise
    (no block repeats another's draws), and restored; the default block is 1/256 of the trained
    elements within [2**16, 2**22]."""
    p = nn.Parameter(torch.zeros(5, 50))
    deltas = []
    MeZO([p], lr=0.0, eps=1.0, seed=2, noise_block=64).step(lambda: deltas.append(p.detach().clone()) or 0.0)
    z = deltas[0].view(-1)  # +εz with θ = 0, ε = 1
    assert bool((z != 0).all())
    blocks = z.split(64)
    assert not any(torch.equal(blocks[0], b[:64]) for b in blocks[1:-1])
    assert float(p.detach().abs().max()) < 1e-6
    assert [zo_mod.noise_block_for(n) for n in (10, 1 << 26, 1 << 30, 1 << 34)] == [1 << 16, 1 << 18, 1 << 22, 1 << 22]


# --------------------------------------------------------------------------------------- GRZO


def _linear_regression(batch=16, d_in=12, d_out=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(d_in, d_out, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(d_out, d_in, generator=g) * 0.3)
        lin.bias.copy_(torch.randn(d_out, generator=g) * 0.3)
    x = torch.randn(batch, d_in, generator=g)
    y = torch.randn(batch, d_out, generator=g)
    return lin, x, y


def test_grzo_forwards_never_touch_the_weights():
    lin, x, y = _linear_regression()
    before = [p.detach().clone() for p in lin.parameters()]
    outs = []

    def closure():
        for b, p in zip(before, lin.parameters(), strict=True):
            assert torch.equal(b, p)  # inside the perturbed forwards: the stored weights are the same bits
        out = lin(x)
        outs.append(out.clone())
        return ((out - y) ** 2).sum(1)

    opt = GRZO(lin, lr=0.0, sigma=1e-2, seed=4)
    opt.step(closure)
    assert not torch.equal(outs[0], outs[1])  # the two forwards were perturbed in opposite directions
    torch.testing.assert_close((outs[0] + outs[1]) / 2, lin(x), rtol=1e-5, atol=1e-6)  # ±σ around W
    for b, p in zip(before, lin.parameters(), strict=True):
        assert torch.equal(b, p)  # lr = 0: not moved either
    opt.remove()
    assert torch.equal(lin(x), lin(x))


def test_grzo_hook_is_each_example_s_own_perturbed_weight():
    """The flipout output of example i equals x_i (W + σ U ⊙ r_i s_iᵀ)ᵀ + b + σ u_b ⊙ r_i."""
    lin, x, y = _linear_regression(batch=6)
    opt = GRZO(lin, lr=0.0, sigma=0.05, seed=11)
    got = []
    opt.step(lambda: got.append(lin(x).clone()) or ((lin(x) - y) ** 2).sum(1))
    key = opt._key(lin)  # the step's noise, drawn as the optimizer draws it (it has advanced: step 0)
    opt.steps = 0
    key = opt._key(lin)
    r = zo_mod._signs(zo_mod.step_seed(key, 0, 2), (6, 5), x.device).float()
    s = zo_mod._signs(zo_mod.step_seed(key, 1, 2), (6, 12), x.device).float()
    u = zo_mod._noise(zo_mod.step_seed(key, 0, 3), (5, 12), x.device)
    ub = zo_mod._noise(zo_mod.step_seed(key, 0, 4), (5,), x.device)
    for i in range(6):
        w_i = lin.weight + 0.05 * u * torch.outer(r[i], s[i])
        b_i = lin.bias + 0.05 * ub * r[i]
        torch.testing.assert_close(got[0][i], x[i] @ w_i.t() + b_i, rtol=1e-5, atol=1e-6)


def test_grzo_signs_are_not_degenerate():
    """Per-example signs are independent draws: no rank-1 checkerboard (research/memory.md)."""
    r = zo_mod._signs(123, (64, 256), torch.device("cpu")).float()
    assert set(r.unique().tolist()) == {-1.0, 1.0}
    assert abs(float(r.mean())) < 0.05
    assert torch.linalg.matrix_rank(r) >= 60
    corr = (r @ r.t() / 256).fill_diagonal_(0)
    assert float(corr.abs().max()) < 0.35  # two examples' sign vectors are nearly orthogonal


def test_grzo_update_points_along_the_gradient():
    """Averaged over many steps from one point, GRZO's move is along -∇ of the batch loss."""
    lin, x, y = _linear_regression()
    start = [p.detach().clone() for p in lin.parameters()]
    opt = GRZO(lin, lr=1e-3, sigma=1e-3, seed=5)
    total = [torch.zeros_like(p) for p in start]
    for _ in range(800):
        with torch.no_grad():
            for p, s in zip(lin.parameters(), start, strict=True):
                p.copy_(s)
        opt.step(lambda: ((lin(x) - y) ** 2).sum(1))
        for t, p, s in zip(total, lin.parameters(), start, strict=True):
            t += p.detach() - s
    for p, s in zip(lin.parameters(), start, strict=True):
        p.data.copy_(s)
    loss = ((lin(x) - y) ** 2).sum(1).mean()
    grads = torch.autograd.grad(loss, list(lin.parameters()))
    move = torch.cat([t.flatten() for t in total])
    grad = torch.cat([g.flatten() for g in grads])
    cos = float(torch.dot(-move, grad) / (move.norm() * grad.norm()))
    assert cos > 0.8, cos


def test_grzo_needs_per_example_losses_and_logits(corpus):
    cfg = C.build("tiny", overrides={"model.dim": "32", "model.n_layers": "1", "model.n_heads": "2",
                                     "model.n_kv_heads": "1", "model.ffn_dim": "64", "model.vocab_size": "64"})
    model = Llama(cfg.model)
    opt = GRZO(model, lr=1e-3)
    idx = torch.randint(0, 64, (2, 8))
    with pytest.raises(ValueError, match="one loss per example"):
        opt.step(lambda: model(idx).float().mean())
    assert opt._sign == 0.0  # hooks off again after an error
    # per-example losses against targets go through the head's logits, which the hooks perturb
    losses = []
    for sign in (1.0, -1.0):
        opt._sign = sign
        opt._signs.clear()
        with torch.no_grad():
            losses.append(model(idx, idx, reduction="none"))
    opt._sign = 0.0
    assert not torch.equal(losses[0], losses[1])
    assert math.isfinite(opt.step(lambda: model(idx, idx, reduction="none")))
    assert opt._sign == 0.0  # hooks off again after an error
    assert "embed_tokens.weight" in opt.frozen and "lm_head.weight" in opt.trained


def test_grzo_leaves_tied_weights_alone():
    cfg = C.build("tiny", overrides={"model.dim": "32", "model.n_layers": "1", "model.n_heads": "2",
                                     "model.n_kv_heads": "1", "model.ffn_dim": "64", "model.vocab_size": "64",
                                     "model.tie_embeddings": "true"})
    opt = GRZO(Llama(cfg.model), lr=1e-3)
    assert "lm_head.weight" in opt.frozen and "embed_tokens.weight" in opt.frozen
    assert any(n.endswith("o_proj.weight") for n in opt.trained)
    assert any(n.endswith("norm.weight") for n in opt.trained)


def test_grzo_state_dict_resumes_bit_identically():
    lin, x, y = _linear_regression()
    clone = nn.Linear(12, 5)

    def run(model, opt, steps):
        for _ in range(steps):
            opt.step(lambda: ((model(x) - y) ** 2).sum(1))

    clone.load_state_dict(lin.state_dict())
    run(lin, GRZO(lin, lr=1e-2, sigma=1e-3, weight_decay=0.1, seed=3), 6)
    opt = GRZO(clone, lr=1e-2, sigma=1e-3, weight_decay=0.1, seed=3)
    run(clone, opt, 3)
    sd = opt.state_dict()
    opt.remove()
    resumed = nn.Linear(12, 5)
    resumed.load_state_dict(clone.state_dict())
    opt2 = GRZO(resumed, lr=9.0, seed=0)
    opt2.load_state_dict(sd)
    run(resumed, opt2, 3)
    for p, q in zip(lin.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)


# ---------------------------------------------------------------------- a tiny Llama learns


@pytest.mark.parametrize("method", ["mezo", "grzo"])
def test_zeroth_order_learns_the_compare_task(method):
    tok = CharTok()
    cfg = C.build("tiny", overrides={"model.dim": "32", "model.n_layers": "1", "model.n_heads": "2",
                                     "model.n_kv_heads": "1", "model.ffn_dim": "64",
                                     "model.vocab_size": str(tok.eot_id + 1)})
    torch.manual_seed(0)
    model = Llama(cfg.model)
    evalb = tasks.encode(tasks.examples("compare", 256, seed=9), tok, tok.eot_id)
    acc0, loss0 = tasks.accuracy(model, evalb)
    if method == "mezo":
        opt = MeZO(model.parameters(), lr=3e-3, eps=1e-3, seed=1)
    else:
        opt = GRZO(model, lr=1e-4, sigma=1e-3, seed=1)  # (its step is lr / (2σ√B) an element: see zo.py)
    train = tasks.examples("compare", 150 * 16, seed=0)
    for step in range(150):
        b = tasks.encode(train[step * 16:(step + 1) * 16], tok, tok.eot_id)
        if method == "mezo":
            opt.step(lambda b=b: tasks.losses(model, b).mean())
        else:
            opt.step(lambda b=b: tasks.losses(model, b))
    acc1, loss1 = tasks.accuracy(model, evalb)
    assert math.isfinite(loss1)
    assert loss1 < loss0 - 0.05, (loss0, loss1)
    assert acc1 > acc0, (acc0, acc1)

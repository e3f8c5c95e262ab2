"""FORGE ``clip="est_global"``: semantics against a hand-computed unfused reference, resume, NaN.

``est_global`` scales a fused layer's gradient at step t by ``min(1, c / (N̂ + 1e-6))`` with
``N̂² = S + R · C / Q``: S the sum of squares of this step's gradients of the layers reduced so
far in this backward (this one included), C / Q this step's / the predicted sums of squares of
those same layers, R the predicted sum of squares of everything else (step 1: ``N̂² = S``). A
unit's prediction (each fused layer; the non-fused parameters together) is the geometric moving
average ``pred ← pred^β · s^(1-β)`` of its sums of squares. The non-fused parameters, stepped in
``opt.step()`` when every gradient is known, use the exact global norm.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from _forge_util import RULES, Net, batches, max_rel, pair, train

import leantrain as lt
from leantrain.forge.optimizer import _EST_BETA

EPS = 1e-6


def _est_global_reference(m, data, c):
    """Unfused: materialize every gradient, apply the est_global scales by hand, step."""
    opt = lt.optim.Optimizer(m.parameters(), RULES["sgd_mom"]())
    fused = [(m.fc2.weight, m.fc2.bias), (m.fc1.weight, m.fc1.bias)]  # backward order
    rest = [m.norm.weight, m.norm.bias]
    pred, scales = None, []  # predictions of [fc2, fc1, the non-fused parameters]
    for x in data:
        m(x).square().mean().backward()
        cur = [sum(float(p.grad.double().square().sum()) for p in layer) for layer in fused]
        cur.append(sum(float(p.grad.double().square().sum()) for p in rest))
        total = sum(cur)
        step_scales = []
        for i, layer in enumerate(fused):
            s = sum(cur[: i + 1])
            est = s if pred is None else s + sum(pred[i + 1:]) * s / sum(pred[: i + 1])
            scale = min(1.0, c / (math.sqrt(est) + EPS))
            step_scales.append(scale)
            for p in layer:
                p.grad.mul_(scale)
        for p in rest:
            p.grad.mul_(min(1.0, c / (math.sqrt(total) + EPS)))
        scales.append(step_scales)
        pred = cur if pred is None else [a ** _EST_BETA * b ** (1 - _EST_BETA) for a, b in zip(pred, cur)]
        opt.step()
        opt.zero_grad()
    return math.sqrt(total), scales


def test_est_global_matches_hand_computed_reference():
    torch.manual_seed(11)
    m0, m1 = pair(Net())
    m2, m3 = copy.deepcopy(m0), copy.deepcopy(m0)
    # growing inputs: the norm changes from step to step, so est_global != prev_global
    data = [x * (2.0 + i) for i, x in enumerate(batches(5))]
    norm, scales = _est_global_reference(m0, data, c=0.05)
    flat = [s for st in scales for s in st]
    assert min(flat) < 0.5 and len({round(s, 6) for s in flat}) > 3  # clipping active and varying
    opt = lt.forge.attach(m1, RULES["sgd_mom"](), backend="torch", clip="est_global", clip_value=0.05)
    train(m1, opt, data)
    assert opt.last_grad_norm == pytest.approx(norm, rel=1e-5)
    for (n, a), (_, b) in zip(m0.named_parameters(), m1.named_parameters()):
        assert max_rel(b, a) <= 1e-5, n
    # and the test can tell the modes apart: prev_global and no clipping land elsewhere
    for mode, m in (("prev_global", m2), ("none", m3)):
        train(m, lt.forge.attach(m, RULES["sgd_mom"](), backend="torch", clip=mode, clip_value=0.05), data)
        assert max(max_rel(b, a) for a, b in zip(m0.parameters(), m.parameters())) > 1e-3, mode


def test_est_global_state_dict_resume_bit_identical():
    torch.manual_seed(12)
    data = [x * 4 for x in batches(6, shape=(2, 12, 33))]
    m0 = Net()
    m1 = copy.deepcopy(m0)
    kw = dict(backend="torch", clip="est_global", clip_value=0.1)
    o0 = lt.forge.attach(m0, RULES["adamw"](), **kw)
    train(m0, o0, data)
    o1 = lt.forge.attach(m1, RULES["adamw"](), **kw)
    train(m1, o1, data[:3])
    sd, msd = copy.deepcopy(o1.state_dict()), copy.deepcopy(m1.state_dict())
    assert len(sd["forge"]["pred_sq"]) == 3  # fc1, fc2, the non-fused parameters
    m2 = Net()
    m2.load_state_dict(msd)
    o2 = lt.forge.attach(m2, RULES["adamw"](), **kw)
    o2.load_state_dict(sd)
    train(m2, o2, data[3:])
    for a, b in zip(m0.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_est_global_nan_layer_does_not_poison_the_estimate():
    torch.manual_seed(13)
    m = Net()
    opt = lt.forge.attach(m, RULES["adamw"](), backend="torch", clip="est_global", clip_value=0.1)
    train(m, opt, batches(2))

    def poison(mod, inp, out):
        out.register_hook(lambda g: torch.full_like(g, float("nan")))

    h = m.fc1.register_forward_hook(poison)
    before = m.fc2.weight.detach().clone()
    m(batches(1, seed=9)[0]).square().mean().backward()
    opt.step()
    opt.zero_grad()
    h.remove()
    assert "fc1" in opt.last_nonfinite
    assert not torch.equal(m.fc2.weight, before) and torch.isfinite(m.fc2.weight).all()
    assert torch.isfinite(opt._pred_total) and all(torch.isfinite(t) for t in opt._pred_sq.values())
    train(m, opt, batches(2, seed=10))
    assert opt.last_nonfinite == [] and all(torch.isfinite(p).all() for p in m.parameters())

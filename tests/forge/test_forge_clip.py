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
from leantrain.forge.gradsums import GradSums
from leantrain.forge.optimizer import _EST_BETA
from leantrain.ops._backend import HAS_TRITON, interpreting

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
    assert torch.isfinite(opt._sums.total) and torch.isfinite(opt._sums.pred).all() and all(opt._sums.has)
    train(m, opt, batches(2, seed=10))
    assert opt.last_nonfinite == [] and all(torch.isfinite(p).all() for p in m.parameters())


# ----------------------------------------------------------------------------- the one-launch scale kernel

needs_triton = pytest.mark.skipif(not (HAS_TRITON and (interpreting() or torch.cuda.is_available())),
                                  reason="Triton interpreter or CUDA")
DEV = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"


def _sequence(seed, nslots, steps, integer):
    """Per step, per slot (backward order), a gradient buffer; one slot NaN in step 2, one +inf in step 3."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in range(steps):
        step = []
        for slot in reversed(range(nslots)):
            n = int(torch.randint(1, 700, (1,), generator=g))
            x = torch.randint(-6, 7, (n,), generator=g).float() if integer else torch.randn(n, generator=g) * (1 + t)
            if t == 2 and slot == 1:
                x[n // 2] = float("nan")
            if t == 3 and slot == 0:
                x[0] = float("inf")
            step.append((slot, x.to(DEV)))
        out.append(step)
    return out


def _drive(sums, seq, est, use_kernel, c=3.0):
    """Run the per-layer scale path over ``seq`` (folding after each step as opt.step() does)."""
    seen = []
    for step in seq:
        for slot, buf in step:
            if use_kernel:
                scale = sums.scale_kernel(slot, buf, est, c)
            else:
                sums.sq_views[slot].copy_(buf.square().sum())
                scale = sums.scale_torch(slot, est, c)
            seen.append((sums.sq[slot].clone(), scale.clone(), sums.run.clone()))
        if est:
            sums.fold([slot for slot, _ in step])
            sums.run.zero_()
    return seen


@needs_triton
@pytest.mark.parametrize("est", [True, False], ids=["est_global", "layer"])
def test_scale_kernel_equals_torch_reference_bit_for_bit(est):
    """Integer-valued gradients: every sum of squares is exact in any order, so the kernel's
    sum and running sums must equal the torch reference's to the bit, over steps that include a
    NaN and an infinite gradient; the scale too on CUDA. On CPU the scale may differ by 2^-22:
    torch's CPU fp32 ``sqrt`` is not correctly rounded (sqrt(22312.62890625) gives 0x1.2abf8cp+7,
    the correctly rounded value is 0x1.2abf8ep+7), the kernel's ``sqrt_rn`` is, as CUDA's is."""
    seq = _sequence(0, 4, 5, integer=True)
    a = _drive(GradSums(4, DEV, _EST_BETA), seq, est, use_kernel=True)
    b = _drive(GradSums(4, DEV, _EST_BETA), seq, est, use_kernel=False)
    assert len(a) == 20
    scales = []
    for (sa, ca, ra), (sb, cb, rb) in zip(a, b):
        assert torch.equal(sa, sb) or (sa.isnan() and sb.isnan())
        if DEV == "cuda" or ca.isnan():
            assert torch.equal(ca, cb) or (ca.isnan() and cb.isnan())
        else:
            assert float((ca - cb).abs()) <= 2.0 ** -22 * float(cb.abs())  # sqrt's ulp, carried through 1/x
        if est:
            assert torch.equal(ra, rb)
        scales.append(float(cb))
    finite = [s for s in scales if math.isfinite(s)]
    assert min(finite) < 0.5  # clipping active in the sequence
    if not est:
        assert any(math.isnan(s) for s in scales)  # clip="layer": a NaN gradient gives a NaN scale (skipped)
    else:
        assert all(math.isfinite(s) for s in scales)  # est_global: a NaN layer adds nothing


@needs_triton
def test_scale_kernel_float_sums_and_ticket_reset():
    """Random float gradients: the kernel's sum (fixed order over its programs) is within fp32
    rounding of torch's; the ticket is back to 0 after every launch (else the next layer's
    last program would never see its turn)."""
    seq = _sequence(1, 3, 3, integer=False)
    sums = GradSums(3, DEV, _EST_BETA)
    a = _drive(sums, seq, True, use_kernel=True)
    b = _drive(GradSums(3, DEV, _EST_BETA), seq, True, use_kernel=False)
    for (sa, ca, _), (sb, cb, _) in zip(a, b):
        if torch.isfinite(sb):
            assert float((sa - sb).abs() / sb) < 1e-5
        assert float((ca - cb).abs()) <= 1e-5 * float(cb.abs())
    assert int(sums._ticket[0]) == 0


@needs_triton
@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
def test_est_global_triton_backend_matches_torch_backend(state_dtype):
    torch.manual_seed(14)
    m0, m1 = pair(Net(k=40, h=96, n=24).to(DEV))
    kw = dict(clip="est_global", clip_value=0.05, state_dtype=state_dtype)
    o0 = lt.forge.attach(m0, RULES["adamw"](), backend="torch", **kw)
    o1 = lt.forge.attach(m1, RULES["adamw"](), backend="triton", **kw)
    data = [x.to(DEV) * (2.0 + i) for i, x in enumerate(batches(4, shape=(2, 12, 40)))]
    train(m0, o0, data)
    train(m1, o1, data)
    assert o1.last_grad_norm == pytest.approx(o0.last_grad_norm, rel=1e-5)
    assert torch.allclose(o1._sums.pred, o0._sums.pred, rtol=1e-5)
    for a, b in zip(m0.parameters(), m1.parameters()):
        assert max_rel(b, a) <= (1e-5 if state_dtype == "fp32" else 2e-2)

"""Calibration: measure each role's gradient error at each bit-width, pick the cheapest policy.

``calibrate(model, batches, candidate_bits=(2, 3, 4, 8), error_budget=0.1)``:

1. reference parameter gradients ``g`` (no quantization), summed over ``batches``;
2. for each role present in the model and each candidate width ``b``: the gradients ``ĝ``
   with only that role quantized to ``b`` bits, and the relative error
   ``e[role][b] = ||ĝ - g|| / ||g||`` (all parameters together);
3. errors of independent roles add in quadrature (unbiased, independent rounding noise):
   starting from the widest candidate everywhere, greedily lower the role whose next step
   saves the most bytes per unit of added squared error, while ``sqrt(Σ e²) <= budget``;
4. the chosen policy is measured as a whole; while it misses the budget, the role with the
   largest error is raised one step.

Cost: ``len(roles) * len(candidate_bits) + 2`` forward/backward passes per batch.

Calibrate a model that has trained a while, never a random-initialized one: at init the
attention and the output distribution are near uniform, and the roles whose backward
exponentiates a saved tensor look easy. Tiny preset, ``attn`` alone at 4 bits: relative
gradient error 0.0095 at init, 1.49 after 300 steps (8 bits: 0.015); ``logits`` at 4 bits on
log-probabilities 0.0006 at init, 0.069 after 300 steps (docs/agoq.md, "Convergence").
The rounding noise differs on every call (each :class:`~leantrain.agoq.hooks.Packer` draws
fresh noise), so repeated measurements of one policy differ by the noise, not by a bias.
"""

from __future__ import annotations

import math

from torch import nn

from leantrain.agoq.hooks import Packer, quantize_activations
from leantrain.agoq.policy import KEEP, ROLES, Policy

__all__ = ["calibrate", "gradient_error", "param_grads"]


def _default_loss(model, batch):
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def param_grads(model: nn.Module, batches, policy: Policy | None = None, loss_fn=None, seed: int = 0):
    """{name: summed gradient over ``batches``}, with AGoQ by ``policy`` (None: no quantization)."""
    loss_fn = loss_fn or _default_loss
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    saved = [p.grad for _, p in params]
    for _, p in params:
        p.grad = None
    for i, b in enumerate(batches):
        if policy is None:
            loss = loss_fn(model, b)
        else:
            with quantize_activations(model, policy.replace(seed=seed * 1000 + i)):
                loss = loss_fn(model, b)
        loss.backward()
    out = {n: p.grad.detach().float().clone() for n, p in params if p.grad is not None}
    for (_, p), g in zip(params, saved, strict=True):
        p.grad = g
    return out


def gradient_error(model: nn.Module, batches, policy: Policy, *, reference=None, loss_fn=None,
                   seed: int = 0) -> dict:
    """Relative gradient error of AGoQ by ``policy``: ``{"total": e, "per_param": {name: e}}``."""
    ref = reference if reference is not None else param_grads(model, batches, None, loss_fn)
    got = param_grads(model, batches, policy, loss_fn, seed)
    num = den = 0.0
    per = {}
    for n, g in ref.items():
        d = (got[n] - g).norm().item() ** 2
        r = g.norm().item() ** 2
        per[n] = math.sqrt(d / r) if r > 0 else 0.0
        num, den = num + d, den + r
    return {"total": math.sqrt(num / den) if den else 0.0, "per_param": per}


def _role_numel(model, batches, loss_fn, base: Policy) -> tuple[dict[str, int], dict[str, int]]:
    """Elements saved per role with every role packed (at 8 bits): (stored, derived). Derived
    saves (``base.derive``) hold no bytes whatever the width, so they weigh nothing in the cost."""
    pol = base.replace(**{r: 8 for r in ROLES})
    pk = Packer(model, pol)
    pk.install()
    try:
        with pk:
            loss = (loss_fn or _default_loss)(model, batches[0])
    finally:
        pk.remove()
    del loss
    return ({r: n for r, n in pk.numel.items() if n}, {r: n for r, n in pk.derived_numel.items() if n})


def _bits_cost(b: int, group_size: int) -> float:
    return (16 if b >= KEEP else b + 32 / group_size) / 8


def calibrate(model: nn.Module, batches, candidate_bits=(2, 3, 4, 8), error_budget: float = 0.1, *,
              base: Policy | None = None, loss_fn=None, return_report: bool = False):
    """The cheapest :class:`Policy` whose measured relative gradient error is ``<= error_budget``."""
    batches = list(batches)
    if not batches:
        raise ValueError("calibrate needs at least one batch")
    cands = sorted(set(candidate_bits))
    base = base or Policy()
    ref = param_grads(model, batches, None, loss_fn)
    numel, derived = _role_numel(model, batches, loss_fn, base)
    roles = [r for r in ROLES if r in numel]
    keep_all = base.replace(**{r: KEEP for r in ROLES})
    err: dict[str, dict[int, float]] = {}
    for r in roles:
        err[r] = {}
        for b in cands:
            e = gradient_error(model, batches, keep_all.replace(**{r: b}), reference=ref, loss_fn=loss_fn)
            err[r][b] = e["total"]
    idx = {r: len(cands) - 1 for r in roles}

    def total(ix):
        return math.sqrt(sum(err[r][cands[i]] ** 2 for r, i in ix.items()))

    while True:
        best, best_gain = None, -1.0
        for r in roles:
            i = idx[r]
            if i == 0:
                continue
            trial = {**idx, r: i - 1}
            if total(trial) > error_budget:
                continue
            saved = numel[r] * (_bits_cost(cands[i], base.group_size) - _bits_cost(cands[i - 1], base.group_size))
            de2 = max(err[r][cands[i - 1]] ** 2 - err[r][cands[i]] ** 2, 1e-12)
            if saved / de2 > best_gain:
                best, best_gain = r, saved / de2
        if best is None:
            break
        idx[best] -= 1

    def policy_of(ix):
        return base.replace(**{r: cands[i] for r, i in ix.items()})

    measured = gradient_error(model, batches, policy_of(idx), reference=ref, loss_fn=loss_fn)["total"]
    for _ in range(len(roles) * len(cands)):
        if measured <= error_budget:
            break
        up = [r for r in roles if idx[r] < len(cands) - 1]
        if not up:
            break
        worst = max(up, key=lambda r: err[r][cands[idx[r]]])
        idx[worst] += 1
        measured = gradient_error(model, batches, policy_of(idx), reference=ref, loss_fn=loss_fn)["total"]
    pol = policy_of(idx)
    if not return_report:
        return pol
    tot_n = sum(numel.values()) + sum(derived.values())
    report = {
        "errors": err,
        "numel": numel,
        "derived_numel": derived,
        "chosen": {r: cands[i] for r, i in idx.items()},
        "predicted_error": total(idx),
        "measured_error": measured,
        # over every saved element, derived ones at 0 bits (they hold nothing)
        "average_bits": sum(numel[r] * cands[idx[r]] for r in roles) / tot_n,
        "budget": error_budget,
    }
    return pol, report

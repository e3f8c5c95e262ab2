"""An alpha-beta model of communication time: measured bytes in, estimated seconds out.

    t = sum over scopes s of  calls_s * alpha_s  +  bytes_s / bandwidth_s

``bytes_s`` are the bytes one rank sends in scope ``s`` (what :class:`leantrain.runtime.ledger.CommLedger`
records; per-rank, NCCL "bus bandwidth" convention), so ``bandwidth_s`` is the per-GPU link
bandwidth: NVLink inside a node (``intra``, default 450 GB/s per direction on H100/H200), the
NIC across nodes (``inter``, default 25 GB/s = 200 Gb/s per GPU). A collective over the whole
data-parallel group (``world``) spanning several nodes runs at the NIC's rate (a ring's
slowest links cross nodes; NCCL's multi-node bus bandwidth is the NIC's); on one node it runs
at the intra rate. :func:`estimate_time` assumes hops do not overlap one another (an upper
bound) and does not model overlap with compute; the fitted step model below does.

:func:`fit_step_model` calibrates a whole step against measurements (the namespace cluster of
``benchmarks/cluster/``):

    t(recipe, R) = compute_recipe + alpha * calls + max(0, link_s - hidden_recipe)
    link_s       = 8 * wire_bytes / (efficiency * R)

``wire_bytes`` are the bytes per step on the busiest shaped link (the interface counters: the
collective algorithm's real traffic and the protocol's overhead included), ``R`` its rate in
bit/s, ``efficiency`` the share of the nominal rate a collective achieves while it sends (gaps
between messages, TCP's window), ``alpha`` the latency per collective call. With per-collective
efficiencies (``op_efficiency``, measured apart: each collective alone on the same links) a row
carries its wire bytes split by collective, ``wire_bytes_by_op``, and

    link_s = 8 * sum over ops o of (wire_bytes_o / op_efficiency_o) / (efficiency * R)

so the fitted ``efficiency`` is what is left once each collective's own share of the rate is
accounted for (1: the collectives achieve in a step what they achieve alone). ``compute_recipe``
is the step with an unlimited link: the model's compute plus the technique's compression
kernels (a recipe minus its uncompressed reference is the kernels' cost; it does not depend on
the link). ``hidden_recipe`` is the compute the recipe's communication runs under: where the
trainer launches collectives during backward (DDP's bucket hooks, the sharded optimizer's
reduce-scatter hooks) a transfer shorter than that costs nothing and a longer one costs only
its excess; where it does not (GIFT reduces after backward) it is 0. The step is therefore
flat in the rate until the link time reaches ``hidden``, then grows with slope ``1 /
efficiency`` (a hinge); a model without the hinge fits the two regimes with one line, whose
slope then reads as an efficiency above 1. A row's ``overlap_share`` (default 1) limits the
hidden part to that share of its link time (the bytes of the collectives launched during
backward), the rest counted after compute:
``max(0, share * link_s - hidden) + (1 - share) * link_s``. :func:`held_out_check` fits on some
rows and predicts the others.

Paired rows: on a shared host a recipe's compute moves between runs by more than the link adds
at fast rates, so a row may carry ``paired_step_s``, the same recipe's step measured right next
to it at ``paired_rate_bps`` (None: an unlimited link). The fit then explains only the link's
excess, ``step - paired_step = comm(R) - comm(R_pair)``, and a prediction starts from the row's
own paired step instead of a fitted compute (which is reported as the median over the rows of
``paired_step - comm(R_pair)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GB = 1e9


def estimate_time(
    bytes_by_scope,
    *,
    intra_GBps: float = 450.0,
    inter_GBps: float = 25.0,
    alpha_us: float | dict = 10.0,
    calls_by_scope: dict | None = None,
    nodes: int = 2,
) -> dict:
    """Estimated communication seconds per scope and in total.

    Args:
        bytes_by_scope: ``{"intra": B, "inter": B, "world": B}`` (bytes sent by one rank), or a
            :class:`leantrain.runtime.ledger.CommLedger` (its bytes and call counts are used).
        intra_GBps / inter_GBps: per-GPU bandwidths in GB/s (1e9 bytes).
        alpha_us: latency per collective call, microseconds (one number, or per scope).
        calls_by_scope: number of collective calls per scope (latency term); 0 if not given.
        nodes: nodes the ``world`` group spans (1: ``world`` runs at the intra rate).
    Returns:
        ``{"intra": s, "inter": s, "world": s, "total": s}``.
    """
    if hasattr(bytes_by_scope, "by_scope"):
        ledger = bytes_by_scope
        bytes_by_scope = ledger.by_scope()
        if calls_by_scope is None:
            calls_by_scope = {}
            for (_, scope), n in ledger.calls.items():
                calls_by_scope[scope] = calls_by_scope.get(scope, 0) + n
    calls_by_scope = calls_by_scope or {}
    bw = {"intra": intra_GBps * GB, "inter": inter_GBps * GB,
          "world": (inter_GBps if nodes > 1 else intra_GBps) * GB}
    out = {}
    for scope in ("intra", "inter", "world"):
        a = alpha_us.get(scope, 0.0) if isinstance(alpha_us, dict) else alpha_us
        out[scope] = calls_by_scope.get(scope, 0) * a * 1e-6 + bytes_by_scope.get(scope, 0) / bw[scope]
    unknown = set(bytes_by_scope) - set(bw)
    if unknown:
        raise ValueError(f"estimate_time: unknown scopes {sorted(unknown)}; expected intra, inter, world")
    out["total"] = out["intra"] + out["inter"] + out["world"]
    return out


def effective_wire_bytes(row: dict, op_efficiency: dict[str, float] | None = None) -> float:
    """The row's ``wire_bytes``, or with ``op_efficiency`` the sum over its ``wire_bytes_by_op`` of
    each collective's bytes over its efficiency (the bytes a link at the collective's full rate
    would carry in the same time). Collectives with no bytes need no efficiency."""
    if op_efficiency is None:
        return row["wire_bytes"]
    by_op = row.get("wire_bytes_by_op")
    if by_op is None:
        raise ValueError(f"a row of {row['recipe']!r} has no wire_bytes_by_op, which per-collective "
                         "efficiencies (op_efficiency) need")
    unknown = sorted(op for op, b in by_op.items() if b and op not in op_efficiency)
    if unknown:
        raise ValueError(f"op_efficiency has no efficiency for {unknown} (a row of {row['recipe']!r} sends "
                         f"bytes through them); it has {sorted(op_efficiency)}")
    return sum(b / op_efficiency[op] for op, b in by_op.items() if b)


@dataclass
class StepModel:
    """A fitted step-time model (see the module docstring); ``predict`` takes a measurement row
    (``recipe``, ``wire_bytes``, ``rate_bps``, optionally ``calls``, ``overlap_share``, the paired
    step, and ``wire_bytes_by_op``, which a model with ``op_efficiency`` needs)."""

    compute_s: dict[str, float]
    alpha_s: float
    efficiency: float
    alpha_fitted: bool = True
    hidden_s: dict[str, float] = field(default_factory=dict)
    op_efficiency: dict[str, float] | None = None

    def link_s(self, row: dict) -> float:
        """Seconds the row's bytes keep its link busy at the fitted efficiency (and each
        collective's ``op_efficiency`` when the model has them; 0 unshaped)."""
        rate = row.get("rate_bps")
        return 0.0 if not rate else 8 * effective_wire_bytes(row, self.op_efficiency) / (self.efficiency * rate)

    def comm_s(self, row: dict) -> float:
        """Seconds communication adds to the step: latency plus the link time not hidden under compute."""
        hidden, link = self.hidden_s.get(row["recipe"], 0.0), self.link_s(row)
        share = row.get("overlap_share", 1.0)
        return self.alpha_s * row.get("calls", 0) + max(0.0, share * link - hidden) + (1 - share) * link

    def compute_of(self, row: dict) -> float:
        """The row's compute: its paired step less that step's own communication when the row is
        paired (see the module docstring), else the recipe's fitted compute."""
        if row.get("paired_step_s") is None:
            return self.compute_s[row["recipe"]]
        return row["paired_step_s"] - self.comm_s(_paired_row(row))

    def predict(self, row: dict) -> float:
        return self.compute_of(row) + self.comm_s(row)


def _paired_row(row: dict) -> dict:
    """The row measured at the paired rate (the same recipe, bytes and calls)."""
    return dict(row, rate_bps=row.get("paired_rate_bps"), paired_step_s=None)


def _hinge_fit(t, u, w, overlaps: bool) -> tuple[float, float, float]:
    """``(compute, hidden, loss)`` of ``t ~ compute + max(0, u - hidden)`` for one recipe's rows,
    ``0 <= hidden <= compute`` (``hidden = 0`` unless ``overlaps``); ``loss`` is the sum of
    ``w * residual**2``.

    The loss is piecewise quadratic in ``hidden``: between two consecutive sorted ``u`` the rows
    split into compute-bound (``t = compute``) and link-bound (``t = compute - hidden + u``) with
    a closed-form least-squares solution, and the minimum is such a solution lying inside its
    interval or a knot (``hidden`` = 0 or one of the ``u``). Ties go to the smallest ``hidden``
    (a recipe whose link time never exceeds what it hides shows only a lower bound)."""
    import numpy as np

    def at(hidden: float) -> tuple[float, float, float]:
        excess = np.maximum(0.0, u - hidden)
        c = float(np.sum(w * (t - excess)) / np.sum(w))
        return c, float(hidden), float(np.sum(w * (c + excess - t) ** 2))

    cands = [at(0.0)]
    if overlaps:
        cands += [at(h) for h in u if h > 0]
        order = np.argsort(u)
        for j in range(1, len(u)):
            bound, link = order[:j], order[j:]
            c = float(np.sum(w[bound] * t[bound]) / np.sum(w[bound]))
            h = c - float(np.sum(w[link] * (t[link] - u[link])) / np.sum(w[link]))
            if u[order[j - 1]] <= h <= u[order[j]]:
                pred = np.where(u > h, c - h + u, c)
                cands.append((c, h, float(np.sum(w * (pred - t) ** 2))))
    feasible = [x for x in cands if 0.0 <= x[1] <= x[0]] or cands[:1]
    best = min(x[2] for x in feasible)
    return min((x for x in feasible if x[2] <= best * (1 + 1e-9) + 1e-15), key=lambda x: x[1])


def _fit_at(rows, recipes, overlap, k, alpha_s, fit_alpha, op_efficiency=None, iterations=30):
    """Best ``(loss, compute, hidden, alpha)`` at a fixed ``k = 1 / efficiency``: per-recipe hinge
    fits, alternated with the least-squares latency ``alpha`` when it is fitted."""
    import numpy as np

    t = np.array([r["step_time_s"] for r in rows])
    w = 1.0 / t**2  # relative error
    x = np.array([8 * effective_wire_bytes(r, op_efficiency) / r["rate_bps"] if r.get("rate_bps") else 0.0
                  for r in rows])
    calls = np.array([float(r.get("calls", 0)) for r in rows])
    share = np.array([float(r.get("overlap_share", 1.0)) for r in rows])
    idx = {name: np.array([i for i, r in enumerate(rows) if r["recipe"] == name]) for name in recipes}
    alpha, compute, hidden = alpha_s, {}, {}
    for it in range(iterations if fit_alpha else 1):
        loss = 0.0
        for name, i in idx.items():
            fixed = alpha * calls[i] + (1 - share[i]) * k * x[i]  # latency and the link time after compute
            compute[name], hidden[name], part = _hinge_fit(t[i] - fixed, share[i] * k * x[i], w[i], name in overlap)
            loss += part
        if not fit_alpha or it == iterations - 1:  # (loss, compute, hidden) belong to this alpha
            break
        excess = np.array([max(0.0, share[j] * k * x[j] - hidden[r["recipe"]]) + (1 - share[j]) * k * x[j]
                           for j, r in enumerate(rows)])
        A = np.zeros((len(rows), len(recipes) + 1))
        for col, name in enumerate(recipes):
            A[idx[name], col] = 1.0
        A[:, -1] = calls
        sw = np.sqrt(w)
        sol, *_ = np.linalg.lstsq(A * sw[:, None], (t - excess) * sw, rcond=None)
        new_alpha = max(0.0, float(sol[-1]))
        if abs(new_alpha - alpha) <= 1e-12 + 1e-9 * abs(alpha):
            break
        alpha = new_alpha
    return loss, dict(compute), dict(hidden), alpha


def _paired_hidden_fit(d, u, v, w, overlaps: bool, upper: float) -> tuple[float, float]:
    """``(hidden, loss)`` of ``d ~ max(0, u - hidden) - max(0, v - hidden)`` for one recipe's paired
    rows (``d``: step minus paired step, ``u`` / ``v``: link seconds at the row's / the paired
    rate), ``0 <= hidden <= upper`` (0 unless ``overlaps``). Between consecutive knots (the ``u``
    and ``v``) every term is linear in ``hidden``, so the minimum is a knot or an interval's
    closed-form least-squares point; ties go to the smallest ``hidden``."""
    import numpy as np

    def loss(h: float) -> float:
        return float(np.sum(w * (d - np.maximum(0.0, u - h) + np.maximum(0.0, v - h)) ** 2))

    if not overlaps:
        return 0.0, loss(0.0)
    knots = np.unique(np.clip(np.concatenate([[0.0, upper], u, v]), 0.0, upper))
    cands = list(knots)
    for a, b in zip(knots[:-1], knots[1:]):
        mid = (a + b) / 2
        slope = (u > mid).astype(float) - (v > mid)  # d(excess)/d(hidden) = -slope
        offset = np.where(u > mid, u, 0.0) - np.where(v > mid, v, 0.0)
        denom = float(np.sum(w * slope**2))
        if denom > 0:
            cands.append(float(np.clip(np.sum(w * slope * (offset - d)) / denom, a, b)))
    scored = [(loss(h), h) for h in cands]
    best = min(x[0] for x in scored)
    return float(min(h for x, h in scored if x <= best * (1 + 1e-9) + 1e-15)), best


def _paired_fit_at(rows, recipes, overlap, k, op_efficiency=None):
    """Best ``(loss, compute, hidden)`` of paired rows at ``k = 1 / efficiency``; compute is the
    median over a recipe's rows of its paired step less that step's unhidden link time."""
    import numpy as np

    t = np.array([r["step_time_s"] for r in rows])
    d = t - np.array([r["paired_step_s"] for r in rows])
    wire = [effective_wire_bytes(r, op_efficiency) for r in rows]
    u = np.array([k * 8 * b / r["rate_bps"] if r.get("rate_bps") else 0.0 for b, r in zip(wire, rows)])
    v = np.array([k * 8 * b / r["paired_rate_bps"] if r.get("paired_rate_bps") else 0.0 for b, r in zip(wire, rows)])
    w = 1.0 / t**2  # relative error of the step
    loss, compute, hidden = 0.0, {}, {}
    for name in recipes:
        i = np.array([j for j, r in enumerate(rows) if r["recipe"] == name])
        upper = float(np.min(t[i] - d[i]))  # hidden <= compute <= the paired step
        hidden[name], part = _paired_hidden_fit(d[i], u[i], v[i], w[i], name in overlap, upper)
        compute[name] = float(np.median(t[i] - d[i] - np.maximum(0.0, v[i] - hidden[name])))
        loss += part
    return loss, compute, hidden


def _search_efficiency(loss) -> float:
    """``k = 1 / efficiency`` minimizing ``loss(log k)``: a coarse log grid, then golden section."""
    import numpy as np

    grid = np.linspace(math.log(0.05), math.log(20.0), 97)
    losses = [loss(g) for g in grid]
    best = int(np.argmin(losses))
    lo, hi = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]
    golden = (math.sqrt(5) - 1) / 2
    a, b = hi - golden * (hi - lo), lo + golden * (hi - lo)
    fa, fb = loss(a), loss(b)
    for _ in range(60):
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = hi - golden * (hi - lo)
            fa = loss(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + golden * (hi - lo)
            fb = loss(b)
    return math.exp((lo + hi) / 2)


def fit_step_model(rows: list[dict], *, alpha_s: float = 0.0, overlap=(),
                   op_efficiency: dict[str, float] | None = None) -> StepModel:
    """Weighted least-squares fit of :class:`StepModel` to measured rows.

    Each row: ``recipe``, ``step_time_s``, ``wire_bytes`` (per step, on the busiest link),
    ``rate_bps`` (None or 0: unshaped, no link term) and optionally ``calls`` (collective calls a
    step), ``overlap_share`` (the share of the link time that may run under compute, default 1;
    constant within a recipe) and ``wire_bytes_by_op`` (``wire_bytes`` split by collective).
    ``overlap``: the recipes whose communication runs under compute (a ``hidden`` is fitted
    for them; the others get 0). ``op_efficiency``: each collective's share of the link's rate,
    measured apart (every row then needs ``wire_bytes_by_op``; see the module docstring); the
    fitted ``efficiency`` multiplies them. None: one efficiency for every collective, and
    ``wire_bytes_by_op`` is not read. Rows are weighted by ``1 / step_time_s``, so the fit minimizes
    relative error. The efficiency is found by a one-dimensional search (a coarse log grid, then
    golden-section refinement); at a fixed efficiency each recipe's compute and hidden time are an
    exact piecewise-quadratic minimum (:func:`_hinge_fit`). Latency is only separable from compute
    when the number of calls varies within a recipe (e.g. across message sizes or delays); then
    it is fitted by alternating with the hinge fits, otherwise ``alpha_s`` is kept at the value
    given and reported as not fitted.

    Paired rows (every row with ``paired_step_s`` and ``paired_rate_bps``: the same recipe's step
    measured next to it, see the module docstring) fit only ``efficiency`` and ``hidden`` to the
    link's excess over the paired step (:func:`_paired_hidden_fit`); unshaped rows whose pair is
    also unshaped carry no information and may be left out.
    """
    recipes = sorted({r["recipe"] for r in rows})
    op_efficiency = None if op_efficiency is None else dict(op_efficiency)
    if not any(r.get("rate_bps") and r["wire_bytes"] for r in rows):
        raise ValueError("fit_step_model: no row has a shaped rate, so the bandwidth term cannot be fitted")
    overlap = set(overlap)
    paired = [r.get("paired_step_s") is not None for r in rows]
    if any(paired):
        if not all(paired):
            raise ValueError("fit_step_model: either every row carries paired_step_s or none does")
        if alpha_s:
            raise ValueError("fit_step_model: paired rows cancel a per-call latency (the pair makes the same "
                             "calls); fit them with alpha_s=0")
        k = _search_efficiency(lambda log_k: _paired_fit_at(rows, recipes, overlap, math.exp(log_k), op_efficiency)[0])
        _, compute, hidden = _paired_fit_at(rows, recipes, overlap, k, op_efficiency)
        return StepModel(compute_s=compute, alpha_s=0.0, efficiency=1.0 / k, alpha_fitted=False, hidden_s=hidden,
                         op_efficiency=op_efficiency)
    fit_alpha = any(len({r.get("calls", 0) for r in rows if r["recipe"] == k}) > 1 for k in recipes)
    k = _search_efficiency(lambda log_k: _fit_at(rows, recipes, overlap, math.exp(log_k), alpha_s, fit_alpha,
                                                 op_efficiency)[0])
    _, compute, hidden, alpha = _fit_at(rows, recipes, overlap, k, alpha_s, fit_alpha, op_efficiency)
    return StepModel(compute_s=compute, alpha_s=alpha, efficiency=1.0 / k, alpha_fitted=fit_alpha, hidden_s=hidden,
                     op_efficiency=op_efficiency)


def _scored(model: StepModel, row: dict) -> dict:
    pred = model.predict(row)
    return {"recipe": row["recipe"], "rate": row.get("rate"), "measured_s": row["step_time_s"], "predicted_s": pred,
            "error": pred / row["step_time_s"] - 1, "comm_share_model": model.comm_s(row) / pred}


def held_out_check(rows: list[dict], held_out, **fit_kwargs) -> dict:
    """Fit :func:`fit_step_model` on the rows for which ``held_out(row)`` is false, predict the others.

    Returns ``{"model", "fit": [...], "held_out": [...], "mean_abs_error", "max_abs_error"}``; each
    entry of ``fit`` / ``held_out``: recipe, rate, measured_s, predicted_s, error (predicted /
    measured - 1), comm_share_model; the two error figures are over the held-out rows.
    """
    fit_rows = [r for r in rows if not held_out(r)]
    test_rows = [r for r in rows if held_out(r)]
    if not test_rows:
        raise ValueError("held_out_check: no row is held out")
    unseen = {r["recipe"] for r in test_rows} - {r["recipe"] for r in fit_rows}
    if unseen:
        raise ValueError(f"held_out_check: recipes {sorted(unseen)} have no row left to fit their compute")
    model = fit_step_model(fit_rows, **fit_kwargs)
    held = [_scored(model, r) for r in test_rows]
    errors = [abs(p["error"]) for p in held]
    return {"model": model, "fit": [_scored(model, r) for r in fit_rows], "held_out": held,
            "mean_abs_error": sum(errors) / len(errors), "max_abs_error": max(errors)}


__all__ = ["StepModel", "effective_wire_bytes", "estimate_time", "fit_step_model", "held_out_check"]

"""An alpha-beta model of communication time: measured bytes in, estimated seconds out.

    t = sum over scopes s of  calls_s * alpha_s  +  bytes_s / bandwidth_s

``bytes_s`` are the bytes one rank sends in scope ``s`` (what :class:`leantrain.runtime.ledger.CommLedger`
records; per-rank, NCCL "bus bandwidth" convention), so ``bandwidth_s`` is the per-GPU link
bandwidth: NVLink inside a node (``intra``, default 450 GB/s per direction on H100/H200), the
NIC across nodes (``inter``, default 25 GB/s = 200 Gb/s per GPU). A collective over the whole
data-parallel group (``world``) spanning several nodes runs at the NIC's rate (a ring's
slowest links cross nodes; NCCL's multi-node bus bandwidth is the NIC's); on one node it runs
at the intra rate. Hops are assumed not to overlap one another (an upper bound); overlap with
compute is not modelled.

:func:`fit_step_model` calibrates a whole step against measurements (the namespace cluster of
``benchmarks/cluster/``):

    t(recipe, R) = compute_recipe + alpha * calls + 8 * wire_bytes / (efficiency * R)

``wire_bytes`` are the bytes per step on the busiest shaped link, ``R`` its rate in bit/s,
``compute_recipe`` the step with an unlimited link (the model's compute plus the technique's
compression kernels: the difference between a recipe and its uncompressed reference is the
kernels' cost), ``efficiency`` the share of the nominal rate a collective achieves (TCP/IP
headers, protocol gaps), ``alpha`` the latency per collective call.
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass
class StepModel:
    """A fitted step-time model (see the module docstring); ``predict`` takes a measurement row."""

    compute_s: dict[str, float]
    alpha_s: float
    efficiency: float
    alpha_fitted: bool = True

    def comm_s(self, row: dict) -> float:
        rate = row.get("rate_bps")
        bw = 0.0 if not rate else 8 * row["wire_bytes"] / (self.efficiency * rate)
        return self.alpha_s * row.get("calls", 0) + bw

    def predict(self, row: dict) -> float:
        return self.compute_s[row["recipe"]] + self.comm_s(row)


def fit_step_model(rows: list[dict], *, alpha_s: float = 0.0) -> StepModel:
    """Least-squares fit of :class:`StepModel` to measured rows.

    Each row: ``recipe``, ``step_time_s``, ``wire_bytes`` (per step, on the busiest link),
    ``rate_bps`` (None or 0: unshaped, no bandwidth term) and optionally ``calls`` (collective
    calls a step). The fit is linear in (compute per recipe, alpha, 1 / efficiency). Latency is
    only separable from compute when the number of calls varies within a recipe (e.g. across
    message sizes or delays); otherwise ``alpha_s`` is kept at the value given and reported as
    not fitted. Rows are weighted by ``1 / step_time_s``, so the fit minimizes relative error.
    """
    import numpy as np

    recipes = sorted({r["recipe"] for r in rows})
    calls_vary = any(len({r.get("calls", 0) for r in rows if r["recipe"] == k}) > 1 for k in recipes)
    cols = len(recipes) + 1 + (1 if calls_vary else 0)
    A, b = np.zeros((len(rows), cols)), np.zeros(len(rows))
    for i, r in enumerate(rows):
        w = 1.0 / r["step_time_s"]
        A[i, recipes.index(r["recipe"])] = w
        rate = r.get("rate_bps")
        A[i, len(recipes)] = w * (8 * r["wire_bytes"] / rate if rate else 0.0)
        known = 0.0 if calls_vary else alpha_s * r.get("calls", 0)
        if calls_vary:
            A[i, len(recipes) + 1] = w * r.get("calls", 0)
        b[i] = w * (r["step_time_s"] - known)
    if not A[:, len(recipes)].any():
        raise ValueError("fit_step_model: no row has a shaped rate, so the bandwidth term cannot be fitted")
    x, *_ = np.linalg.lstsq(A, b, rcond=None)
    return StepModel(compute_s={k: float(x[i]) for i, k in enumerate(recipes)},
                     alpha_s=float(x[-1]) if calls_vary else alpha_s,
                     efficiency=float(1.0 / x[len(recipes)]), alpha_fitted=calls_vary)


__all__ = ["StepModel", "estimate_time", "fit_step_model"]

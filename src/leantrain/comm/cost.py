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
"""

from __future__ import annotations

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


__all__ = ["estimate_time"]

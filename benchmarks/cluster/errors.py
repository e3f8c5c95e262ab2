"""Where the cost model's held-out error comes from: the measurement's noise or the model's form.

    python benchmarks/cluster/cluster.py project <sweep>.json    # the projection's "Error sources" section

Taken from the leave-one-rate-out predictions (``calibrate.leave_one_rate_out``: every shaped point
predicted by a model that did not see its rate):

- by regime: the errors of the points the model puts mostly on the link (``link-bound``), mostly on
  compute (``compute-bound``) and between. A wrong link term (bytes, efficiency, a missing per-byte or
  per-call cost) shows on the link-bound points; compute noise on the compute-bound ones.
- correlations: Pearson's r of each point's signed and absolute error with what a missing term
  would scale with (link share, log rate, log wire bytes, collective calls when the sweep recorded
  them) and with what measures the host's noise (the spread of the point's own timed steps, the
  host's load, the drift of the paired reference and other work's cores when the sweep has them).
- the compute's own noise: the timed steps' spread within a run, and, among the compute-bound
  points (the replaced runs included), how a step over its recipe's fitted compute moves with the
  host's load.
"""

from __future__ import annotations

import math
import statistics

# a point is compute-bound when the model puts less than this share of its step on the link
COMPUTE_BOUND_SHARE = 0.05
LINK_BOUND_SHARE = 0.5
# the standard error of a median over n samples from a normal distribution is about this times sigma / sqrt(n)
MEDIAN_SE_FACTOR = math.sqrt(math.pi / 2)


def _pearson(x: list[float], y: list[float]) -> float | None:
    if len(x) < 3 or statistics.pstdev(x) == 0 or statistics.pstdev(y) == 0:
        return None
    return statistics.correlation(x, y)


def _spread(times: list[float]) -> float:
    return statistics.pstdev(times) / statistics.fmean(times) if len(times) > 1 else 0.0


def _summary(errors: list[float]) -> dict:
    a = [abs(e) for e in errors]
    return {"points": len(a), "mean_abs_error": statistics.fmean(a) if a else None, "max_abs_error": max(a, default=None)}


def features(p: dict, q: dict, doc: dict) -> dict:
    """What a point's error may scale with: ``p`` the sweep's point, ``q`` its prediction."""
    recipe_loads = [x["loadavg"][0] for x in doc["points"] if x["recipe"] == p["recipe"] and x["rate"] != p["rate"]]
    f = {"link share (model)": q["comm_share_model"], "log rate": math.log(p["rate_bps"]),
         "log wire bytes": math.log(max(p["wire_tx_bytes_per_step"])),
         "spread of the point's timed steps": _spread(p["step_times_s"]),
         "host load (1 min)": p["loadavg"][0],
         "host load minus its recipe's other points'": p["loadavg"][0] - statistics.fmean(recipe_loads)}
    calls = p.get("ledger_calls_per_step")
    if calls:
        f["collective calls a step"] = sum(calls.values())
    if "paired_drift" in p:
        f["drift of the paired reference"] = p["paired_drift"]
    if p.get("other_cpu_cores") is not None:
        f["other work's cores"] = p["other_cpu_cores"]
    return f


def _plain_row(p: dict) -> dict:
    return {"recipe": p["recipe"], "rate_bps": p["rate_bps"], "wire_bytes": max(p["wire_tx_bytes_per_step"])}


def compute_vs_load(doc: dict, model, row_of=_plain_row) -> dict:
    """Among the compute-bound points (the replaced runs included), r and the slope of
    ``log(step / the recipe's fitted compute)`` against the host's 1-minute load; ``row_of``: a
    point as the model's row (``calibrate.point_row`` for the model's variant)."""
    x, y = [], []
    for p in doc["points"] + doc.get("replaced_points", []):
        if p["recipe"] not in model.compute_s:
            continue
        row = dict(row_of(p), paired_step_s=None)
        if model.comm_s(row) / model.predict(row) < COMPUTE_BOUND_SHARE:
            x.append(p["loadavg"][0])
            y.append(math.log(p["step_time_s"] / model.compute_s[p["recipe"]]))
    r = _pearson(x, y)
    slope = None
    if r is not None:
        mx, my = statistics.fmean(x), statistics.fmean(y)
        slope = sum((a - mx) * (b - my) for a, b in zip(x, y)) / sum((a - mx) ** 2 for a in x)
    return {"points": len(x), "r": r, "log_step_per_load": slope}


def error_sources(doc: dict, cv: dict, model, row_of=_plain_row) -> dict:
    """The analysis (see the module docstring); ``cv``: ``calibrate.leave_one_rate_out(doc)``,
    ``model``: the model fitted on every point but the held-out rates, ``row_of``: a point as its row."""
    by_key = {(p["recipe"], p["rate"]): p for p in doc["points"]}
    pairs = [(by_key[(q["recipe"], q["rate"])], q) for q in cv["points"]]
    regimes = {"link-bound": lambda s: s >= LINK_BOUND_SHARE,
               "between": lambda s: COMPUTE_BOUND_SHARE <= s < LINK_BOUND_SHARE,
               "compute-bound": lambda s: s < COMPUTE_BOUND_SHARE}
    by_regime = {k: _summary([q["error"] for _, q in pairs if test(q["comm_share_model"])]) for k, test in regimes.items()}
    feats = [features(p, q, doc) for p, q in pairs]
    errors = [q["error"] for _, q in pairs]
    correlations = {}
    for name in feats[0] if feats else []:
        x = [f[name] for f in feats if name in f]
        if len(x) == len(errors):
            correlations[name] = {"r_error": _pearson(x, errors), "r_abs_error": _pearson(x, [abs(e) for e in errors])}
    spreads = [_spread(p["step_times_s"]) for p in doc["points"]]
    se = [MEDIAN_SE_FACTOR * _spread(p["step_times_s"]) / math.sqrt(len(p["step_times_s"])) for p in doc["points"]]
    return {"by_regime": by_regime, "correlations": correlations,
            "within_run_spread": {"median": statistics.median(spreads), "max": max(spreads),
                                  "median_se_of_median": statistics.median(se)},
            "compute_vs_load": compute_vs_load(doc, model, row_of),
            "calls_recorded": any(p.get("ledger_calls_per_step") for p in doc["points"])}


def _r(x) -> str:
    return "–" if x is None else f"{x:+.2f}"


def _pct(x) -> str:
    return "–" if x is None else f"{x:.1%}"


def markdown(es: dict) -> list[str]:
    reg = es["by_regime"]
    L = ["## Error sources", "",
         "Leave-one-rate-out errors by regime (the model's share of the step on the link: link-bound "
         f"≥ {LINK_BOUND_SHARE:.0%}, compute-bound < {COMPUTE_BOUND_SHARE:.0%}):", "",
         "| regime | points | mean abs error | max abs error |", "|---|---|---|---|"]
    L += [f"| {k} | {v['points']} | {_pct(v['mean_abs_error'])} | {_pct(v['max_abs_error'])} |" for k, v in reg.items()]
    L += ["", "Correlation (Pearson r) of each point's error with what a missing model term would scale with, "
          "and with the measurement's noise:", "", "| quantity | r with error | r with abs error |", "|---|---|---|"]
    L += [f"| {k} | {_r(v['r_error'])} | {_r(v['r_abs_error'])} |" for k, v in es["correlations"].items()]
    w, cl = es["within_run_spread"], es["compute_vs_load"]
    L += ["", f"Within a run, the timed steps spread by a median {w['median']:.1%} (coefficient of variation; "
          f"max {w['max']:.1%}), so a point's median alone is uncertain by about {w['median_se_of_median']:.1%} "
          "(its standard error)."]
    if cl["r"] is not None:
        L.append(f"Compute-bound points ({cl['points']}, the replaced runs included): log(step / the recipe's fitted "
                 f"compute) against the host's 1-minute load has r = {cl['r']:+.2f}, "
                 f"{math.expm1(cl['log_step_per_load']):+.1%} a step per unit of load.")
    if not es["calls_recorded"]:
        L.append("The sweep did not record collective calls a step; a recipe's calls do not change with the rate, "
                 "so a per-call latency would be part of its fitted compute either way.")
    return L + [""]

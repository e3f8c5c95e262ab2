"""The cost model fitted to a cluster sweep and checked on points it was not fitted to.

    python benchmarks/cluster/cluster.py project benchmarks/results/comm-cluster/<date>_cpu-netns.json \
        [--collectives benchmarks/results/comm-cluster/<date>_cpu-netns_collectives.json]

Model (:func:`leantrain.comm.cost.fit_step_model`): a step is the recipe's compute (its step with
an unlimited link, compression kernels included) plus the link time ``8 * wire_bytes / (efficiency
* rate)`` that exceeds the compute the recipe's communication runs under (``hidden``; 0 for the
recipes whose trainer sends after backward). ``wire_bytes`` is the busiest node's veth bytes a step
in the timed window (steady state: SCAPE's dense first step is outside it). One ``efficiency`` for
every recipe; ``compute`` and ``hidden`` per recipe. The "hinge-per-collective" model (``--collectives``:
a ``cluster.py collectives`` result, read by ``collectives.per_op``) splits a point's wire bytes by
collective (:func:`wire_split`: the recipe's steady ledger bytes per collective times the collective's
measured wire/ledger) and divides each collective's bytes by its efficiency measured alone, the mean
over the result's rates and sizes; the fitted ``efficiency`` is then what is left over them.

Checks, each on real points the fit did not see:

- the split: every point at the held-out rates (default 300 Mbit/s, inside the fitted range, and
  30 Mbit/s, below it) is predicted by a model fitted on all the others;
- leave one rate out: for each shaped rate in turn, its points are predicted by a model fitted on
  every other rate (the unshaped points are always fitted: they are the only ones that show a
  recipe's compute alone).

A paired sweep (``phases.py``: each rate measured in the same run as, and between, two phases at
the unlimited link) is fitted on the link's excess over the pair (``paired_step_s``), and each
prediction starts from the point's own pair; its unshaped points are those pairs.

The sweep has one layout (its nodes x ranks), so errors are broken down by recipe and rate only.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
from leantrain.comm.cost import held_out_check  # noqa: E402
from leantrain.config import preset  # noqa: E402

# the recipes whose collectives the trainer launches during backward (DDP's bucket hooks, the
# sharded optimizer's reduce-scatter hooks: see leantrain.parallel.sharded), so their transfers run
# under compute; GIFT reduces every gradient after backward, so it gets no hidden time
NO_OVERLAP_METHODS = ("gift",)
# the flag that names a recipe's communication method (the older sweeps recorded --dist.comm)
METHOD_FLAGS = ("--comm.method", "--dist.comm")
# the collectives the trainer launches during backward, by data-parallel mode (the rest run after it):
# DDP's bucket hooks send everything (the int8 hook: an all-to-all and an all-gather); the sharded
# optimizer's hooks send the gradients' reduce-scatter (SDP4Bit's: an all-to-all) and its step() the
# weights' all-gather (SCAPE's mask all-gather, which overlaps the next step, is counted with the
# weights: a small overestimate). A method in NO_OVERLAP_METHODS (GIFT) sends nothing during backward.
GRADIENT_OPS = {"ddp": "*", "sharded": ("reduce_scatter", "all_to_all")}
# a point is "link-bound" when the model puts at least this share of its step on the link
LINK_BOUND_SHARE = 0.5


def _flag(flags: list[str], names: tuple[str, ...], default: str) -> str:
    return next((flags[i + 1] for i, f in enumerate(flags[:-1]) if f in names), default)


def overlapped_recipes(doc: dict) -> list[str]:
    """The sweep's recipes whose communication can run under backward (see NO_OVERLAP_METHODS)."""
    return [name for name, flags in doc["recipes"].items()
            if _flag(flags, METHOD_FLAGS, "none") not in NO_OVERLAP_METHODS]


def gradient_ops(doc: dict, recipe: str):
    """The collectives ``recipe``'s trainer launches during backward ("*": all), from its flags."""
    flags = doc["recipes"][recipe]
    if _flag(flags, METHOD_FLAGS, "none") in NO_OVERLAP_METHODS:
        return ()
    mode = _flag(flags, ("--dist.mode",), "ddp")
    if mode not in GRADIENT_OPS:
        raise SystemExit(f"project: no overlap rule for --dist.mode {mode!r} (recipe {recipe}); add it to GRADIENT_OPS")
    return GRADIENT_OPS[mode]


def steady_bytes_per_param(doc: dict, recipe: str, key: str = "ledger_by_scope_per_step") -> dict:
    """Per-rank bytes a step per parameter by scope (or by op, ``key="ledger_by_op_per_step"``),
    from the ledger (the bus-bandwidth convention of a real reduce-scatter / all-gather, not
    gloo's: see the sweep's wire/ledger column), in the steady state: SCAPE's first
    ``comm.scape.dense_steps`` steps send what its dense reference sends, and are taken out of the
    ledger's average over the run."""
    p = next(q for q in doc["points"] if q["recipe"] == recipe)
    s = dict(p[key])
    if "scape" in " ".join(doc["recipes"][recipe]):
        dense = preset("small").comm.scape.dense_steps
        ref = next(q for q in doc["points"] if q["recipe"] == doc["reference"][recipe])[key]
        n = p["steps"]
        s = {k: max(0.0, (v * n - dense * ref.get(k, 0.0)) / (n - dense)) for k, v in s.items()}
    return {k: v / p["parameters"] for k, v in s.items()}


def bytes_by_path(doc: dict, recipe: str) -> dict:
    """``{"backward": by scope, "after": by scope}``: the steady bytes per parameter of the
    collectives launched during backward (GRADIENT_OPS) and of the rest. The ``intra`` and
    ``inter`` scopes are SDP4Bit's hierarchical all-to-all (its gradient path); ``world`` is split
    by the ops' bytes."""
    scope = steady_bytes_per_param(doc, recipe)
    by_op = steady_bytes_per_param(doc, recipe, "ledger_by_op_per_step")
    ops = gradient_ops(doc, recipe)
    grad = sum(v for k, v in by_op.items() if ops == "*" or k in ops)
    hier = scope.get("intra", 0.0) + scope.get("inter", 0.0)
    grad_world = min(max(0.0, grad - hier), scope.get("world", 0.0))
    backward = {"world": grad_world, **({k: scope[k] for k in ("intra", "inter") if k in scope} if grad else {})}
    after = {"world": scope.get("world", 0.0) - grad_world,
             **({} if grad else {k: scope[k] for k in ("intra", "inter") if k in scope})}
    return {"backward": backward, "after": after}


def overlap_share(doc: dict, recipe: str) -> float:
    """The share of ``recipe``'s bytes on the nodes' links sent by collectives launched during
    backward (the ledger's steady bytes; ``world`` and ``inter`` scopes cross the link, ``intra``
    stays on a node's loopback)."""
    paths = bytes_by_path(doc, recipe)
    wire = {k: v.get("world", 0.0) + v.get("inter", 0.0) for k, v in paths.items()}
    total = wire["backward"] + wire["after"]
    return wire["backward"] / total if total else 0.0


# the models compared (fit_step_model's options): the projection uses "hinge", or "hinge-per-collective"
# when the collectives' own efficiencies were measured (collectives.py; `project --collectives`)
VARIANTS = {
    "flat": "no overlap: step = compute + link time (one line through both regimes)",
    "hinge": "the recipe's whole link time may run under compute (hidden); GIFT none",
    "hinge-backward-ops": "only the bytes of the collectives launched during backward may (overlap_share); GIFT none",
    "hinge-per-collective": "hinge, each collective's wire bytes at its own measured efficiency (collectives.py)",
}
PER_COLLECTIVE = "hinge-per-collective"


def wire_split(doc: dict, recipe: str, wire_per_ledger: dict) -> dict:
    """The shares of ``recipe``'s wire bytes by collective: its steady ledger bytes by op
    (:func:`steady_bytes_per_param`) times each op's measured wire bytes per ledger byte
    (``wire_per_ledger``, from ``collectives.per_op``: gloo's reduce-scatter sends twice the ring's)."""
    by_op = steady_bytes_per_param(doc, recipe, "ledger_by_op_per_step")
    unknown = sorted(op for op, b in by_op.items() if b and op not in wire_per_ledger)
    if unknown:
        raise SystemExit(f"calibrate: the collectives result has no {unknown} (recipe {recipe} sends through them)")
    wire = {op: b * wire_per_ledger[op] for op, b in by_op.items() if b}
    total = sum(wire.values())
    return {op: b / total for op, b in wire.items()}


def is_paired(doc: dict) -> bool:
    """Whether the sweep measured each rate next to its recipe's unlimited link (``phases.py``)."""
    return any("paired_step_s" in p for p in doc["points"])


def point_row(doc: dict, p: dict, variant: str = "hinge", collectives: dict | None = None) -> dict:
    """One point as a :func:`leantrain.comm.cost.fit_step_model` row for ``variant`` (``collectives``:
    ``collectives.per_op`` of a collectives result, which "hinge-per-collective" needs)."""
    row = {"recipe": p["recipe"], "rate": p["rate"], "rate_bps": p["rate_bps"], "step_time_s": p["step_time_s"],
           "wire_bytes": max(p["wire_tx_bytes_per_step"])}
    if "paired_step_s" in p:
        row |= {"paired_step_s": p["paired_step_s"], "paired_rate_bps": p["paired_rate_bps"]}
    if variant == "hinge-backward-ops":
        row["overlap_share"] = overlap_share(doc, p["recipe"])
    if variant == PER_COLLECTIVE:
        split = wire_split(doc, p["recipe"], _need(collectives)["wire_per_ledger"])
        row["wire_bytes_by_op"] = {op: row["wire_bytes"] * share for op, share in split.items()}
    return row


def _need(collectives: dict | None) -> dict:
    if collectives is None:
        raise SystemExit(f"calibrate: the {PER_COLLECTIVE} model needs a collectives result (--collectives FILE, "
                         "from `cluster.py collectives`)")
    return collectives


def rows_of(doc: dict, variant: str = "hinge", collectives: dict | None = None) -> list[dict]:
    """The sweep's points as :func:`leantrain.comm.cost.fit_step_model` rows for ``variant``; a
    paired sweep's shaped points carry their pair (its unshaped points are the pairs, not rows)."""
    paired = is_paired(doc)
    return [point_row(doc, p, variant, collectives) for p in doc["points"] if not (paired and not p["rate_bps"])]


def _fit_options(doc: dict, variant: str, collectives: dict | None = None) -> dict:
    if variant not in VARIANTS:
        raise SystemExit(f"project: unknown model {variant!r}; choose from {sorted(VARIANTS)}")
    opts = {"overlap": [] if variant == "flat" else overlapped_recipes(doc)}
    if variant == PER_COLLECTIVE:
        opts["op_efficiency"] = _need(collectives)["efficiency"]
    return opts


def _summary(points: list[dict]) -> dict:
    errors = [abs(p["error"]) for p in points]
    if not errors:
        return {"points": 0, "mean_abs_error": None, "max_abs_error": None}
    return {"points": len(errors), "mean_abs_error": statistics.fmean(errors), "max_abs_error": max(errors)}


def fit_and_check(doc: dict, holdout: str, variant: str = "hinge", collectives: dict | None = None) -> dict:
    """The fit on every rate but ``holdout`` (comma list) and its errors on the held-out points."""
    rows = rows_of(doc, variant, collectives)
    held = set(holdout.split(","))
    missing = held - {r["rate"] for r in rows}
    if missing:
        raise SystemExit(f"project: the sweep has no points at {sorted(missing)}; its rates: "
                         f"{sorted({r['rate'] for r in rows})}")
    opts = _fit_options(doc, variant, collectives)
    res = held_out_check(rows, lambda r: r["rate"] in held, **opts)
    m, ref = res["model"], doc["reference"]
    return {"model": m, "variant": variant, "fit": res["fit"], "held_out": res["held_out"], "holdout_rate": holdout,
            "overlap": opts["overlap"], "summary": _summary(res["held_out"]),
            "link_bound": _summary([p for p in res["held_out"] if p["comm_share_model"] >= LINK_BOUND_SHARE]),
            "kernel_overhead_s": {k: v - m.compute_s[ref[k]] for k, v in m.compute_s.items()
                                  if ref.get(k) in m.compute_s and ref[k] != k}}


def leave_one_rate_out(doc: dict, variant: str = "hinge", collectives: dict | None = None) -> dict:
    """Every shaped point predicted by a model fitted without its rate; errors overall, by recipe
    and by rate."""
    rows = rows_of(doc, variant, collectives)
    opts = _fit_options(doc, variant, collectives)
    points, efficiency = [], {}
    for rate in dict.fromkeys(r["rate"] for r in rows if r["rate_bps"]):
        res = held_out_check(rows, lambda r, rate=rate: r["rate"] == rate, **opts)
        points += res["held_out"]
        efficiency[rate] = res["model"].efficiency
    by_recipe = {k: _summary([p for p in points if p["recipe"] == k]) for k in dict.fromkeys(p["recipe"] for p in points)}
    by_rate = {k: _summary([p for p in points if p["rate"] == k]) for k in dict.fromkeys(p["rate"] for p in points)}
    return {"points": points, "summary": _summary(points), "by_recipe": by_recipe, "by_rate": by_rate,
            "efficiency_by_held_out_rate": efficiency,
            "link_bound": _summary([p for p in points if p["comm_share_model"] >= LINK_BOUND_SHARE])}


def validate_on(doc: dict, other: dict, variant: str = "hinge", collectives: dict | None = None) -> dict:
    """A model fitted on every point of ``doc`` predicts every point of ``other`` (another sweep of the
    same grid: a later day, other rates); errors per point, overall and on the link-bound ones."""
    opts = _fit_options(doc, variant, collectives)
    known = set(doc["recipes"])
    rows = rows_of(doc, variant, collectives) + [dict(r, new=True) for r in rows_of(other, variant, collectives)
                                                 if r["recipe"] in known]
    res = held_out_check(rows, lambda r: r.get("new", False), **opts)
    return {"source": other.get("command"), "date": other["environment"]["date"], "points": res["held_out"],
            "summary": _summary(res["held_out"]), "efficiency": res["model"].efficiency,
            "link_bound": _summary([p for p in res["held_out"] if p["comm_share_model"] >= LINK_BOUND_SHARE])}


def compare_models(doc: dict, holdout: str, collectives: dict | None = None) -> list[dict]:
    """Each of VARIANTS on the same two checks: held-out and leave-one-rate-out errors ("hinge-per-
    collective" only with ``collectives``)."""
    out = []
    for variant, what in VARIANTS.items():
        if variant == PER_COLLECTIVE and collectives is None:
            continue
        fc, cv = fit_and_check(doc, holdout, variant, collectives), leave_one_rate_out(doc, variant, collectives)
        out.append({"variant": variant, "description": what, "efficiency": fc["model"].efficiency,
                    "held_out": fc["summary"], "held_out_link_bound": fc["link_bound"],
                    "leave_one_rate_out": cv["summary"], "leave_one_rate_out_link_bound": cv["link_bound"]})
    return out


def compute_spread(doc: dict, fc: dict) -> dict:
    """Per recipe, the measured steps of the points the fitted model puts less than 5 % on the link
    (all fitted and held-out points): how much the compute alone moved between runs on this shared
    host, a floor under any model's error on them."""
    out = {}
    for p in fc["fit"] + fc["held_out"]:
        if p["comm_share_model"] < 0.05:
            out.setdefault(p["recipe"], []).append(p["measured_s"])
    return {k: {"n": len(v), "min_s": min(v), "max_s": max(v), "half_range": (max(v) - min(v)) / (max(v) + min(v))}
            for k, v in out.items() if len(v) > 1}


def repeatability(doc: dict) -> dict:
    """The points the sweep measured twice (``replaced_points``: the same recipe and rate run
    again later): each pair's step times and their difference over their mean. Neither run of a
    pair is a fitted point's substitute; this is the measurement's own noise."""
    now = {(p["recipe"], p["rate"]): p["step_time_s"] for p in doc["points"]}
    pairs = [{"recipe": p["recipe"], "rate": p["rate"], "step_s": now[(p["recipe"], p["rate"])],
              "earlier_step_s": p["step_time_s"]} for p in doc.get("replaced_points", [])
             if (p["recipe"], p["rate"]) in now]
    for q in pairs:
        q["difference"] = abs(q["step_s"] - q["earlier_step_s"]) / ((q["step_s"] + q["earlier_step_s"]) / 2)
    diffs = sorted(q["difference"] for q in pairs)
    return {"pairs": pairs, "median_difference": statistics.median(diffs) if diffs else None,
            "max_difference": diffs[-1] if diffs else None}


def _pct(x) -> str:
    return "–" if x is None else f"{x:.1%}"


def markdown(fit: dict, cv: dict, comparison: list[dict]) -> list[str]:
    """The fit's section of the projection's markdown."""
    m = fit["model"]
    s, lb = fit["summary"], fit["link_bound"]
    if m.op_efficiency:
        link = ("8 x sum over collectives of (wire bytes of the collective / its efficiency) / (efficiency x rate); "
                "each collective's efficiency measured alone on the same links (collectives.py, the mean over rates "
                "and sizes: " + ", ".join(f"{op} {e:.3f}" for op, e in m.op_efficiency.items()) + "), a recipe's "
                "wire bytes split by its ledger bytes per collective times the collective's measured wire/ledger")
        what = "the efficiency left over the collectives' own"
    else:
        link, what = "8 x wire bytes / (efficiency x rate)", "efficiency"
    L = [f"Model ({fit['variant']}): step = compute(recipe) + max(0, link - hidden(recipe)), link = {link} "
         "(leantrain.comm.cost.fit_step_model); hidden = 0 for the recipes whose trainer sends after backward "
         f"({', '.join(r for r in m.compute_s if r not in fit['overlap'])}).",
         f"Fitted on every rate but {fit['holdout_rate']}: {what} {m.efficiency:.3f} of the nominal rate; "
         f"latency {'fitted' if m.alpha_fitted else 'not separable from compute here (no delay sweep, no call counts)'}.",
         "", "| recipe | compute s (unlimited link) | hidden s (link time under compute) | kernels' overhead vs reference s |",
         "|---|---|---|---|"]
    for r, c in m.compute_s.items():
        k = fit["kernel_overhead_s"].get(r)
        L.append(f"| {r} | {c:.3f} | {m.hidden_s.get(r, 0.0):.3f} | {'–' if k is None else f'{k:+.3f}'} |")
    L += ["", f"Held out ({fit['holdout_rate']}): mean |error| {s['mean_abs_error']:.1%}, max {s['max_abs_error']:.1%} "
          f"over {s['points']} points (target 15 %); on the {lb['points']} link-bound ones (model: at least "
          f"{LINK_BOUND_SHARE:.0%} of the step on the link) mean {lb['mean_abs_error']:.1%}, max {lb['max_abs_error']:.1%}.",
          "", "| rate | recipe | measured s | predicted s | error | model's link share |", "|---|---|---|---|---|---|"]
    L += [f"| {p['rate']} | {p['recipe']} | {p['measured_s']:.3f} | {p['predicted_s']:.3f} | {p['error']:+.1%} | "
          f"{p['comm_share_model']:.0%} |" for p in fit["held_out"]]
    fit_errors = [abs(p["error"]) for p in fit["fit"]]
    L += ["", f"On the fitted points: mean |error| {statistics.fmean(fit_errors):.1%}, max {max(fit_errors):.1%}.", ""]
    cs, cl = cv["summary"], cv["link_bound"]
    rates = list(cv["by_rate"])
    L += ["Leave one rate out (each shaped rate predicted by a model fitted on the others): "
          f"mean |error| {cs['mean_abs_error']:.1%}, max {cs['max_abs_error']:.1%} over {cs['points']} points; "
          f"link-bound points mean {cl['mean_abs_error']:.1%}, max {cl['max_abs_error']:.1%}. Efficiency fitted without "
          "each rate: " + ", ".join(f"{k} {v:.3f}" for k, v in cv["efficiency_by_held_out_rate"].items()) + ".", "",
          "| recipe | " + " | ".join(rates) + " | mean | max |", "|---|" + "---|" * (len(rates) + 2)]
    for r, summ in cv["by_recipe"].items():
        cells = {p["rate"]: f"{p['error']:+.1%}" for p in cv["points"] if p["recipe"] == r}
        L.append(f"| {r} | " + " | ".join(cells.get(k, "–") for k in rates) +
                 f" | {summ['mean_abs_error']:.1%} | {summ['max_abs_error']:.1%} |")
    L.append("| mean, max | " + " | ".join(f"{v['mean_abs_error']:.1%}, {v['max_abs_error']:.1%}"
                                           for v in cv["by_rate"].values()) + " | | |")
    spread = fit["compute_spread"]
    L += ["", "Compute alone moved between runs (points with under 5 % of the step on the link, fitted and held out; "
          "the host is shared, see the sweep's load column): "
          + "; ".join(f"{k} {v['min_s']:.2f}-{v['max_s']:.2f} s (±{v['half_range']:.0%}, {v['n']} runs)"
                      for k, v in spread.items()) + ". A point of a recipe whose compute moves by more than 15 % "
          "cannot be predicted within 15 % by any function of the link.", ""]
    L += ["Models compared on the same checks (|error|, mean / max; link-bound: the model puts at least "
          f"{LINK_BOUND_SHARE:.0%} of the step on the link):", "",
          "| model | efficiency | held out | held out, link-bound | leave one rate out | leave one rate out, link-bound |",
          "|---|---|---|---|---|---|"]
    for v in comparison:
        cells = [f"{_pct(v[k]['mean_abs_error'])} / {_pct(v[k]['max_abs_error'])}" for k in
                 ("held_out", "held_out_link_bound", "leave_one_rate_out", "leave_one_rate_out_link_bound")]
        L.append(f"| {v['variant']}: {v['description']} | {v['efficiency']:.3f} | " + " | ".join(cells) + " |")
    L.append("")
    for v in fit.get("validation", []):
        s, lb = v["summary"], v["link_bound"]
        L += [f"Another sweep ({v['date']}, `{v['source']}`) predicted by the model fitted on every point above "
              f"(efficiency {v['efficiency']:.3f}): mean |error| {_pct(s['mean_abs_error'])}, max "
              f"{_pct(s['max_abs_error'])} over {s['points']} points; link-bound mean {_pct(lb['mean_abs_error'])}, "
              f"max {_pct(lb['max_abs_error'])}.", "",
              "| rate | recipe | measured s | predicted s | error | model's link share |", "|---|---|---|---|---|---|"]
        L += [f"| {p['rate']} | {p['recipe']} | {p['measured_s']:.3f} | {p['predicted_s']:.3f} | {p['error']:+.1%} | "
              f"{p['comm_share_model']:.0%} |" for p in v["points"]]
        L.append("")
    rep = fit["repeatability"]
    if rep["pairs"]:
        worst = sorted(rep["pairs"], key=lambda q: -q["difference"])[:4]
        L += [f"Repeatability: {len(rep['pairs'])} points of the sweep were measured twice (its replaced_points, "
              f"the earlier runs under a heavier host load); the two step times differ by a median "
              f"{rep['median_difference']:.0%}, at most {rep['max_difference']:.0%} ("
              + ", ".join(f"{q['recipe']} at {q['rate']} {q['earlier_step_s']:.2f} / {q['step_s']:.2f} s" for q in worst)
              + ").", ""]
    return L

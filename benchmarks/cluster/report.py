"""A cluster sweep's JSON -> its markdown table and its plot of speedup vs link bandwidth.

    python benchmarks/cluster/cluster.py report benchmarks/results/comm-cluster/<date>_cpu-netns.json

Speedup: the step time of the uncompressed run of the same mode and optimizer (the sweep's
``reference`` map) over the technique's, at the same rate. Communication share: (step time at
the rate - step time unshaped) / step time at the rate, the time the link's limit adds.
"""

from __future__ import annotations

import json
from pathlib import Path


def rate_label(bps: float | None) -> str:
    if not bps:
        return "unshaped"
    return f"{bps / 1e9:g} Gbit/s" if bps >= 1e9 else f"{bps / 1e6:g} Mbit/s"


def derive(doc: dict) -> list[dict]:
    """Each point with its speedup, communication share and loss gap to its reference."""
    by = {(p["recipe"], p["rate"]): p for p in doc["points"]}
    out = []
    for p in doc["points"]:
        ref = by.get((doc["reference"][p["recipe"]], p["rate"]))
        base = by.get((p["recipe"], "unshaped"))
        q = dict(p)
        q["speedup"] = ref["step_time_s"] / p["step_time_s"] if ref else None
        # (a local sweep's links are never shaped: nothing to take the link's share from)
        q["comm_share"] = (p["step_time_s"] - base["step_time_s"]) / p["step_time_s"] \
            if base and not doc.get("local") else None
        q["val_gap"] = (p["val_loss"] / ref["val_loss"] - 1) if ref and ref["val_loss"] else None
        tx = p.get("wire_tx_bytes_per_step")
        q["wire_max"] = max(tx) if tx else None
        out.append(q)
    return out


def _fmt(x, spec, none="–"):
    return none if x is None else format(x, spec)


def table(doc: dict) -> str:
    rows = derive(doc)
    recipes = list(doc["recipes"])
    rates = sorted({(p["rate_bps"] or float("inf"), p["rate"]) for p in rows}, reverse=True)
    env = doc["environment"]
    if doc.get("local"):
        where = (f"{env['gpus']} x {env['gpu']}" if doc["backend"] == "nccl" else f"{env['cpus']} CPU cores")
        title = f"# Communication techniques on one host's own links, {doc['backend']} ({env['date']})"
        setup = (f"{doc['ranks_per_node']} ranks under one plain torchrun ({doc['backend']}, the links as they are: "
                 f"nothing shaped, no interface counters), {where}, torch {env['torch']}.")
    else:
        title = f"# Communication techniques on a shaped cluster of namespaces ({env['date']})"
        setup = (f"{doc['nodes']} nodes x {doc['ranks_per_node']} ranks (gloo; one network namespace a node, links "
                 f"shaped by tbf, ranks of a node on its loopback), {env['cpus']} CPU cores, torch {env['torch']}, "
                 f"kernel {env['kernel']}.")
    lines = [
        title,
        "",
        setup + f" Model: `{' '.join(doc['train_args'])}`, {doc['steps']} steps (unless a row says "
        "otherwise), the first not timed.",
        "",
        "Commands: " + ", ".join(f"`{c}`" for c in doc.get("commands", [doc["command"]])),
        "",
        "step: median step time of the timed steps. ledger: bytes one rank sends a step (rank 0's "
        "communication ledger, all steps). "
        + ("wire and comm share: not measured (no interface of its own, no shaped rate to compare). " if doc.get("local")
           else "wire: bytes the busiest node's veth sent a step (steps 3..last, TCP/IP headers included). comm "
                "share: (step - step unshaped) / step. ")
        + "speedup: the uncompressed run "
        "of the same mode and optimizer over this one, at the same rate. val: validation loss after the "
        "last step; gap: against that reference. load: the host's 1-minute load average when the run ended (the "
        "host is shared: other work's CPU demand changes the compute part of a step by tens of percent between "
        "runs, which is what a negative comm share shows).",
        "",
        "| rate | recipe | step s | speedup | ledger MB | wire MB | wire/ledger | comm share | val loss | gap | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for _, rate in rates:
        for r in recipes:
            p = next((q for q in rows if q["recipe"] == r and q["rate"] == rate), None)
            if p is None:
                continue
            ratio = p["wire_max"] / p["ledger_bytes_per_step"] if p["wire_max"] and p["ledger_bytes_per_step"] else None
            sp = _fmt(p["speedup"], ".2f")
            steps_note = f" ({p['steps']} steps)" if p["steps"] != doc["steps"] else ""
            if p["speedup"] is not None and doc["reference"][r] != r:
                sp = f"**{sp}**" if p["speedup"] > 1.05 else sp
            lines.append(
                f"| {rate_label(p['rate_bps'])}{steps_note} | {r} | {p['step_time_s']:.3f} | {sp} | "
                f"{p['ledger_bytes_per_step'] / 1e6:.2f} | {_fmt(p['wire_max'] and p['wire_max'] / 1e6, '.2f')} | "
                f"{_fmt(ratio, '.2f')} | {_fmt(p['comm_share'], '.0%')} | {p['val_loss']:.4f} | "
                f"{_fmt(p['val_gap'], '+.2%')} | {p['loadavg'][0]:.1f} |")
    lines += ["", "Recipes (the flags each adds to the model's):", ""]
    lines += [f"- `{r}`: `{' '.join(f)}` (reference: `{doc['reference'][r]}`)" for r, f in doc["recipes"].items()]
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = derive(doc)
    shaped = sorted({p["rate_bps"] for p in rows if p["rate_bps"]})
    if not shaped:
        return False
    x_unshaped = shaped[-1] * 10  # drawn right of the fastest shaped rate
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for r in doc["recipes"]:
        pts = sorted((p["rate_bps"] or x_unshaped, p["speedup"]) for p in rows
                     if p["recipe"] == r and p["speedup"] is not None)
        if not pts or doc["reference"][r] == r:
            continue
        ax.plot(*zip(*pts, strict=True), "o-", label=f"{r} (vs {doc['reference'][r]})", ms=4)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    lo, hi = ax.get_ylim()
    yt = [t for t in (0.125, 0.25, 0.5, 1, 2, 4, 8, 16, 32) if lo <= t <= hi]
    ax.set_yticks(yt, [f"{t:g}x" for t in yt])
    ticks = [*shaped, x_unshaped]
    ax.set_xticks(ticks, [rate_label(t) for t in shaped] + ["unshaped"])
    ax.minorticks_off()
    ax.set_xlabel("inter-node link rate (each direction)")
    ax.set_ylabel("step-time speedup over the uncompressed run")
    ax.set_title(f"{doc['nodes']} nodes x {doc['ranks_per_node']} ranks, gloo over shaped veths "
                 f"({doc['environment']['date']})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(json_path: Path) -> list[Path]:
    doc = json.loads(Path(json_path).read_text())
    md, png = json_path.with_suffix(".md"), json_path.with_suffix(".png")
    md.write_text(table(doc))
    out = [md]
    if plot(doc, png):
        out.append(png)
    return out

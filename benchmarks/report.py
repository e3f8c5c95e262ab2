"""Build the docs' measured tables and ``benchmarks/results/INDEX.md`` from the committed result files.

    python benchmarks/report.py            # rewrite the generated blocks and the index
    python benchmarks/report.py --check    # exit 1 if any of them is stale (a CPU test runs this)

A generated block sits between ``<!-- generated:NAME -->`` and ``<!-- /generated -->`` in
README.md or a page under docs/; ``TABLES`` below says which rows each block holds and which
result file each number comes from. No number in the docs is typed by hand: change a result
file (or add a newer one and point its row at it) and run this script.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
GIB = 2**30


def load(rel: str) -> dict:
    return json.loads((RESULTS / rel).read_text())


def x(v: float, nd: int = 2) -> str:
    return f"{v:.{nd}f}×"


def pct(v: float, nd: int = 2) -> str:
    return f"{v * 100:+.{nd}f} %"


def span(vals, fmt=x) -> str:
    lo, hi = min(vals), max(vals)
    return fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo)}–{fmt(hi)}"


# ---- the figures, each from one file --------------------------------------------------------

def forge_layer(d, key_sets, tokens):
    """Best graphed speedup per row over ``key_sets``, for rows whose T is in ``tokens``."""
    return [max(r.get(k, 0.0) for k in key_sets) for r in d["layer"]["rows"] if r["T"] in tokens]


EXACT = ("speedup_fused_graph", "speedup_split_graph", "speedup_split16_graph", "speedup_ws_graph",
         "speedup_ws16_graph")
FAST = EXACT + ("speedup_ws_fast_graph", "speedup_ws16_fast_graph")


def layer_small_fast(d):
    v = forge_layer(d, FAST, {512, 1024, 2048})
    return f"{span(v)}; ≥ 1.5× in {sum(s >= 1.5 for s in v)} of {len(v)} (shape, T) pairs"


def layer_small_exact(d):
    v = forge_layer(d, EXACT, {512, 1024, 2048})
    return f"{span(v)}; ≥ 1.5× in {sum(s >= 1.5 for s in v)} of {len(v)}"


def layer_16k(d):
    return span(forge_layer(d, EXACT, {16384}))


def graphed_step(d):
    by = {}
    for rnd in d["rounds"]:
        steps = {(s["config"].startswith("torch"), s["B"]): s["step_ms"] for s in rnd["steps"] if s["status"] == "ok"}
        for (is_torch, b), ms in steps.items():
            if not is_torch and (True, b) in steps:
                by.setdefault(b, []).append(ms / steps[(True, b)])
    return "; ".join(f"B = {b}: {span(v, lambda r: x(r, 3))}" for b, v in sorted(by.items()))


def int8p_bytes(d):
    f = [s for s in d["steps"] if s["config"].startswith("forge")][0]
    t = [s for s in d["steps"] if s["config"].startswith("torch")][0]
    return f"{f['persistent_bytes_per_param']:.2f} B/parameter (torch pure bf16: {t['persistent_bytes_per_param']:.2f})"


def median_tps(run):
    return statistics.median(m["tokens_per_second"] for m in run["metrics"] if m["step"] >= 3)


def train1b(name, what):
    def f(d):
        base, r = d["runs"]["baseline"], d["runs"][name]
        if what == "peak":
            b, v = base["summary"]["peak_memory_bytes"], r["summary"]["peak_memory_bytes"]
            return f"{v / GIB:.2f} vs {b / GIB:.2f} GiB ({x(v / b)})"
        if what == "acts":
            b, v = base["summary"]["memory"]["activations"], r["summary"]["memory"]["activations"]
            return f"{v / GIB:.2f} vs {b / GIB:.2f} GiB ({x(v / b)})"
        return f"{median_tps(r):,.0f} vs {median_tps(base):,.0f} tokens/s ({x(median_tps(r) / median_tps(base))})"
    return f


def val_delta(name, base="baseline"):
    def f(d):
        runs = d.get("runs", d)
        return pct(runs[name]["val_loss"] / runs[base]["val_loss"] - 1)
    return f


def state_dtypes_vs_ref(*names):
    """``bench_convergence.py --state-fidelity``: each dtype's mean validation loss vs the yardstick's."""
    return lambda d: " / ".join(pct(d["state_dtypes"][n]["mean_vs_ref"] - 1) for n in names)


def sass_per_element(*states):
    """``bench_forge.py --part sass``: SASS instructions an element on the main path, per state layout."""
    def f(d):
        by = {r["state"]: r["per_element"]["main"] for r in d["rows"]}
        return " / ".join(f"{by[s]:g}" for s in states) + f" (fp8 {x(by['fp8'] / by['bf16'])} bf16's)"
    return f


def fp8_second_moment(d):
    """``parts/fp8_second_moment.py``: updates grown > 2x and the update's relative L2 error, v vs sqrt(v)."""
    runs = list(d["runs"].values())
    def cell(way):
        grown = max(r[way]["update_grown_2x_share"] for r in runs)
        err = max(r[way]["update_rel_l2_max"] for r in runs)
        return f"{grown * 100:.2f} % of updates grown > 2×, rel. L2 error ≤ {err:.3g}"
    return f"e4m3 of v: {cell('e4m3_of_v')}; of sqrt(v): {cell('e4m3_of_sqrt_v')}"


def agoq(key, fmt=x):
    return lambda d: fmt(d["rows"][0][key])


def sdp4bit_estimate(d):
    e = d["estimate"]["450/25"]
    return (f"{e['bf16_rs_ag_s'] * 1e3:.0f} ms → {e['sdp4bit_comm_s'] * 1e3:.0f} ms + "
            f"{e['sdp4bit_compute_s'] * 1e3:.0f} ms compression ({x(e['speedup'])})")


def bytes_vs(name, ref, half=False):
    def f(d):
        runs = d.get("runs", d)
        get = (lambda r: r["summary"]["comm_bytes_per_step"]) if "summary" in runs[name] else \
            (lambda r: r["comm_bytes_per_step"])
        return x(get(runs[name]) / (get(runs[ref]) / (2 if half else 1)), 3)
    return f


def gift_loss(d):
    r = d["runs"]
    return x(r["gift"]["summary"]["val_loss"] / r["exact"]["summary"]["val_loss"], 4)


def scape_seeds(d):
    return ", ".join(pct(d[f"sharded-scape90_seed{s}"]["val_loss"] / d[f"sharded-adams_seed{s}"]["val_loss"] - 1, 1)
                     for s in (1, 2))


def chunkft_peak(d):
    full = d["b1_full_1_1"]["peak_above_weights_bytes"]
    parts = [(v["num_chunks"], v["peak_above_weights_bytes"] / full) for k, v in d.items()
             if k.startswith("b1_chunkft") and v.get("interval") == 1]
    return " / ".join(f"{x(r, 3)} ({n} chunks)" for n, r in sorted(parts))


def chunkft_step(d):
    full = d["b1_full_1_1"]["median_step_seconds"]
    parts = [(v["num_chunks"], v["median_step_seconds"]) for k, v in d.items()
             if k.startswith("b1_chunkft") and v.get("interval") == 1]
    return " / ".join(f"{s:.3f}" for _, s in sorted(parts)) + f" s against {full:.3f} s"


def lowmem_ratio(recipes):
    """Validation loss over full AdamW's, mean of the seeds (and the worst seed), per recipe."""
    def f(d):
        out = []
        for name in recipes:
            worst = max(r["ratio_to_full"] for r in d["runs"] if r["recipe"] == name)
            out.append(f"{name} {d['mean_ratio_to_full'][name]:.4f} (worst {worst:.4f})")
        return "; ".join(out)
    return f


def budget_run(budget):
    """One memory budget's run: the plan, the allocator peak against the estimate, tokens/s."""
    def f(d):
        r = next(r for r in d["runs"] if r["budget"] == budget)
        return (f"{r['plan']}: peak {r['peak_memory_bytes'] / 2**30:.2f} GiB (estimate "
                f"{r['estimate']['total'] / 2**30:.2f}), {r['tokens_per_second']:.0f} tokens/s")
    return f


def hf_methods(d):
    return ", ".join(f"{m['method']} {m['tokens_per_second']:.0f} ({m['peak_memory_bytes'] / GIB:.1f} GiB)"
                     for m in d["methods"] if "error" not in m)


def forge_accum_table(d) -> str:
    """FORGE's accumulation buffers: bytes a fused parameter and the k=4 loss ratios, per accum_dtype."""
    names = {"int8": "`int8` (error feedback)", "int8-noef": "`int8`, `accum_error_feedback false`"}
    lines = ["| `accum_dtype` | bytes held / fused parameter | loss ratio, k=4 vs one 4x batch (all steps / last 10) |",
             "|---|---|---|"]
    for key in ("fp32", "bf16", "int8", "int8-noef"):
        r = d["settings"][key]
        lines.append(f"| {names.get(key, f'`{key}`')} | {r['bytes_per_fused_parameter']:.2f} | "
                     f"{r['loss_ratio_all']:.5f} / {r['loss_ratio_last10']:.5f} |")
    return "\n".join(lines + ["", f"Command: `{d['command']}`"])


def memory_table(rels: list[str]) -> str:
    """bench_memory's rows: per (preset, vocabulary, T) a table of configuration x B, each cell the
    allocator peak (GiB) / tokens a second; then the command of each file."""
    groups: dict[tuple, dict] = {}
    for rel in rels:
        for r in load(rel)["rows"]:
            groups.setdefault((r["preset"], r["vocab"], r["T"]), {}).setdefault(r["config"], {})[r["B"]] = r
    lines = []
    for (preset, vocab, seq), by_config in groups.items():
        batches = sorted({b for rows in by_config.values() for b in rows})
        lines += [f"**{preset}, vocabulary {vocab}, T = {seq}** (allocator peak GiB / tokens a second)", "",
                  "| configuration | " + " | ".join(f"B = {b}" for b in batches) + " |",
                  "|---|" + "---|" * len(batches)]
        for config, rows in by_config.items():
            cells = []
            for b in batches:
                r = rows.get(b)
                cells.append("" if r is None else r["status"].split(":")[0] if r["status"] != "ok"
                             else f"{r['peak_bytes'] / GIB:.2f} / {r['tokens_per_s']:.0f}")
            lines.append(f"| `{config}` | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["Commands:", ""] + [f"- {link('docs/memory.md', rel)}: `{load(rel)['command']}`" for rel in rels]
    return "\n".join(lines)


def profile_table(rel: str, page: str, top: int = 4) -> str:
    """bench_memory --profile: per configuration the step time, the device's busy time and kernel
    launches a step, and the operators taking the most device time (ms a step)."""
    d = load(rel)
    lines = ["| configuration | s a step | device busy s a step | kernels a step | most device time (ms a step) |",
             "|---|---|---|---|---|"]
    for r in d["rows"]:
        p = r["profile"]
        steps = 2  # (bench_memory.profiled's default)
        ops = []
        table = p["table"].splitlines()
        edges, at = [], 0  # the columns' spans, from the dashed rule under the header
        for seg in table[0].split("  "):
            if seg:
                edges.append((at, at + len(seg)))
            at += len(seg) + 2
        for row in table[3:]:
            cells = [row[a:b].strip() for a, b in edges]
            if len(cells) < 10 or not cells[6].endswith("ms"):  # (column 6: self CUDA time)
                continue
            name = cells[0]  # (ranges, autograd nodes and raw kernels overlap the operators: left out)
            if not name.startswith(("Optimizer.step", "nvjet", "void", "cudnn")) and not name.endswith("Backward"):
                ops.append(f"`{name}` {float(cells[6][:-2]) / steps:.1f}")
        lines.append(f"| `{r['config']}` | {r['step_s']:.3f} | {p['device_busy_s']:.3f} | {p['kernels_per_step']:.0f} | "
                     + ", ".join(ops[:top]) + " |")
    return "\n".join(lines + ["", f"From {link(page, rel)}: `{d['command']}`"])


def step_errors(d):
    """bench_step runs that failed: each recipe's error, shortened to its kind."""
    def kind(err):
        if "OutOfMemoryError" in err:
            return "CUDA out of memory"
        return "killed by SIGKILL, no error output" if err == "exit -9" else err.splitlines()[-1][:80]
    return "; ".join(f"{r['recipe']}: {kind(r['error'])}" if "error" in r else f"{r['recipe']}: ran"
                     for r in d["runs"])


def step_runs(d):
    """bench_step without a base: each recipe's tokens/s and allocator peak."""
    out = []
    for name, row in d["median_tokens_per_second"].items():
        peaks = [r["peak_memory_bytes"] for r in d["runs"] if r["recipe"] == name and r.get("peak_memory_bytes")]
        out.append(f"{name} {row['this']:.0f} tok/s, {max(peaks) / GIB:.2f} GiB")
    return "; ".join(out)


def scape_fidelity(d):
    """bench_convergence --scape-fidelity: each sparsity's mean validation loss against dense's (per seed)."""
    out = []
    for name in ("sharded-scape90", "sharded-scape99"):
        if name not in d["recipes"]:
            continue
        r = d["recipes"][name]
        seeds = ", ".join(pct(v["val_vs_dense"] - 1) for v in r["seeds"].values())
        out.append(f"{pct(r['mean_vs_dense'] - 1)} ({seeds})")
    return " / ".join(out)


def scape_gap_by_step(steps, name="sharded-scape90"):
    """bench_convergence --scape-fidelity: the mean over seeds of the validation loss against dense's
    at the evaluations ``steps``."""
    def f(d):
        dense, sparse = d["recipes"]["sharded-adams"]["seeds"], d["recipes"][name]["seeds"]
        gap = {s: statistics.mean(sparse[k]["val_loss_by_step"][str(s)] for k in sparse)
               / statistics.mean(dense[k]["val_loss_by_step"][str(s)] for k in sparse) - 1 for s in steps}
        return ", ".join(f"{pct(g, 1)} at {s}" for s, g in gap.items())
    return f


def scape_hypothesis(key):
    """bench_convergence --scape-fidelity runs of one SCAPE hypothesis: against dense per seed, and the mean
    over the seeds where all three ran."""
    def f(d):
        r = d["runs"][key]
        seeds = ", ".join(pct(v["val_vs_dense"] - 1) for v in r["seeds"].values())
        if "mean_vs_dense" in r:
            return f"{pct(r['mean_vs_dense'] - 1)} ({seeds})"
        return f"{seeds} (stopped after {len(r['seeds'])} of 3 seeds)"
    return f


def _scape_bytes(seeds) -> str:
    """``; bytes 0.163×``: the mean of the seeds' bytes against dense's (nothing for one-process runs, which
    send none)."""
    nbytes = [v["bytes_vs_dense"] for v in seeds if v["bytes_vs_dense"] is not None]
    return f"; bytes {x(statistics.mean(nbytes), 3)}" if nbytes else ""


def scape_recipe(name):
    """bench_convergence --scape-fidelity: one recipe's mean validation loss against dense's (each seed's;
    the worst), and its bytes a step against dense's."""
    def f(d):
        r = d["recipes"][name]
        seeds = ", ".join(pct(v["val_vs_dense"] - 1, 1) for v in r["seeds"].values())
        return f"{pct(r['mean_vs_dense'] - 1)} ({seeds})" + _scape_bytes(r["seeds"].values())
    return f


def scape_recipe_seeds(name, *more):
    """:func:`scape_recipe` over the seeds of the row's file and of ``more`` files (each against its own
    dense runs), the mean of the seeds' ratios: one recipe run in several sittings. A ``more`` entry
    ``(file, recipe)`` names the recipe as that file does (the same settings, spelt otherwise)."""
    named = [m if isinstance(m, tuple) else (m, name) for m in more]

    def f(d):
        docs = [(d, name)] + [(load(rel), n) for rel, n in named]
        runs = [(seed, v) for doc, n in docs for seed, v in doc["recipes"][n]["seeds"].items()]
        per = [v for _, v in runs]
        ratios = [v["val_vs_dense"] for v in per]
        seeds = ", ".join(pct(r - 1, 1) for r in ratios)
        distinct = len({seed for seed, _ in runs})  # (a seed run on several hosts counts once as a seed)
        over = f"{len(per)} seeds" if distinct == len(per) else f"{len(per)} runs of {distinct} seeds"
        return (f"{pct(statistics.mean(ratios) - 1)} over {over} ({seeds}); worst {pct(max(ratios) - 1)}"
                + _scape_bytes(per))
    f.more = [rel for rel, _ in named]  # (the files whose commands the table lists too)
    return f


def memory_cell(rel_config, preset, vocab, seq, batch):
    """One bench_memory row: peak GiB and tokens/s, named by its configuration."""
    def f(d):
        rows = {r["config"]: r for r in d["rows"] if (r["preset"], r["vocab"], r["T"], r["B"]) == (preset, vocab, seq, batch)}
        return "; ".join(f"{name} {rows[c]['peak_bytes'] / GIB:.2f} GiB, {rows[c]['tokens_per_s']:.0f} tok/s"
                         for name, c in rel_config if c in rows)
    return f


def finetune_acc(method, lr=None):
    def f(d):
        v = [r["accuracy_after"] for r in d["runs"] if r["method"] == method and (lr is None or r["lr"] == lr)]
        return f"{statistics.mean(v):.3f}"
    return f


def zo_peak(d):
    return " / ".join(f"{m} {x(d[m]['peak_vs_inference'], 3)}" for m in ("grzo", "mezo", "full"))


def ops_frac(size, names):
    def f(d):
        row = next(s for s in d["sizes"] if s["size_mib"] == size)
        return span([row["kernels"][n]["frac_copy"] for n in names], lambda v: f"{v * 100:.0f} %")
    return f


def norm_rope(d):
    r = {row["impl"]: row["forward_backward_ms"] for row in d["rows"]}
    return (f"RMSNorm {r['leantrain (ops.norm)']:.3f} ms vs {r['op by op (fused_norm=false)']:.3f} op by op, "
            f"{r['torch F.rms_norm']:.3f} F.rms_norm; RoPE {r['rope: leantrain (ops.rope)']:.3f} vs "
            f"{r['rope: op by op (fused_rope=false)']:.3f} ms")


def make_test(d):
    t = d["make_test"]
    failed = f", {t['failed']} failed ({', '.join(f.split('::')[-1] for f in t['failures'])})" if t.get("failed") else ""
    return (f"{t['passed']} tests passed{failed} in {t['pytest_seconds'] / 60:.1f} min of pytest "
            f"({t['total_seconds'] / 60:.1f} min with the install)")


def make_train(d):
    t = d["make_train"]
    return f"{t['seconds']:.0f} s; validation loss {t['val_loss_before']:.2f} → {t['val_loss_after']:.2f}"


def data_rss(d):
    return f"{d['peak_rss_bytes'] / 2**20:.0f} MiB peak RSS for {d['file_bytes'] / 2**30:.2f} GiB of text"


def same_losses(d):
    by = {}
    for r in d["runs"]:
        by.setdefault(r["recipe"], {})[r["tree"]] = r["final_loss"]
    same = [k for k, v in by.items() if v.get("this") == v.get("base")]
    return f"{len(same)} of {len(by)} recipes bit-identical ({', '.join(same)})"


def trainer_vs_base(d):
    t = d["median_tokens_per_second"]
    return "; ".join(f"{name} {x(row['this_over_base'], 3)}" for name, row in t.items() if "this_over_base" in row)


def gift_batched(min_gain, fmt="e4m3"):
    """bench_comm gift-cost: the batched whitening transforms a step in each transform dtype, over the
    layers whose estimated gain is at least ``min_gain``, and their share of the plain step. A shape
    with only some layers over the threshold counts its batched time pro rata (marked ≈)."""
    def f(d):
        plain, partial, out = d["step_ms"]["plain"], False, []
        for dtype in ("float32", "tfloat32", "bfloat16"):
            ms = 0.0
            for shape, row in d["per_shape"].items():
                kept = sum(g >= min_gain for g in d["gain_estimates"][fmt][shape])
                partial |= 0 < kept < row["count"]
                ms += row["batched_transforms_ms"][dtype] * kept / row["count"]
            out.append(f"{dtype} {'≈' if partial else ''}{ms:.1f} ms ({ms / plain:.1%})")
        return "; ".join(out) + f" of a {plain:.1f} ms step"
    return f


def gift_gains(d, fmt="e4m3"):
    return "; ".join(f"{shape} {statistics.median(g):.2f} (min {min(g):.2f})"
                     for shape, g in d["gain_estimates"][fmt].items())


def gift_own(d):
    """bench_comm gift-cost: GIFT's own transforms a step (its reduce path's whiten + map back), per
    ``min_gain`` and ``transform_dtype``, and their share of the plain step."""
    out = []
    for mg, per in d["gift_transforms"]["min_gain"].items():
        n = per["float32"]["whitened_layers"]
        out.append(f"min_gain {mg} ({n} layers): " + ", ".join(f"{dt} {r['ms']:.1f} ms ({r['of_plain_step']:.1%})"
                                                              for dt, r in per.items()))
    return "; ".join(out) + f" of a {d['step_ms']['plain']:.1f} ms step"


def gift_queued(d):
    """bench_comm gift-cost: GIFT's own transforms a step timed on the device with the host ahead (queued
    behind other work, as behind the backward's kernels in a step), per ``min_gain`` and ``transform_dtype``;
    and the host's time to issue them against the plain step's."""
    out = []
    for mg, per in d["gift_transforms"]["min_gain"].items():
        out.append(f"min_gain {mg}: " + ", ".join(f"{dt} {r['queued_ms']:.1f} ms ({r['queued_of_plain_step']:.1%}; "
                                                  f"host {r['host_issue_ms']:.1f} ms)" for dt, r in per.items()))
    return "; ".join(out) + (f" of a {d['step_ms']['plain']:.1f} ms step whose launches the host issues in "
                             f"{d['step_host_issue_ms']:.1f} ms")


def gift_thin_products(d):
    """bench_comm gift-cost: one layer's thin products alone and as its share of the products batched over
    its shape's layers, device ms with the host ahead, per shape: fp32 and TF32."""
    out = []
    for shape, r in d["per_shape"].items():
        cells = []
        for times in (r["device_products_ms"][dt] for dt in ("float32", "tfloat32")):
            share = next(v for c, v in times.items() if c.startswith("P+Q batched"))
            cells.append(f"{times['P+Q one layer']:.3f} / {share:.3f}")
        out.append(f"{shape} {', '.join(cells)}")
    return "; ".join(out)


def gift_stat_tokens(d):
    st = d["step_ms"]
    return "; ".join(f"{k.split('_')[2]} tokens {v - st['plain']:.0f} ms" for k, v in st.items() if k.endswith("_tokens")) \
        + f" (every token: {st['with_statistics'] - st['plain']:.0f} ms)"


def gift_gains_tokens(n, fmt="e4m3"):
    def f(d):
        return "; ".join(f"{shape} {statistics.median(g):.2f} (min {min(g):.2f})"
                         for shape, g in d["gain_estimates_stat_tokens"][str(n)][fmt].items())
    return f


def gift_overhead(d, min_gain="1.2", dtype="tfloat32", tokens=1024, refresh_every=10):
    """The whole of GIFT's compute a step besides the codec: its transforms, and the statistics and the
    refresh spread over ``refresh_every`` steps, with one rank rooting every layer and with 8."""
    st = d["step_ms"]
    tr = d["gift_transforms"]["min_gain"][min_gain][dtype]["ms"]
    refresh = st[f"with_statistics_{tokens}_tokens"] - st["plain"] + d["model"]["refresh_subspace_warm_ms"]
    return "; ".join(f"{ranks} rank{'s' if ranks > 1 else ''} {tr + refresh / ranks / refresh_every:.1f} ms "
                     f"({(tr + refresh / ranks / refresh_every) / st['plain']:.1%})" for ranks in (1, 8))


def scape_cost(d):
    return "; ".join(f"{mb} MiB: " + " / ".join(f"+{per[k]['extra_ms']:.0f}" for k in ("scape-90", "scape-99"))
                     + f" ms (dense {per['dense']['step_ms']:.0f} ms)" for mb, per in d["runs"].items())


# ---- the blocks: (what, function, target, file) ---------------------------------------------

F_LAYER = "forge/2026-12-03_H200_layer.json"
F_STEP = "step/2026-12-02_H200_forge-graphed.json"
F_1B = "step/2026-12-02_H200_train-1b.json"
F_CONV = "convergence/2026-12-02_cpu_tiny-forge-agoq.json"
F_INT8 = "convergence/2026-12-01_cpu_tiny-int8-states.json"
F_FP8 = "convergence/2026-12-05_cpu_tiny-fp8-states.json"
F_FP8V = "convergence/2026-12-05_cpu_tiny-fp8-second-moment.json"
F_SASS = "forge/2026-12-05_cpu_update-sass.json"
F_DIST = "convergence/2026-11-29_cpu_tiny-distributed.json"
F_AGOQ = "agoq/2026-12-01_H200.json"
F_125 = "convergence/2026-12-01_H200_125m-agoq.json"
F_SCAPE = "comm/2026-12-03_cpu_scape.json"
F_SCAPE300 = "comm/2026-12-05_cpu_scape-hypotheses300.json"
SCAPE300 = [("\\|m\\| × age, `catch_up` 10, `catch_up_mode sign`, β1 0.9 (the defaults then)", "defaults"),
            ("`catch_up` 30", "catch_up30"), ("`catch_up` 100", "catch_up100"),
            ("the first moment moves as over τ dense steps (local edit)", "moment_tau"),
            ("`optim.betas 0.95,0.95`: a slower first moment", "beta1_095"),
            ("clipping by the mean gradients' norm (local edit)", "clip_mean_gradient"),
            ("round robin: score = steps since the last update (local edit)", "round_robin"),
            ("`per_tensor`, the tensor's mean \\|m\\| to the power 0.5 (local edit)", "per_tensor_sqrt"),
            ("`optim.warmup_steps 60` (preset: 30)", "warmup60"),
            ("score = the owner's own residual \\|r\\| (local edit)", "residual_score"),
            ("coasting between updates, corrected at the next (local edit)", "coasting")]
F_GIFT = "comm/2026-12-07_cpu_gift-nvfp4.json"
F_GIFT4 = "comm/2026-12-03_cpu_gift-nvfp4-4ranks.json"
F_GIFT8 = "comm/2026-12-03_cpu_gift-e4m3.json"
F_CHUNK = "finetune/2026-12-03_H200_chunkft-1b.json"
F_ZO = "finetune/2026-12-02_H200_zo-1b.json"
F_LOWMEM = "finetune/2026-12-05_cpu_lowmem.json"
F_LOWMEM125 = "finetune/2026-12-06_H100-80GB-HBM3_lowmem-125m.json"
F_LOWMEM125_2K = "finetune/2026-12-06_H200_lowmem-125m-2k.json"
F_GIFT_COST = "comm/2026-12-06_H100-80GB-HBM3_gift-cost.json"
F_GIFT_COST_H200 = "comm/2026-12-07_H200_gift-cost.json"
F_GIFT_QUEUED = "comm/2026-12-07_H100-80GB-HBM3_gift-cost-per-layer.json"  # (with the device times, host ahead)
# the thin products batched on stacks; the reduce path's subsets of slots were picked with a list index, a copy
# to the device the host waited for (its per-shape stacks of every layer took no index)
F_GIFT_STACKS = "comm/2026-12-07_H100-80GB-HBM3_gift-cost-stacks-list-index.json"
F_BUDGET = "finetune/2026-12-05_H200_budgets-7b.json"
F_HF1B = "finetune/2026-12-05_H200_hf-1b.json"
F_MEM = "memory/2026-12-05_H200_memory.json"
F_MEM128 = "memory/2026-12-05_H200_memory-8b-128k.json"
F_PROFILE = "memory/2026-12-05_H200_profile-7b.json"
MEM_8B_128K = memory_cell([("ChunkFT + FORGE, 128 chunks, inputs offloaded", "chunkft_fused128_offload"),
                           ("torchtune's recipe", "torchtune_recipe"), ("torch bf16 + checkpointing", "torch_bf16_ckpt")],
                          "8b", 128256, 2048, 2)

F_SCAPE_W, F_SCAPE_W2 = "comm/2026-12-06_cpu_scape-fidelity-warmup.json", "comm/2026-12-06_cpu_scape-fidelity-warmup-seeds6-8.json"
W90 = "sharded-scape90@comm.scape.warmup=100"
F_SCAPE_SMALL, F_SCAPE_SMALL12 = "comm/2026-12-06_cpu_scape-small-warmup.json", "comm/2026-12-06_cpu_scape-small-warmup-seeds1-2.json"
F_SCAPE99_2C = "comm/2026-12-06_cpu_scape99-default-2core.json"
F_SCAPE99_W = ("comm/2026-12-06_cpu_scape99-fidelity-warmup.json", "comm/2026-12-06_cpu_scape99-fidelity-warmup-b.json",
               "comm/2026-12-06_cpu_scape99-fidelity-warmup-c.json")
SCAPE99_BOTH = scape_recipe_seeds("sharded-scape99", *[(rel, "sharded-scape99@comm.scape.warmup=200") for rel in F_SCAPE99_W[1:]])
F_SCAPE99_SCREEN, F_SCAPE99_CU20 = "comm/2026-12-06_cpu_scape99-screen-2core.json", "comm/2026-12-06_cpu_scape99-catchup20-16core.json"
CU20 = "sharded-scape99@comm.scape.catch_up=20"
SCAPE99_CU20_BOTH = scape_recipe_seeds(CU20, F_SCAPE99_CU20)  # (the 2-core host's seeds and the 16-core host's)
F_SCAPE99_1P = "comm/2026-12-06_cpu_scape99-1proc-2core.json"  # (recipe sharded-scape99: the defaults, cap 20)
F_SCAPE99_1P_B = "comm/2026-12-07_cpu_scape99-1proc-seeds6-11-2core.json"  # (the same, seeds 6-11)
F_SCAPE99_GPU = ("comm/2026-12-06_H100-80GB-HBM3_scape99-screen-1proc.json",
                 "comm/2026-12-06_H100-80GB-HBM3_scape99-catchup20-tiny-seeds6-11-1proc.json")
# the same runs on the other host's text (--data: benchmarks/tools/export_corpus.py): the H100 on the 2-core host's
# (Python 3.11's standard library, 24 MiB), the 2-core host on the GPU host's (Ubuntu's Python 3.12, 10 MiB; the GPU
# host's 16 cores ran the "16-core" gloo runs)
F_SCAPE99_GPU_CPUTEXT = "comm/2026-12-07_H100-80GB-HBM3_scape99-cpu-corpus-1proc.json"
F_SCAPE99_CPU_GPUTEXT = "comm/2026-12-07_cpu_scape99-gpu-corpus-1proc-2core.json"
# every run of the defaults at 99 % on tiny, 300 steps, on one text: 2 ranks, one process on the CPU and on the H100
SCAPE99_TEXT_CPU = scape_recipe_seeds(CU20, (F_SCAPE99_1P, "sharded-scape99"), (F_SCAPE99_1P_B, "sharded-scape99"),
                                      (F_SCAPE99_GPU_CPUTEXT, "sharded-scape99"))  # (row file: F_SCAPE99_SCREEN)
SCAPE99_TEXT_GPU = scape_recipe_seeds(CU20, *F_SCAPE99_GPU, (F_SCAPE99_CPU_GPUTEXT, "sharded-scape99"))  # (F_SCAPE99_CU20)
SCAPE99_CU20_ALL = scape_recipe_seeds(CU20, F_SCAPE99_CU20, (F_SCAPE99_1P, "sharded-scape99"),
                                      (F_SCAPE99_1P_B, "sharded-scape99"), *F_SCAPE99_GPU)

TABLES: dict[str, list[tuple]] = {
    "readme": [
        ("FORGE, one linear vs matmul + fused AdamW, T ≤ 2048, H200 (`fast_math`)", layer_small_fast, "≥ 1.5×", F_LAYER),
        ("FORGE whole 1b step vs torch bf16 AdamW, both graphed, H200", graphed_step, "no slower", F_STEP),
        ("FORGE int8 states + AGoQ, 1b trainer, allocator peak vs baseline", train1b("forge_int8_agoq", "peak"),
         "≤ 0.5×", F_1B),
        ("AGoQ saved activations vs bf16, 1b, B = 8", agoq("saved_ratio", lambda v: x(v, 3)), "≤ 0.3×", F_AGOQ),
        ("AGoQ step time vs baseline, CUDA graph", agoq("graph_step_time_ratio", lambda v: x(v, 3)), "≤ 1.15×", F_AGOQ),
        ("SDP4Bit convergence, 4 gloo ranks (2 × 2), tiny", val_delta("sharded-sdp4bit-x4"), "within 1 %", F_DIST),
        ("SCAPE bytes vs dense sharded AdamS, 90 % sparse", bytes_vs("sharded-scape90x2", "sharded-adamsx2"),
         "≤ 0.1×", F_SCAPE),
        ("SCAPE 90 % (its default 100-step warm-up) val loss vs dense sharded AdamS, tiny, 300 steps, 2 gloo ranks",
         scape_recipe_seeds(W90, F_SCAPE_W2), "within 1 %", F_SCAPE_W),
        ("SCAPE 99 % (200-step warm-up, catch-up cap 10) val loss vs dense sharded AdamS, small, 300 steps, 2 gloo ranks",
         scape_recipe_seeds("sharded-scape99@comm.scape.warmup=200", F_SCAPE_SMALL12), "within 2 %", F_SCAPE_SMALL),
        ("SCAPE 99 % (the defaults: 200-step warm-up, catch-up cap 20) val loss vs dense sharded AdamS, tiny, 300 steps, "
         "every run on Python 3.11's standard library (24 MiB): 2 gloo ranks and one process on a CPU, one process on an H100",
         SCAPE99_TEXT_CPU, "within 2 %", F_SCAPE99_SCREEN),
        ("the same on Ubuntu's Python 3.12 standard library (10 MiB, no test suite)", SCAPE99_TEXT_GPU, "within 2 %",
         F_SCAPE99_CU20),
        ("GIFT NVFP4 bytes vs bf16 all-reduce, 2 ranks", bytes_vs("gift", "exact", half=True), "≤ 0.5×", F_GIFT),
        ("ChunkFT peak above weights vs AdamW, 1b", chunkft_peak, "≤ 1/chunks", F_CHUNK),
        ("7b full fine-tuning, B = 1, T = 1024, `--train.memory-budget 13.8GiB`, H200", budget_run("13.8GiB"),
         "≤ 13.5 GiB", F_BUDGET),
        ("8b (128k vocabulary), B = 2, T = 2048, full fine-tuning step, H200", MEM_8B_128K, "≤ 17 GiB, ≥ torchtune",
         F_MEM128),
        ("every method from a 1b Hugging Face directory, B = 8, T = 256, H200: tokens/s (allocator peak)", hf_methods, "", F_HF1B),
        ("GRZO / MeZO / AdamW peak vs inference, 1b", zo_peak, "≤ 1.1×", F_ZO),
        ("streamed tokenization of a 1 GiB text file (BPE trained on a 64 MB sample)", data_rss, "≤ 2 GB",
         "data/2026-12-04_cpu.json"),
        ("tiny, 20 steps: final loss vs the tree before the technique protocol, CPU", same_losses,
         "unchanged", "convergence/2026-12-04_cpu_trainer-vs-base.json"),
        ("1b step through the trainer vs the tree before the technique protocol, H100, tokens/s",
         trainer_vs_base, "no slower", "step/2026-12-06_H100-80GB-HBM3_trainer-vs-base.json"),
    ],
    "timings": [
        ("`make test` (fresh clone, 2-core CPU)", make_test, "≤ 20 min", "ci/2026-12-07_cpu_make-timings.json"),
        ("`make train` (venv installed)", make_train, "", "ci/2026-12-07_cpu_make-timings.json"),
    ],
    "forge": [
        ("one linear, best path vs matmul + fused AdamW, T ≤ 2048, `fast_math`", layer_small_fast, "≥ 1.5×", F_LAYER),
        ("the same, exact rule (default)", layer_small_exact, "≥ 1.5×", F_LAYER),
        ("one linear, T = 16384, best exact path", layer_16k, "≥ 1.0×", F_LAYER),
        ("whole 1b step, bf16 + SR, bf16 states, graphed, time vs torch", graphed_step, "≤ 1.0×", F_STEP),
        ("persistent state, bf16 weights + int8p states", int8p_bytes, "≤ 4", "forge/2026-12-01_H200_int8p-states.json"),
        ("1b trainer, FORGE int8 + AGoQ: allocator peak", train1b("forge_int8_agoq", "peak"), "≤ 0.5×", F_1B),
        ("1b trainer, FORGE int8 + AGoQ: tokens/s", train1b("forge_int8_agoq", "tps"), "", F_1B),
        ("tiny, 300 steps: FORGE fp32 val loss vs baseline", val_delta("forge"), "within 1 %", F_CONV),
        ("tiny: FORGE bf16 + SR", val_delta("forge-bf16"), "within 1 %", F_CONV),
        ("tiny: FORGE bf16 + SR, int8 / int8p states", lambda d: val_delta("forge-bf16-int8")(d) + " / "
         + val_delta("forge-bf16-int8p")(d), "within 1 %", F_INT8),
        ("tiny, 300 steps, seeds 0–2, mean val loss vs bf16 states: int8 / fp8 / fp8 with e4m3 of v itself",
         state_dtypes_vs_ref("int8", "fp8", "fp8v"), "within 1 %", F_FP8),
        ("fp8 second moments on the bf16-state runs' last states", fp8_second_moment, "", F_FP8V),
        ("update-only kernel, SASS instructions an element (sm_90a, static): bf16 / int8 / fp8 states",
         sass_per_element("bf16", "int8", "fp8"), "fp8 ≤ 1.1× bf16", F_SASS),
    ],
    "agoq": [
        ("saved activations vs bf16, 1b, B = 8", agoq("saved_ratio", lambda v: x(v, 3)), "≤ 0.3×", F_AGOQ),
        ("allocator peak above the weights vs baseline", agoq("peak_above_static_ratio", lambda v: x(v, 3)), "", F_AGOQ),
        ("step time vs baseline, both as CUDA graphs", agoq("graph_step_time_ratio", lambda v: x(v, 3)), "≤ 1.15×", F_AGOQ),
        ("step time vs baseline, eager", agoq("step_time_ratio", lambda v: x(v, 3)), "≤ 1.15×", F_AGOQ),
        ("1b trainer, FORGE + AGoQ: saved activations", train1b("forge_agoq", "acts"), "≤ 0.3×", F_1B),
        ("tiny, 300 steps: FORGE + AGoQ val loss vs baseline", val_delta("agoq+forge"), "within 1 %", F_CONV),
        ("125m, 1000 steps: AGoQ val loss vs baseline", val_delta("agoq"), "within 1 %", F_125),
    ],
    "sdp4bit": [
        ("estimated comm time, 1b, 2 × 8 GPUs at 450 / 25 GB/s", sdp4bit_estimate, "", "comm/2026-11-29_H200_sdp4bit.json"),
        ("gradient encode throughput vs a device copy",
         lambda d: f"{d['ops']['grad.encode']['vs_copy'] * 100:.0f} %", "≥ 50 %", "comm/2026-11-29_H200_sdp4bit.json"),
        ("tiny, 300 steps: ShardedOptimizer × 4 val loss vs baseline", val_delta("sharded-x4"), "within 1 %", F_DIST),
        ("tiny, 300 steps: ShardedOptimizer + SDP4Bit × 4 (2 × 2)", val_delta("sharded-sdp4bit-x4"), "within 1 %", F_DIST),
    ],
    "scape": [
        ("bytes a step vs dense sharded AdamS, 90 % sparse", bytes_vs("sharded-scape90x2", "sharded-adamsx2"),
         "≤ 0.1×", F_SCAPE),
        ("the same, 99 % sparse", bytes_vs("sharded-scape99x2", "sharded-adamsx2"), "", F_SCAPE),
        ("val loss vs dense sharded AdamS, 90 % sparse", val_delta("sharded-scape90x2", "sharded-adamsx2"),
         "within 1 %", F_SCAPE),
        ("the same, 99 % sparse", val_delta("sharded-scape99x2", "sharded-adamsx2"), "within 2 %", F_SCAPE),
        ("90 % sparse, seeds 1 and 2", scape_seeds, "within 1 %", "comm/2026-12-03_cpu_scape-seeds.json"),
        ("90 % / 99 % sparse, mean of seeds 1337, 1, 2", scape_fidelity, "within 1 % / 2 %",
         "comm/2026-12-05_cpu_scape-sign.json"),
        ("the same, `catch_up_mode steps`", scape_fidelity, "within 1 % / 2 %",
         "comm/2026-12-05_cpu_scape-defaults.json"),
        ("small preset, 300 steps, 90 % sparse, seed 1337", scape_fidelity, "within 1 %",
         "comm/2026-12-05_cpu_scape-small-sign.json"),
        ("the same, 99 % sparse", scape_fidelity, "within 2 %", "comm/2026-12-05_cpu_scape99-small-sign.json"),
        ("the same, 90 % / 99 % sparse, `catch_up_mode steps`", scape_fidelity, "within 1 % / 2 %",
         "comm/2026-12-05_cpu_scape-small.json"),
        ("1000 steps, 90 % sparse, mean of seeds 1337, 1, 2", scape_fidelity, "within 1 %",
         "comm/2026-12-05_cpu_scape90-sign-1000steps.json"),
        ("the same, by step (mean over seeds)", scape_gap_by_step((100, 200, 300, 500, 700, 1000)), "",
         "comm/2026-12-05_cpu_scape90-sign-1000steps.json"),
        ("SCAPE's extra compute a step over dense, 1.8 B parameters, rank 0 of 32, H100, 90 % / 99 %, by bucket "
         "size (`dist.bucket_mb`)", scape_cost, "", "comm/2026-12-06_H100-80GB-HBM3_scape-cost.json"),
        ("1000 steps, 90 % sparse, `catch_up_mode steps`, mean of seeds 1337, 1, 2", scape_fidelity, "within 1 %",
         "comm/2026-12-05_cpu_scape90-1000steps.json"),
        ("the same, by step (mean over seeds)", scape_gap_by_step((100, 200, 300, 500, 700, 1000)), "",
         "comm/2026-12-05_cpu_scape90-1000steps.json"),
        ("1000 steps, 90 % / 99 % sparse, `catch_up_mode steps`, seed 1337", scape_fidelity, "within 1 % / 2 %",
         "comm/2026-12-05_cpu_scape-1000steps.json"),
        ("batch 64 (4× the preset's 16), 300 steps, 90 % sparse, seed 1337", scape_fidelity, "within 1 %",
         "comm/2026-12-05_cpu_scape-batch64.json"),
        ("the same, by step", scape_gap_by_step((50, 100, 150, 200, 300)), "", "comm/2026-12-05_cpu_scape-batch64.json"),
    ],
    "gift": [
        ("NVFP4 bytes vs a bf16 all-reduce, 2 ranks", bytes_vs("gift", "exact", half=True), "≤ 0.5×", F_GIFT),
        ("NVFP4 bytes, 4 ranks", bytes_vs("gift", "exact", half=True), "≤ 0.5×", F_GIFT4),
        ("E4M3 bytes, 2 ranks", bytes_vs("gift", "exact", half=True), "≤ 0.5×", F_GIFT8),
        ("NVFP4 val loss vs the exact all-reduce, 2 ranks", gift_loss, "within 1 %", F_GIFT),
        ("NVFP4 val loss vs exact, 4 ranks", gift_loss, "within 1 %", F_GIFT4),
        ("whitening transforms a step, 1b, B = 4, H200, layer by layer (fp32)",
         lambda d: f"{d['model']['transforms_ms']:.1f} ms", "", "comm/2026-12-03_H200_gift-cost.json"),
        ("the same batched by shape, H100: each `transform_dtype` (share of the plain step)", gift_batched(0.0),
         "≤ 10 %", F_GIFT_COST),
        ("the same with `min_gain 1.2` (the layers whose estimated E4M3 gain is at least 1.2)", gift_batched(1.2),
         "≤ 10 %", F_GIFT_COST),
        ("the same on one stack of a shape's 22 layers, the thin products batched, H100; every layer / "
         "`min_gain 1.2`", lambda d: f"{gift_batched(0.0)(d)} / {gift_batched(1.2)(d)}", "≤ 10 %", F_GIFT_STACKS),
        ("the thin products P + Q of one layer alone / batched over the shape's 22 layers (a layer's share), "
         "device ms with the host ahead, float32 and tfloat32, H100", gift_thin_products, "", F_GIFT_STACKS),
        ("estimated E4M3 gain of whitening per shape, median (min) over the 22 layers", gift_gains, "",
         F_GIFT_COST),
        ("a refresh, 1b, H100: the statistics' extra forward + backward time; the refresh warm / cold",
         lambda d: f"{d['step_ms']['with_statistics'] - d['step_ms']['plain']:.0f} ms; "
                   f"{d['model']['refresh_subspace_warm_ms']:.0f} / {d['model']['refresh_subspace_cold_ms']:.0f} ms", "", F_GIFT_COST),
        ("GIFT's own transforms a step (its reduction's whiten + map back), 1b, B = 4, H100, factors from "
         "statistics of 1024 tokens", gift_own, "≤ 10 %", F_GIFT_COST),
        ("the same on an H200", gift_own, "≤ 10 %", F_GIFT_COST_H200),
        ("the same timed on the device with the host ahead (queued behind other work, as behind the backward "
         "in a step), H100, the thin products a layer at a time; the host's time to issue them", gift_queued, "≤ 10 %",
         F_GIFT_QUEUED),
        ("the statistics' extra forward + backward with `stat_tokens`", gift_stat_tokens, "", F_GIFT_COST),
        ("estimated E4M3 gain per shape from statistics of 1024 tokens, median (min)", gift_gains_tokens(1024), "",
         F_GIFT_COST),
        ("all of GIFT's compute a step but the codec, `min_gain 1.2`, `tfloat32`, `stat_tokens 1024`, refresh "
         "every 10: one rank rooting every layer / 8 ranks", gift_overhead, "", F_GIFT_COST),
        ("the same on an H200", gift_overhead, "", F_GIFT_COST_H200),
        ("E4M3 val loss vs exact, 2 ranks, `min_gain 1.2` (on the tiny preset every layer's gain is over 1.2)",
         gift_loss, "within 1 %", "comm/2026-12-07_cpu_gift-e4m3-mingain1.2.json"),
        ("the same with `stat_tokens 512` (one token in 8)", gift_loss, "within 1 %",
         "comm/2026-12-06_cpu_gift-e4m3-mingain1.2-stat512.json"),
    ],
    "chunkft": [
        ("peak above weights vs AdamW, 1b, B = 16", chunkft_peak, "≤ 1/chunks", F_CHUNK),
        ("median step, 4 / 8 / 16 chunks vs AdamW", chunkft_step, "", F_CHUNK),
        ("accuracy on `compare`, tiny, lr 1e-4, 3 seeds (AdamW in brackets)",
         lambda d: f"{finetune_acc('chunkft', 1e-4)(d)} ({finetune_acc('full')(d)})", "as AdamW",
         "finetune/2026-12-03_cpu_chunkft-tiny.json"),
        ("7b, B = 1, T = 1024, H200: `--train.memory-budget 13.8GiB`", budget_run("13.8GiB"), "≤ 13.5 GiB", F_BUDGET),
        ("the same, `--train.memory-budget 22GB`", budget_run("22GB"), "", F_BUDGET),
        ("8b (128k vocabulary), B = 2, T = 2048, one step, H200", MEM_8B_128K, "≤ 17 GiB, ≥ torchtune", F_MEM128),
        ("validation loss vs full AdamW (fp32), tiny, 120 steps from a trained run, 3 seeds",
         lowmem_ratio(["chunkft4", "chunkft4-forge", "chunkft8-forge"]), "within 1 %", F_LOWMEM),
        ("the same, FORGE's memory recipes", lowmem_ratio(["forge-bf16", "forge-int8-ckpt"]), "within 1 %", F_LOWMEM),
        ("the ChunkFT recipes at half of AdamW's learning rate (5e-4 against 1e-3)",
         lowmem_ratio(["chunkft4", "chunkft4-forge", "chunkft8-forge"]), "within 1 %",
         "finetune/2026-12-05_cpu_lowmem-chunkft-half-lr.json"),
        ("validation loss vs full AdamW, 125m, 500 steps from a 300-step run, seed 0, H100 (ChunkFT at 3e-4, "
         "the others 6e-4)", lowmem_ratio(["forge-bf16", "forge-int8-agoq", "chunkft4-forge", "chunkft8-forge"]),
         "within 2 %", F_LOWMEM125),
        ("the ChunkFT recipes, 125m, 500 steps from a 300-step run, seed 0, H200, ChunkFT at 1.5e-4 / 7.5e-5 / "
         "7.5e-5", lowmem_ratio(["chunkft4", "chunkft4-forge", "chunkft8-forge"]), "within 2 %",
         "finetune/2026-12-06_H200_lowmem-125m-lr.json"),
        ("the same from a 2000-step run (fine-tuning a trained model), ChunkFT at 1.5e-4, the others 6e-4",
         lowmem_ratio(["chunkft4", "chunkft4-forge", "chunkft8-forge"]), "within 2 %", F_LOWMEM125_2K),
    ],
    "zo": [
        ("allocator peak vs inference, 1b, B = 16", zo_peak, "≤ 1.1×", F_ZO),
        ("seconds a step, GRZO / MeZO / AdamW",
         lambda d: " / ".join(f"{d[m]['seconds_per_step']:.3f}" for m in ("grzo", "mezo", "full")), "", F_ZO),
        ("accuracy on `compare`, tiny, 3 seeds, H200: GRZO / MeZO",
         lambda d: f"{finetune_acc('grzo')(d)} / {finetune_acc('mezo')(d)}", "GRZO higher",
         "finetune/2026-12-02_H200_zo-tiny.json"),
        ("the same on the CPU", lambda d: f"{finetune_acc('grzo')(d)} / {finetune_acc('mezo')(d)}", "GRZO higher",
         "finetune/2026-12-02_cpu_zo-tiny.json"),
    ],
    "fsdp": [
        ("1b, B = 8, T = 1024, one H200: baseline / FSDP2 (bf16 all-gathers) / FSDP2 + AGoQ", step_runs, "",
         "step/2026-12-05_H200_fsdp-1gpu.json"),
        ("8b, B = 1, T = 1024, one H100 (80 GB, 128 GiB host): FSDP2 + CPU offload / FSDP2 + FORGE + AGoQ",
         step_errors, "runs", "step/2026-12-06_H100-80GB-HBM3_fsdp-8b-1gpu.json"),
        ("8b, B = 1, T = 1024, one H200 (141 GB): FSDP2 + FORGE + AGoQ (fp32 shards and states)", step_runs, "runs",
         "step/2026-12-06_H200_fsdp-8b-1gpu.json"),
    ],
    "ops": [
        ("quantize / dequantize int8, int4 (fp32, g128), 2 GiB, vs copy",
         ops_frac(2048, ["quantize int8 g128 fp32", "dequantize int8 g128 ->fp32", "quantize int4 g128 fp32",
                         "dequantize int4 g128 ->fp32"]), "≥ 50 %", "ops/2026-11-30_H200.json"),
        ("AGoQ's int4 from bf16 with SR / its dequantize, 2 GiB",
         ops_frac(2048, ["quantize int4 g128 SR bf16 (AGoQ)", "dequantize int4 g128 ->bf16 (AGoQ)"]), "≥ 50 %",
         "ops/2026-11-30_H200.json"),
        ("RMSNorm, RoPE forward + backward, 1b shapes, 65 536 tokens", norm_rope, "",
         "ops/2026-12-01_H200_norm-rope.json"),
    ],
}

F_SCAPE6, F_SCAPE6B = "comm/2026-12-06_cpu_scape-fidelity-6seeds.json", "comm/2026-12-06_cpu_scape-fidelity-6seeds-b.json"
TABLES["scape6"] = [
    ("90 %, the defaults before `beta1` (β1 0.9, the optimizer's)", scape_recipe("sharded-scape90"), "within 1 %",
     F_SCAPE6),
    ("90 %, `catch_up` 20", scape_recipe("sharded-scape90@comm.scape.catch_up=20"), "within 1 %", F_SCAPE6),
    ("90 %, `catch_up` 30", scape_recipe("sharded-scape90@comm.scape.catch_up=30"), "within 1 %", F_SCAPE6),
    ("90 %, the first 30 steps dense (`dense_steps 30`)", scape_recipe("sharded-scape90@comm.scape.dense_steps=30"),
     "within 1 %", F_SCAPE6B),
    ("80 % (`density 0.2`)", scape_recipe("sharded-scape90@comm.scape.density=0.2"), "", F_SCAPE6B),
    ("70 % (`density 0.3`)", scape_recipe("sharded-scape90@comm.scape.density=0.3"), "", F_SCAPE6B),
]
F_SCAPE_B1 = "comm/2026-12-06_cpu_scape-fidelity-beta1.json"
TABLES["scape_beta1"] = [
    ("90 %, `optim.betas 0.8,0.95` (every update, the dense first step's too), seeds 1–3, 1337, 16-core host",
     scape_recipe("sharded-scape90"), "within 1 %", "comm/2026-12-06_cpu_scape-fidelity-beta08-4seeds.json"),
    ("90 %, `comm.scape.beta1 0.8`, seeds 1–5, 1337, dense and sparse on the 2-core host",
     scape_recipe("sharded-scape90@comm.scape.beta1=0.8"), "within 1 %", F_SCAPE_B1),
    ("99 %, `comm.scape.beta1 0.8`, seeds 1, 2, 1337, the same host", scape_recipe("sharded-scape99@comm.scape.beta1=0.8"),
     "within 2 %", "comm/2026-12-06_cpu_scape99-fidelity-beta1.json"),
]
TABLES["scape_warmup"] = [
    ("90 %, no warm-up (`beta1 0.8`, the defaults before `warmup`)", scape_recipe("sharded-scape90"), "within 1 %",
     "comm/2026-12-06_cpu_scape-fidelity-beta1-16core.json"),
    ("90 %, `warmup 50`", scape_recipe("sharded-scape90@comm.scape.warmup=50"), "within 1 %", F_SCAPE_W),
    ("90 %, `warmup 100` (the default at 90 %)", scape_recipe_seeds(W90, F_SCAPE_W2), "within 1 %, each seed 2 %", F_SCAPE_W),
    ("99 %, no warm-up, `catch_up 100`", scape_recipe("sharded-scape99@comm.scape.catch_up=100"), "within 2 %",
     F_SCAPE99_W[0]),
    ("99 %, `catch_up 100`, `beta1 0.5`", scape_recipe("sharded-scape99@comm.scape.catch_up=100;comm.scape.beta1=0.5"),
     "within 2 %", F_SCAPE99_W[0]),
    ("99 %, `warmup 100`", scape_recipe_seeds("sharded-scape99@comm.scape.warmup=100", F_SCAPE99_W[2]), "within 2 %",
     F_SCAPE99_W[0]),
    ("99 %, `warmup 100`, `catch_up 100`", scape_recipe("sharded-scape99@comm.scape.catch_up=100;comm.scape.warmup=100"),
     "within 2 %", F_SCAPE99_W[0]),
    ("99 %, `warmup 150`", scape_recipe("sharded-scape99@comm.scape.warmup=150"), "within 2 %", F_SCAPE99_W[1]),
    ("99 %, `warmup 200` (the default at 99 %)", scape_recipe_seeds("sharded-scape99@comm.scape.warmup=200", F_SCAPE99_W[2]), "within 2 %",
     F_SCAPE99_W[1]),
    ("90 %, `warmup 100`, 2-core host, against its dense runs", scape_recipe(W90), "within 1 %, each seed 2 %",
     "comm/2026-12-06_cpu_scape-fidelity-warmup-2core.json"),
    ("the same against dense AdamS at β1 0.8 (`optim.betas 0.8,0.95` in both runs), seeds 1, 2, 1337",
     scape_recipe(W90), "within 1 %, each seed 2 %", "comm/2026-12-06_cpu_scape-fidelity-warmup-beta08.json"),
    ("small preset, seeds 1337, 1, 2, 2-core host: 90 %, `warmup 100` (the default)",
     scape_recipe_seeds(W90, F_SCAPE_SMALL12), "within 1 %, each seed 2 %", F_SCAPE_SMALL),
    ("small preset, the same: 99 %, `warmup 200` (the default at 99 %)",
     scape_recipe_seeds("sharded-scape99@comm.scape.warmup=200", F_SCAPE_SMALL12), "within 2 %", F_SCAPE_SMALL),
    ("99 %, `warmup 200`, `catch_up 10` (the defaults before the scaled cap), 2-core host, against its dense runs",
     scape_recipe("sharded-scape99"), "within 2 %", F_SCAPE99_2C),
    ("the same, and `score residual`", scape_recipe("sharded-scape99@comm.scape.score=residual"), "within 2 %",
     "comm/2026-12-06_cpu_scape99-residual-2core.json"),
    ("the same, and `explore 0.3`", scape_recipe("sharded-scape99@comm.scape.explore=0.3"), "within 2 %",
     F_SCAPE99_SCREEN),
    ("the same, and `catch_up 20` (the default at 99 %)", scape_recipe(CU20), "within 2 %", F_SCAPE99_SCREEN),
    ("99 %, `catch_up 20` (the defaults), 16-core host", scape_recipe(CU20), "within 2 %", F_SCAPE99_CU20),
    ("99 %, `catch_up 10`, both hosts: the 2-core host's 6 seeds and the 16-core host's 6", SCAPE99_BOTH, "within 2 %",
     F_SCAPE99_2C),
    ("99 %, `catch_up 20` (the defaults), both hosts: the 2-core host's 6 seeds and the 16-core host's 6",
     SCAPE99_CU20_BOTH, "within 2 %", F_SCAPE99_SCREEN),
    ("99 %, the defaults (`catch_up 20`), one process, 2-core host, against its dense runs in one process",
     scape_recipe("sharded-scape99"), "within 2 %", F_SCAPE99_1P),
    ("the same, and `per_tensor true`", scape_recipe("sharded-scape99@comm.scape.per_tensor=true"), "within 2 %",
     F_SCAPE99_1P),
    ("99 %, the defaults, every run: 2 ranks on both hosts, one process on the 2-core host and on the H100",
     SCAPE99_CU20_ALL, "within 2 %", F_SCAPE99_SCREEN),
]
G = "comm/2026-12-06_H100-80GB-HBM3_"
S99, W200 = "sharded-scape99@comm.scape.warmup=200", "warmup 200"
TABLES["scape_gpu"] = [
    ("tiny, 300 steps, 6 seeds: 90 %, the defaults", scape_recipe("sharded-scape90"), "within 1 %, each seed 2 %",
     G + "scape-fidelity-1proc.json"),
    (f"the same: 99 %, `{W200}`", scape_recipe(S99), "within 2 %", G + "scape-fidelity-1proc.json"),
    ("small, 300 steps, 3 seeds: 90 %, the defaults", scape_recipe("sharded-scape90"), "within 1 %, each seed 2 %",
     G + "scape-small-1proc.json"),
    (f"the same: 99 %, `{W200}`", scape_recipe(S99), "within 2 %", G + "scape-small-1proc.json"),
    ("tiny, 1000 steps, 3 seeds: 90 %, the defaults", scape_recipe("sharded-scape90"), "", G + "scape-1000steps-1proc.json"),
    (f"the same: 99 %, `{W200}`", scape_recipe(S99), "", G + "scape-1000steps-1proc.json"),
    *[(f"the same, and `{v.replace('=', ' ').replace(';', '`, `')}`",
       scape_recipe(S99 + "".join(f";comm.scape.{kv}" for kv in v.split(";"))), "", G + f)
      for v, f in [("per_tensor=true", "scape99-1000steps-variants-1proc.json"),
                   ("score=m", "scape99-1000steps-variants-1proc.json"),
                   ("catch_up_mode=steps", "scape99-1000steps-variants-1proc.json"),
                   ("catch_up=3", "scape99-1000steps-variants-b-1proc.json"),
                   ("catch_up=5", "scape99-1000steps-variants-b-1proc.json"),
                   ("catch_up=30", "scape99-1000steps-variants-1proc.json"),
                   ("catch_up=100", "scape99-1000steps-variants-1proc.json"),
                   ("beta1=0.9", "scape99-1000steps-variants-1proc.json"),
                   ("beta1=0.7", "scape99-1000steps-variants-1proc.json"),
                   ("beta1=0.65", "scape99-1000steps-variants-c-1proc.json"),
                   ("beta1=0.6", "scape99-1000steps-variants-b-1proc.json"),
                   ("beta1=0.5", "scape99-1000steps-variants-b-1proc.json"),
                   ("beta1=0.3", "scape99-1000steps-variants-b-1proc.json"),
                   ("beta1=0.5;catch_up=5", "scape99-1000steps-variants-b-1proc.json"),
                   ("beta1=0.5;catch_up=30", "scape99-1000steps-variants-b-1proc.json")]],
    *[(f"tiny, 300 steps, 6 seeds: 99 %, `warmup {w}`, `beta1 {b}`",
       scape_recipe(f"sharded-scape99@comm.scape.warmup={w};comm.scape.beta1={b}"), "within 2 %",
       G + "scape99-beta1-1proc.json") for w, b in [(200, 0.7), (200, 0.65), (200, 0.6), (150, 0.6), (100, 0.6)]],
    *[(f"small, 300 steps, 3 seeds: 99 %, `{W200}`, `beta1 {b}`",
       scape_recipe(f"{S99};comm.scape.beta1={b}"), "within 2 %", G + "scape99-small-beta1-1proc.json") for b in (0.7, 0.6)],
    ("small, 1000 steps, 3 seeds: 90 %, the defaults", scape_recipe("sharded-scape90"), "",
     G + "scape-small-1000steps-1proc.json"),
    *[(f"the same: 99 %, `{W200}`{b and f', `beta1 {b}`'}", scape_recipe(S99 + (b and f";comm.scape.beta1={b}")), "",
       G + "scape-small-1000steps-1proc.json") for b in ("", "0.7", "0.6")],
    *[(f"tiny, 300 steps, 6 seeds: 99 %, `{v.replace('=', ' ')}`", scape_recipe(f"sharded-scape99@comm.scape.{v}"),
       "within 2 %", G + f) for v, f in [("score=residual", "scape99-screen-1proc.json"),
                                         ("explore=0.3", "scape99-screen-1proc.json"),
                                         ("catch_up=15", "scape99-catchup-1proc.json"),
                                         ("catch_up=20", "scape99-screen-1proc.json"),
                                         ("catch_up=30", "scape99-catchup-1proc.json")]],
    ("tiny, 300 steps, seeds 6–11: 90 %, the defaults", scape_recipe("sharded-scape90"), "within 1 %, each seed 2 %",
     G + "scape-fidelity-seeds6-11-1proc.json"),
    ("the same: 99 %, `catch_up 10`", scape_recipe("sharded-scape99"), "within 2 %",
     G + "scape-fidelity-seeds6-11-1proc.json"),
    ("the same: 99 %, `catch_up 20`", scape_recipe(CU20), "within 2 %", G + "scape99-catchup20-tiny-seeds6-11-1proc.json"),
    ("tiny, 300 steps, 12 seeds (1337, 1–11): 99 %, `catch_up 10`",
     scape_recipe_seeds(S99, (G + "scape-fidelity-seeds6-11-1proc.json", "sharded-scape99")), "within 2 %",
     G + "scape-fidelity-1proc.json"),
    ("the same: 99 %, `catch_up 20` (the defaults)", scape_recipe_seeds(CU20, G + "scape99-catchup20-tiny-seeds6-11-1proc.json"),
     "within 2 %", G + "scape99-screen-1proc.json"),
    ("tiny, 1000 steps, 3 seeds: 99 %, `catch_up 20`", scape_recipe(CU20), "", G + "scape99-catchup20-tiny-1000steps-1proc.json"),
    ("small, 300 steps, 3 seeds: 99 %, `catch_up 20`", scape_recipe(CU20), "within 2 %", G + "scape99-catchup20-small-1proc.json"),
]
# what the defaults give, on every setup they ran on (docs/scape.md; the variants: docs/scape-record.md)
TABLES["scape_defaults"] = [
    ("bytes a step vs dense sharded AdamS once the warm-up is over, 90 % / 99 % sparse",
     lambda d: bytes_vs("sharded-scape90x2", "sharded-adamsx2")(d) + " / " + bytes_vs("sharded-scape99x2", "sharded-adamsx2")(d),
     "≤ 0.1× at 90 %", F_SCAPE),
    ("90 %, tiny, 300 steps, 2 gloo ranks, the GPU host's 16 cores (bytes: over the whole run, warm-up included)",
     scape_recipe_seeds(W90, F_SCAPE_W2), "within 1 %, each seed 2 %", F_SCAPE_W),
    ("90 %, tiny, 300 steps, one process, H100", scape_recipe_seeds("sharded-scape90", G + "scape-fidelity-seeds6-11-1proc.json"),
     "within 1 %, each seed 2 %", G + "scape-fidelity-1proc.json"),
    ("90 %, small, 300 steps, 2 gloo ranks, 2-core host", scape_recipe_seeds(W90, F_SCAPE_SMALL12), "within 1 %, each seed 2 %",
     F_SCAPE_SMALL),
    ("90 %, small, 300 steps, one process, H100", scape_recipe("sharded-scape90"), "within 1 %, each seed 2 %",
     G + "scape-small-1proc.json"),
    ("99 %, tiny, 300 steps, the 2-core host's text: 2 gloo ranks, 2-core host", scape_recipe(CU20), "within 2 %", F_SCAPE99_SCREEN),
    ("the same text: one process, 2-core host", scape_recipe_seeds("sharded-scape99", F_SCAPE99_1P_B), "within 2 %", F_SCAPE99_1P),
    ("the same text: one process, H100", scape_recipe_seeds("sharded-scape99"), "within 2 %", F_SCAPE99_GPU_CPUTEXT),
    ("the same text: every run above", SCAPE99_TEXT_CPU, "within 2 %", F_SCAPE99_SCREEN),
    ("99 %, tiny, 300 steps, the GPU host's text: 2 gloo ranks, its 16 cores", scape_recipe(CU20), "within 2 %",
     F_SCAPE99_CU20),
    ("the same text: one process, H100", scape_recipe_seeds(CU20, F_SCAPE99_GPU[1]), "within 2 %", F_SCAPE99_GPU[0]),
    ("the same text: one process, 2-core host", scape_recipe_seeds("sharded-scape99"), "within 2 %", F_SCAPE99_CPU_GPUTEXT),
    ("the same text: every run above", SCAPE99_TEXT_GPU, "within 2 %", F_SCAPE99_CU20),
    ("99 %, small, 300 steps, one process, H100", scape_recipe(CU20), "within 2 %", G + "scape99-catchup20-small-1proc.json"),
    ("90 %, tiny, 1000 steps, one process, H100", scape_recipe("sharded-scape90"), "", G + "scape-1000steps-1proc.json"),
    ("99 %, tiny, 1000 steps, one process, H100", scape_recipe(CU20), "", G + "scape99-catchup20-tiny-1000steps-1proc.json"),
    ("the same, 6 seeds, on the 2-core host's text", scape_recipe("sharded-scape99"), "",
     "comm/2026-12-07_H100-80GB-HBM3_scape99-cpu-corpus-1000steps-1proc.json"),
]
# what each part of the defaults buys, measured with and without it (docs/scape.md)
V1000 = G + "scape99-1000steps-variants-1proc.json"
TABLES["scape_design"] = [
    ("90 %, tiny, 2 ranks, 16-core host (the GPU host's text): the masked updates at the optimizer's β1 0.9, no warm-up",
     scape_recipe("sharded-scape90"), "", F_SCAPE6),
    ("the same with `beta1 0.8` (the default)", scape_recipe("sharded-scape90"), "",
     "comm/2026-12-06_cpu_scape-fidelity-beta1-16core.json"),
    ("the same with the density warm-up, 100 steps (the default)", scape_recipe_seeds(W90, F_SCAPE_W2), "", F_SCAPE_W),
    ("99 %, 2-core host, 3 seeds: no warm-up, `catch_up 10`", scape_recipe("sharded-scape99@comm.scape.beta1=0.8"), "",
     "comm/2026-12-06_cpu_scape99-fidelity-beta1.json"),
    ("the same host, 6 seeds: a 200-step warm-up (the default), `catch_up 10`", scape_recipe("sharded-scape99"), "",
     F_SCAPE99_2C),
    ("90 % / 99 %, β1 0.9, no warm-up, 3 seeds: `catch_up_mode steps`", scape_fidelity, "",
     "comm/2026-12-05_cpu_scape-defaults.json"),
    ("the same with `catch_up_mode sign` (the default)", scape_fidelity, "", "comm/2026-12-05_cpu_scape-sign.json"),
    ("99 %, 2 ranks on two CPU hosts, 12 runs: `catch_up 10`", SCAPE99_BOTH, "", F_SCAPE99_2C),
    ("the same with `catch_up 20` (the default at 99 %)", SCAPE99_CU20_BOTH, "", F_SCAPE99_SCREEN),
    ("99 %, tiny, 1000 steps, one process, H100, `catch_up 10`: `score m`",
     scape_recipe(S99 + ";comm.scape.score=m"), "", V1000),
    ("the same with `score m_age` (the default)", scape_recipe(S99), "", V1000),
]
SUMMARIES = {"scape_defaults", "scape_design"}  # (rows from many files: no list of commands under them)
TABLES["scape300"] = [(what, scape_hypothesis(key), "within 1 %", F_SCAPE300) for what, key in SCAPE300]

PAGES = {"README.md": ["readme", "timings"], "docs/forge.md": ["forge", "forge_accum"], "docs/agoq.md": ["agoq"],
         "docs/sdp4bit.md": ["sdp4bit"], "docs/scape.md": ["scape_defaults", "scape_design"],
         "docs/scape-record.md": ["scape", "scape6", "scape_beta1", "scape_warmup", "scape_gpu", "scape300"], "docs/gift.md": ["gift"],
         "docs/chunkft.md": ["chunkft"], "docs/memory.md": ["memory"], "docs/fsdp.md": ["fsdp"], "docs/zo.md": ["zo"], "docs/benchmarks.md": ["ops"],
         "docs/compatibility.md": ["grid"]}


def link(page: str, rel: str) -> str:
    base = "benchmarks/results/" if page == "README.md" else "../benchmarks/results/"
    return f"[`{rel}`]({base}{rel})"


def grid_table(page: str) -> str:
    """The compatibility grid of the newest ``grid/*_cpu.json`` (tests/test_grid.py writes it): ✓ where
    the cell's test passes, else a numbered note with the sentence the user gets."""
    rel = sorted(p.relative_to(RESULTS).as_posix() for p in RESULTS.glob("grid/*_cpu.json"))[-1]
    data = load(rel)
    cols, notes = data["columns"], {}
    lines = ["| recipe | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for recipe, row in data["grid"].items():
        cells = []
        for c in cols:
            if row[c] == "ok":
                cells.append("✓")
            else:
                n = notes.setdefault(row[c], len(notes) + 1)
                cells.append(f"✗ {n}")
        lines.append(f"| {recipe} | " + " | ".join(cells) + " |")
    lines += ["", f"From {link(page, rel)} (`{data['command']}`). What a ✗ says:", ""]
    lines += [f"{n}. {msg}" for msg, n in notes.items()]
    return "\n".join(lines)


def table(name: str, page: str) -> str:
    if name == "grid":
        return grid_table(page)
    if name == "memory":
        return memory_table([F_MEM128, F_MEM])
    if name == "memory_profile":
        return profile_table(F_PROFILE, page)
    if name == "forge_accum":
        return forge_accum_table(load("forge/2026-12-05_cpu_accum.json"))
    cache: dict[str, dict] = {}
    lines = ["| what | measured | target | from |", "|---|---|---|---|"]
    for what, fn, target, rel in TABLES[name]:
        data = cache.setdefault(rel, load(rel))
        lines.append(f"| {what} | {fn(data)} | {target or '—'} | {link(page, rel)} |")
    cmds = []
    for rel in dict.fromkeys(f for r in TABLES[name] for f in (r[3], *getattr(r[1], "more", ()))):
        cache.setdefault(rel, load(rel))
        for cmd in cache[rel].get("commands") or [cache[rel].get("command")]:
            if cmd:
                cmds.append(f"- `{rel}`: `{cmd}`")
    if name in SUMMARIES:
        lines += ["", "The command of each file: [the results index](../benchmarks/results/INDEX.md)."]
    elif cmds and name != "readme":
        lines += ["", "Commands:", "", *cmds]
    return "\n".join(lines)


BLOCK = re.compile(r"(<!-- generated:(\w+) -->\n)(.*?)(<!-- /generated -->)", re.S)


def render(page: str, text: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + table(m.group(2), page) + "\n" + m.group(4), text)


def index() -> str:
    lines = ["# Benchmark results", "", "Generated by `python benchmarks/report.py` from the files below; do not edit.",
             "Names: `<topic>/<date>_<hardware>[_<what>].json`, with `.md` / `.png` beside where a script writes them.",
             "", "| topic | date | hardware | file | what | command |", "|---|---|---|---|---|---|"]
    for p in sorted(RESULTS.glob("*/*.json")):
        d = json.loads(p.read_text())
        date, hw = p.stem.split("_")[:2]
        extra = ", ".join(f"[{q.suffix[1:]}]({q.relative_to(RESULTS)})" for q in sorted(p.parent.glob(p.stem + ".*"))
                          if q.suffix != ".json")
        name = f"[{p.name}]({p.relative_to(RESULTS)})" + (f" ({extra})" if extra else "")
        cmd = (d.get("command") or "; ".join(d.get("commands", []))) if isinstance(d, dict) else ""
        what = d.get("what", "") if isinstance(d, dict) else ""
        lines.append(f"| {p.parent.name} | {date} | {hw} | {name} | {what} | {'`' + cmd + '`' if cmd else ''} |")
    return "\n".join(lines) + "\n"


def outputs() -> dict[Path, str]:
    out = {RESULTS / "INDEX.md": index()}
    for page in PAGES:
        path = ROOT / page
        if path.exists():
            out[path] = render(page, path.read_text())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a generated block or the index is stale")
    a = ap.parse_args(argv)
    stale = []
    for path, text in outputs().items():
        old = path.read_text() if path.exists() else None
        if old != text:
            stale.append(path.relative_to(ROOT))
            if not a.check:
                path.write_text(text)
    if a.check and stale:
        print("stale (run python benchmarks/report.py): " + ", ".join(map(str, stale)), file=sys.stderr)
        return 1
    if not a.check:
        print("updated: " + (", ".join(map(str, stale)) or "nothing"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

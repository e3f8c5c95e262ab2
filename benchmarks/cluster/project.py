"""The cost model fitted to a cluster sweep, checked on held-out points, projected to the papers' settings.

    python benchmarks/cluster/cluster.py project benchmarks/results/comm-cluster/<date>_cpu-netns.json \
        [--collectives benchmarks/results/comm-cluster/<date>_cpu-netns_collectives.json]

Fit and checks: ``calibrate.py`` (the held-out rates, leave one rate out, the compute's own spread).

Projection: a step on H200s = compute (the 1b preset's measured step, scaled by parameters for
other sizes) + the technique's kernels (measured on one GPU, an H200 or an H100, named in each source) +
communication from :func:`leantrain.comm.cost.estimate_time` at the paper's link rates, with the
ledger's bytes per parameter measured here (steady state) rescaled from this
cluster's layout to the target's (ring: (N-1)/N; intra-node: (g-1)/g; the hierarchical inter-node
stage: (M-1)/M / g) and divided by the efficiency fitted here (capped at 1). The per-collective
efficiencies a "hinge-per-collective" model carries (``--collectives``) are gloo's over TCP and are
not carried over: NCCL's collectives were not measured here. Two figures a row: with no overlap
(every byte after compute: an upper bound on communication's cost) and with the overlap the
fitted model has, carried to the GPU: the collectives the trainer launches during backward
(``calibrate.gradient_ops``) run under the backward (BACKWARD_SHARE of the compute), the rest after it. Every
input's source is written next to it in the output.
"""

from __future__ import annotations

import datetime
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(HERE))
from calibrate import (  # noqa: E402
    PER_COLLECTIVE,
    bytes_by_path,
    compare_models,
    compute_spread,
    fit_and_check,
    leave_one_rate_out,
    point_row,
    repeatability,
    validate_on,
)
from calibrate import markdown as fit_markdown  # noqa: E402
from collectives import per_op  # noqa: E402
from errors import error_sources  # noqa: E402
from errors import markdown as errors_markdown  # noqa: E402

from leantrain.comm.cost import estimate_time  # noqa: E402
from leantrain.config import preset  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SRC_1B = RESULTS / "step" / "2026-12-02_H200_train-1b.json"
SRC_SDP4BIT = RESULTS / "comm" / "2026-11-29_H200_sdp4bit.json"
SRC_GIFT = RESULTS / "comm" / "2026-12-06_H100-80GB-HBM3_gift-cost.json"
SRC_SCAPE = RESULTS / "comm" / "2026-12-06_H100-80GB-HBM3_scape-cost.json"
SCAPE_BUCKET_MB = "200"  # the scape-cost run the projection takes (dist.bucket_mb 200; the default 25 is slower)

# the papers' settings, as issue 46 states them; the claim is the paper's headline figure
SETTINGS = [
    {"paper": "SDP4Bit", "recipes": ["sharded-sdp4bit"], "gpus": 128, "per_node": 8, "inter_GBps": 25.0,
     "params": "1b", "claim": "4.08x end-to-end throughput"},
    {"paper": "SCAPE", "recipes": ["scape-90", "scape-99"], "gpus": 32, "per_node": 8, "inter_GBps": 25.0,
     "params": 1.8e9, "claim": "3.26x a step (Llama-1.8B)"},
    {"paper": "GIFT", "recipes": ["gift-e4m3", "gift-nvfp4", "gift-e4m3-tuned", "gift-nvfp4-tuned"], "gpus": 64,
     "per_node": 8, "inter_GBps": 25.0, "params": "1b", "claim": "7.6 %"},
]
# a recipe projected with another recipe's measured bytes (the same wire format, other compute settings)
BYTES_OF = {"gift-e4m3-tuned": "gift-e4m3", "gift-nvfp4-tuned": "gift-nvfp4"}
TUNED_GIFT = {"min_gain": "1.2", "transform_dtype": "tfloat32", "stat_tokens": 1024}
INTRA_GBPS = 450.0  # estimate_time's NVLink default (H100/H200, per direction)
BACKWARD_SHARE = 2 / 3  # of a step's compute: backward does about twice the forward's FLOPs


# ---------------------------------------------------------------- GPU inputs, each from a file


def gpu_inputs() -> dict:
    """The compute time of a step (the 1b preset on one H200) and each technique's kernels a step and
    rank, each from a committed measurement on one GPU (the device is in each source)."""
    d = json.loads(SRC_1B.read_text())
    key = "baseline"
    batch = int(re.search(r"--data.batch-size (\d+)", d["command"]).group(1))
    seq = preset("1b").data.seq_len
    run = d["runs"][key]["summary"]
    step_1b = batch * seq / run["tokens_per_second"]
    sdp = json.loads(SRC_SDP4BIT.read_text())
    g = json.loads(SRC_GIFT.read_text())
    sc = json.loads(SRC_SCAPE.read_text())
    g_dev, sc_dev = g["env"]["device"], sc["env"]["device"]
    refresh_every = preset("1b").comm.gift.refresh_every
    world = next(s["gpus"] for s in SETTINGS if s["paper"] == "GIFT")
    layers = sum(g["shapes"].values())
    share = -(-layers // world) / layers  # the busiest rank roots ceil(layers / world) layers' statistics and refreshes
    step = g["step_ms"]
    codec = g["model_codecs_ms"]

    def gift(transforms_ms: float, stats_ms: float, fmt: str) -> float:
        per_refresh = (stats_ms + g["model"]["refresh_subspace_warm_ms"]) * share
        return (transforms_ms + per_refresh / refresh_every + codec[f"{fmt}_quantize_ms"]
                + codec[f"{fmt}_dequantize_ms"]) / 1e3

    tr = g["gift_transforms"]["min_gain"]
    default_tr, tuned_tr = tr["0"]["float32"]["ms"], tr[TUNED_GIFT["min_gain"]][TUNED_GIFT["transform_dtype"]]["ms"]
    stats_all = step["with_statistics"] - step["plain"]
    stats_tuned = step[f"with_statistics_{TUNED_GIFT['stat_tokens']}_tokens"] - step["plain"]
    sc_runs = sc["runs"][SCAPE_BUCKET_MB]
    gift_src = (f"{SRC_GIFT.relative_to(ROOT)} ({g_dev}, 1b, B=4): GIFT's own transforms a step (gift_transforms) + "
                f"(the statistics' extra forward + backward (step_ms) + a warm refresh) x {share:.3f} (the busiest "
                f"rank's share of the {layers} layers' roots at {world} ranks) / refresh_every {refresh_every} + the "
                "codec's quantize + dequantize of the model's gradients")
    return {
        "step_1b_s": step_1b, "params_1b": run["parameters"],
        "step_1b_source": f"{SRC_1B.relative_to(ROOT)}: runs[{key!r}], {run['tokens_per_second']:.0f} tokens/s "
                          f"at B={batch}, T={seq} (torch.optim.AdamW, bf16)",
        "kernels_s": {
            "sharded-sdp4bit": sdp["estimate"]["450/25"]["sdp4bit_compute_s"],
            "gift-e4m3": gift(default_tr, stats_all, "e4m3"),
            "gift-nvfp4": gift(default_tr, stats_all, "nvfp4"),
            "gift-e4m3-tuned": gift(tuned_tr, stats_tuned, "e4m3"),
            "gift-nvfp4-tuned": gift(tuned_tr, stats_tuned, "nvfp4"),
            "scape-90": sc_runs["scape-90"]["extra_ms"] / 1e3,
            "scape-99": sc_runs["scape-99"]["extra_ms"] / 1e3,
        },
        "kernels_source": {
            "sharded-sdp4bit": f"{SRC_SDP4BIT.relative_to(ROOT)}: estimate['450/25'].sdp4bit_compute_s "
                               "(encode/reduce/decode of a 1b step on one H200)",
            "gift-e4m3": f"{gift_src}; the defaults (every layer whitened, float32 transforms, statistics of every token)",
            "gift-nvfp4": "the same, NVFP4 codec",
            "gift-e4m3-tuned": f"the same with min_gain {TUNED_GIFT['min_gain']}, transform_dtype "
                               f"{TUNED_GIFT['transform_dtype']}, stat_tokens {TUNED_GIFT['stat_tokens']} (bytes: "
                               "gift-e4m3's)",
            "gift-nvfp4-tuned": "the same, NVFP4 codec (bytes: gift-nvfp4's)",
            "scape-90": f"{SRC_SCAPE.relative_to(ROOT)} ({sc_dev}): the sharded optimizer's step as rank 0 of "
                        f"{sc['world']} for {sc['params'] / 1e9:.2f} B parameters, collectives as local copies, minus "
                        f"the dense step's, buckets of {SCAPE_BUCKET_MB} MiB (dist.bucket_mb; at the default 25 MiB: "
                        f"+{sc['runs']['25']['scape-90']['extra_ms']:.0f} ms)",
            "scape-99": f"the same (at 25 MiB: +{sc['runs']['25']['scape-99']['extra_ms']:.0f} ms)",
        },
    }


# ---------------------------------------------------------------- bytes at another scale


def rescale(bpp: dict, params: float, src: tuple[int, int], dst: tuple[int, int]) -> dict:
    """Bytes by scope for ``params`` parameters on ``dst = (nodes, per_node)`` from ``src``'s."""
    (m0, g0), (m1, g1) = src, dst
    n0, n1 = m0 * g0, m1 * g1
    f = {"world": ((n1 - 1) / n1) / ((n0 - 1) / n0),
         "intra": ((g1 - 1) / g1) / ((g0 - 1) / g0) if g0 > 1 else 0.0,
         "inter": ((m1 - 1) / m1 / g1) / ((m0 - 1) / m0 / g0) if m0 > 1 else 0.0}
    return {k: v * params * f[k] for k, v in bpp.items() if not k.startswith("_")}


def comm_time(doc: dict, recipe: str, params: float, setting: dict, efficiency: float, scale: float = 1.0):
    """``({"backward": s, "after": s}, bytes by scope)`` of ``recipe``'s communication a step in
    ``setting``."""
    nodes = setting["gpus"] // setting["per_node"]
    seconds, total = {}, {}
    for path, bpp in bytes_by_path(doc, BYTES_OF.get(recipe, recipe)).items():
        b = rescale(bpp, params, (doc["nodes"], doc["ranks_per_node"]), (nodes, setting["per_node"]))
        b = {k: v * scale for k, v in b.items()}
        t = estimate_time(b, intra_GBps=INTRA_GBPS, inter_GBps=setting["inter_GBps"], alpha_us=0.0, nodes=nodes)
        seconds[path] = t["total"] / efficiency
        for k, v in b.items():
            total[k] = total.get(k, 0.0) + v
    return seconds, total


def step_time(compute: float, kernels: float, comm: dict, overlap: bool) -> float:
    """A step: compute, kernels, then the communication not hidden under the backward."""
    hidden = BACKWARD_SHARE * compute if overlap else 0.0
    return compute + kernels + comm["after"] + max(0.0, comm["backward"] - hidden)


def project(doc: dict, model, gpu: dict) -> list[dict]:
    eff = min(model.efficiency, 1.0)
    out = []
    for s in SETTINGS:
        params = gpu["params_1b"] if s["params"] == "1b" else s["params"]
        compute = gpu["step_1b_s"] * params / gpu["params_1b"]
        for r in s["recipes"]:
            ref = doc["reference"][BYTES_OF.get(r, r)]
            c_ref, b_ref = comm_time(doc, ref, params, s, eff)
            c_ref16, _ = comm_time(doc, ref, params, s, eff, scale=0.5)
            c_t, b_t = comm_time(doc, r, params, s, eff)
            k = gpu["kernels_s"][r]
            row = {"paper": s["paper"], "recipe": r, "reference": ref, "gpus": s["gpus"], "per_node": s["per_node"],
                   "inter_GBps": s["inter_GBps"], "intra_GBps": INTRA_GBPS, "params": params, "compute_s": compute,
                   "kernels_s": k, "comm_ref_s": c_ref, "comm_ref_bf16_s": c_ref16, "comm_s": c_t,
                   "bytes_ref": b_ref, "bytes": b_t, "claim": s["claim"],
                   "speedup_comm_only": sum(c_ref.values()) / sum(c_t.values()) if sum(c_t.values()) else None}
            for tag, overlap in (("", True), ("_no_overlap", False)):
                t_ref, t_t = step_time(compute, 0.0, c_ref, overlap), step_time(compute, k, c_t, overlap)
                t_ref16 = step_time(compute, 0.0, c_ref16, overlap)
                row |= {f"step_ref_s{tag}": t_ref, f"step_s{tag}": t_t, f"speedup{tag}": t_ref / t_t,
                        f"speedup_vs_bf16_ref{tag}": t_ref16 / t_t}
            out.append(row)
    return out


def _assumptions(m, gpu: dict) -> list[str]:
    if m.op_efficiency:
        efficiency = (f"divided by the efficiency fitted here over the collectives' own ({m.efficiency:.3f}, capped "
                      "at 1), and not by gloo's per-collective efficiencies measured here ("
                      + ", ".join(f"{op} {e:.2f}" for op, e in m.op_efficiency.items())
                      + "): those are gloo's algorithms over TCP on these links (its all-to-all and all-gather often "
                      "send one direction after the other), not NCCL's, which were not measured")
    else:
        efficiency = (f"divided by the efficiency fitted here ({m.efficiency:.3f}, capped at 1): the share of the "
                      "nominal rate gloo over TCP reached on the shaped links, assumed for NCCL on the papers' networks")
    return [
        f"compute: the 1b preset's step on one H200, {gpu['step_1b_s'] * 1e3:.1f} ms ({gpu['step_1b_source']}); "
        "other sizes scaled by parameter count; the same for every recipe (the optimizer step's differences ignored)",
        "kernels: " + "; ".join(f"{r} {gpu['kernels_s'][r] * 1e3:.1f} ms ({gpu['kernels_source'][r]})"
                                for r in gpu["kernels_s"]),
        f"communication: bytes per parameter and scope from this sweep's ledger (fp32 weights and gradients; "
        f"SCAPE's dense first step taken out), rescaled to the target layout "
        f"(ring (N-1)/N, intra (g-1)/g, inter (M-1)/M/g), times the parameters; time by "
        f"leantrain.comm.cost.estimate_time at {INTRA_GBPS:g} GB/s intra-node (its NVLink default) and the paper's "
        f"inter-node rate per GPU, {efficiency}",
        f"overlap (the 'step speedup' column): the collectives the trainer launches during backward (DDP's buckets, "
        f"the sharded optimizer's gradient reduce-scatter / SDP4Bit's all-to-all) hide under the backward, "
        f"{BACKWARD_SHARE:.2f} of the compute; the weights' all-gather (SCAPE's mask with it) and GIFT's reduction run "
        "after it. The fitted hidden times are not carried over (they are CPU seconds of this host); the structure "
        "is. 'no overlap': every byte after compute, an upper bound on communication's cost",
        "no latency term: not measurable on this cluster (its kernel has no netem, and a recipe's calls per step do "
        "not change with the rate); a technique and its reference launch collectives per bucket alike, so latency "
        "would add about the same time to both steps and lower every speedup somewhat",
        "vs a bf16 reference: the uncompressed reference sending bf16 (half its measured fp32 bytes), as the papers' "
        "baselines do",
    ]


def write_projection(json_path: Path, holdout: str = "300mbit", validate: tuple[Path, ...] = (),
                     collectives: Path | None = None) -> list[Path]:
    """The fit, its checks (and, for each sweep in ``validate``, its prediction of that sweep's
    points) and the projection, as ``<today>_<hardware>_projection.{json,md}`` beside ``json_path``.
    With ``collectives`` (a ``cluster.py collectives`` result) the model is "hinge-per-collective":
    each collective's efficiency is the result's mean over its rates and sizes."""
    doc = json.loads(Path(json_path).read_text())
    coll = per_op(json.loads(Path(collectives).read_text())) if collectives else None
    variant = PER_COLLECTIVE if coll else "hinge"
    fc = fit_and_check(doc, holdout, variant, coll)
    fc["compute_spread"] = compute_spread(doc, fc)
    fc["repeatability"] = repeatability(doc)
    fc["validation"] = [validate_on(doc, json.loads(Path(v).read_text()), variant, coll) for v in validate]
    comparison = compare_models(doc, holdout, coll)
    cv = leave_one_rate_out(doc, variant, coll)
    m = fc["model"]
    sources = error_sources(doc, cv, m, lambda p: point_row(doc, p, variant, coll))
    gpu = gpu_inputs()
    proj = project(doc, m, gpu)
    hardware = Path(json_path).stem.split("_", 1)[-1]  # the sweep's <date>_<hardware>
    base = Path(json_path).parent / f"{datetime.date.today().isoformat()}_{hardware}_projection"
    per = ", each collective at its efficiency measured alone" if coll else ""
    doc_out = {"what": f"the step-time cost model (alpha-beta with overlap under compute{per}) fitted to the {hardware} "
                       f"sweep, its errors on held-out points ({holdout}; leave one rate out), and its projection "
                       "to SDP4Bit's, SCAPE's and GIFT's settings",
               "source": _source(json_path),
               "command": f"python benchmarks/cluster/cluster.py project {json_path} --holdout {holdout}"
                          + "".join(f" --validate {v}" for v in validate)
                          + (f" --collectives {collectives}" if collectives else ""),
               "fit": {"variant": variant, "compute_s": m.compute_s, "hidden_s": m.hidden_s,
                       "overlapped_recipes": fc["overlap"], "efficiency": m.efficiency, "op_efficiency": m.op_efficiency,
                       "collectives": _source(collectives) if collectives else None, "collectives_per_op": coll, "alpha_s": m.alpha_s, "alpha_fitted": m.alpha_fitted,
                       "kernel_overhead_s": fc["kernel_overhead_s"], "holdout_rate": holdout,
                       "held_out_summary": fc["summary"], "held_out_link_bound_summary": fc["link_bound"],
                       "compute_spread": fc["compute_spread"], "repeatability": fc["repeatability"],
                       "validation": fc["validation"],
                       "fit_points": fc["fit"], "held_out_points": fc["held_out"]},
               "leave_one_rate_out": cv, "error_sources": sources, "model_comparison": comparison, "gpu": gpu, "assumptions": _assumptions(m, gpu), "projection": proj}
    Path(f"{base}.json").write_text(json.dumps(doc_out, indent=1))
    Path(f"{base}.md").write_text(markdown(doc_out, fc, cv, comparison))
    return [Path(f"{base}.json"), Path(f"{base}.md")]


def _source(path: Path) -> str:
    src = Path(path).resolve()
    return str(src.relative_to(ROOT)) if src.is_relative_to(ROOT) else str(src)


def markdown(d: dict, fc: dict, cv: dict, comparison: list[dict]) -> str:
    L = ["# The cost model: fit, held-out check, projection to the papers' settings", "",
         f"Command: `{d['command']}` (measurements: `{d['source']}`)", "", *fit_markdown(fc, cv, comparison),
         *errors_markdown(d["error_sources"])]
    f = d["fit"]
    pts = f["fit_points"] + f["held_out_points"]
    L += ["The model's share of each step spent on the link (link time not hidden, over the predicted step):", "",
          "| rate | " + " | ".join(f["compute_s"]) + " |", "|---|" + "---|" * len(f["compute_s"])]
    for rate in dict.fromkeys(p["rate"] for p in pts):
        share = {p["recipe"]: p["comm_share_model"] for p in pts if p["rate"] == rate}
        L.append(f"| {rate} | " + " | ".join(f"{share[r]:.0%}" if r in share else "–" for r in f["compute_s"]) + " |")
    L += ["",
          "## Projection to the papers' settings", "",
          "| paper (claim) | recipe vs reference | GPUs (per node) | inter GB/s | params | compute ms | kernels ms | "
          "comm ms ref / technique (in backward + after) | step speedup | no overlap | vs a bf16 reference |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]

    def ms(c):
        return f"{c['backward'] * 1e3:.0f}+{c['after'] * 1e3:.0f}"

    for p in d["projection"]:
        L.append(f"| {p['paper']} ({p['claim']}) | {p['recipe']} vs {p['reference']} | {p['gpus']} ({p['per_node']}) | "
                 f"{p['inter_GBps']:g} | {p['params'] / 1e9:.2f} B | {p['compute_s'] * 1e3:.0f} | "
                 f"{p['kernels_s'] * 1e3:.1f} | {ms(p['comm_ref_s'])} / {ms(p['comm_s'])} | "
                 f"{p['speedup']:.2f}x | {p['speedup_no_overlap']:.2f}x | {p['speedup_vs_bf16_ref']:.2f}x |")
    L += ["", "Assumptions:", ""] + [f"- {a}" for a in d["assumptions"]]
    return "\n".join(L) + "\n"

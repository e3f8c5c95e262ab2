"""The cluster benchmark's harness (benchmarks/cluster/) end to end on a tiny model, and the cost
model's fit on synthetic data.

The harness test is plain torchrun on loopback (``--local``: no namespaces, no shaping), so it runs
without root; the namespace variant runs only as root and is skipped, with the reason, elsewhere.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dist_utils import once_more_on_gloo_abort
from helpers import TINY_OVERRIDES

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "cluster" / "cluster.py"
MODEL = ["--model.dim", "48", "--model.n-layers", "2", "--model.n-heads", "4", "--model.n-kv-heads", "2",
         "--model.ffn-dim", "96", "--model.max-seq-len", "64", "--data.seq-len", "32", "--data.batch-size", "4",
         "--data.tokenizer-vocab", TINY_OVERRIDES["data.tokenizer_vocab"]]


def _run(tmp_path, corpus, *extra, recipe="ddp-fp32", steps=3):
    out = tmp_path / f"{recipe}.json"
    cmd = [sys.executable, str(SCRIPT), "run", "--ranks-per-node", "2", "--steps", str(steps), "--recipe", recipe, *extra,
           "--out", str(out), "--", "--preset", "tiny", "--data", str(corpus), *MODEL]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    r = once_more_on_gloo_abort(lambda: subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300))
    return r, out


def _check_point(p, world, steps=3):
    assert p["world_size"] == world and p["steps"] == steps
    assert p["step_time_s"] > 0 and len(p["step_times_s"]) == steps - 1
    assert p["ledger_bytes_per_step"] > 0
    assert math.isfinite(p["val_loss"]) and p["val_loss"] < p["initial_val_loss"] + 0.1
    assert p["commands"] and "leantrain train" in p["commands"][0]


@pytest.mark.distributed
def test_local_sweep_writes_the_table_of_speedups_over_each_reference(corpus, tmp_path):
    """``sweep --local`` (the grid a machine of several GPUs runs over NCCL) on 2 gloo ranks: one
    point a recipe, its speedup over its reference in the table, and no wire counters or link share
    (loopback carries every process's traffic, and nothing is shaped)."""
    cmd = [sys.executable, str(SCRIPT), "sweep", "--local", "--ranks-per-node", "2", "--steps", "3",
           "--recipes", "sharded,sharded-sdp4bit", "--allow-busy", "--busy-wait", "0", "--out", str(tmp_path),
           "--", "--preset", "tiny", "--data", str(corpus), *MODEL]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    r = once_more_on_gloo_abort(lambda: subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    (path,) = tmp_path.glob("*-local.json")
    doc = json.loads(path.read_text())
    assert doc["local"] and doc["backend"] == "gloo" and doc["nodes"] == 1
    ref, q = doc["points"]
    for p in (ref, q):
        _check_point(p, world=2)
        assert p["rate"] == "unshaped" and "wire_tx_bytes_per_step" not in p
    assert (ref["recipe"], q["recipe"]) == ("sharded", "sharded-sdp4bit")
    assert q["ledger_bytes_per_step"] < 0.5 * ref["ledger_bytes_per_step"]  # (4-bit weights and 8/4-bit gradients)
    table = path.with_suffix(".md").read_text()
    assert "2 ranks under one plain torchrun (gloo" in table
    speedup = f"{ref['step_time_s'] / q['step_time_s']:.2f}"
    row = next(line for line in table.splitlines() if line.startswith("| unshaped | sharded-sdp4bit |"))
    assert speedup in row and "| – |" in row  # (no wire counters, no link share)
    at = cmd.index("--recipes") + 1
    for recipes, said in [("sharded-sdp4bit", "lacks the references ['sharded']"), ("sharded,ddp-fp33", "unknown recipes ['ddp-fp33']")]:
        bad = subprocess.run([*cmd[:at], recipes, *cmd[at + 1:]], env=env, capture_output=True, text=True, timeout=60)
        assert bad.returncode != 0 and said in bad.stderr, bad.stderr[-2000:]


@pytest.mark.distributed
def test_local_run_through_phases_pairs_each_rate_with_the_unlimited_link(corpus, tmp_path):
    """A run through phases (``--rates``): one point per rate and the pooled unshaped one; each rate's
    point carries the mean of the two reference phases around it. ``--local`` never shapes the link,
    so only the bookkeeping is checked here (the namespace test below shapes it)."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "cluster"))
    from phases import WARMUP_STEPS, schedule, timed_rows

    r, out = _run(tmp_path, corpus, "--local", "--rates", "100mbit,30mbit", "--phase-steps", "2")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    pts = json.loads(out.read_text())["points"]
    assert [p["rate"] for p in pts] == ["unshaped", "100mbit", "30mbit"]
    assert schedule(["100mbit", "30mbit"]) == ["unshaped", "100mbit", "unshaped", "30mbit", "unshaped"]
    # phase 1: the rows after the warm-up's and phase 0's; its first settles after the change, the second is timed
    assert list(timed_rows(1, 2)) == [WARMUP_STEPS + 3]
    ref, *shaped = pts
    assert ref["steps"] == WARMUP_STEPS + 5 * 2 and len(ref["step_times_s"]) == 3 and ref["phases"] == [0, 2, 4]
    assert len(ref["row_times_s"]) == ref["steps"]
    medians = ref["reference_phase_medians_s"]
    for p, (before, after) in zip(shaped, [(0, 1), (1, 2)], strict=True):
        assert len(p["step_times_s"]) == 1 and p["paired_rate_bps"] is None
        assert p["paired_step_s"] == pytest.approx((medians[before] + medians[after]) / 2)
        assert p["other_cpu_cores"] >= 0.0
    assert ref["ledger_calls_per_step"]["all_reduce"] >= 1


@pytest.mark.distributed
@pytest.mark.slow
def test_namespace_run_counts_the_bytes_on_the_veth(corpus, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root; the --local test covers the harness without them")
    r, out = _run(tmp_path, corpus, "--nodes", "2", "--rate", "1gbit", steps=24)
    if r.returncode == 2:
        pytest.skip(f"no namespace rights here: {r.stderr.strip()}")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    p = json.loads(out.read_text())
    _check_point(p, world=4, steps=24)
    # an all-reduce over 2 nodes: each node's link carries one rank's share (a ring's hop to the other
    # node; the small preset measures 1.00-1.01x), plus TCP/IP headers. The bounds are loose: this tiny
    # model's steps (~15 ms) are shorter than the harness's 20 ms poll, so the counted window is only
    # roughly aligned with steps; over 22 counted steps a few steps' misalignment stays inside the bounds
    # (over 6 it did not on a busy host). The hop between the node's own ranks is on its loopback.
    led = p["ledger_bytes_per_step"]
    for tx, lo in zip(p["wire_tx_bytes_per_step"], p["loopback_bytes_per_step"], strict=True):
        assert 0.5 * led < tx < 2.0 * led + 20_000
        assert lo > 0.5 * led


def test_refuses_without_rights_in_one_sentence(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("running as root: the refusal path is not reachable")
    r = subprocess.run([sys.executable, str(SCRIPT), "run", "--rate", "1gbit", "--", "--preset", "tiny"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "root" in r.stderr


def test_cost_fit_recovers_known_alpha_and_bandwidth():
    import random

    from leantrain.comm.cost import fit_step_model

    rng = random.Random(0)
    alpha, eff, compute = 2e-3, 0.85, {"a": 0.7, "b": 1.1, "c": 0.4}
    rows = []
    for recipe, c in compute.items():
        for rate in (1e8, 3e8, 1e9, 1e10):
            wire, calls = rng.uniform(1e6, 1e8), rng.randint(2, 40)
            t = c + alpha * calls + 8 * wire / (eff * rate)
            rows.append({"recipe": recipe, "rate_bps": rate, "wire_bytes": wire, "calls": calls,
                         "step_time_s": t * (1 + rng.gauss(0, 0.002))})
    m = fit_step_model(rows)
    assert abs(m.alpha_s - alpha) < 0.1 * alpha
    assert abs(m.efficiency - eff) < 0.02
    for recipe, c in compute.items():
        assert abs(m.compute_s[recipe] - c) < 0.02
    for r in rows:
        assert abs(m.predict(r) - r["step_time_s"]) < 0.02 * r["step_time_s"]


def _hinge_rows(rng, compute, hidden, eff, rates=(3e7, 1e8, 3e8, 1e9, None), noise=0.002):
    rows = []
    for recipe, c in compute.items():
        wire = rng.uniform(2e7, 1e8)
        for rate in rates:
            link = 8 * wire / (eff * rate) if rate else 0.0
            t = c + max(0.0, link - hidden.get(recipe, 0.0))
            rows.append({"recipe": recipe, "rate": f"{rate or 0:g}", "rate_bps": rate, "wire_bytes": wire,
                         "step_time_s": t * (1 + rng.gauss(0, noise))})
    return rows


def test_cost_fit_recovers_known_compute_hidden_time_and_efficiency():
    """Synthetic steps from the hinge model (compute + link time beyond what hides under compute):
    the fit returns the parameters that made them, and 0 hidden time for a recipe it is told does
    not overlap."""
    import random

    from leantrain.comm.cost import fit_step_model

    rng = random.Random(1)
    compute, hidden, eff = {"ddp": 2.0, "sharded": 1.5, "gift": 3.0}, {"ddp": 0.8, "sharded": 1.2}, 0.9
    rows = _hinge_rows(rng, compute, hidden, eff)
    m = fit_step_model(rows, overlap=["ddp", "sharded"])
    assert abs(m.efficiency - eff) < 0.01 and not m.alpha_fitted
    for recipe, c in compute.items():
        assert abs(m.compute_s[recipe] - c) < 0.02 * c
        assert abs(m.hidden_s[recipe] - hidden.get(recipe, 0.0)) < 0.05
    assert m.hidden_s["gift"] == 0.0
    for r in rows:
        assert abs(m.predict(r) / r["step_time_s"] - 1) < 0.01
    # a row whose bytes are all sent after compute (overlap_share 0) pays its whole link time
    r = next(r for r in rows if r["recipe"] == "ddp" and r["rate_bps"] == 1e9)
    assert m.comm_s(dict(r, overlap_share=0.0)) == pytest.approx(m.link_s(r))
    assert m.comm_s(r) == pytest.approx(max(0.0, m.link_s(r) - m.hidden_s["ddp"]))
    # without the hinge the same data read as an efficiency above the true one (the overlap shows
    # up as a faster link) and a worse fit
    flat = fit_step_model(rows)
    assert flat.efficiency > eff + 0.02
    assert max(abs(flat.predict(r) / r["step_time_s"] - 1) for r in rows) > 0.05


# each collective's share of the link's rate, as gloo's measure on the namespace cluster (roughly)
OP_EFFICIENCY = {"all_reduce": 0.95, "all_gather": 0.65, "reduce_scatter": 0.95, "all_to_all": 0.5}
OP_MIX = {"ddp": {"all_reduce": 1.0}, "int8": {"all_to_all": 0.5, "all_gather": 0.5},
          "sharded": {"reduce_scatter": 2 / 3, "all_gather": 1 / 3}, "gift": {"all_to_all": 0.5, "all_gather": 0.5}}


def _per_op_rows(rng, compute, hidden, eff, rates=(3e7, 1e8, 3e8, 1e9), noise=0.002, pair_bps=None):
    """Steps from the per-collective model: each recipe's wire bytes split by OP_MIX, each op's bytes
    at OP_EFFICIENCY times ``eff``; with ``pair_bps`` each row carries its pair (drifting compute)."""
    rows = []
    for recipe, c in compute.items():
        wire = rng.uniform(2e7, 1e8)
        by_op = {op: wire * share for op, share in OP_MIX[recipe].items()}
        bits = 8 * sum(b / OP_EFFICIENCY[op] for op, b in by_op.items())
        for rate in rates:
            c_run = c * (1 + rng.uniform(-0.2, 0.2)) if pair_bps else c
            step = c_run + max(0.0, bits / (eff * rate) - hidden.get(recipe, 0.0))
            row = {"recipe": recipe, "rate": f"{rate:g}", "rate_bps": rate, "wire_bytes": wire,
                   "wire_bytes_by_op": by_op, "step_time_s": step * (1 + rng.gauss(0, noise))}
            if pair_bps:
                pair = c_run + max(0.0, bits / (eff * pair_bps) - hidden.get(recipe, 0.0))
                row |= {"paired_rate_bps": pair_bps, "paired_step_s": pair * (1 + rng.gauss(0, noise))}
            rows.append(row)
    return rows


@pytest.mark.parametrize("paired", [False, True])
def test_cost_fit_recovers_known_per_collective_parameters(paired):
    """Steps whose collectives each reach their own share of the rate (all-to-all half of it): given
    those shares (``op_efficiency``), the fit recovers the efficiency over them, the hidden times and
    the compute, and predicts every row within 1 %; one efficiency for every collective cannot."""
    import random

    from leantrain.comm.cost import fit_step_model

    rng = random.Random(5)
    compute, hidden, eff = {"ddp": 2.0, "int8": 1.0, "sharded": 1.5, "gift": 3.0}, {"ddp": 0.8, "sharded": 1.2}, 0.9
    rows = _per_op_rows(rng, compute, hidden, eff, pair_bps=1e10 if paired else None)
    overlap = ["ddp", "int8", "sharded"]
    m = fit_step_model(rows, overlap=overlap, op_efficiency=OP_EFFICIENCY)
    assert abs(m.efficiency - eff) < 0.01 and m.op_efficiency == OP_EFFICIENCY
    for recipe, c in compute.items():
        assert abs(m.hidden_s[recipe] - hidden.get(recipe, 0.0)) < 0.05
        assert abs(m.compute_s[recipe] / c - 1) < (0.2 if paired else 0.02)
    assert max(abs(m.predict(r) / r["step_time_s"] - 1) for r in rows) < 0.01
    r = rows[0]
    bits = 8 * sum(b / OP_EFFICIENCY[op] for op, b in r["wire_bytes_by_op"].items())
    assert m.link_s(r) == pytest.approx(bits / (m.efficiency * r["rate_bps"]))
    single = fit_step_model(rows, overlap=overlap)
    assert max(abs(single.predict(r) / r["step_time_s"] - 1) for r in rows) > 0.05


def test_cost_fit_without_op_efficiency_ignores_the_split():
    """``op_efficiency=None`` is the one-efficiency model, bit for bit: a row's ``wire_bytes_by_op``
    is not read (here a split that does not even add up to its wire bytes). With every collective at
    efficiency 1 and a split that adds up, the per-collective model is the same model."""
    import random

    from leantrain.comm.cost import fit_step_model

    rng = random.Random(6)
    for rows, overlap in ((_hinge_rows(rng, {"ddp": 2.0, "gift": 3.0}, {"ddp": 0.8}, 0.9), ["ddp"]),
                          (_paired_rows(rng, {"ddp": 2.0, "gift": 3.0}, {"ddp": 0.8}, 0.9), ["ddp"])):
        split = [dict(r, wire_bytes_by_op={"all_to_all": r["wire_bytes"] * 0.3, "all_gather": 1.0}) for r in rows]
        plain = fit_step_model(rows, overlap=overlap)
        assert fit_step_model(split, overlap=overlap) == fit_step_model(split, overlap=overlap, op_efficiency=None) \
            == plain and plain.op_efficiency is None
        assert [plain.predict(r) for r in split] == [plain.predict(r) for r in rows]
        whole = [dict(r, wire_bytes_by_op={"all_reduce": r["wire_bytes"]}) for r in rows]
        ones = fit_step_model(whole, overlap=overlap, op_efficiency={"all_reduce": 1.0})
        assert ones.efficiency == pytest.approx(plain.efficiency, rel=1e-6)
        assert ones.hidden_s == pytest.approx(plain.hidden_s, abs=1e-6)
    with pytest.raises(ValueError, match="no wire_bytes_by_op"):
        fit_step_model(rows, overlap=overlap, op_efficiency={"all_reduce": 1.0})
    with pytest.raises(ValueError, match=r"no efficiency for \['all_to_all'\]"):
        fit_step_model(split, op_efficiency={"all_gather": 0.6})


def test_held_out_points_are_not_used_by_the_fit():
    import random

    from leantrain.comm.cost import fit_step_model, held_out_check

    rng = random.Random(2)
    rows = _hinge_rows(rng, {"a": 1.0, "b": 2.0}, {"a": 0.5}, 0.8, noise=0.02)
    held = lambda r: r["rate"] == "3e+08"  # noqa: E731
    res = held_out_check(rows, held, overlap=["a"])
    assert [p["rate"] for p in res["held_out"]] == ["3e+08", "3e+08"]
    assert all(p["rate"] != "3e+08" for p in res["fit"]) and len(res["fit"]) == len(rows) - 2
    # the held-out rows' times change wildly: the fitted model does not move, only their errors do
    wild = [dict(r, step_time_s=r["step_time_s"] * 7) if held(r) else r for r in rows]
    res2 = held_out_check(wild, held, overlap=["a"])
    assert res2["model"] == res["model"] == fit_step_model([r for r in rows if not held(r)], overlap=["a"])
    assert res2["max_abs_error"] > 0.8
    with pytest.raises(ValueError, match="no row is held out"):
        held_out_check(rows, lambda r: False)


def test_calibration_of_the_committed_sweep_holds_out_its_rates():
    """The committed sweep's fit: the held-out rates' points are exactly the predicted ones, GIFT
    (which reduces after backward) gets no hidden time, and the link-bound held-out points are
    predicted within 15 %."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "cluster"))
    from calibrate import fit_and_check, overlapped_recipes, validate_on

    doc = json.loads((ROOT / "benchmarks/results/comm-cluster/2026-12-04_cpu-netns.json").read_text())
    fc = fit_and_check(doc, "300mbit,30mbit")
    held = {(p["recipe"], p["rate"]) for p in fc["held_out"]}
    assert held == {(p["recipe"], p["rate"]) for p in doc["points"] if p["rate"] in ("300mbit", "30mbit")}
    assert not held & {(p["recipe"], p["rate"]) for p in fc["fit"]}
    assert not {"gift-e4m3", "gift-nvfp4"} & set(overlapped_recipes(doc))
    assert fc["model"].hidden_s["gift-e4m3"] == 0.0 and 0.5 < fc["model"].efficiency <= 1.0
    assert fc["link_bound"]["points"] >= 2 and fc["link_bound"]["max_abs_error"] < 0.15
    # another sweep's points (here: the runs this sweep replaced at 300 Mbit/s) are all predicted, by a
    # model fitted on every point of the first
    other = dict(doc, points=[p for p in doc["replaced_points"] if p["rate"] == "300mbit"])
    v = validate_on(doc, other)
    assert len(v["points"]) == len(other["points"]) == 10
    assert v["efficiency"] != fc["model"].efficiency  # the 300 and 30 Mbit/s points are fitted this time


def _paired_rows(rng, compute, hidden, eff, rates=(3e7, 1e8, 3e8, 1e9), drift=0.2, noise=0.002, pair_bps=1e10):
    """Rows whose compute drifts by up to ``drift`` from run to run, each measured with its pair (the
    same compute, at ``pair_bps``) next to it."""
    rows = []
    for recipe, c in compute.items():
        wire = rng.uniform(2e7, 1e8)
        for rate in rates:
            c_run = c * (1 + rng.uniform(-drift, drift))
            h = hidden.get(recipe, 0.0)
            step = c_run + max(0.0, 8 * wire / (eff * rate) - h)
            pair = c_run + max(0.0, 8 * wire / (eff * pair_bps) - h)
            rows.append({"recipe": recipe, "rate": f"{rate:g}", "rate_bps": rate, "wire_bytes": wire,
                         "step_time_s": step * (1 + rng.gauss(0, noise)), "paired_rate_bps": pair_bps,
                         "paired_step_s": pair * (1 + rng.gauss(0, noise))})
    return rows


def test_paired_rows_cancel_the_compute_drift():
    """Compute that moves by up to 20 % between runs: paired rows (each with the same recipe's step at
    an unlimited link measured next to it) recover the efficiency and the hidden times and predict
    held-out rates within 2 %; the same rows without their pairs miss by far more."""
    import random

    from leantrain.comm.cost import fit_step_model, held_out_check

    rng = random.Random(3)
    compute, hidden, eff = {"ddp": 2.0, "sharded": 1.5, "gift": 3.0}, {"ddp": 0.8, "sharded": 1.2}, 0.9
    rows = _paired_rows(rng, compute, hidden, eff)
    m = fit_step_model(rows, overlap=["ddp", "sharded"])
    assert abs(m.efficiency - eff) < 0.01 and not m.alpha_fitted
    for recipe in compute:
        assert abs(m.hidden_s[recipe] - hidden.get(recipe, 0.0)) < 0.05
        assert abs(m.compute_s[recipe] / compute[recipe] - 1) < 0.2
    held = lambda r: r["rate"] in ("3e+08", "3e+07")  # noqa: E731
    res = held_out_check(rows, held, overlap=["ddp", "sharded"])
    assert res["max_abs_error"] < 0.02
    unpaired = [{k: v for k, v in r.items() if not k.startswith("paired")} for r in rows]
    assert held_out_check(unpaired, held, overlap=["ddp", "sharded"])["max_abs_error"] > 0.05
    # a paired row's compute is its pair less the pair's own unhidden link time
    r = rows[0]
    assert m.compute_of(r) == pytest.approx(r["paired_step_s"] - m.comm_s(dict(r, rate_bps=r["paired_rate_bps"])))
    with pytest.raises(ValueError, match="every row carries paired_step_s"):
        fit_step_model(rows + unpaired[:1])


def _paired_sweep(doc, rng, eff=0.9, drift=0.2):
    """The committed sweep's recipes and wire bytes as a paired sweep (phases.py) made from the hinge
    model, its compute drifting by up to ``drift`` between runs."""
    compute = {r: 1.0 + rng.random() for r in doc["recipes"]}
    measured = {p["recipe"]: p for p in doc["points"]}
    wire = {r: p["wire_tx_bytes_per_step"] for r, p in measured.items()}
    points = []
    for recipe, c in compute.items():
        hidden = 0.0 if "gift" in recipe else 0.3 * c
        base = {k: v for k, v in measured[recipe].items() if k.startswith("ledger") or k in ("parameters", "steps")}
        base |= {"recipe": recipe, "wire_tx_bytes_per_step": wire[recipe], "loadavg": [0.1, 0.1, 0.1]}
        refs = []
        for rate in ("1gbit", "300mbit", "100mbit", "30mbit"):
            bps = float(rate[:-4]) * (1e9 if rate.endswith("gbit") else 1e6)
            c_run = c * (1 + rng.uniform(-drift, drift))
            step = c_run + max(0.0, 8 * max(wire[recipe]) / (eff * bps) - hidden)
            points.append({**base, "rate": rate, "rate_bps": bps, "step_time_s": step, "step_times_s": [step] * 3,
                           "paired_step_s": c_run, "paired_rate_bps": None, "paired_drift": 0.0, "other_cpu_cores": 0.0})
            refs.append(c_run)
        points.append({**base, "rate": "unshaped", "rate_bps": None, "step_time_s": sorted(refs)[2],
                       "step_times_s": refs, "other_cpu_cores": 0.0})
    return dict(doc, points=points, replaced_points=[])


def test_calibration_of_a_paired_sweep_and_its_error_sources():
    """A paired sweep is fitted on the link's excess over each point's pair: a held-out rate inside
    the fitted ones is predicted within 1 % although the compute drifts by 20 % between runs; its
    unshaped points are pairs, not rows; the error-sources section reads the pairs' drift and other
    work's cores."""
    import random

    sys.path.insert(0, str(ROOT / "benchmarks" / "cluster"))
    from calibrate import fit_and_check, leave_one_rate_out, rows_of
    from errors import error_sources, markdown

    doc = _paired_sweep(json.loads((ROOT / "benchmarks/results/comm-cluster/2026-12-04_cpu-netns.json").read_text()),
                        random.Random(4))
    assert all(r["rate_bps"] and "paired_step_s" in r for r in rows_of(doc))
    fc = fit_and_check(doc, "300mbit")  # inside the fitted rates: a recipe's knee is seen on both sides
    assert abs(fc["model"].efficiency - 0.9) < 0.01
    assert fc["summary"]["points"] == len(doc["recipes"]) and fc["summary"]["max_abs_error"] < 0.01
    cv = leave_one_rate_out(doc)
    es = error_sources(doc, cv, fc["model"])
    assert {"drift of the paired reference", "other work's cores", "log wire bytes"} <= set(es["correlations"])
    assert es["by_regime"]["link-bound"]["max_abs_error"] < 0.01
    assert any(line.startswith("## Error sources") for line in markdown(es))


@pytest.mark.distributed
@pytest.mark.slow
def test_namespace_run_through_phases_shapes_only_the_rate_phase(corpus, tmp_path):
    """The links are shaped in the rate's phase and unshaped around it: the tiny model's step is
    milliseconds unshaped and is dominated by the link at 4 Mbit/s. (Its unshaped steps are shorter
    than the harness's poll and ``tc`` calls, so on a busy host the shaping may change several steps
    late; 24 steps a phase keep the medians inside the phase through a dozen late steps.)"""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root; the --local test covers the bookkeeping without them")
    r, out = _run(tmp_path, corpus, "--nodes", "2", "--ranks-per-node", "1", "--rates", "4mbit", "--phase-steps", "24")
    if r.returncode == 2:
        pytest.skip(f"no namespace rights here: {r.stderr.strip()}")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    ref, shaped = json.loads(out.read_text())["points"]
    link_s = 8 * max(shaped["wire_tx_bytes_per_step"]) / 4e6
    # (the unshaped medians well under the link's time, with room for a busy host's slower compute)
    assert shaped["step_time_s"] > 0.5 * link_s > 2 * shaped["paired_step_s"]
    # (every unshaped step but at most one: on a busy host one step at a phase's edge can straddle `tc`'s change)
    assert sorted(ref["step_times_s"])[-2] < 0.5 * link_s


def _collectives_result():
    """A ``cluster.py collectives`` result's rows (two rates, one size) with gloo's wire/ledger."""
    wire_per_ledger = {"all_reduce": 1.0, "all_gather": 1.0, "reduce_scatter": 2.0, "all_to_all": 1.0, "broadcast": 1.0}
    rows = [{"rate": rate, "op": op, "payload_bytes": 4_000_000, "efficiency": eff * scale, "wire_per_ledger": f}
            for rate, scale in (("1gbit", 1.0), ("100mbit", 0.9)) for op, f in wire_per_ledger.items()
            for eff in [OP_EFFICIENCY.get(op, 0.96)]]
    return {"rows": rows}


def test_per_collective_rows_of_the_committed_sweep():
    """``collectives.per_op`` reads a result into means over rates; a recipe's wire bytes are split by
    its ledger bytes per collective times the collective's wire/ledger (gloo's reduce-scatter: 2), and
    the comparison carries the per-collective model only when given a result."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "cluster"))
    from calibrate import PER_COLLECTIVE, _fit_options, rows_of
    from collectives import per_op

    coll = per_op(_collectives_result())
    assert coll["efficiency"]["all_to_all"] == pytest.approx(0.5 * 0.95)
    assert coll["efficiency_by_rate"]["all_to_all"] == pytest.approx({"1gbit": 0.5, "100mbit": 0.45})
    assert coll["wire_per_ledger"]["reduce_scatter"] == 2.0
    doc = json.loads((ROOT / "benchmarks/results/comm-cluster/2026-12-05_cpu-netns-paired.json").read_text())
    rows = rows_of(doc, PER_COLLECTIVE, coll)
    assert [r["step_time_s"] for r in rows] == [r["step_time_s"] for r in rows_of(doc)]
    for r in rows:
        assert sum(r["wire_bytes_by_op"].values()) == pytest.approx(r["wire_bytes"])
    by = {r["recipe"]: r["wire_bytes_by_op"] for r in rows}
    assert set(by["ddp-fp32"]) == {"all_reduce"}
    assert by["ddp-int8"]["all_to_all"] == pytest.approx(by["ddp-int8"]["all_gather"], rel=0.01)
    assert by["sharded"]["reduce_scatter"] == pytest.approx(2 * by["sharded"]["all_gather"], rel=0.01)
    assert _fit_options(doc, PER_COLLECTIVE, coll)["op_efficiency"] == coll["efficiency"]
    with pytest.raises(SystemExit, match="needs a collectives result"):
        rows_of(doc, PER_COLLECTIVE)


@pytest.mark.distributed
@pytest.mark.slow
def test_namespace_collectives_measure_each_op(tmp_path):
    """``cluster.py collectives`` on the namespace cluster (root): each op's row has its ledger bytes
    (the CommLedger convention), the wire bytes gloo sends (its reduce-scatter twice the ring's), and
    an efficiency near the rate."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    r = subprocess.run([sys.executable, str(SCRIPT), "collectives", "--rates", "100mbit", "--sizes", "800000",
                        "--reps", "2", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    if r.returncode == 2:
        pytest.skip(f"no namespace rights here: {r.stderr.strip()}")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    doc = json.loads(next(tmp_path.glob("*_collectives.json")).read_text())
    rows = {q["op"]: q for q in doc["rows"]}
    assert set(rows) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"}
    assert rows["all_reduce"]["ledger_bytes"] == 800_000 and rows["broadcast"]["ledger_bytes"] == 800_000
    assert rows["all_gather"]["ledger_bytes"] == rows["all_to_all"]["ledger_bytes"] == 400_000
    assert rows["reduce_scatter"]["wire_per_ledger"] == pytest.approx(2.0, rel=0.1)
    assert rows["all_reduce"]["wire_per_ledger"] == pytest.approx(1.0, rel=0.1)
    assert all(0.2 < q["efficiency"] < 1.5 for q in rows.values())
    assert doc["loadavg_before"] and doc["loadavg_after"] and (tmp_path / next(tmp_path.glob("*.md")).name).exists()


def test_collectives_refuses_without_rights_in_one_sentence():
    if os.geteuid() == 0:
        pytest.skip("running as root: the refusal path is not reachable")
    r = subprocess.run([sys.executable, str(SCRIPT), "collectives", "--rates", "100mbit"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "root" in r.stderr


def test_projection_takes_every_kernel_time_from_a_committed_gpu_file(tmp_path):
    """The projection to the papers' settings: every recipe's kernels come from a committed one-GPU
    measurement (none assumed free), the tuned GIFT costs less than its defaults with the same bytes, and
    the projection of the committed paired sweep is written with a row per recipe and setting."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "cluster"))
    import shutil

    from project import BYTES_OF, SETTINGS, gpu_inputs, write_projection

    g = gpu_inputs()
    recipes = [r for s in SETTINGS for r in s["recipes"]]
    assert set(g["kernels_s"]) == set(recipes) and all(g["kernels_s"][r] > 0 for r in recipes)
    assert all("assumed" not in g["kernels_source"][r] for r in recipes)
    assert g["kernels_s"]["gift-e4m3-tuned"] < g["kernels_s"]["gift-e4m3"]
    assert g["kernels_s"]["scape-99"] < g["kernels_s"]["scape-90"]
    sweep = tmp_path / "2026-12-05_cpu-netns-paired.json"
    shutil.copy(ROOT / "benchmarks/results/comm-cluster/2026-12-05_cpu-netns-paired.json", sweep)
    out = write_projection(sweep, collectives=ROOT / "benchmarks/results/comm-cluster/2026-12-05_cpu-netns_collectives.json")
    proj = json.loads(out[0].read_text())["projection"]
    assert [p["recipe"] for p in proj] == recipes
    rows = {p["recipe"]: p for p in proj}
    for tuned, base in BYTES_OF.items():
        assert rows[tuned]["bytes"] == rows[base]["bytes"] and rows[tuned]["speedup"] > rows[base]["speedup"]

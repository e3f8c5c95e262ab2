"""Where a 1b training step's GPU sits idle: one step under ``torch.profiler``, its timeline
analysed (GPU busy time, idle gaps, the longest CUDA runtime calls on the host).

    PYTHONPATH=src python3 benchmarks/tools/trace_step.py --config agoq --out DIR

configs: ``torch_bf16`` (the bf16 baseline) and ``agoq`` (AGoQ's default policy), forward +
backward (no optimizer), B = 8, T = 1024. Writes ``trace_<config>.json``: GPU busy and idle ms
in the forward and the backward, the 25 longest idle gaps (with the CPU op running when each
began), the 25 longest runtime calls, and the step's wall time; ``--chrome`` also the gzipped
Chrome trace.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))

import torch  # noqa: E402


def _union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(iv):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def analyse(events: list[dict], t_bwd: float) -> dict:
    """GPU busy / idle (µs) before and after ``t_bwd`` (the backward's first event), the gaps."""
    gpu = [(e["ts"], e["ts"] + e["dur"]) for e in events
           if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    busy = _union(gpu)
    cpu_ops = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                     if e.get("ph") == "X" and e.get("cat") == "cpu_op")
    runtime = sorted(((e["dur"], e["name"], e["ts"]) for e in events
                      if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")), reverse=True)
    t0, t1 = busy[0][0], busy[-1][1]
    res = {"gpu_span_ms": (t1 - t0) / 1e3}
    for name, lo, hi in (("forward", t0, t_bwd), ("backward", t_bwd, t1)):
        b = sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in busy)
        res[name] = {"span_ms": (hi - lo) / 1e3, "busy_ms": b / 1e3, "idle_ms": (hi - lo - b) / 1e3}
    gaps = []
    for (_, e0), (s1, _) in zip(busy, busy[1:]):
        g = s1 - e0
        if g > 20:
            # the innermost CPU op running when the GPU went idle (what the host was doing)
            running = [op for op in cpu_ops if op[0] <= e0 <= op[1]]
            inner = min(running, key=lambda op: op[1] - op[0])[2] if running else "-"
            launched = [op for op in cpu_ops if e0 <= op[0] <= s1]
            gaps.append({"at_ms": (e0 - t0) / 1e3, "gap_us": g, "phase": "forward" if e0 < t_bwd else "backward",
                         "host_in": inner, "next_op": launched[0][2] if launched else "-"})
    res["gaps_over_20us"] = len(gaps)
    res["gap_ms_total"] = sum(g["gap_us"] for g in gaps) / 1e3
    res["longest_gaps"] = sorted(gaps, key=lambda g: -g["gap_us"])[:25]
    res["longest_runtime_calls"] = [{"us": d, "name": n, "at_ms": (ts - t0) / 1e3} for d, n, ts in runtime[:25]]
    by_name: dict[str, list[float]] = {}
    for d, n, _ in runtime:
        by_name.setdefault(n, []).append(d)
    res["runtime_by_name"] = {n: {"calls": len(v), "total_ms": sum(v) / 1e3, "max_us": max(v)}
                              for n, v in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:12]}
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="agoq", choices=["torch_bf16", "agoq"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--policy", action="append", default=[], metavar="FIELD=VALUE")
    ap.add_argument("--chrome", action="store_true", help="also write the gzipped Chrome trace")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="gc.freeze() after the warm-up steps (the objects alive then leave the collector's view)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    from torch.profiler import ProfilerActivity, profile

    import leantrain as lt
    from leantrain.config import preset
    from leantrain.model import Llama

    torch.manual_seed(0)
    cfg = preset(a.preset).model
    with torch.device("cuda"):
        model = Llama(cfg).to(torch.bfloat16)
    if a.config == "agoq":
        kw = {}
        for kv in a.policy:
            k, v = kv.split("=", 1)
            kw[k] = type(getattr(lt.agoq.Policy(), k))(v)
        lt.agoq.apply(model, lt.agoq.Policy(**kw))
    g = torch.Generator(device="cuda").manual_seed(0)
    marks: dict[str, float] = {}

    def step():
        idx = torch.randint(0, cfg.vocab_size, (a.batch, a.seq + 1), device="cuda", generator=g)
        loss = model(idx[:, :-1], idx[:, 1:])
        with torch.profiler.record_function("leantrain::backward"):
            loss.backward()
        for p in model.parameters():
            p.grad = None

    for _ in range(4):
        step()
    torch.cuda.synchronize()
    if a.gc_freeze:
        gc.freeze()
    gcs: dict[int, list[float]] = {0: [], 1: [], 2: []}  # Python's cyclic collections in the timed steps, ms
    started = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            gcs[info["generation"]].append((time.perf_counter() - started[0]) * 1e3)

    gc.callbacks.append(on_gc)
    walls = []
    for _ in range(5):
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t) * 1e3)
    gc.callbacks.remove(on_gc)
    marks["gc_in_5_steps"] = {f"gen{g}": {"count": len(v), "total_ms": sum(v), "max_ms": max(v, default=0.0)}
                              for g, v in gcs.items()}
    marks["gc_frozen"] = bool(a.gc_freeze)
    marks["gc_tracked_objects"] = len(gc.get_objects())
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        marks["profiled_wall_ms"] = (time.perf_counter() - t) * 1e3
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"chrome_{a.config}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    if a.chrome:
        with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as z:
            z.write(f.read())
    os.remove(path)
    bwd = [e["ts"] for e in events if e.get("name") == "leantrain::backward" and e.get("cat") == "user_annotation"]
    # the backward's first kernel: the first GPU event after the annotation began
    t_bwd = min((e["ts"] for e in events if e.get("cat") == "kernel" and bwd and e["ts"] >= bwd[0]), default=0)
    res = {"config": a.config, "preset": a.preset, "batch": a.batch, "seq": a.seq, "policy": a.policy,
           "step_ms_unprofiled": sorted(walls)[len(walls) // 2], "step_ms_all": walls, **marks,
           **analyse(events, t_bwd)}
    with open(os.path.join(a.out, f"trace_{a.config}.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(a.config, "step", f"{res['step_ms_unprofiled']:.1f} ms;", "forward busy/idle",
          f"{res['forward']['busy_ms']:.1f}/{res['forward']['idle_ms']:.1f};", "backward busy/idle",
          f"{res['backward']['busy_ms']:.1f}/{res['backward']['idle_ms']:.1f} ms; gc in 5 steps",
          {g: (v["count"], round(v["total_ms"], 2)) for g, v in res["gc_in_5_steps"].items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""AGoQ benchmark: saved-activation bytes, allocator peak and step time, with vs without AGoQ.

    PYTHONPATH=src python3 benchmarks/bench_agoq.py --out benchmarks/results        # GPU: 1b, B=8, T=1024, bf16
    PYTHONPATH=src python3 benchmarks/bench_agoq.py --out DIR --cpu                 # CPU: tiny and small presets
    PYTHONPATH=src python3 benchmarks/bench_agoq.py --out DIR --cpu --errors        # + gradient-error table

Each configuration runs in a fresh subprocess (clean allocator statistics). One step is
forward + backward of the bf16 model (no optimizer: its memory is the same in both runs).
Measured per configuration: the bytes saved for backward (``SavedActivationMeter``: raw
bytes for the baseline, packed codes + scales + what is kept exact for AGoQ), the CUDA
allocator's peak during a step, the memory held before the step (weights, grads) and the
median step time (each step timed alone: a sync before it and after it), and on a GPU the
mean time of the same number of steps run back to back with one sync at the end (the host
issues a step while the GPU finishes the last, as a training loop that does not wait for each
step does). Targets (SPEC §3): saved bytes <= 0.3x, step time <= 1.15x.
Writes ``<date>_<hardware>.json`` and ``.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
sys.path.insert(0, str(HERE))
import harness  # noqa: E402


def _set_field(obj, kv: str) -> None:
    """``FIELD=VALUE`` set on a dataclass instance, the value converted to the field's type."""
    k, v = kv.split("=", 1)
    old = getattr(obj, k)
    setattr(obj, k, v.lower() in ("1", "true") if isinstance(old, bool) else type(old)(v))


def _child(args) -> dict:
    sys.path.insert(0, str(SRC))
    import torch

    from leantrain.agoq import Policy, apply, packer_of, quantize_activations
    from leantrain.config import preset
    from leantrain.model import Llama
    from leantrain.runtime.ledger import SavedActivationMeter

    cuda = args.device == "cuda"
    dev = torch.device("cuda" if cuda else "cpu")
    cfg = preset(args.preset)
    B = args.batch or cfg.data.batch_size
    T = args.seq or cfg.data.seq_len
    cfg.model.max_seq_len = max(cfg.model.max_seq_len, T)
    cfg.model.vocab_size = cfg.data.tokenizer_vocab  # what the trainer sets from the tokenizer (1b: 32000)
    for kv in args.model:  # --model sdpa_gqa=false: a model field set, in both the baseline and AGoQ
        _set_field(cfg.model, kv)
    torch.manual_seed(0)
    with torch.device(dev):  # initialize on the device (1.1B parameters on a CPU is slow)
        m = Llama(cfg.model)
    m = m.to(dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.model.vocab_size, (B, T), generator=g).to(dev)
    tgt = torch.randint(0, cfg.model.vocab_size, (B, T), generator=g).to(dev)
    policy = Policy()
    for kv in args.policy:  # --policy batch_mib=256: a Policy field set (AGoQ configurations)
        _set_field(policy, kv)
    if args.child == "agoq":  # persistent, as the trainer uses it (forwards replay their recorded plan)
        apply(m, policy)
    elif args.child == "agoq_noreplay":  # persistent, every forward through the full path with role hooks
        apply(m, policy, replay=False)

    def fwd():
        if args.child == "agoq_ctx":  # a packer made and its hooks installed per step
            with quantize_activations(m, policy):
                return m(idx, tgt)
        return m(idx, tgt)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    # saved-activation bytes of one forward (then backward to free it)
    with SavedActivationMeter(m.parameters()) as meter:
        loss = fwd()
    loss.backward()
    del loss
    times, fwd_host = [], []
    if args.gc_off:  # Python's cyclic collector off in the timed steps (both configurations)
        gc.collect()
        gc.disable()
    for i in range(args.warmup + args.steps):
        if args.gc_freeze and i == args.warmup:
            gc.freeze()
        for p in m.parameters():
            p.grad = None
        sync()
        if cuda and i == args.warmup:
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if cuda else 0
        t0 = time.perf_counter()
        loss = fwd()
        t_fwd = time.perf_counter() - t0  # host time to issue the forward
        if cuda and i == args.warmup:  # what the forward left allocated: the saved activations (and the loss)
            held_after_forward = torch.cuda.memory_allocated() - before
        loss.backward()
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            fwd_host.append(t_fwd)
        del loss
    back_to_back = None
    if cuda:  # the same steps back to back, one sync at the end: the host issues a step while the GPU
        # still runs the last one, as in a training loop that does not wait for each step
        sync()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            for p in m.parameters():
                p.grad = None
            loss = fwd()
            loss.backward()
            del loss
        sync()
        back_to_back = (time.perf_counter() - t0) / args.steps
    peak = torch.cuda.max_memory_allocated() if cuda else 0  # (before the graph's run resets it)
    graphed = _graphed(args, m, idx, tgt, sync) if cuda and args.graph and args.child != "agoq_ctx" else None
    out = {
        "config": args.child, "preset": args.preset, "batch": B, "seq": T, "dtype": "bf16", "graph": graphed,
        "step_s_back_to_back": back_to_back,
        "params": m.num_params(), "saved_bytes": meter.bytes,
        "saved_by_role": dict(meter.by_role),
        "step_s_median": sorted(times)[len(times) // 2], "step_s_all": times, "forward_host_s_all": fwd_host,
        "gc_off": bool(args.gc_off), "gc_freeze": bool(args.gc_freeze),
    }
    pk = packer_of(m)
    if pk is not None:  # every save's fate over all forwards (replay:diverged: forwards that left their plan)
        out["packer_stats"] = dict(pk.stats)
    if cuda:
        out["peak_allocated"] = peak
        out["allocated_before_step"] = before
        out["peak_above_before"] = out["peak_allocated"] - before
        out["held_after_forward"] = held_after_forward
    return out


def _graphed(args, m, idx, tgt, sync) -> dict:
    """The same step captured as one CUDA graph (leantrain.runtime.capture.GraphedStep) and replayed:
    median of replays timed alone, mean of replays back to back, the graph pool's peak; and a
    check that a replay on a new batch gives the eager step's loss on it (the forward is exact
    under AGoQ too: only what backward reads is packed)."""
    import torch

    from leantrain.runtime.capture import GraphedStep

    for p in m.parameters():  # (the eager steps' gradients: not counted in "before", as in the eager steps)
        p.grad = None
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    step = GraphedStep(lambda i, t: m(i, t), m.parameters(), idx, tgt)
    capture_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(1)
    idx2 = torch.randint(0, m.cfg.vocab_size, tuple(idx.shape), generator=g).to(idx.device)
    tgt2 = torch.randint(0, m.cfg.vocab_size, tuple(tgt.shape), generator=g).to(idx.device)
    times = []
    for i in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        step(idx, tgt)
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step(idx, tgt)
    sync()
    b2b = (time.perf_counter() - t0) / args.steps
    peak = torch.cuda.max_memory_allocated()
    graph_loss = step(idx2, tgt2).float().item()
    graph_grads = [p.grad.float().clone() for p in step.params]
    with torch.no_grad():
        eager_loss = m(idx2, tgt2).float().item()
    return {"step_s_median": sorted(times)[len(times) // 2], "step_s_all": times, "step_s_back_to_back": b2b,
            "capture_s": capture_s, "peak_allocated": peak, "allocated_before": before,
            "peak_above_before": peak - before, "new_batch_loss": graph_loss, "new_batch_eager_loss": eager_loss,
            "grad_norm": float(torch.stack([x.norm() for x in graph_grads]).norm())}


def _errors(out: Path, stamp: str) -> list[str]:
    """Per-role relative gradient error at 2/3/4/8 bits (tiny preset, B=8, T=128, one batch)."""
    sys.path.insert(0, str(SRC))
    import torch

    from leantrain.agoq import Policy, calibrate, gradient_error
    from leantrain.agoq.calibrate import param_grads
    from leantrain.config import preset
    from leantrain.model import Llama

    cfg = preset("tiny").model
    torch.manual_seed(0)
    m = Llama(cfg)
    g = torch.Generator().manual_seed(1)
    mk = lambda: (torch.randint(0, cfg.vocab_size, (8, 128), generator=g), torch.randint(0, cfg.vocab_size, (8, 128), generator=g))
    batches, other = [mk()], [mk()]
    pol, rep = calibrate(m, batches, error_budget=0.1, return_report=True)
    ref, ref2 = param_grads(m, batches), param_grads(m, other)
    dflt = gradient_error(m, batches, Policy(), reference=ref)
    rtn = gradient_error(m, batches, Policy(stochastic=False), reference=ref)
    noise = {n: ((ref2[n] - ref[n]).norm() / ref[n].norm()).item() for n in ref}
    doc = {"per_role": rep, "default_total": dflt["total"], "default_per_param": dflt["per_param"],
           "rtn_total": rtn["total"], "batch_noise_per_param": noise}
    (out / f"agoq_errors_{stamp}_cpu.json").write_text(json.dumps(doc, indent=1))
    lines = ["", "Relative gradient error (all parameters), one role quantized, tiny preset, B=8, T=128:", "",
             "| role | elements | 2 bits | 3 bits | 4 bits | 8 bits |", "|---|---|---|---|---|---|"]
    for r, e in rep["errors"].items():
        lines.append(f"| {r} | {rep['numel'][r]} | " + " | ".join(f"{e[b]:.4f}" for b in (2, 3, 4, 8)) + " |")
    worst = max(dflt["per_param"], key=dflt["per_param"].get)
    lines += ["", f"Default policy: total {dflt['total']:.3f} (round-to-nearest instead: {rtn['total']:.3f}); "
              f"worst layer {worst} {dflt['per_param'][worst]:.3f}; max ratio to the batch-to-batch gradient "
              f"difference {max(dflt['per_param'][n] / noise[n] for n in noise):.3f}.",
              f"calibrate(error_budget=0.1) chose {rep['chosen']} (average {rep['average_bits']:.2f} bits, "
              f"measured error {rep['measured_error']:.3f})."]
    return lines


def _run_child(preset, child, args) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [sys.executable, __file__, "--child", child, "--child-out", path, "--preset", preset,
           "--device", args.device, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if args.gc_off:
        cmd.append("--gc-off")
    if args.gc_freeze:
        cmd.append("--gc-freeze")
    if args.graph:
        cmd.append("--graph")
    for kv in args.model:
        cmd += ["--model", kv]
    for kv in args.policy:
        cmd += ["--policy", kv]
    if args.batch:
        cmd += ["--batch", str(args.batch)]
    if args.seq:
        cmd += ["--seq", str(args.seq)]
    env = {**os.environ, "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TRITON_INTERPRET", None)
    subprocess.run(cmd, check=True, env=env)
    res = json.loads(Path(path).read_text())
    os.unlink(path)
    return res


def _versions(device) -> dict:
    import torch

    v = {"torch": torch.__version__, "python": platform.python_version(), "host": platform.node()}
    try:
        import triton

        v["triton"] = triton.__version__
    except Exception:
        pass
    v["device"] = torch.cuda.get_device_name(0) if device == "cuda" else (platform.processor() or "cpu")
    return v


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--cpu", action="store_true", help="CPU mode: tiny and small presets")
    ap.add_argument("--preset", default=None, help="default: 1b on GPU; tiny,small on CPU")
    ap.add_argument("--batch", type=int, default=None, help="default: 8 on GPU, the preset's on CPU")
    ap.add_argument("--seq", type=int, default=None, help="default: 1024 on GPU, the preset's on CPU")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--errors", action="store_true", help="CPU: also the per-role gradient-error table")
    ap.add_argument("--variants", default="ctx,noreplay",
                    help="GPU: also time AGoQ as a context manager per step (ctx) and applied without replay (noreplay)")
    ap.add_argument("--gc-off", action="store_true", help="Python's cyclic garbage collector off in the timed steps")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="gc.freeze() before the timed steps (the objects alive then leave the collector's view)")
    ap.add_argument("--graph", action="store_true",
                    help="GPU: also time the step captured as one CUDA graph (baseline and AGoQ applied)")
    ap.add_argument("--model", action="append", default=[], metavar="FIELD=VALUE",
                    help="set a ModelConfig field (both configurations), e.g. --model sdpa_gqa=false")
    ap.add_argument("--policy", action="append", default=[], metavar="FIELD=VALUE",
                    help="set an agoq.Policy field (AGoQ configurations), e.g. --policy batch_mib=256")
    ap.add_argument("--device", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        Path(args.child_out).write_text(json.dumps(_child(args)))
        return 0
    import torch

    gpu = torch.cuda.is_available() and not args.cpu
    args.device = "cuda" if gpu else "cpu"
    presets = (args.preset or ("1b" if gpu else "tiny,small")).split(",")
    if gpu:
        args.batch = args.batch or 8
        args.seq = args.seq or 1024
    args.steps = args.steps or (8 if gpu else 3)
    args.warmup = args.warmup if args.warmup is not None else (3 if gpu else 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for p in presets:
        base = _run_child(p, "baseline", args)
        ago = _run_child(p, "agoq", args)
        row = {"preset": p, "batch": base["batch"], "seq": base["seq"], "baseline": base, "agoq": ago,
               "saved_ratio": ago["saved_bytes"] / base["saved_bytes"],
               "step_time_ratio": ago["step_s_median"] / base["step_s_median"]}
        if gpu:
            row["back_to_back_step_time_ratio"] = ago["step_s_back_to_back"] / base["step_s_back_to_back"]
            for v in filter(None, args.variants.split(",")):
                if v not in ("ctx", "noreplay"):
                    raise SystemExit(f"--variants: unknown {v!r} (ctx, noreplay)")
                r = _run_child(p, "agoq_" + v, args)
                row["agoq_" + v] = r
                row[v + "_step_time_ratio"] = r["step_s_median"] / base["step_s_median"]
            if args.graph:
                gb, ga = base["graph"], ago["graph"]
                row["graph_step_time_ratio"] = ga["step_s_median"] / gb["step_s_median"]
                row["graph_back_to_back_step_time_ratio"] = ga["step_s_back_to_back"] / gb["step_s_back_to_back"]
                row["graph_peak_above_ratio"] = ga["peak_above_before"] / gb["peak_above_before"]
            row["peak_ratio"] = ago["peak_allocated"] / base["peak_allocated"]
            row["peak_above_static_ratio"] = ago["peak_above_before"] / base["peak_above_before"]
            if "held_after_forward" in ago and "held_after_forward" in base:
                row["held_after_forward_ratio"] = ago["held_after_forward"] / base["held_after_forward"]
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("baseline", "agoq", "agoq_ctx", "agoq_noreplay")}))
    ver = _versions(args.device)
    stamp = dt.datetime.now().strftime("%Y-%m-%d")
    name = f"{stamp}_{harness.short_name(ver['device']) if args.device == 'cuda' else 'cpu'}"
    cmd = "PYTHONPATH=src python3 benchmarks/bench_agoq.py " + " ".join(argv if argv is not None else sys.argv[1:])
    doc = {"date": stamp, "versions": ver, "command": cmd, "rows": rows}
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1))
    gib = 2**30
    lines = [f"# AGoQ benchmark, {stamp}, {ver['device']}", "",
             f"torch {ver['torch']}, triton {ver.get('triton', '-')}; `{cmd}`", "",
             "| preset | B x T | saved bf16 (GiB) | saved AGoQ (GiB) | ratio | step base (s) | step AGoQ (s) | time ratio |"
             + (" back to back: step base / AGoQ (s) | its ratio |"
                " peak base (GiB) | peak AGoQ (GiB) | peak ratio | peak-above-static ratio |"
                " allocated after forward, base / AGoQ (GiB) | its ratio |"
                " step, context manager per step (s) | its ratio | step, apply without replay (s) | its ratio |"
                if gpu else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|---|---|---|---|---|---|---|---|---|---|---|" if gpu else "")]
    for r in rows:
        b, a = r["baseline"], r["agoq"]  # AGoQ applied persistently (agoq.apply, as the trainer does)
        line = (f"| {r['preset']} | {r['batch']} x {r['seq']} | {b['saved_bytes'] / gib:.3f} | {a['saved_bytes'] / gib:.3f} | "
                f"{r['saved_ratio']:.3f} | {b['step_s_median']:.3f} | {a['step_s_median']:.3f} | {r['step_time_ratio']:.3f} |")
        if gpu:
            line += (f" {b['step_s_back_to_back']:.3f} / {a['step_s_back_to_back']:.3f} |"
                     f" {r['back_to_back_step_time_ratio']:.3f} |")
            line += (f" {b['peak_allocated'] / gib:.2f} | {a['peak_allocated'] / gib:.2f} | {r['peak_ratio']:.3f} |"
                     f" {r['peak_above_static_ratio']:.3f} |"
                     f" {b['held_after_forward'] / gib:.2f} / {a['held_after_forward'] / gib:.2f} |"
                     f" {r['held_after_forward_ratio']:.3f} |")
            for v in ("ctx", "noreplay"):
                line += (f" {r['agoq_' + v]['step_s_median']:.3f} | {r[v + '_step_time_ratio']:.3f} |"
                         if "agoq_" + v in r else " - | - |")
        lines.append(line)
    if gpu and args.graph:
        lines += ["", "The step captured as one CUDA graph (`leantrain.runtime.capture.GraphedStep`), baseline and AGoQ (applied):", "",
                  "| preset | step base / AGoQ (s) | ratio | back to back base / AGoQ (s) | ratio |"
                  " graph pool peak above the weights, base / AGoQ (GiB) | ratio | new-batch loss, graph / eager (AGoQ) |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            gb, ga = r["baseline"]["graph"], r["agoq"]["graph"]
            lines.append(f"| {r['preset']} | {gb['step_s_median']:.4f} / {ga['step_s_median']:.4f} | "
                         f"{r['graph_step_time_ratio']:.3f} | {gb['step_s_back_to_back']:.4f} / "
                         f"{ga['step_s_back_to_back']:.4f} | {r['graph_back_to_back_step_time_ratio']:.3f} | "
                         f"{gb['peak_above_before'] / gib:.2f} / {ga['peak_above_before'] / gib:.2f} | "
                         f"{r['graph_peak_above_ratio']:.3f} | {ga['new_batch_loss']:.5f} / {ga['new_batch_eager_loss']:.5f} |")
    if args.errors and not gpu:
        lines += _errors(out, stamp)
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""GIFT's compute on one device: statistics, factor refreshes, transforms and codecs of a real model.

    PYTHONPATH=src python3 benchmarks/bench_comm.py gift-cost --preset 1b --out DIR     (CUDA; --preset tiny on CPU)

Everything GIFT adds to a data-parallel step except the communication itself, measured on one
process (one rank's share), for the preset's model (random weights and tokens):

- **step**: forward + backward of ``--batch`` x ``--seq`` tokens (bf16 autocast on CUDA) without and
  with the statistics GIFT takes on a refresh step (``x xᵀ`` and ``δ δᵀ`` of every whitened layer);
- **refresh**: the eigen-solves of the ``A`` and ``B`` factors of all the layers of one shape, as a root
  runs them (subspace iteration batched over the layers, cold and warm-started; the full ``eigh`` one
  factor at a time, up to ``--eigh-max`` rows); the model's total is the sum over the shapes (on ``n``
  ranks the roots share it about ``n`` ways);
- **transforms**: whiten + unwhiten of a gradient by the per-layer reference (``_two_sided``: fp32, also
  in TF32), per shape and for the model (each shape's time times its count), and one transform's three
  products alone; and **batched** as GIFT runs them (``TransformGroup``: all the ``count`` layers of a
  shape in one call each way, in place, in each ``transform_dtype``), per shape and for the model (the sum
  over the shapes), with each dtype's error against the fp32 batched whitening and its round trip;
- **gain estimates**: what ``min_gain`` would see: each layer's estimated gain of whitening (Euclidean /
  GIFT error of one codec pass in the K-FAC metric) on the gradient of one step, with factors from that
  step's statistics, in E4M3 and in NVFP4;
- **codecs**: quantize + dequantize of the model's gradients in E4M3 (block 1024) and NVFP4, and each
  codec's throughput on one 2^26-element fp32 tensor against the device's copy bandwidth (the bytes a
  quantize moves: 4 read + codes and scales written; a dequantize: those read, 4 written).

Times are medians of ``--reps`` calls after a warm-up, with the device synchronized around each call;
the codecs' and the copy's are device times (CUDA events around 20 back-to-back calls, median of
``--reps`` trials). GIFT's own transforms are also timed with the host ahead of the device, as in a
step (queued behind a sleep kernel, CUDA events around the calls alone), beside the host's time to
issue them and the plain step's.
Writes ``gift_cost_<date>_<device>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "src"))
import harness  # noqa: E402

from leantrain import config as C  # noqa: E402
from leantrain.comm import gift as G  # noqa: E402  (top_eigenpairs_batched)
from leantrain.comm.fp4 import nvfp4_nbytes  # noqa: E402
from leantrain.comm.gift import GIFT, fp8_dequantize, fp8_quantize  # noqa: E402
from leantrain.comm.gift_transforms import (  # noqa: E402
    TRANSFORM_DTYPES,
    TransformGroup,
    _Side,
    _tf32,
    _two_sided,
)
from leantrain.model import Llama  # noqa: E402
from leantrain.ops import dequantize_nvfp4, quantize_nvfp4  # noqa: E402


def timeit(fn, reps: int, dev: torch.device) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls after one warm-up call, the device synchronized around
    each call (wall time: the host's launches included)."""
    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    fn()
    sync()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def host_time(fn, reps: int, dev: torch.device) -> float:
    """Median seconds the host takes to issue ``fn()`` (launch its work) from a synchronized device, not
    waiting for the work itself."""
    ts = []
    for _ in range(reps + 1):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return statistics.median(ts[1:])


def queued_time(fn, reps: int, dev: torch.device, calls: int = 5) -> float:
    """Device seconds of a call of ``fn()`` when the host is ahead of the device, as in a training step
    where the host issues the reduction while the backward's kernels still run (:func:`gpu_time` with the
    stream held first). Wall time off CUDA."""
    return gpu_time(fn, reps, dev, calls, hold=True)


def gpu_time(fn, reps: int, dev: torch.device, calls: int = 20, hold: bool = False) -> float:
    """Seconds a call of ``fn()`` on the device: median over ``reps`` trials of ``calls`` back-to-back calls
    between two CUDA events (the host's launches overlap the device's work); wall time off CUDA. ``hold``:
    a sleep kernel first holds the stream until the host has queued every call, so the events time the
    device's work alone, with no wait for a launch."""
    if dev.type != "cuda":
        return timeit(fn, reps, dev)
    fn()
    torch.cuda.synchronize(dev)
    ts = []
    for _ in range(reps):
        if hold:
            torch.cuda._sleep(int(5e8))  # (about 0.25 s at 2 GHz: far longer than the host takes to queue the calls)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        ts.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(ts)


def measure_shape(gift: GIFT, n: int, k: int, count: int, args, dev: torch.device, gen: torch.Generator) -> dict:
    """The ``count`` layers of shape ``n x k``: their factors' eigen-solves (batched as a root runs them: all
    the layers' factors of one size at once), by each solver; whiten + unwhiten of one gradient."""
    row = {}
    tok = args.batch * args.seq
    fa = {}
    for side, dim in (("A", k), ("B", n)):  # a factor of realistic spectrum: a Gram matrix of scaled features
        feats = torch.randn(tok, dim, device=dev, generator=gen) * torch.logspace(0, -2, dim, device=dev)
        fa[side] = feats.t() @ feats / tok
    reps = max(1, args.reps // 3)
    seeds = list(range(count))
    for solver in ("subspace", "eigh"):
        if solver == "eigh" and max(n, k) > args.eigh_max:
            continue
        gift.solver = solver
        if solver == "eigh":  # (one factor at a time: one layer's, times the count)
            row["refresh_eigh_ms"] = count * timeit(lambda: [gift._decompose([f], [None], [0]) for f in fa.values()],
                                                    reps, dev) * 1e3
            continue
        row["refresh_subspace_ms"] = timeit(lambda: [gift._decompose([f] * count, [None] * count, seeds)
                                                     for f in fa.values()], reps, dev) * 1e3
        row["refresh_iters0_ms"] = timeit(lambda: [G.top_eigenpairs_batched([f] * count, args.rank, seeds=seeds, iters=0)
                                                   for f in fa.values()], reps, dev) * 1e3  # (the set-up and Rayleigh-Ritz alone)
        warm = {s: [u for u, *_ in gift._decompose([f] * count, [None] * count, seeds)] for s, f in fa.items()}
        row["refresh_subspace_warm_ms"] = timeit(lambda w=warm: [gift._decompose([f] * count, w[s], seeds)
                                                                 for s, f in fa.items()], reps, dev) * 1e3
    gift.solver = "auto"
    (a, b) = (_Side(*gift._decompose([fa[s]], [None], [0])[0]) for s in ("A", "B"))
    g = torch.randn(n, k, device=dev, generator=gen)

    def transforms():
        return _two_sided(b, a, _two_sided(b, a, g, inverse=True), inverse=False)

    row["transforms_ms"] = timeit(transforms, args.reps, dev) * 1e3
    with _tf32(True):
        row["transforms_tf32_ms"] = timeit(transforms, args.reps, dev) * 1e3
    # the three products alone
    row["product_P_ms"] = timeit(lambda: g @ a.u, args.reps, dev) * 1e3
    row["product_Q_ms"] = timeit(lambda: b.u.t() @ g, args.reps, dev) * 1e3
    lft, rgt = torch.randn(n, 2 * a.u.shape[1], device=dev), torch.randn(2 * a.u.shape[1], k, device=dev)
    row["product_final_ms"] = timeit(lambda: torch.addmm(g, lft, rgt, beta=0.5), args.reps, dev) * 1e3
    row["device_products_ms"] = thin_products_device_time(a, b, g, lft, rgt, count, args, dev)
    row.update(measure_batched(a, b, n, k, count, args, dev, gen))
    return row


def thin_products_device_time(a: _Side, b: _Side, g: torch.Tensor, lft: torch.Tensor, rgt: torch.Tensor,
                              count: int, args, dev: torch.device) -> dict:
    """Device ms of the thin products ``P = g Ua`` and ``Q = Ubᵀ g`` of one layer, alone and as one layer's
    share of the products batched over ``count`` layers (as :class:`TransformGroup` runs them on a stack), in
    fp32 and TF32, with the host ahead (:func:`queued_time`, 3 trials: each holds the stream a quarter
    second); and of the final ``g + lft @ rgt``."""
    n, k = g.shape
    reps = min(args.reps, 3)
    ua, ubt = a.u.contiguous(), b.u.contiguous().mT
    stack = g.expand(count, n, k).contiguous()
    uas, ubts = ua.expand(count, *ua.shape).contiguous(), ubt.expand(count, *ubt.shape).contiguous()
    out = {}
    for name, tf32 in (("float32", False), ("tfloat32", True)):
        row = out[name] = {}
        with _tf32(tf32):
            row["P+Q one layer"] = queued_time(lambda: (g @ ua, ubt @ g), reps, dev) * 1e3
            row[f"P+Q batched over {count}, a layer's share"] = queued_time(
                lambda: (torch.bmm(stack, uas), torch.bmm(ubts, stack)), reps, dev) * 1e3 / count
            row["final"] = queued_time(lambda: torch.addmm(g, lft, rgt, beta=0.5), reps, dev) * 1e3
    return out


def measure_batched(a: _Side, b: _Side, n: int, k: int, count: int, args, dev: torch.device,
                    gen: torch.Generator) -> dict:
    """Whiten + unwhiten of a stack of ``count`` gradients of shape ``n x k`` in one :class:`TransformGroup`
    call each way (in place, as GIFT runs them), per ``transform_dtype``; the relative error of its
    whitening against the fp32 one and of its round trip (Euclidean), on the first gradient."""
    grads = torch.randn(count, n, k, device=dev, generator=gen)
    slots = list(range(count))
    row = {"batched_transforms_ms": {}, "batched_whiten_error": {}, "batched_round_trip_error": {}}
    white32 = None
    for dtype in TRANSFORM_DTYPES:
        grp = TransformGroup(n, k, dtype)
        grp.rebuild([(a, b)] * count)
        work = grads.clone()

        def transforms(grp=grp, work=work):
            grp.apply(slots, work, True)
            grp.apply(slots, work, False)

        row["batched_transforms_ms"][dtype] = timeit(transforms, args.reps, dev) * 1e3
        w = grads[:1].clone()
        grp.apply([0], w, True)
        back = w.clone()
        grp.apply([0], back, False)
        white32 = w if white32 is None else white32
        row["batched_whiten_error"][dtype] = float((w - white32).norm() / white32.norm())
        row["batched_round_trip_error"][dtype] = float((back - grads[:1]).norm() / grads[:1].norm())
        del work
    return row


def gain_estimates(model, gift: GIFT, layers: list, x: torch.Tensor, dev: torch.device,
                   formats=("e4m3", "nvfp4")) -> dict:
    """What ``min_gain`` would see: after one step with statistics and a refresh (factors from that step
    alone), each layer's estimated gain of whitening (``GIFT._gain``) on its gradient, per wire format
    and shape (lists in model order)."""
    gift.steps = 0
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
        loss = model(x[:, :-1], x[:, 1:])
    loss.backward()
    gift._refresh_all(layers)
    out = {}
    for fmt in formats:
        gift.format = fmt
        per = out.setdefault(fmt, {})
        for la in layers:
            per.setdefault("x".join(map(str, la.mod.weight.shape)), []).append(
                gift._gain(la.A, la.B, la.mod.weight.grad.float()))
    gift.format = "e4m3"
    model.zero_grad(set_to_none=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--eigh-max", type=int, default=6000, help="largest factor the full eigh is timed on")
    ap.add_argument("--stat-tokens", type=int, nargs="*", default=[512, 1024],
                    help="also time the refresh step with GIFT's stat_tokens at each of these")
    ap.add_argument("--min-gains", type=float, nargs="*", default=[0.0, 1.2],
                    help="time GIFT's own transforms with each of these min_gain")
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = C.build(args.preset)
    cfg.model.max_seq_len = max(cfg.model.max_seq_len, args.seq)
    torch.manual_seed(0)
    with torch.device(dev):
        model = Llama(cfg.model)
    gift = GIFT(model, rank=args.rank)
    layers = list(gift.layers.values())
    shapes = Counter(tuple(la.mod.weight.shape) for la in layers)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    res = {"env": {"torch": torch.__version__, "device": name, "date": datetime.date.today().isoformat()},
           "command": "PYTHONPATH=src python3 benchmarks/bench_comm.py gift-cost " + " ".join(argv if argv is not None else sys.argv[1:]),
           "preset": args.preset, "batch": args.batch, "seq": args.seq, "rank": args.rank,
           "params": sum(p.numel() for p in model.parameters()),
           "whitened_params": sum(la.mod.weight.numel() for la in layers),
           "shapes": {f"{n}x{k}": c for (n, k), c in shapes.items()}}
    print(f"{name}: {args.preset}, {len(layers)} whitened layers, shapes {res['shapes']}", flush=True)

    # --- the step, without and with the statistics
    x = torch.randint(0, cfg.model.vocab_size, (args.batch, args.seq + 1), device=dev)

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        model.zero_grad(set_to_none=True)
        for la in layers:  # (the statistics are summed until a refresh: drop them, as the refresh would)
            la.a_new = la.b_new = None
            la.na = la.nb = 0

    gift.steps = 1  # not a refresh step: no statistics
    t_plain = timeit(step, args.reps, dev)
    gift.steps = 0  # a refresh step (the roots, here every layer's, take statistics)
    t_stats = timeit(step, args.reps, dev)
    res["step_ms"] = {"plain": t_plain * 1e3, "with_statistics": t_stats * 1e3}
    gift.steps = 1  # (the host's launches of the plain step)
    res["step_host_issue_ms"] = host_time(step, args.reps, dev) * 1e3
    print(f"step {t_plain * 1e3:.2f} ms, with statistics {t_stats * 1e3:.2f} ms", flush=True)
    for n in args.stat_tokens:  # the statistics from at most n strided rows a layer (of batch x seq)
        gift.stat_tokens, gift.steps = n, 0
        res["step_ms"][f"with_statistics_{n}_tokens"] = timeit(step, args.reps, dev) * 1e3
        print(f"with statistics of {n} tokens {res['step_ms'][f'with_statistics_{n}_tokens']:.2f} ms", flush=True)
    gift.stat_tokens = 0
    res["gain_estimates"] = gain_estimates(model, gift, layers, x, dev)
    print("gain estimates (min, median, max): " + json.dumps({f: {sh: [min(g), statistics.median(g), max(g)]
                                                                   for sh, g in v.items()}
                                                               for f, v in res["gain_estimates"].items()}), flush=True)
    for n in args.stat_tokens:  # the same from statistics of at most n tokens a layer (fresh factors)
        for la in layers:
            la.A = la.B = la.a_ema = la.b_ema = None
        gift.stat_tokens = n
        res.setdefault("gain_estimates_stat_tokens", {})[str(n)] = gain_estimates(model, gift, layers, x, dev, ("e4m3",))
        gift.stat_tokens = 0
        print(f"gain estimates, statistics of {n} tokens (e4m3 median): " + json.dumps(
            {sh: statistics.median(g) for sh, g in res["gain_estimates_stat_tokens"][str(n)]["e4m3"].items()}), flush=True)

    # --- GIFT's own transforms, both directions, as reduce_gradients runs them on the model's gradients:
    # factors from one refresh step (statistics of at most the last --stat-tokens rows), the layers under
    # each --min-gains left Euclidean, in each transform_dtype
    st_rows = args.stat_tokens[-1] if args.stat_tokens else 0
    gift.steps = 1  # (the benchmark's first GIFT takes no more statistics)
    res["gift_transforms"] = {"stat_tokens": st_rows, "min_gain": {}}
    for mg in args.min_gains:
        per = res["gift_transforms"]["min_gain"][f"{mg:g}"] = {}
        for dt in TRANSFORM_DTYPES:
            g2 = GIFT(model, rank=args.rank, transform_dtype=dt, min_gain=mg, stat_tokens=st_rows)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
            g2._refresh_all(list(g2.layers.values()))
            chunks = g2.whitened_chunks([p for p in model.parameters() if p.grad is not None])
            stacks = [torch.stack(grads) for _, _, grads in chunks]  # (as reduce_gradients stacks them)

            def both(chunks=chunks, stacks=stacks):
                for (grp, slots, _), x in zip(chunks, stacks):
                    grp.apply(slots, x, True)
                    grp.apply(slots, x, False)

            def copies(chunks=chunks, stacks=stacks):  # (the stack's copy in and back out)
                for (_, _, grads), x in zip(chunks, stacks):
                    torch.stack(grads, out=x)
                    torch._foreach_copy_(grads, list(x.unbind(0)))

            ms = timeit(both, args.reps, dev) * 1e3
            queued = queued_time(both, args.reps, dev) * 1e3
            per[dt] = {"ms": ms, "whitened_layers": sum(len(slots) for _, slots, _ in chunks), "chunks": len(chunks),
                       "of_plain_step": ms / res["step_ms"]["plain"],
                       "queued_ms": queued, "queued_of_plain_step": queued / res["step_ms"]["plain"],
                       "host_issue_ms": host_time(both, args.reps, dev) * 1e3,
                       "stack_copies_queued_ms": queued_time(copies, args.reps, dev) * 1e3}
            g2.remove()
            model.zero_grad(set_to_none=True)
            del g2, chunks, stacks
        print(f"GIFT's transforms, min_gain {mg:g}: " + json.dumps(per), flush=True)

    # --- per shape: the eigen-solves and the transforms
    gen = torch.Generator(device=dev).manual_seed(1)
    per_shape = {}
    for (n, k), count in shapes.items():
        row = {"count": count, **measure_shape(gift, n, k, count, args, dev, gen)}
        per_shape[f"{n}x{k}"] = row
        print(f"{n}x{k} (x{count}): " + ", ".join(f"{key} {v:.2f}" if isinstance(v, float) else f"{key} {v}"
                                                  for key, v in row.items() if key != "count"),
              flush=True)
    res["per_shape"] = per_shape

    # --- codecs on the model's gradients (one flat tensor a parameter, padded as the all-reduce pads)
    def codec_times(numel: int) -> dict:
        v = torch.randn(-(-numel // 1024) * 1024, device=dev, generator=gen)
        r = {}
        c, s = fp8_quantize(v, 1024)
        r["e4m3_quantize_ms"] = gpu_time(lambda: fp8_quantize(v, 1024), args.reps, dev) * 1e3
        r["e4m3_dequantize_ms"] = gpu_time(lambda: fp8_dequantize(c, s, 1024), args.reps, dev) * 1e3
        wire = {"scale_round": "up", "nonfinite": "nan", "local_scale": True}  # (GIFT's options, comm/fp4.py)
        q = quantize_nvfp4(v, stochastic=True, seed=2, **wire)
        r["nvfp4_quantize_ms"] = gpu_time(lambda: quantize_nvfp4(v, stochastic=True, seed=2, **wire), args.reps, dev) * 1e3
        r["nvfp4_quantize_nearest_ms"] = gpu_time(lambda: quantize_nvfp4(v, **wire), args.reps, dev) * 1e3
        tensor_scale = {**wire, "local_scale": False}  # (one scale for the tensor: an amax pass first)
        r["nvfp4_quantize_tensor_scale_ms"] = gpu_time(lambda: quantize_nvfp4(v, stochastic=True, seed=2, **tensor_scale),
                                                     args.reps, dev) * 1e3
        r["nvfp4_dequantize_ms"] = gpu_time(lambda: dequantize_nvfp4(q), args.reps, dev) * 1e3
        return r

    big = 1 << 26 if dev.type == "cuda" else 1 << 22
    one = codec_times(big)
    v = torch.randn(big, device=dev)
    copy_s = gpu_time(lambda: v.clone(), args.reps, dev)
    bw = 2 * 4 * big / copy_s
    fp8_bytes, fp4_bytes = big + 4 * big // 1024, nvfp4_nbytes(big)
    moved = {"e4m3_quantize_ms": 4 * big + fp8_bytes, "e4m3_dequantize_ms": 4 * big + fp8_bytes,
             "nvfp4_quantize_ms": 4 * big + fp4_bytes, "nvfp4_quantize_nearest_ms": 4 * big + fp4_bytes,
             "nvfp4_dequantize_ms": 4 * big + fp4_bytes,
             "nvfp4_quantize_tensor_scale_ms": 4 * big + fp4_bytes}  # (that quantize reads x twice: the amax pass, then the
    # encode pass; counted once here, as the bytes a fused single-pass kernel would move)
    res["codec_bandwidth"] = {"numel": big, "copy_GBps": bw / 1e9,
                              **{k: {"ms": t, "GBps": moved[k] / (t / 1e3) / 1e9, "of_copy": moved[k] / (t / 1e3) / bw}
                                 for k, t in one.items()}}
    print(f"copy {bw / 1e9:.0f} GB/s; " + ", ".join(f"{k} {v['GBps']:.1f} GB/s ({v['of_copy']:.3f})"
                                                    for k, v in res["codec_bandwidth"].items() if isinstance(v, dict)),
          flush=True)
    total = sum(p.numel() for p in model.parameters())
    res["model_codecs_ms"] = codec_times(total)

    # --- the model's totals a step (one rank doing every layer)
    tr = sum(r["transforms_ms"] * r["count"] for r in per_shape.values())
    tr32 = sum(r["transforms_tf32_ms"] * r["count"] for r in per_shape.values())
    ref_sub = sum(r["refresh_subspace_ms"] for r in per_shape.values())
    ref_warm = sum(r["refresh_subspace_warm_ms"] for r in per_shape.values())
    batched = {dt: sum(r["batched_transforms_ms"][dt] for r in per_shape.values()) for dt in TRANSFORM_DTYPES}
    res["model"] = {"transforms_ms": tr, "transforms_tf32_ms": tr32, "batched_transforms_ms": batched,
                    "batched_transforms_of_plain_step": {dt: t / res["step_ms"]["plain"] for dt, t in batched.items()},
                    "refresh_subspace_cold_ms": ref_sub,
                    "refresh_subspace_warm_ms": ref_warm}
    if all("refresh_eigh_ms" in r for r in per_shape.values()):
        res["model"]["refresh_eigh_ms"] = sum(r["refresh_eigh_ms"] for r in per_shape.values())
    print(json.dumps(res["model"]), flush=True)

    harness.write(args.out, "gift-cost", res, markdown(res))
    print(markdown(res))
    return 0


def gift_transforms_table(res: dict) -> list[str]:
    """GIFT's own transforms (whiten + map back) a step, per ``min_gain`` and ``transform_dtype``."""
    gt = res.get("gift_transforms")
    if not gt:
        return []
    lines = [f"GIFT's own transforms a step (whiten + map back of the whitened layers' gradients, factors from "
             f"statistics of at most {gt['stat_tokens'] or 'all'} tokens a layer), ms and share of the plain step:", "",
             "| min_gain | whitened layers | " + " | ".join(TRANSFORM_DTYPES) + " |",
             "|---|---|" + "---|" * len(TRANSFORM_DTYPES)]
    for mg, per in gt["min_gain"].items():
        n = per[TRANSFORM_DTYPES[0]]["whitened_layers"]
        lines.append(f"| {mg} | {n} | " + " | ".join(f"{per[dt]['ms']:.2f} ({100 * per[dt]['of_plain_step']:.1f}%)"
                                                      for dt in TRANSFORM_DTYPES) + " |")
    if "queued_ms" not in next(iter(gt["min_gain"].values()))[TRANSFORM_DTYPES[0]]:
        return [*lines, ""]
    lines += ["", "The same timed on the device with the host ahead (queued behind a sleep kernel, as behind the "
              "backward's kernels in a step), and the host's time to issue them:", "",
              "| min_gain | " + " | ".join(f"{dt} queued | {dt} host" for dt in TRANSFORM_DTYPES) + " |",
              "|---|" + "---|---|" * len(TRANSFORM_DTYPES)]
    for mg, per in gt["min_gain"].items():
        lines.append(f"| {mg} | " + " | ".join(f"{per[dt]['queued_ms']:.2f} ({100 * per[dt]['queued_of_plain_step']:.1f}%)"
                                               f" | {per[dt]['host_issue_ms']:.2f}" for dt in TRANSFORM_DTYPES) + " |")
    if "stack_copies_queued_ms" in next(iter(gt["min_gain"].values()))[TRANSFORM_DTYPES[0]]:
        lines += ["", "The whitened layers' gradients are transformed in stacks (a shape's layers, at most a bucket "
                  "each), the buffers the all-reduce sends. Copying them in and back out, queued ms (the Euclidean "
                  "all-reduce copies the same gradients into its buckets and back): " + "; ".join(
                      f"min_gain {mg}: {per[TRANSFORM_DTYPES[0]]['stack_copies_queued_ms']:.2f} "
                      f"({per[TRANSFORM_DTYPES[0]]['chunks']} stacks)" for mg, per in gt["min_gain"].items()) + "."]
    if "step_host_issue_ms" in res:
        lines += ["", f"The plain step's forward + backward: {res['step_ms']['plain']:.2f} ms, of which the host "
                  f"issues its launches in {res['step_host_issue_ms']:.2f} ms."]
    return [*lines, ""]


def markdown(res: dict) -> str:
    e = res["env"]
    lines = [f"# GIFT's compute, {res['preset']} preset — {e['device']}, {e['date']}", "",
             f"torch {e['torch']}; command: `{res['command']}`. One process does every layer (on `n` ranks the "
             f"factor refreshes are shared `n` ways; the transforms and codecs are not). {res['whitened_params']:,} "
             f"of {res['params']:,} parameters whitened, rank {res['rank']}; statistics from {res['batch']} x "
             f"{res['seq']} tokens.", "",
             "| forward + backward | ms |", "|---|---|",
             f"| plain | {res['step_ms']['plain']:.2f} |",
             f"| with GIFT's statistics (a refresh step) | {res['step_ms']['with_statistics']:.2f} |",
             *[f"| the same, statistics of at most {k.split('_')[2]} tokens a layer | {v:.2f} |"
               for k, v in res["step_ms"].items() if k.endswith("_tokens")], "",
             *gift_transforms_table(res),
             "| layer N×K | count | refresh of the count layers: subspace, cold ms | subspace, warm ms | full eigh ms "
             "| whiten + unwhiten of one layer ms | TF32 ms | one transform's products P, Q, final ms |",
             "|---|---|---|---|---|---|---|---|"]
    for shape, r in res["per_shape"].items():
        eigh = f"{r['refresh_eigh_ms']:.1f}" if "refresh_eigh_ms" in r else "(not run)"
        lines.append(f"| {shape} | {r['count']} | {r['refresh_subspace_ms']:.1f} | {r['refresh_subspace_warm_ms']:.1f} | "
                     f"{eigh} | {r['transforms_ms']:.3f} | {r['transforms_tf32_ms']:.3f} | "
                     f"{r['product_P_ms']:.3f}, {r['product_Q_ms']:.3f}, {r['product_final_ms']:.3f} |")
    m = res["model"]
    dts = list(next(iter(res["per_shape"].values()))["batched_transforms_ms"])
    lines += ["", "Batched as GIFT runs them (all the count layers of a shape, one call each way, in place), "
              "whiten + unwhiten ms, and each dtype's whitening error against fp32 / round-trip error:", "",
              "| layer N×K | " + " | ".join(dts) + " |", "|---|" + "---|" * len(dts)]
    for shape, r in res["per_shape"].items():
        lines.append(f"| {shape} | " + " | ".join(
            f"{r['batched_transforms_ms'][d]:.2f} ({r['batched_whiten_error'][d]:.1e} / "
            f"{r['batched_round_trip_error'][d]:.1e})" for d in dts) + " |")
    m = res["model"]
    dp = [(shape, r["device_products_ms"]) for shape, r in res["per_shape"].items() if "device_products_ms" in r]
    if dp:
        cols = list(next(iter(dp))[1]["float32"])
        lines += ["", "The thin products P and Q of one layer, alone and batched over the shape's layers (a layer's "
                  "share), and the final product, device ms with the host ahead, float32 / tfloat32:", "",
                  "| layer N×K | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
        for shape, d in dp:
            lines.append(f"| {shape} | " + " | ".join(f"{d['float32'][c]:.3f} / {d['tfloat32'][c]:.3f}" for c in cols)
                         + " |")
    lines += ["", "Batched, the model a step: " + ", ".join(
        f"{d} {m['batched_transforms_ms'][d]:.2f} ms ({100 * m['batched_transforms_of_plain_step'][d]:.1f} % of "
        f"a plain step)" for d in dts) + "."]
    ge = res.get("gain_estimates", {})
    if ge:
        lines += ["", "Estimated gain of whitening (``min_gain``'s measure) over a shape's layers, min / median / max:",
                  "", "| layer N×K | " + " | ".join(ge) + " |", "|---|" + "---|" * len(ge)]
        for shape in next(iter(ge.values())):
            lines.append(f"| {shape} | " + " | ".join(
                f"{min(v[shape]):.2f} / {statistics.median(v[shape]):.2f} / {max(v[shape]):.2f}" for v in ge.values())
                + " |")
    lines += ["", "The refresh's set-up and Rayleigh-Ritz alone (no iteration), ms: "
              + ", ".join(f"{shape} {r['refresh_iters0_ms']:.1f}" for shape, r in res["per_shape"].items()), ""]
    lines += ["", "Model totals (refresh: the sum over the shapes; transforms: each shape's time × its count): "
              f"transforms {m['transforms_ms']:.2f} ms a step ({m['transforms_tf32_ms']:.2f} in TF32); "
              f"a refresh {m['refresh_subspace_warm_ms']:.0f} ms warm, "
              f"{m['refresh_subspace_cold_ms']:.0f} ms cold (subspace)"
              + (f", {m['refresh_eigh_ms']:.0f} ms by the full eigh" if "refresh_eigh_ms" in m else "") + ".", ""]
    cb = res["codec_bandwidth"]
    lines += [f"Codecs on one {cb['numel']:,}-element fp32 tensor, device time (CUDA events; copy bandwidth "
              f"{cb['copy_GBps']:.0f} GB/s):", "",
              "| codec | ms | GB/s | of copy |", "|---|---|---|---|"]
    for k, v in cb.items():
        if isinstance(v, dict):
            lines.append(f"| {k.removesuffix('_ms')} | {v['ms']:.3f} | {v['GBps']:.1f} | {v['of_copy']:.3f} |")
    mc = res["model_codecs_ms"]
    lines += ["", "On the whole model's gradient (ms): " + ", ".join(f"{k.removesuffix('_ms')} {v:.2f}" for k, v in mc.items()),
              ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

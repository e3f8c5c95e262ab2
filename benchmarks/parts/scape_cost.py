"""SCAPE's compute on one device: what one rank of a ``--world``-rank job computes in a sharded step.

    PYTHONPATH=src python3 benchmarks/bench_comm.py scape-cost --params 1.8e9 --world 32 --out DIR

One process runs :class:`leantrain.parallel.ShardedOptimizer`'s real ``step()`` as rank 0 of ``--world``
ranks, for ``--params`` bf16 parameters (tensors of ``--tensor`` elements, gradients set), with AdamS,
dense (``NoCompression``) and with ``SCAPE`` at each ``--densities``. The collectives are replaced by
local copies (a reduce-scatter keeps rank 0's chunk, an all-gather writes the rank's piece into every
slot): what is timed is everything the rank computes (flattening, error feedback, the mask's top-k
and bitmap, the sparse update with catch-up, the weight scatter), not the network. SCAPE's extra
compute a step is its step time minus the dense one. Times are medians of ``--reps`` steps after
``--warmup`` (the first SCAPE step is dense: no mask yet), the device synchronized around each.
Writes ``<date>_<device>_scape-cost.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "src"))
import harness  # noqa: E402

import leantrain as lt  # noqa: E402
from leantrain.comm.topology import Topology  # noqa: E402
from leantrain.parallel import sharded as sharded_mod  # noqa: E402
from leantrain.runtime import collectives as C  # noqa: E402


class _Done:
    def wait(self):
        return None


@contextlib.contextmanager
def local_collectives(world: int, intra: int):
    """Rank 0 of ``world`` ranks in one process: the topology says ``world``, the collectives copy locally."""

    def done(async_op):
        return _Done() if async_op else None

    def reduce_scatter_tensor(out, inp, *, op=None, group=None, scope="world", async_op=False):
        out.copy_(inp.view(world, -1)[0].view_as(out))
        return done(async_op)

    def all_gather_into_tensor(out, inp, *, group=None, scope="world", async_op=False):
        out.view(world, -1).copy_(inp.reshape(1, -1).expand(world, -1))
        return done(async_op)

    def all_reduce(t, *, op=None, group=None, scope="world", async_op=False):
        return done(async_op)

    def broadcast(t, src, *, group=None, scope="world", async_op=False):
        return done(async_op)

    topo = Topology(None, world, 0, intra, world // intra, None, None)
    saved = {n: getattr(C, n) for n in ("reduce_scatter_tensor", "all_gather_into_tensor", "all_reduce", "broadcast")}
    saved_topo = sharded_mod.get_topology
    try:
        C.reduce_scatter_tensor, C.all_gather_into_tensor = reduce_scatter_tensor, all_gather_into_tensor
        C.all_reduce, C.broadcast = all_reduce, broadcast
        sharded_mod.get_topology = lambda group=None, intra_node_size=None: topo
        yield
    finally:
        for n, f in saved.items():
            setattr(C, n, f)
        sharded_mod.get_topology = saved_topo


def measure(params: list, compression, bucket_mb: float, args, dev: torch.device) -> dict:
    """Median seconds of ``step()`` and the allocator's peak over it, for one compressor."""
    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    with local_collectives(args.world, args.intra):
        opt = lt.parallel.ShardedOptimizer(params, lt.optim.AdamS(lr=1e-4), compression=compression,
                                           max_grad_norm=1.0, bucket_mb=bucket_mb)
        times = []
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        for i in range(args.warmup + args.reps):
            sync()
            t = time.perf_counter()
            opt.step()
            sync()
            if i >= args.warmup:
                times.append(time.perf_counter() - t)
        peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0
        if args.profile:  # one more step under the profiler: the ops by their device (or CPU) time
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
            with profile(activities=acts) as prof:
                opt.step()
                sync()
            key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
            print(prof.key_averages().table(sort_by=key, row_limit=args.profile), flush=True)
        buckets = len(opt.buckets)
        del opt
    return {"step_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3, "max_ms": max(times) * 1e3,
            "buckets": buckets, "peak_GiB": peak / 2**30}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=float, default=1.8e9, help="parameters of the model (rounded to --tensor)")
    ap.add_argument("--tensor", type=int, default=2048 * 5632, help="elements a parameter tensor")
    ap.add_argument("--world", type=int, default=32)
    ap.add_argument("--intra", type=int, default=8, help="ranks a node")
    ap.add_argument("--densities", type=float, nargs="+", default=[0.1, 0.01])
    ap.add_argument("--bucket-mb", type=float, nargs="+", default=[25.0, 200.0],
                    help="the optimizer's bucket sizes to time (MiB of fp32 gradient; 25 is its default)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--profile", type=int, default=0, help="print the top N ops of a profiled step")
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n_tensors = max(1, round(args.params / args.tensor))
    gen = torch.Generator(device=dev).manual_seed(0)
    params = []
    for _ in range(n_tensors):
        p = torch.nn.Parameter((torch.randn(args.tensor, device=dev, generator=gen) * 0.02).to(torch.bfloat16))
        p.grad = (torch.randn(args.tensor, device=dev, generator=gen) * 1e-3).to(torch.bfloat16)
        params.append(p)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    n = n_tensors * args.tensor
    res = {"env": {"torch": torch.__version__, "device": name, "date": datetime.date.today().isoformat()},
           "command": "PYTHONPATH=src python3 benchmarks/bench_comm.py scape-cost "
                      + " ".join(argv if argv is not None else sys.argv[1:]),
           "params": n, "world": args.world, "intra": args.intra, "optimizer": "AdamS, max_grad_norm 1.0",
           "runs": {}}
    print(f"{name}: {n:,} bf16 parameters, rank 0 of {args.world}", flush=True)
    runs = {"dense": None, **{f"scape-{round(100 * (1 - d))}": d for d in args.densities}}
    for mb in args.bucket_mb:
        per = res["runs"][f"{mb:g}"] = {}
        for key, d in runs.items():
            r = measure(params, None if d is None else lt.comm.SCAPE(density=d, warmup=0), mb, args, dev)
            if key != "dense":
                r["extra_ms"] = r["step_ms"] - per["dense"]["step_ms"]
            per[key] = r
            print(f"buckets of {mb:g} MiB, {key}: " + json.dumps(r), flush=True)
    harness.write(args.out, "scape-cost", res, markdown(res))
    print(markdown(res))
    return 0


def markdown(res: dict) -> str:
    e = res["env"]
    lines = [f"# SCAPE's compute, rank 0 of {res['world']} — {e['device']}, {e['date']}", "",
             f"torch {e['torch']}; command: `{res['command']}`. {res['params']:,} bf16 parameters, "
             f"{res['optimizer']}; the sharded optimizer's step with the collectives replaced by local copies.", "",
             "| bucket MiB | compressor | step ms (median) | min / max ms | extra over dense ms | buckets | peak GiB |",
             "|---|---|---|---|---|---|---|"]
    for mb, per in res["runs"].items():
        for key, r in per.items():
            extra = f"{r['extra_ms']:+.2f}" if "extra_ms" in r else "—"
            lines.append(f"| {mb} | {key} | {r['step_ms']:.2f} | {r['min_ms']:.2f} / {r['max_ms']:.2f} | {extra} | "
                         f"{r['buckets']} | {r['peak_GiB']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

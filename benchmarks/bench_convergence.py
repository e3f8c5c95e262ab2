"""Convergence of every recipe against the baseline, on the same preset, data and seed.

    PYTHONPATH=src python3 benchmarks/bench_convergence.py --preset tiny --steps 300 --out DIR \
        [--recipes baseline,reference,forge,...] [--dist-recipes ddp,sharded,sharded-sdp4bit --nproc 4 --intra 2]
        [--dist-recipes sharded-adams,sharded-scape90,sharded-scape99 --nproc 2 --intra 1]  # SCAPE vs dense AdamS

Single-process recipes run one after the other (``leantrain train``); distributed recipes run
under ``torchrun`` (gloo on CPU, NCCL on CUDA) with the same *global* batch. Writes
``report.md`` (final and validation loss, tokens/s, memory breakdown, bytes per step, each as
a ratio to the baseline), ``loss.png`` and ``summary.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from leantrain.cli import RECIPES  # noqa: E402
from leantrain.train.report import write_report  # noqa: E402

DIST_RECIPES = {
    "ddp": {},
    "ddp-int8": {"comm.method": "int8"},
    "sharded": {"dist.mode": "sharded"},
    "sharded-sdp4bit": {"dist.mode": "sharded", "comm.method": "sdp4bit"},
    # SCAPE's recipes use AdamS (masks from its first moment): compare them with sharded-adams
    "sharded-adams": {"dist.mode": "sharded", "optim.name": "adams"},
    "sharded-scape90": {"dist.mode": "sharded", "optim.name": "adams", "comm.method": "scape", "comm.scape.density": 0.1},
    "sharded-scape99": {"dist.mode": "sharded", "optim.name": "adams", "comm.method": "scape",
                        "comm.scape.density": 0.01},
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(name, overrides, args, nproc=1) -> dict:
    out = Path(args.out) / name
    cmd = ["-m", "leantrain", "train", "--preset", args.preset, "--steps", str(args.steps), "--out", str(out),
           "--train.sample-tokens", "0", "--train.eval-every", str(args.eval_every)]
    if name == "baseline":
        cmd.append("--baseline")
    for k, v in {**overrides, **dict(kv.split("=", 1) for kv in args.set)}.items():
        cmd += [f"--{k}", str(v)]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(_port()), *cmd]
    else:
        cmd = [sys.executable, *cmd]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "NCCL_NVLS_ENABLE": "0",
           "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
        raise SystemExit(f"recipe {name} failed (exit {proc.returncode})")
    s = json.loads((out / "summary.json").read_text())
    print(f"{name:>18}: val {s['val_loss']:.4f}  final {s['final_loss']:.4f}  {s['tokens_per_second']:.0f} tok/s  "
          f"{time.time() - t0:.0f}s", flush=True)
    return s


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--out", required=True)
    p.add_argument("--recipes", default="baseline,reference,forge,forge-bf16,agoq,agoq+forge")
    p.add_argument("--dist-recipes", default="")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--intra", type=int, default=2, help="ranks per pretend node for distributed recipes")
    p.add_argument("--set", action="append", default=[], help="extra config override key=value (repeatable)")
    args = p.parse_args(argv)
    results = {}
    for name in [r for r in args.recipes.split(",") if r]:
        results[name] = run(name, RECIPES[name], args)
    for name in [r for r in args.dist_recipes.split(",") if r]:
        ov = {**DIST_RECIPES[name], "dist.intra_node_size": args.intra}
        # same global batch as the single-process runs
        ov["data.batch_size"] = _per_rank_batch(args, name)
        results[f"{name}x{args.nproc}"] = run(f"{name}x{args.nproc}", ov, args, nproc=args.nproc)
    if "baseline" not in results:
        raise SystemExit("include the baseline recipe: every ratio is to it")
    path = write_report(Path(args.out), results)
    base = results["baseline"]["val_loss"]
    for name, s in results.items():
        print(f"{name:>18}: val loss {s['val_loss']:.4f} ({100 * (s['val_loss'] - base) / base:+.2f}% vs baseline)")
    print(f"report: {path}")
    return 0


def _per_rank_batch(args, name) -> int:
    from leantrain import config

    cfg = config.build(args.preset, overrides=dict(kv.split("=", 1) for kv in args.set))
    b = cfg.data.batch_size
    if b % args.nproc:
        raise SystemExit(f"data.batch_size {b} does not split over {args.nproc} ranks for {name}")
    return b // args.nproc


if __name__ == "__main__":
    sys.exit(main())

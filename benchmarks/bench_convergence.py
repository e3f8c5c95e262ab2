"""Convergence of every recipe against the baseline, on the same preset, data and seed.

    PYTHONPATH=src python3 benchmarks/bench_convergence.py --preset tiny --steps 300 --out DIR \
        [--recipes baseline,reference,forge,...] [--dist-recipes ddp,sharded,sharded-sdp4bit --nproc 4 --intra 2]
        [--dist-recipes sharded-adams,sharded-scape90,sharded-scape99 --nproc 2 --intra 1]  # SCAPE vs dense AdamS
    PYTHONPATH=src python3 benchmarks/bench_convergence.py --scape-fidelity --steps 300 --seeds 1337,1,2 \
        --out benchmarks/results/comm/2026-12-04_cpu_scape-fidelity.json  # SCAPE 90 % / 99 % vs dense AdamS
    PYTHONPATH=src python3 benchmarks/bench_convergence.py --forge-accum --steps 30 \
        --set data.batch_size=8 --set data.seq_len=64 --out benchmarks/results/forge/2026-12-05_cpu_accum.json  # FORGE k=4 accumulation vs one 4x batch
    PYTHONPATH=src python3 benchmarks/bench_convergence.py --state-fidelity --steps 300 --seeds 0,1,2 \
        --state-dtypes bf16,int8,fp8 --set forge.backend=torch --out DIR/states.json  # FORGE state dtypes

Single-process recipes run one after the other (``leantrain train``); distributed recipes run
under ``torchrun`` (gloo on CPU, NCCL on CUDA) with the same *global* batch. Writes
``report.md`` (final and validation loss, tokens/s, memory breakdown, bytes per step, each as
a ratio to the baseline), ``loss.png`` and ``summary.json`` into ``--out``.

``--scape-fidelity``: dense sharded AdamS, SCAPE at 90 % and at 99 % sparsity (or the recipes of
``--scape-recipes``), each seed of ``--seeds`` (``--ranks`` gloo ranks, 2 by default, the preset's global
batch; ``--ranks 1``: one process, on the GPU where there is one: the same masks, residual and catch-up
over the whole bucket, without the sum over ranks, a fast screen of SCAPE's settings); writes
one JSON (``--out``): per seed the final validation loss, the validation loss at each evaluation,
its ratio to dense AdamS of the same seed and the bytes a step, and per recipe the mean over seeds.

``--state-fidelity``: FORGE (bf16 weights, stochastic rounding) with each state dtype of
``--state-dtypes`` (the first is the yardstick), each seed of ``--seeds``, single process
(``--set forge.backend=torch`` steps with the pure-torch reference, which the kernels equal bit for
bit); writes one JSON (``--out``): per seed the final validation and training loss and the
validation loss's ratio to the yardstick's of the same seed, and per dtype the mean over seeds.

``--forge-accum``: FORGE with 4 micro-batches of a quarter of the preset's batch against one step
over the same rows, for each ``forge.accum_dtype`` (bf16, fp32, int8, int8 without error
feedback), in process; writes one JSON (``--out``): the ratio of the mean training loss
(accumulated / one batch) over all steps and over the last 10, and the bytes the accumulation
buffers hold per fused parameter, counted from the real buffers after one accumulating micro-batch.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import harness  # noqa: E402
import torch  # noqa: E402

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
    p.add_argument("--scape-fidelity", action="store_true", help="SCAPE 90 %% / 99 %% vs dense AdamS over --seeds")
    p.add_argument("--seeds", default="1337,1,2")
    p.add_argument("--scape-recipes", default=",".join(("sharded-adams", "sharded-scape90", "sharded-scape99")),
                   help="with --scape-fidelity: the recipes (dense sharded-adams first, the yardstick)")
    p.add_argument("--dense-from", default="",
                   help="with --scape-fidelity: take the dense runs from this earlier --scape-fidelity JSON of the "
                        "same preset and steps (dense runs are bit-reproducible)")
    p.add_argument("--ranks", type=int, default=2,
                   help="with --scape-fidelity: processes a run (gloo; 1: one process, the mask over the whole bucket "
                        "and no byte on a wire, on the GPU if there is one)")
    p.add_argument("--jobs", type=int, default=1, help="with --scape-fidelity: runs at a time")
    p.add_argument("--state-fidelity", action="store_true", help="FORGE per --state-dtypes over --seeds")
    p.add_argument("--state-dtypes", default="bf16,int8,fp8")
    p.add_argument("--forge-accum", action="store_true", help="FORGE k=4 accumulation vs one 4x batch, per accum_dtype")
    args = p.parse_args(argv)
    if args.scape_fidelity:
        return scape_fidelity(args)
    if args.state_fidelity:
        return state_fidelity(args)
    if args.forge_accum:
        from parts.forge_accum import forge_accum

        return forge_accum(args)
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


def _val_by_step(run_dir: Path) -> dict[str, float]:
    """A run's validation loss at each evaluation (from its ``metrics.jsonl``)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {str(r["step"]): r["val_loss"] for r in rows if r.get("val_loss") is not None}


def _recipe(name: str) -> dict:
    """A recipe of DIST_RECIPES, or ``<recipe>@<key>=<value>;<key>=<value>``: that recipe with overrides."""
    base, _, extra = name.partition("@")
    if base not in DIST_RECIPES:
        raise SystemExit(f"--scape-recipes: no recipe {base!r} (one of {', '.join(DIST_RECIPES)})")
    return {**DIST_RECIPES[base], **dict(kv.split("=", 1) for kv in extra.split(";") if kv)}


def scape_fidelity(args) -> int:
    """Every recipe of ``--scape-recipes`` for every seed on ``--ranks`` ranks, ``--jobs`` runs at a time; one
    JSON at ``--out``, rewritten as runs finish (the runs done so far, their seeds compared where the dense
    run of the seed is done)."""
    nproc, seeds = args.ranks, [int(x) for x in args.seeds.split(",")]
    if nproc < 1:
        raise SystemExit(f"--ranks must be >= 1, got {nproc}")
    out = Path(args.out)
    args.nproc = nproc
    recipes = [r for r in args.scape_recipes.split(",") if r]
    if recipes[0] != "sharded-adams":
        raise SystemExit("--scape-recipes: the first is the yardstick, sharded-adams")
    configs = {name: _recipe(name) for name in recipes}
    runs: dict[str, dict[int, dict]] = {name: {} for name in recipes}
    if args.dense_from:  # (dense runs are bit-reproducible on one host: an earlier file's stand for them)
        earlier = json.loads(Path(args.dense_from).read_text())
        if f"--preset {args.preset} --steps {args.steps} " not in earlier["command"] \
                or _ranks(earlier["command"]) != nproc:
            raise SystemExit(f"--dense-from: {args.dense_from} is not of --preset {args.preset} --steps {args.steps} "
                             f"--ranks {nproc}")
        have = earlier["recipes"]["sharded-adams"]["seeds"]
        missing = [s for s in seeds if str(s) not in have]
        if missing:
            raise SystemExit(f"--dense-from: {args.dense_from} has no dense run of seeds {missing}")
        runs["sharded-adams"] = {s: have[str(s)] for s in seeds}
    dense_from = f" --dense-from {args.dense_from}" if args.dense_from else ""
    command = ("PYTHONPATH=src python3 benchmarks/bench_convergence.py --scape-fidelity "
               f"--preset {args.preset} --steps {args.steps} --seeds {args.seeds} "
               f"--scape-recipes '{args.scape_recipes}'{''.join(f' --set {kv}' for kv in args.set)}"
               f"{f' --ranks {nproc}' if nproc != 2 else ''}"
               f"{dense_from}{f' --jobs {args.jobs}' if args.jobs > 1 else ''} --out {out}")

    def one(name: str, seed: int) -> tuple[str, int, dict]:
        ov = {**configs[name], "dist.intra_node_size": 1, "data.batch_size": _per_rank_batch(args, "sharded-adams")}
        tag = f"{re.sub(r'[^A-Za-z0-9_.-]+', '-', name)}_seed{seed}"
        s = run(tag, {**ov, "train.seed": seed}, args, nproc=nproc)
        return name, seed, {**{k: s[k] for k in ("val_loss", "final_loss", "comm_bytes_per_step")},
                            "val_loss_by_step": _val_by_step(Path(args.out) / tag)}

    todo = [(name, seed) for name in recipes if not runs[name] for seed in seeds]
    args.out = tempfile.mkdtemp(prefix="scape-fidelity-")  # (the runs' directories)
    try:
        with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
            for fut in concurrent.futures.as_completed([pool.submit(one, *job) for job in todo]):
                name, seed, r = fut.result()
                runs[name][seed] = r
                _write_fidelity(out, args, recipes, configs, runs, command, final=False)
    finally:  # (the runs' directories: checkpoints no one reads, ~0.15 GB a tiny run)
        shutil.rmtree(args.out, ignore_errors=True)
    result = _write_fidelity(out, args, recipes, configs, runs, command, final=True)
    dense_mean = result["recipes"]["sharded-adams"]["mean_val_loss"]
    for name, r in result["recipes"].items():
        print(f"{name:>18}: mean val {r['mean_val_loss']:.4f} ({100 * (r['mean_val_loss'] / dense_mean - 1):+.2f}% "
              "vs dense), per seed " + ", ".join(f"{100 * (x['val_vs_dense'] - 1):+.2f}%" for x in r["seeds"].values()),
              flush=True)
    print(f"wrote {out}")
    return 0


def _write_fidelity(out: Path, args, recipes, configs, runs, command, final: bool) -> dict:
    """The fidelity JSON of the runs done so far: per recipe and seed, against the seed's dense run."""
    dense = runs["sharded-adams"]
    result = {"what": f"{', '.join(recipes[1:])} vs dense sharded AdamS, {args.preset} preset, "
                      f"{args.steps} steps, {_procs(args.nproc)}, seeds {args.seeds}"
                      + "".join(f", {kv}" for kv in args.set) + ("" if final else " (partial: the runs done so far)"),
              "command": command, "env": {"cpu": harness.cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
                                          "python": platform.python_version(),  # (the embedded corpus's Python)
                                          **({"gpu": torch.cuda.get_device_name(0)} if args.nproc == 1 and
                                             torch.cuda.is_available() else {})},
              "recipes": {}}
    for name in recipes:
        done = {seed: s for seed, s in sorted(runs[name].items()) if seed in dense}
        if not done:
            continue
        per = {str(seed): {"val_loss": s["val_loss"], "final_loss": s["final_loss"],
                           "val_loss_by_step": s.get("val_loss_by_step", {}),  # (absent in older files)
                           "val_vs_dense": s["val_loss"] / dense[seed]["val_loss"],
                           "comm_bytes_per_step": s["comm_bytes_per_step"],
                           "bytes_vs_dense": (s["comm_bytes_per_step"] / dense[seed]["comm_bytes_per_step"]
                                              if dense[seed]["comm_bytes_per_step"] else None)}  # (1 process: none)
               for seed, s in done.items()}
        mean = sum(r["val_loss"] for r in per.values()) / len(per)
        dense_mean = sum(dense[seed]["val_loss"] for seed in done) / len(done)
        result["recipes"][name] = {"config": configs[name], "seeds": per, "mean_val_loss": mean,
                                   "mean_vs_dense": mean / dense_mean,
                                   "worst_seed_vs_dense": max(r["val_vs_dense"] for r in per.values())}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def _procs(n: int) -> str:
    """How a fidelity file's runs ran: ``2 gloo ranks``, or one process (on the GPU, if the host has one)."""
    if n > 1:
        return f"{n} gloo ranks"
    return "1 process on " + ("the GPU" if torch.cuda.is_available() else "the CPU")


def _ranks(command: str) -> int:
    """The ``--ranks`` of a fidelity file's command (2 where it names none)."""
    m = re.search(r"--ranks (\d+)", command)
    return int(m.group(1)) if m else 2


def state_fidelity(args) -> int:
    """FORGE with every state dtype of ``--state-dtypes`` for every seed; one JSON at ``--out``."""
    seeds, dtypes = [int(x) for x in args.seeds.split(",")], [d for d in args.state_dtypes.split(",") if d]
    out = Path(args.out)
    args.out = tempfile.mkdtemp(prefix="state-fidelity-")  # (the runs' directories)
    print(f"runs in {args.out}", flush=True)  # (benchmarks/parts/fp8_second_moment.py reads their checkpoints)
    runs: dict[str, dict[int, dict]] = {d: {} for d in dtypes}
    for seed in seeds:  # (seed-major: a stopped sweep has every dtype of its first seeds)
        for d in dtypes:
            ov = {"forge.enabled": "true", "train.weights": "bf16", "forge.state_dtype": d, "train.seed": seed}
            runs[d][seed] = run(f"forge-bf16-{d}_seed{seed}", ov, args)
    ref = runs[dtypes[0]]
    extra = "".join(f" --set {kv}" for kv in args.set)
    result = {"what": f"FORGE (bf16 weights, stochastic rounding) per optimizer-state dtype, {args.preset} preset, "
                      f"{args.steps} steps, seeds {seeds}, ratios to {dtypes[0]} states",
              "command": "PYTHONPATH=src python3 benchmarks/bench_convergence.py --state-fidelity "
                         f"--preset {args.preset} --steps {args.steps} --seeds {args.seeds} "
                         f"--state-dtypes {args.state_dtypes}{extra} --out {out}",
              "state_dtypes": {}}
    for d, by_seed in runs.items():
        per = {str(seed): {"val_loss": s["val_loss"], "final_loss": s["final_loss"],
                           "val_vs_ref": s["val_loss"] / ref[seed]["val_loss"]} for seed, s in by_seed.items()}
        mean = sum(r["val_loss"] for r in per.values()) / len(per)
        ref_mean = sum(s["val_loss"] for s in ref.values()) / len(ref)
        result["state_dtypes"][d] = {"seeds": per, "mean_val_loss": mean, "mean_vs_ref": mean / ref_mean,
                                     "worst_seed_vs_ref": max(r["val_vs_ref"] for r in per.values())}
        print(f"{d:>8}: mean val {mean:.4f} ({100 * (mean / ref_mean - 1):+.2f}% vs {dtypes[0]}), per seed "
              + ", ".join(f"{100 * (r['val_vs_ref'] - 1):+.2f}%" for r in per.values()), flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
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

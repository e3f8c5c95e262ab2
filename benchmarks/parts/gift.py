"""GIFT on CPU (2 gloo ranks): its communication error against Euclidean FP8, its bytes, and training.

    PYTHONPATH=src python3 benchmarks/bench_comm.py gift --out DIR [--steps 150] [--ranks 2] [--format nvfp4]
        [--gift-rank 64]

Three runs of the trainer on the ``tiny`` preset (the embedded corpus), each under
``torch.distributed.run`` with ``--ranks`` processes (2) and the same seed and data:

- ``exact``: DDP's fp32 all-reduce (``comm.method none``);
- ``fp8``: every gradient through the FP8 all-reduce in its own coordinates (``comm.method gift
  --comm.gift.whiten false``): Euclidean FP8;
- ``gift``: the linear weights in K-FAC-whitened coordinates (``comm.method gift``).

With ``--format nvfp4`` the two low-precision runs use GIFT's 4-bit format instead (the Euclidean
one is then named ``fp4``).

In the ``gift`` run, every ``--every`` steps and before the reduction, :meth:`GIFT.errors` measures
each whitened layer's relative error against the exact average, for GIFT and for Euclidean FP8, on
the same gradients, in the Euclidean metric and in the whitened one. Bytes a step come from each
run's ledger (``summary.json``); the bf16 all-reduce of the same gradients is counted on the side.
Writes ``gift_<date>_cpu.json`` and ``.md`` (``_nvfp4`` appended for that format, ``_r<ranks>`` for other
than 2 ranks).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "src"))
import harness  # noqa: E402


def runs(fmt: str, rank: int = 64, min_gain: float = 0.0, stat_tokens: int = 0) -> dict[str, list[str]]:
    """The three runs' config overrides (``rank``: GIFT's eigenpairs a factor; ``min_gain``: whiten
    only the layers whose estimated gain is at least this; ``stat_tokens``: the statistics' rows)."""
    low = ["comm.method=gift", f"comm.gift.format={fmt}", f"comm.gift.rank={rank}"]
    gift = low + ([f"comm.gift.min_gain={min_gain}"] if min_gain else []) \
        + ([f"comm.gift.stat_tokens={stat_tokens}"] if stat_tokens else [])
    return {"exact": [], "fp8" if fmt == "e4m3" else "fp4": [*low, "comm.gift.whiten=false"], "gift": gift}


def worker(args) -> int:
    """One trainer run (under torch.distributed.run); with ``--errors``, GIFT's errors every ``--every`` steps."""
    import torch

    from leantrain import config as C
    from leantrain.runtime import collectives as Cc
    from leantrain.runtime.ledger import COMM
    from leantrain.train.trainer import Trainer

    torch.set_num_threads(1)
    overrides = dict(kv.split("=", 1) for kv in args.set)
    cfg = C.build("tiny", overrides=overrides)
    tr = Trainer(cfg, args.run_out)
    rows = []
    gift = next((t.gift for t in tr.techniques if t.name == "gift"), None)
    if args.errors and gift is not None:
        real = gift.reduce_gradients

        def reduce_and_measure():
            step = gift.steps
            if step % args.every == 0 or step == cfg.train.steps - 1:
                kept = copy.deepcopy((COMM.bytes, COMM.calls))  # (the probes' traffic is taken out of the run's ledger)
                errs = gift.errors()
                # the bf16 all-reduce of the same gradients: what DDP in bf16 would send
                with COMM.capture() as led16:
                    for p in gift.params:
                        if p.grad is not None:
                            Cc.all_reduce(p.grad.detach().to(torch.bfloat16).clone())
                COMM.bytes, COMM.calls = kept
                rows.append({"step": step, "errors": errs, "bf16_bytes": led16.total})
            real()

        gift.reduce_gradients = reduce_and_measure
    summary = tr.fit()
    if tr.rank == 0:
        Path(args.run_out, "bench_rows.json").write_text(json.dumps({"rows": rows, "summary": summary}, default=str))
    return 0


def _launch(name: str, extra: list, out: Path, steps: int, every: int, errors: bool, ranks: int) -> dict:
    run_out = out / name
    sets = [f"train.steps={steps}", "train.progress=false", "train.sample_tokens=0", "train.ckpt_every=0", *extra]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port", str(_port()),
           __file__, "worker", "--run-out", str(run_out), "--every", str(every), *(["--errors"] if errors else []),
           "--set", *sets]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{name}: exit {r.returncode}\n{r.stderr[-3000:]}")
    data = json.loads((run_out / "bench_rows.json").read_text())
    metrics = [json.loads(x) for x in (run_out / "metrics.jsonl").read_text().splitlines()]
    return {"rows": data["rows"], "summary": data["summary"], "losses": [m["loss"] for m in metrics if "loss" in m],
            "val": [(m["step"], m["val_loss"]) for m in metrics if m.get("val_loss") is not None]}


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def markdown(res: dict) -> str:
    env = res["env"]
    fmt = res.get("format", "e4m3")
    low = "FP8" if fmt == "e4m3" else "NVFP4"
    lines = [f"# GIFT ({low}) on CPU, {res.get('ranks', 2)} gloo ranks — {env['date']}", "",
             f"torch {env['torch']}; command: `{res['command']}`; the `tiny` preset, {res['steps']} steps, embedded corpus.",
             "", "## Training: the same run with three gradient all-reduces", "",
             "| run | final loss | last val loss | val / exact's | bytes a step | bytes / exact's |", "|---|---|---|---|---|---|"]
    ex = res["runs"]["exact"]
    for name, r in res["runs"].items():
        val = r["val"][-1][1] if r["val"] else None
        b = r["summary"].get("comm_bytes_per_step")
        ex_val = ex["val"][-1][1] if ex["val"] else None
        v = "" if val is None else f"{val:.4f}"
        ratio = "" if val is None or ex_val is None else f"{val / ex_val:.4f}"
        lines.append(f"| {name} | {r['summary'].get('final_loss', float('nan')):.4f} | {v} | {ratio} | {b:.0f} | "
                     f"{b / ex['summary']['comm_bytes_per_step']:.4f} |")
    g = res["runs"]["gift"]["rows"]
    if g:
        lines += ["", "## Communication error of one step's gradients (GIFT's run, before its reduction)", "",
                  "Relative error against the exact average. Euclidean: `‖Ĝ - Ḡ‖ / ‖Ḡ‖`; whitened: the same in "
                  "GIFT's K-FAC coordinates (`‖B^-1/2 (Ĝ - Ḡ) A^-1/2‖ / ‖B^-1/2 Ḡ A^-1/2‖`). Median over the "
                  "whitened layers, and the fraction of layers where GIFT's error is the smaller.", "",
                  f"| step | layers | GIFT, Euclidean | {low}, Euclidean | GIFT, whitened | {low}, whitened | "
                  "GIFT smaller (Euclidean) | GIFT smaller (whitened) |",
                  "|---|---|---|---|---|---|---|---|"]
        for row in g:
            e = row["errors"]
            if not e:
                continue

            def med(k, e=e):
                v = sorted(x[k] for x in e.values())
                return v[len(v) // 2]

            n = len(e)
            lines.append(f"| {row['step']} | {n} | {med('gift'):.4f} | {med('euclidean'):.4f} | {med('gift_whitened'):.4f} | "
                         f"{med('euclidean_whitened'):.4f} | {sum(x['gift'] < x['euclidean'] for x in e.values())}/{n} | "
                         f"{sum(x['gift_whitened'] < x['euclidean_whitened'] for x in e.values())}/{n} |")
        bf = [row["bf16_bytes"] for row in g if row.get("bf16_bytes")]
        if bf:
            lines += ["", f"A bf16 all-reduce of the same gradients sends {bf[-1]} bytes a rank; GIFT's run "
                          f"{res['runs']['gift']['summary']['comm_bytes_per_step']:.0f} a step on average "
                          f"({res['runs']['gift']['summary']['comm_bytes_per_step'] / bf[-1]:.4f}×, the factors' "
                          "broadcasts included)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", nargs="?", default="bench", choices=["bench", "worker"])
    ap.add_argument("--out", default=".")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--ranks", type=int, default=2, help="processes (gloo on CPU)")
    ap.add_argument("--format", default="e4m3", choices=["e4m3", "nvfp4"], help="GIFT's wire format")
    ap.add_argument("--gift-rank", type=int, default=64, help="eigenpairs kept a K-FAC factor")
    ap.add_argument("--min-gain", type=float, default=0.0, help="comm.gift.min_gain of the gift run")
    ap.add_argument("--stat-tokens", type=int, default=0, help="comm.gift.stat_tokens of the gift run")
    ap.add_argument("--run-out")
    ap.add_argument("--errors", action="store_true")
    ap.add_argument("--set", nargs="*", default=[])
    args = ap.parse_args(argv)
    if args.mode == "worker":
        return worker(args)
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
    res = {"env": {"torch": torch.__version__, "date": date, "python": sys.version.split()[0]},
           "command": f"PYTHONPATH=src python3 benchmarks/bench_comm.py gift --steps {args.steps} --every {args.every}"
                      + (f" --ranks {args.ranks}" if args.ranks != 2 else "")
                      + (f" --format {args.format}" if args.format != "e4m3" else "")
                      + (f" --gift-rank {args.gift_rank}" if args.gift_rank != 64 else "")
                      + (f" --min-gain {args.min_gain:g}" if args.min_gain else "")
                      + (f" --stat-tokens {args.stat_tokens}" if args.stat_tokens else ""),
           "steps": args.steps, "ranks": args.ranks, "format": args.format, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in runs(args.format, args.gift_rank, args.min_gain, args.stat_tokens).items():
            print(f"run {name} ...", flush=True)
            r = _launch(name, extra, Path(tmp), args.steps, args.every, errors=name == "gift", ranks=args.ranks)
            res["runs"][name] = r
            print(f"  final loss {r['summary'].get('final_loss')}, val {r['val'][-1] if r['val'] else None}, "
                  f"bytes/step {r['summary'].get('comm_bytes_per_step')}", flush=True)
    stem = harness.stem(f"gift-{args.format}" + (f"-{args.ranks}ranks" if args.ranks != 2 else "")
                        + (f"-rank{args.gift_rank}" if args.gift_rank != 64 else "")
                        + (f"-mingain{args.min_gain:g}" if args.min_gain else "")
                        + (f"-stat{args.stat_tokens}" if args.stat_tokens else ""))
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1, default=str))
    (out / f"{stem}.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())

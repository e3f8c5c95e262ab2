"""Each collective the trainer uses, timed alone on the namespace cluster: its share of the link's rate.

    python benchmarks/cluster/cluster.py collectives --rates 1gbit,300mbit,100mbit
    # -> benchmarks/results/comm-cluster/<date>_cpu-netns_collectives.{json,md}

For each rate, one ``torchrun`` per node (``netns.Cluster``, the sweep's 2 nodes x 1 rank by
default) runs this file as a worker: for each payload size and each op of OPS it calls the op once
untimed, then ``reps`` times between barriers (``barrier; t0; op; barrier; t1``) through
:mod:`leantrain.runtime.collectives`, so the communication ledger records what it records for the
trainer's calls. A result row per (rate, size, op):

- ``seconds``: the mean over the reps of the slowest rank's time (``median_seconds`` and
  ``seconds_by_rep`` beside it). The mean, not the median: gloo's all-to-all and all-gather are
  bimodal from one call to the next on these links (the two directions at once, or one after the
  other: twice the time), and a step pays the mix; the wire bytes are a mean over the reps too;
- ``wire_tx_bytes``: the bytes the busiest node's interface sent a rep (its ``tx_bytes`` counter
  read in the namespace before and after the reps, the barriers' few bytes included);
- ``ledger_bytes``: the bytes :class:`leantrain.runtime.ledger.CommLedger` records a call, the
  largest over the ranks (the NCCL bus-bandwidth convention: all-reduce ``2 (n-1)/n B``,
  reduce-scatter ``(n-1)/n B``, all-gather ``(n-1) B / n``, all-to-all ``(n-1)/n B``, broadcast ``B``
  on the source, for a payload of ``B`` bytes as defined in OPS);
- ``wire_per_ledger``: what gloo really sends per ledger byte (its reduce-scatter sends twice the
  ring's bytes);
- ``efficiency``: ``8 * wire_tx_bytes / (rate * seconds)``, the share of the nominal rate the op's
  real traffic achieves (gloo's all-to-all and all-gather send their two directions one after the
  other in many calls, so their means fall well below all-reduce's).

:func:`per_op` reads a result into the cost model's inputs (``calibrate.py --collectives``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# the ops, by the name the ledger files them under; a payload of B bytes is the tensor the op moves:
# all-reduce and broadcast B, reduce-scatter's input B (its output B / n), all-gather's output B (its
# input, a rank's shard, B / n), all-to-all's input B (B / n to each rank)
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
SIZES = (4_000_000, 16_000_000)  # payload bytes: a DDP bucket of the sweep's model is 25 MB at most
REPS = 8
RATES = ("1gbit", "300mbit", "100mbit")


def _call(op: str, payload: int, world: int):
    """A function running ``op`` once on fp32 tensors of ``payload`` bytes (see OPS)."""
    import torch

    from leantrain.runtime import collectives as C

    n = payload // 4 // world * world
    full, shard = torch.ones(n), torch.ones(n // world)
    out_full, out_shard = torch.empty(n), torch.empty(n // world)
    return {"all_reduce": lambda: C.all_reduce(full),
            "all_gather": lambda: C.all_gather_into_tensor(out_full, shard),
            "reduce_scatter": lambda: C.reduce_scatter_tensor(out_shard, full),
            "all_to_all": lambda: C.all_to_all_single(out_full, full),
            "broadcast": lambda: C.broadcast(full, 0)}[op]


def _tx_bytes(ifname: str) -> int:
    return int(Path(f"/sys/class/net/{ifname}/statistics/tx_bytes").read_text())


def worker(sizes: list[int], reps: int, ifname: str, out: Path) -> None:
    """One rank's part (under torchrun, in its node's namespace); rank 0 writes the rows to ``out``."""
    import torch
    import torch.distributed as dist

    from leantrain.runtime.ledger import COMM

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    rows = []
    for size in sizes:
        for op in OPS:
            call = _call(op, size, world)
            call()
            dist.barrier()
            times = []
            tx0 = _tx_bytes(ifname)
            with COMM.capture() as ledger:
                for _ in range(reps):
                    dist.barrier()
                    t0 = time.perf_counter()
                    call()
                    dist.barrier()
                    times.append(time.perf_counter() - t0)
            worst = torch.tensor([*times, (_tx_bytes(ifname) - tx0) / reps, ledger.total / reps], dtype=torch.float64)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            *seconds, wire, led = worst.tolist()
            rows.append({"op": op, "payload_bytes": size, "seconds": statistics.fmean(seconds),
                         "median_seconds": statistics.median(seconds), "seconds_by_rep": seconds,
                         "wire_tx_bytes": wire, "ledger_bytes": led})
    if dist.get_rank() == 0:
        out.write_text(json.dumps(rows))
    dist.destroy_process_group()


def measure_rate(cluster, rate: str, *, nodes: int, ranks_per_node: int, sizes: list[int], reps: int,
                 timeout: float, nice: int = 0, port: int = 29500) -> list[dict]:
    """The rows of one rate: the links shaped to ``rate``, one torchrun a node running :func:`worker`."""
    from netns import IFNAME, rate_bps

    cluster.set_rate(rate)
    out = Path(tempfile.mkdtemp(prefix="ltcluster-")) / "rows.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": IFNAME}
    procs = []
    try:
        for node in range(nodes):
            cmd = [*(["nice", "-n", str(nice)] if nice else []), sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node-rank", str(node),
                   "--nproc-per-node", str(ranks_per_node), "--master-addr", cluster.addr(0), "--master-port",
                   str(port), str(Path(__file__).resolve()), "--worker", "--sizes", ",".join(map(str, sizes)),
                   "--reps", str(reps), "--ifname", IFNAME, "--out", str(out)]
            procs.append(cluster.popen(node, cmd, env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    bad = [i for i, p in enumerate(procs) if p.returncode != 0]
    if bad:
        raise RuntimeError(f"collectives at {rate}: node {bad[0]} exited with {procs[bad[0]].returncode}:\n"
                           f"{logs[bad[0]][-3000:]}")
    bps = rate_bps(rate)
    rows = json.loads(out.read_text())
    out.unlink()
    out.parent.rmdir()
    for r in rows:
        r |= {"rate": rate, "rate_bps": bps, "wire_per_ledger": r["wire_tx_bytes"] / r["ledger_bytes"],
              "efficiency": 8 * r["wire_tx_bytes"] / (bps * r["seconds"])}
    return rows


def per_op(doc: dict, sizes: list[int] | None = None) -> dict:
    """``{"efficiency": {op: mean over the rates and sizes}, "wire_per_ledger": {op: mean},
    "efficiency_by_rate": {op: {rate: mean over sizes}}}`` of a result (``sizes``: only these)."""
    rows = [r for r in doc["rows"] if sizes is None or r["payload_bytes"] in sizes]
    out = {"efficiency": {}, "wire_per_ledger": {}, "efficiency_by_rate": {}}
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = [r for r in rows if r["op"] == op]
        out["efficiency"][op] = statistics.fmean(r["efficiency"] for r in mine)
        out["wire_per_ledger"][op] = statistics.fmean(r["wire_per_ledger"] for r in mine)
        out["efficiency_by_rate"][op] = {rate: statistics.fmean(r["efficiency"] for r in mine if r["rate"] == rate)
                                         for rate in dict.fromkeys(r["rate"] for r in mine)}
    return out


def markdown(doc: dict) -> str:
    env, summary = doc["environment"], per_op(doc)
    rates = list(dict.fromkeys(r["rate"] for r in doc["rows"]))
    L = [f"# Collectives alone on a shaped cluster of namespaces ({env['date']})", "",
         f"{doc['nodes']} nodes x {doc['ranks_per_node']} ranks (gloo over tbf-shaped veths), {env['cpus']} CPU "
         f"cores, torch {env['torch']}, kernel {env['kernel']}; seconds: the mean of {doc['reps']} reps a point (the "
         f"slowest rank's; the median beside it); host load (1 min) {doc['loadavg_before'][0]:.2f} before, {doc['loadavg_after'][0]:.2f} after.", "",
         f"Command: `{doc['command']}`", "",
         "payload: the tensor the op moves (all-gather's output, reduce-scatter's and all-to-all's input). "
         "ledger: the bytes CommLedger records a call (NCCL's bus-bandwidth convention). wire: the bytes the "
         "busiest node's interface sent a call. efficiency: 8 x wire / (rate x seconds).", "",
         "| rate | op | payload MB | seconds | median s | ledger MB | wire MB | wire/ledger | efficiency |",
         "|---|---|---|---|---|---|---|---|---|"]
    L += [f"| {r['rate']} | {r['op']} | {r['payload_bytes'] / 1e6:g} | {r['seconds']:.3f} | {r['median_seconds']:.3f} "
          f"| {r['ledger_bytes'] / 1e6:.2f} "
          f"| {r['wire_tx_bytes'] / 1e6:.2f} | {r['wire_per_ledger']:.2f} | {r['efficiency']:.3f} |" for r in doc["rows"]]
    L += ["", "Per op (the cost model's inputs, `calibrate.py --collectives`: the mean over rates and sizes):", "",
          "| op | " + " | ".join(f"efficiency {k}" for k in rates) + " | efficiency, mean | wire/ledger |",
          "|---|" + "---|" * (len(rates) + 2)]
    for op, eff in summary["efficiency"].items():
        by = summary["efficiency_by_rate"][op]
        L.append(f"| {op} | " + " | ".join(f"{by[k]:.3f}" for k in rates) +
                 f" | {eff:.3f} | {summary['wire_per_ledger'][op]:.2f} |")
    return "\n".join(L) + "\n"


def write_result(doc: dict, out_dir: Path, hardware: str) -> list[Path]:
    """``<date>_<hardware>_collectives.{json,md}`` in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    base = out_dir / f"{datetime.date.today().isoformat()}_{hardware}_collectives"
    Path(f"{base}.json").write_text(json.dumps(doc, indent=1))
    Path(f"{base}.md").write_text(markdown(doc))
    return [Path(f"{base}.json"), Path(f"{base}.md")]


def _worker_main(argv: list[str]) -> None:
    sys.path.insert(0, str(ROOT / "src"))
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--sizes", required=True)
    ap.add_argument("--reps", type=int, required=True)
    ap.add_argument("--ifname", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    worker([int(s) for s in a.sizes.split(",")], a.reps, a.ifname, Path(a.out))


if __name__ == "__main__":
    _worker_main(sys.argv[1:])

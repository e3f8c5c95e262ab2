"""leantrain's trainer on a bandwidth-limited cluster made on one machine.

    # one run: 2 nodes x 1 rank, 100 Mbit/s links, the int8 all-reduce
    python benchmarks/cluster/cluster.py run --rate 100mbit --recipe ddp-int8 --out /tmp/p.json -- --preset small
    # one run through phases: unlimited | 100 Mbit/s | unlimited | 30 Mbit/s | unlimited (phases.py)
    python benchmarks/cluster/cluster.py run --rates 100mbit,30mbit --recipe ddp-int8 --out /tmp/p.json -- ...
    # the same without namespaces or shaping (plain torchrun on this host; no root needed)
    python benchmarks/cluster/cluster.py run --local --ranks-per-node 2 --recipe ddp-fp32 --out /tmp/p.json -- ...
    # the whole grid -> benchmarks/results/comm-cluster/<date>_cpu-netns.{json,md,png}
    python benchmarks/cluster/cluster.py sweep
    # the grid on this host's own links, no shaping (NCCL on a machine of several GPUs, gloo otherwise)
    #   -> benchmarks/results/comm-cluster/<date>_<hardware>-local.{json,md}
    python benchmarks/cluster/cluster.py sweep --local --ranks-per-node 8 -- --preset 1b --data.batch-size 4
    # the table and plot again from a sweep's JSON; the cost model's fit and projection
    python benchmarks/cluster/cluster.py report benchmarks/results/comm-cluster/<date>_cpu-netns.json
    python benchmarks/cluster/cluster.py project benchmarks/results/comm-cluster/<date>_cpu-netns.json
    # each collective alone: its efficiency and wire bytes per rate (collectives.py)
    python benchmarks/cluster/cluster.py collectives --rates 1gbit,300mbit,100mbit

Each node is a network namespace on a bridge (``netns.py``); its ranks run under one
``torchrun --nnodes M --node-rank i`` inside it, gloo bound to the node's veth
(``GLOO_SOCKET_IFNAME``). A point records the median step time of the timed steps (from
``metrics.jsonl``), the bytes and calls per step of the communication ledger (``summary.json``) and,
as a cross-check, the bytes of the veth counters (sampled when rank 0 logs a step, so the window
holds whole steps), the validation loss, and the cores other work took meanwhile. Needs root for
namespaces; says so in one sentence otherwise.

The sweep measures each recipe in one run whose phases alternate between the unlimited link and
each rate (``phases.py``), so every shaped point is paired with its recipe's compute measured
seconds before and after it, and the cost model fits only what the link adds. It runs 2 nodes x 1
rank (a core a rank on a 2-core host: no oversubscription), waits for other work on the host to
stop before each run, and measures a recipe again when its reference phases drifted apart.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
import collectives  # noqa: E402
from netns import IFNAME, Cluster, ClusterError, rate_bps, teardown  # noqa: E402
from phases import CpuMeter, phase_after, run_steps, schedule, split_points, wait_until_idle  # noqa: E402

# The techniques, each as the flags that turn it on (the one place to change when flags move).
RECIPES: dict[str, list[str]] = {
    "ddp-fp32": ["--dist.mode", "ddp", "--comm.method", "none"],
    "ddp-bf16": ["--dist.mode", "ddp", "--comm.method", "none", "--train.weights", "bf16"],
    "ddp-int8": ["--dist.mode", "ddp", "--comm.method", "int8"],
    "gift-e4m3": ["--dist.mode", "ddp", "--comm.method", "gift", "--comm.gift.format", "e4m3"],
    "gift-nvfp4": ["--dist.mode", "ddp", "--comm.method", "gift", "--comm.gift.format", "nvfp4"],
    "sharded": ["--dist.mode", "sharded", "--comm.method", "none"],
    "sharded-sdp4bit": ["--dist.mode", "sharded", "--comm.method", "sdp4bit"],
    "sharded-adams": ["--dist.mode", "sharded", "--comm.method", "none", "--optim.name", "adams"],
    # (no density warm-up: every step after the first is timed at the recipe's density)
    "scape-90": ["--dist.mode", "sharded", "--comm.method", "scape", "--comm.scape.density", "0.1",
                 "--comm.scape.warmup", "0", "--optim.name", "adams"],
    "scape-99": ["--dist.mode", "sharded", "--comm.method", "scape", "--comm.scape.density", "0.01",
                 "--comm.scape.warmup", "0", "--optim.name", "adams"],
}
# the uncompressed run of the same mode (and optimizer) each recipe's speedup is taken against
REFERENCE = {"ddp-fp32": "ddp-fp32", "ddp-bf16": "ddp-fp32", "ddp-int8": "ddp-fp32", "gift-e4m3": "ddp-fp32",
             "gift-nvfp4": "ddp-fp32", "sharded": "sharded", "sharded-sdp4bit": "sharded",
             "sharded-adams": "sharded-adams", "scape-90": "sharded-adams", "scape-99": "sharded-adams"}

# the sweep's model and grid: the small preset (15.7 M parameters) at a batch a 2-core CPU steps
# through in about a second; 2 nodes x 1 rank, so each rank has a core of its own. Each recipe is
# one run whose phases alternate between the unlimited link and each rate (phases.py).
SWEEP_TRAIN = ["--preset", "small", "--data.batch-size", "2", "--data.seq-len", "128"]
SWEEP_RATES = ["1gbit", "300mbit", "100mbit", "30mbit"]
SWEEP_STEPS = 8  # a run at one rate (`run` without --rates)
PHASE_STEPS = 4  # steps a phase of a scheduled run: the first settles after the link changes, 3 are timed
HARDWARE = "cpu-netns"  # the namespace sweep's result name
# the sweep measures a recipe again when the two unlimited-link phases around a rate differ by more
# than MAX_DRIFT, or when other work took more than MAX_OTHER_CORES of the host's cores in a phase
MAX_DRIFT = 0.05
MAX_OTHER_CORES = 0.2
# every run: no checkpoints, samples or progress bars; one CPU thread a rank; one evaluation at the end;
# every step a log step, so that each step's row reaches metrics.jsonl as the next one starts (the
# harness follows the run's progress, and times its steps, by those rows)
FIXED = ["--train.ckpt-every", "0", "--train.sample-tokens", "0", "--train.progress", "false",
         "--train.threads", "1", "--train.log-every", "1", "--train.eval-batches", "4"]



def _portable(cmd: str) -> str:
    """A recorded command without this machine's paths: the interpreter as ``python``, the run's
    temporary directory as ``$TMP``."""
    cmd = cmd.replace(sys.executable, "python")
    return re.sub(r"/tmp/ltcluster-\w+", "$TMP", cmd)

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_args(recipe: str, steps: int, user: list[str]) -> list[str]:
    if recipe not in RECIPES:
        raise SystemExit(f"cluster: unknown recipe {recipe!r}; choose from {sorted(RECIPES)}")
    return ["--steps", str(steps), *FIXED, "--train.eval-every", str(steps), *RECIPES[recipe], *user]


def _rows(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def launch(*, recipe: str, steps: int, user_args: list[str], nodes: int, ranks_per_node: int,
           rate: str | None, cluster: Cluster | None, workdir: Path, timeout: float = 900.0,
           nice: int = 0, rates: list[str] | None = None, phase_steps: int = PHASE_STEPS) -> dict | list[dict]:
    """One training run across the nodes; returns its point (see the module docstring), or with
    ``rates`` a run through ``phases.schedule(rates)`` (``steps`` is then set by the schedule) and
    its points, one per rate and the unshaped one (``phases.split_points``). Without a cluster
    (``--local``) the schedule's phases are kept apart but the link is never shaped."""
    phases = schedule(rates) if rates else None
    if phases:
        steps = run_steps(rates, phase_steps)
        rate = None
    out = workdir / "run"
    args = train_args(recipe, steps, user_args)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", "LEANTRAIN_PROGRESS": "0"}
    port = 29500 if cluster else free_port()
    master = cluster.addr(0) if cluster else "127.0.0.1"
    if cluster:
        env["GLOO_SOCKET_IFNAME"] = IFNAME
    procs, cmds, logs = [], [], []
    t0 = time.time()
    try:
        for node in range(nodes if cluster else 1):
            cmd = [*(["nice", "-n", str(nice)] if nice else []), sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes if cluster else 1),
                   "--node-rank", str(node), "--nproc-per-node", str(ranks_per_node),
                   "--master-addr", master, "--master-port", str(port),
                   "-m", "leantrain", "train", "--out", str(out), *args]
            log = open(workdir / f"node{node}.log", "w")
            logs.append(log)
            cmds.append(_portable(shlex.join(cmd)))
            if cluster:
                procs.append(cluster.popen(node, cmd, env, stdout=log, stderr=subprocess.STDOUT))
            else:
                procs.append(subprocess.Popen(cmd, env=env, start_new_session=True, stdout=log,
                                              stderr=subprocess.STDOUT))
        metrics = out / "metrics.jsonl"
        marks, phase_cpu = _watch(procs, metrics, cluster, phases, phase_steps, t0 + timeout,
                                  f"{recipe} at {rate or ','.join(rates or [])}")
        end_counters = cluster.counters() if cluster else None
        bad = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode not in (None, 0)]
        if bad or any(p.poll() is None for p in procs):
            for log in logs:
                log.flush()
            tail = (workdir / f"node{bad[0][0] if bad else 0}.log").read_text()[-3000:]
            raise RuntimeError(f"{recipe} at {rate}: node {bad[0][0] if bad else '?'} exited with "
                               f"{bad[0][1] if bad else '?'}:\n{tail}")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for log in logs:
            log.close()
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    shutil.rmtree(workdir, ignore_errors=True)
    tokens_per_step = summary["world_size"] * _flag(args, "--data.batch-size", int) * _flag(args, "--data.seq-len", int)
    all_times = [tokens_per_step / r["tokens_per_second"] for r in rows]
    times = all_times[1:]  # row 0: the untimed warm-up (a run through phases leaves out more: phases.py)
    comm = summary["comm"]
    per = max(comm["steps"], 1)
    point = {
        "recipe": recipe, "rate": rate or "unshaped", "rate_bps": rate_bps(rate), "nodes": nodes if cluster else 1,
        "ranks_per_node": ranks_per_node, "world_size": summary["world_size"], "steps": steps,
        "step_time_s": statistics.median(times) if times else None, "step_times_s": times,
        "tokens_per_step": tokens_per_step, "row_times_s": all_times, "parameters": summary["parameters"],
        "ledger_bytes_per_step": comm["bytes_per_step"],
        "ledger_by_scope_per_step": {k: v / per for k, v in comm["by_scope"].items()},
        "ledger_by_op_per_step": {k: v / per for k, v in comm["by_op"].items()},
        "ledger_calls_per_step": {k: v / per for k, v in comm.get("calls_by_op", {}).items()},
        "val_loss": summary["val_loss"], "initial_val_loss": summary["initial_val_loss"],
        "final_loss": summary["final_loss"], "wall_s": time.time() - t0, "loadavg": os.getloadavg(),
        "commands": cmds,
    }
    if cluster:
        point.update(_wire(marks, end_counters, steps))
    if phases:
        return split_points(point, all_times, rates, phase_steps, phase_cpu, rate_bps)
    return point


def _watch(procs, metrics: Path, cluster: Cluster | None, phases: list[str] | None, phase_steps: int,
           deadline: float, what: str) -> tuple[dict, list[dict]]:
    """Poll a run until its processes exit (or one fails): ``marks`` (rows rank 0 has logged ->
    the links' counters at that moment) and, for a run through ``phases``, the shaping changed at
    each phase's start and other work's cores over each phase (``phases.CpuMeter``)."""
    marks: dict[int, list[dict]] = {}
    meter, phase_cpu, current = CpuMeter([p.pid for p in procs]), [], -1
    while any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs):
            break
        if time.time() > deadline:
            raise TimeoutError(f"{what}: no result in time")
        n = _rows(metrics)
        if n not in marks:
            marks[n] = cluster.counters() if cluster else []
        phase = phase_after(n, phase_steps) if phases else -1
        if phase > current:  # a phase ended (a poll that missed a boundary closes several at once)
            cpu = meter.sample()
            phase_cpu += [cpu] * (phase - current - 1 if current < 0 else phase - current)
            current = phase
            if cluster and phase < len(phases):
                cluster.set_rate(None if phases[phase] == "unshaped" else phases[phase])
        time.sleep(0.02)
    if phases:
        phase_cpu += [meter.sample()] * (len(phases) - len(phase_cpu))
    return marks, phase_cpu


def _flag(args: list[str], name: str, tp):
    """The last value given for ``name`` (the preset's when absent: read it from config)."""
    val = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            val = args[i + 1]
        elif a.startswith(name + "="):
            val = a.split("=", 1)[1]
    if val is None:
        sys.path.insert(0, str(ROOT / "src"))
        from leantrain import config

        preset = _flag(args, "--preset", str) or "tiny"
        sec, field = name[2:].replace("-", "_").split(".")
        return tp(getattr(getattr(config.preset(preset), sec), field))
    return tp(val)


def _wire(marks: dict, end: list[dict], steps: int) -> dict:
    """Bytes each node sent per step: counters between rank 0 logging its first row after the
    warm-up (row 1: the end of step 2) and its last row before the end (row ``steps - 1``: the end
    of the last step); a row the poll missed moves the window by a step. The whole run (DDP's
    first broadcast included) when no such window was seen."""
    inside = sorted(k for k in marks if 1 <= k <= steps - 1 and marks[k])
    if len(inside) >= 2:
        i, j = inside[0], inside[-1]
        a, b, n, window = marks[i], marks[j], j - i, f"steps {i + 2}..{j + 1}"
    else:
        a, b, n, window = [dict.fromkeys(end[0], 0)] * len(end), end, steps, "whole run"
    return {"wire_tx_bytes_per_step": [(y["tx_bytes"] - x["tx_bytes"]) / n for x, y in zip(a, b)],
            "wire_rx_bytes_per_step": [(y["rx_bytes"] - x["rx_bytes"]) / n for x, y in zip(a, b)],
            "loopback_bytes_per_step": [(y["lo_bytes"] - x["lo_bytes"]) / n for x, y in zip(a, b)],
            "wire_window": window}


# ---------------------------------------------------------------- commands


def _refuse(e: Exception) -> int:
    print(f"cluster: {e}", file=sys.stderr)
    return 2


def _on_signal(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


def cmd_run(a, user: list[str]) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="ltcluster-"))
    rates = a.rates.split(",") if a.rates else None
    if rates and a.rate:
        raise SystemExit("cluster: give --rate (one rate a run) or --rates (a run through phases), not both")
    opts = dict(recipe=a.recipe, steps=a.steps, user_args=user, ranks_per_node=a.ranks_per_node, workdir=workdir,
                timeout=a.timeout, nice=a.nice, rates=rates, phase_steps=a.phase_steps)
    try:
        if a.local:
            point = launch(nodes=1, rate=None, cluster=None, **opts)
        else:
            with Cluster(a.nodes, None if rates else a.rate, a.delay) as c:
                point = launch(nodes=a.nodes, rate=a.rate, cluster=c, **opts)
    except ClusterError as e:
        return _refuse(e)
    command = _portable(shlex.join(["python", *sys.argv]))
    point = {"command": command, "points": point} if rates else {**point, "command": command}
    text = json.dumps(point, indent=1)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text)
    print(text)
    return 0


def environment() -> dict:
    import torch

    env = {"date": datetime.date.today().isoformat(), "host": platform.node(), "cpus": os.cpu_count(),
           "kernel": platform.release(), "python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():  # (the trainer's ranks then run on the GPUs, over NCCL)
        env.update(gpu=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count())
    return env


def _worst(points: list[dict]) -> tuple[float, float]:
    """A scheduled run's largest drift between the reference phases around a rate, and the most
    cores other work took in a phase."""
    return (max((p.get("paired_drift", 0.0) for p in points), default=0.0),
            max((p.get("other_cpu_cores") or 0.0 for p in points), default=0.0))


def _host_idle(a, then: str = "") -> bool:
    """Wait (``--busy-wait``) for other work on the host to stop; False, said in one sentence, when it
    still takes more than ``--max-other-cores`` (unless ``--allow-busy``)."""
    busy = wait_until_idle(a.max_other_cores, a.busy_wait)
    if busy > a.max_other_cores and not a.allow_busy:
        print(f"cluster: other work keeps {busy:.2f} cores of this host busy (limit {a.max_other_cores}); "
              f"the sweep stops here{then}", file=sys.stderr)
        return False
    return True


def cmd_sweep(a, user: list[str]) -> int:
    """Per recipe, one run through the phases of ``phases.schedule(rates)``; a run whose reference
    phases drifted apart or that shared the host is measured again (``--repeats``), the run with the
    smallest drift kept and the others under ``replaced_points``."""
    if a.local:
        return _sweep_local(a, user)
    recipes = a.recipes.split(",") if a.recipes else list(RECIPES)
    rates = a.rates.split(",")
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{datetime.date.today().isoformat()}_{a.hardware}.json"
    train = [*SWEEP_TRAIN, *user]
    doc = {"command": shlex.join(["python", *sys.argv]), "environment": environment(), "nice": a.nice,
           "nodes": a.nodes, "ranks_per_node": a.ranks_per_node, "steps": run_steps(rates, a.phase_steps),
           "protocol": {"schedule": schedule(rates), "phase_steps": a.phase_steps, "max_drift": a.max_drift,
                        "max_other_cores": a.max_other_cores, "repeats": a.repeats},
           "train_args": train, "recipes": {r: RECIPES[r] for r in recipes}, "reference": REFERENCE, "points": []}
    if path.exists() and a.resume:  # today's points kept; this command's recipes run again unless done
        old = json.loads(path.read_text())
        doc = {**old, "commands": [*old.get("commands", [old["command"]]), doc["command"]],
               "recipes": {**old["recipes"], **doc["recipes"]}}
    done = {p["recipe"] for p in doc["points"]}
    t0 = time.time()
    try:
        for r in [r for r in recipes if r not in done]:
            runs = []
            for attempt in range(1 + a.repeats):
                if not _host_idle(a, ", rerun it with --resume when the host is idle"):
                    return 3
                with Cluster(a.nodes, None) as c:
                    pts = launch(recipe=r, steps=0, user_args=train, nodes=a.nodes, ranks_per_node=a.ranks_per_node,
                                 rate=None, cluster=c, workdir=Path(tempfile.mkdtemp(prefix="ltcluster-")),
                                 timeout=a.timeout, nice=a.nice, rates=rates, phase_steps=a.phase_steps)
                for p in pts:
                    p["attempt"] = attempt
                runs.append(pts)
                drift, other = _worst(pts)
                print(f"[{time.time() - t0:6.0f} s] {r:<16} " + "  ".join(
                    f"{p['rate']} {p['step_time_s']:.3f} s" for p in pts) + f"  drift {drift:.1%}  other work "
                    f"{other:.2f} cores  wire {max(pts[0]['wire_tx_bytes_per_step']) / 1e6:.2f} MB", flush=True)
                if drift <= a.max_drift and other <= a.max_other_cores:
                    break
            best = min(runs, key=lambda pts: _worst(pts)[0])
            doc["points"] += best
            doc["replaced_points"] = [*doc.get("replaced_points", []), *(p for pts in runs if pts is not best for p in pts)]
            path.write_text(json.dumps(doc, indent=1))
    except ClusterError as e:
        return _refuse(e)
    from report import write_report

    write_report(path)
    return 0


def _sweep_local(a, user: list[str]) -> int:
    """``sweep --local``: every recipe in one plain torchrun on this host, its links as they are (NVLink
    and NCCL on a machine of several GPUs; loopback and gloo otherwise), ``--steps`` steps each: step
    time, the ledger's bytes, validation loss, and each recipe's speedup over its uncompressed
    reference on those links. No namespaces, so no root, no shaping and no interface counters."""
    import torch

    sys.path.append(str(HERE.parent))  # (after this folder: its report.py, not the benchmarks' one)
    import harness

    recipes = a.recipes.split(",") if a.recipes else list(RECIPES)
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        raise SystemExit(f"cluster: unknown recipes {unknown}; choose from {sorted(RECIPES)}")
    missing = sorted({REFERENCE[r] for r in recipes} - set(recipes))
    if missing:
        raise SystemExit(f"cluster: --recipes lacks the references {missing} the speedups are taken against")
    hardware = a.hardware if a.hardware != HARDWARE else f"{harness.hardware()}-local"
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{datetime.date.today().isoformat()}_{hardware}.json"
    train = user or SWEEP_TRAIN  # (the namespace sweep's model unless the command names one)
    doc = {"command": _portable(shlex.join(["python", *sys.argv])), "environment": environment(), "local": True,
           "backend": "nccl" if torch.cuda.is_available() else "gloo", "nice": 0, "nodes": 1,
           "ranks_per_node": a.ranks_per_node, "steps": a.steps, "train_args": train,
           "recipes": {r: RECIPES[r] for r in recipes}, "reference": REFERENCE, "points": []}
    t0 = time.time()
    for r in recipes:
        if not _host_idle(a):
            return 3
        p = launch(recipe=r, steps=a.steps, user_args=train, nodes=1, ranks_per_node=a.ranks_per_node, rate=None,
                   cluster=None, workdir=Path(tempfile.mkdtemp(prefix="ltcluster-")), timeout=a.timeout)
        doc["points"].append(p)
        print(f"[{time.time() - t0:6.0f} s] {r:<16} {p['step_time_s']:.4f} s a step  "
              f"ledger {p['ledger_bytes_per_step'] / 1e6:.2f} MB  val {p['val_loss']:.4f}", flush=True)
        path.write_text(json.dumps(doc, indent=1))
    from report import write_report

    for f in write_report(path):
        print(f)
    return 0


def cmd_report(a, _user) -> int:
    from report import write_report

    for p in write_report(Path(a.json)):
        print(p)
    return 0


def cmd_project(a, _user) -> int:
    from project import write_projection

    for p in write_projection(Path(a.json), holdout=a.holdout, validate=tuple(Path(v) for v in a.validate),
                              collectives=Path(a.collectives) if a.collectives else None):
        print(p)
    return 0


def cmd_collectives(a, _user) -> int:
    """Each collective alone at each rate (``collectives.py``), in one cluster whose links change rate."""
    sizes = [int(s) for s in a.sizes.split(",")]
    doc = {"what": "each collective the trainer uses, timed alone on the namespace cluster at each rate: seconds, "
                   "wire and ledger bytes, efficiency (collectives.py)",
           "command": shlex.join(["python", *sys.argv]), "environment": environment(), "nodes": a.nodes,
           "ranks_per_node": a.ranks_per_node, "reps": a.reps, "sizes": sizes, "nice": a.nice,
           "loadavg_before": os.getloadavg(),
           "rows": []}
    try:
        with Cluster(a.nodes, None) as c:
            for rate in a.rates.split(","):
                doc["rows"] += collectives.measure_rate(c, rate, nodes=a.nodes, ranks_per_node=a.ranks_per_node,
                                                        sizes=sizes, reps=a.reps, timeout=a.timeout, nice=a.nice)
                print(f"{rate}: " + "  ".join(f"{r['op']} {r['efficiency']:.2f}" for r in doc["rows"]
                                              if r["rate"] == rate), flush=True)
    except ClusterError as e:
        return _refuse(e)
    doc["loadavg_after"] = os.getloadavg()
    for p in collectives.write_result(doc, Path(a.out), a.hardware):
        print(p)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    user: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, user = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(prog="cluster.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("run", "sweep"):
        p = sub.add_parser(name)
        p.add_argument("--nodes", type=int, default=2)
        p.add_argument("--ranks-per-node", type=int, default=1,
                       help="ranks a node (default 1: 2 nodes x 1 rank keep a core a rank on a 2-core host)")
        p.add_argument("--steps", type=int, default=SWEEP_STEPS, help="steps a run at one rate (the first is not timed)")
        p.add_argument("--phase-steps", type=int, default=PHASE_STEPS,
                       help="steps a phase of a run through several rates (the first of each is not timed)")
        p.add_argument("--timeout", type=float, default=900.0, help="seconds a run may take")
        p.add_argument("--nice", type=int, default=-10 if name == "sweep" else 0,
                       help="the ranks' niceness (negative: ahead of other work on the host, for steadier timings)")
    run = sub.choices["run"]
    run.add_argument("--recipe", default="ddp-fp32", help=f"one of {sorted(RECIPES)}")
    run.add_argument("--rate", default=None, help="link rate, e.g. 100mbit, 1gbit (default: unshaped)")
    run.add_argument("--rates", default=None, help="comma list: one run through phases alternating the unlimited "
                                                   "link and each rate (phases.py); writes {'points': [...]}")
    run.add_argument("--delay", default=None, help="one-way delay a link, e.g. 1ms (needs netem)")
    run.add_argument("--local", action="store_true", help="plain torchrun on this host: no namespaces, no shaping")
    run.add_argument("--out", help="write the point's JSON here")
    sw = sub.choices["sweep"]
    sw.add_argument("--rates", default=",".join(SWEEP_RATES), help="shaped rates (each paired with the unlimited link)")
    sw.add_argument("--repeats", type=int, default=1, help="extra runs of a recipe whose run drifted or shared the host")
    sw.add_argument("--max-drift", type=float, default=MAX_DRIFT,
                    help="largest change between the two unlimited-link phases around a rate before a repeat")
    sw.add_argument("--max-other-cores", type=float, default=MAX_OTHER_CORES,
                    help="cores other work may use (before a run: waits, then stops; in a phase: a repeat)")
    sw.add_argument("--busy-wait", type=float, default=600.0, help="seconds to wait for an idle host before a run")
    sw.add_argument("--allow-busy", action="store_true", help="run even when other work keeps the host busy")
    sw.add_argument("--recipes", default=None, help="comma list (default: all)")
    sw.add_argument("--out", default=str(ROOT / "benchmarks/results/comm-cluster"))
    sw.add_argument("--hardware", default=HARDWARE,
                    help=f"the result's name after the date (default: {HARDWARE}; with --local the GPU or cpu, "
                         "and -local)")
    sw.add_argument("--local", action="store_true",
                    help="plain torchrun on this host, its links unshaped (NCCL on GPUs): --steps steps a recipe, "
                         "--ranks-per-node ranks; no root needed")
    sw.add_argument("--resume", action="store_true", help="keep the recipes of today's JSON, run the rest")
    p = sub.add_parser("report")
    p.add_argument("json")
    p = sub.add_parser("project")
    p.add_argument("json")
    p.add_argument("--holdout", default="300mbit",
                   help="the rates (comma list) whose points are predicted, not fitted")
    p.add_argument("--validate", action="append", default=[],
                   help="another sweep's JSON whose points the model fitted on every point of the first predicts")
    p.add_argument("--collectives", default=None,
                   help="a `collectives` result: the model takes each collective's measured efficiency and wire bytes")
    p = sub.add_parser("collectives", help="each collective alone at each rate (collectives.py)")
    p.add_argument("--rates", default=",".join(collectives.RATES), help="shaped rates (comma list)")
    p.add_argument("--sizes", default=",".join(map(str, collectives.SIZES)),
                   help="payload bytes (comma list; see collectives.OPS)")
    p.add_argument("--reps", type=int, default=collectives.REPS,
                   help="timed calls an op, size and rate (their mean is kept)")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=1)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a rate may take")
    p.add_argument("--nice", type=int, default=-10,
                   help="the ranks' niceness (negative: ahead of other work on the host, for steadier timings)")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/comm-cluster"))
    p.add_argument("--hardware", default=HARDWARE)
    p = sub.add_parser("clean", help="remove namespaces, veths and the bridge a crashed run left")
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGHUP, _on_signal)
    if a.cmd == "clean":
        teardown()
        return 0
    return {"run": cmd_run, "sweep": cmd_sweep, "report": cmd_report, "project": cmd_project,
            "collectives": cmd_collectives}[a.cmd](a, user)


if __name__ == "__main__":
    sys.exit(main())

"""Run a function on N real gloo processes on loopback and collect what each returns.

    results = run_distributed(fn, world_size=2, args=(...,))

``fn(rank, world_size, *args)`` runs in a fresh process after
``init_process_group("gloo")`` on a free port; its return value (tensors,
numbers, dicts: anything picklable) comes back in ``results[rank]``. An
exception in any rank, or a timeout, fails the caller with that rank's
traceback. ``fn`` must be a module-level function (it is pickled by name).

The ranks start from a fork server that has imported torch and leantrain once (where the platform
has one; else by spawn): a rank then starts in milliseconds instead of importing torch anew, which
on a small CPU machine is seconds a process and hundreds of processes a test suite. Each rank gets
the caller's environment as it is at the call (as a spawned process would), plus ``env``.
"""

from __future__ import annotations

import os
import socket
import traceback
from datetime import timedelta

import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed", "leantrain", "interp_speed"]

# what a rank prints when gloo's threads abort the process at exit (a C++ std::terminate in torch's
# gloo backend): a group that outlives destroy_process_group keeps its worker threads until the
# interpreter shuts down. leantrain's commands close theirs (runtime.distributed.close); a rank that
# a test's own code leaves with a live group can still abort so, rarely, on a loaded host
GLOO_ABORT = "terminate called without an active exception"


def once_more_on_gloo_abort(job):
    """``job()`` (a ``subprocess.CompletedProcess`` of a multi-process run), and once more if it failed
    by gloo's own abort; ``job`` must start afresh (e.g. into an empty directory)."""
    r = job()
    if r.returncode != 0 and GLOO_ABORT in r.stdout + r.stderr:
        r = job()
    return r


def _context():
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # (read when the server starts: the first call)
    return ctx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue, env):
    import torch
    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=60),
        )
        out = fn(rank, world_size, *args)
        queue.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, args: tuple = (), timeout: float = 180.0, env: dict | None = None) -> list:
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world_size),
           **(env or {})}
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, env)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = payload
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break
    except Exception as e:  # queue.Empty on timeout
        errors.append(f"distributed run timed out after {timeout}s ({type(e).__name__}); ranks done: {sorted(results)}")
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 30)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]


def resumes_bit_identically(build, batch, rank: int, world: int, saved_at: int, end: int) -> bool:
    """``build(seed) -> (model, optimizer)``; ``batch(step, rank, world) -> (x, y)``. Train to
    ``saved_at``, take the model's and optimizer's state dicts, train on to ``end``; a second pair
    built from another seed loads them and trains the same steps: the same weights bit for bit?"""
    import torch

    def run(m, o, steps):
        for s in steps:
            x, y = batch(s, rank, world)
            m(x, y).backward()
            o.step()
            o.zero_grad()

    def flat(m):
        return torch.cat([p.detach().reshape(-1).float() for p in m.parameters()])

    m, o = build(0)
    run(m, o, range(saved_at))
    model_sd = {k: v.clone() for k, v in m.state_dict().items()}
    opt_sd = o.state_dict()
    run(m, o, range(saved_at, end))
    m2, o2 = build(7)  # different init: everything must come from the checkpoint
    m2.load_state_dict(model_sd)
    o2.load_state_dict(opt_sd)
    run(m2, o2, range(saved_at, end))
    return torch.equal(flat(m), flat(m2))

"""Whole-step benchmarks, one configuration per process: the timing loop a worker runs, the
guard that turns its failure into a result, and the parent's side that starts it.

A worker prints one line ``RESULT <json>``; the parent reads the last such line. A worker that
runs out of device memory reports ``{"status": "oom"}``, any other exception ``{"status":
"error"}`` with its text, and a worker that does not answer within the timeout is killed and
recorded as ``{"status": "timeout"}``: one configuration's failure never stops the others.
Used by ``bench_forge.py`` (part b) and ``bench_memory.py``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
RESULT = "RESULT "


def worker_env() -> dict:
    """The environment of a worker process: ``src/`` first on PYTHONPATH, Triton compiled (not
    interpreted), autotuning results cached."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
           "TRITON_CACHE_AUTOTUNING": "1"}
    env.pop("TRITON_INTERPRET", None)
    return env


def run_worker(argv: list[str], timeout: float, env: dict | None = None) -> dict:
    """Run ``python argv...`` and return its last ``RESULT`` line as a dict; without one,
    ``{"status": "error", "error": <the end of its stderr>}``; past ``timeout`` seconds,
    ``{"status": "timeout"}``."""
    try:
        r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout,
                           env=env or worker_env())
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "error": f"no result within {timeout:g}s"}
    lines = [x for x in r.stdout.splitlines() if x.startswith(RESULT)]
    if lines:
        return json.loads(lines[-1][len(RESULT):])
    return {"status": "error", "error": (r.stderr or r.stdout or f"exit {r.returncode}")[-2000:]}


def guarded(fn: Callable[[], dict]) -> dict:
    """``fn()``, or ``{"status": "oom" | "error", "error": ...}`` if it raised."""
    import torch

    try:
        return fn()
    except torch.OutOfMemoryError as e:  # (torch.cuda.OutOfMemoryError is this class)
        return {"status": "oom", "error": str(e)[:500]}
    except Exception as e:  # noqa: BLE001
        return {"status": "error", "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"}


def print_result(result: dict) -> None:
    """The worker's answer to :func:`run_worker`."""
    print(RESULT + json.dumps(result, default=str), flush=True)


def timed_steps(one_step: Callable[[], object], *, warmup: int, steps: int, device: str = "cuda",
                after_warmup: Callable[[], None] | None = None) -> dict:
    """Run ``warmup`` steps, read the bytes held between steps, reset the allocator's peak, call
    ``after_warmup`` (e.g. a CUDA-graph capture: its memory counts in the peak), then time ``steps``
    steps (synchronized after each). ``one_step`` returns the step's loss.

    Returns ``warmup_s`` (the warm-up and ``after_warmup``: compilation included), ``times`` (seconds
    a step), ``step_s`` (their median), ``held_bytes`` and ``peak_bytes`` (the CUDA allocator's;
    None on another device) and ``final_loss``."""
    import torch

    cuda = torch.device(device).type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    t_warm = time.perf_counter()
    for _ in range(warmup):
        one_step()
    sync()
    held = torch.cuda.memory_allocated() if cuda else None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    if after_warmup is not None:
        after_warmup()
        sync()
    warmup_s = time.perf_counter() - t_warm
    times, loss = [], None
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = one_step()
        sync()
        times.append(time.perf_counter() - t0)
    return {"warmup_s": warmup_s, "times": times, "step_s": statistics.median(times) if times else None,
            "held_bytes": held, "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "final_loss": None if loss is None else float(loss)}

"""One training run measured at several link rates, each next to the unlimited link.

A run's steps after ``WARMUP_STEPS`` untimed steps are cut into phases of ``phase_steps`` steps. The phases alternate
between the reference (the unlimited link) and the rates asked for::

    warm-up | ref | rate 1 | ref | rate 2 | ref | ... | rate n | ref

The harness changes the links' shaping when rank 0 logs the last step of a phase (``netns.Cluster.
set_rate``), so the first step of each phase may straddle the change and is not timed
(``SETTLE_STEPS``). A rate's point is the median of its phase's timed steps, paired with the
mean of the medians of the two reference phases around it (``paired_step_s``): the recipe's
compute measured a few seconds before and after, so drift in the host's speed (other work, clock
changes) cancels in ``step - paired_step``, the time the link adds. The reference phases pooled
make the recipe's unshaped point.

Host load: :class:`CpuMeter` counts the CPU time the host spent on anything but this run's
processes (in cores) over each phase; :func:`wait_until_idle` holds a sweep back while other work
runs.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

SETTLE_STEPS = 1  # untimed steps at the start of each phase (the shaping changes during the first)
WARMUP_STEPS = 2  # untimed steps before the first phase (allocations, gloo's first buffers)
REFERENCE = "unshaped"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def schedule(rates: list[str]) -> list[str]:
    """The phases' rates: the reference before, between and after the ``rates``."""
    out = [REFERENCE]
    for r in rates:
        out += [r, REFERENCE]
    return out


def run_steps(rates: list[str], phase_steps: int) -> int:
    """Steps of a run through ``schedule(rates)``."""
    return WARMUP_STEPS + len(schedule(rates)) * phase_steps


def phase_after(rows: int, phase_steps: int) -> int:
    """The phase that runs once rank 0 has logged ``rows`` rows (-1: still warming up)."""
    return (rows - WARMUP_STEPS) // phase_steps if rows >= WARMUP_STEPS else -1


def timed_rows(phase: int, phase_steps: int) -> range:
    """The metrics rows (0-based) whose steps are timed in ``phase`` (its settle steps left out)."""
    first = WARMUP_STEPS + phase * phase_steps
    return range(first + SETTLE_STEPS, first + phase_steps)


def split_points(base: dict, times: list[float], rates: list[str], phase_steps: int, phase_cpu: list[dict],
                 rate_bps) -> list[dict]:
    """One point per rate (paired with its neighbouring reference phases) and the pooled reference
    point, from a scheduled run's per-row step times ``times`` (the warm-up's rows included)."""
    phases = schedule(rates)
    per_phase = [[times[i] for i in timed_rows(j, phase_steps) if i < len(times)] for j in range(len(phases))]
    medians = [statistics.median(t) if t else None for t in per_phase]

    def point(rate, steps, phase_ids, **extra):
        cpu = [phase_cpu[j] for j in phase_ids if j < len(phase_cpu)]
        return {**base, "rate": rate, "rate_bps": rate_bps(rate), "step_time_s": statistics.median(steps),
                "step_times_s": steps, "phases": phase_ids,
                "other_cpu_cores": max((c["other_cores"] for c in cpu), default=None), **extra}

    ref_ids = [j for j, r in enumerate(phases) if r == REFERENCE]
    out = [point(REFERENCE, [t for j in ref_ids for t in per_phase[j]], ref_ids,
                 reference_phase_medians_s=[medians[j] for j in ref_ids])]
    for j, rate in enumerate(phases):
        if rate == REFERENCE:
            continue
        before, after = medians[j - 1], medians[j + 1]
        out.append(point(rate, per_phase[j], [j], paired_rate=REFERENCE, paired_rate_bps=None,
                         paired_step_s=(before + after) / 2, paired_drift=abs(after - before) / ((after + before) / 2)))
    return out


def _jiffies_of(pid: str) -> tuple[int, int] | None:
    """``(parent pid, utime + stime + cutime + cstime)`` of a process, None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return int(fields[1]), sum(int(x) for x in fields[11:15])


class CpuMeter:
    """The host's CPU time spent outside the process trees rooted at ``roots`` (cores, averaged
    between two calls of :meth:`sample`). The trees' exited processes' time is counted through
    their parents' ``cutime`` once reaped; a short window may misattribute a process that exits
    inside it."""

    def __init__(self, roots: list[int] | None = None):
        self.roots = set(roots or [])
        self.last = self._read()

    def _read(self) -> tuple[float, int, int]:
        cpu = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        busy = sum(int(x) for i, x in enumerate(cpu[:8]) if i not in (3, 4))  # all but idle, iowait
        procs = {}
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                info = _jiffies_of(pid)
                if info:
                    procs[int(pid)] = info
        ours, frontier = set(), [p for p in self.roots if p in procs]
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in procs.items():
            children.setdefault(ppid, []).append(pid)
        while frontier:
            pid = frontier.pop()
            if pid not in ours:
                ours.add(pid)
                frontier += children.get(pid, [])
        return time.monotonic(), busy, sum(procs[p][1] for p in ours)

    def sample(self) -> dict:
        """``{"seconds", "other_cores", "own_cores"}`` since the previous sample."""
        now = self._read()
        dt = max(now[0] - self.last[0], 1e-6)
        own = max(0, now[2] - self.last[2]) / CLOCK_TICKS / dt
        busy = (now[1] - self.last[1]) / CLOCK_TICKS / dt
        self.last = now
        return {"seconds": dt, "other_cores": max(0.0, busy - own), "own_cores": own}


def host_busy_cores(seconds: float = 2.0) -> float:
    """Cores the host keeps busy over ``seconds`` (this process idles meanwhile)."""
    meter = CpuMeter([os.getpid()])
    time.sleep(seconds)
    return meter.sample()["other_cores"]


def wait_until_idle(max_cores: float, wait_s: float, log=print) -> float:
    """Block until other work uses at most ``max_cores`` (sampled every few seconds), at most
    ``wait_s`` seconds; returns the last reading (the caller refuses if it is still above)."""
    t0 = time.monotonic()
    busy = host_busy_cores()
    while busy > max_cores and time.monotonic() - t0 < wait_s:
        log(f"cluster: the host is busy ({busy:.2f} cores of other work, limit {max_cores}); waiting", file=sys.stderr)
        time.sleep(10)
        busy = host_busy_cores()
    return busy

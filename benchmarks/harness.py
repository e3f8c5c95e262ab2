"""Shared pieces of the benchmark scripts: the import path to ``src/``, the environment record
and the result file names.

Every result is written as ``<date>_<hardware>[_<what>].json`` (and ``.md`` beside it), where
``hardware`` is the short GPU name (``H200``; ``H200x2`` for two) or ``cpu``. The GPU entry point
(``benchmarks/gpu.sh``) points each script's ``--out`` at ``$OUT/<topic>/``; committed results
live under ``benchmarks/results/<topic>/`` and ``benchmarks/report.py`` builds the docs' tables
from them.
"""

from __future__ import annotations

import datetime as dt
import json
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the platform's word for it: hosts differ, and so do
    their floating-point results (a CPU run's numbers are this host's)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware() -> str:
    """``H200`` (the GPU's name without its vendor), ``H200x2`` for several, or ``cpu``."""
    try:
        import torch
    except ImportError:
        return "cpu"
    if not torch.cuda.is_available():
        return "cpu"
    name = short_name(torch.cuda.get_device_name(0))
    n = torch.cuda.device_count()
    return name if n == 1 else f"{name}x{n}"


def short_name(device_name: str) -> str:
    """``NVIDIA H200`` -> ``H200``; a CPU's processor string -> ``cpu``."""
    if not device_name or "nvidia" not in device_name.lower() and "amd" not in device_name.lower():
        return "cpu"
    return device_name.replace("NVIDIA", "").replace("AMD", "").strip().replace(" ", "-")


def stem(what: str = "") -> str:
    """The result name of a run today on this machine: ``<date>_<hardware>[_<what>]``."""
    s = f"{dt.date.today().isoformat()}_{hardware()}"
    return f"{s}_{what}" if what else s


def env() -> dict:
    """Versions and hardware, recorded in every result file."""
    info = {"date": dt.datetime.now().isoformat(timespec="seconds"), "python": platform.python_version(),
            "hardware": hardware()}
    try:
        import torch
        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def command() -> str:
    """The command line that made this result, as a user would type it (an absolute path outside
    the repository, e.g. the GPU machine's output folder, written as ``DIR``: no machine paths)."""
    def portable(arg: str) -> str:
        if not arg.startswith("/"):
            return arg
        try:
            return Path(arg).resolve().relative_to(ROOT).as_posix()
        except ValueError:
            return "DIR"
    return "PYTHONPATH=src python3 " + " ".join(["benchmarks/" + Path(sys.argv[0]).name,
                                                  *map(portable, sys.argv[1:])])


def write(out: str | Path, what: str, data: dict, markdown: str | None = None) -> Path:
    """Write ``data`` (with ``env`` and ``command`` added when missing) as ``out/<stem>.json`` and
    ``markdown`` beside it; returns the JSON path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data = {"command": command(), "env": env(), **data} if isinstance(data, dict) else data
    path = out / f"{stem(what)}.json"
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    if markdown is not None:
        path.with_suffix(".md").write_text(markdown)
    return path

"""What CI costs: ``make test`` on a fresh clone (the install included) and ``make train``.

    python3 benchmarks/bench_ci.py --out benchmarks/results/ci/<date>_cpu_make-timings.json
    python3 benchmarks/bench_ci.py --log ci.log --seconds S --out FILE   (a .ci/run already timed)

The first form clones this repository into a temporary directory, runs ``.ci/run`` there (what CI
runs) and then ``make train`` in the same clone, timing both; the second reads the output of a
``.ci/run`` that was timed apart (``S``: its wall seconds). Either writes the pytest summary
(passed, skipped, deselected, pytest's seconds) and the wall seconds; the first also the seconds
and losses of ``make train``.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness import cpu_model  # noqa: E402

SUMMARY = re.compile(r"(\d+) passed(?:, (\d+) skipped)?(?:, (\d+) deselected)?.* in ([\d.]+)s")
DURATION = re.compile(r"^([\d.]+)s (call|setup|teardown) +(\S+)$", re.M)  # pytest --durations lines


def parse_pytest(text: str) -> dict:
    """The numbers of pytest's last summary line in ``text``."""
    found = SUMMARY.findall(text)
    if not found:
        raise SystemExit("no pytest summary line in the log")
    passed, skipped, deselected, seconds = found[-1]
    last = [line for line in text.splitlines() if SUMMARY.search(line)][-1]  # (make's own lines may follow it)
    failed = re.findall(r"(\d+) failed", last)
    return {"passed": int(passed), "skipped": int(skipped or 0), "deselected": int(deselected or 0),
            "failed": int(failed[0]) if failed else 0, "pytest_seconds": float(seconds),
            "failures": re.findall(r"^FAILED (\S+)", text, re.M),
            "slowest": [{"seconds": float(s), "phase": phase, "test": test} for s, phase, test in DURATION.findall(text)]}


def run_fresh() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        clone = Path(tmp) / "leantrain"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        t0 = time.time()
        ci = subprocess.run(["bash", ".ci/run"], cwd=clone, capture_output=True, text=True)
        test = {**parse_pytest(ci.stdout + ci.stderr), "total_seconds": round(time.time() - t0), "exit": ci.returncode}
        t0 = time.time()
        train = subprocess.run(["make", "train"], cwd=clone, capture_output=True, text=True)
        summary = json.loads((clone / "runs" / "default" / "summary.json").read_text()) if train.returncode == 0 else {}
        return {"make_test": test, "make_train": {
            "seconds": round(time.time() - t0, 1), "exit": train.returncode, "steps": summary.get("steps"),
            "final_loss": summary.get("final_loss"), "val_loss_before": summary.get("initial_val_loss"),
            "val_loss_after": summary.get("val_loss")}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--log", help="the output of a .ci/run timed apart")
    ap.add_argument("--seconds", type=float, help="with --log: its wall seconds")
    a = ap.parse_args(argv)
    result = {"what": "make test on a fresh clone (CI: .ci/run, the install included) and make train (FORGE + "
                      "AGoQ, tiny, 200 steps) on the 2-core CPU development machine",
              "hardware": f"2-core CPU development machine ({cpu_model()}), torch 2.13 CPU",
              "command": "python3 benchmarks/bench_ci.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    if a.log:
        result["what"] = ("make test on a fresh clone (CI: .ci/run, the install included) on the 2-core CPU "
                          "development machine")
        result["make_test"] = {**parse_pytest(Path(a.log).read_text()), "total_seconds": a.seconds}
    else:
        result.update(run_fresh())
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

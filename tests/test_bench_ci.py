"""benchmarks/bench_ci.py reads pytest's summary from a ``make test`` log."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_ci  # noqa: E402

LOG = """..F.. [100%]
FAILED tests/a/test_b.py::test_c - AssertionError
0.50s call     tests/a/test_b.py::test_c
1 failed, 4 passed, 2 skipped in 12.34s (0:00:12)
make: *** [Makefile:26: test] Error 1
"""


def test_the_failed_count_comes_from_the_summary_line_not_the_last_line():
    r = bench_ci.parse_pytest(LOG)
    assert (r["passed"], r["skipped"], r["failed"], r["pytest_seconds"]) == (4, 2, 1, 12.34)
    assert r["failures"] == ["tests/a/test_b.py::test_c"]
    assert r["slowest"] == [{"seconds": 0.5, "phase": "call", "test": "tests/a/test_b.py::test_c"}]

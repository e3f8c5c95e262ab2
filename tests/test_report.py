"""benchmarks/report.py generates the docs' measured tables from the committed result files:
the committed docs must match what it generates, and a changed result must change the table."""

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "report.py"


def _load(root: Path):
    spec = importlib.util.spec_from_file_location("report_under_test", root / "benchmarks" / "report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_committed_docs_are_up_to_date():
    r = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_every_row_names_an_existing_result_file():
    report = _load(ROOT)
    for rows in report.TABLES.values():
        for _, fn, _, rel in rows:
            for f in (rel, *getattr(fn, "more", ())):  # (a row over several files names the others)
                assert (report.RESULTS / f).is_file(), f


def test_a_changed_result_changes_the_table(tmp_path):
    shutil.copytree(ROOT / "benchmarks" / "results", tmp_path / "benchmarks" / "results")
    (tmp_path / "benchmarks" / "report.py").write_bytes(SCRIPT.read_bytes())
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    report = _load(tmp_path)
    assert report.main(["--check"]) == 0
    rel = "agoq/2026-12-01_H200.json"
    path = tmp_path / "benchmarks" / "results" / rel
    data = json.loads(path.read_text())
    before = report.table("readme", "README.md")
    data["rows"][0]["saved_ratio"] = 0.5
    path.write_text(json.dumps(data))
    after = report.table("readme", "README.md")
    assert before != after and "| 0.500× |" in after
    assert report.main(["--check"]) == 1  # the README is stale now
    assert report.main([]) == 0 and report.main(["--check"]) == 0  # and regenerating fixes it
    assert "| 0.500× |" in (tmp_path / "README.md").read_text()

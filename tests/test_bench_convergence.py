"""benchmarks/bench_convergence.py --scape-fidelity --dense-from: an earlier file's dense runs stand in
for this command's (older files have no per-step losses); a file of another preset is refused. The
training runs themselves are stubbed: this checks the bookkeeping, not SCAPE."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_convergence_under_test", BENCH / "bench_convergence.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _stub_run(args, name, val, nbytes) -> dict:
    """What a stubbed training run leaves: its metrics file (one evaluation at step 20) and its summary."""
    out = Path(args.out) / name
    out.mkdir(parents=True)
    (out / "metrics.jsonl").write_text(json.dumps({"step": 20, "val_loss": val}) + "\n")
    return {"val_loss": val, "final_loss": val - 0.1, "comm_bytes_per_step": nbytes}


def _earlier(tmp_path, preset="tiny"):
    dense = {"val_loss": 5.0, "final_loss": 4.9, "comm_bytes_per_step": 1000.0}  # (no val_loss_by_step)
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps({
        "command": f"python3 benchmarks/bench_convergence.py --scape-fidelity --preset {preset} --steps 20 --seeds 1",
        "recipes": {"sharded-adams": {"seeds": {"1": dense}}}}))
    return path


def test_dense_from_an_older_file(tmp_path, monkeypatch):
    bc = _load()
    ran = []

    def run(name, overrides, args, nproc=1):
        ran.append((name, overrides["comm.scape.density"]))
        return _stub_run(args, name, 5.5, 100.0)

    monkeypatch.setattr(bc, "run", run)
    out = tmp_path / "r.json"
    assert bc.main(["--scape-fidelity", "--preset", "tiny", "--steps", "20", "--seeds", "1", "--scape-recipes",
                    "sharded-adams,sharded-scape90", "--dense-from", str(_earlier(tmp_path)), "--out", str(out)]) == 0
    assert ran == [("sharded-scape90_seed1", 0.1)]  # (the dense run came from the file)
    r = json.loads(out.read_text())
    sparse = r["recipes"]["sharded-scape90"]
    assert sparse["mean_vs_dense"] == pytest.approx(1.1) and sparse["seeds"]["1"]["bytes_vs_dense"] == pytest.approx(0.1)
    assert sparse["seeds"]["1"]["val_loss_by_step"] == {"20": 5.5}
    assert r["recipes"]["sharded-adams"]["seeds"]["1"]["val_loss_by_step"] == {}
    assert "--dense-from" in r["command"]


def test_dense_from_another_preset_is_refused(tmp_path):
    bc = _load()
    with pytest.raises(SystemExit, match="not of --preset tiny"):
        bc.main(["--scape-fidelity", "--preset", "tiny", "--steps", "20", "--seeds", "1", "--dense-from",
                 str(_earlier(tmp_path, preset="small")), "--out", str(tmp_path / "r.json")])


def test_variants_run_in_parallel_jobs_and_are_compared_seed_by_seed(tmp_path, monkeypatch):
    """``<recipe>@<key>=<value>;...`` runs a recipe with overrides; ``--jobs`` runs several at once; the
    file is complete at the end whatever order the runs finished in."""
    bc = _load()
    ran, dirs = [], set()

    def run(name, overrides, args, nproc=1):
        ran.append((name, overrides.get("comm.scape.catch_up"), overrides.get("comm.method")))
        dirs.add(args.out)
        val = 5.0 + overrides["train.seed"] / 10 + (0.5 if overrides.get("comm.scape.catch_up") == "30" else 0.0)
        return _stub_run(args, name, val, 100.0)

    monkeypatch.setattr(bc, "run", run)
    out = tmp_path / "r.json"
    assert bc.main(["--scape-fidelity", "--preset", "tiny", "--steps", "20", "--seeds", "1,2", "--jobs", "3",
                    "--scape-recipes", "sharded-adams,sharded-scape90@comm.scape.catch_up=30",
                    "--set", "data.seq_len=64", "--out", str(out)]) == 0
    assert len(dirs) == 1 and not Path(dirs.pop()).exists()  # (the runs' directories are gone)
    assert sorted(ran) == [("sharded-adams_seed1", None, None), ("sharded-adams_seed2", None, None),
                           ("sharded-scape90-comm.scape.catch_up-30_seed1", "30", "scape"),
                           ("sharded-scape90-comm.scape.catch_up-30_seed2", "30", "scape")]
    r = json.loads(out.read_text())
    v = r["recipes"]["sharded-scape90@comm.scape.catch_up=30"]
    assert v["config"]["comm.scape.catch_up"] == "30" and list(v["seeds"]) == ["1", "2"]
    assert v["seeds"]["2"]["val_vs_dense"] == pytest.approx(5.7 / 5.2) and "partial" not in r["what"]
    assert r["what"].endswith(", data.seq_len=64") and "--set data.seq_len=64" in r["command"]
    with pytest.raises(SystemExit, match="no recipe"):
        bc.main(["--scape-fidelity", "--scape-recipes", "sharded-adams,nope@x=1", "--out", str(out)])


def test_one_process_runs_the_whole_batch_and_refuses_a_two_rank_yardstick(tmp_path, monkeypatch):
    """``--ranks 1``: each run is one process with the preset's whole batch, sends nothing (no byte
    ratio), says so in the file, and an earlier file of 2 ranks cannot stand in for its dense runs."""
    bc = _load()
    ran = []

    def run(name, overrides, args, nproc=1):
        ran.append((name, nproc, int(overrides["data.batch_size"])))
        return _stub_run(args, name, 5.0, 0.0)

    monkeypatch.setattr(bc, "run", run)
    out = tmp_path / "r.json"
    assert bc.main(["--scape-fidelity", "--ranks", "1", "--preset", "tiny", "--steps", "20", "--seeds", "1",
                    "--scape-recipes", "sharded-adams,sharded-scape99", "--out", str(out)]) == 0
    batch = bc._per_rank_batch(type("A", (), {"preset": "tiny", "set": [], "nproc": 1})(), "x")
    assert sorted(ran) == [("sharded-adams_seed1", 1, batch), ("sharded-scape99_seed1", 1, batch)]
    r = json.loads(out.read_text())
    assert "1 process on the" in r["what"] and "--ranks 1" in r["command"]
    assert r["recipes"]["sharded-scape99"]["seeds"]["1"]["bytes_vs_dense"] is None
    with pytest.raises(SystemExit, match="--ranks 1"):
        bc.main(["--scape-fidelity", "--ranks", "1", "--preset", "tiny", "--steps", "20", "--seeds", "1",
                 "--dense-from", str(_earlier(tmp_path)), "--out", str(tmp_path / "r2.json")])

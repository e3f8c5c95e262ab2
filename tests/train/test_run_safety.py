"""Runs a user can trust: each case is run as a user runs it (the CLI, a subprocess where signals
or redirected output matter), and the test asserts the exit code, the one sentence, and that
nothing in the run directory changed where nothing should. No case may print a traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import TINY_OVERRIDES, tiny_config
from leantrain.cli import main as cli_main
from leantrain.runtime import checkpoint
from leantrain.train.trainer import NonFiniteLoss, Trainer

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _flags(corpus, **extra) -> list[str]:
    out = []
    for k, v in {**TINY_OVERRIDES, "data.path": str(corpus), **extra}.items():
        out += [f"--{k}", str(v)]
    return out


def _snapshot(run: Path) -> dict:
    return {p.relative_to(run).as_posix(): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def _cli(args, capsys) -> tuple[int, str]:
    rc = cli_main(args)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, corpus):
    """A finished 5-step run with a checkpoint at step 5."""
    out = tmp_path_factory.mktemp("runs") / "a"
    assert cli_main(["train", "--out", str(out), "--steps", "5", *_flags(corpus)]) == 0
    return out


def test_train_into_a_previous_run_is_refused_and_changes_nothing(run_dir, corpus, capsys):
    before = _snapshot(run_dir)
    rc, err = _cli(["train", "--out", str(run_dir), "--steps", "5", *_flags(corpus)], capsys)
    assert rc == 2 and "holds a previous run" in err and "--resume" in err and "--overwrite" in err
    assert _snapshot(run_dir) == before


@pytest.mark.parametrize("extra,named", [
    (["--model.dim", "64"], "model.dim 48 (this run: 64; pass --model.dim 48)"),
    (["--forge"], "forge.enabled false"),
    (["--preset", "small"], "pass --preset tiny"),
])
def test_resume_with_another_config_is_refused_before_writing(run_dir, corpus, capsys, extra, named):
    before = _snapshot(run_dir)
    args = ["train", "--out", str(run_dir), "--steps", "8", "--resume", *_flags(corpus)]
    if extra[0] == "--preset":  # (the preset's own values, then the test's overrides)
        args = ["train", "--preset", "small", "--out", str(run_dir), "--steps", "8", "--resume", *_flags(corpus)]
    else:
        args += extra
    rc, err = _cli(args, capsys)
    assert rc == 2 and named in err and "Nothing in the run directory was changed" in err
    assert _snapshot(run_dir) == before  # config.json and tokenizer.json included


def test_overwrite_replaces_the_previous_run(tmp_path, corpus, capsys):
    out = tmp_path / "o"
    assert cli_main(["train", "--out", str(out), "--steps", "5", *_flags(corpus)]) == 0
    rc, _ = _cli(["train", "--out", str(out), "--steps", "3", "--overwrite", *_flags(corpus)], capsys)
    assert rc == 0
    rows = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows == [1, 2, 3] and checkpoint.latest(out).name == "step_0000003"


def test_resume_cuts_metrics_to_the_checkpoint_and_rows_carry_their_own_lr(tmp_path, corpus):
    out = tmp_path / "r"
    over = {"train.steps": "10", "train.ckpt_every": "5", "train.eval_every": "0"}
    Trainer(tiny_config(corpus, **over), out).fit(until=7)  # (checkpoints at 5 and 7)
    with open(out / "metrics.jsonl", "a") as f:  # a step logged after the checkpoint, then lost
        f.write(json.dumps({"step": 8, "loss": 0.0, "lr": 0.0}) + "\n")
    tr = Trainer(tiny_config(corpus, **over), out, resume=True)
    assert tr.step == 7
    tr.fit()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 11)) and rows[7]["loss"] > 0  # no step twice
    # the lr of step s is the one its update used: warmup_steps 2, so steps 1 and 2 ramp
    lr = tr.cfg.optim.lr
    assert rows[0]["lr"] == pytest.approx(lr / 2) and rows[1]["lr"] == pytest.approx(lr)


def test_nonfinite_loss_before_any_checkpoint_says_so(corpus, tmp_path, monkeypatch):
    cfg = tiny_config(corpus, **{"train.steps": "6", "train.ckpt_every": "5", "train.eval_every": "0"})
    tr = Trainer(cfg, tmp_path / "n")
    real = tr.model.forward
    monkeypatch.setattr(tr.model, "forward", lambda *a, **k: real(*a, **k) * float("nan"))
    with pytest.raises(NonFiniteLoss, match="No checkpoint was written before it"):
        tr.fit()


@pytest.mark.parametrize("args,sentence", [
    (["--optim.lr", "inf"], "optim.lr must be a finite number > 0"),
    (["--model.dim", "100"], "must divide into model.n_heads"),
    (["--steps", "0"], "train.steps must be at least 1"),
    (["--train.stesp", "3"], "did you mean train.steps?"),
    (["--dist.comm", "int8"], "--dist.comm is now --comm.method"),
])
def test_bad_input_is_one_sentence(tmp_path, corpus, capsys, args, sentence):
    rc, err = _cli(["train", "--out", str(tmp_path / "b"), *_flags(corpus), *args], capsys)
    assert rc == 2 and sentence in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "b" / "metrics.jsonl").exists()


def test_out_is_a_file(tmp_path, corpus, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    rc, err = _cli(["train", "--out", str(f), *_flags(corpus)], capsys)
    assert rc == 2 and "is a file, not a directory" in err and f.read_text() == "x"


def test_help_teaches_recipes_and_tasks(capsys):
    with pytest.raises(SystemExit):
        cli_main(["train", "--help"])
    out = capsys.readouterr().out
    assert all(x in out for x in ("--forge", "--agoq", "--baseline", "--comm.method", "leantrain config"))
    with pytest.raises(SystemExit):
        cli_main(["finetune", "--help"])
    out = capsys.readouterr().out
    assert all(x in out for x in ("compare", "lookup", "parity", "--finetune.num-chunks"))
    assert cli_main(["config", "--comm.method", "scape"]) == 0
    out = capsys.readouterr().out
    assert "[comm.scape]" in out and "density = 0.1" in out and "fraction of each shard" in out


def test_no_plot_says_why(tmp_path, corpus, monkeypatch, capsys):
    import builtins

    from leantrain.train import progress

    real_import = builtins.__import__

    def no_matplotlib(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    monkeypatch.setattr(progress, "_SAID", set())
    Trainer(tiny_config(corpus, **{"train.steps": "2", "train.eval_every": "0"}), tmp_path / "p").fit()
    assert "no loss plot: matplotlib is not installed" in capsys.readouterr().out
    assert not (tmp_path / "p" / "loss.png").exists()


def _start(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "leantrain", *args], stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, env=env)


def _wait_rows(metrics: Path, n: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
            return
        time.sleep(0.2)
    raise AssertionError(f"no {n} metrics rows in {timeout} s")


# the signal tests' run: long enough that the signal, sent once 3 rows are written, lands before the
# last step even when the test process is starved of CPU for seconds (a shorter run can end first:
# nothing to stop)
SIGNALLED_STEPS = 120


def _signalled_flags(corpus) -> list[str]:
    return _flags(corpus, **{"train.ckpt_every": "1000", "train.eval_every": "0", "train.log_every": "1",
                             "train.progress": "true"})


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, corpus) -> dict:
    """The final weights of the signal tests' run when nothing stops it (one run for every signal)."""
    from safetensors.torch import load_file

    ref = tmp_path_factory.mktemp("uninterrupted") / "ref"
    p = _start(["train", "--out", str(ref), "--steps", str(SIGNALLED_STEPS), *_signalled_flags(corpus)],
               ref.parent / "ref.log")
    assert p.wait(timeout=600) == 0
    return load_file(str(checkpoint.latest(ref) / "model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_finishes_the_step_writes_everything_and_resume_continues(tmp_path, corpus, uninterrupted, sig):
    """Redirected output gets progress lines; SIGINT / SIGTERM: exit 130 with one line, a
    checkpoint at the step reached, summary and metrics; --resume then ends where an
    uninterrupted run ends, bit for bit."""
    from safetensors.torch import load_file

    flags, steps = _signalled_flags(corpus), SIGNALLED_STEPS
    out, log = tmp_path / "s", tmp_path / "s.log"
    p = _start(["train", "--out", str(out), "--steps", str(steps), *flags], log)
    _wait_rows(out / "metrics.jsonl", 3, p)
    p.send_signal(sig)
    assert p.wait(timeout=240) == 130
    text = log.read_text()
    assert "Traceback" not in text and "continue with the same command and --resume" in text
    assert f"step 1/{steps} loss" in text and "eta" in text  # (progress lines: stdout is a file)
    step = int(checkpoint.latest(out).name.split("_")[1])
    assert 3 <= step < steps and (out / "summary.json").exists()
    p = _start(["train", "--out", str(out), "--steps", str(steps), "--resume", *flags], log)
    assert p.wait(timeout=600) == 0
    a = load_file(str(checkpoint.latest(out) / "model.safetensors"))
    assert sorted(a) == sorted(uninterrupted)
    assert all(torch.equal(a[k], uninterrupted[k]) for k in a)
    rows = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows == list(range(1, steps + 1))


def test_chunkft_resume_names_the_chunk_count(tmp_path, corpus, capsys):
    base = ["finetune", "--method", "chunkft", "--task", "compare", "--data.batch-size", "4",
            "--finetune.eval-examples", "8", "--out", str(tmp_path / "f"), "--model.n-layers", "1",
            "--model.dim", "32", "--model.n-heads", "2", "--model.n-kv-heads", "1", "--model.ffn-dim", "64",
            "--data.path", str(corpus), "--data.tokenizer-vocab", "400"]
    assert cli_main([*base, "--steps", "2", "--finetune.num-chunks", "3"]) == 0
    rc, err = _cli([*base, "--steps", "4", "--resume"], capsys)
    assert rc == 2 and "pass --finetune.num-chunks 3" in err


def test_a_damaged_newest_checkpoint_is_named_and_the_older_one_resumes(tmp_path, corpus, capsys):
    out = tmp_path / "d"
    over = {"train.steps": "10", "train.ckpt_every": "5", "train.eval_every": "0", "train.keep_checkpoints": "3"}
    Trainer(tiny_config(corpus, **over), out).fit(until=10)
    newest = checkpoint.latest(out)
    f = newest / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # truncated
    rc = cli_main(["train", "--out", str(out), "--steps", "12", "--resume",
                   *_flags(corpus, **{k: v for k, v in over.items() if k != "train.steps"})])
    cap = capsys.readouterr()
    text = cap.err + cap.out
    assert "Traceback" not in text
    assert rc == 0, text
    assert f"skipping checkpoint {newest}" in text and "truncated" in text
    assert "resumed from" in text and "step_0000005" in text


@pytest.mark.parametrize("recipe", [{"agoq.enabled": "true"}, {"agoq.enabled": "true", "forge.enabled": "true"}],
                         ids=["agoq", "forge+agoq"])
def test_agoq_resume_is_bit_identical(tmp_path, corpus, recipe):
    """AGoQ's stochastic rounding continues where the checkpoint left it (its noise counter is in the
    checkpoint, its salt the rank's), whatever ran in the process before."""
    from safetensors.torch import load_file

    base = {"train.eval_every": "0", "train.ckpt_every": "2", **recipe}
    Trainer(tiny_config(corpus, **base, **{"train.steps": "4"}), tmp_path / "a").fit()
    Trainer(tiny_config(corpus, **base, **{"train.steps": "2"}), tmp_path / "b").fit()
    Trainer(tiny_config(corpus, **base, **{"train.steps": "4"}), tmp_path / "b", resume=True).fit()
    wa, wb = (load_file(str(tmp_path / d / "checkpoints" / "step_0000004" / "model.safetensors")) for d in "ab")
    assert {k: float((wa[k] - wb[k]).abs().max()) for k in wa if not torch.equal(wa[k], wb[k])} == {}

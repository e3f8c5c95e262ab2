"""Kill tests: one of 2 gloo ranks under ``torchrun`` gets SIGINT, SIGTERM or SIGKILL at a random
step, or SIGKILL while a checkpoint is being written; ``--resume`` then continues from the newest
intact checkpoint and ends with the weights of an uninterrupted run, bit for bit, each step logged
once. And no bad input of the run-safety table prints a Python traceback.

What each signal does to a 2-rank job (what the tests assert):

- SIGINT or SIGTERM to one rank: that rank finishes its step; the all-reduce after each step
  (``StopSignals.requested``) tells the other rank, so both stop after the same step, both write
  its checkpoint, rank 0 the summary and the plot (the other rank waits for it: the test slows
  rank 0's plot down), and each exits with 130 and the one line saying how to resume. torchrun
  then reports the job failed (exit 1, with its own ChildFailedError traceback: torchrun's, not a
  rank's).
- SIGINT to torchrun (Ctrl-C in its terminal; the ranks run in sessions of their own, so only
  torchrun gets it): torchrun sends SIGINT to each rank, which stop as above; torchrun ends with
  its SignalException (exit 1).
- SIGKILL to one rank: the other rank's next collective fails (the peer closed its connection),
  torchrun ends the job (exit 1); the steps since the last checkpoint are lost, and a checkpoint
  being written is left as a temporary directory that resume never reads.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dist_utils import free_port, once_more_on_gloo_abort
from helpers import TINY_OVERRIDES, tiny_config
from leantrain import data as data_mod
from leantrain.cli import main as cli_main
from leantrain.runtime import checkpoint

SRC = str(Path(__file__).resolve().parents[2] / "src")
STEPS, CKPT_EVERY = 30, 5
LAUNCHER = -1  # the signal goes to torchrun itself, as Ctrl-C in its terminal does
JOB_TIMEOUT = 300  # seconds for one torchrun job on 2 busy cores (each takes ~10 s on a quiet machine)

# a checkpoint write that does not end: a script torchrun runs in place of ``-m leantrain``; in the
# checkpoint of step SLOW_STEP the VICTIM rank stops after its first file, until the test kills it
SLOW_WRITE = """
import os, sys, time
from pathlib import Path
from leantrain.cli import main
from leantrain.runtime import checkpoint

SLOW_STEP, VICTIM = int(sys.argv.pop(1)), int(sys.argv.pop(1))
write = checkpoint._save_tensors

def slow_write(tensors, path):
    write(tensors, path)
    if Path(path).parent.name == f".tmp_step_{SLOW_STEP:07d}" and int(os.environ["RANK"]) == VICTIM:
        time.sleep(600)

checkpoint._save_tensors = slow_write
sys.exit(main())
"""

# a slow loss plot on rank 0: a script torchrun runs in place of ``-m leantrain``. Rank 0 writes the
# summary and the plot after the other rank has nothing left to do; the other rank must wait for it,
# or torchrun, which ends the job as soon as one rank exits with an error, cuts rank 0 short
SLOW_PLOT = """
import os, sys, time
from leantrain.cli import main
from leantrain.train import trainer

plot = trainer.plot_losses

def slow_plot(*args, **kwargs):
    time.sleep(3)
    return plot(*args, **kwargs)

if int(os.environ["RANK"]) == 0:
    trainer.plot_losses = slow_plot
sys.exit(main())
"""


def _train_args(out: Path, corpus: Path, *extra: str) -> list[str]:
    args = ["train", "--out", str(out), "--steps", str(STEPS), "--data.path", str(corpus)]
    over = {**TINY_OVERRIDES, "data.batch_size": "2", "train.eval_every": "0", "train.ckpt_every": str(CKPT_EVERY)}
    for k, v in over.items():
        args += [f"--{k}", v]
    return [*args, *extra]


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
            str(free_port()), *args]


@pytest.fixture(scope="module")
def env(tmp_path_factory, corpus) -> dict:
    """The subprocesses' environment, with the corpus tokenized once beforehand (ranks that find no
    token cache both write it: the cache is not safe against two writers)."""
    cache = tmp_path_factory.getbasetemp() / "cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LEANTRAIN_CACHE", str(cache))
        data_mod.load(tiny_config(corpus).data, log=lambda *a: None)
    return {**os.environ, "LEANTRAIN_CACHE": str(cache), "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus, env) -> dict:
    """The final weights of an uninterrupted 2-rank run."""
    out = tmp_path_factory.mktemp("kill") / "reference"

    def job():
        shutil.rmtree(out, ignore_errors=True)
        return subprocess.run(_torchrun("-m", "leantrain", *_train_args(out, corpus)), env=env, capture_output=True,
                              text=True, timeout=JOB_TIMEOUT)

    r = once_more_on_gloo_abort(job)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert checkpoint.latest(out).name == f"step_{STEPS:07d}"
    return load_file(str(checkpoint.latest(out) / "model.safetensors"))


class Job:
    """A torchrun job in the background, its output in a log file."""

    def __init__(self, cmd: list[str], env: dict, log: Path):
        self.log = log
        with open(log, "w") as f:
            self.proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)

    def wait_for(self, ready, what: str, timeout: float = JOB_TIMEOUT) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if ready():
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"the job ended (exit {self.proc.returncode}) before {what}:\n{self.text()[-3000:]}")
            time.sleep(0.05)
        raise AssertionError(f"no {what} in {timeout} s:\n{self.text()[-3000:]}")

    def workers(self) -> dict[int, int]:
        """rank -> pid of torchrun's worker processes (from each one's RANK)."""
        try:
            pids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        except FileNotFoundError:  # (torchrun has ended)
            return {}
        ranks = {}
        for pid in map(int, pids):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except FileNotFoundError:  # (the worker has ended)
                continue
            ranks[next(int(v[5:]) for v in environ if v.startswith(b"RANK="))] = pid
        return ranks

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=JOB_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.end()
            raise AssertionError(f"the job did not end after one rank was signalled:\n{self.text()[-3000:]}") from None

    def end(self) -> None:
        """Kill what is left of the job (torchrun starts each worker in a session of its own)."""
        if self.proc.poll() is None:
            for pid in self.workers().values():
                os.kill(pid, signal.SIGKILL)
            self.proc.kill()
            self.proc.wait()

    def text(self) -> str:
        return self.log.read_text()


@pytest.fixture
def jobs():
    started: list[Job] = []
    yield started
    for job in started:
        job.end()


def _rows(out: Path) -> int:
    m = out / "metrics.jsonl"
    return len(m.read_text().splitlines()) if m.exists() else 0


def _step_of(ckpt: Path | None) -> int:
    return int(ckpt.name.split("_")[1]) if ckpt is not None else 0


def _resume_and_compare(out: Path, corpus: Path, env: dict, reference: dict, from_step: int) -> None:
    """``--resume`` to STEPS on 2 ranks: resumed from ``from_step``; the weights are the reference's
    bit for bit; metrics.jsonl holds steps 1..STEPS once each; no traceback."""
    r = subprocess.run(_torchrun("-m", "leantrain", *_train_args(out, corpus, "--resume")), env=env,
                       capture_output=True, text=True, timeout=JOB_TIMEOUT)
    text = r.stdout + r.stderr
    assert r.returncode == 0, text[-3000:]
    assert "Traceback" not in text
    assert f"resumed from {out / 'checkpoints' / f'step_{from_step:07d}'} at step {from_step}" in text, text[-3000:]
    final = load_file(str(checkpoint.latest(out) / "model.safetensors"))
    assert sorted(final) == sorted(reference)
    for k in reference:
        assert torch.equal(final[k], reference[k]), k
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))
    assert not list((out / "checkpoints").glob(".tmp_*"))  # (a partial write is cleared by the next save)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("sig,victim", [(signal.SIGINT, 1), (signal.SIGTERM, 0), (signal.SIGKILL, 1),
                                        (signal.SIGINT, LAUNCHER)],
                         ids=["SIGINT-rank1", "SIGTERM-rank0", "SIGKILL-rank1", "SIGINT-torchrun"])
def test_a_signal_to_one_rank_then_resume_is_bit_identical(tmp_path, corpus, env, reference, jobs, sig, victim):
    rows = random.Random(int(sig)).randint(3, STEPS - 8)  # (the rows logged when the signal is sent)
    out = tmp_path / "run"
    script = tmp_path / "slow_plot.py"
    script.write_text(SLOW_PLOT)
    job = Job(_torchrun(str(script), *_train_args(out, corpus)), env, tmp_path / "job.log")
    jobs.append(job)
    job.wait_for(lambda: _rows(out) >= rows, f"{rows} metrics rows")
    workers = job.workers()
    assert sorted(workers) == [0, 1], workers
    if victim == LAUNCHER:
        # the ranks are held (SIGSTOP) until torchrun has passed the signal on to both: on a busy
        # host torchrun may otherwise forward it only after the ranks have run their last step
        for pid in workers.values():
            os.kill(pid, signal.SIGSTOP)
        os.kill(job.proc.pid, sig)
        job.wait_for(lambda: job.text().count(f"closing signal {sig.name}") >= 2, "the signal passed on to both ranks")
        for pid in workers.values():
            os.kill(pid, signal.SIGCONT)
    else:
        os.kill(workers[victim], sig)
    rc = job.wait()
    text = job.text()
    assert rc != 0, text[-3000:]  # (torchrun: a worker that ends with an error or by a signal fails the job)
    newest, warnings = checkpoint.latest_intact(out)
    reached = _step_of(newest)
    if sig == signal.SIGKILL:
        assert "exitcode: -9" in text, text[-3000:]
        assert reached <= _rows(out) and reached % CKPT_EVERY == 0
    else:
        # both ranks stop at the same step, write its checkpoint, and exit 130 with the one line
        said = f"leantrain: stopped by {sig.name} after step {reached}: checkpoint, summary and plot written to {out}"
        assert text.count(said) == 1, text[-3000:]  # (every rank stops; rank 0 says so)
        assert "[rank0]: Traceback" not in text and "[rank1]: Traceback" not in text
        if victim == LAUNCHER:  # (torchrun passes the signal on to each rank, then ends with its own error)
            assert "Sending process" in text and "closing signal SIGINT" in text, text[-3000:]
        else:  # (torchrun sees a rank's exit code, and ends the job)
            assert "exitcode: 130" in text, text[-3000:]
        assert rows <= reached < STEPS and warnings == []
        assert _rows(out) == reached
        summary = json.loads((out / "summary.json").read_text())
        assert summary["steps"] == reached and summary["world_size"] == 2
        assert (out / "loss.png").exists() or "no loss plot" in text
    _resume_and_compare(out, corpus, env, reference, from_step=reached)


@pytest.mark.distributed
@pytest.mark.slow
def test_sigkill_during_a_checkpoint_write_resumes_from_the_older_checkpoint(tmp_path, corpus, env, reference, jobs):
    slow_step = random.Random(0).choice(range(2 * CKPT_EVERY, STEPS, CKPT_EVERY))
    victim = 0  # (the rank that writes the model and the manifest)
    script = tmp_path / "slow_write.py"
    script.write_text(SLOW_WRITE)
    out = tmp_path / "run"
    job = Job(_torchrun(str(script), str(slow_step), str(victim), *_train_args(out, corpus)), env,
              tmp_path / "job.log")
    jobs.append(job)
    tmp = out / "checkpoints" / f".tmp_step_{slow_step:07d}"
    job.wait_for(lambda: (tmp / f"state.rank{victim}.safetensors").exists(), f"checkpoint write at step {slow_step}")
    workers = job.workers()
    assert sorted(workers) == [0, 1], workers
    os.kill(workers[victim], signal.SIGKILL)
    assert job.wait() != 0
    older = slow_step - CKPT_EVERY
    assert tmp.is_dir() and not (out / "checkpoints" / f"step_{slow_step:07d}").exists()
    newest, warnings = checkpoint.latest_intact(out)
    assert _step_of(newest) == older and warnings == []
    _resume_and_compare(out, corpus, env, reference, from_step=older)


def _run_dir_with_a_checkpoint(tmp_path: Path, corpus: Path) -> Path:
    out = tmp_path / "previous"
    flags = [x for k, v in {**TINY_OVERRIDES, "data.path": str(corpus)}.items() for x in (f"--{k}", v)]
    assert cli_main(["train", "--out", str(out), "--steps", "1", *flags]) == 0
    return out


@pytest.mark.slow
def test_no_bad_input_prints_a_traceback(tmp_path, corpus, env):
    """Each bad input of the run-safety table, given to ``python -m leantrain train`` as a user gives
    it: a non-zero exit, one line on stderr ("leantrain: error: ..."), no traceback anywhere."""
    previous = _run_dir_with_a_checkpoint(tmp_path, corpus)
    binary = tmp_path / "weights.dat"
    binary.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    token_ids = tmp_path / "tokens.bin"
    token_ids.write_bytes(np.random.default_rng(1).integers(0, 400, 4096, dtype=np.uint16).tobytes())
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cases = {  # case -> its flags (--out a new directory and --data the corpus unless given)
        "a previous run without --resume": ["--out", str(previous)],
        "--resume with another --model.dim": ["--out", str(previous), "--resume", "--model.dim", "64"],
        "a binary --data file": ["--data", str(binary)],
        "a .bin without its vocabulary": ["--data", str(token_ids)],
        "a --data path that does not exist": ["--data", str(tmp_path / "nowhere")],
        "--optim.lr inf": ["--optim.lr", "inf"],
        "--model.dim 100": ["--model.dim", "100"],
        "--out an existing file": ["--out", str(a_file)],
        "--steps 0": ["--steps", "0"],
        "an unknown flag": ["--train.stesp", "3"],
    }
    flags = [x for k, v in TINY_OVERRIDES.items() for x in (f"--{k}", v)]
    runs = {}
    for n, (case, args) in enumerate(cases.items()):  # (all at once: each spends seconds importing torch)
        out = tmp_path / f"new{n}"
        defaults = [*(["--out", str(out)] if "--out" not in args else []),
                    *(["--data", str(corpus)] if "--data" not in args else [])]
        cmd = [sys.executable, "-m", "leantrain", "train", "--steps", "2", *flags, *defaults, *args]
        runs[case] = out, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    failures = []
    for case, (out, proc) in runs.items():
        stdout, stderr = proc.communicate(timeout=JOB_TIMEOUT)
        err = stderr.strip().splitlines()
        if (proc.returncode == 0 or "Traceback" in stdout + stderr or len(err) != 1
                or not err[0].startswith("leantrain: error:") or (out / "metrics.jsonl").exists()):
            failures.append(f"{case}: exit {proc.returncode}\n{stdout[-1500:]}{stderr[-1500:]}")
    assert not failures, "\n\n".join(failures)


def test_a_signal_handled_as_the_all_reduce_returns_is_kept_for_the_next_check(monkeypatch):
    """Python runs a signal handler after the blocking call it arrived in: when that call is the
    ranks' all-reduce of the stop flag, this round's result (0: nobody had a signal) must not erase
    it, and the next round tells every rank."""
    from leantrain.train.rows import StopSignals

    stop = StopSignals()
    rounds = []

    def all_reduce(t, op=None):  # the peer sends 0; on the first round our handler runs as it returns
        if not rounds:
            stop._handle(signal.SIGINT, None)
        rounds.append(float(t.item()))

    monkeypatch.setattr("leantrain.train.rows.dist.all_reduce", all_reduce)
    try:
        assert not stop.requested(2, "cpu")  # (the round's result: every rank goes on, together)
        assert stop.requested(2, "cpu") and stop.signum == signal.SIGINT
        assert rounds == [0.0, float(signal.SIGINT)]
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)

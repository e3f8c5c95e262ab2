"""`torchrun` on CPU (gloo): same loss curve as one process with the same global batch; a killed worker ends the job."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dist_utils import free_port
from helpers import TINY_OVERRIDES

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
SRC = str(Path(__file__).resolve().parents[1] / "src")


def _args(out, corpus, batch, steps=8):
    a = ["-m", "leantrain", "train", "--preset", "tiny", "--steps", str(steps), "--out", str(out), "--data", str(corpus)]
    for k, v in {**TINY_OVERRIDES, "data.batch_size": str(batch), "train.eval_every": "4"}.items():
        a += [f"--{k}", v]
    return a


def _env():
    return {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}


def _torchrun(n):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-port", str(free_port())]


def _losses(out):
    return [json.loads(x)["loss"] for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]


# The plain runs several tests compare against, made once: 8 steps, a checkpoint every 4, lr 1e-2
PLAIN = ["--train.ckpt-every", "4", "--optim.lr", "1e-2"]


@pytest.fixture(scope="module")
def one_process(corpus, tmp_path_factory):
    """One process, a batch of 4: the reference of the 2-rank runs and of the activations' bytes."""
    out = tmp_path_factory.mktemp("one") / "run"
    r = subprocess.run([sys.executable, *_args(out, corpus, 4), *PLAIN], env=_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def ddp(corpus, tmp_path_factory):
    """DDP's exact all-reduce on 2 gloo ranks of a batch of 2 (the same global batch)."""
    out = tmp_path_factory.mktemp("ddp") / "run"
    r = subprocess.run([*_torchrun(2), *_args(out, corpus, 2), *PLAIN], env=_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return out


def test_two_gloo_ranks_match_one_process(one_process, ddp):
    a, b = _losses(one_process), _losses(ddp)
    assert len(a) == len(b) == 8
    for x, y in zip(a, b):
        assert abs(x - y) <= 1e-4 * abs(x), (a, b)
    s = json.loads((ddp / "summary.json").read_text())
    assert s["world_size"] == 2 and s["comm_bytes_per_step"] > 0


def _children(pid):
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def test_killed_worker_ends_the_job_with_an_error(corpus, tmp_path):
    proc = subprocess.Popen([*_torchrun(2), *_args(tmp_path / "k", corpus, 2, steps=100000)], env={**_env(), "LEANTRAIN_PROGRESS": "0"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "k" / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.5)
    workers = _children(proc.pid)
    assert len(workers) == 2, "torchrun did not start two workers"
    os.kill(workers[1], signal.SIGKILL)
    try:
        rc = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the job hung after a worker was killed")
    assert rc != 0


def test_sharded_optimizer_in_the_trainer_matches_ddp_sdp4bit_and_scape_split_traffic(corpus, ddp, tmp_path):
    sh = tmp_path / "sharded"
    r = subprocess.run([*_torchrun(2), *_args(sh, corpus, 2), *PLAIN, "--dist.mode", "sharded"], env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert len(_losses(sh)) == len(_losses(ddp)) == 8
    for x, y in zip(_losses(ddp), _losses(sh)):
        assert abs(x - y) <= 1e-4 * abs(x)
    q = tmp_path / "sdp4bit"
    r = subprocess.run([*_torchrun(4), *_args(q, corpus, 1, steps=6), "--dist.mode", "sharded", "--comm.method", "sdp4bit",
                        "--dist.intra-node-size", "2"], env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    s = json.loads((q / "summary.json").read_text())
    assert s["comm"]["by_scope"]["inter"] > 0 and s["comm"]["by_scope"]["intra"] > 0
    assert all(x == x for x in _losses(q))  # finite
    sc = tmp_path / "scape"  # SCAPE at 90 % sparsity, AdamS, no warm-up: after its dense first step, ~0.09x the traffic
    r = subprocess.run([*_torchrun(2), *_args(sc, corpus, 2, steps=6), "--dist.mode", "sharded", "--comm.method", "scape",
                        "--comm.scape.warmup", "0", "--optim.name", "adams"],
                       env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    dense = json.loads((sh / "summary.json").read_text())["comm_bytes_per_step"]
    sparse = json.loads((sc / "summary.json").read_text())["comm_bytes_per_step"]
    assert sparse < 0.3 * dense, (sparse, dense)  # the mean of one dense step and five at ~0.09: ~0.24
    assert all(x == x for x in _losses(sc)) and _losses(sc)[-1] < _losses(sc)[0]


def test_forge_agoq_and_int8_allreduce_compose_in_one_run(corpus, one_process, tmp_path):
    """FORGE (per-layer dW reduced through AGoQ's int8 all-reduce) + AGoQ activations, 2 ranks."""
    out = tmp_path / "fa"
    r = subprocess.run([*_torchrun(2), *_args(out, corpus, 2, steps=8), "--forge.enabled", "true",
                        "--agoq.enabled", "true", "--comm.method", "int8", "--optim.lr", "1e-2"],
                       env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["recipe"] == "forge+agoq+ddp-int8"
    by_op = s["comm"]["by_op"]
    assert by_op.get("all_to_all", 0) > 0 and by_op.get("all_gather", 0) > 0  # the int8 all-reduce's two hops
    # saved activations are packed: far below the same model's raw fp32 bytes
    raw = json.loads((one_process / "summary.json").read_text())["memory"]["activations"]
    per_sample_ratio = (s["memory"]["activations"] / 2) / (raw / 4)  # batch 2 per rank vs 4, fp32 model
    assert per_sample_ratio < 0.3, per_sample_ratio
    losses = _losses(out)
    assert all(x == x for x in losses) and losses[-1] < losses[0]


def _gift_args(out, corpus, steps=8):
    return [*_args(out, corpus, 2, steps=steps), "--comm.method", "gift", "--comm.gift.min-numel", "1000",
            "--comm.gift.refresh-every", "3", "--comm.gift.rank", "8", *PLAIN]


def test_gift_follows_the_exact_all_reduce_and_resumes_bit_identically(corpus, ddp, tmp_path):
    """comm.method=gift (FP8 in K-FAC-whitened coordinates, the factors refreshed every 3 steps): the loss
    curve stays within 2 % of DDP's exact all-reduce; the traffic is the FP8 all-reduce's two hops plus the
    factors' broadcasts; resumed from the step-4 checkpoint, the run ends with the uninterrupted one's bits."""
    gift = tmp_path / "gift"
    r = subprocess.run([*_torchrun(2), *_gift_args(gift, corpus)], env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    a, b = _losses(ddp), _losses(gift)
    assert len(a) == len(b) == 8 and a != b
    for x, y in zip(a, b):
        assert abs(x - y) <= 0.02 * abs(x), (a, b)
    s = json.loads((gift / "summary.json").read_text())
    assert s["recipe"] == "ddp-gift"
    by_op = s["comm"]["by_op"]
    assert by_op.get("all_to_all", 0) > 0 and by_op.get("all_gather", 0) > 0 and by_op.get("broadcast", 0) > 0
    _assert_resumes_bit_identically(gift, tmp_path / "resumed", lambda out: _gift_args(out, corpus))


def _assert_resumes_bit_identically(run, resumed, args):
    """``run``'s step-4 checkpoint alone (its step-8 one removed: the run "interrupted" after step 4), continued
    to step 8 with ``args(out)``: the weights end with the uninterrupted run's bits."""
    import shutil

    import torch

    from leantrain.runtime import checkpoint

    shutil.copytree(run, resumed)
    shutil.rmtree(checkpoint.latest(resumed))
    assert checkpoint.latest(resumed).name != checkpoint.latest(run).name
    r = subprocess.run([*_torchrun(2), *args(resumed), "--resume"], env=_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    m1, _, _ = checkpoint.load(checkpoint.latest(run))
    m2, _, _ = checkpoint.load(checkpoint.latest(resumed))
    assert checkpoint.latest(resumed).name == checkpoint.latest(run).name
    for k in m1:
        assert torch.equal(m1[k], m2[k]), k


def test_gift_in_nvfp4_learns_and_resumes_bit_identically(corpus, tmp_path):
    """comm.gift.format=nvfp4 (4-bit, stochastic rounding seeded by the step): the loss falls, and a run
    resumed from the step-4 checkpoint ends with the uninterrupted one's bits (the rounding draws depend on
    the step, not on the process's history)."""
    run = tmp_path / "fp4"

    def args(out):
        return [*_gift_args(out, corpus), "--comm.gift.format", "nvfp4"]

    r = subprocess.run([*_torchrun(2), *args(run)], env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    losses = _losses(run)
    assert len(losses) == 8 and losses[-1] < losses[0]
    s = json.loads((run / "summary.json").read_text())
    assert s["recipe"] == "ddp-gift-nvfp4"
    _assert_resumes_bit_identically(run, tmp_path / "resumed", args)

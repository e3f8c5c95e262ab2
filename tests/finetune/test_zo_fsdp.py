"""MeZO and GRZO under ``--dist.mode fsdp`` (FSDP2) in the trainer, on 2 gloo ranks: the same
run as under ``--dist.mode ddp`` on 2 ranks and as one process with the same global batch; each
rank holds half of the weights; only losses travel besides FSDP's weight all-gathers; DCP
checkpoints resume bit for bit at the same world size, and at one process load the saved weights
bit for bit and follow to rounding.

Tolerances: FSDP and DDP draw the same noise for every element, compute each update over whole
noise blocks (a rank keeps its rows), run the same forwards on the same (all-gathered) weights and
average the same per-rank losses: bit for bit, at 2 ranks and under HSDP at 4. One process takes
the mean of the whole batch's losses, the ranks the mean of their halves' means: the same sum in
another order, so its losses and weights agree to rounding: 1e-5 relative (MeZO's
``(ℓ₊ - ℓ₋) / 2ε`` and GRZO's ``δᵢ / std(δ)`` magnify a loss's rounding by about ``1 / ε``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dist_utils import run_distributed
from helpers import tiny_config
from leantrain.runtime import checkpoint
from leantrain.train.trainer import Trainer

pytestmark = pytest.mark.distributed

STEPS, GLOBAL_BATCH, SAVED_AT = 5, 4, 3
RTOL = 1e-5  # (module docstring)
LR = {"mezo": "1e-2", "grzo": "1e-4"}  # (large enough to move a tiny model's weights in 5 steps)


def _overrides(method: str, world: int, mode: str, **extra) -> dict:
    return {"finetune.method": method, "dist.mode": mode, "optim.lr": LR[method], "train.steps": str(STEPS),
            "data.batch_size": str(GLOBAL_BATCH // world), "train.eval_every": "0",
            "train.ckpt_every": str(SAVED_AT), "train.keep_checkpoints": "3", **extra}


def _full_state(model) -> dict:
    """The whole weights on every rank (a collective under FSDP), as numpy arrays."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {k: v.detach().numpy().copy() for k, v in get_model_state_dict(model, options=opts).items()}


def _train(rank, world, corpus, out, over, resume=False):
    """One rank's run: (losses, summary, whole weights at the end, whole weights before the first step)."""
    tr = Trainer(tiny_config(corpus, **over), out, resume=resume)
    start = _full_state(tr.model)
    summary = tr.fit()
    losses = [json.loads(x)["loss"] for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return losses, summary, _full_state(tr.model), start


def _tensors(arrays: dict) -> dict:
    return {k: torch.from_numpy(v) for k, v in arrays.items()}


def _losses_weights(result: tuple) -> tuple:
    """(losses, whole weights) of a rank's result (:func:`_train`'s, :func:`_hsdp`'s)."""
    return result[0], result[2]


def _follows(a: tuple, b: tuple, *, exactly: bool) -> None:
    """Run ``a`` (losses, weights) is run ``b``: bit for bit, or to rounding (module docstring)."""
    (la, wa), (lb, wb) = a, b
    assert wa.keys() == wb.keys() and len(la) == len(lb) == STEPS
    if exactly:
        assert la == lb
        assert all((wa[k] == wb[k]).all() for k in wb)
        return
    for x, y in zip(la, lb, strict=True):
        assert abs(x - y) <= RTOL * abs(y), (la, lb)
    for k in wb:
        ta, tb = torch.from_numpy(wa[k]).double(), torch.from_numpy(wb[k]).double()
        assert (ta - tb).norm() <= RTOL * tb.norm(), f"{k}: relative difference {(ta - tb).norm() / tb.norm():.2e}"


@pytest.fixture(scope="module", params=["mezo", "grzo"])
def runs(request, corpus, tmp_path_factory):
    """(method, root, FSDP's 2 ranks, DDP's 2 ranks, one process's run) of one method."""
    method = request.param
    root = tmp_path_factory.mktemp(f"zo-fsdp-{method}")
    fsdp = run_distributed(_train, 2, args=(corpus, root / "fsdp", _overrides(method, 2, "fsdp")))
    ddp = run_distributed(_train, 2, args=(corpus, root / "ddp", _overrides(method, 2, "ddp", **{
        "train.ckpt_every": "0"})))
    [one] = run_distributed(_train, 1, args=(corpus, root / "one", _overrides(method, 1, "ddp", **{
        "train.ckpt_every": "0"})))
    return method, root, fsdp, ddp, one


@pytest.mark.slow  # (two or three gloo runs of the trainer: ~30 s)
def test_fsdp_is_ddp_and_one_process(runs):
    method, _, fsdp, ddp, one = runs
    losses, summary, weights, start = fsdp[0]
    assert summary["recipe"] == f"fsdp+{method}"
    moved = max(float(abs(weights[k] - start[k]).max()) for k in weights)
    assert moved > 1e-4, moved  # the steps changed the weights
    _follows((losses, weights), _losses_weights(ddp[0]), exactly=True)
    _follows((losses, weights), _losses_weights(one), exactly=False)


@pytest.mark.slow  # (two or three gloo runs of the trainer: ~30 s)
def test_each_rank_holds_half_the_weights_and_sends_only_losses(runs):
    method, _, fsdp, ddp, _ = runs
    whole = sum(v.nbytes for v in fsdp[0][2].values())  # (fp32 weights)
    for _, summary, _, _ in fsdp:
        assert abs(summary["memory"]["weights"] - whole / 2) <= 0.01 * whole, (summary["memory"], whole)
        assert summary["memory"]["optimizer_states"] == 0
        by_op, ddp_by_op = summary["comm"]["by_op"], ddp[0][1]["comm"]["by_op"]
        # no gradient traffic; the losses as under DDP (MeZO all-reduces 2, GRZO all-gathers them
        # all); the rest is FSDP's all-gathers of the weights: each forward, the other rank's half
        assert set(by_op) <= {"all_gather", "all_reduce"}, by_op
        assert by_op.get("all_reduce", 0) == ddp_by_op.get("all_reduce", 0)
        weights_gathered = by_op["all_gather"] - ddp_by_op.get("all_gather", 0)
        assert STEPS * 2 * whole / 2 <= weights_gathered <= 1.01 * STEPS * 2 * whole / 2, (by_op, whole)


def _resume(rank, world, corpus, out, over):
    return _train(rank, world, corpus, out, over, resume=True)


def _resumable_copy(run: Path, out: Path, keep_step: int) -> Path:
    shutil.copytree(run, out)
    for _, path in checkpoint.checkpoints(out):
        if checkpoint.read_meta(path)["step"] > keep_step:
            shutil.rmtree(path)
    return out


@pytest.mark.slow  # (two or three gloo runs of the trainer: ~30 s)
def test_dcp_resume_is_bit_identical_at_two_ranks_and_follows_at_one(runs, corpus, tmp_path):
    method, root, fsdp, _, _ = runs
    path = checkpoint.latest(root / "fsdp")
    meta = checkpoint.read_meta(path)
    assert meta["format"] == "dcp" and meta["step"] == STEPS and checkpoint.reshardable(meta)
    saved, _ = checkpoint.load_model_state(path)
    assert all(torch.equal(saved[k], torch.from_numpy(v)) for k, v in fsdp[0][2].items())

    out = _resumable_copy(root / "fsdp", tmp_path / "two", SAVED_AT)
    again = run_distributed(_resume, 2, args=(corpus, out, _overrides(method, 2, "fsdp")))
    assert again[0][0] == fsdp[0][0]  # (the losses of steps 4 and 5 too)
    assert all((again[0][2][k] == v).all() for k, v in fsdp[0][2].items())

    out = _resumable_copy(root / "fsdp", tmp_path / "one", SAVED_AT)
    [one] = run_distributed(_resume, 1, args=(corpus, out, _overrides(method, 1, "fsdp")))
    step3, _ = checkpoint.load_model_state(root / "fsdp" / "checkpoints" / f"step_{SAVED_AT:07d}")
    assert all(torch.equal(torch.from_numpy(one[3][k]), step3[k]) for k in step3)  # (loaded whole, bit for bit)
    for a, b in zip(one[0], fsdp[0][0], strict=True):
        assert abs(a - b) <= RTOL * abs(b), (one[0], fsdp[0][0])


# ---------------------------------------------------------------- the optimizers on uneven shards


class _Net(torch.nn.Module):
    """A block (linear 5 -> 7 with a bias, RMSNorm 7) and a head (linear 7 -> 3): under FSDP on 2
    ranks the rows split 4 + 3 and 2 + 1, so noise blocks straddle the shards (module docstring of zo.py)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.block = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.RMSNorm(7))
        self.head = torch.nn.Linear(7, 3, bias=False)

    def forward(self, x):
        return self.head(self.block(x))


def _uneven(rank, world, method, sharded):
    from torch.distributed.fsdp import fully_shard

    from leantrain.finetune import GRZO, MeZO

    # A matmul over 4 rows and over 8 may round a row differently (on AVX-512 CPUs it does), and a
    # zeroth-order step divides loss differences by 1e-3: MeZO (fp32 weights only) forwards one row
    # at a time, GRZO (one forward: it reads the layers' inputs) runs in fp64.
    dtype = torch.float64 if method == "grzo" else torch.float32
    net = _Net().to(dtype)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 5, generator=g).to(dtype), torch.randn(8, 3, generator=g).to(dtype)
    lo, hi = rank * 8 // world, (rank + 1) * 8 // world
    if sharded:
        fully_shard(net.block)
        fully_shard(net, reshard_after_forward=True)  # (the root all-gathers at every forward: zo.py)

    def per_example():
        if method == "grzo":
            return (net(x[lo:hi]) - y[lo:hi]).pow(2).mean(1)
        return torch.cat([(net(x[i:i + 1]) - y[i:i + 1]).pow(2).mean(1) for i in range(lo, hi)])

    if method == "mezo":  # (6 elements a noise block: blocks straddle the 4-row / 3-row split of 35 elements)
        opt, closure = MeZO(net.parameters(), lr=1e-2, eps=1e-3, seed=4, noise_block=6), \
            lambda: per_example().double().mean()
    else:  # (15 elements: blocks of 3 rows, one straddling the split at row 4)
        opt, closure = GRZO(net, lr=1e-2, sigma=1e-3, seed=4, noise_block=15), per_example
    for _ in range(3):
        opt.step(closure)
    if sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = net.state_dict()
    return {k: v.detach().numpy().copy() for k, v in state.items()}


@pytest.mark.parametrize("method", ["mezo", "grzo"])
def test_uneven_shards_step_as_one_process(method):
    [one] = run_distributed(_uneven, 1, args=(method, False))
    two = run_distributed(_uneven, 2, args=(method, True))[0]
    start = _Net().state_dict()
    assert two.keys() == one.keys()
    assert max(float(abs(one[k] - start[k].numpy()).max()) for k in one) > 1e-4  # the steps moved the weights
    for k in one:
        torch.testing.assert_close(torch.from_numpy(two[k]), torch.from_numpy(one[k]), rtol=0, atol=1e-6)


# ---------------------------------------------------------------- slow: HSDP


BATCH_OF_8 = {"data.batch_size": "2"}  # (4 ranks of 2 examples: GRZO refuses fewer than 2 a rank)


def _hsdp(rank, world, corpus, out, over):
    losses, summary, weights, _ = _train(rank, world, corpus, out, over)
    return losses, summary, weights


@pytest.mark.slow
@pytest.mark.parametrize("method", ["mezo", "grzo"])
def test_hsdp_two_replicas_of_two_shards_is_ddp_on_four_ranks(method, corpus, tmp_path):
    """``--dist.replicate 2`` on 4 ranks: each rank shards over the 2 of its replica, perturbs its
    rows, and the losses are averaged over all 4: DDP's run on 4 ranks bit for bit."""
    hsdp = run_distributed(_hsdp, 4, args=(corpus, tmp_path / "hsdp", _overrides(method, 4, "fsdp", **{
        "dist.replicate": "2", "train.ckpt_every": "0", **BATCH_OF_8})))
    ddp = run_distributed(_hsdp, 4, args=(corpus, tmp_path / "ddp", _overrides(method, 4, "ddp", **{
        "train.ckpt_every": "0", **BATCH_OF_8})))
    assert hsdp[0][1]["recipe"] == f"hsdp+{method}"
    _follows(_losses_weights(hsdp[0]), _losses_weights(ddp[0]), exactly=True)
    whole = sum(v.nbytes for v in ddp[0][2].values())
    assert abs(hsdp[0][1]["memory"]["weights"] - whole / 2) <= 0.01 * whole  # (sharded over the 2 of a replica)

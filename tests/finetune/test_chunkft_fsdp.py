"""ChunkFT under ``--dist.mode fsdp`` (FSDP2) in the trainer, on 2 gloo ranks, against one process's
ChunkFT with the same global batch: the same chunk schedule, the same losses and weights to
rounding; each rank's optimizer state holds its shards' rows of the active chunk (about half of one
process's); a DCP resume at the same world size is bit for bit, at another it is refused.

Tolerances: FSDP averages the ranks' gradients by a reduce-scatter of whole weight gradients and
sums the active chunk's squared norm (clipping) over the ranks' rows; one process computes only the
active rows' gradient (its patched linears), over the whole batch, and the norm of whole rows: the
same sums in another order. Over 6 fp32 steps (3 chunks, each active twice) the losses agree to
LOSS_RTOL (measured 8e-8) and each weight tensor to WEIGHT_RTOL in norm (measured 1.7e-5 at worst:
a chunk's first AdamW steps divide each gradient element by its own magnitude, which magnifies the
rounding of small elements).
State bytes: a chunk's pieces are cut between rows, and each rank keeps the rows of them its shard
holds: the two ranks' state together is one process's exactly. Each rank's share of the largest
chunk's (its device arena) is within 15 % of half (FSDP's shards and the chunks' cuts fall at
different rows: measured 0.54 and 0.55), of all chunks' within 10 %.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dist_utils import run_distributed
from helpers import tiny_config
from leantrain.config import ConfigError
from leantrain.runtime import checkpoint
from leantrain.train import techniques
from leantrain.train.trainer import Trainer

STEPS, GLOBAL_BATCH, SAVED_AT, CHUNKS = 6, 4, 3, 3
LOSS_RTOL, WEIGHT_RTOL = 1e-5, 5e-5  # (module docstring)


def _overrides(world: int, mode: str, **extra) -> dict:
    return {"finetune.method": "chunkft", "finetune.num_chunks": str(CHUNKS), "dist.mode": mode,
            "optim.lr": "3e-3", "train.steps": str(STEPS), "data.batch_size": str(GLOBAL_BATCH // world // 2),
            "data.grad_accum": "2", "train.eval_every": "0", "train.ckpt_every": str(SAVED_AT),
            "train.keep_checkpoints": "3", **extra}


def _full_state(model) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {k: v.detach().numpy().copy() for k, v in get_model_state_dict(model, options=opts).items()}


def _train(rank, world, corpus, out, over, resume=False):
    """One rank's run: (losses, chunks stepped, whole weights, state bytes: the arena and all chunks')."""
    tr = Trainer(tiny_config(corpus, **over), out, resume=resume)
    summary = tr.fit()
    rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    weights = _full_state(tr.model) if world > 1 else {k: v.detach().numpy().copy()
                                                       for k, v in tr.model.state_dict().items()}
    nbytes = tr.opt.arena.element_size()
    return ([r["loss"] for r in rows], [r["chunk"] for r in rows], weights,
            (tr.opt.arena.numel() * nbytes, sum(tr.opt.sizes) * nbytes), summary)


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("chunkft-fsdp")
    fsdp = run_distributed(_train, 2, args=(corpus, root / "fsdp", _overrides(2, "fsdp")))
    one = _train(0, 1, corpus, root / "one", _overrides(1, "ddp", **{"train.ckpt_every": "0"}))
    return root, fsdp, one


@pytest.mark.distributed
def test_two_ranks_follow_one_process(runs):
    _, fsdp, one = runs
    losses, chunks, weights, *_ = one
    assert chunks == [0, 1, 2, 0, 1, 2] and len(losses) == STEPS
    for rank_losses, rank_chunks, *_ in fsdp:
        assert rank_chunks == chunks
        for x, y in zip(rank_losses, losses, strict=True):
            assert abs(x - y) <= LOSS_RTOL * abs(y), (rank_losses, losses)
    gathered = fsdp[0][2]  # (the whole weights, gathered on rank 0)
    assert gathered.keys() == weights.keys()
    for k in weights:
        a, b = torch.from_numpy(gathered[k]).double(), torch.from_numpy(weights[k]).double()
        assert (a - b).norm() <= WEIGHT_RTOL * b.norm(), f"{k}: relative difference {(a - b).norm() / b.norm():.2e}"


@pytest.mark.distributed
def test_only_the_active_chunks_gradients_are_reduce_scattered(runs):
    """Inactive chunks' parameters are frozen for the step: FSDP computes and reduce-scatters no
    gradient for them. With 3 chunks a step sends about a third of every gradient's bytes, more
    where a chunk holds part of a parameter (measured 0.41x of FSDP's full reduce-scatter)."""
    summary = runs[1][0][4]
    full = STEPS * summary["parameters"] * 4 / 2  # (fp32 gradients, (n - 1) / n of them sent at 2 ranks)
    assert 0.3 * full <= summary["comm"]["by_op"]["reduce_scatter"] <= 0.5 * full, (summary["comm"], full)


@pytest.mark.distributed
def test_each_rank_holds_about_half_of_the_state(runs):
    _, fsdp, one = runs
    arena, whole = one[3]
    assert sum(r[3][1] for r in fsdp) == whole  # (every state row is on exactly one rank)
    for _, _, _, (rank_arena, rank_whole), _ in fsdp:
        assert 0.5 * 0.85 * arena <= rank_arena <= 0.5 * 1.15 * arena, (rank_arena, arena)
        assert 0.5 * 0.9 * whole <= rank_whole <= 0.5 * 1.1 * whole, (rank_whole, whole)


@pytest.mark.distributed
def test_resume_at_the_same_world_size_is_bit_identical(runs, corpus, tmp_path):
    root, fsdp, _ = runs
    out = tmp_path / "again"
    shutil.copytree(root / "fsdp", out)
    for _, path in checkpoint.checkpoints(out):
        if checkpoint.read_meta(path)["step"] > SAVED_AT:
            shutil.rmtree(path)
    resumed = run_distributed(_train, 2, args=(corpus, out, _overrides(2, "fsdp"), True))
    for (losses, chunks, weights, *_), (first_losses, first_chunks, first_weights, *_) in zip(resumed, fsdp):
        assert losses == first_losses and chunks == first_chunks
        assert all((weights[k] == first_weights[k]).all() for k in first_weights)


@pytest.mark.distributed
def test_resume_at_another_world_size_is_refused(runs, corpus, tmp_path):
    root, _, _ = runs
    out = tmp_path / "one"
    shutil.copytree(root / "fsdp", out)
    with pytest.raises(checkpoint.CheckpointError, match="resume with the 2 processes"):
        _train(0, 1, corpus, out, _overrides(1, "fsdp"), True)


@pytest.mark.parametrize("over, words", [
    ({"forge.enabled": "true"}, "drop --forge"),
    ({"comm.method": "int8"}, "drop --comm.method int8"),
    ({"dist.param_dtype": "bf16"}, "--dist.reduce-dtype"),
])
def test_refusals_under_fsdp(corpus, over, words):
    with pytest.raises(ConfigError) as e:
        techniques.validate(tiny_config(corpus, **{"finetune.method": "chunkft", "dist.mode": "fsdp", **over}), world=2)
    assert str(e.value).startswith("finetune.method chunkft under --dist.mode fsdp: ") and words in str(e.value)


def test_torchrun_without_fsdp_is_refused(corpus):
    with pytest.raises(ConfigError, match="--dist.mode fsdp"):
        techniques.validate(tiny_config(corpus, **{"finetune.method": "chunkft"}), world=2)

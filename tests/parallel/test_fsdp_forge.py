"""``--dist.mode fsdp --forge``: FORGE's updates in backward on FSDP2's row shards (forge/shards.py),
on 2 gloo ranks, against one process with ``--forge`` and against FSDP2 + torch AdamW on the
same global batch; per-rank state bytes; at most one layer's whole gradient alive; DCP resume;
the refused combinations.

Tolerances: each layer's gradient is reduce-scattered (the mean of the ranks' sums), one
process takes the mean over the whole batch: the same sums in another order, so fp32 results
agree to rounding (1e-5 relative, as tests/parallel/test_fsdp.py's), not bit for bit. FORGE's
AdamW and torch's differ by rounding only (the same formula: tests/forge), so FORGE under FSDP
follows FSDP + torch AdamW to the same tolerance when nothing is clipped. A resume at the same
world size repeats the same arithmetic: bit-identical.
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from helpers import tiny_config
from leantrain.config import ConfigError
from leantrain.train import techniques
from parallel.test_fsdp import RTOL, STEPS, _close, _resumable_copy, _tensors, _train

GLOBAL_BATCH = 4


def _overrides(world: int, **extra) -> dict:
    """10 steps of a global batch of 4 sequences in one micro-batch, norm weights without weight
    decay, no clipping (FORGE's in-backward clip is an estimate; torch's is exact)."""
    return {"train.steps": str(STEPS), "data.batch_size": str(GLOBAL_BATCH // world), "data.grad_accum": "1",
            "optim.decay_1d": "false", "optim.grad_clip": "0", "train.eval_every": "0", "train.ckpt_every": "5",
            "train.keep_checkpoints": "3", **extra}


FORGE = {"forge.enabled": "true"}
FSDP = {"dist.mode": "fsdp"}


def _train_forge(rank, world, corpus, out, over, resume=False):
    """:func:`parallel.test_fsdp._train` (losses, summary, whole weights[, right after resuming])
    plus the most elements FORGE's dW workspace held at once."""
    from leantrain.forge.optimizer import ForgeOptimizer

    peaks = []
    original = ForgeOptimizer.step

    def step(self, closure=None):  # (records the workspace's peak before step() releases it)
        peaks.append(self.peak_dw_numel)
        return original(self, closure)

    ForgeOptimizer.step = step
    try:
        result = _train(rank, world, corpus, out, over, resume=resume, loaded_state=resume)
    finally:
        ForgeOptimizer.step = original
    return result, max(peaks)


@pytest.fixture(scope="module")
def forge_runs(corpus, tmp_path_factory):
    """FSDP + FORGE on 2 ranks, FORGE in one process, FSDP + torch AdamW on 2 ranks."""
    root = tmp_path_factory.mktemp("fsdp_forge")
    sharded = run_distributed(_train_forge, 2, args=(corpus, root / "fsdp_forge", _overrides(2, **FSDP, **FORGE)))
    [one] = run_distributed(_train, 1, args=(corpus, root / "forge", _overrides(1, **FORGE)))
    adamw = run_distributed(_train, 2, args=(corpus, root / "fsdp", _overrides(2, **FSDP)))
    return root, sharded, one, adamw


@pytest.mark.distributed
def test_follows_one_process_forge_and_fsdp_with_torch_adamw(forge_runs):
    _, sharded, one, adamw = forge_runs
    (losses, summary, weights, _), _ = sharded[0]
    assert summary["recipe"] == "forge+fsdp" and summary["world_size"] == 2 and len(losses) == STEPS
    for other_losses, other_weights in ((one[0], one[2]), (adamw[0][0], adamw[0][2])):
        for a, b in zip(losses, other_losses, strict=True):
            assert abs(a - b) <= RTOL * abs(b), (losses, other_losses)
        _close(_tensors(weights), _tensors(other_weights))


@pytest.mark.distributed
def test_each_rank_holds_half_the_optimizer_state_and_one_layers_gradient(forge_runs):
    _, sharded, one, _ = forge_runs
    whole = sum(v.nbytes for v in one[2].values())  # (fp32 weights)
    largest = max(v.size for k, v in one[2].items() if v.ndim == 2 and "embed" not in k)
    unfused = sum(v.nbytes for k, v in one[2].items() if v.ndim != 2 or "embed" in k)
    for (_, summary, _, _), peak in sharded:
        mem = summary["memory"]
        assert abs(mem["weights"] - whole / 2) <= 0.01 * whole, (mem, whole)
        assert abs(mem["optimizer_states"] - whole) <= 0.01 * whole, (mem, whole)  # (exp_avg, exp_avg_sq halves)
        # gradients: only the shards FSDP reduced of the parameters FORGE does not fuse (norms, embedding)
        assert mem["grads"] <= unfused / 2 + 0.01 * whole, (mem, unfused)
        # one dW workspace: the largest fused layer's gradient (its rows padded to 2 equal shards)
        assert largest <= peak <= largest + 48, (peak, largest)
        # the traffic in the ledger: FSDP's weight all-gathers (forward and backward) and FSDP's
        # reduce-scatter of the unfused gradients beside FORGE's own of each fused layer's dW
        comm = summary["comm"]
        gathers = comm["by_op"]["all_gather"] / comm["steps"]
        assert whole / 2 <= gathers <= 2.02 * whole / 2, (gathers, whole)
        assert whole / 2 <= comm["by_op"]["reduce_scatter"] / comm["steps"] <= 1.05 * whole / 2, comm


@pytest.mark.distributed
def test_resume_at_the_same_world_size_is_bit_identical(forge_runs, corpus, tmp_path):
    root, sharded, _, _ = forge_runs
    out = _resumable_copy(root / "fsdp_forge", tmp_path / "again", 5)
    resumed = run_distributed(_train_resumed, 2, args=(corpus, out, _overrides(2, **FSDP, **FORGE)))
    (losses, _, weights, _), _ = sharded[0]
    (again_losses, _, again, _), _ = resumed[0]
    assert again_losses == losses
    whole, again = _tensors(weights), _tensors(again)
    assert all(torch.equal(whole[k], again[k]) for k in whole)


def _train_resumed(rank, world, corpus, out, over):
    return _train_forge(rank, world, corpus, out, over, resume=True)


@pytest.mark.parametrize("over, says", [
    ({"forge.state_dtype": "int8"}, "forge.state_dtype int8"),
    ({"data.grad_accum": "2"}, "data.grad_accum"),
])
def test_unsupported_combinations_are_refused_in_one_sentence(corpus, over, says):
    cfg = tiny_config(corpus, **{**FSDP, **FORGE, **over})
    with pytest.raises(ConfigError) as e:
        techniques.validate(cfg, world=2)
    msg = str(e.value)
    assert msg.startswith("--forge with --dist.mode fsdp: ") and says in msg and msg.count(". ") == 0, msg


def test_fsdp_yields_the_step_to_forge(corpus):
    classes = techniques.wanted(tiny_config(corpus, **FSDP, **FORGE))
    techniques.validate(tiny_config(corpus, **FSDP, **FORGE), world=2)
    assert techniques.step_owner(classes).name == "forge"


@pytest.mark.distributed
@pytest.mark.slow
def test_clipping_sees_the_whole_layers_norms(corpus, tmp_path):
    """``optim.grad_clip`` 0.5 (every step clips): FORGE's est_global scale from each layer's sum of
    squares all-reduced over the shards, the non-fused parameters' too, so the 2-rank run clips as
    one process does; resumed at step 5 (the predictions kept beside DCP's state), bit-identical."""
    clip = {"optim.grad_clip": "0.5", "forge.clip": "est_global"}
    sharded = run_distributed(_train_forge, 2, args=(corpus, tmp_path / "two", _overrides(2, **FSDP, **FORGE, **clip)))
    [one] = run_distributed(_train, 1, args=(corpus, tmp_path / "one", _overrides(1, **FORGE, **clip)))
    (losses, _, weights, _), _ = sharded[0]
    for a, b in zip(losses, one[0], strict=True):
        assert abs(a - b) <= RTOL * abs(b), (losses, one[0])
    _close(_tensors(weights), _tensors(one[2]))
    out = _resumable_copy(tmp_path / "two", tmp_path / "again", 5)
    (again_losses, _, again, _), _ = run_distributed(
        _train_resumed, 2, args=(corpus, out, _overrides(2, **FSDP, **FORGE, **clip)))[0]
    assert again_losses == losses
    assert all(torch.equal(_tensors(weights)[k], _tensors(again)[k]) for k in weights)


@pytest.mark.distributed
@pytest.mark.slow
def test_hsdp_two_replicas_of_two_shards_follow_one_process(corpus, tmp_path):
    """HSDP (4 ranks, ``dist.replicate`` 2): each layer's rows reduce-scattered over the 2 shards of
    a replica, then all-reduced across the replicas."""
    over = _overrides(4, **FSDP, **FORGE, **{"dist.replicate": "2", "train.ckpt_every": "0"})
    ranks = run_distributed(_train_forge, 4, args=(corpus, tmp_path / "hsdp", over))
    [one] = run_distributed(_train, 1, args=(corpus, tmp_path / "one", _overrides(1, **FORGE)))
    (losses, summary, weights, _), _ = ranks[0]
    assert summary["recipe"] == "forge+hsdp"
    for a, b in zip(losses, one[0], strict=True):
        assert abs(a - b) <= RTOL * abs(b), (losses, one[0])
    _close(_tensors(weights), _tensors(one[2]))

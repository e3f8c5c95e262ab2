"""``--dist.mode fsdp``: FSDP2 in the trainer on gloo ranks against one process with the same
optimizer math (``--baseline``: ``torch.optim.AdamW``, the same global batch); per-rank bytes;
DCP checkpoints resumed at another world size and read whole for ``export`` / ``--from``;
the refused combinations.

Tolerances: FSDP averages the ranks' gradients by a reduce-scatter, one process takes the mean
over the whole batch: the same sums in another order, so fp32 results agree to rounding (losses
and each weight tensor's norm of difference within 1e-5 relative after 10 AdamW steps), not bit
for bit. A resume at the same world size repeats the
same arithmetic: bit-identical.
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

STEPS = 10
GLOBAL_BATCH = 4
RTOL = 1e-5  # (module docstring)


def _overrides(world: int, **extra) -> dict:
    """10 steps of a global batch of 4 sequences in 2 micro-batches (FSDP's ``no_sync`` in the first),
    norm weights in a group without weight decay, gradients clipped at 1 (the default)."""
    return {"train.steps": str(STEPS), "data.batch_size": str(GLOBAL_BATCH // world), "data.grad_accum": "2",
            "optim.decay_1d": "false", "train.eval_every": "0", "train.ckpt_every": "5", "train.keep_checkpoints": "3", **extra}


def _full_state(model) -> dict:
    """The whole weights on every rank (a collective under FSDP), as numpy arrays (pickled by value:
    a tensor returned from a rank would be shared memory of a process that ends)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {k: v.detach().numpy().copy() for k, v in get_model_state_dict(model, options=opts).items()}


def _tensors(arrays: dict) -> dict:
    return {k: torch.from_numpy(v) for k, v in arrays.items()}


def _train(rank, world, corpus, out, over, until=None, resume=False, loaded_state=False):
    """One rank's run: (losses, summary, whole weights at the end[, whole weights right after resuming])."""
    tr = Trainer(tiny_config(corpus, **over), out, resume=resume)
    if tr.cfg.dist.mode == "fsdp":  # the optimizer steps the sharded parameters, every one once
        from torch.distributed.tensor import DTensor

        stepped = [p for g in tr.opt.param_groups for p in g["params"]]
        assert sorted(map(id, stepped)) == sorted(map(id, tr.model.parameters()))
        assert all(isinstance(p, DTensor) for p in stepped)
    after_load = _full_state(tr.model) if loaded_state else None
    summary = tr.fit(until=until)
    losses = [json.loads(x)["loss"] for x in (Path(out) / "metrics.jsonl").read_text().splitlines()] \
        if rank == 0 else None
    return losses, summary, _full_state(tr.model), after_load


def _baseline(corpus, out) -> tuple[list, dict]:
    tr = Trainer(tiny_config(corpus, **_overrides(1, **{"train.ckpt_every": "0"})), out, baseline=True)
    tr.fit()
    losses = [json.loads(x)["loss"] for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return losses, {k: v.detach().clone() for k, v in tr.model.state_dict().items()}


def _close(a: dict, b: dict, rtol: float = RTOL) -> None:
    """Each tensor within ``rtol`` of the other in norm (one coordinate of a near-zero gradient may
    move by AdamW's step where the two sums round apart: compared element-wise it would not)."""
    assert a.keys() == b.keys()
    for k in b:
        err = (a[k].double() - b[k].double()).norm() / b[k].double().norm()
        assert err <= rtol, f"{k}: relative difference {err:.2e}"


@pytest.fixture(scope="module")
def two_rank_run(corpus, tmp_path_factory):
    """10 steps of ``--dist.mode fsdp`` on 2 gloo ranks (checkpoints at 5 and 10) and the one-process baseline."""
    root = tmp_path_factory.mktemp("fsdp")
    fsdp = run_distributed(_train, 2, args=(corpus, root / "two", _overrides(2, **{"dist.mode": "fsdp"})))
    return root, fsdp, _baseline(corpus, root / "one")


@pytest.mark.distributed
def test_two_ranks_follow_one_process_with_torch_adamw(two_rank_run):
    _, ranks, (base_losses, base_weights) = two_rank_run
    losses, summary, weights, _ = ranks[0]
    weights = _tensors(weights)
    assert len(losses) == STEPS
    for a, b in zip(losses, base_losses, strict=True):
        assert abs(a - b) <= RTOL * abs(b), (losses, base_losses)
    _close(weights, base_weights)
    assert summary["recipe"] == "fsdp" and summary["world_size"] == 2


@pytest.mark.distributed
def test_each_rank_holds_half_the_weights_and_optimizer_state(two_rank_run):
    root, ranks, _ = two_rank_run
    whole = sum(v.nbytes for v in ranks[0][2].values())  # (fp32 weights)
    for _, summary, _, _ in ranks:
        mem = summary["memory"]
        # (a shard may be padded to a multiple of the world size: a few elements per tensor)
        assert abs(mem["weights"] - whole / 2) <= 0.01 * whole, (mem, whole)
        assert abs(mem["optimizer_states"] - whole) <= 0.01 * whole, (mem, whole)  # (exp_avg, exp_avg_sq)


@pytest.mark.distributed
def test_dcp_checkpoint_is_intact_and_reads_whole_in_one_process(two_rank_run):
    root, ranks, _ = two_rank_run
    path, warnings = checkpoint.latest_intact(root / "two")
    assert path.name == "step_0000010" and not warnings
    meta = checkpoint.read_meta(path)
    assert meta["format"] == "dcp" and meta["world_size"] == 2 and checkpoint.reshardable(meta)
    state, _ = checkpoint.load_model_state(path)
    weights = _tensors(ranks[0][2])
    assert state.keys() == weights.keys()
    assert all(torch.equal(state[k], weights[k]) for k in weights)


@pytest.mark.distributed
def test_resume_at_one_process_from_two_ranks(two_rank_run, corpus, tmp_path):
    """Saved at 2 ranks (step 5), resumed by one process with the same global batch: the weights
    loaded are the saved ones bit for bit; the 5 steps after follow the 2-rank run to rounding."""
    root, ranks, _ = two_rank_run
    out = tmp_path / "resumed"
    shutil.copytree(root / "two", out)
    shutil.rmtree(out / "checkpoints" / "step_0000010")
    saved, _ = checkpoint.load_model_state(out / "checkpoints" / "step_0000005")
    [(losses, _, weights, loaded)] = run_distributed(_train_resumed, 1,
                                                     args=(corpus, out, _overrides(1, **{"dist.mode": "fsdp"})))
    loaded = _tensors(loaded)
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert len(losses) == STEPS
    for a, b in zip(losses, ranks[0][0], strict=True):
        assert abs(a - b) <= RTOL * abs(b)
    _close(_tensors(weights), _tensors(ranks[0][2]))


def _train_resumed(rank, world, corpus, out, over, until=None):
    return _train(rank, world, corpus, out, over, until=until, resume=True, loaded_state=True)


def _resumable_copy(run: Path, out: Path, keep_step: int) -> Path:
    """A copy of ``run`` whose newest checkpoint is step ``keep_step``."""
    shutil.copytree(run, out)
    for _, path in checkpoint.checkpoints(out):
        if checkpoint.read_meta(path)["step"] > keep_step:
            shutil.rmtree(path)
    return out


@pytest.mark.distributed
def test_resume_at_the_same_world_size_is_bit_identical(two_rank_run, corpus, tmp_path):
    root, ranks, _ = two_rank_run
    out = _resumable_copy(root / "two", tmp_path / "again", 5)
    resumed = run_distributed(_train_resumed, 2, args=(corpus, out, _overrides(2, **{"dist.mode": "fsdp"})))
    assert resumed[0][0] == ranks[0][0]  # (the losses of steps 6-10 too)
    whole, again = _tensors(ranks[0][2]), _tensors(resumed[0][2])
    assert all(torch.equal(whole[k], again[k]) for k in whole)


@pytest.mark.distributed
def test_from_and_export_read_the_dcp_checkpoint_whole(two_rank_run, corpus, tmp_path):
    """``--from RUN`` starts from the checkpoint's weights; ``leantrain export`` writes them as a
    Hugging Face model whose logits are the leantrain model's."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    from leantrain import cli
    from leantrain import config as config_mod
    from leantrain.model import Llama

    root, ranks, _ = two_rank_run
    weights = _tensors(ranks[0][2])
    tr = Trainer(tiny_config(corpus, **{"train.init_from": str(root / "two"), "train.steps": "1"}), tmp_path / "from")
    assert all(torch.equal(v, weights[k]) for k, v in tr.model.state_dict().items())
    assert cli.main(["export", str(root / "two"), str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    meta = checkpoint.read_meta(checkpoint.latest(root / "two"))
    model = Llama(config_mod.from_dict(meta["config"]).model)
    model.load_state_dict(weights)
    x = torch.randint(0, model.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize("over, says", [
    ({"comm.method": "gift"}, "comm.method gift"),
    ({"agoq.grad_bits": "8"}, "agoq.grad_bits 8"),
    ({"optim.name": "lion"}, "optim.name lion"),
    ({"optim.name": "adams"}, "optim.name adams"),
    ({"train.weights": "bf16"}, "train.weights bf16"),
    ({"dist.cpu_offload": "true"}, "dist.cpu_offload"),
    ({"dist.replicate": "3"}, "dist.replicate (3)"),
])
def test_unsupported_combinations_are_refused_in_one_sentence(corpus, over, says):
    cfg = tiny_config(corpus, **{"dist.mode": "fsdp", **over})
    with pytest.raises(ConfigError) as e:
        techniques.validate(cfg, world=4)
    msg = str(e.value)
    assert msg.startswith("--dist.mode fsdp: ") and says in msg and msg.count(". ") == 0, msg


def test_cuda_graph_is_refused(corpus):
    cfg = tiny_config(corpus, **{"dist.mode": "fsdp", "train.cuda_graph": "true"})
    with pytest.raises(ConfigError, match="train.cuda_graph"):
        techniques.validate(cfg, world=2)


def test_replicate_must_be_positive(corpus):
    with pytest.raises(ConfigError, match="dist.replicate must be >= 1"):
        tiny_config(corpus, **{"dist.mode": "fsdp", "dist.replicate": "0"})


# ---------------------------------------------------------------- slow: 4 ranks, HSDP, AGoQ, torchrun


@pytest.mark.distributed
@pytest.mark.slow
def test_four_ranks_then_two_then_one(two_rank_run, corpus, tmp_path):
    """4 ranks follow one process; their step-5 checkpoint resumed at 2 ranks to step 7, that one at
    1 process to step 10: each load gives the saved weights bit for bit, and the end is the
    uninterrupted 4-rank run's to rounding (steps 6-10 sum the gradients in other orders)."""
    _, _, (base_losses, base_weights) = two_rank_run
    four = run_distributed(_train, 4, args=(corpus, tmp_path / "four", _overrides(4, **{"dist.mode": "fsdp"})))
    losses, _, weights, _ = four[0]
    weights = _tensors(weights)
    for a, b in zip(losses, base_losses, strict=True):
        assert abs(a - b) <= RTOL * abs(b), (losses, base_losses)
    _close(weights, base_weights)

    out = _resumable_copy(tmp_path / "four", tmp_path / "chain", 5)
    step5, _ = checkpoint.load_model_state(out / "checkpoints" / "step_0000005")
    two = run_distributed(_train_resumed, 2, args=(corpus, out, _overrides(2, **{"dist.mode": "fsdp"}), 7))
    assert all(torch.equal(_tensors(two[0][3])[k], step5[k]) for k in step5)
    step7, meta = checkpoint.load_model_state(checkpoint.latest(out))
    assert meta["step"] == 7 and meta["world_size"] == 2
    [one] = run_distributed(_train_resumed, 1, args=(corpus, out, _overrides(1, **{"dist.mode": "fsdp"})))
    assert all(torch.equal(_tensors(one[3])[k], step7[k]) for k in step7)
    for a, b in zip(one[0], losses, strict=True):
        assert abs(a - b) <= RTOL * abs(b), (one[0], losses)
    _close(_tensors(one[2]), weights)


@pytest.mark.distributed
@pytest.mark.slow
def test_hsdp_two_replicas_of_two_shards_follow_one_process(two_rank_run, corpus, tmp_path):
    _, _, (base_losses, base_weights) = two_rank_run
    over = _overrides(4, **{"dist.mode": "fsdp", "dist.replicate": "2"})
    ranks = run_distributed(_train, 4, args=(corpus, tmp_path / "hsdp", over))
    losses, summary, weights, _ = ranks[0]
    assert summary["recipe"] == "hsdp"
    for a, b in zip(losses, base_losses, strict=True):
        assert abs(a - b) <= RTOL * abs(b), (losses, base_losses)
    _close(_tensors(weights), base_weights)
    whole = sum(v.nbytes for v in weights.values())
    assert abs(summary["memory"]["weights"] - whole / 2) <= 0.01 * whole  # (sharded over the 2 of a replica)
    # the ledger: per step, the fp32 gradients reduce-scattered inside a replica ((2-1)/2 of them) and
    # this rank's half all-reduced across the 2 replicas (2 (2-1)/2 of it), each within padding
    comm = summary["comm"]
    for op in ("reduce_scatter", "all_reduce"):
        sent = comm["by_op"][op] / STEPS
        assert whole / 2 <= sent <= 1.01 * whole / 2, (op, sent, whole)


@pytest.mark.distributed
@pytest.mark.slow
def test_agoq_under_fsdp_follows_agoq_under_ddp(corpus, tmp_path):
    """AGoQ packs each rank's own activations: under FSDP the same ones as under DDP. The two runs'
    optimizers are torch's AdamW and leantrain's reference AdamW, equal to rounding (1.6e-7 apart
    after 10 steps without AGoQ); AGoQ's rounding to 8 bits turns such differences into ~5e-5 of
    the weights (the losses agree to 1e-7): 1e-4 relative."""
    agoq = {"agoq.enabled": "true", "train.ckpt_every": "0"}
    fsdp = run_distributed(_train, 2, args=(corpus, tmp_path / "fsdp", _overrides(2, **agoq, **{"dist.mode": "fsdp"})))
    ddp = run_distributed(_train, 2, args=(corpus, tmp_path / "ddp", _overrides(2, **agoq)))
    for a, b in zip(fsdp[0][0], ddp[0][0], strict=True):
        assert abs(a - b) <= 1e-4 * abs(b), (fsdp[0][0], ddp[0][0])
    _close(_tensors(fsdp[0][2]), _tensors(ddp[0][2]), rtol=1e-4)
    # the same packed activations (without AGoQ, FSDP's saved all-gathered weights count as activations)
    assert fsdp[0][1]["memory"]["activations"] == ddp[0][1]["memory"]["activations"]


@pytest.mark.distributed
@pytest.mark.slow
def test_cli_under_torchrun_then_one_process_resumes(corpus, tmp_path):
    """``torchrun --nproc-per-node 2 -m leantrain train --dist.mode fsdp`` exits 0 (after its
    sample); a plain
    ``python -m leantrain train --resume`` (no torchrun: a one-process group) continues it."""
    import os
    import subprocess
    import sys

    from dist_utils import free_port
    from helpers import TINY_OVERRIDES

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src"), "OMP_NUM_THREADS": "1"}

    def args(batch, steps):
        flags = {**TINY_OVERRIDES, "data.batch_size": str(batch), "train.eval_every": "2", "train.ckpt_every": "2"}
        return ["-m", "leantrain", "train", "--preset", "tiny", "--steps", str(steps), "--out", str(tmp_path / "run"),
                "--data", str(corpus), "--dist.mode", "fsdp", *[x for k, v in flags.items() for x in (f"--{k}", v)]]

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                str(free_port())]
    two = subprocess.run([*torchrun, *args(2, 4), "--train.sample-tokens", "4"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "sample:" in two.stdout  # (every rank runs the sharded model's forwards)
    one = subprocess.run([sys.executable, *args(4, 6), "--resume"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "resumed from" in one.stdout and "at step 4" in one.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["world_size"] == 1
    bad = subprocess.run([sys.executable, *args(2, 8), "--resume"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode != 0 and "--data.batch-size 4" in bad.stderr, bad.stderr[-2000:]


@pytest.mark.distributed
@pytest.mark.slow
def test_bf16_all_gathers_and_reductions_follow_fp32(two_rank_run, corpus, tmp_path):
    """``dist.param_dtype`` / ``reduce_dtype`` bf16: the forward, backward and gradient reduction in
    bf16 (8 bits of mantissa) over fp32 shards and optimizer: the losses of 10 steps within 1e-3
    relative of the fp32 run's."""
    _, ranks, _ = two_rank_run
    over = _overrides(2, **{"dist.mode": "fsdp", "dist.param_dtype": "bf16", "dist.reduce_dtype": "bf16",
                            "train.ckpt_every": "0"})
    losses, summary, _, _ = run_distributed(_train, 2, args=(corpus, tmp_path / "bf16", over))[0]
    assert summary["recipe"] == "fsdp-bf16"
    for a, b in zip(losses, ranks[0][0], strict=True):
        assert abs(a - b) <= 1e-3 * abs(b), (losses, ranks[0][0])
    assert summary["memory"]["weights"] == ranks[0][1]["memory"]["weights"]  # (fp32 shards)


@pytest.mark.distributed
@pytest.mark.slow
def test_sgd_follows_the_reference_sgd_under_ddp(corpus, tmp_path):
    """``optim.name sgd``: ``torch.optim.SGD`` over the shards with decoupled weight decay against
    leantrain's reference SGD under DDP (the same update; sums in other orders)."""
    sgd = {"optim.name": "sgd", "optim.lr": "0.05", "optim.weight_decay": "0.1", "train.ckpt_every": "0"}
    fsdp = run_distributed(_train, 2, args=(corpus, tmp_path / "fsdp", _overrides(2, **sgd, **{"dist.mode": "fsdp"})))
    ddp = run_distributed(_train, 2, args=(corpus, tmp_path / "ddp", _overrides(2, **sgd)))
    assert fsdp[0][1]["recipe"] == "fsdp"
    for a, b in zip(fsdp[0][0], ddp[0][0], strict=True):
        assert abs(a - b) <= RTOL * abs(b), (fsdp[0][0], ddp[0][0])
    _close(_tensors(fsdp[0][2]), _tensors(ddp[0][2]))

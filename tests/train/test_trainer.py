import copy
import json

import pytest
import torch

import leantrain as lt
from helpers import tiny_config
from leantrain.cli import main as cli_main
from leantrain.runtime import checkpoint
from leantrain.train.trainer import NonFiniteLoss, Trainer, lr_lambda, rule_from_config


def test_trains_logs_and_writes_every_artifact(corpus, tmp_path):
    cfg = tiny_config(corpus, **{"train.steps": "30", "train.eval_every": "10", "optim.lr": "3e-3"})
    s = Trainer(cfg, tmp_path / "run").fit()
    out = tmp_path / "run"
    for f in ("metrics.jsonl", "summary.json", "config.json", "loss.png"):
        assert (out / f).exists(), f
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 30 and {"step", "loss", "lr", "tokens_per_second"} <= rows[0].keys()
    # (a row is written once the next step is issued, or before an evaluation / checkpoint)
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert [r["step"] for r in rows if "val_loss" in r] == [10, 20, 30]
    assert all(isinstance(r["loss"], float) and r["tokens_per_second"] > 0 for r in rows)
    rates = sorted(r["tokens_per_second"] for r in rows[1:])  # (each a step's own interval: none near zero)
    assert rates[-1] < 20 * rates[len(rates) // 2]
    assert s["final_loss"] == sum(r["loss"] for r in rows[-10:]) / 10
    for key in ("final_loss", "val_loss", "steps", "tokens_per_second", "peak_memory_bytes", "memory", "comm_bytes_per_step"):
        assert key in s
    assert set(s["memory"]) == {"weights", "grads", "optimizer_states", "activations"}
    assert s["memory"]["optimizer_states"] == 2 * s["memory"]["weights"]  # AdamW: m and v in fp32
    assert s["memory"]["grads"] == s["memory"]["weights"] and s["memory"]["activations"] > 0
    assert s["val_loss"] < s["initial_val_loss"] - 0.5
    assert checkpoint.latest(out).name == "step_0000030"


RESUME_RECIPES = {
    "reference": {},
    "forge": {"forge.enabled": "true"},
    "forge-no-decay-1d": {"forge.enabled": "true", "optim.decay_1d": "false"},  # two param groups
    "forge-bf16-int8": {"forge.enabled": "true", "train.weights": "bf16", "forge.state_dtype": "int8",
                        "model.dim": "64", "model.ffn_dim": "128"},
    "forge-bf16-int8p": {"forge.enabled": "true", "train.weights": "bf16", "forge.state_dtype": "int8p",
                         "model.dim": "64", "model.ffn_dim": "128"},
}


@pytest.mark.parametrize("recipe", sorted(RESUME_RECIPES))
def test_resume_is_bit_identical(corpus, tmp_path, recipe):
    extra = {"train.steps": "10", "train.eval_every": "0", "train.ckpt_every": "5", **RESUME_RECIPES[recipe]}
    straight = Trainer(tiny_config(corpus, **extra), tmp_path / "a")
    straight.fit()
    half = Trainer(tiny_config(corpus, **extra), tmp_path / "b")
    half.fit(until=5)  # an interrupted run
    resumed = Trainer(tiny_config(corpus, **extra), tmp_path / "b", resume=True)
    assert resumed.step == 5
    resumed.fit()
    for (k, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), k
    la = [json.loads(x)["loss"] for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    lb = [json.loads(x)["loss"] for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert la == lb


def test_resume_names_the_layout_a_checkpoint_was_written_with(corpus, tmp_path):
    """model.fused_proj changes the optimizer's per-layer state: a resume in the other layout
    stops with the flag to pass; in the checkpoint's own it resumes."""
    from leantrain.config import ConfigError

    extra = {"train.steps": "2", "train.eval_every": "0", "train.ckpt_every": "2", "model.fused_proj": "false"}
    Trainer(tiny_config(corpus, **extra), tmp_path / "r").fit()
    with pytest.raises(ConfigError, match="--model.fused-proj false"):
        Trainer(tiny_config(corpus, **dict(extra, **{"model.fused_proj": "true"})), tmp_path / "r", resume=True)
    assert Trainer(tiny_config(corpus, **extra), tmp_path / "r", resume=True).step == 2


def test_gradient_accumulation_averages_micro_batch_gradients(corpus, tmp_path):
    cfg = tiny_config(corpus, **{"train.steps": "1", "data.batch_size": "2", "data.grad_accum": "3", "optim.grad_clip": "0"})
    tr = Trainer(cfg, tmp_path / "a")
    model = copy.deepcopy(tr.model)
    tr.train_step()
    # expected: mean of the three micro-batches' gradients, then one reference step
    for micro in range(3):
        x, y = tr.data.batch("train", cfg.data.seq_len, 2, seed=cfg.train.seed, step=0, micro=micro)
        (model(x.to(tr.device), y.to(tr.device)) / 3).backward()  # (the trainer's device: CUDA on a GPU)
    opt = lt.optim.Optimizer(model.parameters(), rule_from_config(cfg))
    torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    opt.step()
    for a, b in zip(tr.model.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_nonfinite_loss_stops_and_keeps_the_last_good_checkpoint(corpus, tmp_path, monkeypatch):
    cfg = tiny_config(corpus, **{"train.steps": "12", "train.ckpt_every": "5", "train.eval_every": "0"})
    tr = Trainer(cfg, tmp_path / "r")
    real_forward = tr.model.forward

    def poisoned(idx, targets=None, reduction="mean"):
        out = real_forward(idx, targets, reduction)
        return out * float("nan") if tr.step >= 7 else out

    monkeypatch.setattr(tr.model, "forward", poisoned)
    with pytest.raises(NonFiniteLoss, match="last good checkpoint"):
        tr.fit()
    assert checkpoint.latest(tmp_path / "r").name == "step_0000005"
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 8))  # every step before the non-finite one


def test_nonfinite_loss_skipped_when_asked(corpus, tmp_path, monkeypatch):
    """train.on_nonfinite=skip: the poisoned step is checked before its update (weights unchanged
    by it), logged as skipped, and training goes on."""
    cfg = tiny_config(corpus, **{"train.steps": "6", "train.ckpt_every": "0", "train.eval_every": "0",
                                 "train.on_nonfinite": "skip"})
    tr = Trainer(cfg, tmp_path / "r")
    real_forward = tr.model.forward
    seen = {}

    def poisoned(idx, targets=None, reduction="mean"):
        out = real_forward(idx, targets, reduction)
        if tr.step == 3:  # (step 4)
            seen["before"] = [p.detach().clone() for p in tr.model.parameters()]
            return out * float("nan")
        if tr.step == 4:
            seen["after"] = [p.detach().clone() for p in tr.model.parameters()]
        return out

    monkeypatch.setattr(tr.model, "forward", poisoned)
    s = tr.fit()
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert rows[3]["skipped"] is True and rows[3]["loss"] != rows[3]["loss"]
    assert all(r["loss"] == r["loss"] for i, r in enumerate(rows) if i != 3)
    assert all(torch.equal(a, b) for a, b in zip(seen["before"], seen["after"]))
    assert s["steps"] == 6


def test_cli_train_and_errors(corpus, tmp_path, capsys):
    args = ["train", "--preset", "tiny", "--steps", "4", "--out", str(tmp_path / "c"), "--data", str(corpus)]
    small = []
    from helpers import TINY_OVERRIDES

    for k, v in TINY_OVERRIDES.items():
        small += [f"--{k}", v]
    assert cli_main(args + small + ["--train.sample-tokens", "10"]) == 0
    assert "sample:" in capsys.readouterr().out
    assert cli_main(args + ["--model.widht", "3"]) == 2
    assert "valid keys of [model]" in capsys.readouterr().err
    assert cli_main(["train", "--out", str(tmp_path / "d"), "--data", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_compare_writes_a_report_with_ratios(corpus, tmp_path):
    from helpers import TINY_OVERRIDES

    small = []
    for k, v in TINY_OVERRIDES.items():
        small += [f"--{k}", v]
    rc = cli_main(["compare", "--steps", "3", "--out", str(tmp_path / "cmp"), "--data", str(corpus),
                   "--recipes", "baseline,reference"] + small)
    assert rc == 0
    report = (tmp_path / "cmp" / "report.md").read_text()
    assert "| baseline |" in report and "| reference |" in report and "1.00×" in report


def test_agoq_is_applied_once_and_replaced_for_another_policy(corpus, tmp_path):
    """The trainer applies AGoQ persistently at its first training forward (one packer, module
    hooks installed once); a different policy replaces it instead of stacking a second one."""
    from leantrain import agoq

    cfg = tiny_config(corpus, **{"train.steps": "2", "train.eval_every": "0", "train.ckpt_every": "0",
                                 "agoq.enabled": "true"})
    tr = Trainer(cfg, tmp_path / "a")
    tr.fit()
    tech = next(t for t in tr.techniques if t.name == "agoq")
    pk = tech.packer
    hooks = len(tr.model._forward_hooks) + len(tr.model._forward_pre_hooks)
    packed = pk.stats["packed"]
    assert pk.policy is tech.policy and packed > 0
    tr.train_step()
    assert tech.packer is pk and pk.stats["packed"] > packed
    tech.policy, tech.packer = agoq.Policy(qkv_in=8), None  # another policy: applied at the next forward
    tr.train_step()
    assert tech.packer is not pk and tech.packer.policy is tech.policy
    assert len(tr.model._forward_hooks) + len(tr.model._forward_pre_hooks) == hooks
    assert tech.packer._plans  # the training forward's plan, replayed by the next steps


def test_agoq_replay_can_be_turned_off(corpus, tmp_path):
    cfg = tiny_config(corpus, **{"train.steps": "2", "train.eval_every": "0", "train.ckpt_every": "0",
                                 "agoq.enabled": "true", "agoq.replay": "false"})
    tr = Trainer(cfg, tmp_path / "a")
    tr.fit()
    pk = lt.agoq.packer_of(tr.model)
    assert pk.stats["packed"] > 0 and not pk._plans and "replay:diverged" not in pk.stats


@pytest.mark.parametrize("recipe", ["baseline", "reference", "forge"])
def test_no_weight_decay_on_1d_parameters(corpus, tmp_path, recipe):
    """optim.decay_1d false: the norm weights (the tiny model's 1-D parameters) in a group without
    weight decay in every recipe's optimizer, the matrices at optim.weight_decay; a step trains.
    The sharded optimizer, which has no per-parameter decay, refuses it."""
    extra = {"optim.decay_1d": "false", "train.steps": "2", "train.eval_every": "0", "train.ckpt_every": "0",
             **({"forge.enabled": "true"} if recipe == "forge" else {})}
    t = Trainer(tiny_config(corpus, **extra), tmp_path / recipe, baseline=recipe == "baseline")
    flat = {id(p) for p in t.model.parameters() if p.dim() < 2}
    assert flat
    for g in t.opt.param_groups:
        kinds = {id(p) in flat for p in g["params"]}
        assert len(kinds) == 1  # a group holds only 1-D or only matrices
        assert g["weight_decay"] == (0.0 if kinds == {True} else t.cfg.optim.weight_decay)
    assert {id(p) for g in t.opt.param_groups if g["weight_decay"] == 0.0 for p in g["params"]} == flat
    norm = next(p for p in t.model.parameters() if p.dim() < 2)
    before = norm.detach().clone()
    t.fit()
    assert not torch.equal(norm, before)


def test_no_weight_decay_on_1d_refused_when_sharded(corpus, tmp_path):
    with pytest.raises(lt.config.ConfigError, match="decay_1d.*sharded"):
        Trainer(tiny_config(corpus, **{"optim.decay_1d": "false", "dist.mode": "sharded"}), tmp_path / "s")

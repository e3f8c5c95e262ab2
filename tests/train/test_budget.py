"""``--train.memory-budget``: the estimate against the ledger's counts of real runs, the plans it
picks, and its refusals."""

from __future__ import annotations

import json

import pytest

from helpers import tiny_config
from leantrain import config as C
from leantrain.cli import main as cli_main
from leantrain.config import ConfigError
from leantrain.train import budget
from leantrain.train.trainer import Trainer


def test_parse_bytes():
    assert budget.parse_bytes("24GB") == 24 * 10**9
    assert budget.parse_bytes("22.5 GiB") == int(22.5 * 2**30)
    assert budget.parse_bytes("512mib") == 512 * 2**20
    for bad in ("24", "GB", "24 apples", "-1GB"):
        with pytest.raises(ConfigError, match="memory_budget"):
            budget.parse_bytes(bad)


def _cfg(name: str, batch: int, seq: int, budget_text: str) -> C.Config:
    c = C.preset(name)
    c.data.batch_size, c.data.seq_len = batch, seq
    c.model.max_seq_len = max(c.model.max_seq_len, seq)
    c.train.memory_budget = budget_text
    return c


def test_plans_from_fastest_to_leanest():
    big = _cfg("1b", 8, 1024, "200GB")
    assert budget.fit(big, log=lambda *a: None) == "as given" and not big.forge.enabled
    one_b = _cfg("1b", 8, 1024, "20GB")
    assert budget.fit(one_b, log=lambda *a: None).startswith("FORGE")
    assert one_b.forge.enabled and one_b.train.weights == "bf16" and one_b.finetune.method == "full"
    seven = _cfg("7b", 1, 1024, "22GB")
    assert budget.fit(seven, log=lambda *a: None).startswith("ChunkFT + FORGE")
    assert seven.finetune.method == "chunkft" and seven.forge.enabled and seven.model.activation_checkpointing
    # each later plan needs less than the one before
    totals = [budget.estimate(budget._with(_cfg("7b", 1, 1024, "1GB"), f)).total for _, f in budget.plans(seven)]
    assert all(b <= a for a, b in zip(totals, totals[1:], strict=False)), totals
    with pytest.raises(ConfigError, match=r"leanest plan .* needs about [0-9.]+ GiB .*weights alone 12\.6 GiB"):
        budget.fit(_cfg("7b", 1, 1024, "12GiB"), log=lambda *a: None)
    fsdp = _cfg("1b", 8, 1024, "20GB")
    fsdp.dist.mode = "fsdp"
    with pytest.raises(ConfigError, match="dist.mode fsdp"):
        budget.fit(fsdp, log=lambda *a: None)


@pytest.mark.parametrize("recipe", [pytest.param("full", marks=pytest.mark.slow),
                                    pytest.param("forge", marks=pytest.mark.slow), "chunkft+forge"])
def test_estimate_against_the_ledger(corpus, tmp_path, recipe):
    """The estimate's parts against what a run's ledger counts (weights and state exactly as
    far as the formula goes; activations within a third)."""
    over = {"train.steps": "2", "train.eval_every": "0", "train.ckpt_every": "0", "data.batch_size": "4"}
    if recipe != "full":
        over.update({"forge.enabled": "true", "forge.backend": "torch"})
    if recipe == "chunkft+forge":
        over.update({"finetune.method": "chunkft", "finetune.num_chunks": "4"})
    cfg = tiny_config(corpus, **over)
    t = Trainer(cfg, tmp_path / recipe)
    t.fit()
    s = json.loads((tmp_path / recipe / "summary.json").read_text())
    cfg.model.vocab_size = cfg.data.tokenizer_vocab = t.model.cfg.vocab_size
    est, mem = budget.estimate(cfg), s["memory"]
    assert est.weights == mem["weights"]
    assert mem["activations"] / 1.35 < est.activations < mem["activations"] * 1.35
    if recipe == "chunkft+forge":
        held = s["method_bytes"]
        assert held * 0.8 < est.grads + est.states < held * 1.3
    else:
        assert est.states == pytest.approx(mem["optimizer_states"], rel=0.05)
        assert est.grads == pytest.approx(mem["grads"], rel=0.1, abs=0.02 * mem["weights"])


def test_finetune_with_a_budget(corpus, tmp_path, capsys):
    """The CLI applies the plan to the run's config and says which; an impossible budget is one
    sentence and exit status 2. (The tokenizer is trained on the test corpus, not the embedded one:
    the plan depends on the configured vocabulary's size, not on the text.)"""
    out = tmp_path / "run"
    assert cli_main(["finetune", "--task", "lookup", "--steps", "2", "--data.batch-size", "4",
                     "--finetune.eval-examples", "16", "--train.memory-budget", "40MB", "--train.progress", "false",
                     "--data.path", str(corpus), "--out", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["train"]["memory_budget"] == "40MB" and cfg["forge"]["enabled"]
    assert "memory budget" in capsys.readouterr().out
    assert cli_main(["finetune", "--task", "lookup", "--steps", "2", "--train.memory-budget", "1MB",
                     "--out", str(tmp_path / "no")]) == 2
    assert "leanest plan" in capsys.readouterr().err

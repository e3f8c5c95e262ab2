"""Policy: validation, the 1F1B stage rule, and calibration picking a cheap policy in budget."""

import pytest
import torch

from leantrain.agoq import ROLES, Policy, calibrate, gradient_error
from leantrain.config import AgoqConfig, ModelConfig
from leantrain.model import Llama


def test_stage_rule_balances_memory():
    pol = Policy(pipeline_stages=4, micro_batches=8)
    ks = [pol.in_flight(s) for s in range(4)]
    assert ks == [4, 3, 2, 1]  # min(p - s, m)
    bits = [pol.bits_for("qkv_in", s) for s in range(4)]
    assert bits == [2, 3, 4, 8]  # earlier stages: fewer bits
    held = [k * b for k, b in zip(ks, bits, strict=True)]
    assert max(held) / min(held) <= 9 / 8
    assert sum(bits) / 4 == pytest.approx(4.25)
    assert [pol.bits_for("attn", s) for s in range(4)] == [4, 4, 8, 8]  # an 8-bit role
    assert pol.bits_for("mask", 0) == 1
    assert Policy().bits_for("qkv_in", 0) == 4
    few = Policy(pipeline_stages=4, micro_batches=2)  # m < p: k = 2, 2, 2, 1
    assert [few.in_flight(s) for s in range(4)] == [2, 2, 2, 1]


def test_policy_validation_and_config():
    with pytest.raises(ValueError, match="bits must be one of"):
        Policy(qkv_in=5)
    with pytest.raises(ValueError, match="group_size"):
        Policy(group_size=100)
    pol = Policy.from_config(AgoqConfig(bits=8, group_size=64, pipeline_stages=2))
    assert pol.qkv_in == 8 and pol.group_size == 64 and pol.pipeline_stages == 2


@pytest.mark.slow
def test_calibrate_meets_budget_and_saves_bits():
    cfg = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64)
    torch.manual_seed(0)
    m = Llama(cfg)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 256, (4, 64), generator=g), torch.randint(0, 256, (4, 64), generator=g))]
    budget = 0.1
    pol, rep = calibrate(m, batches, candidate_bits=(2, 3, 4, 8), error_budget=budget, return_report=True)
    assert rep["measured_error"] <= budget
    assert set(rep["chosen"]) <= set(ROLES)
    assert rep["average_bits"] < 8  # cheaper than 8 bits everywhere
    # derived saves (the default derive) hold nothing: counted at 0 bits, apart (the default model's
    # fused SwiGLU saves no silu(g): only the down projection's input is derived)
    assert set(rep["derived_numel"]) == {"down_in"}
    stored = sum(rep["numel"].values())
    by_width = sum(rep["numel"][r] * b for r, b in rep["chosen"].items())
    assert rep["average_bits"] == pytest.approx(by_width / (stored + sum(rep["derived_numel"].values())))
    assert gradient_error(m, batches, pol)["total"] <= budget * 1.05  # re-measured independently
    for r, errs in rep["errors"].items():  # more bits, less error
        assert errs[8] <= errs[2], (r, errs)

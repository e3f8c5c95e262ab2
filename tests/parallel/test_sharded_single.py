"""ShardedOptimizer in one process (no process group): the torch.optim contract."""

from __future__ import annotations

import copy

import pytest
import torch

import leantrain as lt


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.GELU(), torch.nn.Linear(33, 7))


def _steps(model, opt, n, sched=None):
    for s in range(n):
        g = torch.Generator().manual_seed(s)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 7, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


@pytest.mark.parametrize("rule", [lt.optim.AdamW(lr=1e-2, weight_decay=0.1), lt.optim.Lion(lr=1e-3),
                                  lt.optim.SGD(lr=0.1, momentum=0.9, nesterov=True), lt.optim.AdamS(lr=1e-2)])
def test_single_process_equals_reference_bitwise(rule):
    """The rule is element-wise, so flat buckets give exactly the per-parameter result."""
    m1, m2 = _model(), _model()
    o1 = lt.dist.ShardedOptimizer(m1, rule, bucket_mb=0.001)
    o2 = lt.optim.Optimizer(m2.parameters(), rule)
    s1 = torch.optim.lr_scheduler.LambdaLR(o1, lambda s: 1.0 / (1 + s))
    s2 = torch.optim.lr_scheduler.LambdaLR(o2, lambda s: 1.0 / (1 + s))
    _steps(m1, o1, 5, s1)
    _steps(m2, o2, 5, s2)
    assert len(o1.buckets) > 1
    for a, b in zip(m1.parameters(), m2.parameters(), strict=True):
        assert torch.equal(a, b)
    assert o1.param_groups[0]["lr"] == o2.param_groups[0]["lr"]


def test_state_dict_round_trip_and_memory_ledger():
    m = _model()
    o = lt.dist.ShardedOptimizer(m, lt.optim.AdamW(lr=1e-2))
    _steps(m, o, 3)
    sd = copy.deepcopy(o.state_dict())
    msd = copy.deepcopy(m.state_dict())
    _steps(m, o, 2)
    after = [p.clone() for p in m.parameters()]
    m2 = _model()
    m2.load_state_dict(msd)
    o2 = lt.dist.ShardedOptimizer(m2, lt.optim.AdamW(lr=1e-2))
    o2.load_state_dict(sd)
    _steps(m2, o2, 2)
    assert all(torch.equal(a, b) for a, b in zip(after, m2.parameters(), strict=True))
    led = lt.runtime.ledger.MemoryLedger.measure(m2, o2)
    n = sum(p.numel() for p in m2.parameters())
    assert led.optimizer_states >= 3 * 4 * n  # master + exp_avg + exp_avg_sq, fp32
    bad = copy.deepcopy(sd)
    bad["layout"]["world_size"] = 2
    with pytest.raises(ValueError, match="load_consolidated"):
        o2.load_state_dict(bad)


def test_rejects_bad_arguments():
    with pytest.raises(TypeError, match="rule"):
        lt.dist.ShardedOptimizer(_model(), torch.optim.SGD)
    with pytest.raises(ValueError, match="no trainable"):
        lt.dist.ShardedOptimizer([], lt.optim.SGD(lr=0.1))

"""FORGE on 2 gloo ranks: tensor/sequence parallel = the unsharded update; data parallel = one process."""

from __future__ import annotations

import copy

import pytest
import torch
from _forge_util import RULES, Net, max_rel

from dist_utils import run_distributed

pytestmark = pytest.mark.distributed

STEPS = 3


class FullMLP(torch.nn.Module):
    def __init__(self, k=24, h=32, n=20):
        super().__init__()
        self.norm = torch.nn.LayerNorm(k)
        self.fc1 = torch.nn.Linear(k, h)
        self.fc2 = torch.nn.Linear(h, n)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class TPMLP(torch.nn.Module):
    def __init__(self, full: FullMLP, sp: bool):
        super().__init__()
        from leantrain.parallel import tp

        self.norm = copy.deepcopy(full.norm)
        if sp:
            tp.mark_sequence_parallel(self.norm.weight)
            tp.mark_sequence_parallel(self.norm.bias)
        self.fc1 = tp.ColumnParallelLinear.from_linear(full.fc1, sequence_parallel=sp)
        self.fc2 = tp.RowParallelLinear.from_linear(full.fc2, sequence_parallel=sp)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


def _data(steps):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 2, 24, generator=g), torch.randn(8, 2, 20, generator=g)) for _ in range(steps)]


def _tp_worker(rank, world, sp):
    import leantrain as lt
    from leantrain.parallel import tp

    torch.manual_seed(0)
    full = FullMLP()
    ref = copy.deepcopy(full)
    model = TPMLP(full, sp)
    opt = lt.forge.attach(model, RULES["adamw"](), backend="torch")
    assert opt.dp_group is None and len(opt.layers) == 2 and opt.layers[1].bias is None
    ropt = lt.forge.attach(ref, RULES["adamw"](), backend="torch", dp_group=False)
    for x, r in _data(STEPS):
        (ref(x) * r).sum().backward()
        ropt.step()
        ropt.zero_grad()
        xl = tp.split_sequence(x) if sp else x
        rl = tp.split_sequence(r) if sp else r
        (model(xl) * rl).sum().backward()
        opt.step()
        opt.zero_grad()
    n = world
    errs = {
        "fc1.weight": max_rel(model.fc1.weight, ref.fc1.weight.chunk(n, 0)[rank]),
        "fc1.bias": max_rel(model.fc1.bias, ref.fc1.bias.chunk(n, 0)[rank]),
        "fc2.weight": max_rel(model.fc2.weight, ref.fc2.weight.chunk(n, 1)[rank]),
        "fc2.bias": max_rel(model.fc2.bias, ref.fc2.bias),
        "norm.weight": max_rel(model.norm.weight, ref.norm.weight),
        "norm.bias": max_rel(model.norm.bias, ref.norm.bias),
    }
    return errs


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_tensor_parallel_equals_unsharded(sp):
    for errs in run_distributed(_tp_worker, 2, (sp,)):
        for name, e in errs.items():
            assert e <= 1e-6, (name, e)


def _dp_worker(rank, world):
    import leantrain as lt
    from leantrain.runtime.ledger import COMM

    torch.manual_seed(0)
    model = Net()
    opt = lt.forge.attach(model, RULES["adamw"](), backend="torch")
    assert opt.dp_group is not None
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(4, 12, 33, generator=g) for _ in range(STEPS)]
    COMM.reset()
    with COMM.capture() as led:
        for x in data:
            model(x.chunk(world)[rank]).square().mean().backward()
            opt.step()
            opt.zero_grad()
    # numpy: pickled by value (tensors would travel as shared memory of a process that exits)
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}, dict(led.calls)


def test_data_parallel_equals_single_process():
    import leantrain as lt

    torch.manual_seed(0)
    ref = Net()
    opt = lt.forge.attach(ref, RULES["adamw"](), backend="torch")
    g = torch.Generator().manual_seed(1)
    for x in [torch.randn(4, 12, 33, generator=g) for _ in range(STEPS)]:
        ref(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    for sd, calls in run_distributed(_dp_worker, 2):
        for k, v in ref.state_dict().items():
            assert max_rel(torch.from_numpy(sd[k]), v) <= 1e-6, k
        # one all-reduce per fused layer (fc1, fc2) + one for the non-linear grads, per step
        assert calls[("all_reduce", "world")] == 3 * STEPS

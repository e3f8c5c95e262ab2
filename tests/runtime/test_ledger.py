import torch
import torch.distributed as dist

import leantrain as lt
from dist_utils import run_distributed
from leantrain.runtime import collectives
from leantrain.runtime.ledger import COMM, MemoryLedger, SavedActivationMeter


def test_memory_ledger_counts_each_role_once():
    m = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))
    opt = lt.optim.Optimizer(m.parameters(), lt.optim.AdamW(lr=1e-3))
    m(torch.randn(4, 64)).sum().backward()
    opt.step()
    led = MemoryLedger.measure(m, opt)
    nbytes = sum(p.numel() * 4 for p in m.parameters())
    assert led.weights == nbytes and led.grads == nbytes and led.optimizer_states == 2 * nbytes


def test_activation_meter_counts_saved_tensors_and_skips_parameters():
    lin = torch.nn.Linear(64, 64, bias=False)
    x = torch.randn(16, 64, requires_grad=True)
    with SavedActivationMeter(lin.parameters()) as meter:
        y = torch.relu(lin(x))
    # linear saves x (its weight is a parameter: skipped); relu saves its output
    assert meter.bytes == x.numel() * 4 + y.numel() * 4
    y.sum().backward()


def test_activation_meter_dedupes_a_tensor_saved_twice():
    x = torch.randn(32, 32, requires_grad=True)
    with SavedActivationMeter() as meter:
        y = x * x  # mul saves x twice
    assert meter.bytes == x.numel() * 4
    y.sum().backward()


def _comm_worker(rank, world):
    COMM.reset()
    t = torch.ones(1000)
    collectives.all_reduce(t)
    out = torch.empty(1000 // world)
    collectives.reduce_scatter_tensor(out, torch.ones(1000))
    full = torch.empty(1000)
    collectives.all_gather_into_tensor(full, torch.ones(1000 // world), scope="intra")
    a2a = torch.empty(1000, dtype=torch.uint8)
    collectives.all_to_all_single(a2a, torch.ones(1000, dtype=torch.uint8), scope="inter")
    return t[0].item(), COMM.by_op(), COMM.by_scope(), dist.get_world_size()


def test_comm_ledger_counts_bytes_sent_per_collective():
    for world in (2, 4):
        res = run_distributed(_comm_worker, world)
        for total, by_op, by_scope, n in res:
            assert total == n
            assert by_op["all_reduce"] == 2 * (n - 1) * 4000 // n
            assert by_op["reduce_scatter"] == (n - 1) * 4000 // n
            assert by_op["all_gather"] == (n - 1) * (4000 // n)
            assert by_op["all_to_all"] == 1000 - 1000 // n
            assert by_scope["intra"] == by_op["all_gather"] and by_scope["inter"] == by_op["all_to_all"]


def test_collectives_are_local_noops_without_a_process_group():
    COMM.reset()
    t = torch.ones(10)
    collectives.all_reduce(t)
    assert COMM.total == 0 and t.sum() == 10

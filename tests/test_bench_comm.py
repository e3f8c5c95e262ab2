"""bench_comm.py scape-cost on CPU: SCAPE's step as rank 0 of a larger world with the collectives replaced by
local copies; the collectives and the topology are the library's own again afterwards."""

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_scape_cost_times_dense_and_sparse_steps_and_restores_the_collectives(tmp_path):
    from parts import scape_cost

    from leantrain.parallel import sharded
    from leantrain.runtime import collectives as C

    before = (C.reduce_scatter_tensor, C.all_gather_into_tensor, C.all_reduce, C.broadcast, sharded.get_topology)
    had_group = torch.distributed.is_initialized()  # (an earlier test of this file may have left one)
    assert scape_cost.main(["--params", "40000", "--tensor", "10000", "--world", "4", "--intra", "2", "--reps", "1",
                            "--warmup", "2", "--bucket-mb", "0.05", "1", "--out", str(tmp_path)]) == 0
    assert before == (C.reduce_scatter_tensor, C.all_gather_into_tensor, C.all_reduce, C.broadcast, sharded.get_topology)
    (path,) = tmp_path.glob("*_scape-cost.json")
    res = json.loads(path.read_text())
    assert res["world"] == 4 and res["params"] == 40000 and set(res["runs"]) == {"0.05", "1"}
    small, big = res["runs"]["0.05"], res["runs"]["1"]
    assert set(small) == {"dense", "scape-90", "scape-99"}
    assert small["dense"]["buckets"] == 4 and big["dense"]["buckets"] == 1  # (a tensor a bucket, or all in one)
    assert all("extra_ms" in r for k, r in small.items() if k != "dense")
    assert (tmp_path / path.name.replace(".json", ".md")).read_text().count("| scape-") == 4
    assert torch.distributed.is_initialized() == had_group


def test_gift_cost_times_the_host_and_the_queued_device_and_tables_them():
    import time

    from parts import gift_cost

    cpu = torch.device("cpu")
    assert gift_cost.host_time(lambda: time.sleep(0.01), 3, cpu) >= 0.009
    assert gift_cost.queued_time(lambda: time.sleep(0.01), 3, cpu) >= 0.009  # (wall time off CUDA)
    row = {"ms": 2.0, "whitened_layers": 4, "of_plain_step": 0.2, "queued_ms": 1.5, "queued_of_plain_step": 0.15,
           "host_issue_ms": 0.5}
    res = {"gift_transforms": {"stat_tokens": 64, "min_gain": {"0": {dt: row for dt in gift_cost.TRANSFORM_DTYPES}}},
           "step_ms": {"plain": 10.0}, "step_host_issue_ms": 7.0}
    table = "\n".join(gift_cost.gift_transforms_table(res))
    assert "| 0 | 1.50 (15.0%) | 0.50 |" in table and "host issues its launches in 7.00 ms" in table
    del row["queued_ms"]  # (a file made before the queued timing: the first table alone)
    assert "queued" not in "\n".join(gift_cost.gift_transforms_table(res))


def test_gift_cost_times_the_batched_thin_products_and_tables_the_stacks_copies():
    """One layer's thin products alone and batched over a shape's layers, timed (wall time off CUDA); the
    stacks' copy in and out tabled beside the transforms a step."""
    from types import SimpleNamespace

    from parts import gift_cost

    from leantrain.comm.gift_transforms import _Side

    g = torch.Generator().manual_seed(0)
    n, k, r = 32, 16, 4

    def side(dim):
        u, _ = torch.linalg.qr(torch.randn(dim, r, generator=g))
        return _Side(u, torch.rand(r, generator=g) + 1, 0.5, 1e-3)

    times = gift_cost.thin_products_device_time(side(k), side(n), torch.randn(n, k, generator=g),
                                                torch.randn(n, 2 * r), torch.randn(2 * r, k), 3,
                                                SimpleNamespace(reps=1), torch.device("cpu"))
    assert list(times["float32"]) == ["P+Q one layer", "P+Q batched over 3, a layer's share", "final"]
    assert all(v > 0 for d in times.values() for v in d.values())
    row = {"ms": 2.0, "whitened_layers": 4, "chunks": 2, "of_plain_step": 0.2, "queued_ms": 1.5,
           "queued_of_plain_step": 0.15, "host_issue_ms": 0.5, "stack_copies_queued_ms": 0.25}
    res = {"gift_transforms": {"stat_tokens": 64, "min_gain": {"1.2": {dt: row for dt in gift_cost.TRANSFORM_DTYPES}}},
           "step_ms": {"plain": 10.0}}
    table = "\n".join(gift_cost.gift_transforms_table(res))
    assert "min_gain 1.2: 0.25 (2 stacks)" in table

"""The process groups a run made are gone, gloo's threads with them, once the command has closed them.

A gloo group that outlives ``destroy_process_group`` keeps its worker threads until the
interpreter exits, and a worker that drops its last tensor while Python shuts down aborts the
rank ("terminate called without an active exception") after a run that succeeded.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")

# one gloo group (this process alone), a step of DDP or FSDP through it, the command's own close,
# then the names of the threads left in the process
_RUN = """
import os, sys
sys.path.insert(0, sys.argv[1])
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from leantrain.runtime import distributed


def step(wrap):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    if wrap == "ddp":
        model = DDP(model)
    else:
        from torch.distributed.fsdp import fully_shard

        mesh = distributed.device_mesh("cpu", (1,), ("shard",))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model(torch.ones(3, 4)).sum().backward()


distributed.ensure_group(torch.device("cpu"))
step(sys.argv[2])
distributed.close(True)
print(" ".join(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads thread names from /proc")
@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_closing_the_group_ends_gloo_threads(wrap):
    r = subprocess.run([sys.executable, "-c", _RUN, SRC, wrap], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    threads = r.stdout.split()
    assert threads and "pt_gloo_runloop" not in threads, threads

"""The process group a run made is gone, gloo's threads with it, once the command has closed it.

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

# one gloo group (this process alone), a DDP step through it, the command's own close, then
# the names of the threads left in the process
_RUN = """
import os, sys
sys.path.insert(0, sys.argv[1])
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from leantrain import cli
from leantrain.runtime import distributed

distributed.ensure_group(torch.device("cpu"))
model = DDP(torch.nn.Linear(4, 2))
model(torch.ones(3, 4)).sum().backward()
del model
cli._close_process_group(True)
print(" ".join(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads thread names from /proc")
def test_closing_the_group_ends_gloo_threads_after_ddp():
    r = subprocess.run([sys.executable, "-c", _RUN, SRC], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    threads = r.stdout.split()
    assert threads and "pt_gloo_runloop" not in threads, threads

"""The NCCL/CUDA run of the sharded optimizer: ``torchrun_smoke.py`` on 2-4 GPUs (GPU machine only)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.gpu
@pytest.mark.distributed
def test_torchrun_nccl_smoke():
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        pytest.skip("needs at least 2 CUDA devices")
    env = {**os.environ, "PYTHONPATH": os.path.join(HERE, "..", "..", "src")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={min(n, 4)}",
           os.path.join(HERE, "torchrun_smoke.py")]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr

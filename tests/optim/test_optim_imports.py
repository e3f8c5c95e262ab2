"""The reference optimizer and the ops never depend on FORGE (the update kernel they share lives in ops/)."""

import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_ops_and_optim_do_not_import_forge():
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import leantrain.optim, leantrain.ops, "
            "leantrain.ops.update, leantrain.ops.update_launch, leantrain.optim.optimizer; "
            "bad = [m for m in sys.modules if m.startswith('leantrain.forge')]; assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code, SRC], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]

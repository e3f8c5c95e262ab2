import os
import platform
import sys
from collections import Counter

# Triton kernels run on CPU through the interpreter in the test suite (set before triton loads).
# On the GPU machine, LEANTRAIN_TEST_GPU=1 runs them compiled (benchmarks/gpu.sh sets it).
if os.environ.get("LEANTRAIN_TEST_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # The interpreter's tl.dot is numpy's matmul. Where OpenBLAS picks an FMA kernel (Haswell, Zen)
    # the rounding of one output element can depend on the tile's width, and the tests that compare
    # two tilings of the same kernel bit for bit would fail on some hosts and pass on others: the
    # AVX kernel without FMA (every x86-64 CPU since 2011) rounds a dot product the same at any width.
    # (Read when numpy loads OpenBLAS: before anything imports numpy.)
    if "numpy" not in sys.modules and platform.machine() in ("x86_64", "AMD64"):
        os.environ.setdefault("OPENBLAS_CORETYPE", "Sandybridge")

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "src"))

import pytest  # noqa: E402

import interp_speed  # noqa: E402,F401  (the interpreter patches triton.language once a launch)


def pytest_addoption(parser):
    parser.addoption("--grid-out", default=None, help="tests/test_grid.py: write the compatibility grid to this file")


def pytest_configure(config):
    """Under ``--dist loadfile`` xdist hands out whole files in the collection's order, which
    :func:`pytest_collection_modifyitems` sets, instead of re-sorting them by their number of tests
    (its ``--loadscope-reorder``): that sort starts a long file of one test (the compatibility grid)
    last, while the other worker has nothing left to run."""
    if getattr(config.option, "dist", "no") in ("loadfile", "loadscope"):
        config.option.loadscopereorder = False


@pytest.hookimpl(trylast=True)  # (after the -m selection)
def pytest_collection_modifyitems(config, items):
    """Files with the most ``slow`` tests first, then those with the most tests (xdist's own order),
    so that the last files handed out to the workers are short. A stable sort: a file's tests stay
    together and in their order."""
    slow, tests = Counter(), Counter()
    for item in items:
        tests[item.path] += 1
        slow[item.path] += item.get_closest_marker("slow") is not None
    items.sort(key=lambda item: (-slow[item.path], -tests[item.path]))


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Tokenizers and token caches of tests go to one temporary directory per session, shared by the
    session's xdist workers (each a directory of its own under the session's: the parent): a corpus
    is tokenized once, not once a worker. The cache's files are written under a name of their
    process and renamed into place, so workers filling it at once do not collide. Session-scoped,
    so that module-scoped fixtures (a run shared by a file's tests) use it too."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LEANTRAIN_CACHE", str(base / "cache"))
        yield


@pytest.fixture(scope="module", autouse=True)
def _no_process_group_across_files():
    """A process group that a file's tests left in this process (a run of one process under FSDP makes
    one, :func:`leantrain.runtime.distributed.ensure_group`) is closed after the file: the next file
    on this worker starts without one, as it would alone."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from leantrain.runtime import distributed

        distributed.close(together=False)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    from helpers import write_corpus

    return write_corpus(tmp_path_factory.mktemp("data"))

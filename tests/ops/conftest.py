"""Shared set-up of the ops tests.

On a machine without CUDA the Triton kernels run through the Triton interpreter. Triton
decides interpreter-or-compiler when a kernel is *defined* (at import of leantrain.ops), so
TRITON_INTERPRET must be set before anything imports leantrain.ops or triton: here, at the
top of the first conftest that pytest loads for this folder.
"""

import os

import torch

if not torch.cuda.is_available():  # tests/conftest.py also does this, unless LEANTRAIN_TEST_GPU=1
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from _opslib import DEVICE, triton_runnable  # noqa: E402


@pytest.fixture(params=["torch", "triton"])
def backend(request):
    if request.param == "triton" and not triton_runnable():
        pytest.skip("Triton kernels were built without the interpreter and no CUDA is present")
    return request.param


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)

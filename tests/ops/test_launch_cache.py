"""ops.launch's direct-call cache, with a stand-in for a JIT kernel (runs without a GPU)."""

import pytest
import torch

from leantrain.ops import _backend


class _Compiled:
    """What Triton returns from ``kernel[grid](...)``: callable per grid, with a signature."""

    def __init__(self, names, calls, fail=False):
        self.src = type("Src", (), {"signature": dict.fromkeys(names)})()
        self.calls, self.fail = calls, fail

    def __getitem__(self, grid):
        def run(*args):
            if self.fail:
                raise TypeError("launcher takes other arguments")
            self.calls.append(("direct", grid, args))
        return run


class _Kernel:
    arg_names = ["x_ptr", "n", "key", "BLOCK", "MODE"]

    def __init__(self, fail=False):
        self.calls, self.fail = [], fail

    def __getitem__(self, grid):
        def run(*args, **meta):
            self.calls.append(("jit", grid, args, meta))
            return _Compiled(self.arg_names, self.calls, self.fail)
        return run


@pytest.fixture
def direct(monkeypatch):
    monkeypatch.setattr(_backend, "_DIRECT", [True])
    monkeypatch.setattr(_backend, "_FAST", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_second_launch_calls_the_compiled_kernel_with_constexprs_in_signature_order(direct):
    k = _Kernel()
    x = torch.zeros(64)
    _backend.launch(k, (4,), x, 64, 7, MODE=2, BLOCK=16, num_warps=4)
    _backend.launch(k, (5,), x, 64, 9, MODE=2, BLOCK=16, num_warps=4)
    assert k.calls[0][0] == "jit" and k.calls[0][3]["enable_fp_fusion"] is False
    kind, grid, args = k.calls[1]
    assert kind == "direct" and grid == (5, 1, 1) and args == (x, 64, 9, 16, 2)  # BLOCK before MODE


def test_a_new_specialization_goes_through_the_jit_again(direct):
    k = _Kernel()
    x = torch.zeros(64)
    _backend.launch(k, (1,), x, 64, 0, MODE=2, BLOCK=16)
    _backend.launch(k, (1,), x, 1, 0, MODE=2, BLOCK=16)  # n == 1: Triton specializes on it
    _backend.launch(k, (1,), x[1:], 64, 0, MODE=2, BLOCK=16)  # a pointer not 16-byte aligned
    _backend.launch(k, (1,), x, 64, 0, MODE=3, BLOCK=16)  # another constexpr
    assert [c[0] for c in k.calls] == ["jit"] * 4


def test_a_failing_direct_call_turns_the_fast_path_off(direct):
    k = _Kernel(fail=True)
    x = torch.zeros(64)
    _backend.launch(k, (1,), x, 64, 0, MODE=2, BLOCK=16)
    _backend.launch(k, (1,), x, 64, 0, MODE=2, BLOCK=16)  # direct call raises: JIT path, fast path off
    assert _backend._DIRECT[0] is False and [c[0] for c in k.calls] == ["jit", "jit"]
    assert not _backend._FAST

"""The update epilogue's e4m3 conversions (``ops.update._fp8_encode`` / ``_fp8_decode``, the
``"fp8"`` state kind) against torch's ``.to(torch.float8_e4m3fn)`` bit for bit.

Both paths of the helpers: the integer ops (``NATIVE`` 0 or 1: what the interpreter runs, whose own
fp32 -> fp8 cast is not round-to-nearest-even at every binade, e.g. -125.37 -> -64) and, compiled
on a GPU, the hardware's ``cvt`` (``NATIVE`` 2, the ``gpu`` tests). Inputs: every finite e4m3
value and its negation, every midpoint between neighbours (ties, to even), the values one fp32 ulp
either side of each midpoint, binade boundaries, subnormals of e4m3 and of fp32, 0 and -0, and
random points, all within the epilogue's range ``|y| <= 448 (1 + 2**-23)``.
"""

from __future__ import annotations

import pytest
import torch

from leantrain.ops._backend import HAS_TRITON, interpreting

pytestmark = pytest.mark.skipif(not (HAS_TRITON and (interpreting() or torch.cuda.is_available())),
                                reason="needs Triton (interpreter or CUDA)")

if HAS_TRITON:
    import triton
    import triton.language as tl

    from leantrain.ops.update import _fp8_decode, _fp8_encode

    @triton.jit
    def _roundtrip_kernel(x_ptr, code_ptr, back_ptr, n, NATIVE: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        code = _fp8_encode(tl.load(x_ptr + offs, mask=m, other=0.0), NATIVE)
        tl.store(code_ptr + offs, code, mask=m)
        tl.store(back_ptr + offs, _fp8_decode(tl.load(code_ptr + offs, mask=m, other=0), NATIVE), mask=m)


def _every_class() -> torch.Tensor:
    vals = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    vals = vals[torch.isfinite(vals)].unique()  # (both signs: the codes 0x80.. are the negatives)
    mids = (vals[1:] + vals[:-1]) / 2  # ties: exact in fp32
    up, down = torch.nextafter(mids, torch.tensor(float("inf"))), torch.nextafter(mids, torch.tensor(-float("inf")))
    binades = torch.tensor([2.0**e for e in range(-9, 9)])
    g = torch.Generator().manual_seed(0)
    special = torch.tensor([0.0, -0.0, -125.37, 125.37, 448.0, -448.0, 448.0 * (1 + 2**-23), -448.0 * (1 + 2**-23),
                            464.0 - 2**-15, 1e-30, -1e-30, 1e-40, -1e-40, 2.0**-10, 3 * 2.0**-11, 2.0**-149])
    x = torch.cat([vals, mids, up, down, binades, -binades, torch.nextafter(binades, torch.zeros(())), special,
                   torch.randn(4000, generator=g) * 60, torch.randn(1000, generator=g) * 2.0**-7])
    return x[x.abs() <= 448.0 * (1 + 2**-23)]


def _check(native: int, device: str) -> None:
    x = _every_class().to(device)
    code = torch.empty(x.shape, dtype=torch.uint8, device=device)
    back = torch.empty(x.shape, dtype=torch.float32, device=device)
    _roundtrip_kernel[(triton.cdiv(x.numel(), 1024),)](x, code, back, x.numel(), NATIVE=native, BLOCK=1024)
    want = x.cpu().to(torch.float8_e4m3fn)
    assert torch.equal(code.cpu(), want.view(torch.uint8))  # (-0 -> 0x80, ties to even, subnormals)
    assert torch.equal(back.cpu().view(torch.int32), want.float().view(torch.int32))  # exact, -0 kept


@pytest.mark.skipif(not interpreting(), reason="the interpreter's path")
def test_integer_encode_equals_torch_cast_on_every_class():
    _check(0, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(interpreting() or not torch.cuda.is_available(), reason="needs CUDA, compiled")
@pytest.mark.parametrize("native", [2, 1])
def test_compiled_encode_equals_torch_cast_on_every_class(native):
    """On the GPU: the hardware ``cvt.rn.satfinite.e4m3x2.f32`` (``NATIVE`` 2, sm_89 and newer) and the
    integer ops (1: what a GPU without e4m3 conversions runs)."""
    if native == 2 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no e4m3 conversions before sm_89")
    _check(native, "cuda")

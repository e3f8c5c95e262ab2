"""State storage (fp32 / bf16 / 8-bit) and the reference Optimizer's ``state_dtype``."""

from __future__ import annotations

import pytest
import torch

import leantrain as lt
from leantrain.optim.state import StateStorage, dequantize8, quantize8


@pytest.mark.parametrize("shape", [(127, 65), (1, 4097), (4097,), (3, 5, 300)])
@pytest.mark.parametrize("signed", [True, False])
def test_quantize8_round_trip(shape, signed):
    x = torch.randn(shape)
    x = x if signed else x.abs()
    codes, absmax = quantize8(x, signed)
    assert codes.dtype == torch.uint8
    if len(shape) == 2:  # 16 x 16 tiles, block-major
        assert codes.shape == (-(-shape[0] // 16), -(-shape[1] // 16), 16, 16)
    y = dequantize8(codes, absmax, signed, x.shape)
    assert y.shape == x.shape
    # dynamic map: at most ~1.4 % of the block absmax near 1 (coarsest step / 2)
    assert ((y - x).abs() <= 0.0075 * x.abs().max() + 1e-12).all()
    assert 10 * torch.log10(x.square().sum() / (y - x).square().sum()) > 35  # SQNR (dB)


def test_tile_blocks_are_local():
    """A 2-D block is a 16 x 16 tile: one large value only affects its own tile's codes."""
    x = torch.randn(32, 32) * 0.01
    x[0, 0] = 100.0
    codes, absmax = quantize8(x, True)
    assert absmax[0, 0] == 100.0 and (absmax.flatten()[1:] < 1).all()


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_reference_optimizer_state_dtype(state_dtype):
    torch.manual_seed(0)
    lin32, linq = torch.nn.Linear(80, 64), torch.nn.Linear(80, 64)
    linq.load_state_dict(lin32.state_dict())
    o32 = lt.optim.Optimizer(lin32.parameters(), lt.optim.AdamW(lr=1e-2))
    oq = lt.optim.Optimizer(linq.parameters(), lt.optim.AdamW(lr=1e-2), state_dtype=state_dtype)
    w0 = lin32.weight.detach().clone()
    for _ in range(10):
        x = torch.randn(16, 80)
        for m, o in ((lin32, o32), (linq, oq)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    kind = StateStorage.kind_of(oq.state[linq.weight], "exp_avg")
    assert kind == state_dtype
    assert StateStorage.kind_of(oq.state[linq.bias], "exp_avg") == ("fp32" if state_dtype == "int8" else "bf16")
    assert (linq.weight - lin32.weight).norm() / (lin32.weight - w0).norm() < 0.05


def test_bad_state_dtype():
    with pytest.raises(ValueError, match="state_dtype must be one of"):
        StateStorage("fp8")

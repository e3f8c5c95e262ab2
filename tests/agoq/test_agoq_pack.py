"""Packing: unpack(pack(x)) restores shape/dtype/device; error within the SQNR floor of each
bit-width (and of each role's default width); masks exact; stochastic rounding unbiased."""

import pytest
import torch

from leantrain.agoq import ROLES, Policy, pack, unpack

# SQNR floors (dB) on Gaussian data, group 128, absmax (sym) / min-max (asym) scaling.
# Theory for round-to-nearest: ~6.02 b - 10 dB at group 128; stochastic rounding ~3 dB lower.
# Measured here (fp32, 2**20 elements): RTN 43.8/18.6/13.4/6.0, SR 40.8/15.6/10.4/3.0 dB for
# 8/4/3/2 bits; the floors leave ~1-3 dB of margin.
FLOOR_RTN = {8: 41.0, 4: 17.0, 3: 12.0, 2: 5.0}
FLOOR_SR = {8: 38.0, 4: 14.0, 3: 9.0, 2: 2.0}


def sqnr(x, y):
    x, y = x.float(), y.float()
    return 10 * torch.log10(x.pow(2).mean() / (x - y).pow(2).mean().clamp_min(1e-30)).item()


@pytest.mark.parametrize("bits", [8, 4, 3, 2])
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sqnr_floor(bits, stochastic, dtype):
    x = torch.randn(64, 4096, generator=torch.Generator().manual_seed(bits)).to(dtype)
    p = pack(x, bits, stochastic=stochastic, seed=3)
    y = unpack(p)
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    floor = (FLOOR_SR if stochastic else FLOOR_RTN)[bits]
    assert sqnr(x, y) >= floor
    per_elem = p.nbytes / x.numel()
    zero = 0 if bits in (8, 4) else 4 / 128  # 2/3 bits keep a zero point per group
    assert per_elem == pytest.approx(bits / 8 + 4 / 128 + zero, rel=1e-6)


@pytest.mark.parametrize("shape", [(1,), (127,), (4097,), (3, 5, 7), (2, 1, 129)])
@pytest.mark.parametrize("bits", [8, 4, 3, 2])
def test_odd_shapes_roundtrip(shape, bits):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    y = unpack(pack(x, bits, group_size=64, stochastic=True, seed=1))
    assert y.shape == x.shape and y.dtype == x.dtype
    step = x.abs().max() * (2 / (2**bits - 1))  # coarsest possible grid (asym, full range)
    assert (y - x).abs().max() <= step + 1e-6


def test_non_contiguous_view():
    base = torch.randn(8, 16, 64)
    x = base.transpose(1, 2)[..., :10]
    y = unpack(pack(x, 8, stochastic=False))
    assert y.shape == x.shape
    assert sqnr(x, y) >= FLOOR_RTN[8]


def test_bool_mask_is_one_bit_exact():
    m = torch.rand(3, 1001, generator=torch.Generator().manual_seed(0)) > 0.3
    p = pack(m, 1)
    assert p.nbytes == -(-m.numel() // 8)
    assert torch.equal(unpack(p), m)


@pytest.mark.parametrize("bits", [4, 2])
def test_stochastic_rounding_unbiased(bits):
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(0))
    mean = sum(unpack(pack(x, bits, stochastic=True, seed=s)) for s in range(400)) / 400
    step = (x.abs().amax() * 2 / (2**bits - 1)).item()
    # the mean of 400 draws: std <= step / (2 sqrt(400)) = step / 40; 5 sigma
    assert (mean - x).abs().max() < 5 * step / 40
    rtn = unpack(pack(x, bits, stochastic=False))
    assert (mean - x).abs().mean() < 0.5 * (rtn - x).abs().mean()  # RTN is biased, SR is not


def _role_tensor(role, g):
    """(tensor like the role's, symmetric grid?, dB below the Gaussian floor it may fall)."""
    z = torch.randn(64, 4096, generator=g)
    if role == "logits":  # log-probabilities: one-sided, asymmetric grid
        return torch.log_softmax(z * 3, -1), False, 0.0
    if role == "gate_up":  # SiLU output: skewed (absmax set by the positive tail)
        return torch.nn.functional.silu(z), True, 3.0
    if role == "down_in":  # SiLU(gate) * up: product of Gaussians, kurtosis ~9 -> absmax/RMS ~2x
        return torch.nn.functional.silu(z) * torch.randn(64, 4096, generator=g), True, 6.0
    return z, True, 0.0


@pytest.mark.parametrize("role", ROLES)
def test_role_error_within_floor_of_its_width(role):
    pol = Policy()
    bits = pol.bits_for(role)
    x, symmetric, slack = _role_tensor(role, torch.Generator().manual_seed(7))
    y = unpack(pack(x, bits, group_size=pol.group_size, stochastic=pol.stochastic, symmetric=symmetric))
    assert sqnr(x, y) >= FLOOR_SR[bits] - slack, (role, bits, sqnr(x, y))

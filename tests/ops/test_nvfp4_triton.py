"""NVFP4 Triton kernels == torch reference, bit for bit: codes, E4M3 block scales, tensor
scale and dequantized values; plus the rounding rules (E2M1 ties to even index, E4M3 block
scale == torch's cast incl. the clamp at 448 and subnormals) and the special values."""

import pytest
import torch
from _opslib import DTYPES, SQNR_FLOOR_DB, equal_nan, randn, sqnr_db

from leantrain.ops import NVFP4Tensor, dequantize_nvfp4, quantize_nvfp4
from leantrain.ops.nvfp4 import dequantize_nvfp4_ref, quantize_nvfp4_ref

SIZES = [1, 15, 16, 127, 4097, 3 * 4096 + 5]
E4M3 = torch.float8_e4m3fn


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where the other is NaN, and the same sign bit (-0.0 != +0.0)."""
    nan = torch.isnan(a)
    return equal_nan(a, b) and torch.equal(torch.signbit(a)[~nan], torch.signbit(b)[~nan])


def _check(x: torch.Tensor, backend: str) -> NVFP4Tensor:
    """Quantize + dequantize with ``backend``; assert bit-equality with the reference."""
    q = quantize_nvfp4(x, backend=backend)
    r = quantize_nvfp4_ref(x)
    nb = -(-x.numel() // 16)
    assert q.data.dtype == torch.uint8 and q.data.shape == (nb * 8,)
    assert q.block_scale.dtype == torch.uint8 and q.block_scale.shape == (nb,)
    assert q.tensor_scale.dtype == torch.float32 and q.tensor_scale.shape == ()
    assert torch.equal(q.data, r.data)
    assert torch.equal(q.block_scale, r.block_scale)
    assert torch.equal(q.tensor_scale.view(torch.int32), r.tensor_scale.view(torch.int32))
    assert q.shape == x.shape and q.dtype == x.dtype
    nib = torch.stack([q.data & 0xF, q.data >> 4])
    assert not (nib == 8).any(), "negative zero code"
    assert not ((q.block_scale & 0x7F) == 0x7F).any(), "NaN block scale"
    y = dequantize_nvfp4(q, backend=backend)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert _same_bits(y, dequantize_nvfp4_ref(r))
    assert torch.isfinite(y).all()
    return q


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_kernel_matches_reference_bit_exact(backend, device, dtype, n):
    x = randn(n, dtype, device)
    q = _check(x, backend)
    for out in DTYPES:  # dequantize into another dtype
        y = dequantize_nvfp4(q, dtype=out, backend=backend)
        assert y.dtype == out and _same_bits(y, dequantize_nvfp4_ref(q, out))


@pytest.mark.parametrize("dtype", DTYPES)
def test_extremes_bit_exact(backend, device, dtype):
    big = {torch.float32: 3e38, torch.bfloat16: 3e38, torch.float16: 6e4}[dtype]
    cases = {
        "all zero": torch.zeros(100, device=device),
        "signed zeros": torch.tensor([0.0, -0.0] * 20, device=device),
        "zero blocks between blocks": torch.cat([torch.zeros(32), torch.randn(16), torch.zeros(16),
                                                 torch.randn(5) * 1e-3, torch.zeros(11), torch.randn(3)]),
        "inf nan": torch.tensor([1.0, float("inf"), -float("inf"), float("nan"), -2.5, 0.1] * 6),
        "only non-finite": torch.tensor([float("nan"), float("inf"), -float("inf")] * 7),
        "denormals": torch.randn(200) * 1e-41,           # tensor scale underflows to 0
        "deep denormals": torch.randn(200) * 1e-44,
        "tiny normals": torch.randn(200) * 1e-36,        # tensor scale and block scales denormal
        "mixed tiny": torch.cat([torch.randn(48) * 1e-41, torch.randn(48) * 1e-30, torch.randn(48)]),
        "huge outlier": torch.cat([torch.randn(100), torch.tensor([big]), torch.randn(60)]),
        "negative outlier": torch.cat([torch.randn(70), torch.tensor([-big]), torch.randn(9)]),
        "tiny negatives": torch.cat([torch.tensor([100.0]), -torch.rand(40) * 1e-3]),  # round to +0
        "log-spread": torch.randn(500) * 10 ** (torch.rand(500) * 60 - 30),
    }
    for name, x in cases.items():
        x = x.to(device=device, dtype=dtype)
        q = _check(x, backend)
        y = dequantize_nvfp4(q, backend=backend).float()
        xf = x.float()
        fin = torch.isfinite(xf)
        assert (y[~fin] == 0).all() and (y[xf == 0] == 0).all(), name
    q = _check(torch.zeros(33, dtype=dtype, device=device), backend)
    assert q.tensor_scale.item() == 0 and (q.data == 0).all() and (q.block_scale == 0).all()
    y = dequantize_nvfp4(_check(cases["huge outlier"].to(device=device, dtype=dtype), backend), backend=backend)
    assert abs(y[100].item() / float(torch.tensor(big, dtype=dtype)) - 1) < 1e-6


def test_e2m1_ties_to_even_index(backend, device):
    """Tensor scale 1 (amax 2688) and power-of-two block scales (normal and subnormal E4M3):
    values on every E2M1 midpoint round to the even index, one ulp off goes to the near side."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    tied = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])
    below = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0])
    above = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    head = torch.zeros(16)
    head[3] = 2688.0
    blocks, want = [head], [head]
    for k in (0, -4, -8):  # block scale 2**k: E4M3 normal, normal, subnormal
        p = 2.0**k
        for vals, exp in ((mids, tied), (torch.nextafter(mids, torch.tensor(0.0)), below),
                          (torch.nextafter(mids, torch.tensor(9.0)), above)):
            b = torch.cat([torch.tensor([6.0]), vals, -vals, torch.tensor([-6.0])]) * p
            blocks.append(b)
            want.append(torch.cat([torch.tensor([6.0]), exp, -exp, torch.tensor([-6.0])]) * p)
    x, want = torch.cat(blocks).to(device), torch.cat(want).to(device)
    q = _check(x, backend)
    assert q.tensor_scale.item() == 1.0
    assert torch.equal(dequantize_nvfp4(q, backend=backend), want)
    assert torch.equal(q.data[8:16].cpu(), torch.tensor([0x07 | 0x00 << 4, 0x2 | 0x2 << 4, 0x4 | 0x4 << 4,
                                                         0x6 | 0x6 << 4, 0x0 | 0xA << 4, 0xA | 0xC << 4,
                                                         0xC | 0xE << 4, 0xE | 0xF << 4], dtype=torch.uint8))


def test_block_scale_is_torch_e4m3_cast(backend, device):
    """With tensor scale 1 a block of amax 6v gets s = v exactly: every E4M3 value, every
    midpoint (ties to even, subnormals included), below the smallest subnormal, and the clamp."""
    vals = torch.arange(128, dtype=torch.uint8).view(E4M3).float()
    vals = vals[torch.isfinite(vals)]
    mids = (vals[1:] + vals[:-1]) / 2
    s = torch.cat([vals, mids, torch.tensor([2.0**-11, 2.0**-10, 3 * 2.0**-11])])
    x = torch.zeros(s.numel() + 1, 16)
    x[0, 5] = 2688.0  # block 0: amax 2688 -> tensor scale 1, block scale 448
    x[1:, 7] = -6 * s
    x[1:, 2] = s
    q = _check(x.to(device), backend)
    assert q.tensor_scale.item() == 1.0
    assert torch.equal(q.block_scale[1:].cpu(), s.to(E4M3).view(torch.uint8))
    # the clamp: amax / 6 / (amax / 2688) rounds to 448.00003 for this amax -> 448, never NaN
    a = 997.8823852539062
    ts = torch.tensor(a) / 2688.0
    assert (torch.tensor(a) / 6.0) / ts > 448.0
    q = _check(torch.tensor([a, 1.0, -a / 3], device=device), backend)
    assert q.block_scale[0].item() == 0x7E
    # denormal amax: the tensor scale is one denormal ulp (2**-149), amax / 6 / ts = 668 > 464,
    # which the E4M3 cast would turn into NaN without the clamp
    a = torch.tensor(1.49 * 2688 * 2.0**-149).item()
    ts = torch.tensor(a) / 2688.0
    assert ts.item() == 2.0**-149 and (torch.tensor(a) / 6.0) / ts >= 464.0
    q = _check(torch.tensor([-a, a / 5] + [a / 7] * 14 + [a / 2] * 3, device=device), backend)
    assert q.block_scale[0].item() == 0x7E


def test_dequantize_every_byte_and_scale(backend, device):
    """All 256 code bytes under all 256 E4M3 scale patterns (NaN patterns included)."""
    data = torch.arange(256, dtype=torch.uint8).repeat(8)
    q = NVFP4Tensor(data.to(device), torch.arange(256, dtype=torch.uint8, device=device),
                    torch.tensor(0.37, device=device), torch.Size([64, 64]), torch.float32)
    for dtype in DTYPES:
        assert _same_bits(dequantize_nvfp4(q, dtype=dtype, backend=backend), dequantize_nvfp4_ref(q, dtype))


def test_shapes_empty_and_views(backend, device):
    q = quantize_nvfp4(torch.empty(0, device=device), backend=backend)
    assert q.data.numel() == 0 and q.block_scale.numel() == 0 and q.tensor_scale.item() == 0
    assert dequantize_nvfp4(q, backend=backend).shape == (0,)
    x = randn(37 * 11, device=device).view(37, 11)
    _check(x, backend)
    _check(x.t(), backend)  # non-contiguous
    _check(x[:, 3], backend)  # strided


def test_sqnr_floor(backend, device):
    x = torch.randn(1 << 16, device=device)
    q = quantize_nvfp4(x, backend=backend)
    assert q.nbytes == (1 << 15) + (1 << 12) + 4
    assert sqnr_db(x, dequantize_nvfp4(q, backend=backend)) >= SQNR_FLOOR_DB["nvfp4"]


# --- the options for gradients on the wire: stochastic rounding, scales rounded up, NaN blocks

OPTS = {"sr": {"stochastic": True, "seed": 11}, "up": {"scale_round": "up"}, "nan": {"nonfinite": "nan"},
        "local": {"local_scale": True},
        "wire": {"stochastic": True, "seed": 2**40 + 3, "scale_round": "up", "nonfinite": "nan", "local_scale": True}}


@pytest.mark.parametrize("opt", list(OPTS))
@pytest.mark.parametrize("n", [16, 4097, 3 * 4096 + 5])
def test_options_kernel_matches_reference_bit_exact(backend, device, opt, n):
    """Each option for gradients on the wire: Triton == torch bit for bit, and what the option promises."""
    x = randn(n, torch.float32, device) * torch.logspace(-3, 3, n, device=device)
    x[n // 3] = float("nan")
    x[n // 2] = float("-inf")
    kw = OPTS[opt]
    q = quantize_nvfp4(x, backend=backend, **kw)
    r = quantize_nvfp4_ref(x, **kw)
    assert torch.equal(q.data, r.data) and torch.equal(q.block_scale, r.block_scale)
    assert torch.equal(q.tensor_scale.view(torch.int32), r.tensor_scale.view(torch.int32))
    y = dequantize_nvfp4(q, backend=backend)
    assert _same_bits(y, dequantize_nvfp4_ref(r))
    bad = torch.zeros(-(-n // 16) * 16, dtype=torch.bool, device=device)
    bad[:n] = ~torch.isfinite(x)
    bad_blocks = bad.view(-1, 16).any(1).repeat_interleave(16)[:n]
    if kw.get("nonfinite") == "nan":  # exactly the blocks holding a non-finite value decode as NaN
        assert torch.equal(torch.isnan(y), bad_blocks)
    else:
        assert torch.isfinite(y).all()
    if kw.get("scale_round") == "up":  # no element is clamped: every block scale is at or above amax / 6
        xb = torch.zeros(bad.numel(), device=device)
        xb[:n] = torch.where(torch.isfinite(x), x, 0.0)
        amax = xb.view(-1, 16).abs().amax(1)
        eff = q.block_scale.view(torch.float8_e4m3fn).float() * q.block_tensor_scale()
        ok = ~bad.view(-1, 16).any(1) | (kw.get("nonfinite") != "nan")
        assert torch.all((6 * eff >= amax * (1 - 2**-22))[ok])


def test_stochastic_rounding_is_unbiased_and_seeded(backend, device):
    x = torch.randn(64, device=device) * 3
    x[0] = 9.0  # a block's largest element: unbiased too, with the scale rounded up
    n = 3000  # copies in one call: the same blocks and scales, a draw of its own for every element
    q = quantize_nvfp4(x.repeat(n), stochastic=True, seed=1, scale_round="up", backend=backend)
    mean = dequantize_nvfp4(q, backend=backend).view(n, 64).mean(0)
    # each draw is one of the two E2M1 values around x (step at most 2 units, unit <= 9 / 6): std < 0.75,
    # so the mean of 3000 is within 0.075 (5.5 sigma) of x
    assert (mean - x).abs().max() < 0.075
    nearest = dequantize_nvfp4(quantize_nvfp4(x, scale_round="up", backend=backend), backend=backend)
    assert (mean - x).abs().mean() < 0.3 * (nearest - x).abs().mean()
    a = quantize_nvfp4(x, stochastic=True, seed=5, backend=backend).data
    assert torch.equal(a, quantize_nvfp4(x, stochastic=True, seed=5, backend=backend).data)
    assert not torch.equal(a, quantize_nvfp4(x, stochastic=True, seed=6, backend=backend).data)


def test_local_scales_are_per_4096_elements_and_one_pass():
    # three 4096-element groups of very different ranges: each gets its own fp32 scale (amax / 2688), so the
    # small group keeps its precision; with one tensor scale its E4M3 block scales underflow to zero
    x = torch.cat([torch.randn(4096) * 1e3, torch.randn(4096) * 1e-3, torch.randn(100)])
    q = quantize_nvfp4(x, local_scale=True)
    nb = -(-x.numel() // 16)  # 519 blocks: codes, E4M3 scales, three fp32 scales
    assert q.tensor_scale.shape == (3,) and q.nbytes == nb * 8 + nb + 3 * 4
    assert torch.equal(q.tensor_scale, torch.stack([g.abs().max() for g in x.split(4096)]) / 2688)
    rel = lambda y, a, b: ((y[a:b] - x[a:b]).norm() / x[a:b].norm()).item()  # noqa: E731
    local = dequantize_nvfp4(q)
    glob = dequantize_nvfp4(quantize_nvfp4(x))
    assert rel(local, 4096, 8192) < 0.15 and rel(glob, 4096, 8192) > 0.9


def test_options_are_checked():
    with pytest.raises(ValueError):
        quantize_nvfp4(torch.zeros(16), scale_round="down")
    with pytest.raises(ValueError):
        quantize_nvfp4(torch.zeros(16), nonfinite="inf")

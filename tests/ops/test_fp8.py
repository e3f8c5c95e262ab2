import pytest
import torch
from _opslib import DTYPES, SQNR_FLOOR_DB, equal_nan, randn, sqnr_db

from leantrain.ops import QTensor, dequantize, dequantize_fp8, quantize_fp8
from leantrain.ops.fp8 import FP8_FORMATS, dequantize_fp8_ref, quantize_fp8_ref

FMTS = ["e4m3", "e5m2"]


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,group_size", [(1, 32), (127, 32), (4097, 128), (1000, 100)])
def test_kernel_matches_reference_bit_exact(backend, device, fmt, dtype, n, group_size):
    x = randn(n, dtype, device)
    q = quantize_fp8(x, fmt=fmt, group_size=group_size, backend=backend)
    r = quantize_fp8_ref(x, fmt=fmt, group_size=group_size)
    assert q.data.dtype == torch.uint8 and torch.equal(q.data, r.data) and torch.equal(q.scale, r.scale)
    y = dequantize_fp8(q, backend=backend)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y, dequantize_fp8_ref(r))
    assert torch.equal(dequantize(q, backend=backend), y)  # generic dequantize routes on fmt


@pytest.mark.parametrize("fmt", FMTS)
def test_rounding_matches_torch_cast_everywhere(backend, device, fmt):
    """Every fp8 value, every midpoint between neighbours (ties) and random points, including
    subnormals: with amax == FMAX the scale is 1, so codes are torch's own cast."""
    dt, _, _, _, fmax = FP8_FORMATS[fmt]
    vals = torch.arange(256, dtype=torch.uint8).view(dt).float()
    vals = vals[torch.isfinite(vals) & (vals.abs() <= fmax)].unique()
    mids = (vals[1:] + vals[:-1]) / 2
    x = torch.cat([torch.tensor([fmax]), vals, mids, torch.randn(2000) * fmax / 8,
                   torch.randn(500) * 2.0 ** FP8_FORMATS[fmt][3]])
    x = x.to(device)
    q = quantize_fp8(x, fmt=fmt, group_size=4096, backend=backend)
    assert q.scale.item() == 1.0
    assert torch.equal(q.data[: x.numel()], x.clamp(-fmax, fmax).to(dt).view(torch.uint8))


@pytest.mark.parametrize("fmt", FMTS)
def test_decode_all_codes(backend, device, fmt):
    q = QTensor(torch.arange(256, dtype=torch.uint8, device=device), torch.ones(2, device=device), None,
                torch.Size([256]), torch.float32, 8, 128, True, fmt)
    ref = torch.arange(256, dtype=torch.uint8).view(FP8_FORMATS[fmt][0]).float().to(device)
    assert equal_nan(dequantize_fp8(q, backend=backend), ref)


@pytest.mark.parametrize("fmt", FMTS)
def test_sqnr_floor_and_extremes(backend, device, fmt):
    x = torch.randn(1 << 16)
    assert sqnr_db(x, dequantize_fp8(quantize_fp8(x, fmt=fmt))) >= SQNR_FLOOR_DB[fmt]
    z = randn(256, device=device)
    z[:64] = 0
    z[64] = float("nan"); z[65] = -float("inf")  # noqa: E702
    z[128:192] = torch.randn(64, device=device) * 1e-41
    z[192] = -3e38
    q = quantize_fp8(z, fmt=fmt, group_size=64, backend=backend)
    y = dequantize_fp8(q, backend=backend)
    assert torch.isfinite(y).all() and (y[:64] == 0).all() and y[64] == 0 and y[65] == 0
    assert abs(y[192].item() / -3e38 - 1) < 1e-6
    # denormal groups: bounded error; once amax / FMAX underflows fp32 they decode to 0 (documented)
    assert ((y[128:192] - z[128:192]).abs() <= z[128:192].abs().max()).all()


@pytest.mark.parametrize("fmt", FMTS)
def test_nonfinite_nan_marks_exactly_the_groups_holding_one(backend, device, fmt):
    x = randn(1000, torch.float32, device)
    x[5], x[250], x[999] = float("nan"), float("inf"), float("-inf")
    q = quantize_fp8(x, fmt=fmt, group_size=128, nonfinite="nan", backend=backend)
    r = quantize_fp8_ref(x, fmt=fmt, group_size=128, nonfinite="nan")
    assert torch.equal(q.data, r.data) and equal_nan(q.scale, r.scale)
    y = dequantize_fp8(q, backend=backend)
    groups = torch.zeros(8, dtype=torch.bool, device=device)
    groups[[0, 1, 7]] = True
    assert torch.equal(torch.isnan(y), groups.repeat_interleave(128)[:1000])
    # the default: treated as 0, everything finite
    assert torch.isfinite(dequantize_fp8(quantize_fp8(x, fmt=fmt, group_size=128, backend=backend), backend=backend)).all()
    with pytest.raises(ValueError):
        quantize_fp8(x, nonfinite="keep")

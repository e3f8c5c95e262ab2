import pytest
import torch
from _opslib import SQNR_FLOOR_DB, randn, sqnr_db

from leantrain.ops import StateCodec8


@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_map(signed):
    q = StateCodec8(signed).qmap
    assert q.shape == (256,) and q.dtype == torch.float32
    assert (q.diff() > 0).all() and q.max() == 1.0 and (q == 0).any()
    assert (q.min() < -0.99) if signed else (q.min() == 0)


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("n", [1, 127, 4097])
def test_kernel_matches_reference(backend, device, signed, n):
    c = StateCodec8(signed)
    x = randn(n, device=device)
    x = x if signed else x.abs()
    codes, absmax = c.encode(x, backend=backend)
    rc, ra = c.encode(x, backend="torch")
    assert codes.dtype == torch.uint8 and codes.shape == x.shape and absmax.numel() == -(-n // 256)
    assert torch.equal(codes, rc) and torch.equal(absmax, ra)
    assert torch.equal(c.decode(codes, absmax, backend=backend), c.decode(rc, ra, backend="torch"))


@pytest.mark.parametrize("signed", [True, False])
def test_round_trip_is_nearest_map_entry(signed):
    """Error bound: every element decodes to the map entry nearest to x / absmax, so
    |x - x'| <= absmax * (half the map gap around x / absmax) <= absmax * max_gap / 2."""
    c = StateCodec8(signed)
    x = randn(4097, device="cpu")
    x = x if signed else x.abs()
    codes, absmax = c.encode(x)
    y = c.decode(codes, absmax)
    am = absmax.repeat_interleave(256)[: x.numel()]
    xn = x / am
    best = (xn[:, None] - c.qmap[None, :]).abs().min(1).values
    got = (xn - c.qmap[codes.long()]).abs()
    assert (got <= best + 1e-6).all()
    assert ((x - y).abs() <= am * c.qmap.diff().max() / 2 * (1 + 1e-5)).all()
    key = "state8_signed" if signed else "state8_unsigned"
    z = torch.randn(1 << 16)
    z = z if signed else z.abs()
    assert sqnr_db(z, c.decode(*c.encode(z))) >= SQNR_FLOOR_DB[key]


def test_extreme_inputs(backend, device):
    c = StateCodec8(True)
    x = randn(1024, device=device)
    x[:256] = 0.0
    x[256] = float("nan"); x[257] = float("inf")  # noqa: E702
    x[512] = 1e30
    codes, absmax = c.encode(x, backend=backend)
    y = c.decode(codes, absmax, backend=backend)
    assert torch.isfinite(y).all() and (y[:256] == 0).all()
    assert y[256] == 0 and y[257] == 0          # documented: non-finite -> 0
    assert y[512] == 1e30


@pytest.mark.gpu
def test_gpu_full_size():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    c = StateCodec8(True)
    x = randn((1 << 24) + 5, device="cuda")
    a, b = c.encode(x, backend="triton"), c.encode(x, backend="torch")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])

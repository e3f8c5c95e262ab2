import numpy as np
import pytest
import torch
from _opslib import SQNR_FLOOR_DB, randn, sqnr_db

from leantrain.ops import (
    QTensor,
    dequant_sum_requant,
    dequantize,
    dequantize_nvfp4,
    pack_bits,
    quantize,
    quantize_fp8,
    quantize_nvfp4,
    unpack_bits,
)
from leantrain.ops.reduce import dequant_sum_requant_ref

IN_FORMATS = [("int", 8, True, 128), ("int", 4, True, 32), ("int", 8, False, 64), ("e4m3", 8, True, 128)]


def _peers(fmt, bits, sym, gs, n, k, device):
    xs = [randn(n, device=device) for _ in range(k)]
    if fmt == "int":
        return xs, [quantize(x, bits=bits, symmetric=sym, group_size=gs) for x in xs]
    return xs, [quantize_fp8(x, fmt=fmt, group_size=gs) for x in xs]


@pytest.mark.parametrize("fmt,bits,sym,gs", IN_FORMATS)
@pytest.mark.parametrize("bits_out,gs_out,sym_out", [(4, 128, True), (8, 512, False)])
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("n", [1, 127, 4097])
def test_kernel_matches_reference_bit_exact(backend, device, fmt, bits, sym, gs, bits_out, gs_out, sym_out,
                                            stochastic, n):
    xs, qs = _peers(fmt, bits, sym, gs, n, 3, device)
    kw = dict(bits_out=bits_out, group_size_out=gs_out, symmetric_out=sym_out, stochastic=stochastic, seed=2)
    out = dequant_sum_requant(qs, backend=backend, **kw)
    ref = dequant_sum_requant_ref(QTensor.stack(qs), **kw)
    assert torch.equal(out.data, ref.data) and torch.equal(out.scale, ref.scale)
    assert out.shape == qs[0].shape and out.bits == bits_out
    # it is the sum: within the quantization errors of the inputs and of the output
    s = sum(xs)
    err = (dequantize(out) - s).norm() / s.norm().clamp_min(1e-30)
    assert err < (0.4 if bits_out == 4 or bits == 4 else 0.05)


def test_stacked_buffer_path_equals_list_path():
    """The two-level reduce-scatter's call: k peers' codes and scales as received by an
    all-to-all, viewed (no copy) as one stacked QTensor."""
    xs, qs = _peers("int", 8, True, 128, 1000, 4, "cpu")
    codes = torch.cat([q.data for q in qs])
    scales = torch.cat([q.scale for q in qs])
    st = QTensor.from_buffers(codes, scales, shape=(1000,), bits=8, group_size=128)
    a = dequant_sum_requant(st, bits_out=4)
    b = dequant_sum_requant(qs, bits_out=4)
    assert torch.equal(a.data, b.data) and torch.equal(a.scale, b.scale)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 127, 4097])
def test_pack_bits_exact(backend, device, n):
    m = torch.rand(n, device=device) > 0.5
    p = pack_bits(m, backend=backend)
    assert p.dtype == torch.uint8 and p.numel() == -(-n // 8)
    ref = np.packbits(m.cpu().numpy(), bitorder="little")
    assert np.array_equal(p.cpu().numpy(), ref)
    assert torch.equal(unpack_bits(p, n, backend=backend), m)
    m2 = (torch.rand(3, 5, device=device) > 0.3)
    assert torch.equal(unpack_bits(pack_bits(m2, backend=backend), 15, backend=backend).view(3, 5), m2)


def test_nvfp4_round_trip():
    x = torch.randn(1 << 16)
    q = quantize_nvfp4(x)
    assert sqnr_db(x, dequantize_nvfp4(q)) >= SQNR_FLOOR_DB["nvfp4"]
    assert q.nbytes == (1 << 15) + (1 << 12) + 4
    # E2M1 grid: values exactly on the grid (with a power-of-two block scale) are exact
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0] * 2) * torch.tensor([1.0] * 8 + [-1.0] * 8)
    assert torch.equal(dequantize_nvfp4(quantize_nvfp4(grid)), grid)
    z = randn(100)
    z[:16] = 0
    z[20] = float("nan"); z[21] = float("inf")  # noqa: E702
    y = dequantize_nvfp4(quantize_nvfp4(z.view(10, 10)))
    assert y.shape == (10, 10) and torch.isfinite(y).all() and (y.view(-1)[:16] == 0).all()
    assert (dequantize_nvfp4(quantize_nvfp4(torch.zeros(33))) == 0).all()
    assert quantize_nvfp4(torch.empty(0)).data.numel() == 0

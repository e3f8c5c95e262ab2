"""State storage (fp32 / bf16 / 8-bit) and the reference Optimizer's ``state_dtype``."""

from __future__ import annotations

import pytest
import torch

import leantrain as lt
from leantrain.ops.tiles import ieee_div
from leantrain.ops.update import FP8_FLOOR
from leantrain.optim.state import StateStorage, dequantize8, dequantize_fp8, quantize8, quantize_fp8


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


@pytest.mark.parametrize("state_dtype", ["bf16", "int8", "int8p", "fp8"])
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
    assert StateStorage.kind_of(oq.state[linq.bias], "exp_avg") == ("bf16" if state_dtype == "bf16" else "fp32")
    assert (linq.weight - lin32.weight).norm() / (lin32.weight - w0).norm() < 0.05


def test_bad_state_dtype():
    with pytest.raises(ValueError, match="state_dtype must be one of"):
        StateStorage("fp4")


@pytest.mark.parametrize("shape", [(127, 65), (1, 4097), (4097,), (3, 5, 300), (256,)])
@pytest.mark.parametrize("signed", [True, False])
def test_quantize8p_packs_the_absmax_into_the_codes(shape, signed):
    """``int8p``: the absmax comes back bit for bit from the first 32 codes' low bits; those codes
    decode odd map entries, within twice the 8-bit step; the other codes are int8's exactly."""
    from leantrain.optim.state import codec, dequantize8p, quantize8p

    g = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=g) * 1e-3
    x = x if signed else x.abs()
    c8, absmax = quantize8(x, signed)
    c = quantize8p(x, signed)
    nblocks = absmax.numel()
    assert c.dtype == torch.uint8 and c.numel() == 256 * nblocks  # whole blocks: 1 byte an element
    blocks, blocks8 = c.reshape(-1, 256).long(), c8.reshape(-1).long()
    if c8.dim() == 4:
        blocks8 = blocks8.view(-1, 256)
    else:  # (flat int8 codes are not padded)
        blocks8 = torch.nn.functional.pad(blocks8, (0, 256 * nblocks - blocks8.numel()), value=-1).view(-1, 256)
    tail = blocks8[:, 32:] >= 0
    assert torch.equal(blocks[:, 32:][tail], blocks8[:, 32:][tail])
    bits = ((blocks[:, :32] & 1) << torch.arange(32)).sum(1)
    assert torch.equal(bits.to(torch.int32).view(torch.float32), absmax.reshape(-1))
    y = dequantize8p(c, signed, x.shape)
    y8 = dequantize8(c8, absmax, signed, x.shape)
    assert y.shape == x.shape
    # head codes: every other map entry (step <= 0.0141 near 1); the worst case is -absmax itself:
    # the signed map has no -1, its lowest odd entry is -0.979 (2.11 %)
    assert ((y - x).abs() <= 0.0212 * x.abs().max()).all()
    assert 10 * torch.log10(x.square().sum() / (y - x).square().sum()) > 33  # SQNR (dB), int8: > 35
    if len(shape) != 2 or shape[0] >= 16:  # (a 1-row tensor is all head codes)
        assert (y != y8).float().mean() <= 32 / 256  # only the head codes moved
    qmap = codec(signed).qmap
    head_vals = qmap[blocks[:, :32] | 1]
    assert (head_vals != 0).any() or not x.any()


def test_quantize8p_zero_and_nonfinite():
    from leantrain.optim.state import dequantize8p, quantize8p

    z = quantize8p(torch.zeros(512), True)
    assert torch.equal(dequantize8p(z, True, (512,)), torch.zeros(512))  # signed: 0 is an odd entry
    x = torch.randn(300)
    x[7], x[40] = float("nan"), float("inf")
    y = dequantize8p(quantize8p(x, True), True, x.shape)
    assert torch.isfinite(y).all() and y[7] == 0 and y[40] == 0


def test_storage_int8p_kinds_and_bytes():
    rule = lt.optim.AdamW()
    sto = StateStorage("int8p")
    big, mid, small = torch.zeros(64, 80), torch.zeros(300), torch.zeros(200)
    sb, sm, ss = sto.init(rule, big), sto.init(rule, mid), sto.init(rule, small)
    assert StateStorage.kind_of(sb, "exp_avg") == "int8p" and sb["exp_avg"].numel() == 64 * 80
    assert set(sb) == {"exp_avg", "exp_avg_sq"}  # no absmax tensors: the bytes held are the codes
    assert StateStorage.kind_of(sm, "exp_avg") == "int8p" and sm["exp_avg"].shape == (512,)  # padded flat
    assert StateStorage.kind_of(ss, "exp_avg") == "fp32"  # below one block
    v = torch.randn(64, 80)
    sto.write(sb, "exp_avg", v, True)
    assert (sto.read(sb, "exp_avg", True, v.shape) - v).abs().max() <= 0.0212 * v.abs().max()
    keep = torch.tensor(True)
    before = sb["exp_avg"].clone()
    sto.write(sb, "exp_avg", v * 3, True, keep_old=keep)
    assert torch.equal(sb["exp_avg"], before)


@pytest.mark.parametrize("shape", [(127, 65), (1, 4097), (4097,), (3, 5, 300), (16, 16)])
@pytest.mark.parametrize("signed", [True, False])
def test_quantize_fp8_round_trip(shape, signed):
    """"fp8": e4m3 codes in int8's blocks; a signed state's value (an unsigned one's root) is within
    half an e4m3 step (2**-4 relative) or half the block's subnormal step of the stored value."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    x = x if signed else x.square() * 1e-6  # (a second moment)
    codes, absmax = quantize_fp8(x, signed)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == quantize8(x, signed)[0].shape
    assert absmax.shape == quantize8(x, signed)[1].shape  # one fp32 a block, as int8
    y = dequantize_fp8(codes, absmax, signed, x.shape)
    assert y.shape == x.shape
    r, ry = (x, y) if signed else (x.sqrt(), y.sqrt())
    amax = r.abs().max()
    assert ((ry - r).abs() <= 2.0**-4 * r.abs() + amax / 448 * 2.0**-10 * 1.001).all()
    assert 10 * torch.log10(x.square().sum() / (y - x).square().sum()) > (29 if signed else 23)  # SQNR (dB)


def test_fp8_encode_is_the_stated_formula():
    """code = e4m3_rne(y * (448 / absmax)) (IEEE division), decode fp32(code) * (absmax * fp32(1/448)); a
    block's absmax is at least 2**-100; non-finite values are 0; unsigned states keep their root."""
    x = torch.randn(40, 33, generator=torch.Generator().manual_seed(2)) * 3
    x[0, :16] = 0.0
    x[16:32, 16:32] *= 1e-36  # a tiny block: 448 / absmax stays finite
    x[20, 20], x[5, 30] = float("nan"), float("inf")
    codes, absmax = quantize_fp8(x, True)
    from leantrain.optim.state import to_tiles

    t = to_tiles(torch.where(torch.isfinite(x), x, 0.0)).reshape(-1, 256)
    am = t.abs().amax(1).clamp_min(FP8_FLOOR)
    assert torch.equal(absmax.reshape(-1), am) and (absmax >= FP8_FLOOR).all()
    want = (t * ieee_div(448.0, am)[:, None]).to(torch.float8_e4m3fn)
    assert torch.equal(codes.reshape(-1, 256).view(torch.uint8), want.view(torch.uint8))
    y = dequantize_fp8(codes, absmax, True, x.shape)
    assert torch.isfinite(y).all() and y[20, 20] == 0 and y[5, 30] == 0
    assert (y[16:32, 16:32] != 0).any()  # the tiny block is kept, not flushed
    v = x.abs()
    cu, au = quantize_fp8(v, False)
    assert torch.equal(cu.view(torch.uint8), quantize_fp8(v.sqrt(), True)[0].view(torch.uint8))
    assert torch.equal(dequantize_fp8(cu, au, False, v.shape), dequantize_fp8(cu, au, True, v.shape).square())


def test_storage_fp8_kinds_and_bytes():
    """"fp8" holds exactly what "int8" holds (1 byte an element, one fp32 absmax a block, fp32 below
    MIN_NUMEL), is told apart by its dtype, and keeps its old bits where asked."""
    rule = lt.optim.AdamW()
    sto, sto8 = StateStorage("fp8"), StateStorage("int8")
    for shape in ((64, 80), (5000,), (200,)):
        s, s8 = sto.init(rule, torch.zeros(shape)), sto8.init(rule, torch.zeros(shape))
        assert {k: (v.shape, v.element_size()) for k, v in s.items()} == \
            {k: (v.shape, v.element_size()) for k, v in s8.items()}
        assert StateStorage.kind_of(s, "exp_avg") == ("fp32" if shape == (200,) else "fp8")
    sb = sto.init(rule, torch.zeros(64, 80))
    v = torch.randn(64, 80)
    sto.write(sb, "exp_avg", v, True)
    assert (sto.read(sb, "exp_avg", True, v.shape) - v).abs().max() <= 2.0**-4 * v.abs().max()
    before = {k: t.clone() for k, t in sb.items()}
    sto.write(sb, "exp_avg", v * 3, True, keep_old=torch.tensor(True))
    assert all(torch.equal(sb[k].view(torch.uint8) if sb[k].element_size() == 1 else sb[k],
                           before[k].view(torch.uint8) if before[k].element_size() == 1 else before[k]) for k in sb)


def test_fp8_second_moment_is_kept_as_its_root():
    """A block of second moments spanning more than e4m3's range relative to its max (448 / 2**-9 ~ 2.3e5)
    keeps its small entries through the root (v down to ~4e-11 of the max); e4m3 of v itself would
    flush those below ~4.4e-6 of the max to 0, and m / (sqrt(v) + eps) would then divide by eps."""
    v = torch.logspace(0, -10, 256).view(16, 16)
    codes, absmax = quantize_fp8(v, False)
    y = dequantize_fp8(codes, absmax, False, v.shape)
    assert (y > 0).all()
    assert ((y.sqrt() - v.sqrt()).abs() <= 2.0**-4 * v.sqrt() + 1 / 448 * 2.0**-10).all()

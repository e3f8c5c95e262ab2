"""FP8 (E4M3 / E5M2) block-wise quantization, payload as uint8 (gloo has no float8).

Math (per group of ``group_size`` elements of the flattened tensor):
    scale = amax / FMAX            (FMAX = 448 for e4m3, 57344 for e5m2)
    code  = fp8_rne(clamp(x * pre * (FMAX / (amax * pre)), -FMAX, FMAX))
    x'    = float(code) * scale
with ``pre`` the exact power-of-two rescale for denormal groups described in
:mod:`leantrain.ops.quant`. ``fp8_rne`` is IEEE round-to-nearest-even into
``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` (subnormals included); the Triton kernel
computes it with integer arithmetic on the fp32 bits (normal range) and an exact
``(k + 2**23) - 2**23`` rounding (subnormal range), so its bytes equal torch's cast bit for
bit, on the interpreter and on any GPU (no dependence on hardware fp8 conversions).
Non-finite inputs are treated as 0 (``nonfinite="zero"``, the default) or make their group's
scale NaN (``nonfinite="nan"``: the group decodes as NaN, so a gradient's overflow stays visible
after a trip through the wire); all-zero groups give scale 0 and exact zeros. Groups of
denormals whose ``amax / FMAX`` underflows the fp32 scale (amax below ~1e-40 for e4m3, ~1e-38
for e5m2) dequantize to 0.

Tiling (Triton): ``[ROWS, group_size]`` tile of whole groups per program (~4096 elements).
Bytes per element: quantize reads sizeof(x), writes 1 (+ 4 / group_size); dequantize the reverse.
"""

from __future__ import annotations

import torch

from leantrain.ops._backend import HAS_TRITON, launch, resolve
from leantrain.ops.qtensor import QTensor
from leantrain.ops.tiles import PRE_SCALE, TINY_RANGE, fast_bits, ieee_div, pad_groups, tile_shape

# fmt -> (torch dtype, mantissa bits, exponent bias, min normal exponent, max finite)
FP8_FORMATS = {
    "e4m3": (torch.float8_e4m3fn, 3, 7, -6, 448.0),
    "e5m2": (torch.float8_e5m2, 2, 15, -14, 57344.0),
}


def _fmt(fmt: str):
    if fmt not in FP8_FORMATS:
        raise ValueError(f"fmt must be one of {sorted(FP8_FORMATS)}, got {fmt!r}")
    return FP8_FORMATS[fmt]


def _check_nonfinite(nonfinite: str) -> None:
    if nonfinite not in ("zero", "nan"):
        raise ValueError(f"nonfinite must be 'zero' or 'nan', got {nonfinite!r}")


def quantize_fp8_ref(x: torch.Tensor, *, fmt: str = "e4m3", group_size: int = 128, nonfinite: str = "zero") -> QTensor:
    _check_nonfinite(nonfinite)
    dt, _, _, _, fmax = _fmt(fmt)
    xg, _ = pad_groups(x, group_size)
    bad = ~torch.isfinite(xg).all(-1)
    xg = torch.where(torch.isfinite(xg), xg, 0.0)
    amax = xg.abs().amax(-1) if xg.shape[0] else xg.new_zeros(0)
    pre = torch.where(amax < TINY_RANGE, PRE_SCALE, 1.0)
    scale = ieee_div(amax, fmax)
    inv = torch.where(amax > 0, ieee_div(fmax, torch.where(amax > 0, amax * pre, 1.0)), 0.0)
    y = ((xg * pre[:, None]) * inv[:, None]).clamp(-fmax, fmax)
    data = y.to(dt).view(torch.uint8).reshape(-1)
    if nonfinite == "nan":
        scale = torch.where(bad, float("nan"), scale)
    return QTensor(data, scale, None, x.shape, x.dtype, 8, group_size, True, fmt)


def dequantize_fp8_ref(q: QTensor, dtype=None) -> torch.Tensor:
    dt = _fmt(q.fmt)[0]
    lead = q.data.shape[:-1]
    v = q.data.view(dt).to(torch.float32).reshape(*lead, -1, q.group_size) * q.scale.unsqueeze(-1)
    v = v.reshape(*lead, -1)[..., : q.numel]
    return v.reshape(*lead, *q.shape).to(dtype or q.dtype)


if HAS_TRITON:
    import triton
    import triton.language as tl

    from leantrain.ops.tl_helpers import cast_out_tl

    @triton.jit
    def fp8_encode_tl(y, M: tl.constexpr, BIAS: tl.constexpr, EMIN: tl.constexpr):
        """fp32 ``y`` (finite, |y| <= FMAX) -> fp8 bit pattern (int32 0..255), round to nearest even."""
        a = tl.abs(y)
        sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
        bits = a.to(tl.int32, bitcast=True)
        SHIFT: tl.constexpr = 23 - M
        r = bits + ((1 << (SHIFT - 1)) - 1) + ((bits >> SHIFT) & 1)
        normal = (r >> SHIFT) - ((127 - BIAS) << M)
        k = tl.where(a < 2.0**EMIN, a, 0.0) * (2.0 ** (M - EMIN))  # exact: power-of-two scaling
        sub = ((k + 8388608.0) - 8388608.0).to(tl.int32)  # round half to even, k < 2**M
        code = tl.where(a < 2.0**EMIN, sub, normal)
        return code | (sign << 7)

    @triton.jit
    def fp8_decode_tl(c, M: tl.constexpr, BIAS: tl.constexpr, EMIN: tl.constexpr,
                      IS_E4M3: tl.constexpr):
        """fp8 bit pattern (int32 0..255) -> fp32, exact (NaN/inf patterns included)."""
        e = (c >> M) & ((1 << (7 - M)) - 1)
        m = c & ((1 << M) - 1)
        sub = m.to(tl.float32) * (2.0 ** (EMIN - M))
        normal = (((e + (127 - BIAS)) << 23) | (m << (23 - M))).to(tl.float32, bitcast=True)
        v = tl.where(e == 0, sub, normal)
        if IS_E4M3:
            v = tl.where((c & 0x7F) == 0x7F, float("nan"), v)
        else:
            v = tl.where(e == 31, tl.where(m == 0, float("inf"), float("nan")), v)
        # the sign as a bit, exact for every code: compiled, ``where(sign, -v, v)`` gave +0 for 0x80 (-0)
        return (v.to(tl.int32, bitcast=True) | ((c >> 7) << 31)).to(tl.float32, bitcast=True)

    @triton.jit
    def _qfp8_kernel(x_ptr, data_ptr, scale_ptr, n, n_groups, FMAX: tl.constexpr,
                     GS: tl.constexpr, COLS: tl.constexpr, ROWS: tl.constexpr,
                     M: tl.constexpr, BIAS: tl.constexpr, EMIN: tl.constexpr, KEEP_NAN: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, COLS)
        idx = rows[:, None] * GS + cols[None, :]
        valid = (cols[None, :] < GS) & (idx < n)
        x = tl.load(x_ptr + idx, mask=valid, other=0.0).to(tl.float32)
        finite = tl.abs(x) < float("inf")
        x = tl.where(finite, x, 0.0)
        amax = tl.max(tl.abs(x), axis=1)
        fmax = tl.zeros_like(amax) + FMAX
        pre = tl.where(amax < 5.421010862427522e-20, 1.8446744073709552e19, 1.0)
        scale = tl.div_rn(amax, fmax)
        inv = tl.where(amax > 0, tl.div_rn(fmax, tl.where(amax > 0, amax * pre, 1.0)), 0.0)
        y = (x * pre[:, None]) * inv[:, None]
        y = tl.minimum(tl.maximum(y, -FMAX), FMAX)
        code = fp8_encode_tl(y, M, BIAS, EMIN)
        gmask = (cols[None, :] < GS) & (rows[:, None] < n_groups)
        tl.store(data_ptr + idx, code.to(tl.uint8), mask=gmask)
        if KEEP_NAN:
            scale = tl.where(tl.max(tl.where(finite, 0, 1), axis=1) > 0, float("nan"), scale)
        tl.store(scale_ptr + rows, scale, mask=rows < n_groups)

    @triton.jit
    def _dqfp8_kernel(data_ptr, scale_ptr, out_ptr, n, n_groups,
                      GS: tl.constexpr, COLS: tl.constexpr, ROWS: tl.constexpr,
                      M: tl.constexpr, BIAS: tl.constexpr, EMIN: tl.constexpr, IS_E4M3: tl.constexpr,
                      FAST: tl.constexpr):
        peer = tl.program_id(1).to(tl.int64)
        data_ptr += peer * (n_groups * GS)
        scale_ptr += peer * n_groups
        out_ptr += peer * n
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, COLS)
        idx = rows[:, None] * GS + cols[None, :]
        m = (cols[None, :] < GS) & (idx < n)
        c = tl.load(data_ptr + idx, mask=m, other=0).to(tl.int32)
        s = tl.load(scale_ptr + rows, mask=rows < n_groups, other=0.0)
        v = fp8_decode_tl(c, M, BIAS, EMIN, IS_E4M3) * s[:, None]
        tl.store(out_ptr + idx, cast_out_tl(v, out_ptr.dtype.element_ty, FAST), mask=m)


def quantize_fp8(x: torch.Tensor, *, fmt: str = "e4m3", group_size: int = 128, nonfinite: str = "zero",
                 backend: str = "auto") -> QTensor:
    """FP8 quantization with one fp32 scale per group; ``data`` is the uint8 view of the fp8 codes.
    ``nonfinite="nan"``: a group with a NaN or an infinity gets a NaN scale (module doc)."""
    _, m, bias, emin, fmax = _fmt(fmt)
    _check_nonfinite(nonfinite)
    if not (1 <= group_size <= 4096):
        raise ValueError(f"group_size must be in [1, 4096], got {group_size}")
    if resolve(backend, x) == "torch":
        return quantize_fp8_ref(x, fmt=fmt, group_size=group_size, nonfinite=nonfinite)
    xf = x.reshape(-1).contiguous()
    n = xf.numel()
    g = -(-n // group_size)
    data = torch.empty(g * group_size, dtype=torch.uint8, device=x.device)
    scale = torch.empty(g, dtype=torch.float32, device=x.device)
    if g:
        cols, rows, warps = tile_shape(group_size)
        launch(_qfp8_kernel, (triton.cdiv(g, rows),), xf, data, scale, n, g, FMAX=fmax,
               GS=group_size, COLS=cols, ROWS=rows, M=m, BIAS=bias, EMIN=emin, KEEP_NAN=nonfinite == "nan",
               num_warps=warps)
    return QTensor(data, scale, None, x.shape, x.dtype, 8, group_size, True, fmt)


def dequantize_fp8(q: QTensor, *, dtype: torch.dtype | None = None, backend: str = "auto") -> torch.Tensor:
    """Values of an FP8 QTensor (stacked: ``(k, *shape)``), in ``dtype`` or the original dtype."""
    _, m, bias, emin, _ = _fmt(q.fmt)
    dtype = dtype or q.dtype
    if resolve(backend, q.data) == "torch":
        return dequantize_fp8_ref(q, dtype)
    k = q.num_peers
    out = torch.empty(*((k,) if q.stacked else ()), *q.shape, dtype=dtype, device=q.device)
    g = q.num_groups
    if g and k:
        cols, rows, warps = tile_shape(q.group_size)
        launch(_dqfp8_kernel, (triton.cdiv(g, rows), k), q.data.contiguous(), q.scale.contiguous(),
               out, q.numel, g, GS=q.group_size, COLS=cols, ROWS=rows, M=m, BIAS=bias, EMIN=emin,
               IS_E4M3=q.fmt == "e4m3", FAST=fast_bits(), num_warps=warps)
    return out

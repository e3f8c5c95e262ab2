"""NVFP4-style 4-bit floating point: E2M1 values in 16-element blocks, E4M3 block scales,
one fp32 tensor scale. Pure-torch reference and Triton kernels behind one dispatcher
(``backend="auto" | "torch" | "triton"``), bit-identical to each other.

Math (every division is one IEEE fp32 division, :func:`~leantrain.ops.tiles.ieee_div` in
torch, ``tl.div_rn`` in Triton, so the result does not depend on the device):
    tensor_scale = amax(x) / (6 * 448)                          (fp32; 0 for an all-zero x)
    s_b          = e4m3_rne(min(amax_b / 6 / tensor_scale, 448)) per 16-block b, stored as E4M3 bits
    code         = e2m1_rne(x * (1 / (s_b * tensor_scale)))      values {0, .5, 1, 1.5, 2, 3, 4, 6}, sign bit 3
    x'           = e2m1(code) * s_b * tensor_scale
``e4m3_rne`` is torch's ``.to(torch.float8_e4m3fn)`` (round to nearest even, subnormals
included); ``e2m1_rne`` rounds to the nearest E2M1 magnitude, ties to the even index (0.25 -> 0,
0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), after clamping to [-6, 6]; blocks
whose ``s_b * tensor_scale`` is 0 encode as zeros. Codes of negative values get bit 3; a
negative value that rounds to 0 is stored as +0 (code 0, no negative zero); code 8 decodes to +0.
Two codes per byte (even element in the low nibble). Non-finite inputs are treated as 0
(excluded from both amaxes, encoded as 0).

Options for gradients on the wire (GIFT's 4-bit all-reduce), each off by default:
- ``stochastic=True, seed``: ``code = lo + (u < p)``, with ``lo`` the E2M1 magnitude at or below
  ``a = |y|``, ``p = (a - E2M1[lo]) / (E2M1[lo + 1] - E2M1[lo])`` (exact: a subtraction and a
  power of two) and ``u = hash_uniform(seed, element index)`` of :mod:`leantrain.ops.rng`: the decoded
  value's expectation is ``x`` (to the 2**-16 resolution of ``u``), when nothing is clamped.
- ``scale_round="up"``: ``s_b`` is the E4M3 value at or above ``min(amax_b / 6 / tensor_scale, 448)``
  (the cast, then the next code where the cast went down), so ``|y| <= 6`` up to one fp32 rounding
  and stochastic rounding stays unbiased on the block's largest element.
- ``nonfinite="nan"``: a block holding a NaN or an infinity gets the E4M3 NaN byte ``0x7F`` as its
  scale, so it decodes as NaN (a gradient's overflow stays visible after the trip).
- ``local_scale=True``: one fp32 scale per 4096 elements (256 blocks, one Triton program) in place of
  the tensor's: ``tensor_scale`` is then a vector, the quantize reads ``x`` once (no amax pass) and the
  block scales sit closer to their blocks' range; 4 more bytes a 4096 elements.

Triton path: the tensor scale needs the global amax before any block can be encoded, so
quantize is two passes over ``x``: a small kernel writes one partial amax (finite values) per
4096 elements, torch reduces the partials (exact: max is order-free) and divides by 2688; then
the encode kernel reads ``x`` again. The E4M3 scale is encoded with integer arithmetic on the
fp32 bits (:func:`~leantrain.ops.fp8.fp8_encode_tl`) and the E2M1 code with seven
comparisons, so no hardware fp8/fp4 conversion is involved and the interpreter and any GPU
give the same bytes.

Tiling (Triton): one program owns a ``[256, 16]`` tile (256 whole blocks, 4096 elements);
amax pass: one program per 4096 elements.
Bytes per element: quantize reads 2 * sizeof(x) (amax pass + encode pass) and writes
0.5 (codes) + 1/16 (block scale) (+ 4/numel tensor scale, + 4/4096 amax partials);
dequantize reads 0.5 + 1/16 and writes sizeof(dtype).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from leantrain.ops._backend import HAS_TRITON, launch, resolve
from leantrain.ops.rng import hash_uniform, kernel_key
from leantrain.ops.tiles import fast_bits, ieee_div

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_MIDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
BLOCK = 16
_TS_DIV = 6.0 * 448.0  # tensor_scale = amax / (E2M1 max * E4M3 max)
_ROWS = 256            # blocks per program: a [256, 16] tile, 4096 elements
_AMAX_BLOCK = 4096     # elements per program of the amax pass


@dataclass
class NVFP4Tensor:
    data: torch.Tensor          # uint8 [ceil(numel / 16) * 8]: two E2M1 codes per byte
    block_scale: torch.Tensor   # uint8 [ceil(numel / 16)]: E4M3 bit patterns
    tensor_scale: torch.Tensor  # fp32 scalar
    shape: torch.Size
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.block_scale.numel() + 4 * self.tensor_scale.numel()

    def block_tensor_scale(self) -> torch.Tensor:
        """The fp32 scale each block's E4M3 scale multiplies: the tensor's, or its 4096-element group's."""
        if self.tensor_scale.dim() == 0:
            return self.tensor_scale.expand(self.block_scale.numel())
        return self.tensor_scale.repeat_interleave(_ROWS)[:self.block_scale.numel()]


def _e2m1_rne(a: torch.Tensor) -> torch.Tensor:
    """Index 0..7 of the nearest E2M1 magnitude to ``a >= 0`` (ties to even index)."""
    mids = _MIDS.to(a.device)
    lo = torch.bucketize(a, mids, right=False)
    hi = torch.bucketize(a, mids, right=True)
    return torch.where((lo != hi) & (lo % 2 == 1), hi, lo)


def _tensor_scale(amax: torch.Tensor) -> torch.Tensor:
    return ieee_div(amax.to(torch.float32), _TS_DIV)


# ----------------------------------------------------------------------------- torch reference


_LOWER = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0)  # the E2M1 magnitudes that start an interval of stochastic rounding
_FMAX32 = 3.4028234663852886e38  # the largest finite fp32
_INV_STEP = torch.tensor([2.0, 2.0, 2.0, 2.0, 1.0, 1.0, 0.5])  # 1 / the interval's width (exact)


def _check_options(scale_round: str, nonfinite: str) -> None:
    if scale_round not in ("nearest", "up"):
        raise ValueError(f"scale_round must be 'nearest' or 'up', got {scale_round!r}")
    if nonfinite not in ("zero", "nan"):
        raise ValueError(f"nonfinite must be 'zero' or 'nan', got {nonfinite!r}")


def quantize_nvfp4_ref(x: torch.Tensor, *, stochastic: bool = False, seed: int = 0, scale_round: str = "nearest",
                       nonfinite: str = "zero", local_scale: bool = False) -> NVFP4Tensor:
    """NVFP4 quantization of the flattened ``x`` (any shape, numel >= 0), pure torch."""
    _check_options(scale_round, nonfinite)
    flat = x.reshape(-1).to(torch.float32)
    n = flat.numel()
    nb = -(-n // BLOCK)
    bad = torch.zeros(nb * BLOCK, dtype=torch.bool, device=x.device)
    bad[:n] = ~torch.isfinite(flat)
    flat = torch.where(torch.isfinite(flat), flat, 0.0)
    xg = torch.zeros(nb * BLOCK, dtype=torch.float32, device=x.device)
    xg[:n] = flat
    xg = xg.view(nb, BLOCK)
    bamax = xg.abs().amax(1) if nb else xg.new_zeros(0)
    if local_scale:  # one scale per 256 blocks
        groups = -(-nb // _ROWS)
        gmax = torch.zeros(groups * _ROWS, device=x.device)
        gmax[:nb] = bamax
        ts = _tensor_scale(gmax.view(groups, _ROWS).amax(1))
        tsb = ts.repeat_interleave(_ROWS)[:nb]
    else:
        ts = _tensor_scale(xg.abs().max() if n else torch.zeros((), device=x.device))
        tsb = ts.expand_as(bamax)
    ts_safe = torch.where(tsb > 0, tsb, 1.0)
    s = torch.where(tsb > 0, ieee_div(ieee_div(bamax, 6.0), ts_safe), 0.0).clamp(max=448.0)
    s8 = s.to(torch.float8_e4m3fn)
    if scale_round == "up":  # (s <= 448, so a cast that went down has a next code, at most 448's)
        s8 = torch.where(s8.to(torch.float32) < s, s8.view(torch.uint8) + 1, s8.view(torch.uint8)).view(torch.float8_e4m3fn)
    eff = s8.to(torch.float32) * tsb
    inv = torch.where(eff > 0, ieee_div(torch.ones_like(eff), torch.where(eff > 0, eff, 1.0)), 0.0)
    inv = inv.clamp(max=_FMAX32)  # (1 / a subnormal unit overflows: x * inf would give NaN at x = 0)
    y = (xg * inv[:, None]).clamp(-6, 6)
    a = y.abs()
    if stochastic:
        lo = sum((a >= t).to(torch.int64) for t in _LOWER)
        glo = E2M1_VALUES.to(a.device)[lo]
        p = (a - glo) * _INV_STEP.to(a.device)[lo]
        u = hash_uniform(seed, torch.arange(nb * BLOCK, device=x.device)).view(nb, BLOCK)
        idx = lo + (u < p).to(torch.int64)
    else:
        idx = _e2m1_rne(a)
    code = idx | ((y < 0).to(torch.int64) << 3)
    code = torch.where(code == 8, 0, code)  # no negative zero
    byte = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8).reshape(-1)
    sbytes = s8.view(torch.uint8)
    if nonfinite == "nan":
        sbytes = torch.where(bad.view(nb, BLOCK).any(1), 0x7F, sbytes)
    return NVFP4Tensor(byte, sbytes, ts.to(torch.float32), x.shape, x.dtype)


def dequantize_nvfp4_ref(q: NVFP4Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    d = q.data.to(torch.int64)
    code = torch.stack([d & 0xF, d >> 4], -1).reshape(-1, BLOCK)
    mag = E2M1_VALUES.to(q.data.device)[code & 7]
    v = torch.where((code >= 8) & (mag > 0), -mag, mag)  # code 8 ("-0") -> +0.0, as the kernel
    eff = q.block_scale.view(torch.float8_e4m3fn).to(torch.float32) * q.block_tensor_scale()
    eff = torch.where(eff == 0, 0.0, eff)  # a -0 block scale (never written) decodes as +0, as the kernel
    v = (v * eff[:, None]).reshape(-1)[: q.numel]
    return v.reshape(q.shape).to(dtype or q.dtype)


# ----------------------------------------------------------------------------- Triton kernels

if HAS_TRITON:
    import triton
    import triton.language as tl

    from leantrain.ops.fp8 import fp8_decode_tl, fp8_encode_tl
    from leantrain.ops.quant_tl import pack_tile_tl, unpack_tile_tl
    from leantrain.ops.rng import uniform1_tl
    from leantrain.ops.tl_helpers import cast_out_tl

    @triton.jit
    def _amax_partial_kernel(x_ptr, part_ptr, n, BLOCK_N: tl.constexpr):
        """``part[p] = max |x|`` over the finite elements of the p-th 4096-element chunk."""
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        a = tl.abs(tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32))
        a = tl.where(a < float("inf"), a, 0.0)  # NaN and +-inf -> 0
        tl.store(part_ptr + pid, tl.max(a, axis=0))

    @triton.jit(do_not_specialize=["key"])
    def _qnvfp4_kernel(x_ptr, ts_ptr, data_ptr, bs_ptr, n, n_blocks, key, ROWS: tl.constexpr,
                       STOCHASTIC: tl.constexpr, SCALE_UP: tl.constexpr, KEEP_NAN: tl.constexpr,
                       LOCAL: tl.constexpr, IDX32: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, 16)
        idx = rows[:, None] * 16 + cols[None, :]
        x = tl.load(x_ptr + idx, mask=idx < n, other=0.0).to(tl.float32)
        finite = tl.abs(x) < float("inf")
        x = tl.where(finite, x, 0.0)  # NaN and +-inf -> 0
        bamax = tl.max(tl.abs(x), axis=1)
        if LOCAL:  # this program's 256 blocks share a scale: amax / 2688, written here
            ts = tl.div_rn(tl.zeros_like(bamax) + tl.max(bamax, axis=0), tl.zeros_like(bamax) + 2688.0)
            tl.store(ts_ptr + tl.program_id(0), tl.max(ts, axis=0))
        else:
            ts = tl.load(ts_ptr)
        six = tl.zeros_like(bamax) + 6.0
        ts_safe = tl.zeros_like(bamax) + tl.where(ts > 0, ts, 1.0)
        s = tl.where(ts > 0, tl.div_rn(tl.div_rn(bamax, six), ts_safe), 0.0)
        s = tl.minimum(s, 448.0)
        s8 = fp8_encode_tl(s, 3, 7, -6)  # E4M3 bits, RNE, == torch's cast (s >= 0, <= 448)
        if SCALE_UP:
            s8 = tl.where(fp8_decode_tl(s8, 3, 7, -6, True) < s, s8 + 1, s8)
        eff = fp8_decode_tl(s8, 3, 7, -6, True) * ts
        inv = tl.where(eff > 0, tl.div_rn(tl.zeros_like(eff) + 1.0, tl.where(eff > 0, eff, 1.0)), 0.0)
        inv = tl.minimum(inv, 3.4028234663852886e38)  # (1 / a subnormal unit overflows; as the reference)
        y = x * inv[:, None]  # (one division a block, not one an element)
        y = tl.minimum(tl.maximum(y, -6.0), 6.0)
        a = tl.abs(y)
        if STOCHASTIC:  # the magnitude below, plus one with probability of the distance to it
            lo = ((a >= 0.5).to(tl.int32) + (a >= 1.0).to(tl.int32) + (a >= 1.5).to(tl.int32)
                  + (a >= 2.0).to(tl.int32) + (a >= 3.0).to(tl.int32) + (a >= 4.0).to(tl.int32))
            glo = tl.where(lo < 4, lo.to(tl.float32) * 0.5, tl.where(lo == 4, 2.0, tl.where(lo == 5, 3.0, 4.0)))
            p = (a - glo) * tl.where(lo < 4, 2.0, tl.where(lo < 6, 1.0, 0.5))  # (exact: powers of two)
            if IDX32:  # (an index below 2**32: the hash's one-word form, the same bits)
                u = uniform1_tl(key, idx.to(tl.uint32)) - 1.0
            else:
                u = uniform1_tl(key, idx) - 1.0  # (exact: 1 + u holds u's 17 bits)
            code = lo + (u < p).to(tl.int32)
        else:
            # nearest E2M1 index: count of midpoints below a; a tie on an odd-index midpoint
            # (0.75, 1.75, 3.5) goes up to the even index, one on an even-index midpoint stays
            code = ((a > 0.25).to(tl.int32) + (a > 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
                    + (a > 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a > 3.5).to(tl.int32)
                    + (a > 5.0).to(tl.int32))
            code += ((a == 0.75) | (a == 1.75) | (a == 3.5)).to(tl.int32)
        code = code | ((y < 0).to(tl.int32) << 3)
        code = tl.where(code == 8, 0, code)  # no negative zero
        byts = pack_tile_tl(code, ROWS, 16, 4)
        rmask = rows < n_blocks
        bcols = tl.arange(0, 8)
        tl.store(data_ptr + rows[:, None] * 8 + bcols[None, :], byts, mask=rmask[:, None])
        if KEEP_NAN:
            s8 = tl.where(tl.max(tl.where(finite, 0, 1), axis=1) > 0, 0x7F, s8)
        tl.store(bs_ptr + rows, s8.to(tl.uint8), mask=rmask)

    @triton.jit
    def _dqnvfp4_kernel(data_ptr, bs_ptr, ts_ptr, out_ptr, n, n_blocks, ROWS: tl.constexpr, FAST: tl.constexpr,
                        LOCAL: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        rmask = rows < n_blocks
        bcols = tl.arange(0, 8)
        b = tl.load(data_ptr + rows[:, None] * 8 + bcols[None, :], mask=rmask[:, None], other=0)
        code = unpack_tile_tl(b, ROWS, 8, 4, False)  # [ROWS, 16], unsigned 0..15
        e = (code >> 1) & 3
        m = code & 1
        normal = (((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)  # (1 + m/2) * 2**(e-1)
        mag = tl.where(e == 0, m.to(tl.float32) * 0.5, normal)
        # code 8 ("-0", never written by quantize) decodes to +0.0 in both backends: the GPU
        # compiler does not keep the sign of a zero through a select
        v = tl.where((code >= 8) & (mag > 0), -mag, mag)
        s8 = tl.load(bs_ptr + rows, mask=rmask, other=0).to(tl.int32)
        if LOCAL:
            ts = tl.load(ts_ptr + tl.program_id(0))
        else:
            ts = tl.load(ts_ptr)
        eff = fp8_decode_tl(s8, 3, 7, -6, True) * ts
        eff = tl.where(eff == 0.0, 0.0, eff)  # a -0 block scale (never written) decodes as +0
        v = v * eff[:, None]
        cols = tl.arange(0, 16)
        idx = rows[:, None] * 16 + cols[None, :]
        tl.store(out_ptr + idx, cast_out_tl(v, out_ptr.dtype.element_ty, FAST), mask=idx < n)


def _quantize_nvfp4_triton(x: torch.Tensor, stochastic: bool, seed: int, scale_round: str,
                           nonfinite: str, local_scale: bool) -> NVFP4Tensor:
    xf = x.reshape(-1)
    if not xf.is_contiguous():
        xf = xf.contiguous()
    n = xf.numel()
    nb = -(-n // BLOCK)
    data = torch.empty(nb * BLOCK // 2, dtype=torch.uint8, device=x.device)
    bs = torch.empty(nb, dtype=torch.uint8, device=x.device)
    if n == 0:
        ts = torch.zeros((0,) if local_scale else (), dtype=torch.float32, device=x.device)
        return NVFP4Tensor(data, bs, ts, x.shape, x.dtype)
    if local_scale:  # (written by the encode kernel, one a program)
        ts = torch.empty(triton.cdiv(nb, _ROWS), dtype=torch.float32, device=x.device)
    else:
        parts = torch.empty(triton.cdiv(n, _AMAX_BLOCK), dtype=torch.float32, device=x.device)
        launch(_amax_partial_kernel, (parts.numel(),), xf, parts, n, BLOCK_N=_AMAX_BLOCK, num_warps=8)
        ts = _tensor_scale(parts.amax())
    launch(_qnvfp4_kernel, (triton.cdiv(nb, _ROWS),), xf, ts, data, bs, n, nb, kernel_key(seed), ROWS=_ROWS,
           STOCHASTIC=stochastic, SCALE_UP=scale_round == "up", KEEP_NAN=nonfinite == "nan", LOCAL=local_scale,
           IDX32=nb * BLOCK < 2**32, num_warps=8)
    return NVFP4Tensor(data, bs, ts, x.shape, x.dtype)


def _dequantize_nvfp4_triton(q: NVFP4Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=dtype, device=q.data.device)
    n = q.numel
    nb = -(-n // BLOCK)
    if nb:
        ts = q.tensor_scale.to(device=q.data.device, dtype=torch.float32).reshape(-1).contiguous()
        launch(_dqnvfp4_kernel, (triton.cdiv(nb, _ROWS),), q.data.contiguous(), q.block_scale.contiguous(),
               ts, out, n, nb, ROWS=_ROWS, FAST=fast_bits(), LOCAL=q.tensor_scale.dim() == 1, num_warps=8)
    return out


# ----------------------------------------------------------------------------- public API


def quantize_nvfp4(x: torch.Tensor, *, stochastic: bool = False, seed: int = 0, scale_round: str = "nearest",
                   nonfinite: str = "zero", local_scale: bool = False, backend: str = "auto") -> NVFP4Tensor:
    """NVFP4 quantization of the flattened ``x`` (any shape, numel >= 0).

    See the module docstring for the math and the options (stochastic rounding of the elements from
    ``seed``, block scales rounded up, non-finite blocks kept as NaN, one fp32 scale per 4096 elements);
    the Triton path reads ``x`` twice (global amax pass, then the encode pass; once with
    ``local_scale``) and gives the same bytes as the torch reference.
    """
    _check_options(scale_round, nonfinite)
    if resolve(backend, x) == "triton":
        return _quantize_nvfp4_triton(x, stochastic, seed, scale_round, nonfinite, local_scale)
    return quantize_nvfp4_ref(x, stochastic=stochastic, seed=seed, scale_round=scale_round, nonfinite=nonfinite,
                              local_scale=local_scale)


def dequantize_nvfp4(q: NVFP4Tensor, *, dtype: torch.dtype | None = None, backend: str = "auto") -> torch.Tensor:
    """Values of ``q`` with its original shape, in ``dtype`` (default: the original dtype)."""
    dtype = dtype or q.dtype
    if resolve(backend, q.data) == "triton":
        return _dequantize_nvfp4_triton(q, dtype)
    return dequantize_nvfp4_ref(q, dtype)

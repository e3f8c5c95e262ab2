"""Block-wise integer quantization: int8 and int4 (two codes per byte), symmetric or not.

Math (per group ``g`` of ``group_size`` consecutive elements of the flattened tensor):
  symmetric:   qmax = 2**(bits-1) - 1 (127, 7);  scale = absmax / qmax
               code = clamp(round(x * pre * (qmax / (absmax * pre))), -qmax, qmax)
  asymmetric:  qmax = 2**bits - 1 (255, 15);    scale = (max - min) / qmax, zero = min
               code = clamp(round((x - min) * pre * (qmax / ((max - min) * pre))), 0, qmax)
  dequant:     x' = code * scale (+ zero)
``pre`` is 2**64 when the group's range is below 2**-64 (else 1): an exact power-of-two
rescale so that groups of denormals do not overflow ``qmax / range``. ``round`` is
``floor(y + 0.5)`` (round half up) for round-to-nearest and ``floor(y + (1 + u)) - 1`` with
``u = hash_uniform(seed, element_index)`` for stochastic rounding (``1 + u`` is exact; unbiased
up to 2**-17 of a step, the resolution of ``u``: see :mod:`leantrain.ops.rng`; 4-bit kernels
draw the two uniforms of a byte from one hash, :func:`~leantrain.ops.quant_tl.encode_pack_tl`).
Every step is one IEEE fp32 operation done in the same order by both backends (Triton with
FMA contraction off; divisions with ``tl.div_rn``, since Triton's ``/`` is the
approximate ``div.full.f32`` on NVIDIA GPUs; torch divides two tensors of one shape, see
:func:`ieee_div`), so codes, scales and dequantized values are
bit-identical between torch and Triton.

Special values: non-finite inputs (NaN, +-inf) are treated as 0 — excluded from the scale and
encoded as the code of 0 (dequantize to 0 for symmetric, to the nearest level of 0 for
asymmetric). Callers that must see non-finite values check for them before quantizing.
All-zero groups get scale 0 and dequantize to exact zeros.

Tiling (Triton): one program owns ``ROWS`` whole groups (a ``[ROWS, group_size]`` tile, about
4096 elements), reduces absmax/min/max along the row, writes codes and one scale per row.
4 bits from bf16 / fp16 read the tile as ``[ROWS, group_size / 2]`` 32-bit words, one word per
output byte (:func:`~leantrain.ops.quant_tl.encode_words_tl`: no even/odd split of the tile).
On a GPU (the ``FAST_*`` flags of :mod:`leantrain.ops.tiles`) rounding is one add rounded toward
-inf whose bits are the code, codes become floats by their bits and bf16 outputs use the hardware
cast: no conversion instructions, the same results as the portable path the interpreter runs.
The tile functions live in :mod:`leantrain.ops.quant_tl`; this module holds the torch reference,
the two kernels and their launchers.
Bytes moved per element: quantize reads ``sizeof(x)`` and writes ``bits/8`` (+ 4/group_size
for the scale); dequantize the reverse.
"""

from __future__ import annotations

import torch

from leantrain.ops._backend import HAS_TRITON, launch, resolve
from leantrain.ops.fp8 import dequantize_fp8
from leantrain.ops.qtensor import QTensor
from leantrain.ops.rng import hash_uniform, kernel_key
from leantrain.ops.tiles import (
    PRE_SCALE,
    TINY,
    TINY_RANGE,
    Tile,
    check_int_format,
    fast_bits,
    ieee_div,
    int_code_range,
    pad_groups,
    tile_shape,
)

# ----------------------------------------------------------------------------- torch reference


def encode_groups_ref(xg, valid, *, bits, symmetric, stochastic, seed, index=None):
    """Integer codes (int32), scale and zero of the fp32 groups ``xg [..., G, gs]``.

    The one definition of the quantizer; ``index`` gives each element's RNG counter
    (defaults to its flat position in ``xg``).
    """
    xg = torch.where(torch.isfinite(xg), xg, 0.0)
    lo, hi = int_code_range(bits, symmetric)
    if symmetric:
        rng = xg.abs().amax(-1) if xg.shape[-1] else xg.new_zeros(xg.shape[:-1])
        base, zero = xg, None
    else:
        inf = torch.tensor(float("inf"), device=xg.device)
        mn = torch.where(valid, xg, inf).amin(-1)
        mx = torch.where(valid, xg, -inf).amax(-1)
        rng = mx - mn
        base, zero = xg - mn.unsqueeze(-1), mn
    pre = torch.where(rng < TINY_RANGE, PRE_SCALE, 1.0)
    scale = ieee_div(rng, hi)
    inv = torch.where(rng > 0, ieee_div(hi, torch.where(rng > 0, rng * pre, 1.0)), 0.0)
    y = (base * pre.unsqueeze(-1)) * inv.unsqueeze(-1)
    if stochastic:
        if index is None:
            index = torch.arange(xg.numel(), device=xg.device).view(xg.shape)
        code = torch.floor(y + (1.0 + hash_uniform(seed, index))) - 1
    else:
        code = torch.floor(y + 0.5)
    code = code.clamp(lo, hi).to(torch.int32)
    return code, scale, zero


def pack_codes(code: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 codes ``[..., G, gs]`` -> uint8 bytes ``[..., G * gs * bits // 8]``."""
    if bits == 8:
        b = code & 0xFF
    else:
        c = code & 0xF
        b = c[..., 0::2] | (c[..., 1::2] << 4)
    return b.to(torch.uint8).reshape(*code.shape[:-2], -1)


def unpack_codes(data: torch.Tensor, bits: int, symmetric: bool, group_size: int) -> torch.Tensor:
    """uint8 bytes ``[..., B]`` -> int32 codes ``[..., G, gs]`` (sign-extended if symmetric)."""
    d = data.to(torch.int32)
    if bits == 8:
        c = d
        if symmetric:
            c = c - ((c >= 128).to(torch.int32) << 8)
    else:
        c = torch.stack([d & 0xF, d >> 4], dim=-1).flatten(-2)
        if symmetric:
            c = c - ((c >= 8).to(torch.int32) << 4)
    return c.reshape(*data.shape[:-1], -1, group_size)


def quantize_ref(x, *, bits=8, group_size=128, symmetric=True, stochastic=False, seed=0, exp=False) -> QTensor:
    xg, valid = pad_groups(x.float().exp() if exp else x, group_size)
    code, scale, zero = encode_groups_ref(xg, valid, bits=bits, symmetric=symmetric,
                                          stochastic=stochastic, seed=seed)
    return QTensor(pack_codes(code, bits), scale, zero, x.shape, x.dtype, bits, group_size, symmetric)


def dequantize_ref(q: QTensor, dtype=None, log=False) -> torch.Tensor:
    """fp values of ``q`` (a stacked QTensor gives ``(k, *shape)``); ``log``: ``log(max(v, TINY))``."""
    code = unpack_codes(q.data, q.bits, q.symmetric, q.group_size)
    v = code.to(torch.float32) * q.scale.unsqueeze(-1)
    if q.zero is not None:
        v = v + q.zero.unsqueeze(-1)
    if log:
        v = v.clamp_min(TINY).log()
    lead = q.data.shape[:-1]
    v = v.reshape(*lead, -1)[..., : q.numel]
    return v.reshape(*lead, *q.shape).to(dtype or q.dtype)


if HAS_TRITON:
    import triton
    import triton.language as tl

    from leantrain.ops.quant_tl import (
        dequant_tile_tl,
        encode_pack_tl,
        encode_words_tl,
        store_packed_tl,
        tile_index_tl,
    )
    from leantrain.ops.tl_helpers import cast_out_tl

    @triton.jit(do_not_specialize=["key"])
    def _quantize_kernel(x_ptr, data_ptr, scale_ptr, zero_ptr, n, n_groups, key,
                         GS: tl.constexpr, COLS: tl.constexpr, ROWS: tl.constexpr,
                         BITS: tl.constexpr, SYMMETRIC: tl.constexpr, STOCHASTIC: tl.constexpr,
                         QLO: tl.constexpr, QHI: tl.constexpr, IDX32: tl.constexpr,
                         PAIRS: tl.constexpr, FAST: tl.constexpr, WORDS: tl.constexpr, EXP: tl.constexpr = False):
        """``WORDS`` (4 bits, bf16 = 1 / fp16 = 2 input): ``x_ptr`` is the input as int32 words.
        ``EXP`` (not with WORDS): quantize ``exp(x)``, computed in fp32 registers."""
        row0 = tl.program_id(0).to(tl.int64) * ROWS        # int64 only per program
        if WORDS:
            byts, scale, zero = encode_words_tl(x_ptr, row0, n, key, WORDS, GS, COLS, ROWS, QLO, QHI, SYMMETRIC,
                                                STOCHASTIC, IDX32, FAST)
        else:
            base, rem, loc, valid, idx = tile_index_tl(row0, n, GS, COLS, ROWS, IDX32)
            x = tl.load(x_ptr + base + loc, mask=valid, other=0.0).to(tl.float32)
            if EXP:
                x = tl.exp(x)
            byts, scale, zero = encode_pack_tl(x, valid, idx, key, ROWS, COLS, BITS, QLO, QHI, SYMMETRIC,
                                               STOCHASTIC, PAIRS, FAST)
        store_packed_tl(data_ptr, scale_ptr, zero_ptr, byts, scale, zero, row0, n_groups, GS, COLS, ROWS,
                        BITS, SYMMETRIC)

    @triton.jit
    def _dequantize_kernel(data_ptr, scale_ptr, zero_ptr, out_ptr, n, n_groups,
                           GS: tl.constexpr, COLS: tl.constexpr, ROWS: tl.constexpr,
                           BITS: tl.constexpr, SYMMETRIC: tl.constexpr, FAST: tl.constexpr,
                           LOG: tl.constexpr = False):
        """``LOG``: write ``log(max(v, TINY))`` (the values are probabilities)."""
        peer = tl.program_id(1).to(tl.int64)
        data_ptr += peer * (n_groups * GS * BITS // 8)
        scale_ptr += peer * n_groups
        zero_ptr += peer * n_groups  # (the scale pointer again when symmetric: never read)
        out_ptr += peer * n
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        v = dequant_tile_tl(data_ptr, scale_ptr, zero_ptr, rows, rows < n_groups, GS, COLS, ROWS, BITS, SYMMETRIC,
                            FAST)
        if LOG:
            v = tl.log(tl.maximum(v, 1.1754943508222875e-38))
        cols = tl.arange(0, COLS)
        idx = rows[:, None] * GS + cols[None, :]
        tl.store(out_ptr + idx, cast_out_tl(v, out_ptr.dtype.element_ty, FAST), mask=(cols[None, :] < GS) & (idx < n))


PAIR_SR = True  # 4-bit stochastic rounding: one hash per byte (encode_pack_tl; same codes)
WORD_PAIRS = True  # 4 bits from bf16 or fp16: read the tensor as 32-bit words (encode_words_tl); measured on
#   an H200 (tune_kernels --what fast): int4 SR from bf16 46 -> 50 % of a copy. (Writing dequantized
#   pairs as words was slower, 81 -> 63 %: not done.)
_HALF_KIND = {torch.bfloat16: 1, torch.float16: 2}
_IDX32_LIMIT = 2**32  # outputs up to this many elements use the uint32 RNG counter


def word_kind(bits: int, dtype: torch.dtype, n: int, *ptrs: int) -> int:
    """1 (bf16) / 2 (fp16) when a 16-bit tensor of ``n`` elements at the addresses ``ptrs``
    can be read as 32-bit words for 4-bit quantization (:data:`WORD_PAIRS`), else 0 (8 bits: the
    word path compiles to more instructions, SASS counted)."""
    ok = WORD_PAIRS and bits == 4 and n % 2 == 0 and all(p % 4 == 0 for p in ptrs)
    return _HALF_KIND.get(dtype, 0) if ok else 0


QUANT_WARPS = 0  # quantize's warps per program (0: tile_shape's choice)
WORD_TILE = Tile(elems=4096, warps=4)  # per program of the 4-bit word path: 32 elements a thread


def _quantize_triton(x, bits, group_size, symmetric, stochastic, seed, exp=False) -> QTensor:
    xf = x.reshape(-1)
    if not xf.is_contiguous():
        xf = xf.contiguous()
    n = xf.numel()
    words = 0 if exp else word_kind(bits, xf.dtype, n, xf.data_ptr())
    g = -(-n // group_size)
    data = torch.empty(g * group_size * bits // 8, dtype=torch.uint8, device=x.device)
    scale = torch.empty(g, dtype=torch.float32, device=x.device)
    zero = None if symmetric else torch.empty(g, dtype=torch.float32, device=x.device)
    if g:
        word_elems, word_warps, _ = Tile(*WORD_TILE)
        cols, rows, warps = tile_shape(group_size, word_elems if words else 0)
        warps = (word_warps if words else QUANT_WARPS) or warps
        qlo, qhi = int_code_range(bits, symmetric)
        launch(_quantize_kernel, (triton.cdiv(g, rows),), xf.view(torch.int32) if words else xf, data, scale,
               scale if zero is None else zero, n, g, kernel_key(seed), GS=group_size, COLS=cols,
               ROWS=rows, BITS=bits, SYMMETRIC=symmetric, STOCHASTIC=stochastic, QLO=qlo, QHI=qhi,
               IDX32=g * group_size <= _IDX32_LIMIT, PAIRS=PAIR_SR, FAST=fast_bits(), WORDS=words, EXP=exp,
               num_warps=warps)
    return QTensor(data, scale, zero, x.shape, x.dtype, bits, group_size, symmetric)


def _dequantize_triton(q: QTensor, dtype, log=False) -> torch.Tensor:
    k = q.num_peers
    lead = (k,) if q.stacked else ()
    out = torch.empty(*lead, *q.shape, dtype=dtype, device=q.device)
    g = q.num_groups
    if g and k:
        cols, rows, warps = tile_shape(q.group_size)
        data, scale = q.data.contiguous(), q.scale.contiguous()
        zero = scale if q.zero is None else q.zero.contiguous()
        launch(_dequantize_kernel, (triton.cdiv(g, rows), k), data, scale, zero, out, q.numel, g,
               GS=q.group_size, COLS=cols, ROWS=rows, BITS=q.bits, SYMMETRIC=q.symmetric, FAST=fast_bits(),
               LOG=log, num_warps=warps)
    return out


# ----------------------------------------------------------------------------- public API


def quantize(x: torch.Tensor, *, bits: int = 8, group_size: int = 128, symmetric: bool = True,
             stochastic: bool = False, seed: int = 0, exp: bool = False, backend: str = "auto") -> QTensor:
    """Block-wise int8/int4 quantization of the flattened ``x`` (any shape, any numel >= 0).

    See the module docstring for the exact math, rounding and special values. ``exp``: quantize
    ``exp(x)`` instead (fp32, inside the kernel: no tensor of it is made; AGoQ stores a
    log-softmax as probabilities). The Triton kernel's ``exp`` may differ from torch's in the
    last bits, so a code can differ by one step from the reference's.
    """
    check_int_format(bits, group_size)
    if not x.is_floating_point():
        raise TypeError(f"quantize expects a floating-point tensor, got {x.dtype}")
    if resolve(backend, x) == "triton":
        return _quantize_triton(x, bits, group_size, symmetric, stochastic, seed, exp)
    return quantize_ref(x, bits=bits, group_size=group_size, symmetric=symmetric,
                        stochastic=stochastic, seed=seed, exp=exp)


def dequantize(q: QTensor, *, dtype: torch.dtype | None = None, log: bool = False,
               backend: str = "auto") -> torch.Tensor:
    """Values of ``q`` with its original shape and dtype (or ``dtype``).

    Works for integer and FP8 QTensors; a stacked QTensor gives ``(k, *shape)``. ``log``
    (integer QTensors): ``log(max(v, TINY))`` of the values, in the same pass (the inverse of
    ``quantize(..., exp=True)``; ``TINY``, fp32's smallest normal, keeps ``log`` finite).
    """
    if q.fmt != "int":
        if log:
            raise ValueError("dequantize(log=True) is for integer QTensors")
        return dequantize_fp8(q, dtype=dtype, backend=backend)
    dtype = dtype or q.dtype
    if resolve(backend, q.data) == "triton":
        return _dequantize_triton(q, dtype, log)
    return dequantize_ref(q, dtype, log)

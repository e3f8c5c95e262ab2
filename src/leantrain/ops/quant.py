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
draw the two uniforms of a byte from one hash, :func:`encode_pack_tl`).
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
output byte (:func:`encode_words_tl`: no even/odd split of the tile). On a GPU (``FAST``,
measured) rounding is one add rounded toward -inf whose bits are the code, codes become floats
by their bits and bf16 outputs use the hardware cast: no conversion instructions, the same
results as the portable path the interpreter runs.
Bytes moved per element: quantize reads ``sizeof(x)`` and writes ``bits/8`` (+ 4/group_size
for the scale); dequantize the reverse.
"""

from __future__ import annotations

import torch

from leantrain.ops._backend import HAS_TRITON, interpreting, launch, next_pow2, resolve
from leantrain.ops.qtensor import QTensor
from leantrain.ops.rng import hash_uniform, kernel_key

_TINY = 2.0**-64
TINY = torch.finfo(torch.float32).tiny  # dequantize(log=True) clamps here (the kernel's literal)
_PRE = 2.0**64


def ieee_div(a, b) -> torch.Tensor:
    """Correctly rounded ``a / b`` as the Triton kernels compute it.

    torch computes ``scalar / tensor`` as ``reciprocal(tensor) * scalar`` and may turn
    ``tensor / scalar`` into a multiply by the reciprocal (1 ulp off); dividing two tensors
    of one shape is a true IEEE division on every device.
    """
    a = a if isinstance(a, torch.Tensor) else torch.full_like(b, float(a))
    b = b if isinstance(b, torch.Tensor) else torch.full_like(a, float(b))
    return torch.div(a, b)


def _check(bits: int, group_size: int) -> None:
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if not (2 <= group_size <= 4096) or group_size % 2:
        raise ValueError(f"group_size must be an even number in [2, 4096] (32..4096 advised), got {group_size}")


def _qrange(bits: int, symmetric: bool) -> tuple[int, int]:
    return (-(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1) if symmetric else (0, 2**bits - 1)


# ----------------------------------------------------------------------------- torch reference


def _pad_groups(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten ``x`` (fp32), pad with zeros to whole groups; return ``(xg[G, gs], valid[G, gs])``."""
    flat = x.reshape(-1).to(torch.float32)
    n = flat.numel()
    g = -(-n // group_size)
    xg = torch.zeros(g * group_size, dtype=torch.float32, device=x.device)
    xg[:n] = flat
    valid = torch.arange(g * group_size, device=x.device) < n
    return xg.view(g, group_size), valid.view(g, group_size)


def encode_groups_ref(xg, valid, *, bits, symmetric, stochastic, seed, index=None):
    """Integer codes (int32), scale and zero of the fp32 groups ``xg [..., G, gs]``.

    The one definition of the quantizer; ``index`` gives each element's RNG counter
    (defaults to its flat position in ``xg``).
    """
    xg = torch.where(torch.isfinite(xg), xg, 0.0)
    lo, hi = _qrange(bits, symmetric)
    if symmetric:
        rng = xg.abs().amax(-1) if xg.shape[-1] else xg.new_zeros(xg.shape[:-1])
        base, zero = xg, None
    else:
        inf = torch.tensor(float("inf"), device=xg.device)
        mn = torch.where(valid, xg, inf).amin(-1)
        mx = torch.where(valid, xg, -inf).amax(-1)
        rng = mx - mn
        base, zero = xg - mn.unsqueeze(-1), mn
    pre = torch.where(rng < _TINY, _PRE, 1.0)
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
    xg, valid = _pad_groups(x.float().exp() if exp else x, group_size)
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


# ----------------------------------------------------------------------------- Triton kernels

if HAS_TRITON:
    import triton
    import triton.language as tl

    from leantrain.ops.rng import uniform1_pair_tl, uniform1_tl

    @triton.jit
    def _range_tl(x, valid, QHI: tl.constexpr, SYMMETRIC: tl.constexpr):
        """Row-wise ``(x with NaN/inf -> 0, base, scale, zero, pre, inv)`` of an fp32 tile: the
        codes are ``(base * pre[:, None]) * inv[:, None]`` rounded (see the module docstring)."""
        x = tl.where(tl.abs(x) < float("inf"), x, 0.0)  # NaN and +-inf -> 0
        x = tl.where(valid, x, 0.0)
        if SYMMETRIC:
            rng = tl.max(tl.abs(x), axis=1)
            zero = tl.zeros_like(rng)
            base = x
        else:
            mn = tl.min(tl.where(valid, x, float("inf")), axis=1)
            mx = tl.max(tl.where(valid, x, -float("inf")), axis=1)
            mn = tl.where(mx >= mn, mn, 0.0)  # rows past the end (no valid lane)
            mx = tl.where(mx >= mn, mx, 0.0)
            rng = mx - mn
            zero = mn
            base = x - mn[:, None]
        scale, pre, inv = _scale_tl(rng, QHI)
        return base, scale, zero, pre, inv

    @triton.jit
    def _scale_tl(rng, QHI: tl.constexpr):
        """(scale, pre, inv) of row ranges ``rng`` (module docstring)."""
        qhi = tl.zeros_like(rng) + QHI
        pre = tl.where(rng < 5.421010862427522e-20, 1.8446744073709552e19, 1.0)
        scale = tl.div_rn(rng, qhi)
        inv = tl.where(rng > 0, tl.div_rn(qhi, tl.where(rng > 0, rng * pre, 1.0)), 0.0)
        return scale, pre, inv

    @triton.jit
    def _round_tl(y, r, QLO: tl.constexpr, QHI: tl.constexpr, FAST: tl.constexpr, OFF: tl.constexpr):
        """int32 ``clamp(floor(y + r) - OFF, QLO, QHI)``: round-to-nearest is ``r = 0.5, OFF = 0``,
        stochastic rounding ``r = 1 + u, OFF = 1`` (module docstring). The clamp is done on
        ``w = y + r`` (integer bounds ``QLO + OFF``, ``QHI + OFF``). ``FAST & 1`` (GPU):
        ``floor(w) - OFF + 1.5 * 2**23`` is one fp32 add rounded toward -inf, whose low bits are
        the two's complement code, so neither the floor, the float-to-int conversion (the slow
        conversion pipe) nor the ``- OFF`` is executed; same codes.

        Symmetric codes (``QLO = -QHI``) skip the clamps that cannot act: there ``|y| <= QHI +
        ulp(QHI)`` (``y = x * RN(QHI / absmax)``, one rounding each) and ``r - OFF`` lies in
        ``[2**-17, 1 - 2**-17]`` (or is 1/2), so ``floor(w) - OFF >= -QHI`` always, and
        ``<= QHI`` whenever ``ulp(QHI) < 2**-17`` (4 bits: ulp(7) = 2**-21); int8 keeps the
        upper clamp."""
        w = y + r
        if QLO == -QHI:
            if QHI > 7:
                w = tl.minimum(w, QHI + OFF)
        else:
            w = tl.minimum(tl.maximum(w, QLO + OFF), QHI + OFF)
        if FAST & 1:
            if OFF == 0:
                m = tl.inline_asm_elementwise("add.rm.f32 $0, $1, 0f4B400000;", "=f,f", [w],
                                              dtype=tl.float32, is_pure=True, pack=1)
            else:
                m = tl.inline_asm_elementwise("add.rm.f32 $0, $1, 0f4B3FFFFF;", "=f,f", [w],
                                              dtype=tl.float32, is_pure=True, pack=1)
            return m.to(tl.int32, bitcast=True) - 0x4B400000
        else:
            return tl.floor(w).to(tl.int32) - OFF

    @triton.jit
    def _pack_pair_tl(y0, y1, key, pair, QLO: tl.constexpr, QHI: tl.constexpr, STOCHASTIC: tl.constexpr,
                      FAST: tl.constexpr):
        """The bytes of two 4-bit code tiles rounded from ``y0`` (low nibble) and ``y1``;
        stochastic rounding draws both uniforms of a byte from one hash of its ``pair`` index."""
        if STOCHASTIC:
            r0, r1 = uniform1_pair_tl(key, pair, FAST)
            c0 = _round_tl(y0, r0, QLO, QHI, FAST, 1)
            c1 = _round_tl(y1, r1, QLO, QHI, FAST, 1)
        else:
            c0 = _round_tl(y0, 0.5, QLO, QHI, FAST, 0)
            c1 = _round_tl(y1, 0.5, QLO, QHI, FAST, 0)
        return ((c0 & 0xF) | ((c1 & 0xF) << 4)).to(tl.uint8)

    @triton.jit
    def encode_tile_tl(x, valid, idx, key, QLO: tl.constexpr, QHI: tl.constexpr,
                       SYMMETRIC: tl.constexpr, STOCHASTIC: tl.constexpr, FAST: tl.constexpr):
        """Quantize an fp32 tile ``[ROWS, COLS]`` row-wise; returns (int32 codes, scale, zero).

        ``valid`` masks padding; ``idx`` holds each element's RNG counter; codes lie in
        [QLO, QHI]. Same math, same operation order as :func:`encode_groups_ref`.
        """
        y, scale, zero = _tile_y_tl(x, valid, QHI, SYMMETRIC, FAST)
        if STOCHASTIC:
            code = _round_tl(y, uniform1_tl(key, idx), QLO, QHI, FAST, 1)
        else:
            code = _round_tl(y, 0.5, QLO, QHI, FAST, 0)
        return code, scale, zero

    @triton.jit
    def _max_nan_tl(a, b):
        return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def _clean_scale_tl(rmax, QHI: tl.constexpr):
        """``(scale, inv1, clean)`` from the NaN-propagating row absmax ``rmax`` of a tile:
        ``inv1 = pre * inv`` and ``clean`` (a scalar) when every row is finite with ``inv1``
        finite (no denormal-range group), the case where ``y = x * inv1`` equals ``(x * pre) *
        inv`` (both exact power-of-two scalings of one rounding of ``x * pre * inv``)."""
        scale, pre, inv = _scale_tl(rmax, QHI)
        inv1 = pre * inv
        clean = tl.min(((rmax < float("inf")) & (inv1 < float("inf"))).to(tl.int32), axis=0)
        return scale, inv1, clean

    @triton.jit
    def _tile_y_tl(x, valid, QHI: tl.constexpr, SYMMETRIC: tl.constexpr, FAST: tl.constexpr):
        """``(y, scale, zero)`` of an fp32 tile ``[ROWS, COLS]``: the values to round, ``(base *
        pre) * inv`` (module docstring); ``FAST & 16``: the clean-tile branch of
        :func:`_pair_y_tl`."""
        if SYMMETRIC and (FAST & 16):
            x = tl.where(valid, x, 0.0)
            scale, inv1, clean = _clean_scale_tl(tl.reduce(tl.abs(x), 1, _max_nan_tl), QHI)
            if clean != 0:
                y = x * inv1[:, None]
                zero = tl.zeros_like(scale)
            else:
                y, scale, zero = _tile_y_general_tl(x, valid, QHI, SYMMETRIC)
            return y, scale, zero
        else:
            return _tile_y_general_tl(x, valid, QHI, SYMMETRIC)

    @triton.jit
    def _tile_y_general_tl(x, valid, QHI: tl.constexpr, SYMMETRIC: tl.constexpr):
        base, scale, zero, pre, inv = _range_tl(x, valid, QHI, SYMMETRIC)
        return (base * pre[:, None]) * inv[:, None], scale, zero

    @triton.jit
    def _pair_y_tl(x0, x1, v0, v1, QHI: tl.constexpr, SYMMETRIC: tl.constexpr, FAST: tl.constexpr,
                   WORD: tl.constexpr):
        """``(y0, y1, scale, zero)`` of a tile given as its even (``x0``) and odd (``x1``) columns
        (fp32; masks ``v0``, ``v1``; ``WORD``: one mask for both, and masked lanes hold 0): the
        values to round, ``(base * pre) * inv`` (module docstring).

        ``FAST & 16`` (GPU), symmetric: one NaN-propagating absmax per row, and when the tile is
        clean (:func:`_clean_scale_tl`) ``y = x * (pre * inv)``, without the per-element
        non-finite select and ``pre`` multiply; any other tile takes the general path."""
        if not WORD:  # (a caller's tile may hold anything past the end)
            x0 = tl.where(v0, x0, 0.0)
            x1 = tl.where(v1, x1, 0.0)
        if SYMMETRIC and (FAST & 16):
            rmax = tl.reduce(_max_nan_tl(tl.abs(x0), tl.abs(x1)), 1, _max_nan_tl)
            scale, inv1, clean = _clean_scale_tl(rmax, QHI)
            if clean != 0:
                y0 = x0 * inv1[:, None]
                y1 = x1 * inv1[:, None]
                zero = tl.zeros_like(scale)
            else:
                y0, y1, scale, zero = _pair_y_general_tl(x0, x1, v0, v1, QHI, SYMMETRIC, WORD)
            return y0, y1, scale, zero
        else:
            return _pair_y_general_tl(x0, x1, v0, v1, QHI, SYMMETRIC, WORD)

    @triton.jit
    def _pair_y_general_tl(x0, x1, v0, v1, QHI: tl.constexpr, SYMMETRIC: tl.constexpr, WORD: tl.constexpr):
        x0 = tl.where(tl.abs(x0) < float("inf"), x0, 0.0)  # NaN, +-inf -> 0
        x1 = tl.where(tl.abs(x1) < float("inf"), x1, 0.0)
        if SYMMETRIC:  # (element-wise first: one cross-thread reduction per row, not two)
            rng = tl.max(tl.maximum(tl.abs(x0), tl.abs(x1)), axis=1)
            zero = tl.zeros_like(rng)
        else:
            if WORD:
                mn = tl.min(tl.where(v0, tl.minimum(x0, x1), float("inf")), axis=1)
                mx = tl.max(tl.where(v0, tl.maximum(x0, x1), -float("inf")), axis=1)
            else:
                mn = tl.min(tl.minimum(tl.where(v0, x0, float("inf")), tl.where(v1, x1, float("inf"))), axis=1)
                mx = tl.max(tl.maximum(tl.where(v0, x0, -float("inf")), tl.where(v1, x1, -float("inf"))), axis=1)
            mn = tl.where(mx >= mn, mn, 0.0)  # rows past the end (no valid lane)
            mx = tl.where(mx >= mn, mx, 0.0)
            rng = mx - mn
            zero = mn
            x0 = x0 - mn[:, None]
            x1 = x1 - mn[:, None]
        scale, pre, inv = _scale_tl(rng, QHI)
        return (x0 * pre[:, None]) * inv[:, None], (x1 * pre[:, None]) * inv[:, None], scale, zero

    @triton.jit
    def encode_pack_tl(x, valid, idx, key, ROWS: tl.constexpr, COLS: tl.constexpr, BITS: tl.constexpr,
                       QLO: tl.constexpr, QHI: tl.constexpr, SYMMETRIC: tl.constexpr,
                       STOCHASTIC: tl.constexpr, PAIRS: tl.constexpr, FAST: tl.constexpr):
        """:func:`encode_tile_tl` then :func:`pack_tile_tl`: (uint8 bytes, scale, zero).

        With ``PAIRS`` the tile is split into its even and odd columns before rounding and each
        pair of neighbours draws its two uniforms from one hash (``idx`` even at even columns:
        whole groups of even size). Same codes as the element-wise path, fewer instructions
        per element (4 bits; measured no gain for 8, whose codes are not packed in pairs)."""
        if BITS == 4 and PAIRS:
            x0, x1 = tl.split(tl.reshape(x, [ROWS, COLS // 2, 2]))
            v0, v1 = tl.split(tl.reshape(valid, [ROWS, COLS // 2, 2]))
            y0, y1, scale, zero = _pair_y_tl(x0, x1, v0, v1, QHI, SYMMETRIC, FAST, False)
            if STOCHASTIC:
                i0, _ = tl.split(tl.reshape(idx, [ROWS, COLS // 2, 2]))
                pair = i0 >> 1
            else:
                pair = 0  # (not read)
            return _pack_pair_tl(y0, y1, key, pair, QLO, QHI, STOCHASTIC, FAST), scale, zero
        else:
            code, scale, zero = encode_tile_tl(x, valid, idx, key, QLO, QHI, SYMMETRIC, STOCHASTIC, FAST)
            return pack_tile_tl(code, ROWS, COLS, BITS), scale, zero

    @triton.jit
    def cast_out_tl(v, DTYPE: tl.constexpr, FAST: tl.constexpr):
        """fp32 -> ``DTYPE`` with round-to-nearest-even. ``FAST & 4`` (GPU): the hardware
        conversion; else bf16 is rounded on the integer bits (the Triton interpreter truncates
        fp32 -> bf16; GPUs round to nearest even)."""
        if FAST & 4:
            return v.to(DTYPE)
        elif DTYPE == tl.bfloat16:
            b = v.to(tl.int32, bitcast=True)
            r = (b + (0x7FFF + ((b >> 16) & 1))) & -65536
            r = tl.where(v != v, b, r)
            return r.to(tl.float32, bitcast=True).to(tl.bfloat16)
        else:
            return v.to(DTYPE)

    @triton.jit
    def half_pair_tl(w, KIND: tl.constexpr):
        """fp32 values of the two 16-bit floats of each 32-bit word ``w`` (the element at the
        lower address is the low half): bf16 (``KIND`` 1) widens by shifts, fp16 (2) converts."""
        w = w.to(tl.uint32, bitcast=True)
        if KIND == 1:
            return (w << 16).to(tl.float32, bitcast=True), (w & 0xFFFF0000).to(tl.float32, bitcast=True)
        else:
            lo = (w & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
            return lo, (w >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def word_index_tl(row0, n, GS: tl.constexpr, H: tl.constexpr, ROWS: tl.constexpr, IDX32: tl.constexpr):
        """``(wbase, wloc, valid, pair)`` of the ``[ROWS, group_size]`` tile whose first group is
        ``row0``, seen as ``[ROWS, H]`` words of two elements (even group size and ``n``): the
        first word, int32 word offsets inside the tile, their mask and the pair indices (element
        index // 2, the RNG counter of :func:`uniform_pair_tl`)."""
        base = row0 * GS
        rem = tl.minimum(n - base, ROWS * GS).to(tl.int32)
        wcols = tl.arange(0, H)
        wloc = tl.arange(0, ROWS)[:, None] * (GS // 2) + wcols[None, :]
        valid = (wcols[None, :] < GS // 2) & (wloc < rem // 2)
        wbase = base // 2
        if IDX32:
            pair = wbase.to(tl.uint32) + wloc.to(tl.uint32)
        else:
            pair = wbase + wloc
        return wbase, wloc, valid, pair

    @triton.jit
    def encode_words_tl(w_ptr, row0, n, key, KIND: tl.constexpr, GS: tl.constexpr, COLS: tl.constexpr,
                        ROWS: tl.constexpr, QLO: tl.constexpr, QHI: tl.constexpr, SYMMETRIC: tl.constexpr,
                        STOCHASTIC: tl.constexpr, IDX32: tl.constexpr, FAST: tl.constexpr):
        """4-bit (uint8 bytes ``[ROWS, COLS // 2]``, scale, zero) of the tile at group ``row0`` of
        a bf16/fp16 tensor read as 32-bit words (``w_ptr``): a word holds the two elements of
        one output byte, so the tile is never split into even and odd columns. Same codes as
        :func:`encode_pack_tl`."""
        wbase, wloc, valid, pair = word_index_tl(row0, n, GS, COLS // 2, ROWS, IDX32)
        x0, x1 = half_pair_tl(tl.load(w_ptr + wbase + wloc, mask=valid, other=0), KIND)
        y0, y1, scale, zero = _pair_y_tl(x0, x1, valid, valid, QHI, SYMMETRIC, FAST, True)
        return _pack_pair_tl(y0, y1, key, pair, QLO, QHI, STOCHASTIC, FAST), scale, zero

    @triton.jit
    def pack_tile_tl(code, ROWS: tl.constexpr, COLS: tl.constexpr, BITS: tl.constexpr):
        """int32 codes ``[ROWS, COLS]`` -> uint8 ``[ROWS, COLS * BITS // 8]`` (low nibble = even)."""
        if BITS == 8:
            return (code & 0xFF).to(tl.uint8)
        else:
            lo, hi = tl.split(tl.reshape(code & 0xF, [ROWS, COLS // 2, 2]))
            return (lo | (hi << 4)).to(tl.uint8)

    @triton.jit
    def unpack_tile_tl(b, ROWS: tl.constexpr, HALF: tl.constexpr, BITS: tl.constexpr,
                       SYMMETRIC: tl.constexpr):
        """uint8 ``[ROWS, n]`` -> int32 codes ``[ROWS, n * 8 // BITS]`` (sign-extended if symmetric)."""
        d = b.to(tl.int32)
        if BITS == 8:
            if SYMMETRIC:
                d = tl.where(d >= 128, d - 256, d)
            return d
        else:
            lo = d & 0xF
            hi = d >> 4
            if SYMMETRIC:
                lo = tl.where(lo >= 8, lo - 16, lo)
                hi = tl.where(hi >= 8, hi - 16, hi)
            return tl.reshape(tl.join(lo, hi), [ROWS, 2 * HALF])

    @triton.jit
    def _code_float_tl(c, SIGNED: tl.constexpr, BITS: tl.constexpr):
        """fp32 value of the code in the low ``BITS`` bits of the int32 ``c`` (two's complement
        if ``SIGNED``) without an int-to-float conversion: ``1.5 * 2**23 + code`` has the bits
        ``0x4B400000 + code``, and subtracting 1.5 * 2**23 is exact."""
        if SIGNED:
            h: tl.constexpr = 1 << (BITS - 1)
            b = (c ^ h) + (0x4B400000 - h)  # (c ^ h) - h is the signed code
        else:
            b = c | 0x4B400000
        return b.to(tl.float32, bitcast=True) - 12582912.0

    @triton.jit
    def unpack_float_tl(b, ROWS: tl.constexpr, HALF: tl.constexpr, BITS: tl.constexpr,
                        SYMMETRIC: tl.constexpr, FAST: tl.constexpr):
        """uint8 ``[ROWS, n]`` -> fp32 codes ``[ROWS, n * 8 // BITS]`` (:func:`unpack_tile_tl`
        converted; ``FAST & 2`` (GPU): through :func:`_code_float_tl`, the same values)."""
        if FAST & 2:
            d = b.to(tl.int32)
            if BITS == 8:
                return _code_float_tl(d, SYMMETRIC, 8)
            else:
                lo = _code_float_tl(d & 0xF, SYMMETRIC, 4)
                hi = _code_float_tl(d >> 4, SYMMETRIC, 4)
                return tl.reshape(tl.join(lo, hi), [ROWS, 2 * HALF])
        else:
            return unpack_tile_tl(b, ROWS, HALF, BITS, SYMMETRIC).to(tl.float32)

    @triton.jit
    def tile_index_tl(row0, n, GS: tl.constexpr, COLS: tl.constexpr, ROWS: tl.constexpr,
                      IDX32: tl.constexpr):
        """``(base, rem, loc, valid, idx)`` of the ``[ROWS, group_size]`` tile whose first group
        is ``row0`` (int64): its first element, how many of its elements exist, int32 offsets
        inside it, their mask and their RNG counters (uint32 below 2**32 elements: hashes like
        the int64 index, whose high word is then 0)."""
        base = row0 * GS
        rem = tl.minimum(n - base, ROWS * GS).to(tl.int32)
        r = tl.arange(0, ROWS)
        cols = tl.arange(0, COLS)
        loc = r[:, None] * GS + cols[None, :]
        valid = (cols[None, :] < GS) & (loc < rem)
        if IDX32:
            idx = base.to(tl.uint32) + loc.to(tl.uint32)
        else:
            idx = base + loc
        return base, rem, loc, valid, idx

    @triton.jit
    def store_packed_tl(data_ptr, scale_ptr, zero_ptr, byts, scale, zero, row0, n_groups,
                        GS: tl.constexpr, COLS: tl.constexpr, ROWS: tl.constexpr, BITS: tl.constexpr,
                        SYMMETRIC: tl.constexpr):
        """Store a tile's packed bytes ``[ROWS, COLS * BITS // 8]``, scales (and zero points) at
        group ``row0`` of the output."""
        BCOLS: tl.constexpr = COLS * BITS // 8
        OB: tl.constexpr = GS * BITS // 8
        r = tl.arange(0, ROWS)
        bcols = tl.arange(0, BCOLS)
        rows = row0 + r
        bmask = (rows[:, None] < n_groups) & (bcols[None, :] < OB)
        tl.store(data_ptr + row0 * OB + (r[:, None] * OB + bcols[None, :]), byts, mask=bmask)
        rmask = rows < n_groups
        tl.store(scale_ptr + rows, scale, mask=rmask)
        if not SYMMETRIC:
            tl.store(zero_ptr + rows, zero, mask=rmask)

    @triton.jit
    def dequant_tile_tl(data_ptr, scale_ptr, zero_ptr, rows, rmask, GS: tl.constexpr, COLS: tl.constexpr,
                        ROWS: tl.constexpr, BITS: tl.constexpr, SYMMETRIC: tl.constexpr, FAST: tl.constexpr):
        """fp32 values ``[ROWS, COLS]`` of the groups ``rows`` (masked by ``rmask``)."""
        BCOLS: tl.constexpr = COLS * BITS // 8
        bcols = tl.arange(0, BCOLS)
        bmask = rmask[:, None] & (bcols[None, :] < GS * BITS // 8)
        b = tl.load(data_ptr + rows[:, None] * (GS * BITS // 8) + bcols[None, :], mask=bmask, other=0)
        code = unpack_float_tl(b, ROWS, BCOLS, BITS, SYMMETRIC, FAST)
        scale = tl.load(scale_ptr + rows, mask=rmask, other=0.0)
        v = code * scale[:, None]
        if not SYMMETRIC:
            v = v + tl.load(zero_ptr + rows, mask=rmask, other=0.0)[:, None]
        return v

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


TILE_ELEMS = 4096  # elements per program of quantize / dequantize (whole groups)
PAIR_SR = True  # 4-bit stochastic rounding: one hash per byte (encode_pack_tl; same codes)
WORD_PAIRS = True  # 4 bits from bf16 or fp16: read the tensor as 32-bit words (encode_words_tl); measured on
#   an H200 (tune_kernels --what fast): int4 SR from bf16 46 -> 50 % of a copy. (Writing dequantized
#   pairs as words was slower, 81 -> 63 %: not done.)
_HALF_KIND = {torch.bfloat16: 1, torch.float16: 2}
# GPU-only instruction choices (bits: 1 rounding by a directed add, 2 codes to floats by their
# bits, 4 the hardware fp32 -> bf16 cast, 8 the two uniforms of a hash by integer multiply-adds,
# 16 the clean-tile branch of symmetric quantization, :func:`_pair_y_tl`: measured a win for
# single tensors (int4 SR from bf16 65 -> 82 % of a copy); dequant-sum-requant launches without
# it, the multi-tensor kernel per multi.FAST_MASK);
# same results as the portable paths, which the Triton interpreter runs. Measured on an H200: see
# benchmarks/results (tune_kernels --what fast).
FAST = 31


def fast_bits() -> int:
    """The ``FAST`` constexpr of a launch: :data:`FAST` on a GPU; under the interpreter only
    the portable bits 2 (bitcasts) and 16 (the clean-tile branch), which the CPU tests thus
    check against the reference (bits 1, 4 and 8 are PTX instructions)."""
    return FAST & 18 if interpreting() else FAST


def tile_shape(group_size: int, elems: int = 0) -> tuple[int, int, int]:
    """(COLS, ROWS, num_warps) for a tile of whole groups holding about ``elems`` elements."""
    cols = next_pow2(group_size)
    rows = max(1, (elems or TILE_ELEMS) // cols)
    return cols, rows, 8 if cols * rows >= 4096 else 4


_IDX32_LIMIT = 2**32  # outputs up to this many elements use the uint32 RNG counter


def word_kind(bits: int, dtype: torch.dtype, n: int, *ptrs: int) -> int:
    """1 (bf16) / 2 (fp16) when a 16-bit tensor of ``n`` elements at the addresses ``ptrs``
    can be read as 32-bit words for 4-bit quantization (:data:`WORD_PAIRS`), else 0 (8 bits: the
    word path compiles to more instructions, SASS counted)."""
    ok = WORD_PAIRS and bits == 4 and n % 2 == 0 and all(p % 4 == 0 for p in ptrs)
    return _HALF_KIND.get(dtype, 0) if ok else 0


QUANT_WARPS = 0  # quantize's warps per program (0: tile_shape's choice)
WORD_TILE = (4096, 4)  # (elements, warps) per program of the 4-bit word path: 32 elements a thread


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
        cols, rows, warps = tile_shape(group_size, WORD_TILE[0] if words else 0)
        warps = (WORD_TILE[1] if words else QUANT_WARPS) or warps
        qlo, qhi = _qrange(bits, symmetric)
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
    _check(bits, group_size)
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
        from leantrain.ops.fp8 import dequantize_fp8

        return dequantize_fp8(q, dtype=dtype, backend=backend)
    dtype = dtype or q.dtype
    if resolve(backend, q.data) == "triton":
        return _dequantize_triton(q, dtype, log)
    return dequantize_ref(q, dtype, log)

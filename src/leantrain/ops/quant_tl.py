"""Triton device functions of the integer block quantizer: a ``[ROWS, group_size]`` tile of
whole groups in, packed codes and one scale (and zero point) per group out, and back.

The math, the rounding and the special values are :mod:`leantrain.ops.quant`'s (its module
docstring); every function here does the same fp32 operations in the same order as the torch
reference :func:`leantrain.ops.quant.encode_groups_ref`, so codes are bit-identical. The
kernels of :mod:`~leantrain.ops.quant`, :mod:`~leantrain.ops.multi`,
:mod:`~leantrain.ops.hadamard`, :mod:`~leantrain.ops.reduce` and :mod:`~leantrain.ops.nvfp4`
are built from them:

- encoding: :func:`encode_tile_tl` (int32 codes of an fp32 tile), :func:`encode_pack_tl` (and
  packed to bytes; 4 bits: a pair of neighbours per hash), :func:`encode_words_tl` (4 bits from a
  bf16 / fp16 tensor read as 32-bit words);
- packing: :func:`pack_tile_tl`, :func:`unpack_tile_tl`, :func:`unpack_float_tl`;
- addressing: :func:`tile_index_tl`, :func:`word_index_tl`, :func:`store_packed_tl`,
  :func:`dequant_tile_tl`.
"""

from __future__ import annotations

from leantrain.ops._backend import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    from leantrain.ops.rng import uniform1_pair_tl, uniform1_tl
    from leantrain.ops.tl_helpers import CLEAN_TILE, CODE_BITCAST, ROUND_BY_ADD, half_pair_tl

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
        ``w = y + r`` (integer bounds ``QLO + OFF``, ``QHI + OFF``). ``FAST & ROUND_BY_ADD`` (GPU):
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
        if ROUND_BY_ADD & FAST:
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
        pre) * inv`` (module docstring); ``FAST & CLEAN_TILE``: the clean-tile branch of
        :func:`_pair_y_tl`."""
        if SYMMETRIC and (CLEAN_TILE & FAST):
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

        ``FAST & CLEAN_TILE`` (GPU), symmetric: one NaN-propagating absmax per row, and when the tile is
        clean (:func:`_clean_scale_tl`) ``y = x * (pre * inv)``, without the per-element
        non-finite select and ``pre`` multiply; any other tile takes the general path."""
        if not WORD:  # (a caller's tile may hold anything past the end)
            x0 = tl.where(v0, x0, 0.0)
            x1 = tl.where(v1, x1, 0.0)
        if SYMMETRIC and (CLEAN_TILE & FAST):
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
        converted; ``FAST & CODE_BITCAST`` (GPU): through :func:`_code_float_tl`, the same values)."""
        if CODE_BITCAST & FAST:
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


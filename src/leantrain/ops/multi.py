"""Block-wise quantize / dequantize of many tensors in one kernel launch.

``quantize_many(xs, seeds=...)`` equals ``[quantize(x, seed=s) for x, s in zip(xs, seeds)]``
bit for bit (same codes, scales, zero points, same stochastic-rounding draws), and
``dequantize_many(qs)`` equals ``[dequantize(q) for q in qs]``; the math is
:mod:`leantrain.ops.quant`'s. What changes is the host cost: one launch for the whole list
instead of one per tensor. A Triton launch costs tens of µs of host time, more than the
kernel runs for a few-MiB tensor, and AGoQ packs hundreds of saved activations per step.

Tiling (Triton): a table (int64, one row per tensor: addresses, sizes, the RNG key and the
first program of the tensor) goes to the device with the launch; program ``p`` finds its
tensor as the number of tensors whose first program is ``<= p``, minus one, and then does
exactly what :func:`leantrain.ops.quant._quantize_kernel` does for one ``[ROWS, group_size]``
tile of that tensor (4 or 8 bits per tensor: a launch with both widths branches on the
table's width column). Tensors are read through raw addresses, cast to typed pointers on a GPU;
under the Triton interpreter (whose bf16 pointers cannot be made from an integer) 16-bit
floats are loaded as their bit patterns and widened exactly (bf16: ``bits << 16``). The
compiler cannot know the alignment of a loaded address: the host checks it and says so
(``ALIGN_HINTS``, measured). All tensors of one call share dtype, group size, symmetry and
rounding; every input must be contiguous. Bytes moved are those of the per-tensor kernels,
plus 88 bytes of table per tensor.
"""

from __future__ import annotations

import torch

from . import quant
from ._backend import HAS_TRITON, interpreting, launch, next_pow2, resolve
from .qtensor import QTensor
from .quant import _check, dequantize_ref, quantize_ref, tile_shape
from .rng import kernel_key

__all__ = ["quantize_many", "dequantize_many"]

# The table: 10 int64 columns per tensor (the kernels' row stride): 4 addresses, n, n_groups, key,
# first program, bits, (unused); after the rows, the first-program column again, padded to a power of 2.
# (elements per tile, warps, tiles per program), 0 = quant.tile_shape's choice; measured on an
# H200 (bf16, one 1b layer's saves): 2048 elements at 4 warps is the fastest tile for both
# (tune_kernels --what agoq); a program runs TPP consecutive tiles of one tensor (the table
# lookup and its dependent loads are paid once per program).
Q_TILE = (2048, 4, 2)  # TPP measured (tune_kernels --what fast): 2 for quantize, 4 for dequantize
DQ_TILE = (2048, 4, 4)
# Tell the compiler the addresses are 16-byte aligned (when they are): measured on an H200
# (tune_kernels.py --what agoq), quantize_many 0.52 ms with the hint vs 1.13 ms without, and
# dequantize_many the reverse, 0.30 ms without vs 1.01 ms with (bf16, one 1b layer's saves).
ALIGN_HINTS = {"quantize": True, "dequantize": False}
_FLOAT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_IDX32_LIMIT = 2**32


def _table(rows: list[list[int]], progs: list[int], device) -> tuple[torch.Tensor, int]:
    """The rows (first program filled in) plus the padded first-program column, as one int64
    device tensor; copied without waiting for the stream (a blocking copy would)."""
    starts, s = [], 0
    for r, p in zip(rows, progs):
        r[7] = s  # the row's first program, also read by the program that owns a tile of it
        starts.append(s)
        s += p
    tp = next_pow2(max(1, len(rows)))
    flat = torch.tensor([v for r in rows for v in r] + starts + [1 << 62] * (tp - len(starts)), dtype=torch.int64)
    # From pageable memory the copy is staged at once and never waits for the device.
    return flat.to(device, non_blocking=True), s


if HAS_TRITON:
    import triton
    import triton.language as tl

    from .quant import (
        dequant_tile_tl,
        encode_pack_tl,
        encode_words_tl,
        store_packed_tl,
        tile_index_tl,
    )

    @triton.jit
    def _row(tab_ptr, n_tensors, TP: tl.constexpr):
        """(this program's tensor's table row pointer, program index inside that tensor)."""
        pid = tl.program_id(0).to(tl.int64)
        starts = tl.load(tab_ptr + n_tensors * 10 + tl.arange(0, TP))
        t = tl.sum((starts <= pid).to(tl.int32), axis=0) - 1
        row = tab_ptr + t * 10
        return row, pid - tl.load(row + 7)

    @triton.jit
    def _ptr(addr, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
        """A raw address as a pointer; ``ALIGNED``: every address of the launch is a multiple of
        16 bytes, said so to the compiler (vector loads / stores need it to be known)."""
        p = addr.to(tl.pointer_type(DTYPE))
        if ALIGNED:
            p = tl.multiple_of(p, 16)
        return p

    @triton.jit
    def _load_float(addr, offs, mask, KIND: tl.constexpr, ALIGNED: tl.constexpr, NATIVE: tl.constexpr):
        """fp32 values of an fp32 (0), bf16 (1) or fp16 (2) tensor at a raw address."""
        if KIND == 0:
            return tl.load(_ptr(addr, tl.float32, ALIGNED) + offs, mask=mask, other=0.0)
        elif NATIVE:
            DT: tl.constexpr = tl.bfloat16 if KIND == 1 else tl.float16
            return tl.load(_ptr(addr, DT, ALIGNED) + offs, mask=mask, other=0.0).to(tl.float32)
        else:
            u = tl.load(_ptr(addr, tl.uint16, ALIGNED) + offs, mask=mask, other=0)
            if KIND == 1:
                return (u.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
            else:
                return u.to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _store_float(addr, offs, v, mask, KIND: tl.constexpr, HW_CAST: tl.constexpr, ALIGNED: tl.constexpr):
        """Store fp32 ``v`` as fp32 (0), bf16 (1) or fp16 (2), round to nearest even (``HW_CAST``:
        on a GPU, through typed pointers)."""
        if KIND == 0:
            tl.store(_ptr(addr, tl.float32, ALIGNED) + offs, v, mask=mask)
        elif HW_CAST:
            DT: tl.constexpr = tl.bfloat16 if KIND == 1 else tl.float16
            tl.store(_ptr(addr, DT, ALIGNED) + offs, v.to(DT), mask=mask)
        else:
            if KIND == 1:  # the interpreter truncates fp32 -> bf16: round on the integer bits
                b = v.to(tl.uint32, bitcast=True)
                r = (b + (0x7FFF + ((b >> 16) & 1))) >> 16
                u = tl.where(v != v, b >> 16, r).to(tl.uint16)
            else:
                u = v.to(tl.float16).to(tl.uint16, bitcast=True)
            tl.store(_ptr(addr, tl.uint16, ALIGNED) + offs, u, mask=mask)

    @triton.jit
    def _quantize_tile(row, prog, KIND: tl.constexpr, GS: tl.constexpr, COLS: tl.constexpr,
                       ROWS: tl.constexpr, BITS: tl.constexpr, SYMMETRIC: tl.constexpr,
                       STOCHASTIC: tl.constexpr, IDX32: tl.constexpr, ALIGNED: tl.constexpr,
                       NATIVE: tl.constexpr, PAIRS: tl.constexpr, FAST: tl.constexpr, TPP: tl.constexpr,
                       WORDS: tl.constexpr):
        """``TPP`` consecutive ``[ROWS, group_size]`` tiles of the tensor of table row ``row``
        (the program's ``prog``-th run of them), each as
        :func:`leantrain.ops.quant._quantize_kernel` does it; tiles past the end are masked.
        ``WORDS``: 4-bit tiles read the (bf16 = 1 / fp16 = 2) input as 32-bit words."""
        QHI: tl.constexpr = (1 << (BITS - 1)) - 1 if SYMMETRIC else (1 << BITS) - 1
        QLO: tl.constexpr = -QHI if SYMMETRIC else 0
        x_addr = tl.load(row)
        data_ptr = _ptr(tl.load(row + 1), tl.uint8, ALIGNED)
        scale_ptr = _ptr(tl.load(row + 2), tl.float32, ALIGNED)
        zero_ptr = _ptr(tl.load(row + 3), tl.float32, ALIGNED)
        n = tl.load(row + 4)
        n_groups = tl.load(row + 5)
        key = tl.load(row + 6).to(tl.int32)
        for j in tl.static_range(TPP):
            row0 = (prog * TPP + j) * ROWS
            if BITS == 4 and WORDS:
                byts, scale, zero = encode_words_tl(_ptr(x_addr, tl.int32, ALIGNED), row0, n, key, WORDS, GS, COLS,
                                                    ROWS, QLO, QHI, SYMMETRIC, STOCHASTIC, IDX32, FAST)
            else:
                base, rem, loc, valid, idx = tile_index_tl(row0, n, GS, COLS, ROWS, IDX32)
                x = _load_float(x_addr, base + loc, valid, KIND, ALIGNED, NATIVE)
                byts, scale, zero = encode_pack_tl(x, valid, idx, key, ROWS, COLS, BITS, QLO, QHI, SYMMETRIC,
                                                   STOCHASTIC, PAIRS, FAST)
            store_packed_tl(data_ptr, scale_ptr, zero_ptr, byts, scale, zero, row0, n_groups, GS, COLS, ROWS,
                            BITS, SYMMETRIC)

    @triton.jit(do_not_specialize=["n_tensors"])
    def _quantize_many_kernel(tab_ptr, n_tensors, TP: tl.constexpr, KIND: tl.constexpr,
                              GS: tl.constexpr, COLS: tl.constexpr, ROWS: tl.constexpr,
                              BITS: tl.constexpr, SYMMETRIC: tl.constexpr, STOCHASTIC: tl.constexpr,
                              IDX32: tl.constexpr, ALIGNED: tl.constexpr, NATIVE: tl.constexpr,
                              PAIRS: tl.constexpr, FAST: tl.constexpr, TPP: tl.constexpr, WORDS: tl.constexpr):
        """``BITS`` 4 or 8 for every tensor, or 0: each tensor's own (table column 8)."""
        row, prog = _row(tab_ptr, n_tensors, TP)
        if BITS == 0:
            if tl.load(row + 8) == 4:
                _quantize_tile(row, prog, KIND, GS, COLS, ROWS, 4, SYMMETRIC, STOCHASTIC, IDX32, ALIGNED, NATIVE,
                               PAIRS, FAST, TPP, WORDS)
            else:
                _quantize_tile(row, prog, KIND, GS, COLS, ROWS, 8, SYMMETRIC, STOCHASTIC, IDX32, ALIGNED, NATIVE,
                               PAIRS, FAST, TPP, WORDS)
        else:
            _quantize_tile(row, prog, KIND, GS, COLS, ROWS, BITS, SYMMETRIC, STOCHASTIC, IDX32, ALIGNED, NATIVE,
                           PAIRS, FAST, TPP, WORDS)

    @triton.jit
    def _dequantize_tile(row, prog, KIND: tl.constexpr, HW_CAST: tl.constexpr, GS: tl.constexpr,
                         COLS: tl.constexpr, ROWS: tl.constexpr, BITS: tl.constexpr,
                         SYMMETRIC: tl.constexpr, ALIGNED: tl.constexpr, FAST: tl.constexpr, TPP: tl.constexpr):
        data_ptr = _ptr(tl.load(row), tl.uint8, ALIGNED)
        scale_ptr = _ptr(tl.load(row + 1), tl.float32, ALIGNED)
        zero_ptr = _ptr(tl.load(row + 2), tl.float32, ALIGNED)
        out_ptr = tl.load(row + 3)
        n = tl.load(row + 4)
        n_groups = tl.load(row + 5)
        cols = tl.arange(0, COLS)
        for j in tl.static_range(TPP):
            rows = (prog * TPP + j) * ROWS + tl.arange(0, ROWS)
            v = dequant_tile_tl(data_ptr, scale_ptr, zero_ptr, rows, rows < n_groups, GS, COLS, ROWS, BITS,
                                SYMMETRIC, FAST)
            idx = rows[:, None] * GS + cols[None, :]
            _store_float(out_ptr, idx, v, (cols[None, :] < GS) & (idx < n), KIND, HW_CAST, ALIGNED)

    @triton.jit(do_not_specialize=["n_tensors"])
    def _dequantize_many_kernel(tab_ptr, n_tensors, TP: tl.constexpr, KIND: tl.constexpr,
                                HW_CAST: tl.constexpr, GS: tl.constexpr, COLS: tl.constexpr,
                                ROWS: tl.constexpr, BITS: tl.constexpr, SYMMETRIC: tl.constexpr,
                                ALIGNED: tl.constexpr, FAST: tl.constexpr, TPP: tl.constexpr):
        row, prog = _row(tab_ptr, n_tensors, TP)
        if BITS == 0:
            if tl.load(row + 8) == 4:
                _dequantize_tile(row, prog, KIND, HW_CAST, GS, COLS, ROWS, 4, SYMMETRIC, ALIGNED, FAST, TPP)
            else:
                _dequantize_tile(row, prog, KIND, HW_CAST, GS, COLS, ROWS, 8, SYMMETRIC, ALIGNED, FAST, TPP)
        else:
            _dequantize_tile(row, prog, KIND, HW_CAST, GS, COLS, ROWS, BITS, SYMMETRIC, ALIGNED, FAST, TPP)


def _aligned(rows: list[list[int]], kernel: str) -> bool:
    """Hint alignment to ``kernel``: every address of the launch (the table's first four
    columns) is a multiple of 16 and ALIGN_HINTS says the hint pays."""
    return ALIGN_HINTS[kernel] and all(r[c] % 16 == 0 for r in rows for c in range(4))


def _words(rows: list[list[int]], dtype: torch.dtype) -> int:
    """The ``WORDS`` constexpr: :func:`leantrain.ops.quant.word_kind` holds for every 4-bit
    tensor of the launch."""
    four = [r for r in rows if r[8] == 4]
    ok = four and all(quant.word_kind(4, dtype, r[4], r[0]) for r in four)
    return quant.word_kind(4, dtype, 2) if ok else 0


def _same(values, what: str):
    first = values[0]
    if any(v != first for v in values[1:]):
        raise ValueError(f"quantize_many/dequantize_many: all tensors of one call need the same {what}")
    return first


def quantize_many(xs: list[torch.Tensor], *, bits: int | list[int] = 8, group_size: int = 128,
                  symmetric: bool = True, stochastic: bool = False, seeds: list[int] | None = None,
                  keys: list[int] | None = None, backend: str = "auto") -> list[QTensor]:
    """``[quantize(x, bits=b, seed=s, ...) for x, b, s in zip(xs, bits, seeds)]`` in one launch.

    ``bits``: one width (4 or 8) for all, or one per tensor. ``keys`` (``kernel_key(seed)`` per
    tensor) may be given instead of ``seeds`` by callers that derive them directly. Every ``x``
    must be contiguous and of one floating dtype and device. See the module docstring.
    """
    if not xs:
        return []
    widths = list(bits) if isinstance(bits, (list, tuple)) else [bits] * len(xs)
    if len(widths) != len(xs):
        raise ValueError(f"quantize_many: {len(xs)} tensors but {len(widths)} bit-widths")
    for b in set(widths):
        _check(b, group_size)
    if keys is None:
        seeds = list(seeds) if seeds is not None else [0] * len(xs)
        if len(seeds) != len(xs):
            raise ValueError(f"quantize_many: {len(xs)} tensors but {len(seeds)} seeds")
        keys = [kernel_key(s) for s in seeds]
    elif len(keys) != len(xs):
        raise ValueError(f"quantize_many: {len(xs)} tensors but {len(keys)} keys")
    dtype = _same([x.dtype for x in xs], "dtype")
    device = _same([x.device for x in xs], "device")
    if dtype not in _FLOAT_KIND:
        raise TypeError(f"quantize_many expects fp32/bf16/fp16 tensors, got {dtype}")
    if resolve(backend, *xs) == "torch":
        if seeds is None:
            raise ValueError("quantize_many: the torch backend needs seeds (keys cannot be inverted)")
        return [quantize_ref(x, bits=b, group_size=group_size, symmetric=symmetric, stochastic=stochastic, seed=s)
                for x, b, s in zip(xs, widths, seeds)]
    for x in xs:
        if not x.is_contiguous():
            raise ValueError("quantize_many needs contiguous tensors (pass x.contiguous())")
    cols, rows_per, warps = tile_shape(group_size, Q_TILE[0])
    warps = Q_TILE[1] or warps
    out, rows, progs = [], [], []
    big = False
    for x, b, k in zip(xs, widths, keys):
        n = x.numel()
        g = -(-n // group_size)
        nd = g * group_size * b // 8
        at = -(-nd // 16) * 16  # one allocation per tensor: codes, then scales (and zero points)
        buf = torch.empty(at + 4 * g * (1 if symmetric else 2), dtype=torch.uint8, device=device)
        data = buf[:nd]  # at 16-byte aligned offsets, as the kernel is told
        scale = buf[at:at + 4 * g].view(torch.float32)
        zero = None if symmetric else buf[at + 4 * g:].view(torch.float32)
        out.append(QTensor(data, scale, zero, x.shape, dtype, b, group_size, symmetric))
        if g:
            rows.append([x.data_ptr(), data.data_ptr(), scale.data_ptr(),
                         (scale if zero is None else zero).data_ptr(), n, g, k, 0, b, 0])
            progs.append(-(-g // (rows_per * Q_TILE[2])))
            big |= g * group_size > _IDX32_LIMIT
    if rows:
        tab, total = _table(rows, progs, device)
        mixed = len(set(r[8] for r in rows)) > 1
        launch(_quantize_many_kernel, (total,), tab, len(rows), TP=next_pow2(len(rows)), KIND=_FLOAT_KIND[dtype],
               GS=group_size, COLS=cols, ROWS=rows_per, BITS=0 if mixed else rows[0][8], SYMMETRIC=symmetric,
               STOCHASTIC=stochastic, IDX32=not big, ALIGNED=_aligned(rows, "quantize"),
               NATIVE=not interpreting(), PAIRS=quant.PAIR_SR, FAST=quant.fast_bits(), TPP=Q_TILE[2],
               WORDS=_words(rows, dtype), num_warps=warps)
    return out


def dequantize_many(qs: list[QTensor], *, dtype: torch.dtype | None = None,
                    backend: str = "auto") -> list[torch.Tensor]:
    """``[dequantize(q, dtype=dtype) for q in qs]`` in one launch (integer, non-stacked QTensors
    of 4 or 8 bits (mixed), one group size, symmetry and output dtype)."""
    if not qs:
        return []
    for q in qs:
        if q.fmt != "int" or q.stacked:
            raise ValueError("dequantize_many takes integer, non-stacked QTensors")
    gs = _same([q.group_size for q in qs], "group_size")
    sym = _same([q.symmetric for q in qs], "symmetric")
    out_dtype = _same([dtype or q.dtype for q in qs], "output dtype")
    device = _same([q.data.device for q in qs], "device")
    if out_dtype not in _FLOAT_KIND:
        raise TypeError(f"dequantize_many writes fp32/bf16/fp16, got {out_dtype}")
    if resolve(backend, *(q.data for q in qs)) == "torch":
        return [dequantize_ref(q, out_dtype) for q in qs]
    cols, rows_per, warps = tile_shape(gs, DQ_TILE[0])
    warps = DQ_TILE[1] or warps
    out, rows, progs = [], [], []
    for q in qs:
        o = torch.empty(q.shape, dtype=out_dtype, device=device)
        out.append(o)
        g = q.num_groups
        if g:
            zero = q.scale if q.zero is None else q.zero
            rows.append([q.data.data_ptr(), q.scale.data_ptr(), zero.data_ptr(), o.data_ptr(), q.numel, g, 0, 0,
                         q.bits, 0])
            progs.append(-(-g // (rows_per * DQ_TILE[2])))
    if rows:
        tab, total = _table(rows, progs, device)
        mixed = len(set(r[8] for r in rows)) > 1
        launch(_dequantize_many_kernel, (total,), tab, len(rows), TP=next_pow2(len(rows)),
               KIND=_FLOAT_KIND[out_dtype], HW_CAST=not interpreting(), GS=gs, COLS=cols, ROWS=rows_per,
               BITS=0 if mixed else rows[0][8], SYMMETRIC=sym, ALIGNED=_aligned(rows, "dequantize"),
               FAST=quant.fast_bits(), TPP=DQ_TILE[2], num_warps=warps)
    return out

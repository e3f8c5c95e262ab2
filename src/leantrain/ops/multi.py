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
tile of that tensor (4 or 8 bits and fp32 / bf16 / fp16 per tensor: a launch mixing widths or
dtypes branches on the table's columns). Tensors are read through raw addresses, cast to typed
pointers on a GPU;
under the Triton interpreter (whose bf16 pointers cannot be made from an integer) 16-bit
floats are loaded as their bit patterns and widened exactly (bf16: ``bits << 16``). The
compiler cannot know the alignment of a loaded address: the host checks it and says so
(``ALIGN_HINTS``, measured). All tensors of one call share group size, symmetry and rounding;
every input must be contiguous. The codes (and the scales) of all tensors of a call are views
of one allocation, freed when the last of them is (host time: one allocation per call, not
per tensor). ``quantize_flat`` / ``dequantize_flat`` (AGoQ's batches) skip even the views: one
buffer and byte offsets, a tensor's ``QTensor`` made only when asked for. Bytes moved are those
of the per-tensor kernels, plus 88 bytes of table per tensor.
"""

from __future__ import annotations

import os
from array import array

import torch

from leantrain.ops import quant
from leantrain.ops._backend import HAS_TRITON, interpreting, launch, next_pow2, resolve
from leantrain.ops.qtensor import QTensor
from leantrain.ops.quant import _check, dequantize_ref, quantize_ref, tile_shape
from leantrain.ops.rng import kernel_key

__all__ = ["quantize_many", "dequantize_many", "quantize_flat", "dequantize_flat", "flat_qtensor", "FlatLayout"]

# The table: 10 int64 columns per tensor (the kernels' row stride): 4 addresses, n, n_groups, key,
# first program, bits, dtype kind (_FLOAT_KIND); after the rows, the first-program column again,
# padded to a power of 2.
# Tiles: (elements per tile, warps, tiles per program), 0 = quant.tile_shape's choice; a program
# runs TPP consecutive tiles of one tensor (the table lookup and its dependent loads are paid
# once per program). Measured on an H200: quantize, with every size hinted divisible by 16
# (tune_kernels --what multi, session 5), 4096 elements at 4 warps, one tile a program, is the
# best for 4-bit bf16 (77.6 % of a copy; mixed widths 58-60 % for every tile tried). Dequantize:
# 4096 elements at 4 warps, 2 tiles a program, with the size hints (session 8, tune_kernels --what
# s8: one 1b AGoQ step's 30 flushes, 15.4 GiB, 5.47 ms = 89 % of a copy; 6.02 ms at session 5's
# 2048 x 4 warps x 4, 7.84 ms without the hints).
Q_TILE = (4096, 4, 1)
DQ_TILE = (4096, 4, 2)


def _tile_env(name: str, default: tuple[int, int, int]) -> tuple[int, int, int]:
    """A tile from the environment (``"elems,warps,tiles_per_program"``), else ``default``."""
    v = os.environ.get(name, "")
    return tuple(int(t) for t in v.split(",")) if v else default


# The rows off the word path (fp32 inputs, 8 bits) when split from it: their own tile
# (LEANTRAIN_Q_TILE_OTHER="elems,warps,tpp"); SPLIT_KINDS launches them per (bits, dtype kind),
# each compiled for its one path (LEANTRAIN_Q_SPLIT_KINDS).
Q_TILE_OTHER = _tile_env("LEANTRAIN_Q_TILE_OTHER", Q_TILE)
SPLIT_KINDS = os.environ.get("LEANTRAIN_Q_SPLIT_KINDS", "0") not in ("", "0")
FAST_MASK = ~0  # the quant.FAST bits quantize_many launches with
# Launches that mix dtype kinds or widths compile both paths into one kernel (145 registers a
# thread on sm_90 for AGoQ's flushes, against 56 for 4-bit bf16 alone: benchmarks/sass_count.py).
# MIXED_MAXNREG caps the registers of such launches (0: no cap; LEANTRAIN_Q_MAXNREG); SPLIT_PATHS
# sends the 4-bit 16-bit-float rows (the word path) and the others to two launches instead of
# one mixed one (LEANTRAIN_Q_SPLIT=0 turns it off). On the H200, split launches made an
# AGoQ-like flush 11-24 % faster (session 6, benchmarks/results/2026-11-30_H200_tune_s6/); once
# the save path's host time no longer hid it (session 7), the AGoQ step was faster with them
# too (benchmarks/results/2026-11-30_H200_s7/).
MIXED_MAXNREG = int(os.environ.get("LEANTRAIN_Q_MAXNREG", "0"))
SPLIT_PATHS = os.environ.get("LEANTRAIN_Q_SPLIT", "1") not in ("", "0")
# DQ_SPLIT: dequantize in one launch per (bits, dtype) instead of one mixed launch
# (LEANTRAIN_DQ_SPLIT).
DQ_SPLIT = os.environ.get("LEANTRAIN_DQ_SPLIT", "0") not in ("", "0")
# Tell the compiler the addresses are 16-byte aligned and the sizes multiples of 16 (when they
# are): measured on an H200 (tune_kernels.py --what agoq), quantize_many 0.52 ms with the hint vs
# 1.13 ms without (bf16, one 1b layer's saves). Dequantize was the reverse in session 5 (0.30 ms
# without vs 1.01 ms with), when only the addresses were hinted: the codes then loaded as vectors
# but each thread stored its 16 outputs one element at a time, 2 KiB apart across a warp. With
# the sizes hinted too, the store mask is constant over 16 elements and the stores are 16-byte
# vectors (8 STG.128 a thread for a 4-bit bf16 tile of 4 x 2048 elements instead of 64 STG.U16:
# benchmarks/sass_count.py dequant). LEANTRAIN_DQ_ALIGN=0 drops the dequantize hint.
ALIGN_HINTS = {"quantize": True, "dequantize": os.environ.get("LEANTRAIN_DQ_ALIGN", "1") not in ("", "0")}
_FLOAT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_IDX32_LIMIT = 2**32


def _table(rows: list[list[int]], progs: list[int], device, keyed: bool = False) -> tuple[torch.Tensor, int]:
    """The rows (first program filled in) plus the padded first-program column, as one int64
    device tensor; copied without waiting for the stream (a blocking copy would). ``keyed``: the
    rows' column 6 holds stochastic-rounding keys (see the capture case below)."""
    starts, s = [], 0
    for r, p in zip(rows, progs):
        r[7] = s  # the row's first program, also read by the program that owns a tile of it
        starts.append(s)
        s += p
    tp = next_pow2(max(1, len(rows)))
    flat = array("q", [v for r in rows for v in r])
    flat.extend(starts)
    flat.extend([1 << 62] * (tp - len(starts)))
    # (from an array: a third of torch.tensor(list)'s host time.) From pageable memory: on the
    # H200 machine the copy did not wait for a busy stream (15-23 us of host time behind 2 ms of
    # queued work), and page-locked tables cost more host time and made AGoQ's step no faster
    # (session 6, benchmarks/results/2026-11-30_H200_tune_s6/).
    host = torch.frombuffer(flat, dtype=torch.int64)
    if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
        # Captured into a CUDA graph, the copy is a memcpy node that reads the host buffer at every
        # replay: page-locked (a pageable copy cannot be captured) and kept for the process's life.
        host = host.pin_memory()
        _CAPTURED_TABLES.append(host)
        dev = host.to(device, non_blocking=True)
        if keyed:  # each replay rounds with new noise: the keys XOR the replay's salt, in the graph
            from leantrain.ops.rng import replay_salt

            salt = replay_salt(device, create=False)
            if salt is not None:
                dev[6: len(rows) * 10: 10].bitwise_xor_(salt)
        return dev, s
    return host.to(device, non_blocking=True), s


# Host launch tables read by captured CUDA graphs' copies (see _table); a few KiB per graph.
_CAPTURED_TABLES: list[torch.Tensor] = []


if HAS_TRITON:
    import triton
    import triton.language as tl

    from leantrain.ops.quant import (
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
        ``WORDS``: 4-bit tiles of bf16 / fp16 inputs read them as 32-bit words."""
        QHI: tl.constexpr = (1 << (BITS - 1)) - 1 if SYMMETRIC else (1 << BITS) - 1
        QLO: tl.constexpr = -QHI if SYMMETRIC else 0
        x_addr = tl.load(row)
        data_ptr = _ptr(tl.load(row + 1), tl.uint8, ALIGNED)
        scale_ptr = _ptr(tl.load(row + 2), tl.float32, ALIGNED)
        zero_ptr = _ptr(tl.load(row + 3), tl.float32, ALIGNED)
        n = tl.load(row + 4)
        if ALIGNED:  # (and every n a multiple of 16: tile masks constant over 16 elements, loads vectorize)
            n = tl.multiple_of(n, 16)
        n_groups = tl.load(row + 5)
        key = tl.load(row + 6).to(tl.int32)
        for j in tl.static_range(TPP):
            row0 = (prog * TPP + j) * ROWS
            if BITS == 4 and WORDS and KIND > 0:
                byts, scale, zero = encode_words_tl(_ptr(x_addr, tl.int32, ALIGNED), row0, n, key, KIND, GS, COLS,
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
        """``BITS`` 4 or 8 for every tensor, or 0: each tensor's own (table column 8); ``KIND``
        the input dtype of every tensor (0 fp32, 1 bf16, 2 fp16), or -1: each tensor's own
        (column 9)."""
        row, prog = _row(tab_ptr, n_tensors, TP)
        if KIND < 0:
            k = tl.load(row + 9)
            if k == 0:
                _quantize_bits(row, prog, 0, GS, COLS, ROWS, BITS, SYMMETRIC, STOCHASTIC, IDX32, ALIGNED, NATIVE,
                               PAIRS, FAST, TPP, WORDS)
            elif k == 1:
                _quantize_bits(row, prog, 1, GS, COLS, ROWS, BITS, SYMMETRIC, STOCHASTIC, IDX32, ALIGNED, NATIVE,
                               PAIRS, FAST, TPP, WORDS)
            else:
                _quantize_bits(row, prog, 2, GS, COLS, ROWS, BITS, SYMMETRIC, STOCHASTIC, IDX32, ALIGNED, NATIVE,
                               PAIRS, FAST, TPP, WORDS)
        else:
            _quantize_bits(row, prog, KIND, GS, COLS, ROWS, BITS, SYMMETRIC, STOCHASTIC, IDX32, ALIGNED, NATIVE,
                           PAIRS, FAST, TPP, WORDS)

    @triton.jit
    def _quantize_bits(row, prog, KIND: tl.constexpr, GS: tl.constexpr, COLS: tl.constexpr, ROWS: tl.constexpr,
                       BITS: tl.constexpr, SYMMETRIC: tl.constexpr, STOCHASTIC: tl.constexpr, IDX32: tl.constexpr,
                       ALIGNED: tl.constexpr, NATIVE: tl.constexpr, PAIRS: tl.constexpr, FAST: tl.constexpr,
                       TPP: tl.constexpr, WORDS: tl.constexpr):
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
        if ALIGNED:  # (and every n a multiple of 16: store masks constant over 16 elements, stores vectorize)
            n = tl.multiple_of(n, 16)
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
        if KIND < 0:  # each tensor's output dtype (table column 9)
            k = tl.load(row + 9)
            if k == 0:
                _dequantize_bits(row, prog, 0, HW_CAST, GS, COLS, ROWS, BITS, SYMMETRIC, ALIGNED, FAST, TPP)
            elif k == 1:
                _dequantize_bits(row, prog, 1, HW_CAST, GS, COLS, ROWS, BITS, SYMMETRIC, ALIGNED, FAST, TPP)
            else:
                _dequantize_bits(row, prog, 2, HW_CAST, GS, COLS, ROWS, BITS, SYMMETRIC, ALIGNED, FAST, TPP)
        else:
            _dequantize_bits(row, prog, KIND, HW_CAST, GS, COLS, ROWS, BITS, SYMMETRIC, ALIGNED, FAST, TPP)

    @triton.jit
    def _dequantize_bits(row, prog, KIND: tl.constexpr, HW_CAST: tl.constexpr, GS: tl.constexpr,
                         COLS: tl.constexpr, ROWS: tl.constexpr, BITS: tl.constexpr, SYMMETRIC: tl.constexpr,
                         ALIGNED: tl.constexpr, FAST: tl.constexpr, TPP: tl.constexpr):
        if BITS == 0:
            if tl.load(row + 8) == 4:
                _dequantize_tile(row, prog, KIND, HW_CAST, GS, COLS, ROWS, 4, SYMMETRIC, ALIGNED, FAST, TPP)
            else:
                _dequantize_tile(row, prog, KIND, HW_CAST, GS, COLS, ROWS, 8, SYMMETRIC, ALIGNED, FAST, TPP)
        else:
            _dequantize_tile(row, prog, KIND, HW_CAST, GS, COLS, ROWS, BITS, SYMMETRIC, ALIGNED, FAST, TPP)


def _kind(rows: list[list[int]]) -> int:
    """The ``KIND`` constexpr: the dtype kind shared by every row, else -1 (column 9 per row)."""
    kinds = {r[9] for r in rows}
    return kinds.pop() if len(kinds) == 1 else -1


def _split(device, dtype, sizes: list[int], align: int) -> tuple[list[torch.Tensor], list[int]]:
    """One allocation cut into views of ``sizes`` elements, each starting at a multiple of
    ``align`` elements: (views, their addresses). One allocation and one split for a whole
    call instead of a few tensor ops per tensor (host time)."""
    cuts, keep, offs, o = [], [], [], 0
    for s in sizes:
        p = -(-s // align) * align
        keep.append(len(cuts))
        cuts.append(s)
        if p > s:  # a padding piece only where one is needed (each view costs host time)
            cuts.append(p - s)
        offs.append(o)
        o += p
    buf = torch.empty(o, dtype=dtype, device=device)
    base, esize = buf.data_ptr(), buf.element_size()
    views = buf.split(cuts)
    if len(cuts) != len(sizes):
        views = [views[i] for i in keep]
    return list(views), [base + esize * off for off in offs]


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
    must be contiguous, fp32 / bf16 / fp16 (mixed), on one device. See the module docstring.
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
    device = xs[0].device
    for x in xs:
        if x.dtype not in _FLOAT_KIND:
            raise TypeError(f"quantize_many expects fp32/bf16/fp16 tensors, got {x.dtype}")
        if x.device != device:
            raise ValueError("quantize_many/dequantize_many: all tensors of one call need the same device")
    if resolve(backend, *xs) == "torch":
        if seeds is None:
            raise ValueError("quantize_many: the torch backend needs seeds (keys cannot be inverted)")
        return [quantize_ref(x, bits=b, group_size=group_size, symmetric=symmetric, stochastic=stochastic, seed=s)
                for x, b, s in zip(xs, widths, seeds)]
    gs = [-(-x.numel() // group_size) for x in xs]
    # codes, scales (and zero points) of all tensors: one allocation each, 16-byte aligned views
    datas, dps = _split(device, torch.uint8, [g * group_size * b // 8 for g, b in zip(gs, widths)], 16)
    scales, sps = _split(device, torch.float32, gs, 4)
    zeros, zps = ([None] * len(xs), sps) if symmetric else _split(device, torch.float32, gs, 4)
    table = _QuantRows()
    for x, b, k, dp, sp, zp in zip(xs, widths, keys, dps, sps, zps):
        table.add(x, b, k, dp, sp, zp, group_size)
    table.launch(device, group_size, symmetric, stochastic)
    return [QTensor(d, sc, z, x.shape, x.dtype, b, group_size, symmetric)
            for d, sc, z, x, b in zip(datas, scales, zeros, xs, widths)]


class _QuantRows:
    """A quantize launch table being built, one row per non-empty tensor (:func:`quantize_many`
    with each tensor's own addresses; :class:`FlatLayout` with offsets into a buffer not yet
    allocated, its address added at the launch)."""

    __slots__ = ("rows", "low", "words", "half4", "gmax")

    def __init__(self):
        self.rows: list[list[int]] = []
        self.low = 0  # OR of every address and size: the alignment hint holds when its low 4 bits are 0
        self.words = quant.WORD_PAIRS  # every 4-bit 16-bit-float input readable as 32-bit words
        self.half4 = False
        self.gmax = 0

    def add(self, x: torch.Tensor, bits: int, key: int, dp: int, sp: int, zp: int, group_size: int) -> None:
        """The row of contiguous ``x`` quantized to ``bits`` into codes / scales / zero points at
        ``dp`` / ``sp`` / ``zp``."""
        if not x.is_contiguous():
            raise ValueError("quantize_many / quantize_flat need contiguous tensors (pass x.contiguous())")
        n = x.numel()
        if not n:
            return
        g = -(-n // group_size)
        if g > self.gmax:
            self.gmax = g
        xp = x.data_ptr()
        kind = _FLOAT_KIND[x.dtype]
        self.rows.append([xp, dp, sp, zp, n, g, key, 0, bits, kind])
        self.low |= xp | dp | sp | zp | n
        if bits == 4 and kind:
            self.half4 = True
            self.words = self.words and not (n & 1 or xp & 3)

    def launch(self, device, group_size: int, symmetric: bool, stochastic: bool, base: int = 0) -> None:
        """Quantize every row (``base`` added to the three output addresses of each)."""
        if not self.rows:
            return
        rows = self.rows if not base else [[r[0], r[1] + base, r[2] + base, r[3] + base, *r[4:]] for r in self.rows]
        _launch_quantize(rows, device, group_size, symmetric, stochastic, self.gmax * group_size > _IDX32_LIMIT,
                         self.half4 and self.words, self.low | base)


def _launch_quantize(rows: list[list[int]], device, group_size: int, symmetric: bool, stochastic: bool, big: bool,
                     word: bool, low: int) -> None:
    """Launch the quantize kernel on table ``rows``. ``big``: a tensor needs 64-bit indices;
    ``word``: every 4-bit 16-bit-float row can be read as 32-bit words; ``low``: the OR of every
    address and size (16-byte alignment when its low 4 bits are 0)."""
    parts = [(rows, word, Q_TILE)]  # (rows, WORDS, tile)
    if SPLIT_PATHS and word:  # the word path's rows (4-bit 16-bit floats) apart from the others
        sel = [r[8] == 4 and r[9] > 0 for r in rows]
        parts = [([r for r, s in zip(rows, sel) if s], True, Q_TILE)]
        rest = [r for r, s in zip(rows, sel) if not s]
        if SPLIT_KINDS:  # and those in one launch per (bits, dtype kind)
            groups: dict[tuple[int, int], list] = {}
            for r in rest:
                groups.setdefault((r[8], r[9]), []).append(r)
            parts += [(g, False, Q_TILE_OTHER) for g in groups.values()]
        elif rest:
            parts.append((rest, False, Q_TILE_OTHER))
    for prow, pword, (elems, pwarps, tpp) in parts:
        cols, rows_per, warps = tile_shape(group_size, elems)
        per_prog = rows_per * tpp
        tab, total = _table(prow, [-(-r[5] // per_prog) for r in prow], device, keyed=stochastic)
        mixed = len(set(r[8] for r in prow)) > 1
        kind = _kind(prow)
        extra = {}
        if MIXED_MAXNREG and (mixed or kind < 0) and not interpreting():
            extra["maxnreg"] = MIXED_MAXNREG
        launch(_quantize_many_kernel, (total,), tab, len(prow), TP=next_pow2(len(prow)), KIND=kind,
               GS=group_size, COLS=cols, ROWS=rows_per, BITS=0 if mixed else prow[0][8], SYMMETRIC=symmetric,
               STOCHASTIC=stochastic, IDX32=not big, ALIGNED=ALIGN_HINTS["quantize"] and not low & 15,
               NATIVE=not interpreting(), PAIRS=quant.PAIR_SR, FAST=quant.fast_bits() & FAST_MASK, TPP=tpp,
               WORDS=pword, num_warps=pwarps or warps, **extra)


def _align16(n: int) -> int:
    return (n + 15) & ~15


class FlatLayout:
    """The layout of a :func:`quantize_flat` buffer, built one tensor at a time, and the rows of
    its launch table (all but the buffer's address): AGoQ's batches add each save as it comes,
    so a flush only allocates, adds the address, and launches (its host time was the forward's).

    ``offsets[i] = (data, scale, zero)``: byte offsets of tensor ``i``'s codes, fp32 scales and
    zero points (``zero == scale`` when symmetric), each 16-byte aligned."""

    __slots__ = ("group_size", "symmetric", "size", "offsets", "table")

    def __init__(self, group_size: int, symmetric: bool):
        self.group_size, self.symmetric = group_size, symmetric
        self.size = 0  # bytes so far
        self.offsets: list[tuple[int, int, int]] = []
        self.table = _QuantRows()  # output addresses as offsets into the buffer

    def place(self, x: torch.Tensor, bits: int) -> tuple[int, int, int]:
        """Room for ``x`` at ``bits``: its offsets (no launch-table row)."""
        g = -(-x.numel() // self.group_size)
        d = self.size
        sc = d + _align16(g * self.group_size * bits // 8)
        z = end = sc + _align16(4 * g)
        if self.symmetric:
            z = sc
        else:
            end += _align16(4 * g)
        self.size = end
        lay = (d, sc, z)
        self.offsets.append(lay)
        return lay

    def add(self, x: torch.Tensor, bits: int, seed: int) -> tuple[int, int, int]:
        """Place contiguous ``x`` at ``bits`` and add its row (its stochastic-rounding ``seed``)."""
        d, sc, z = lay = self.place(x, bits)
        self.table.add(x, bits, kernel_key(seed), d, sc, z, self.group_size)
        return lay

    def launch(self, device, stochastic: bool) -> torch.Tensor:
        """Allocate the buffer and quantize every tensor added into it (one launch per path)."""
        buf = torch.empty(max(self.size, 16), dtype=torch.uint8, device=device)
        self.table.launch(device, self.group_size, self.symmetric, stochastic, base=buf.data_ptr())
        return buf


def quantize_flat(xs: list[torch.Tensor], bits: list[int], seeds: list[int], *, group_size: int = 128,
                  symmetric: bool = True, stochastic: bool = False, backend: str = "auto",
                  layout: FlatLayout | None = None) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """:func:`quantize_many`'s codes and scales, in one uint8 buffer, without a view or a
    :class:`QTensor` per tensor (per-tensor host time: AGoQ's flushes, hundreds of tensors a
    forward). Returns ``(buffer, layout)``: ``layout[i] = (data, scale, zero)``, byte offsets of
    tensor ``i``'s codes, fp32 scales and zero points (``zero == scale`` when symmetric), each
    16-byte aligned. :func:`flat_qtensor` makes tensor ``i``'s QTensor on demand;
    :func:`dequantize_flat` dequantizes members straight from the buffer. Inputs as for
    :func:`quantize_many` (contiguous fp32 / bf16 / fp16 on one device, 4 or 8 bits).
    ``layout``: the :class:`FlatLayout` of exactly these tensors, widths and seeds, built as they
    came (the caller vouches for it; its table rows are used as they are).
    """
    if not xs:
        return torch.empty(0, dtype=torch.uint8), []
    device = xs[0].device
    if resolve(backend, *xs) == "torch":
        lay = FlatLayout(group_size, symmetric)
        offsets = [lay.place(x, b) for x, b in zip(xs, bits, strict=True)]
        buf = torch.empty(max(lay.size, 16), dtype=torch.uint8, device=device)
        for x, b, s, o3 in zip(xs, bits, seeds, offsets):
            q = quantize_ref(x, bits=b, group_size=group_size, symmetric=symmetric, stochastic=stochastic, seed=s)
            for t, o in ((q.data, o3[0]), (q.scale, o3[1]), (q.zero, o3[2])):
                if t is not None:
                    buf[o:o + t.numel() * t.element_size()].copy_(t.view(torch.uint8))
        return buf, offsets
    for b in set(bits):
        _check(b, group_size)
    if any(x.device != device for x in xs):
        raise ValueError("quantize_flat: all tensors of one call need the same device")
    if layout is None:
        layout = FlatLayout(group_size, symmetric)
        for x, b, s in zip(xs, bits, seeds, strict=True):
            layout.add(x, b, s)
    elif len(layout.offsets) != len(xs) or layout.group_size != group_size or layout.symmetric != symmetric:
        raise ValueError("quantize_flat: the layout given was not built for these tensors")
    return layout.launch(device, stochastic), layout.offsets


def flat_qtensor(buf: torch.Tensor, layout: tuple[int, int, int], shape, dtype: torch.dtype, bits: int,
                 group_size: int, symmetric: bool) -> QTensor:
    """The :class:`QTensor` of one member of a :func:`quantize_flat` buffer (views into it)."""
    n = 1
    for v in shape:
        n *= v
    g = -(-n // group_size)
    d, sc, z = layout
    data = buf[d:d + g * group_size * bits // 8]
    scale = buf[sc:sc + 4 * g].view(torch.float32)
    zero = None if symmetric else buf[z:z + 4 * g].view(torch.float32)
    return QTensor(data, scale, zero, torch.Size(shape), dtype, bits, group_size, symmetric)


def dequantize_flat(buf: torch.Tensor, members: list[tuple[tuple[int, int, int], torch.Size, torch.dtype, int]], *,
                    group_size: int = 128, symmetric: bool = True, backend: str = "auto") -> list[torch.Tensor]:
    """Dequantize members ``(layout, shape, dtype, bits)`` of a :func:`quantize_flat` buffer in one
    launch, each into its own new tensor (freed one by one)."""
    if not members:
        return []
    if resolve(backend, buf) == "torch":
        return [dequantize_ref(flat_qtensor(buf, lay, shape, dt, b, group_size, symmetric))
                for lay, shape, dt, b in members]
    base = buf.data_ptr()
    return _dequantize_into([(base + d, base + sc, base + z, shape, dt, b) for (d, sc, z), shape, dt, b in members],
                            buf.device, group_size, symmetric)


def _dequantize_into(srcs: list[tuple[int, int, int, torch.Size, torch.dtype, int]], device, group_size: int,
                     symmetric: bool) -> list[torch.Tensor]:
    """The Triton path of :func:`dequantize_many` / :func:`dequantize_flat`: ``srcs`` are (codes,
    scales, zero points addresses, shape, output dtype, bits); one new tensor each."""
    out, rows, low = [], [], 0
    for dp, sp, zp, shape, dt, b in srcs:
        o = torch.empty(shape, dtype=dt, device=device)  # one allocation each: freed one by one
        out.append(o)
        n = o.numel()
        if n:
            op = o.data_ptr()
            rows.append([dp, sp, zp, op, n, -(-n // group_size), 0, 0, b, _FLOAT_KIND[dt]])
            low |= dp | sp | zp | op | n
    if rows:
        _launch_dequantize(rows, device, group_size, symmetric, low)
    return out


def dequantize_many(qs: list[QTensor], *, dtype: torch.dtype | None = None,
                    backend: str = "auto") -> list[torch.Tensor]:
    """``[dequantize(q, dtype=dtype) for q in qs]`` in one launch (integer, non-stacked QTensors
    of 4 or 8 bits and output dtypes mixed, one group size and symmetry)."""
    if not qs:
        return []
    for q in qs:
        if q.fmt != "int" or q.stacked:
            raise ValueError("dequantize_many takes integer, non-stacked QTensors")
    gs = _same([q.group_size for q in qs], "group_size")
    sym = _same([q.symmetric for q in qs], "symmetric")
    device = _same([q.data.device for q in qs], "device")
    dtypes = [dtype or q.dtype for q in qs]
    for d in set(dtypes):
        if d not in _FLOAT_KIND:
            raise TypeError(f"dequantize_many writes fp32/bf16/fp16, got {d}")
    if resolve(backend, *(q.data for q in qs)) == "torch":
        return [dequantize_ref(q, d) for q, d in zip(qs, dtypes)]
    srcs = [(q.data.data_ptr(), q.scale.data_ptr(), (q.scale if q.zero is None else q.zero).data_ptr(), q.shape, d,
             q.bits) for q, d in zip(qs, dtypes)]
    return _dequantize_into(srcs, device, gs, sym)


def _launch_dequantize(rows: list[list[int]], device, group_size: int, symmetric: bool, low: int) -> None:
    """Launch the dequantize kernel on table ``rows`` (``low``: as for :func:`_launch_quantize`)."""
    cols, rows_per, warps = tile_shape(group_size, DQ_TILE[0])
    warps = DQ_TILE[1] or warps
    per_prog = rows_per * DQ_TILE[2]
    parts = [rows]
    if DQ_SPLIT:  # one launch per (bits, dtype kind): each compiled for its own path
        groups: dict[tuple[int, int], list] = {}
        for r in rows:
            groups.setdefault((r[8], r[9]), []).append(r)
        parts = list(groups.values())
    for prow in parts:
        tab, total = _table(prow, [-(-r[5] // per_prog) for r in prow], device)
        mixed = len(set(r[8] for r in prow)) > 1
        launch(_dequantize_many_kernel, (total,), tab, len(prow), TP=next_pow2(len(prow)),
               KIND=_kind(prow), HW_CAST=not interpreting(), GS=group_size, COLS=cols, ROWS=rows_per,
               BITS=0 if mixed else prow[0][8], SYMMETRIC=symmetric,
               ALIGNED=ALIGN_HINTS["dequantize"] and not low & 15, FAST=quant.fast_bits(), TPP=DQ_TILE[2],
               num_warps=warps)

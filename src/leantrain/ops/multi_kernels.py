"""The launch table of the multi-tensor quantize / dequantize kernels, and the kernels.

A launch of :mod:`leantrain.ops.multi` takes one table, an int64 device tensor with one row of
:data:`TABLE_COLUMNS` columns per tensor (:class:`Col`), followed by the
first-program column again, padded to a power of two. Program ``p`` finds its tensor as the
number of tensors whose first program is ``<= p``, minus one, and then does what
:func:`leantrain.ops.quant._quantize_kernel` (or ``_dequantize_kernel``) does for ``TPP``
consecutive ``[ROWS, group_size]`` tiles of that tensor. ``BITS`` / ``KIND`` 0 / -1: the launch
mixes widths / dtypes and each program branches on its row's ``bits`` / ``kind`` column.
"""

from __future__ import annotations

from array import array

import torch

from leantrain.ops._backend import HAS_TRITON, next_pow2
from leantrain.ops.rng import replay_salt


class Col:
    """Column indices of a table row (host side; the kernels read the same as ``COL_*``
    constexprs). Quantize rows start with the input, codes, scales and zero points addresses;
    dequantize rows with the codes, scales, zero points and output addresses. Then both:
    elements, groups, the stochastic-rounding key (quantize), the row's first program, bits, and
    the dtype kind (:data:`FLOAT_KIND`: of the input when quantizing, of the output when
    dequantizing)."""

    IN, DATA_Q, SCALE_Q, ZERO_Q = 0, 1, 2, 3
    DATA_DQ, SCALE_DQ, ZERO_DQ, OUT = 0, 1, 2, 3
    N, N_GROUPS, KEY, FIRST_PROGRAM, BITS, KIND = 4, 5, 6, 7, 8, 9


TABLE_COLUMNS = 10
FLOAT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the ``kind`` column


def launch_table(rows: list[list[int]], progs: list[int], device, keyed: bool = False) -> tuple[torch.Tensor, int]:
    """The rows (first program filled in) plus the padded first-program column, as one int64
    device tensor; copied without waiting for the stream (a blocking copy would). ``keyed``: the
    rows' ``key`` column holds stochastic-rounding keys (see the capture case below)."""
    starts, s = [], 0
    for r, p in zip(rows, progs):
        r[Col.FIRST_PROGRAM] = s  # the row's first program, also read by the program that owns a tile of it
        starts.append(s)
        s += p
    tp = next_pow2(max(1, len(rows)))
    flat = array("q", [v for r in rows for v in r])
    flat.extend(starts)
    flat.extend([1 << 62] * (tp - len(starts)))
    # (from an array: a third of torch.tensor(list)'s host time.) From pageable memory: on an
    # H200 the copy did not wait for a busy stream (15-23 us of host time behind 2 ms of queued
    # work), and page-locked tables cost more host time and made AGoQ's step no faster.
    host = torch.frombuffer(flat, dtype=torch.int64)
    if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
        # Captured into a CUDA graph, the copy is a memcpy node that reads the host buffer at every
        # replay: page-locked (a pageable copy cannot be captured) and kept for the process's life.
        host = host.pin_memory()
        _CAPTURED_TABLES.append(host)
        dev = host.to(device, non_blocking=True)
        if keyed:  # each replay rounds with new noise: the keys XOR the replay's salt, in the graph
            salt = replay_salt(device, create=False)
            if salt is not None:
                dev[Col.KEY: len(rows) * TABLE_COLUMNS: TABLE_COLUMNS].bitwise_xor_(salt)
        return dev, s
    return host.to(device, non_blocking=True), s


# Host launch tables read by captured CUDA graphs' copies (see launch_table); a few KiB per graph.
_CAPTURED_TABLES: list[torch.Tensor] = []


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

    TABLE_COLUMNS_TL = tl.constexpr(TABLE_COLUMNS)
    COL_IN, COL_DATA_Q, COL_SCALE_Q, COL_ZERO_Q = (tl.constexpr(c) for c in (Col.IN, Col.DATA_Q, Col.SCALE_Q,
                                                                             Col.ZERO_Q))
    COL_DATA_DQ, COL_SCALE_DQ, COL_ZERO_DQ, COL_OUT = (tl.constexpr(c) for c in (Col.DATA_DQ, Col.SCALE_DQ,
                                                                                 Col.ZERO_DQ, Col.OUT))
    COL_N, COL_N_GROUPS, COL_KEY = tl.constexpr(Col.N), tl.constexpr(Col.N_GROUPS), tl.constexpr(Col.KEY)
    COL_FIRST_PROGRAM, COL_BITS, COL_KIND = (tl.constexpr(Col.FIRST_PROGRAM), tl.constexpr(Col.BITS),
                                             tl.constexpr(Col.KIND))

    @triton.jit
    def _row(tab_ptr, n_tensors, TP: tl.constexpr):
        """(this program's tensor's table row pointer, program index inside that tensor)."""
        pid = tl.program_id(0).to(tl.int64)
        starts = tl.load(tab_ptr + n_tensors * TABLE_COLUMNS_TL + tl.arange(0, TP))
        t = tl.sum((starts <= pid).to(tl.int32), axis=0) - 1
        row = tab_ptr + t * TABLE_COLUMNS_TL
        return row, pid - tl.load(row + COL_FIRST_PROGRAM)

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
        x_addr = tl.load(row + COL_IN)
        data_ptr = _ptr(tl.load(row + COL_DATA_Q), tl.uint8, ALIGNED)
        scale_ptr = _ptr(tl.load(row + COL_SCALE_Q), tl.float32, ALIGNED)
        zero_ptr = _ptr(tl.load(row + COL_ZERO_Q), tl.float32, ALIGNED)
        n = tl.load(row + COL_N)
        if ALIGNED:  # (and every n a multiple of 16: tile masks constant over 16 elements, loads vectorize)
            n = tl.multiple_of(n, 16)
        n_groups = tl.load(row + COL_N_GROUPS)
        key = tl.load(row + COL_KEY).to(tl.int32)
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
        """``BITS`` 4 or 8 for every tensor, or 0: each tensor's own (table column ``bits``); ``KIND``
        the input dtype of every tensor (0 fp32, 1 bf16, 2 fp16), or -1: each tensor's own
        (column ``kind``)."""
        row, prog = _row(tab_ptr, n_tensors, TP)
        if KIND < 0:
            k = tl.load(row + COL_KIND)
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
            if tl.load(row + COL_BITS) == 4:
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
        data_ptr = _ptr(tl.load(row + COL_DATA_DQ), tl.uint8, ALIGNED)
        scale_ptr = _ptr(tl.load(row + COL_SCALE_DQ), tl.float32, ALIGNED)
        zero_ptr = _ptr(tl.load(row + COL_ZERO_DQ), tl.float32, ALIGNED)
        out_ptr = tl.load(row + COL_OUT)
        n = tl.load(row + COL_N)
        if ALIGNED:  # (and every n a multiple of 16: store masks constant over 16 elements, stores vectorize)
            n = tl.multiple_of(n, 16)
        n_groups = tl.load(row + COL_N_GROUPS)
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
        if KIND < 0:  # each tensor's output dtype (table column ``kind``)
            k = tl.load(row + COL_KIND)
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
            if tl.load(row + COL_BITS) == 4:
                _dequantize_tile(row, prog, KIND, HW_CAST, GS, COLS, ROWS, 4, SYMMETRIC, ALIGNED, FAST, TPP)
            else:
                _dequantize_tile(row, prog, KIND, HW_CAST, GS, COLS, ROWS, 8, SYMMETRIC, ALIGNED, FAST, TPP)
        else:
            _dequantize_tile(row, prog, KIND, HW_CAST, GS, COLS, ROWS, BITS, SYMMETRIC, ALIGNED, FAST, TPP)

"""Fused dequantize -> fp32 sum over k peers -> requantize, for two-level reduce-scatter.

Math: for a stacked QTensor of ``k`` peers' chunks of one shape (``data [k, bytes]``,
``scale [k, groups]``), element ``i`` of the output is
    s_i = ((0 + v_0i) + v_1i) + ... + v_(k-1)i,   v_pi = dequantize(peer p)_i   (fp32, peer order)
    out = quantize(s, bits=bits_out, group_size=group_size_out, ...)
so the sum is requantized once (never per hop). Input and output group sizes are
independent. Inputs may be int8/int4 (symmetric or not) or FP8; the output is integer.

How the two-level reduce-scatter calls it: after ``all_to_all_single`` each rank holds, in
one uint8 buffer, ``k`` peers' codes for its chunk and, in one fp32 buffer, their scales;
``QTensor.from_buffers(codes, scales, shape=chunk_shape, bits=..., group_size=...)`` views
them as a stacked QTensor without copying and ``dequant_sum_requant(q, ...)`` is one kernel
launch (no Python loop over elements; the torch reference loops over the k peers only).

Tiling (Triton): one program owns ``ROWS`` output groups (``[ROWS, group_size_out]``) and
loops over the k peers, gathering each peer's codes and per-element scales. Bytes per
output element: k * (bits_in / 8 + 4 / group_size_in) read, bits_out / 8 (+ 4 / gs_out) written.
"""

from __future__ import annotations

import torch

from leantrain.ops import quant
from leantrain.ops._backend import HAS_TRITON, launch, resolve
from leantrain.ops.fp8 import FP8_FORMATS, dequantize_fp8_ref
from leantrain.ops.qtensor import QTensor
from leantrain.ops.quant import dequantize_ref, encode_groups_ref, pack_codes
from leantrain.ops.rng import kernel_key
from leantrain.ops.tiles import (
    FAST_CLEAN_TILE,
    check_int_format,
    fast_bits,
    int_code_range,
    pad_groups,
    tile_shape,
)


def dequant_sum_requant_ref(q: QTensor, *, bits_out, group_size_out, symmetric_out, stochastic,
                            seed) -> QTensor:
    if q.fmt == "int":
        v = dequantize_ref(q, torch.float32)
    else:
        v = dequantize_fp8_ref(q, torch.float32)
    v = v.reshape(q.num_peers, -1)
    s = v[0]
    for p in range(1, q.num_peers):
        s = s + v[p]
    xg, valid = pad_groups(s, group_size_out)
    code, scale, zero = encode_groups_ref(xg, valid, bits=bits_out, symmetric=symmetric_out,
                                          stochastic=stochastic, seed=seed)
    return QTensor(pack_codes(code, bits_out), scale, zero, q.shape, torch.float32, bits_out,
                   group_size_out, symmetric_out)


_UNROLL_MAX = 16  # peers up to this count: the peer loop is unrolled at compile time
TILE_ELEMS = 2048  # output elements per program (whole output groups); 2048 at 4 warps measured
#   best on an H200
NUM_WARPS = 4
_IDX32_LIMIT = 2**32  # outputs up to this many elements use the uint32 RNG counter

if HAS_TRITON:
    import triton
    import triton.language as tl

    from leantrain.ops.fp8 import fp8_decode_tl
    from leantrain.ops.quant_tl import (
        encode_pack_tl,
        store_packed_tl,
        tile_index_tl,
        unpack_float_tl,
    )

    @triton.jit
    def _dsr_peer(dp, sp, zp, loc, valid, bloc, bvalid, sidx, svalid,
                  GS_IN: tl.constexpr, BITS_IN: tl.constexpr, SYM_IN: tl.constexpr,
                  FP8: tl.constexpr, M: tl.constexpr, BIAS: tl.constexpr, EMIN: tl.constexpr,
                  IS_E4M3: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                  ROW_SCALE: tl.constexpr, FAST: tl.constexpr):
        """One peer's dequantized ``[ROWS, COLS]`` tile (fp32), as :func:`dequantize_ref`."""
        if BITS_IN == 8:
            c = tl.load(dp + loc, mask=valid, other=0)
            if FP8:
                v = fp8_decode_tl(c.to(tl.int32), M, BIAS, EMIN, IS_E4M3)
            elif SYM_IN:
                v = c.to(tl.int8, bitcast=True).to(tl.float32)  # two's complement byte
            else:
                v = c.to(tl.float32)
        else:
            byts = tl.load(dp + bloc, mask=bvalid, other=0)
            v = unpack_float_tl(byts, ROWS, COLS // 2, 4, SYM_IN, FAST)
        if ROW_SCALE:
            v = v * tl.load(sp + sidx, mask=svalid, other=0.0)[:, None]
            if not SYM_IN:
                v = v + tl.load(zp + sidx, mask=svalid, other=0.0)[:, None]
        else:
            v = v * tl.load(sp + sidx, mask=valid, other=0.0)
            if not SYM_IN:
                v = v + tl.load(zp + sidx, mask=valid, other=0.0)
        return v

    @triton.jit(do_not_specialize=["key"])
    def _dsr_kernel(data_ptr, scale_ptr, zero_ptr, odata_ptr, oscale_ptr, ozero_ptr,
                    n, k, in_bytes, in_groups, out_groups, key,
                    GS_IN: tl.constexpr, BITS_IN: tl.constexpr, SYM_IN: tl.constexpr,
                    FP8: tl.constexpr, M: tl.constexpr, BIAS: tl.constexpr, EMIN: tl.constexpr,
                    IS_E4M3: tl.constexpr,
                    GS: tl.constexpr, COLS: tl.constexpr, ROWS: tl.constexpr, BITS: tl.constexpr,
                    SYMMETRIC: tl.constexpr, STOCHASTIC: tl.constexpr,
                    QLO: tl.constexpr, QHI: tl.constexpr, K: tl.constexpr,
                    ROW_SCALE: tl.constexpr, IDX32: tl.constexpr, PAIRS: tl.constexpr,
                    FAST: tl.constexpr):
        row0 = tl.program_id(0).to(tl.int64) * ROWS
        base, rem, loc, valid, idx = tile_index_tl(row0, n, GS, COLS, ROWS, IDX32)
        r = tl.arange(0, ROWS)
        # int4 input: whole bytes of each row (GS is even, so rows start on a byte)
        HB: tl.constexpr = COLS // 2
        bcol = tl.arange(0, HB)
        bloc = r[:, None] * (GS // 2) + bcol[None, :]
        bvalid = (bcol[None, :] < GS // 2) & (2 * bloc < rem)
        if BITS_IN == 8:
            dp = data_ptr + base
        else:
            dp = data_ptr + base // 2
        g0 = base // GS_IN                                  # input group of the tile's first element
        off0 = (base - g0 * GS_IN).to(tl.int32)             # its offset in that group
        if ROW_SCALE:  # every output row inside one input group: one scale per row
            sidx = (off0 + r * GS) // GS_IN
            svalid = row0 + r < out_groups
        else:          # per-element input group, int32 inside the tile
            sidx = (off0 + loc) // GS_IN
            svalid = valid
        sp = scale_ptr + g0
        zp = zero_ptr + g0
        acc = tl.zeros([ROWS, COLS], dtype=tl.float32)
        if K > 0:  # unrolled: all peers' loads issue back to back
            for _ in tl.static_range(K):
                acc = acc + _dsr_peer(dp, sp, zp, loc, valid, bloc, bvalid, sidx, svalid, GS_IN,
                                      BITS_IN, SYM_IN, FP8, M, BIAS, EMIN, IS_E4M3, ROWS, COLS,
                                      ROW_SCALE, FAST)
                dp += in_bytes
                sp += in_groups
                zp += in_groups
        else:
            for _ in range(k):
                acc = acc + _dsr_peer(dp, sp, zp, loc, valid, bloc, bvalid, sidx, svalid, GS_IN,
                                      BITS_IN, SYM_IN, FP8, M, BIAS, EMIN, IS_E4M3, ROWS, COLS,
                                      ROW_SCALE, FAST)
                dp += in_bytes
                sp += in_groups
                zp += in_groups
        byts, scale, zero = encode_pack_tl(acc, valid, idx, key, ROWS, COLS, BITS, QLO, QHI, SYMMETRIC,
                                           STOCHASTIC, PAIRS, FAST)
        store_packed_tl(odata_ptr, oscale_ptr, ozero_ptr, byts, scale, zero, row0, out_groups, GS, COLS, ROWS,
                        BITS, SYMMETRIC)


def dequant_sum_requant(qs: QTensor | list[QTensor], *, bits_out: int = 4, group_size_out: int = 128,
                        symmetric_out: bool = True, stochastic: bool = False, seed: int = 0,
                        backend: str = "auto") -> QTensor:
    """Sum ``k`` peers' quantized chunks in fp32 and requantize once.

    ``qs``: a stacked QTensor (``data [k, bytes]``, e.g. from :meth:`QTensor.from_buffers`) or
    a list of ``k`` QTensors of the same shape and format (stacked here, one copy).
    Returns a plain QTensor of the chunk's shape with ``dtype=torch.float32``.
    """
    q = qs if isinstance(qs, QTensor) else QTensor.stack(list(qs))
    if not q.stacked:
        q = QTensor.stack([q])
    check_int_format(bits_out, group_size_out)
    if resolve(backend, q.data) == "torch":
        return dequant_sum_requant_ref(q, bits_out=bits_out, group_size_out=group_size_out,
                                       symmetric_out=symmetric_out, stochastic=stochastic, seed=seed)
    n, k = q.numel, q.num_peers
    g = -(-n // group_size_out)
    dev = q.device
    data = torch.empty(g * group_size_out * bits_out // 8, dtype=torch.uint8, device=dev)
    scale = torch.empty(g, dtype=torch.float32, device=dev)
    zero = None if symmetric_out else torch.empty(g, dtype=torch.float32, device=dev)
    if g:
        fp8 = q.fmt != "int"
        _, m, bias, emin, _ = FP8_FORMATS[q.fmt] if fp8 else (None, 0, 0, 0, 0)
        cols, rows, warps = tile_shape(group_size_out, TILE_ELEMS)
        warps = NUM_WARPS or warps
        qlo, qhi = int_code_range(bits_out, symmetric_out)
        qd, qsc = q.data.contiguous(), q.scale.contiguous()
        qz = qsc if q.zero is None else q.zero.contiguous()
        launch(_dsr_kernel, (triton.cdiv(g, rows),), qd, qsc, qz, data, scale,
               scale if zero is None else zero, n, k, q.data.shape[1], q.scale.shape[1], g,
               kernel_key(seed), GS_IN=q.group_size, BITS_IN=q.bits, SYM_IN=q.zero is None,
               FP8=fp8, M=m, BIAS=bias, EMIN=emin, IS_E4M3=q.fmt == "e4m3", GS=group_size_out,
               COLS=cols, ROWS=rows, BITS=bits_out, SYMMETRIC=symmetric_out, STOCHASTIC=stochastic,
               QLO=qlo, QHI=qhi, K=k if k <= _UNROLL_MAX else 0,
               ROW_SCALE=q.group_size % group_size_out == 0, IDX32=g * group_size_out <= _IDX32_LIMIT,
               PAIRS=quant.PAIR_SR, FAST=fast_bits() & ~FAST_CLEAN_TILE, num_warps=warps)
    return QTensor(data, scale, zero, q.shape, torch.float32, bits_out, group_size_out, symmetric_out)

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

from ._backend import HAS_TRITON, launch, resolve
from .fp8 import FP8_FORMATS
from .qtensor import QTensor
from .quant import (
    _check,
    _pad_groups,
    _qrange,
    dequantize_ref,
    encode_groups_ref,
    pack_codes,
    tile_shape,
)
from .rng import kernel_key


def dequant_sum_requant_ref(q: QTensor, *, bits_out, group_size_out, symmetric_out, stochastic,
                            seed) -> QTensor:
    if q.fmt == "int":
        v = dequantize_ref(q, torch.float32)
    else:
        from .fp8 import dequantize_fp8_ref

        v = dequantize_fp8_ref(q, torch.float32)
    v = v.reshape(q.num_peers, -1)
    s = v[0]
    for p in range(1, q.num_peers):
        s = s + v[p]
    xg, valid = _pad_groups(s, group_size_out)
    code, scale, zero = encode_groups_ref(xg, valid, bits=bits_out, symmetric=symmetric_out,
                                          stochastic=stochastic, seed=seed)
    return QTensor(pack_codes(code, bits_out), scale, zero, q.shape, torch.float32, bits_out,
                   group_size_out, symmetric_out)


if HAS_TRITON:
    import triton
    import triton.language as tl

    from .fp8 import fp8_decode_tl
    from .quant import encode_tile_tl, pack_tile_tl

    @triton.jit(do_not_specialize=["key"])
    def _dsr_kernel(data_ptr, scale_ptr, zero_ptr, odata_ptr, oscale_ptr, ozero_ptr,
                    n, k, in_bytes, in_groups, out_groups, key,
                    GS_IN: tl.constexpr, BITS_IN: tl.constexpr, SYM_IN: tl.constexpr,
                    FP8: tl.constexpr, M: tl.constexpr, BIAS: tl.constexpr, EMIN: tl.constexpr,
                    IS_E4M3: tl.constexpr,
                    GS: tl.constexpr, COLS: tl.constexpr, ROWS: tl.constexpr, BITS: tl.constexpr,
                    SYMMETRIC: tl.constexpr, STOCHASTIC: tl.constexpr,
                    QLO: tl.constexpr, QHI: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, COLS)
        idx = rows[:, None] * GS + cols[None, :]
        valid = (cols[None, :] < GS) & (idx < n)
        gin = idx // GS_IN
        acc = tl.zeros([ROWS, COLS], dtype=tl.float32)
        dp = data_ptr
        sp = scale_ptr
        zp = zero_ptr
        for _ in range(k):
            if BITS_IN == 8:
                c = tl.load(dp + idx, mask=valid, other=0).to(tl.int32)
                if FP8:
                    v = fp8_decode_tl(c, M, BIAS, EMIN, IS_E4M3)
                else:
                    if SYM_IN:
                        c = tl.where(c >= 128, c - 256, c)
                    v = c.to(tl.float32)
            else:
                byte = tl.load(dp + idx // 2, mask=valid, other=0).to(tl.int32)
                c = (byte >> ((idx & 1) * 4).to(tl.int32)) & 0xF
                if SYM_IN:
                    c = tl.where(c >= 8, c - 16, c)
                v = c.to(tl.float32)
            v = v * tl.load(sp + gin, mask=valid, other=0.0)
            if not SYM_IN:
                v = v + tl.load(zp + gin, mask=valid, other=0.0)
            acc = acc + v
            dp += in_bytes
            sp += in_groups
            zp += in_groups
        code, scale, zero = encode_tile_tl(acc, valid, idx, key, QLO, QHI, SYMMETRIC, STOCHASTIC)
        byts = pack_tile_tl(code, ROWS, COLS, BITS)
        BC: tl.constexpr = COLS * BITS // 8
        bcols = tl.arange(0, BC)
        bmask = (rows[:, None] < out_groups) & (bcols[None, :] < GS * BITS // 8)
        tl.store(odata_ptr + rows[:, None] * (GS * BITS // 8) + bcols[None, :], byts, mask=bmask)
        tl.store(oscale_ptr + rows, scale, mask=rows < out_groups)
        if not SYMMETRIC:
            tl.store(ozero_ptr + rows, zero, mask=rows < out_groups)


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
    _check(bits_out, group_size_out)
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
        cols, rows, warps = tile_shape(group_size_out)
        qlo, qhi = _qrange(bits_out, symmetric_out)
        qd, qsc = q.data.contiguous(), q.scale.contiguous()
        qz = qsc if q.zero is None else q.zero.contiguous()
        launch(_dsr_kernel, (triton.cdiv(g, rows),), qd, qsc, qz, data, scale,
               scale if zero is None else zero, n, k, q.data.shape[1], q.scale.shape[1], g,
               kernel_key(seed), GS_IN=q.group_size, BITS_IN=q.bits, SYM_IN=q.zero is None,
               FP8=fp8, M=m, BIAS=bias, EMIN=emin, IS_E4M3=q.fmt == "e4m3", GS=group_size_out,
               COLS=cols, ROWS=rows, BITS=bits_out, SYMMETRIC=symmetric_out, STOCHASTIC=stochastic,
               QLO=qlo, QHI=qhi, num_warps=warps)
    return QTensor(data, scale, zero, q.shape, torch.float32, bits_out, group_size_out, symmetric_out)

"""Triton device helpers shared by the kernels of :mod:`leantrain.ops`.

The ``FAST`` flags of :mod:`leantrain.ops.tiles` as constexprs a kernel can test
(``if HW_CAST & FAST:``), the rounding fp32 -> bf16 / fp16 cast every kernel writes its outputs
with (:func:`cast_out_tl`) and the widening of two 16-bit floats packed in a 32-bit word
(:func:`half_pair_tl`).
"""

from __future__ import annotations

from leantrain.ops._backend import HAS_TRITON
from leantrain.ops.tiles import (
    FAST_CLEAN_TILE,
    FAST_CODE_BITCAST,
    FAST_HASH_IMAD,
    FAST_HW_CAST,
    FAST_ROUND_BY_ADD,
)

if HAS_TRITON:
    import triton
    import triton.language as tl

    ROUND_BY_ADD = tl.constexpr(FAST_ROUND_BY_ADD)
    CODE_BITCAST = tl.constexpr(FAST_CODE_BITCAST)
    HW_CAST = tl.constexpr(FAST_HW_CAST)
    HASH_IMAD = tl.constexpr(FAST_HASH_IMAD)
    CLEAN_TILE = tl.constexpr(FAST_CLEAN_TILE)

    @triton.jit
    def cast_out_tl(v, DTYPE: tl.constexpr, FAST: tl.constexpr):
        """fp32 -> ``DTYPE`` with round-to-nearest-even. ``FAST & HW_CAST`` (GPU): the hardware
        conversion; else bf16 is rounded on the integer bits (the Triton interpreter truncates
        fp32 -> bf16; GPUs round to nearest even)."""
        if HW_CAST & FAST:
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


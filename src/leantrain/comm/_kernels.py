"""The numeric blocks the compressors use, taken from :mod:`leantrain.ops`.

One import site, so ``comm`` depends on the names agreed with ``ops`` in one place:
``quantize`` / ``dequantize`` (block-wise int8/int4, stochastic rounding),
``hadamard`` / ``hadamard_quantize`` (blocked Walsh-Hadamard, optionally fused with the
quantizer) and ``dequant_sum_requant`` (the fused middle hop of the two-level
reduce-scatter). Each dispatches to Triton on CUDA and to its torch reference elsewhere.
"""

from __future__ import annotations

from leantrain.ops import (  # noqa: F401
    QTensor,
    dequant_sum_requant,
    dequantize,
    hadamard,
    hadamard_quantize,
    quantize,
)


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from small integers (step, bucket, rank, stage): distinct inputs, distinct streams."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h ^= (int(p) + 0x9E3779B97F4A7C15 + ((h << 6) & 0xFFFFFFFFFFFFFFFF) + (h >> 2)) & 0xFFFFFFFFFFFFFFFF
        h = (h * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    return h & 0x7FFFFFFFFFFFFFFF

"""bf16 stochastic rounding of fp32 (unbiased), torchao style.

Math: with ``b = bits(x)`` (fp32 as int32) and ``r`` 16 random bits,
``y = bf16(bits^-1((b + r) & 0xFFFF0000))``. Adding ``r`` to the 16 bits bf16 drops carries
into the kept half with probability ``(b & 0xFFFF) / 2**16``, so the magnitude rounds up
with exactly the probability that makes ``E[y] = x`` (sign-magnitude: unbiased for
negatives too). ``r = hash_u32(seed, offset + i) >> 16`` from :mod:`leantrain.ops.rng`, so
torch and Triton give identical bits. NaN stays NaN and +-inf stay +-inf; a finite value
above the largest bf16 (about 3.39e38) may round up to inf, as with round-to-nearest.

Tiling (Triton): 1-D, ``BLOCK`` = 4096 elements per program. Bytes per element: 4 read,
2 written.
"""

from __future__ import annotations

import torch

from leantrain.ops._backend import HAS_TRITON, launch, resolve
from leantrain.ops.rng import hash_u32, kernel_key


def bf16_stochastic_round_ref(x: torch.Tensor, *, seed: int, offset: int = 0) -> torch.Tensor:
    xf = x.to(torch.float32).contiguous()
    idx = torch.arange(xf.numel(), device=x.device, dtype=torch.int64).view(xf.shape) + offset
    r = (hash_u32(seed, idx) >> 16).to(torch.int32)
    b = (xf.view(torch.int32) + r) & -65536
    y = b.view(torch.float32)
    y = torch.where(torch.isnan(xf), xf, y)  # inf + r keeps its bits; NaN payloads may not
    return y.to(torch.bfloat16)


if HAS_TRITON:
    import triton
    import triton.language as tl

    from leantrain.ops.rng import hash_u32_tl

    @triton.jit
    def sr_bf16(x, rand_u32):
        """Device helper: fp32 tensor ``x`` -> bf16, stochastically rounded with the top 16 bits
        of ``rand_u32`` (a uint32 tensor, e.g. ``hash_u32_tl(key, index)``)."""
        r = (rand_u32 >> 16).to(tl.int32)
        b = (x.to(tl.int32, bitcast=True) + r) & -65536
        y = b.to(tl.float32, bitcast=True)
        y = tl.where(x != x, x, y)
        return y.to(tl.bfloat16)

    @triton.jit(do_not_specialize=["key", "offset"])
    def _sr_kernel(x_ptr, y_ptr, n, key, offset, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs, sr_bf16(x, hash_u32_tl(key, offs + offset)), mask=m)


def bf16_stochastic_round(x: torch.Tensor, *, seed: int, offset: int = 0, backend: str = "auto") -> torch.Tensor:
    """Round ``x`` (fp32) to bf16 stochastically; element ``i`` uses RNG counter ``offset + i``.

    Pass a distinct ``(seed, offset)`` per call site and step (e.g. ``seed=step``,
    ``offset`` = the tensor's position in a flat parameter buffer) to get independent draws.
    """
    if resolve(backend, x) == "torch":
        return bf16_stochastic_round_ref(x, seed=seed, offset=offset)
    xf = x.contiguous()
    y = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    n = xf.numel()
    if n:
        block = 4096
        launch(_sr_kernel, (triton.cdiv(n, block),), xf, y, n, kernel_key(seed), int(offset),
               BLOCK=block, num_warps=8)
    return y

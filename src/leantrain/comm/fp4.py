"""NVFP4-style 4-bit floating point for gradient communication (GIFT's ``format="nvfp4"``).

A tensor is cut into blocks of 16 elements. Each element is an E2M1 value (sign, 2 exponent bits,
1 mantissa bit: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), two to a byte. Each block has an E4M3 scale
(one byte), and each message one fp32 scale that puts the block scales into E4M3's range:

    g = absmax(message) / (6 * 448)           (fp32, once a message)
    s = E4M3↑(absmax(block) / (6 g))          (one byte a block, rounded up to an E4M3 value)
    x ≈ s g · E2M1(x / (s g))                 (each element; |x / (s g)| <= 6, nothing saturates)

That is 4.5 bits an element plus 32 bits a message: 0.281 of bf16's bytes. The format is the one
of NVIDIA's Blackwell NVFP4 (block 16, E4M3 block scales, an fp32 tensor scale); this module
computes it in torch, on any device, and ships it as uint8 (gloo has no 4-bit or float8 types).

Rounding of the elements: to nearest (``generator=None``), or stochastic: ``x`` rounds up to
the next grid point with probability equal to its distance from the one below, so the expected
value of the decoded tensor is ``x`` (the block scale is rounded up, so no element is clipped; a
block whose scale is below E4M3's smallest value, ``2^-9`` of the largest block's, decodes as zero).
A block with a non-finite element decodes as NaN (its scale byte is E4M3's NaN), so the
optimizer's checks still see it.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["BLOCK", "E2M1_GRID", "nvfp4_all_reduce", "nvfp4_dequantize", "nvfp4_quantize", "nvfp4_nbytes"]

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitudes of codes 0..7; bit 3 is the sign


def nvfp4_nbytes(numel: int) -> int:
    """Bytes of one message of ``numel`` elements (a multiple of 16): codes, block scales, the fp32 scale."""
    return numel // 2 + numel // BLOCK + 4


def _grid(device) -> Tensor:
    return torch.tensor(E2M1_GRID, dtype=torch.float32, device=device)


def nvfp4_quantize(x: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """``x`` (fp32, ``numel`` a multiple of 16) -> one uint8 message ``[nvfp4_nbytes(numel)]``: the
    packed codes (element ``2i`` in the low nibble of byte ``i``), the E4M3 block scales, the fp32
    message scale. ``generator``: stochastic rounding of the elements from it (module doc)."""
    if x.numel() % BLOCK:
        raise ValueError(f"nvfp4_quantize: numel must be a multiple of {BLOCK}, got {x.numel()}")
    xb = x.detach().float().reshape(-1, BLOCK)
    amax_b = xb.abs().amax(1)
    finite = torch.isfinite(amax_b)
    amax = torch.where(finite, amax_b, torch.zeros_like(amax_b)).amax()
    g = torch.where(amax > 0, amax / (E2M1_MAX * E4M3_MAX), torch.ones_like(amax))
    s = (amax_b / (E2M1_MAX * g)).clamp(max=E4M3_MAX)
    s8 = s.to(torch.float8_e4m3fn)  # rounded up below, so that no element saturates: |x| <= 6 s g
    s8 = torch.where(s8.float() < s, s8.view(torch.uint8) + 1, s8.view(torch.uint8))  # (the next E4M3 value)
    s8 = torch.where(finite, s8, torch.full_like(s8, 0x7F)).view(torch.float8_e4m3fn)  # 0x7F: E4M3's NaN
    unit = s8.float() * g  # the block's step unit (0 where E4M3 flushed a tiny block's scale to zero)
    y = torch.where(unit[:, None] > 0, xb / unit[:, None], torch.zeros_like(xb))
    y = torch.nan_to_num(y, nan=0.0).clamp_(-E2M1_MAX, E2M1_MAX)
    mag = y.abs()
    grid = _grid(x.device)
    if generator is None:  # nearest: compare with the midpoints between grid values
        idx = torch.bucketize(mag, (grid[1:] + grid[:-1]) / 2)
    else:  # stochastic: the grid point below, plus one with probability of the distance to it
        lo = (torch.bucketize(mag, grid, right=True) - 1).clamp_(0, len(E2M1_GRID) - 2)
        glo, ghi = grid[lo], grid[lo + 1]
        p = (mag - glo) / (ghi - glo)
        u = torch.rand(mag.shape, generator=generator, device=x.device)
        idx = lo + (u < p).long()
    code = (idx | ((y < 0).long() << 3)).to(torch.uint8).reshape(-1, 2)
    packed = code[:, 0] | (code[:, 1] << 4)
    return torch.cat([packed, s8.view(torch.uint8), g.reshape(1).view(torch.uint8)])


def nvfp4_dequantize(msg: Tensor, numel: int) -> Tensor:
    """Inverse of :func:`nvfp4_quantize` for a message of ``numel`` elements: fp32 ``[numel]``."""
    nb = numel // BLOCK
    packed = msg[:numel // 2]
    s8 = msg[numel // 2:numel // 2 + nb].contiguous().view(torch.float8_e4m3fn).float()
    g = msg[numel // 2 + nb:numel // 2 + nb + 4].clone().view(torch.float32)
    code = torch.stack([packed & 0xF, packed >> 4], 1).reshape(-1).long()
    val = _grid(msg.device)[code & 7]
    val = torch.where(code >= 8, -val, val)
    return (val.view(nb, BLOCK) * (s8 * g)[:, None]).reshape(-1)


def nvfp4_all_reduce(tensor: Tensor, group=None, *, average: bool = False, stochastic: bool = True,
                     seed: int = 0, scope: str = "world") -> Tensor:
    """All-reduce ``tensor`` in place through NVFP4 (AGoQ's two-phase scheme,
    :func:`leantrain.comm.int8_allreduce.two_phase_all_reduce`, with this codec; one fp32 scale a
    chunk); returns it. ``stochastic``: stochastic rounding of the elements, from a generator seeded
    with ``seed``, this rank and the phase (deterministic for a given seed; vary it between calls).
    Bytes: ``(0.5 + 1/16) / 2 = 0.281`` of a bf16 all-reduce plus padding and 4 bytes a chunk."""
    from .. import collectives as C
    from .int8_allreduce import two_phase_all_reduce

    if C.world_size(group) == 1:
        return tensor
    me = C.rank(group)

    def gen(phase):
        if not stochastic:
            return None
        return torch.Generator(device=tensor.device).manual_seed(((seed * 1_000_003 + me) * 2 + phase) % (1 << 63))

    def encode(x, k, phase):
        rng = gen(phase)
        return torch.stack([nvfp4_quantize(c, rng) for c in x.view(k, -1)])

    def decode(buf, chunk):
        return torch.stack([nvfp4_dequantize(m, chunk) for m in buf])

    return two_phase_all_reduce(tensor, group, block=BLOCK, encode=encode, decode=decode, average=average,
                                scope=scope)

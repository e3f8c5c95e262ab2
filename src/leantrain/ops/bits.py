"""Bit-packing of boolean masks: 1 bit per element (AGoQ's 1-bit saved masks, SCAPE's masks).

Math: byte ``j`` of the output holds elements ``8j .. 8j+7``, element ``8j + b`` in bit ``b``
(little-endian bit order, the same as ``numpy.packbits(..., bitorder="little")``). The tail
byte is zero-padded.

Tiling (Triton): one program owns ``ROWS`` bytes as a ``[ROWS, 8]`` tile. Bytes per element:
pack reads 1 and writes 1/8; unpack the reverse.
"""

from __future__ import annotations

import torch

from leantrain.ops._backend import HAS_TRITON, launch, resolve

_WEIGHTS = [1, 2, 4, 8, 16, 32, 64, 128]


def pack_bits_ref(mask: torch.Tensor) -> torch.Tensor:
    flat = mask.reshape(-1).to(torch.uint8)
    n = flat.numel()
    nb = -(-n // 8)
    pad = torch.zeros(nb * 8, dtype=torch.uint8, device=mask.device)
    pad[:n] = flat
    w = torch.tensor(_WEIGHTS, dtype=torch.int32, device=mask.device)
    return (pad.view(nb, 8).to(torch.int32) * w).sum(1).to(torch.uint8)


def unpack_bits_ref(packed: torch.Tensor, numel: int) -> torch.Tensor:
    sh = torch.arange(8, device=packed.device, dtype=torch.int32)
    bits = (packed.to(torch.int32)[:, None] >> sh) & 1
    return bits.reshape(-1)[:numel].to(torch.bool)


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _pack_kernel(m_ptr, out_ptr, n, nb, ROWS: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        b = tl.arange(0, 8)
        idx = rows[:, None] * 8 + b[None, :]
        v = tl.load(m_ptr + idx, mask=idx < n, other=0).to(tl.int32)
        byte = tl.sum((v != 0).to(tl.int32) << b[None, :], axis=1)
        tl.store(out_ptr + rows, byte.to(tl.uint8), mask=rows < nb)

    @triton.jit
    def _unpack_kernel(p_ptr, out_ptr, n, nb, ROWS: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        b = tl.arange(0, 8)
        byte = tl.load(p_ptr + rows, mask=rows < nb, other=0).to(tl.int32)
        bits = (byte[:, None] >> b[None, :]) & 1
        idx = rows[:, None] * 8 + b[None, :]
        tl.store(out_ptr + idx, bits.to(tl.int8), mask=idx < n)


def pack_bits(mask: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Boolean (or 0/1) tensor -> uint8 of ``ceil(numel / 8)`` bytes (flattened, little-endian bits)."""
    if resolve(backend, mask) == "torch":
        return pack_bits_ref(mask)
    flat = mask.reshape(-1).contiguous()
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    n = flat.numel()
    nb = -(-n // 8)
    out = torch.empty(nb, dtype=torch.uint8, device=mask.device)
    if nb:
        rows = 1024
        launch(_pack_kernel, (triton.cdiv(nb, rows),), flat, out, n, nb, ROWS=rows, num_warps=4)
    return out


def unpack_bits(packed: torch.Tensor, numel: int, *, backend: str = "auto") -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``numel`` bits as a flat bool tensor."""
    if packed.numel() * 8 < numel:
        raise ValueError(f"unpack_bits: {packed.numel()} bytes hold fewer than numel={numel} bits")
    if resolve(backend, packed) == "torch":
        return unpack_bits_ref(packed, numel)
    out = torch.empty(numel, dtype=torch.bool, device=packed.device)
    nb = -(-numel // 8)
    if nb:
        rows = 1024
        launch(_unpack_kernel, (triton.cdiv(nb, rows),), packed.contiguous(), out.view(torch.int8),
               numel, nb, ROWS=rows, num_warps=4)
    return out

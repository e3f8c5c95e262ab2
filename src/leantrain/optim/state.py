"""Optimizer-state storage: fp32, bf16, or 8-bit block-quantized (int8 / int8p / fp8).

A rule (:mod:`leantrain.optim.rules`) always computes in fp32; this module decides how its
state tensors are *kept* between steps. ``StateStorage(dtype)`` turns a rule's state into
entries of ``optimizer.state[p]`` (plain tensors, so ``state_dict()``, the memory ledger
and ``torch.save`` see exactly what is held) and converts them to and from fp32:

- ``"fp32"``: the state tensor itself (reading returns it, no copy).
- ``"bf16"``: a bf16 tensor; written with round-to-nearest-even.
- ``"int8"``: ``name`` holds uint8 codes (same shape as the parameter) and
  ``name + "_absmax"`` one fp32 absmax per block, encoded by :class:`leantrain.ops.StateCodec8`
  (bitsandbytes' dynamic map: signed for first moments, unsigned for second moments;
  nearest map entry of ``x * (1 / absmax)``). Blocks have 256 elements: for a 2-D tensor a
  16 x 16 tile (codes stored block-major as ``[RB, CB, 16, 16]``, zero-padded to whole
  tiles), so the tiles of FORGE's fused kernel (multiples of 16 on both sides) hold whole
  blocks and requantize on their own; for any other tensor 256 consecutive elements.
  Tensors with fewer than 4096 elements stay fp32 (``MIN_NUMEL``), as in bitsandbytes and
  torchao.
- ``"int8p"``: the same codes and blocks, with each block's fp32 absmax *packed into its codes*:
  bit ``j`` of the absmax is the low bit of the block's code ``j`` (``j < 32``, storage order:
  the first two rows of a 16 x 16 tile). Those 32 codes keep 7 bits of value: they decode the
  odd map entry ``qmap[code | 1]`` (odd entries hold 0 and 1.0 of the signed map, 1.0 of the
  unsigned one); the encoder gives them the nearest code ``c`` and, where ``c`` is even, moves
  it to ``c + 1`` if ``x >= qmap[c]`` (or ``c == 0``), else to ``c - 1``. The other 224 codes of
  a block are the ``"int8"`` codes bit for bit. Exactly 1 byte an element, nothing else held
  (flat tensors are zero-padded to whole blocks: codes ``[blocks * 256]``); tensors of fewer
  than 256 elements stay fp32 (``MIN_NUMEL_PACKED``). So bf16 weights with two int8p states hold
  2 + 1 + 1 = 4 bytes a parameter.

- ``"fp8"``: ``name`` holds e4m3 codes (``torch.float8_e4m3fn``: one byte, the bits the kernels
  read as uint8) in ``"int8"``'s blocks and layout, ``name + "_absmax"`` one fp32 a block, fp32
  below ``MIN_NUMEL``: the bytes of ``"int8"`` exactly, told apart by the dtype (so a checkpoint says
  which it holds). Per block, with ``y`` the state (signed states) or its square root (unsigned
  ones): ``absmax = max(max |y|, FP8_FLOOR)`` over the finite values (non-finite ones store 0),
  ``code = e4m3_rne(y * (448 / absmax))`` (IEEE division once a block; ``|y * inv| <= 448 (1 +
  2**-23)``, which rounds to 448), decoded as ``fp32(code) * (absmax * FP8_INV_MAX)`` and squared
  for unsigned states. These exact fp32 operations are the definition: FORGE's update epilogue
  (:mod:`leantrain.ops.update`, ``KIND`` 4) computes the same bits with the GPU's e4m3 conversions.

  Why the root for second moments: e4m3 holds ``2**-9 / 448 ~ 4.4e-6`` of a block's max at the
  least, and AdamW's ``v`` spans more than that within a 16 x 16 block; stored as itself, its
  small entries decode to 0 and ``m / (sqrt(v) + eps)`` divides by ``eps``. Measured on the
  states of three tiny-preset runs after 300 steps
  (``benchmarks/results/convergence/2026-12-05_cpu_tiny-fp8-second-moment.json``): the e4m3 of
  ``v`` sends 1.1-1.4 % of ``v`` to 0 and grows as many updates more than 2x (up to 2150x), the
  e4m3 of ``sqrt(v)`` grows none (the root spans half the exponent range, and AdamW takes it
  anyway: the epilogue reuses its ``sqrt``). Trained that way for 300 steps over seeds 0-2
  (``benchmarks/results/convergence/2026-12-05_cpu_tiny-fp8-states.json``), the mean validation
  loss is +0.32 % against bf16 states (int8: +0.26 %) with the root, +1.61 % with ``v`` itself.

Error of 8-bit storage: relative to the block absmax, the dynamic map's step is at most
~1.4 % near 1 and finer toward 0 (log-spaced); e4m3's is 2**-3 of the value at every scale
(3 mantissa bits) above ``2**-6 / 448`` of the block's max; see ``tests/forge/test_state.py`` for the
tolerance FORGE's 8-bit states are held to against fp32 states.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from leantrain.ops.state8 import StateCodec8, block_inverse
from leantrain.ops.tiles import ieee_div
from leantrain.ops.update import FP8_FLOOR, FP8_INV_MAX, FP8_MAX, Fp8Table

STATE_DTYPES = ("fp32", "bf16", "int8", "int8p", "fp8")
MIN_NUMEL = 4096  # smaller tensors keep fp32 state
MIN_NUMEL_PACKED = 256  # "int8p": one whole block at least
PACKED_BITS = 32  # "int8p": the absmax's bits ride in the low bits of a block's first 32 codes
TILE = 16  # 2-D blocks are TILE x TILE = 256 elements
FLAT_BLOCK = 256


@functools.cache
def codec(signed: bool) -> StateCodec8:
    """The shared 8-bit codec (dynamic map, blocks of 256) for signed or unsigned state."""
    return StateCodec8(signed=bool(signed), block_size=FLAT_BLOCK)


def qmap_on(signed: bool, device) -> Tensor:
    """The codec's 256-entry map on ``device`` (what the Triton epilogue reads)."""
    return codec(signed).qmap_on(device)


def tile_blocks(shape) -> tuple[int, int] | None:
    """``(RB, CB)``: 16 x 16 blocks of a 2-D tensor (None for other shapes: flat blocks)."""
    if len(shape) != 2:
        return None
    return -(-int(shape[0]) // TILE), -(-int(shape[1]) // TILE)


def to_tiles(x: Tensor) -> Tensor:
    """2-D ``[R, C]`` -> zero-padded ``[RB, CB, 16, 16]``: each 256-element block contiguous."""
    r, c = x.shape
    rb, cb = tile_blocks(x.shape)
    x = torch.nn.functional.pad(x, (0, cb * TILE - c, 0, rb * TILE - r))
    return x.view(rb, TILE, cb, TILE).permute(0, 2, 1, 3).contiguous()


def from_tiles(t: Tensor, shape) -> Tensor:
    rb, cb = t.shape[:2]
    return t.permute(0, 2, 1, 3).reshape(rb * TILE, cb * TILE)[: shape[0], : shape[1]]


def quantize8(x: Tensor, signed: bool) -> tuple[Tensor, Tensor]:
    """fp32 ``x`` -> (uint8 codes, fp32 absmax per block).

    2-D tensors: codes ``[RB, CB, 16, 16]`` (block-major 16 x 16 tiles), absmax ``[RB, CB]``;
    other shapes: codes shaped like ``x`` (flat blocks of 256), absmax ``[blocks]``.
    """
    if tile_blocks(x.shape) is None:
        return codec(signed).encode(x.float())
    t = to_tiles(x.float())
    codes, absmax = codec(signed).encode(t)
    return codes, absmax.view(t.shape[0], t.shape[1])


def dequantize8(codes: Tensor, absmax: Tensor, signed: bool, shape) -> Tensor:
    v = codec(signed).decode(codes, absmax.reshape(-1))
    return v if codes.dim() != 4 else from_tiles(v, shape)


def quantize8p(x: Tensor, signed: bool) -> Tensor:
    """fp32 ``x`` -> uint8 codes with the block absmax packed in (``"int8p"``, module docstring).

    2-D tensors: codes ``[RB, CB, 16, 16]`` as :func:`quantize8`; other shapes: flat
    ``[blocks * 256]`` (zero-padded)."""
    if tile_blocks(x.shape) is None:
        n = x.numel()
        x = torch.nn.functional.pad(x.reshape(-1).float(), (0, -(-n // FLAT_BLOCK) * FLAT_BLOCK - n))
    else:
        x = to_tiles(x.float())
    codes, absmax = codec(signed).encode(x)
    blocks = x.reshape(-1, FLAT_BLOCK)[:, :PACKED_BITS]
    blocks = torch.where(torch.isfinite(blocks), blocks, 0.0)  # (as the codec)
    am = absmax.reshape(-1, 1)
    xn = blocks * block_inverse(am)
    head = codes.reshape(-1, FLAT_BLOCK)[:, :PACKED_BITS].long()
    up = (head == 0) | (xn >= qmap_on(signed, x.device)[head])  # (the table's first 256 entries: the map)
    odd = torch.where(head % 2 == 1, head, torch.where(up, head + 1, head - 1))
    bits = (am.view(torch.int32).long() >> torch.arange(PACKED_BITS, device=x.device)) & 1
    out = codes.reshape(-1, FLAT_BLOCK).clone()
    out[:, :PACKED_BITS] = ((odd & 0xFE) | bits).to(torch.uint8)
    return out.view(codes.shape)


def dequantize8p(codes: Tensor, signed: bool, shape) -> Tensor:
    """``"int8p"`` codes -> fp32 tensor of ``shape``."""
    blocks = codes.reshape(-1, FLAT_BLOCK).long()
    bits = ((blocks[:, :PACKED_BITS] & 1) << torch.arange(PACKED_BITS, device=codes.device)).sum(1)  # < 2**32
    absmax = torch.where(bits < 2**31, bits, bits - 2**32).to(torch.int32).view(torch.float32)
    idx = blocks.clone()
    idx[:, :PACKED_BITS] |= 1
    v = qmap_on(signed, codes.device)[idx] * absmax[:, None]
    if codes.dim() == 4:
        return from_tiles(v.view(codes.shape), shape)
    return v.reshape(-1)[: int(torch.Size(shape).numel())].view(shape)


def quantize_fp8(x: Tensor, signed: bool) -> tuple[Tensor, Tensor]:
    """fp32 ``x`` -> (e4m3 codes as ``torch.float8_e4m3fn``, fp32 absmax per block): ``"fp8"``.

    Blocks and shapes as :func:`quantize8`. Per block: ``y`` = the values (unsigned states: their
    square roots), non-finite ones 0; ``absmax = max(max |y|, FP8_FLOOR)``;
    ``code = e4m3_rne(y * (448 / absmax))`` (IEEE division once a block, then one multiply; the
    product is at most 448 (1 + 2**-23), which rounds to 448)."""
    y = x.float()
    if not signed:
        y = y.sqrt()  # (the method: what rules.py calls, correctly rounded as the kernel's sqrt_rn)
    if tile_blocks(x.shape) is None:
        n = y.numel()
        nb = -(-n // FLAT_BLOCK)
        blocks = torch.nn.functional.pad(y.reshape(-1), (0, nb * FLAT_BLOCK - n)).view(nb, FLAT_BLOCK)
    else:
        blocks = to_tiles(y)
        blocks = blocks.reshape(-1, FLAT_BLOCK)
    blocks = torch.where(torch.isfinite(blocks), blocks, 0.0)
    absmax = blocks.abs().amax(1).clamp_min(FP8_FLOOR) if blocks.shape[0] else blocks.new_zeros(0)
    codes = (blocks * ieee_div(FP8_MAX, absmax)[:, None]).to(torch.float8_e4m3fn)
    if tile_blocks(x.shape) is None:
        return codes.view(torch.uint8).reshape(-1)[: x.numel()].view(torch.float8_e4m3fn).view(x.shape), absmax
    rb, cb = tile_blocks(x.shape)
    return codes.view(rb, cb, TILE, TILE), absmax.view(rb, cb)


def dequantize_fp8(codes: Tensor, absmax: Tensor, signed: bool, shape) -> Tensor:
    """``"fp8"`` codes -> fp32 tensor of ``shape``: ``fp32(code) * (absmax * FP8_INV_MAX)`` (``FP8_INV_MAX``
    = fp32(1 / 448); a multiply once a block, then one an element), squared for unsigned states."""
    flat = absmax.reshape(-1)
    scale = flat * FP8_INV_MAX
    if codes.dim() == 4:
        v = from_tiles(codes.float() * scale.view(absmax.shape)[:, :, None, None], shape)
    else:
        n = codes.numel()
        blk = torch.arange(n, device=codes.device) // FLAT_BLOCK
        v = (codes.reshape(-1).float() * scale[blk]).view(codes.shape)
    return v if signed else v * v


class StateStorage:
    """How a rule's state tensors are stored: ``StateStorage("fp32" | "bf16" | "int8" | "int8p" | "fp8")``."""

    def __init__(self, dtype: str = "fp32", min_numel: int = MIN_NUMEL):
        if dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype must be one of {STATE_DTYPES}, got {dtype!r}")
        self.dtype = dtype
        self.min_numel = min_numel

    def kind_for(self, p: Tensor, force_fp32: bool = False) -> str:
        if force_fp32 or self.dtype == "fp32":
            return "fp32"
        if self.dtype in ("int8", "fp8") and p.numel() < self.min_numel:
            return "fp32"
        if self.dtype == "int8p" and p.numel() < min(self.min_numel, MIN_NUMEL_PACKED):
            return "fp32"
        return self.dtype

    def init(self, rule, p: Tensor, *, force_fp32: bool = False) -> dict[str, Tensor]:
        """Fresh (zero) state entries for parameter ``p``."""
        kind = self.kind_for(p, force_fp32)
        out: dict[str, Tensor] = {}
        for name in rule.state_names:
            if kind == "fp32":
                out[name] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            elif kind == "bf16":
                out[name] = torch.zeros(p.shape, dtype=torch.bfloat16, device=p.device)
            elif kind == "int8p":
                out[name] = quantize8p(torch.zeros(p.shape, device=p.device), name in rule.signed_states)
            elif kind == "fp8":
                out[name], out[name + "_absmax"] = quantize_fp8(torch.zeros(p.shape, device=p.device),
                                                                name in rule.signed_states)
            else:
                signed = name in rule.signed_states
                codes, absmax = quantize8(torch.zeros(p.shape, device=p.device), signed)
                out[name], out[name + "_absmax"] = codes, absmax
        return out

    @staticmethod
    def kind_of(state: dict, name: str) -> str:
        t = state[name]
        if t.dtype == torch.uint8:
            return "int8" if name + "_absmax" in state else "int8p"
        return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8"}[t.dtype]

    @staticmethod
    def kernel_table(state: dict, name: str, signed: bool, device):
        """What FORGE's kernel takes for state ``name`` (``launch_forge``'s ``qtables``): ``(map
        table, absmax)`` for int8, ``(map table, None)`` for int8p (the absmax is in the codes),
        ``(Fp8Table(signed), absmax)`` for fp8, None for fp32 / bf16."""
        kind = StateStorage.kind_of(state, name)
        if kind == "fp8":
            return Fp8Table(bool(signed)), state[name + "_absmax"]
        if kind not in ("int8", "int8p"):
            return None
        return qmap_on(signed, device), state.get(name + "_absmax")

    @staticmethod
    def read(state: dict, name: str, signed: bool, shape=None) -> Tensor:
        """The fp32 value of state ``name`` (the stored tensor itself for fp32 storage).

        ``shape``: the parameter's shape (needed for 8-bit states of 2-D parameters).
        """
        t = state[name]
        kind = StateStorage.kind_of(state, name)
        if kind == "fp32":
            return t
        if kind == "bf16":
            return t.float()
        if kind == "int8p":
            return dequantize8p(t, signed, t.shape if shape is None else shape)
        if kind == "fp8":
            return dequantize_fp8(t, state[name + "_absmax"], signed, shape)
        return dequantize8(t, state[name + "_absmax"], signed, shape)

    @staticmethod
    def write(state: dict, name: str, value: Tensor, signed: bool, keep_old: Tensor | None = None) -> None:
        """Store the fp32 ``value``; where the bool scalar ``keep_old`` is True the old bits stay."""
        t = state[name]
        if StateStorage.kind_of(state, name) == "int8p":
            codes = quantize8p(value, signed)
            t.copy_(codes if keep_old is None else torch.where(keep_old, t, codes))
            return
        kind = StateStorage.kind_of(state, name)
        if kind == "fp8":
            codes, absmax = quantize_fp8(value, signed)
            codes = codes.view(torch.uint8)
            if keep_old is not None:
                codes = torch.where(keep_old, t.view(torch.uint8), codes)
                absmax = torch.where(keep_old, state[name + "_absmax"], absmax)
            t.view(torch.uint8).copy_(codes)
            state[name + "_absmax"].copy_(absmax)
            return
        if t.dtype == torch.uint8:
            codes, absmax = quantize8(value, signed)
            if keep_old is not None:
                codes = torch.where(keep_old, t, codes)
                absmax = torch.where(keep_old, state[name + "_absmax"], absmax)
            t.copy_(codes)
            state[name + "_absmax"].copy_(absmax)
            return
        new = value.to(t.dtype)
        if keep_old is not None:
            new = torch.where(keep_old, t, new)
        t.copy_(new)


__all__ = ["StateStorage", "STATE_DTYPES", "MIN_NUMEL", "codec", "qmap_on", "quantize8", "dequantize8", "quantize8p",
           "dequantize8p", "quantize_fp8", "dequantize_fp8", "to_tiles",
           "from_tiles", "tile_blocks"]

"""Host-side helpers shared by the block-wise quantizers (int, FP8, NVFP4, Hadamard, multi-tensor).

- Number helpers of the quantization math (:mod:`leantrain.ops.quant`'s module docstring):
  :data:`TINY_RANGE` / :data:`PRE_SCALE`, the exact power-of-two rescale of groups of denormals,
  :func:`ieee_div`, a correctly rounded division as the kernels compute it, and the code range of
  an integer format (:func:`int_code_range`).
- The torch references' grouping (:func:`pad_groups`) and the Triton kernels' tile of whole
  groups (:func:`tile_shape`).
- The GPU-only instruction choices of the kernels (``FAST_*`` flags, :func:`fast_bits`): each
  gives the same results as its portable path, which the Triton interpreter runs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from leantrain.ops._backend import interpreting, next_pow2

TINY_RANGE = 2.0**-64  # a group whose range is below this is rescaled by PRE_SCALE first
PRE_SCALE = 2.0**64
TINY = torch.finfo(torch.float32).tiny  # dequantize(log=True) clamps here (the kernel's literal)

# GPU-only instruction choices, bits of the kernels' ``FAST`` constexpr (the same results as the
# portable paths, which the Triton interpreter runs; ``benchmarks/tools/tune_kernels.py --what fast``
# times them):
FAST_ROUND_BY_ADD = 1  # round by one fp32 add rounded toward -inf whose low bits are the code
FAST_CODE_BITCAST = 2  # integer codes to floats by their bits (no int-to-float conversion)
FAST_HW_CAST = 4  # the hardware fp32 -> bf16 cast (round to nearest even)
FAST_HASH_IMAD = 8  # the two uniforms of a hash by integer multiply-adds
FAST_CLEAN_TILE = 16  # symmetric quantization: the clean-tile branch (one scaling multiply a value)
FAST_GPU = FAST_ROUND_BY_ADD | FAST_CODE_BITCAST | FAST_HW_CAST | FAST_HASH_IMAD | FAST_CLEAN_TILE
FAST_PORTABLE = FAST_CODE_BITCAST | FAST_CLEAN_TILE  # pure bit manipulation: the interpreter runs these
FAST = FAST_GPU  # the choices launched on a GPU (a tuning tool may lower it)

TILE_ELEMS = 4096  # elements per program of quantize / dequantize (whole groups)


class Tile(NamedTuple):
    """A launch's work per program: about ``elems`` elements (whole groups) at ``warps`` warps
    (0: :func:`tile_shape`'s choice), ``per_program`` consecutive tiles each."""

    elems: int
    warps: int = 0
    per_program: int = 1


def fast_bits() -> int:
    """The ``FAST`` constexpr of a launch: :data:`FAST` on a GPU; under the interpreter only
    its :data:`FAST_PORTABLE` bits, which the CPU tests thus check against the reference (the
    others are PTX instructions)."""
    return FAST & FAST_PORTABLE if interpreting() else FAST


def ieee_div(a, b) -> torch.Tensor:
    """Correctly rounded ``a / b`` as the Triton kernels compute it.

    torch computes ``scalar / tensor`` as ``reciprocal(tensor) * scalar`` and may turn
    ``tensor / scalar`` into a multiply by the reciprocal (1 ulp off); dividing two tensors
    of one shape is a true IEEE division on every device.
    """
    a = a if isinstance(a, torch.Tensor) else torch.full_like(b, float(a))
    b = b if isinstance(b, torch.Tensor) else torch.full_like(a, float(b))
    return torch.div(a, b)


def check_int_format(bits: int, group_size: int) -> None:
    """Raise ValueError unless ``bits`` and ``group_size`` are an integer quantizer's."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if not (2 <= group_size <= 4096) or group_size % 2:
        raise ValueError(f"group_size must be an even number in [2, 4096] (32..4096 advised), got {group_size}")


def int_code_range(bits: int, symmetric: bool) -> tuple[int, int]:
    """``(lowest, highest)`` integer code of the format: ``(-(2**(b-1) - 1), 2**(b-1) - 1)``
    symmetric, ``(0, 2**b - 1)`` asymmetric."""
    return (-(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1) if symmetric else (0, 2**bits - 1)


def pad_groups(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten ``x`` (fp32), pad with zeros to whole groups; return ``(xg[G, gs], valid[G, gs])``."""
    flat = x.reshape(-1).to(torch.float32)
    n = flat.numel()
    g = -(-n // group_size)
    xg = torch.zeros(g * group_size, dtype=torch.float32, device=x.device)
    xg[:n] = flat
    valid = torch.arange(g * group_size, device=x.device) < n
    return xg.view(g, group_size), valid.view(g, group_size)


def tile_shape(group_size: int, elems: int = 0) -> tuple[int, int, int]:
    """(COLS, ROWS, num_warps) for a tile of whole groups holding about ``elems`` elements
    (default :data:`TILE_ELEMS`)."""
    cols = next_pow2(group_size)
    rows = max(1, (elems or TILE_ELEMS) // cols)
    return cols, rows, 8 if cols * rows >= 4096 else 4

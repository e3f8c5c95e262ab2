"""NVFP4-style 4-bit floating point: E2M1 values in 16-element blocks, E4M3 block scales,
one fp32 tensor scale. Torch reference only (a Triton kernel is future work; GIFT's 4-bit
option is the only caller and runs it off the critical path).

Math:
    tensor_scale = amax(x) / (6 * 448)                          (fp32; 0 for an all-zero x)
    s_b          = e4m3_rne(amax_b / 6 / tensor_scale)           per 16-block b, stored as E4M3 bits
    code         = e2m1_rne(x / (s_b * tensor_scale))            values {0, .5, 1, 1.5, 2, 3, 4, 6}, sign bit 3
    x'           = e2m1(code) * s_b * tensor_scale
Two codes per byte (even element in the low nibble). Non-finite inputs are treated as 0.
Bytes per element: 0.5 (codes) + 1/16 (block scale) + 4/numel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_MIDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
BLOCK = 16


@dataclass
class NVFP4Tensor:
    data: torch.Tensor          # uint8 [ceil(numel / 16) * 8]: two E2M1 codes per byte
    block_scale: torch.Tensor   # uint8 [ceil(numel / 16)]: E4M3 bit patterns
    tensor_scale: torch.Tensor  # fp32 scalar
    shape: torch.Size
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.block_scale.numel() + 4


def _e2m1_rne(a: torch.Tensor) -> torch.Tensor:
    """Index 0..7 of the nearest E2M1 magnitude to ``a >= 0`` (ties to even index)."""
    mids = _MIDS.to(a.device)
    lo = torch.bucketize(a, mids, right=False)
    hi = torch.bucketize(a, mids, right=True)
    return torch.where((lo != hi) & (lo % 2 == 1), hi, lo)


def quantize_nvfp4(x: torch.Tensor) -> NVFP4Tensor:
    """NVFP4 quantization of the flattened ``x`` (any shape, numel >= 0)."""
    flat = x.reshape(-1).to(torch.float32)
    flat = torch.where(torch.isfinite(flat), flat, 0.0)
    n = flat.numel()
    nb = -(-n // BLOCK)
    xg = torch.zeros(nb * BLOCK, dtype=torch.float32, device=x.device)
    xg[:n] = flat
    xg = xg.view(nb, BLOCK)
    amax = xg.abs().max() if n else torch.zeros((), device=x.device)
    ts = amax / (6.0 * 448.0)
    bamax = xg.abs().amax(1) if nb else xg.new_zeros(0)
    s = torch.where(ts > 0, bamax / 6.0 / torch.where(ts > 0, ts, 1.0), 0.0).clamp(max=448.0)
    s8 = s.to(torch.float8_e4m3fn)
    eff = s8.to(torch.float32) * ts
    y = torch.where(eff[:, None] > 0, xg / torch.where(eff > 0, eff, 1.0)[:, None], 0.0).clamp(-6, 6)
    code = _e2m1_rne(y.abs()) | ((y < 0).to(torch.int64) << 3)
    code = torch.where(code == 8, 0, code)  # no negative zero
    byte = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8).reshape(-1)
    return NVFP4Tensor(byte, s8.view(torch.uint8), ts.to(torch.float32), x.shape, x.dtype)


def dequantize_nvfp4(q: NVFP4Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    d = q.data.to(torch.int64)
    code = torch.stack([d & 0xF, d >> 4], -1).reshape(-1, BLOCK)
    mag = E2M1_VALUES.to(q.data.device)[code & 7]
    v = torch.where(code >= 8, -mag, mag)
    eff = q.block_scale.view(torch.float8_e4m3fn).to(torch.float32) * q.tensor_scale
    v = (v * eff[:, None]).reshape(-1)[: q.numel]
    return v.reshape(q.shape).to(dtype or q.dtype)

"""``QTensor``: the container every block-wise quantizer of ``leantrain.ops`` returns.

Layout (what travels in a collective): ``data`` is uint8. For 8 bits it holds one code per
element (int8 two's-complement bytes for symmetric, viewable with ``.view(torch.int8)``;
unsigned 0..255 for asymmetric; FP8 bit patterns for ``fmt="e4m3"/"e5m2"``). For 4 bits it
holds two codes per byte, the even element in the low nibble. The flattened tensor is cut
into ``num_groups = ceil(numel / group_size)`` groups; the last one is padded with zeros, so
``data`` has ``num_groups * group_size * bits // 8`` bytes and ``scale`` (fp32) has
``num_groups`` entries (``zero`` too, for asymmetric). A *stacked* QTensor holds ``k`` peers'
quantized chunks of the same ``shape``: ``data`` is ``(k, bytes)`` and ``scale`` ``(k, groups)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch


@dataclass
class QTensor:
    data: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    shape: torch.Size
    dtype: torch.dtype
    bits: int
    group_size: int
    symmetric: bool = True
    fmt: str = "int"  # "int" | "e4m3" | "e5m2"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def num_groups(self) -> int:
        return -(-self.numel // self.group_size)

    @property
    def bytes_per_peer(self) -> int:
        return self.num_groups * self.group_size * self.bits // 8

    @property
    def stacked(self) -> bool:
        return self.data.dim() == 2

    @property
    def num_peers(self) -> int:
        return self.data.shape[0] if self.stacked else 1

    @property
    def nbytes(self) -> int:
        """Bytes of payload: data + scale (+ zero). What memory and comm ledgers count."""
        n = self.data.numel() * self.data.element_size()
        n += self.scale.numel() * self.scale.element_size()
        if self.zero is not None:
            n += self.zero.numel() * self.zero.element_size()
        return n

    @property
    def device(self) -> torch.device:
        return self.data.device

    def peer(self, i: int) -> QTensor:
        """The ``i``-th peer of a stacked QTensor, as a plain QTensor (views, no copy)."""
        if not self.stacked:
            raise ValueError("peer() needs a stacked QTensor (data of shape (k, bytes))")
        z = None if self.zero is None else self.zero[i]
        return replace(self, data=self.data[i], scale=self.scale[i], zero=z)

    @staticmethod
    def stack(qs: list[QTensor]) -> QTensor:
        """Stack ``k`` QTensors of identical format and shape into one stacked QTensor."""
        if not qs:
            raise ValueError("QTensor.stack needs at least one QTensor")
        q0 = qs[0]
        for q in qs[1:]:
            if (q.shape, q.bits, q.group_size, q.symmetric, q.fmt) != (
                q0.shape, q0.bits, q0.group_size, q0.symmetric, q0.fmt,
            ):
                raise ValueError("QTensor.stack: all peers need the same shape, bits, group_size, symmetric and fmt")
        z = None if q0.zero is None else torch.stack([q.zero for q in qs])
        return replace(
            q0, data=torch.stack([q.data for q in qs]), scale=torch.stack([q.scale for q in qs]), zero=z
        )

    @staticmethod
    def from_buffers(data: torch.Tensor, scale: torch.Tensor, *, shape, dtype=torch.float32,
                     bits: int, group_size: int, zero: torch.Tensor | None = None,
                     fmt: str = "int") -> QTensor:
        """Wrap received buffers (e.g. an all-to-all of ``k`` peers' chunks) without copying.

        ``data`` is ``(k * bytes_per_peer,)`` or ``(k, bytes_per_peer)`` uint8, ``scale`` likewise
        with ``groups_per_peer`` fp32 entries; ``shape`` is one peer's chunk shape.
        """
        q = QTensor(data, scale, zero, torch.Size(shape), dtype, bits, group_size, zero is None, fmt)
        per_b, per_g = q.bytes_per_peer, q.num_groups
        if data.numel() % max(per_b, 1) or scale.numel() % max(per_g, 1):
            raise ValueError(f"from_buffers: data/scale sizes {data.numel()}/{scale.numel()} are not "
                             f"multiples of one peer's {per_b} bytes / {per_g} groups")
        k = data.numel() // max(per_b, 1)
        q.data = data.reshape(k, per_b)
        q.scale = scale.reshape(k, per_g)
        if zero is not None:
            q.zero = zero.reshape(k, per_g)
        return q

    def to(self, device) -> QTensor:
        z = None if self.zero is None else self.zero.to(device)
        return replace(self, data=self.data.to(device), scale=self.scale.to(device), zero=z)

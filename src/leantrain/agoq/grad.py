"""8-bit gradient accumulation: int8 buffers with per-block scales and error feedback.

Over ``m`` micro-batches the running sum ``S_k = g_1 + ... + g_k`` of each parameter's
gradient is held as int8 codes ``c`` with one fp32 scale per block of ``block_size``
elements (``scale = absmax / 127``) instead of an fp32 ``.grad``. Each
:meth:`Int8GradAccumulator.accumulate` folds ``p.grad`` in and frees it:

    v  = c * scale + r * scale / 254 + g        # dequantized sum + carried error + new grad
    scale' = absmax_block(v) / 127;  c' = round(v / scale')       (int8, |c'| <= 127)
    r' = round((v - c' * scale') / scale' * 254)                  (int8 error feedback)

The requantization error of one step, ``e = v - c' scale'`` (|e| <= scale'/2), is not lost:
it is carried in ``r`` (int8, in units of scale'/254) into the next step, so the stored pair
(c, r) is a ~16-bit fixed-point number per block and the error of the final sum is bounded
by ``scale/508`` per element (plus one rounding of ``r``) instead of growing with the number
of micro-batches. Memory: 2 bytes + 4/block_size per element (``error_feedback=False``:
1 byte), against 4 for fp32 accumulation. :meth:`finalize` writes ``p.grad`` (in the
parameter's dtype) before the optimizer step and clears the buffers.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

__all__ = ["Int8GradAccumulator"]


class _Buf:
    __slots__ = ("code", "resid", "scale", "n")

    def __init__(self, n: int, block: int, device, ef: bool):
        nb = -(-n // block)
        self.n = n
        self.code = torch.zeros(nb, block, dtype=torch.int8, device=device)
        self.resid = torch.zeros(nb, block, dtype=torch.int8, device=device) if ef else None
        self.scale = torch.zeros(nb, 1, dtype=torch.float32, device=device)


class Int8GradAccumulator:
    """Gradient accumulation in int8 (per-block scales, int8 error feedback).

    ``acc.accumulate()`` after each micro-batch's backward; ``acc.finalize()`` before
    ``optimizer.step()``. ``acc.tensors()`` lists the buffers (for the memory ledger:
    ``MemoryLedger.measure(model, opt, grad_buffers=acc.tensors())``).
    """

    def __init__(self, params: Iterable[Tensor], block_size: int = 256, *, error_feedback: bool = True,
                 stochastic: bool = False):
        self.params = [p for p in params if p.requires_grad]
        if block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {block_size}")
        self.block_size = block_size
        self.error_feedback = error_feedback
        self.stochastic = stochastic
        self._bufs: dict[int, _Buf] = {}
        self.micro_batches = 0

    def _blocks(self, g: Tensor) -> Tensor:
        flat = g.detach().reshape(-1).float()
        pad = (-flat.numel()) % self.block_size
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        return flat.view(-1, self.block_size)

    @torch.no_grad()
    def accumulate(self) -> None:
        """Fold every ``p.grad`` into its int8 buffer and free ``p.grad``."""
        for p in self.params:
            if p.grad is None:
                continue
            buf = self._bufs.get(id(p))
            if buf is None:
                buf = self._bufs[id(p)] = _Buf(p.numel(), self.block_size, p.device, self.error_feedback)
            v = self._blocks(p.grad)
            p.grad = None
            if self.micro_batches or buf.scale.any():
                v += self._value(buf)
            absmax = v.abs().amax(1, keepdim=True)
            scale = absmax / 127.0
            inv = torch.where(absmax > 0, 127.0 / absmax, torch.zeros_like(absmax))
            y = v * inv
            if self.stochastic:
                code = torch.floor(y + torch.rand_like(y))
            else:
                code = torch.round(y)
            code = code.clamp_(-127, 127)
            buf.code.copy_(code.to(torch.int8))
            buf.scale.copy_(scale)
            if buf.resid is not None:
                r = torch.round((y - code) * 254.0).clamp_(-127, 127)
                buf.resid.copy_(r.to(torch.int8))
        self.micro_batches += 1

    @staticmethod
    def _value(buf: _Buf) -> Tensor:
        v = buf.code.float()
        if buf.resid is not None:
            v += buf.resid.float() / 254.0
        return v * buf.scale

    @torch.no_grad()
    def finalize(self, *, scale: float = 1.0) -> None:
        """Set ``p.grad`` to ``scale`` times the accumulated sum and clear the buffers.

        Gradients still in ``p.grad`` (a backward after the last ``accumulate``) are folded in.
        """
        if any(p.grad is not None for p in self.params):
            self.accumulate()
        for p in self.params:
            buf = self._bufs.get(id(p))
            if buf is None:
                continue
            v = self._value(buf).reshape(-1)[: buf.n]
            if scale != 1.0:
                v *= scale
            p.grad = v.view(p.shape).to(p.dtype)
        self._bufs.clear()
        self.micro_batches = 0

    def tensors(self) -> list[Tensor]:
        """Every buffer held between micro-batches (codes, error feedback, scales)."""
        out = []
        for b in self._bufs.values():
            out += [b.code, b.scale] + ([b.resid] if b.resid is not None else [])
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

"""8-bit gradient accumulation: int8 buffers with per-block scales and error feedback.

Over ``m`` micro-batches the running sum ``S_k = g_1 + ... + g_k`` of each parameter's
gradient is held in a :class:`leantrain.optim.grad8.Int8GradBuffer` (int8 codes with one fp32
scale per block of ``block_size`` elements, ``scale = absmax / 127``, and an int8 error-feedback
residual with its own per-block scale) instead of an fp32 ``.grad``. Each
:meth:`Int8GradAccumulator.accumulate` folds ``p.grad`` in and frees it:

    v     = dequant(codes) + dequant(resid) + g     # dequantized sum + carried error + new grad
    codes = quantize(v);  resid = quantize(v - dequant(codes))

The requantization error of one fold (|e| <= scale/2) is not lost: it is carried in the
residual into the next fold, so the stored pair is a ~16-bit fixed-point number per block: a
fold loses at most ``scale/508`` per element (the residual's rounding) instead of ``scale/2``. Memory: ``2 + 8/block_size`` bytes per element
(``error_feedback=False``: ``1 + 4/block_size``), against 4 for fp32 accumulation.
:meth:`finalize` writes ``p.grad`` (in the parameter's dtype) before the optimizer step and
clears the buffers. The same buffer holds FORGE's int8 accumulated gradients
(``forge.accum_dtype int8``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from leantrain.ops.tiles import check_int_format
from leantrain.optim.grad8 import Int8GradBuffer

__all__ = ["Int8GradAccumulator"]


class Int8GradAccumulator:
    """Gradient accumulation in int8 (per-block scales, int8 error feedback).

    ``acc.accumulate()`` after each micro-batch's backward; ``acc.finalize()`` before
    ``optimizer.step()``. ``acc.tensors()`` lists the buffers (for the memory ledger:
    ``MemoryLedger.measure(model, opt, grad_buffers=acc.tensors())``). ``stochastic``: stochastic
    rounding of the codes, seeded by ``seed`` and a per-buffer fold counter (reproducible).
    """

    def __init__(self, params: Iterable[Tensor], block_size: int = 256, *, error_feedback: bool = True,
                 stochastic: bool = False, seed: int = 0):
        self.params = [p for p in params if p.requires_grad]
        check_int_format(8, block_size)
        self.block_size = block_size
        self.error_feedback = error_feedback
        self.stochastic = stochastic
        self.seed = seed
        self._bufs: dict[int, Int8GradBuffer] = {}
        self.micro_batches = 0

    @torch.no_grad()
    def accumulate(self) -> None:
        """Fold every ``p.grad`` into its int8 buffer and free ``p.grad``."""
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            buf = self._bufs.get(id(p))
            if buf is None:
                buf = self._bufs[id(p)] = Int8GradBuffer(
                    p.numel(), group_size=self.block_size, error_feedback=self.error_feedback,
                    stochastic=self.stochastic, seed=self.seed + (i << 20))
            buf.add_(p.grad)
            p.grad = None
        self.micro_batches += 1

    @torch.no_grad()
    def finalize(self, *, scale: float = 1.0) -> None:
        """Set ``p.grad`` to ``scale`` times the accumulated sum and clear the buffers.

        Gradients still in ``p.grad`` (a backward after the last ``accumulate``) are folded in.
        """
        for p in self.params:
            buf = self._bufs.get(id(p))
            if buf is None:
                continue
            v = buf.value() if p.grad is None else buf.add_to(p.grad.detach().reshape(-1).float())
            if scale != 1.0:
                v *= scale
            p.grad = v.view(p.shape).to(p.dtype)
        for p in self.params:  # (a parameter whose gradient came only after the last accumulate)
            if id(p) not in self._bufs and p.grad is not None and scale != 1.0:
                p.grad.mul_(scale)
        self._bufs.clear()
        self.micro_batches = 0

    def tensors(self) -> list[Tensor]:
        """Every buffer held between micro-batches (codes, error feedback, scales)."""
        return [t for b in self._bufs.values() for t in b.tensors()]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

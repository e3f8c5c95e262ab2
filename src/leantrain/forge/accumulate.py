"""Gradient accumulation over micro-batches (:class:`AccumulateMixin` of ForgeOptimizer).

With ``grad_accum = k`` a step is ``k`` micro-batches. :meth:`AccumulateMixin.before_micro_batch`
is called before each micro-batch's forward (the FORGE technique calls it from its
``before_forward`` hook); it counts the calls since the last ``step()`` / ``zero_grad()``:

- micro-batches 1..k-1 *accumulate*: each fused layer's dW (and db) is added into the layer's
  accumulation buffer (``accum_dtype``: bf16, fp32 or int8; the first micro-batch copies). No
  update, no data-parallel reduction (that happens once, on the sum);
- micro-batch k *updates*: the accumulated sum is added to the layer's dW and the rest is the
  ordinary update: the data-parallel reduction, the clip (its norms are the summed gradient's),
  the non-finite gate, the rule.

Where the sum is added, by the layer's path (:mod:`leantrain.forge.dispatch`):

- the fused tiles (Triton): inside the tile kernel (:mod:`leantrain.forge.kernel`). An
  accumulating micro-batch runs its ``MODE_ACCUM`` (the dW tile added into a bf16 / fp32 buffer in
  the epilogue, or folded into an int8 one group by group when ``in_features`` is a multiple of
  ``ACCUM_GROUP``: :meth:`_accumulates_in_kernel`); the last runs ``MODE_FUSED`` with the buffer as
  an input, added to the dW tile before its sum of squares and the update. The same fp32
  operations in the same order as the split path below: the same bits for the same dW;
- the split path (every other case): dW is computed into the reused workspace (one layer's at a
  time), then added into the buffer (``acc.add_(dW)``), or, in the last micro-batch, the buffer
  into dW (:meth:`_add_accumulated`) before the update-only kernel or the torch rule. It is taken
  by the torch backend, ``kernel="split"`` (and ``"auto"`` on CUDA at the default ``split_tokens``),
  a ``fill`` caller, in the last micro-batch by data parallelism and ``clip="layer"`` /
  ``"est_global"``, and in accumulating micro-batches by an int8 buffer of a layer whose
  ``in_features`` is not a multiple of ``ACCUM_GROUP``. The warp-specialized kernel does not
  take an accumulated gradient (its layer's last micro-batch runs the tiles or the split path).

The non-fused parameters accumulate in ``.grad`` as usual (``step()`` steps them). The caller
divides each micro-batch's loss by ``k`` (the trainer does), so the update sees the mean over the
``k`` micro-batches: one big batch's gradient up to the summation order (and, with bf16
buffers, the rounding of the partial sums to bf16; with int8, the requantization error).

Each buffer holds one layer's weight and bias gradients, flat (``numel`` of the layer's fused
parameters, the weight row-major then the bias: the workspace's layout and the kernel's): in
``accum_dtype`` bf16 / fp32, or for ``int8`` a :class:`leantrain.optim.grad8.Int8GradBuffer`
(int8 codes with one fp32 scale per ``ACCUM_GROUP`` elements, plus an int8 error-feedback
residual with its own scales unless ``accum_error_feedback=False``: 2.03 / 1.02 bytes a
parameter, against bf16's 2 and fp32's 4); made at the first accumulating micro-batch and kept
across steps.

What exists in fp32, and when. Held between micro-batches: only fp32 buffers
(``accum_dtype="fp32"``, 4 bytes a parameter). Transient: on the fused tiles, nothing of the layer's size (the dW tile
lives in registers; an int8 fold of a layer with a bias makes an fp32 vector of its
``out_features`` and the fold's copies of it). On the split path, the materialized dW of the one
layer being processed (the reused workspace: :attr:`peak_dw_numel` counts it) and, with int8, the
fold's transient ``dequant(sum) + dW`` and one dequantized copy (the layer's size, freed after
the fold). No fp32 gradient outlives a layer's backward. A buffer is "filled" from its first
accumulation to the update that consumes it; ``step()`` and ``zero_grad()`` end the step's
accumulation, so a checkpoint (written after a full step) never holds one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from leantrain.forge import launch as K
from leantrain.forge.dispatch import choose_path
from leantrain.forge.linear import ForgeLayer
from leantrain.optim.grad8 import Int8GradBuffer

ACCUM_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "int8": torch.int8}
ACCUM_GROUP = 256  # elements of an int8 buffer sharing one scale (AGoQ's int8 gradient blocks too)


def check_accumulation(grad_accum: int, accum_dtype: str) -> None:
    if not isinstance(grad_accum, int) or grad_accum < 1:
        raise ValueError(f"grad_accum must be a positive number of micro-batches, got {grad_accum!r}")
    if accum_dtype not in ACCUM_DTYPES:
        raise ValueError(f"accum_dtype must be one of {sorted(ACCUM_DTYPES)}, got {accum_dtype!r}")


def _holds(acc: Tensor | Int8GradBuffer, numel: int, device: torch.device) -> bool:
    """Whether the accumulation buffer ``acc`` fits a layer's ``numel`` gradient elements on ``device``."""
    if isinstance(acc, Int8GradBuffer):
        return acc.numel == numel and (acc.codes is None or acc.codes.device == device)
    return acc.numel() == numel and acc.device == device


class AccumulateMixin:
    """The accumulation state of :class:`leantrain.forge.optimizer.ForgeOptimizer` (module
    docstring). Expects ``grad_accum``, ``accum_dtype``, ``_micro``, ``_accum`` (slot -> buffer) and
    ``_filled`` (slots whose buffer holds this step's gradient), ``accum_error_feedback`` set by the
    optimizer."""

    def before_micro_batch(self) -> None:
        """Call before each micro-batch's forward when training with ``grad_accum > 1``: the
        backwards of the first ``grad_accum - 1`` micro-batches since the last ``step()`` /
        ``zero_grad()`` accumulate, the next one updates. Without calls every backward updates."""
        if self._micro >= self.grad_accum:
            raise RuntimeError(f"FORGE: micro-batch {self._micro + 1} of a step with grad_accum={self.grad_accum}; "
                               "call opt.step() after every grad_accum micro-batches")
        self._micro += 1

    @property
    def accumulating(self) -> bool:
        """Whether a backward now adds its layers' gradients into the accumulation buffers."""
        return 0 < self._micro < self.grad_accum

    def accum_buffers(self) -> list[Tensor]:
        """The accumulation buffers' tensors (the memory ledger counts them as gradients)."""
        return [t for acc in self._accum.values()
                for t in (acc.tensors() if isinstance(acc, Int8GradBuffer) else [acc])]

    def _buffer_for(self, slot: int, numel: int, device: torch.device, backend: str) -> Tensor | Int8GradBuffer:
        """The layer's accumulation buffer, made at its first accumulating micro-batch and kept."""
        acc = self._accum.get(slot)
        if acc is None or not _holds(acc, numel, device):
            if self.accum_dtype == "int8":  # (its quantize ops on the layer's backend: torch or triton)
                acc = Int8GradBuffer(numel, group_size=ACCUM_GROUP, error_feedback=self.accum_error_feedback,
                                     backend=backend)
            else:
                acc = torch.empty(numel, dtype=ACCUM_DTYPES[self.accum_dtype], device=device)
            self._accum[slot] = acc
        return acc

    def _accumulates_in_kernel(self, layer: ForgeLayer, x2: Tensor | None, fill, backend: str) -> bool:
        """Whether the layer's dW goes into its buffer inside the tile kernel (``MODE_ACCUM``): the
        Triton backend, no ``fill`` caller, an fp32 / bf16 buffer or an int8 one whose groups are
        whole runs of a weight row (``in_features`` a multiple of ``ACCUM_GROUP``), and the fused
        tiles as the path :func:`~leantrain.forge.dispatch.choose_path` gives the layer (the CPU
        interpreter; on CUDA with ``kernel="tiles"`` or ``split_tokens`` above the layer's tokens)."""
        if backend != "triton" or fill is not None or x2 is None:
            return False
        if self.accum_dtype == "int8" and layer.weight.shape[1] % ACCUM_GROUP:
            return False
        return choose_path(self.kernel, x2.shape[0], on_cuda=layer.weight.is_cuda, must_materialize=False,
                           ws_ok=False, split_tokens=self.split_tokens, ws_tokens=self.ws_tokens) == "tiles"

    def _accumulate_layer(self, layer: ForgeLayer, x2: Tensor | None, dy2: Tensor | None, fill) -> None:
        """Add the layer's dW (and db) of this micro-batch into its buffer: no update."""
        if self._phase is not None:
            raise RuntimeError("FORGE: gradient accumulation cannot run inside a captured CUDA graph "
                               "(train.cuda_graph needs data.grad_accum 1)")
        backend = self._backend_for(layer.weight)
        w, b = layer.weight, layer.bias
        filled = layer.slot in self._filled
        if self._accumulates_in_kernel(layer, x2, fill, backend):
            acc = self._buffer_for(layer.slot, w.numel() + (0 if b is None else b.numel()), w.device, backend)
            K.launch_forge(K.MODE_ACCUM, x=x2.contiguous(), dy=dy2.contiguous(), w=w, b=b, accum=acc,
                           accum_read=filled)
        else:
            buf, _, _ = self._materialize(layer, x2, dy2, backend, fill, reduce=False)
            acc = self._buffer_for(layer.slot, buf.numel(), buf.device, backend)
            if filled:
                acc.add_(buf)
            else:
                acc.copy_(buf)
        self._filled.add(layer.slot)

    def _add_accumulated(self, layer: ForgeLayer, buf: Tensor) -> None:
        """The update's micro-batch: add the layer's accumulated gradient into its dW ``buf``."""
        if layer.slot in self._filled:
            acc = self._accum[layer.slot]
            if isinstance(acc, Int8GradBuffer):
                acc.add_to(buf)
            else:
                buf.add_(acc)
            self._filled.discard(layer.slot)

    def _end_accumulation(self) -> None:
        """At ``step()``: every accumulated gradient must have been consumed by its layer's update."""
        self._micro = 0
        if self._filled:
            names = [self.layers[s].name for s in sorted(self._filled)]
            self._filled.clear()
            raise RuntimeError(f"FORGE: layers {', '.join(names)} got gradients in accumulating micro-batches but "
                               "none in the last one, whose backward updates them; their accumulated gradient "
                               "was dropped. Every fused layer must take part in the last micro-batch of a step")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``torch.optim.Optimizer.zero_grad``; also drops this step's accumulated gradients and
        restarts the micro-batch count (a skipped step)."""
        self._micro = 0
        self._filled.clear()
        super().zero_grad(set_to_none=set_to_none)

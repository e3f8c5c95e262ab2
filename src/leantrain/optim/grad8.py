"""An 8-bit gradient sum: int8 codes with per-group scales and an int8 error-feedback residual.

Over ``m`` micro-batches the running sum ``S_k = g_1 + ... + g_k`` of one gradient is held as a
block-wise int8 :class:`~leantrain.ops.QTensor` (:func:`leantrain.ops.quantize`, symmetric,
``group_size`` consecutive elements of the flattened gradient share one fp32 scale
``absmax / 127``) instead of an fp32 (or bf16) tensor. :meth:`Int8GradBuffer.add_` folds a new
gradient in:

    v     = dequant(codes) + dequant(resid) + g                 (fp32, the buffer's numel)
    codes = quantize(v)                                          (int8, scale_c = absmax(v) / 127)
    resid = quantize(v - dequant(codes))                         (int8, scale_r = absmax(e) / 127)

The requantization error ``e = v - dequant(codes)`` (``|e| <= scale_c / 2`` per element with
round-to-nearest) is not lost: it is carried in ``resid`` into the next fold and into
:meth:`add_to`, so the pair is a ~16-bit block fixed-point number. What a fold loses is the
residual's own rounding, at most ``scale_r / 2 <= scale_c / 508 = absmax_group(v) / 64516`` per
element; over ``m`` folds these add up (``m`` times a 16-bit rounding). Without the residual
(``error_feedback=False``) each fold loses up to ``scale_c / 2 = absmax_group(v) / 254``.

Memory held per element: 1 byte of codes + 4 / group_size of scale, and the same again for the
residual: ``2 + 8 / group_size`` bytes with error feedback (2.03 at 256: slightly *more* than a
bf16 buffer's 2, for ~16 bits of precision relative to the group's largest element against
bf16's 8 relative to each element), ``1 + 4 / group_size`` without (1.02 at 256).

Transients: a fold makes ``v`` and one dequantized copy in fp32 (the buffer's numel), freed when
it returns; the quantize / dequantize ops are Triton kernels on CUDA and the pure-torch
reference elsewhere (:mod:`leantrain.ops.quant`), bit-identical to each other.

A kernel may fold in place instead (FORGE's tile kernel, ``MODE_ACCUM`` of
:mod:`leantrain.forge.kernel`): :meth:`Int8GradBuffer.writable` hands it the codes and residual
(allocated once) and counts the fold; the kernel does the same operations on whole groups it
owns, and :meth:`Int8GradBuffer.fold_tail_` folds the groups from a group-aligned offset to the
end (a layer's bias) in torch, with transients of that tail's size only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from leantrain.ops.qtensor import QTensor
from leantrain.ops.quant import dequantize, quantize

__all__ = ["Int8GradBuffer"]


class Int8GradBuffer:
    """The 8-bit sum of one flat gradient of ``numel`` elements (module docstring).

    ``copy_(g)`` starts a sum, ``add_(g)`` adds to it, ``add_to(out)`` adds the sum into ``out``
    (an fp32 or bf16 tensor of ``numel`` elements), ``tensors()`` lists what it holds (for the
    memory ledger). The codes are allocated by the first ``copy_``/``add_`` and kept: a new sum
    replaces them (same sizes), so the bytes held stay constant across steps.
    ``stochastic``: stochastic rounding of the codes (seeded per fold from ``seed`` and a fold
    counter: reproducible), else round-to-nearest. ``backend``: the quantize / dequantize ops'
    (``"auto"``: Triton on CUDA, the torch reference elsewhere; the two are bit-identical).
    """

    def __init__(self, numel: int, *, group_size: int = 256, error_feedback: bool = True,
                 stochastic: bool = False, seed: int = 0, backend: str = "auto"):
        self.numel = numel
        self.backend = backend
        self.group_size = group_size
        self.error_feedback = error_feedback
        self.stochastic = stochastic
        self.seed = seed
        self.folds = 0
        self.codes: QTensor | None = None
        self.resid: QTensor | None = None

    def _quantize(self, v: Tensor) -> QTensor:
        self.folds += 1
        return quantize(v, bits=8, group_size=self.group_size, stochastic=self.stochastic,
                        seed=self.seed + self.folds, backend=self.backend)

    def _dequantize(self, q: QTensor) -> Tensor:
        return dequantize(q, dtype=torch.float32, backend=self.backend)

    @torch.no_grad()
    def copy_(self, g: Tensor) -> None:
        """Start a new sum at ``g`` (any float dtype, ``numel`` elements; read, not kept)."""
        self._store(self._flat_copy(g))

    @torch.no_grad()
    def add_(self, g: Tensor) -> None:
        """Fold ``g`` into the sum (requantize ``sum + g``, carrying the error in the residual)."""
        v = self._flat_copy(g)
        if self.codes is not None:
            self.add_to(v)
        self._store(v)

    def _flat_copy(self, g: Tensor) -> Tensor:
        if g.numel() != self.numel:
            raise ValueError(f"Int8GradBuffer of {self.numel} elements given a gradient of {g.numel()}")
        return g.detach().reshape(-1).to(torch.float32, copy=True)

    def _store(self, v: Tensor) -> None:
        self.codes = self._quantize(v)
        if self.error_feedback:
            self.resid = self._quantize(v.sub_(self._dequantize(self.codes)))

    def writable(self, device) -> tuple[QTensor, QTensor | None]:
        """The codes and the residual (None without error feedback) for a kernel that folds a
        gradient into them in place, group by group, with :meth:`add_`'s operations
        (``leantrain.forge.kernel``'s ``MODE_ACCUM``): allocated by the first call in
        :func:`~leantrain.ops.quantize`'s layout, then kept; the call counts as one fold. Round to
        nearest only (a kernel does not draw :meth:`add_`'s stochastic rounding bits)."""
        if self.stochastic:
            raise ValueError("Int8GradBuffer.writable: a stochastically rounded sum folds with add_ only")
        if self.codes is None:
            self.codes = self._empty(device)
        if self.error_feedback and self.resid is None:
            self.resid = self._empty(device)
        self.folds += 2 if self.error_feedback else 1
        return self.codes, self.resid

    def _empty(self, device) -> QTensor:
        groups = -(-self.numel // self.group_size)
        return QTensor(torch.empty(groups * self.group_size, dtype=torch.uint8, device=device),
                       torch.empty(groups, dtype=torch.float32, device=device), None, torch.Size([self.numel]),
                       torch.float32, 8, self.group_size, True)

    @torch.no_grad()
    def fold_tail_(self, g: Tensor, start: int, first: bool) -> None:
        """Fold ``g`` into the elements from ``start`` (a multiple of ``group_size``) to the end,
        leaving those groups as :meth:`add_` (:meth:`copy_` with ``first``) leaves them: groups are
        quantized independently, so the tail's codes are the whole buffer's. For a kernel that folds
        the groups before ``start`` (after :meth:`writable`, which counted the fold)."""
        gs = self.group_size
        if start % gs or g.numel() != self.numel - start or self.codes is None:
            raise ValueError(f"Int8GradBuffer.fold_tail_: {g.numel()} elements from {start} of a buffer of "
                             f"{self.numel} (groups of {gs}), after writable()")
        head = start // gs
        v = g.detach().reshape(-1).to(torch.float32, copy=True)
        if not first:
            v.add_(self._dequantize(self._tail(self.codes, head)))
            if self.resid is not None:
                v.add_(self._dequantize(self._tail(self.resid, head)))
        codes = quantize(v, bits=8, group_size=gs, backend=self.backend)
        self._put(self.codes, head, codes)
        if self.resid is not None:
            self._put(self.resid, head, quantize(v.sub_(self._dequantize(codes)), bits=8, group_size=gs,
                                                 backend=self.backend))

    def _tail(self, q: QTensor, head: int) -> QTensor:
        gs = self.group_size
        return QTensor(q.data[head * gs:], q.scale[head:], None, torch.Size([self.numel - head * gs]),
                       torch.float32, 8, gs, True)

    @staticmethod
    def _put(dst: QTensor, head: int, src: QTensor) -> None:
        dst.data[head * dst.group_size:].copy_(src.data)
        dst.scale[head:].copy_(src.scale)

    @torch.no_grad()
    def add_to(self, out: Tensor) -> Tensor:
        """``out += sum`` (``out`` flat or any shape of ``numel`` elements); returns ``out``."""
        if self.codes is None:
            raise RuntimeError("Int8GradBuffer.add_to before any copy_/add_")
        flat = out.view(-1)
        flat.add_(self._dequantize(self.codes))
        if self.resid is not None:
            flat.add_(self._dequantize(self.resid))
        return out

    def value(self) -> Tensor:
        """The sum as a new fp32 tensor of ``numel`` elements."""
        if self.codes is None:
            raise RuntimeError("Int8GradBuffer.value before any copy_/add_")
        return self.add_to(torch.zeros(self.numel, dtype=torch.float32, device=self.codes.device))

    def tensors(self) -> list[Tensor]:
        """Every tensor held between folds (codes, scales; the residual's too)."""
        return [t for q in (self.codes, self.resid) if q is not None for t in (q.data, q.scale)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @staticmethod
    def bytes_per_element(group_size: int = 256, error_feedback: bool = True) -> float:
        """Bytes held per gradient element (the padding of the last group aside)."""
        return (2 if error_feedback else 1) * (1 + 4 / group_size)

"""Packing one saved activation into few bits, and unpacking it exactly back to its shape.

Formats (all per group of ``group_size`` consecutive elements of the flattened tensor, in
logical order: a non-contiguous view is copied first, so groups run along its last dim):

- 8 and 4 bits: :func:`leantrain.ops.quant_fast.quantize_q` / ``dequantize_q``: the Triton
  kernels on CUDA (several tensors per launch through :class:`PackBatch`,
  ``ops.multi.quantize_flat``), on CPU a vectorized torch path writing the same ``QTensor``
  layout with ``torch.rand`` noise. Symmetric absmax (``scale = absmax / (2**(b-1)-1)``) or, for one-sided data such as
  log-probabilities, asymmetric min/max (``scale = (max-min)/(2**b-1)``, ``zero = min``).
- 3 and 2 bits: asymmetric min/max codes ``0 .. 2**b-1`` (a symmetric 2-bit grid has only
  three levels), packed by this module in pure torch: four 2-bit codes per byte, eight 3-bit
  codes per three bytes. No Python loop per element; a handful of element-wise kernels.
- 1 bit: boolean masks, eight per byte (exact).

Rounding is to nearest or stochastic (``floor(y + u)``, ``u`` uniform: unbiased, E[x'] = x),
the default for activations (ActNN, GACT): the gradient stays an unbiased estimate.
Bytes kept per element: ``b/8 + 4/group_size`` (+4/group_size for the zero point of the
asymmetric formats). The SQNR floor of round-to-nearest on Gaussian data with absmax
scaling is about ``6.02 b - 10`` dB at group 128; stochastic rounding costs about 3 dB.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from leantrain.ops._backend import resolve
from leantrain.ops.multi import FlatLayout, dequantize_flat, flat_qtensor, quantize_flat
from leantrain.ops.qtensor import QTensor
from leantrain.ops.quant_fast import dequantize_q, group_uniforms, pad_groups_edge, quantize_q

__all__ = ["Packed", "PackBatch", "pack", "unpack", "pack_mask", "unpack_mask", "quantize_q",
           "dequantize_q", "SUPPORTED_BITS"]

SUPPORTED_BITS = (1, 2, 3, 4, 8)


@dataclass(slots=True, weakref_slot=True)  # (slots: built once per packed save, ~250 a 1b forward)
class Packed:
    """A saved activation in packed form. ``nbytes`` is what it holds (codes + scales)."""

    kind: str  # "q" (ops QTensor, 4/8 bits), "flat" (4/8 bits, in a batch's buffer), "low" (2/3 bits), "mask" (1 bit)
    payload: object
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    bits: int
    nbytes: int
    uses: int = 1  # backward nodes holding it (a deduplicated save counts once per node)
    cache: Tensor | None = None  # the unpacked tensor, kept until the last of those nodes took it
    taken: int = 0  # unpacks so far
    batch: PackBatch | None = None  # packed with others: payload (buffer, offsets) filled at the batch's flush

    def tensors(self) -> list[Tensor]:
        """The tensors holding the codes (a batch member: the batch's whole buffer, shared)."""
        p = self.payload
        if p is None:  # not flushed yet
            return []
        if self.kind == "q":
            return [t for t in (p.data, p.scale, p.zero) if t is not None]
        return [t for t in p if isinstance(t, Tensor)]

    def qtensor(self) -> QTensor:
        """The 4/8-bit codes as a :class:`QTensor` (a batch member: views into the batch's buffer)."""
        if self.payload is None and self.batch is not None:
            self.batch.flush()
        if self.kind == "flat":
            buf, lay = self.payload
            b = self.batch
            return flat_qtensor(buf, lay, self.shape, self.dtype, self.bits, b.group_size, b.symmetric)
        if self.kind != "q":
            raise TypeError(f"agoq: a {self.kind!r} packed tensor has no QTensor")
        return self.payload


class PackBatch:
    """Saved activations packed in one kernel launch (one symmetry; fp32, bf16 and fp16, 4 and 8
    bits mixed) and unpacked in a few.

    :meth:`add` registers a tensor and its (still empty) :class:`Packed`; :meth:`flush`
    quantizes all of them with :func:`leantrain.ops.multi.quantize_flat` (the same codes as
    one :func:`quantize` per tensor, in one buffer: no view per member, which costs host time
    on every save; the buffer's :class:`~leantrain.ops.multi.FlatLayout` is built by :meth:`add`,
    so the flush only allocates and launches); the first :func:`unpack` of a member dequantizes it and the members saved
    before it that are not taken yet, up to ``unpack_bytes`` of results (:meth:`unpack_live`),
    with ``dequantize_flat``, and caches each result until its backward node takes it.
    The buffer is freed when the last member is. Until the flush the batch holds the tensors
    (the caller bounds the bytes). A tensor changed in place between its save and the flush is
    an error: eager packing would have kept the old values, autograd without hooks would have
    refused the backward.
    """

    def __init__(self, group_size: int, symmetric: bool, stochastic: bool, backend: str = "auto",
                 unpack_bytes: int = 0):
        self.group_size, self.symmetric, self.stochastic = group_size, symmetric, stochastic
        self.backend = backend
        self.unpack_bytes = unpack_bytes  # dequantized bytes made at once (0: every live member)
        self._todo: list[tuple[Tensor, Packed, int, int]] = []  # (source, packed, seed, version)
        self._members: list[weakref.ref] = []
        self._layout: FlatLayout | None = None  # the flush's buffer laid out as members come (Triton)
        self._kernels: bool | None = None  # the backend resolves to the kernels (decided at the first member)

    def add(self, src: Tensor, p: Packed, seed: int) -> None:
        self._todo.append((src, p, seed, src._version))
        self._members.append(weakref.ref(p))
        if self._kernels is None:
            self._kernels = resolve(self.backend, src) == "triton"
        if self._kernels:
            if self._layout is None:
                self._layout = FlatLayout(self.group_size, self.symmetric)
            self._layout.add(src, p.bits, seed)

    def register(self, x: Tensor, bits: int, seed: int) -> Packed:
        """The (still empty) :class:`Packed` of float tensor ``x`` at 4 or 8 bits, quantized at the
        flush (``x`` in logical order: a permuted view is copied, see :func:`_source`)."""
        src = _source(x)
        p = Packed("q", None, x.shape, x.dtype, x.device, bits,
                   _q_nbytes(src.numel(), bits, self.group_size, self.symmetric), batch=self)
        self.add(src, p, seed)
        return p

    def flush(self) -> None:
        todo, self._todo = self._todo, []
        flat, self._layout = self._layout, None
        if not todo:
            return
        for src, _, _, version in todo:
            if src._version != version:
                raise RuntimeError(
                    "agoq: a saved activation was modified in place after autograd saved it and "
                    "before its batch was packed; pack each tensor at once with Policy(batch_mib=0)")
        buf, layout = quantize_flat([t[0] for t in todo], [t[1].bits for t in todo], [t[2] for t in todo],
                                    group_size=self.group_size, symmetric=self.symmetric,
                                    stochastic=self.stochastic, backend=self.backend, layout=flat)
        for (_, p, _, _), lay in zip(todo, layout, strict=True):
            p.kind, p.payload = "flat", (buf, lay)

    def unpack_live(self, want: Packed | None = None) -> None:
        """Dequantize, in one launch, ``want`` and the members saved before it that some backward
        node has still to take (backward takes saves in about reverse order), up to
        ``unpack_bytes`` of dequantized tensors (0, or no ``want``: every such member)."""
        self.flush()
        live = [p for r in self._members if (p := r()) is not None and p.cache is None and p.taken < p.uses]
        if want is not None and self.unpack_bytes > 0 and len(live) > 1:
            i = next((k for k, p in enumerate(live) if p is want), None)
            if i is not None:
                pick, total = [want], _out_bytes(want)
                for p in reversed(live[:i]):
                    total += _out_bytes(p)
                    if total > self.unpack_bytes:
                        break
                    pick.append(p)
                live = pick
        if not live:
            return
        buf = live[0].payload[0]  # (one flush per batch: one buffer)
        outs = dequantize_flat(buf, [(p.payload[1], p.shape, p.dtype, p.bits) for p in live],
                               group_size=self.group_size, symmetric=self.symmetric, backend=self.backend)
        for p, v in zip(live, outs, strict=True):
            p.cache = v


def _out_bytes(p: Packed) -> int:
    return math.prod(p.shape) * p.dtype.itemsize


def _pack_low(x: Tensor, bits: int, group_size: int, stochastic: bool, seed: int):
    """2/3-bit asymmetric codes, returns ``(data uint8, scale fp32, zero fp32)``."""
    if group_size % 8:
        raise ValueError(f"2/3-bit packing needs group_size divisible by 8, got {group_size}")
    xg = pad_groups_edge(x, group_size)
    xg = torch.where(torch.isfinite(xg), xg, 0.0)
    mn, mx = xg.amin(1, keepdim=True), xg.amax(1, keepdim=True)
    qmax = 2**bits - 1
    scale = (mx - mn) / qmax
    inv = torch.where(scale > 0, 1.0 / scale, 0.0)
    y = (xg - mn) * inv
    if stochastic:
        y = y + group_uniforms(seed, *xg.shape, xg.device)
    else:
        y = y + 0.5
    code = y.floor_().clamp_(0, qmax).to(torch.int32)
    if bits == 2:
        c = code.view(-1, 4)
        data = c[:, 0] | (c[:, 1] << 2) | (c[:, 2] << 4) | (c[:, 3] << 6)
        data = data.to(torch.uint8)
    else:  # 3 bits: 8 codes -> 24-bit word -> 3 bytes
        c = code.view(-1, 8)
        shifts = torch.arange(0, 24, 3, device=c.device, dtype=torch.int32)
        word = (c << shifts).sum(1, dtype=torch.int32)
        data = torch.stack([word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF], 1).to(torch.uint8).reshape(-1)
    return data, scale.view(-1), mn.view(-1)


def _unpack_low(data: Tensor, scale: Tensor, zero: Tensor, bits: int, group_size: int, n: int) -> Tensor:
    d = data.to(torch.int32)
    if bits == 2:
        code = torch.stack([d & 3, (d >> 2) & 3, (d >> 4) & 3, (d >> 6) & 3], 1).reshape(-1)
    else:
        b = d.view(-1, 3)
        word = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        shifts = torch.arange(0, 24, 3, device=d.device, dtype=torch.int32)
        code = ((word.unsqueeze(1) >> shifts) & 7).reshape(-1)
    v = code.view(-1, group_size).float() * scale.unsqueeze(1) + zero.unsqueeze(1)
    return v.reshape(-1)[:n]


def _bit_weights(device) -> Tensor:
    """``[1, 2, 4, ..., 128]`` (uint8), made on ``device``: no host-to-device copy per call."""
    return torch.ones(8, dtype=torch.uint8, device=device) << torch.arange(8, dtype=torch.uint8, device=device)


def pack_mask(m: Tensor) -> tuple[Tensor, int]:
    """Bool tensor -> uint8 bytes, eight elements per byte (little-endian bits)."""
    flat = m.reshape(-1).to(torch.uint8)
    n = flat.numel()
    pad = (-n) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    w = _bit_weights(m.device)
    return (flat.view(-1, 8) * w).sum(1, dtype=torch.uint8), n


def unpack_mask(data: Tensor, n: int, shape) -> Tensor:
    w = _bit_weights(data.device)
    bits = (data.unsqueeze(1) & w) != 0
    return bits.reshape(-1)[:n].reshape(shape)


def _nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _source(x: Tensor) -> Tensor:
    """``x`` in logical (row-major) order: a group of ``group_size`` elements then lies along the
    last dim. A permuted view such as attention's ``[B, H, T, D]`` transpose of ``[B, T, H, D]``
    memory is copied (detached): read in memory order, its groups would span heads of different
    scale (docs/agoq.md, "Convergence on 125m": a suspected, not isolated, cause of a 0.3-0.9 %
    validation-loss gap measured while views were read in place)."""
    return x if x.is_contiguous() else x.detach().contiguous()


def _q_nbytes(n: int, bits: int, group_size: int, symmetric: bool) -> int:
    g = -(-n // group_size)
    return g * group_size * bits // 8 + 4 * g * (1 if symmetric else 2)


def pack(x: Tensor, bits: int, *, group_size: int = 128, stochastic: bool = True, seed: int = 0,
         symmetric: bool = True, batch: PackBatch | None = None, exp: bool = False) -> Packed:
    """Pack ``x`` to ``bits`` (1: bool masks only; 2/3: asymmetric; 4/8: ``symmetric`` as asked).

    With ``batch`` (4/8 bits), ``x`` is registered there and quantized at the batch's flush.
    ``exp``: pack ``exp(x)`` (fp32; 4/8 bits unbatched: inside the quantize kernel, without a
    tensor of it)."""
    if exp and (bits not in (4, 8) or batch is not None):
        x, exp = x.detach().float().exp(), False
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"agoq: bits must be one of {SUPPORTED_BITS}, got {bits}")
    if x.dtype == torch.bool:
        data, n = pack_mask(x)
        return Packed("mask", (data, n), x.shape, x.dtype, x.device, 1, _nbytes(data))
    if bits == 1:
        raise ValueError("agoq: 1-bit packing is for boolean masks only")
    if not x.is_floating_point():
        raise TypeError(f"agoq: cannot quantize a {x.dtype} tensor (integer tensors are kept exact)")
    if bits in (2, 3):
        data, scale, zero = _pack_low(x, bits, group_size, stochastic, seed)
        return Packed("low", (data, scale, zero, group_size), x.shape, x.dtype, x.device, bits,
                      _nbytes(data, scale, zero))
    if batch is not None:  # only its memory is read, at the flush: no detached alias needed
        return batch.register(x, bits, seed)
    src = _source(x)
    q = quantize_q(src.detach(), bits, group_size=group_size, symmetric=symmetric, stochastic=stochastic, seed=seed,
                   exp=exp)
    return Packed("q", q, x.shape, q.dtype, x.device, bits, q.nbytes)


def unpack(p: Packed) -> Tensor:
    """The tensor ``p`` was packed from (values up to quantization error), same shape/dtype/device.

    A packed tensor shared by ``uses`` backward nodes (q/k/v projections saving one input) is
    dequantized once: the first unpack keeps the result for the other ``uses - 1`` (they run
    one after another in backward) and the last one drops it. Backward formulas never write
    into saved tensors, so handing the same tensor to each node is safe; a further unpack
    (``retain_graph``) dequantizes again. A member of a :class:`PackBatch` is dequantized with
    the batch's other live members in one launch.
    """
    if p.cache is None and p.batch is not None and p.taken < p.uses:
        p.batch.unpack_live(p)
    p.taken += 1
    c = p.cache
    if c is not None:
        if p.taken >= p.uses:
            p.cache = None
        return c
    t = _unpack(p)
    if p.taken < p.uses:
        p.cache = t
    return t


def _unpack(p: Packed) -> Tensor:
    if p.payload is None:  # a batch member whose batch was not flushed yet
        p.batch.flush()
    if p.kind == "mask":
        data, n = p.payload
        return unpack_mask(data, n, p.shape)
    if p.kind == "low":
        data, scale, zero, gs = p.payload
        n = math.prod(p.shape)
        return _unpack_low(data, scale, zero, p.bits, gs, n).to(p.dtype).reshape(p.shape)
    if p.kind == "flat":
        b = p.batch
        return dequantize_flat(p.payload[0], [(p.payload[1], p.shape, p.dtype, p.bits)], group_size=b.group_size,
                               symmetric=b.symmetric, backend=b.backend)[0]
    return dequantize_q(p.payload).reshape(p.shape)

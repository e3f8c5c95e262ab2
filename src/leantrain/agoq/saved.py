"""What a saved activation becomes besides a :class:`~leantrain.agoq.pack.Packed`: a log-softmax
stored as probabilities (:class:`ProbPacked`) and a tensor recomputed in backward from other
saves (:class:`Derived`, ``policy.derive``: the output of SiLU, of a product, or a view of one),
with the autograd node names that can be derived (:data:`DERIVABLE`) and :func:`unpack_saved`,
the one unpack for every form."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from leantrain.agoq.pack import Packed, unpack
from leantrain.ops.quant_fast import dequantize_q
from leantrain.ops.tiles import TINY


@dataclass
class ProbPacked:
    """A log-softmax stored as ``p = exp(logp)`` (``Packed``); unpacks to ``log(p)``.

    Log-softmax backward reads only ``exp(logp)``: rounding ``p`` stochastically keeps exactly
    that unbiased, and its error is absolute in ``p`` (largest where ``p`` is largest), where a
    grid on ``logp`` gives every probability the same relative error and, through ``exp``, a bias.
    """

    packed: Packed
    dtype: torch.dtype
    uses: int = 1  # backward nodes holding it (log-softmax and the NLL loss after it: 2)
    taken: int = 0
    cache: Tensor | None = None  # log(p), kept until the last of those nodes took it

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes

    def unpack(self) -> Tensor:
        """``log(p)``, computed once for all ``uses`` (each pass over the logits is a GiB at 1b)."""
        self.taken += 1
        more = self.taken % self.uses  # nodes of this backward still to take it (retain_graph: rounds)
        c = self.cache
        if c is not None:
            if not more:
                self.cache = None
            return c
        pk = self.packed  # (used by this object only)
        if pk.kind == "q":  # log in the dequantize pass
            out = dequantize_q(pk.payload, torch.float32, log=True).reshape(pk.shape)
        else:  # (2/3 bits: a new tensor, changed in place)
            out = unpack(pk).float().clamp_min_(TINY).log_()  # p = 0 -> -88, not -inf: exp() gives 1e-38
        out = out.to(self.dtype)
        if more:
            self.cache = out
        return out


def is_log_softmax(t: Tensor) -> bool:
    """The output of log_softmax (cross-entropy saves it): its grad_fn is already set when saved."""
    return t.grad_fn is not None and type(t.grad_fn).__name__.startswith("LogSoftmaxBackward")


class Derived:
    """A saved tensor not stored at all: recomputed in backward by ``fn`` from other saves'
    packed copies (0 bytes held). ``silu``: SwiGLU's product saves ``silu(g)`` while SiLU's
    backward saves ``g``; AGoQ keeps ``g`` only and gives the product ``silu(ĝ)`` (SiLU's slope
    is within [-0.1, 1.1], so ``ĝ``'s error passes through at most 1.1×; the measured gradient
    error is lower than with ``silu(g)`` packed on its own: docs/agoq.md). ``mul``: a product
    of two saves (the down projection's input ``silu(g)·u``, through the view ``F.linear`` takes
    of it) as ``silu(ĝ)·û``. ``uses``: the unpacks one backward will make. The result is
    computed once a backward, at the first of them, and kept until the last (:meth:`unpack`), so
    it unpacks each source once: the first consumer adds one use to every source below it, the
    others none."""

    __slots__ = ("fn", "srcs", "uses", "taken", "cache")
    nbytes = 0

    def __init__(self, fn, srcs: tuple):
        self.fn, self.srcs, self.uses, self.taken, self.cache = fn, srcs, 0, 0, None

    def add_use(self) -> None:
        self.uses += 1
        if self.uses == 1:
            for s in self.srcs:
                add_use(s)

    def unpack(self) -> Tensor:
        """``fn`` of the sources, computed once for all ``uses`` of one backward (``silu(ĝ)``: the
        product's backward and the down projection's input both take it) and kept until the last
        of them took it (as :meth:`ProbPacked.unpack`)."""
        if self.uses <= 1:
            return self.fn(*(unpack_saved(s) for s in self.srcs))
        self.taken += 1
        more = self.taken % self.uses
        c = self.cache
        if c is None:
            c = self.fn(*(unpack_saved(s) for s in self.srcs))
            if more:
                self.cache = c
        elif not more:
            self.cache = None
        return c


def add_use(obj) -> None:
    if isinstance(obj, Derived):
        obj.add_use()
    else:
        obj.uses += 1


def _mul(a: Tensor, b: Tensor) -> Tensor:
    return a * b


def _swiglu(g: Tensor, u: Tensor | None = None) -> Tensor:
    """SwiGLU's output from its saves (``model.fused_swiglu``): ``g`` and ``u``, or one tensor
    holding both as halves."""
    from leantrain.ops.swiglu import swiglu

    return swiglu(g, u)


class Reshape:
    __slots__ = ("shape",)

    def __init__(self, shape):
        self.shape = shape

    def __call__(self, x: Tensor) -> Tensor:
        return x.reshape(self.shape)


# autograd node of a saved tensor -> (derivation name, its function of the node's inputs)
DERIVABLE = {"SiluBackward0": ("silu", torch.nn.functional.silu), "MulBackward0": ("mul", _mul),
           "SwigluFnBackward": ("swiglu", _swiglu)}
# views of one input (F.linear flattens its input to 2-D: the down projection saves such a view)
VIEW_NODES = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"})


def derived_shape(how: str, srcs: list) -> torch.Size:
    """The shape a derivation gives from its sources' (one shape; SwiGLU over one tensor's halves:
    half its last dim)."""
    shape = srcs[0][1]
    return shape[:-1] + (shape[-1] // 2,) if how == "swiglu" and len(srcs) == 1 else shape


def unpack_saved(obj):
    if isinstance(obj, Packed):
        return unpack(obj)
    if isinstance(obj, (ProbPacked, Derived)):
        return obj.unpack()
    return obj


def storage_ptr(t: Tensor) -> int:
    """The address of ``t``'s storage: its data pointer less its offset (``untyped_storage()``
    builds a Python object per call, on a hook that runs ~940 times a forward)."""
    try:
        return t.data_ptr() - t.storage_offset() * t.element_size()
    except (RuntimeError, NotImplementedError):
        return -id(t)

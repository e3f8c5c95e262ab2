"""Derived saves (``policy.derive``): a tensor saved in the forward that backward can recompute
from other saves of the same forward (SiLU's output, a product's, or a view of one) is stored
as a :class:`~leantrain.agoq.saved.Derived` recipe instead of being packed; replay rebuilds the
recipe from the plan's slots without walking the autograd graph again."""

from __future__ import annotations

import weakref

from torch import Tensor

from leantrain.agoq.saved import DERIVABLE, VIEW_NODES, Derived, Reshape, derived_shape, storage_ptr
from leantrain.runtime.ledger import note_saved

__all__ = ["DeriveMixin"]


class DeriveMixin:
    """The derivation part of :class:`~leantrain.agoq.packer.Packer` (its attributes)."""

    def _derived(self, t: Tensor, gf) -> Derived | None:
        """A :class:`Derived` for ``t`` when the policy recomputes it (``policy.derive``) from saves
        already made in this forward: ``t`` is the output of SiLU (``silu``) or of a product
        (``mul``), or a view of one, whose inputs are such saves, or outputs derivable in turn
        (``t``'s dtype; a product's inputs of its shape). None otherwise (``t`` is then packed)."""
        name = type(gf).__name__
        if name in VIEW_NODES:
            if not t.is_contiguous():
                return None
            (node, nr), = gf.next_functions
            src = self._source(node, nr, t.dtype, t.numel(), 1)
            return None if src is None else Derived(Reshape(t.shape), (src[0],))
        how = DERIVABLE.get(name)
        if how is None or how[0] not in self._derive:
            return None
        srcs = self._sources(gf, how[0], t.dtype, t.numel(), 1)
        if srcs is None or derived_shape(how[0], srcs) != t.shape:
            return None
        return Derived(how[1], tuple(x[0] for x in srcs))

    def _sources(self, node, how: str, dtype, numel: int, depth: int) -> list | None:
        """(save, shape) of each input of the derivable ``node`` (derivation ``how``) whose output
        has ``numel`` elements (one input of twice as many for a SwiGLU over one tensor's halves)."""
        nxt = node.next_functions
        n_in = numel * 2 if how == "swiglu" and len(nxt) == 1 else numel
        srcs = [self._source(n, k, dtype, n_in, depth) for n, k in nxt]
        return None if any(x is None for x in srcs) or len({x[1] for x in srcs}) != 1 else srcs

    def _source(self, node, nr: int, dtype, numel: int, depth: int) -> tuple | None:
        """(save, shape): the packed or derived save giving output ``nr`` of autograd ``node``,
        made derivable here if the policy allows (registered, so later saves share it)."""
        if node is None:
            return None
        hit = self._by_node.get((id(node), nr))
        if hit is not None:
            ok = hit[0] is node and hit[3] == dtype and hit[2].numel() == numel
            return (hit[1], hit[2]) if ok else None
        how = DERIVABLE.get(type(node).__name__)
        if how is None or how[0] not in self._derive or depth > 2:
            return None
        srcs = self._sources(node, how[0], dtype, numel, depth + 1)
        if srcs is None:
            return None
        d, shape = Derived(how[1], tuple(x[0] for x in srcs)), derived_shape(how[0], srcs)
        self._by_node[(id(node), nr)] = (node, d, shape, dtype)
        return d, shape

    def _recipe(self, d: Derived) -> tuple:
        """How to rebuild ``d`` from saves of a forward with the same plan: ``(fn, parts)`` with a
        part ``("slot", i)`` for a save of slot ``i`` and a nested recipe for an intermediate."""
        return (d.fn, tuple(("slot", self._slot_of[id(s)]) if id(s) in self._slot_of else self._recipe(s)
                            for s in d.srcs))

    def _rebuild(self, recipe: tuple) -> Derived | None:
        fn, parts = recipe
        srcs = []
        for part in parts:
            src = self._objs[part[1]] if part[0] == "slot" else self._rebuild(part)
            if src is None:  # (a source slot this forward did not pack: take the full path)
                return None
            srcs.append(src)
        return Derived(fn, tuple(srcs))

    def _store_derived(self, t: Tensor, role: str, base: Tensor | None, d: Derived, key: tuple | None = None) -> Derived:
        d.add_use()
        if key is None:
            key = (storage_ptr(t), t.storage_offset(), t.shape, t.stride(), t.dtype, t._version)
        self._dedup[key] = (weakref.ref(t if base is None else base), d)
        nb = t.numel() * t.element_size()
        self.stats["derived"] += 1
        self.derived_numel[role] += t.numel()
        self.bytes_raw[role] += nb
        note_saved(0, ("agoq", id(d)), role)
        if self.record:
            self.log.append({"role": role, "shape": tuple(t.shape), "dtype": str(t.dtype), "bits": 0, "why": "derived"})
        return d

"""Replay (persistent :func:`apply`, what the trainer uses): the decisions above cost Python on
each of the ~940 saves of a 1b forward, and the role module hooks slow every module call; on
a GPU that host time, not the kernels, set AGoQ's step time. So the first forward with a new
signature (the tensor arguments' shapes, dtypes and devices, the other arguments, grad and
training mode, the policy) runs the full path with the role hooks installed and records one
slot per save: shape, dtype, role, bits. The next forwards with that signature run with the
role hooks removed and follow the slots: a save whose shape and dtype match its slot is kept
or packed as recorded (dedup still checked live), without classifying it again; the counts of
kept tensors are added in bulk at the end of the forward, so ``stats`` and the byte counts
equal the full path's. A save that does not match its slot (a forward that departs from the
recorded one; a slot recorded as a log-softmax that gets another tensor; fewer saves than
recorded) ends the replay: that save and the rest of the forward take the full path with
the role ``"other"`` (its bits, 8 by default: there is no module context to read), the
replayed prefix is counted, ``stats["replay:diverged"]`` is incremented, and the plan is
dropped, so the next forward records anew. Matching is by shape and dtype: a model whose saves
change with state the signature does not see (a flag on a module) can have saves packed at
the widths of the recorded saves of the same shape, until a mismatch shows;
``apply(..., replay=False)`` avoids it. Forwards metered by a
:class:`leantrain.runtime.ledger.SavedActivationMeter`, and packers with ``record=True``, always run
the full path.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import torch
from torch import Tensor

from leantrain.agoq.saved import storage_ptr

__all__ = ["Plan", "signature", "ReplayMixin"]


class Plan:
    """The saves of one recorded forward: a slot ``(shape, dtype, role, bits, prob, why, nbytes)``
    per save (``bits`` 0: kept for reason ``why``, ``nbytes`` reported for it; ``prob``: a
    log-softmax stored as probabilities), and the totals of the kept slots, added in bulk."""

    __slots__ = ("slots", "kept_stats", "kept_bytes")

    def __init__(self, slots: list[tuple], kept_stats: Counter, kept_bytes: dict[str, int]):
        self.slots, self.kept_stats, self.kept_bytes = slots, kept_stats, kept_bytes


def signature(args: tuple, kwargs: dict) -> tuple:
    """What a forward's saves depend on, from its arguments: tensors by shape, dtype and device,
    anything else by value (its type if it cannot be hashed)."""
    def one(a):
        if isinstance(a, Tensor):
            return (a.shape, a.dtype, a.device)
        try:
            hash(a)
            return a
        except TypeError:
            return type(a)

    return (tuple(one(a) for a in args), tuple((k, one(v)) for k, v in sorted(kwargs.items())),
            torch.is_grad_enabled())


class ReplayMixin:
    """The forward boundaries of :class:`~leantrain.agoq.packer.Packer`: start and end a forward,
    follow a recorded :class:`Plan` or record one, and leave a plan when the forward departs from
    it (the attributes are the Packer's)."""

    def begin(self, plan: Plan | None = None, sig: tuple | None = None) -> None:
        """Start of a forward: clear the dedup table; replay ``plan``, or record one under ``sig``
        (None: neither), else refresh the storages of parameters and buffers.

        The module list is walked once (``named_modules`` recursion costs ~1 ms a forward on a
        1b model); each forward re-reads the modules' parameter and buffer dicts, so replaced
        tensors are seen."""
        self._dedup.clear()
        self._by_node.clear()
        self._slot_of.clear()
        self._objs = [None] * len(plan.slots) if plan is not None else []
        self._derive = frozenset(x for x in self.policy.derive.split(",") if x)
        self._bits = {}  # role -> bits this forward (the policy may have been changed between forwards)
        self._replay, self._i, self._sig = plan, 0, sig
        self._trace = [] if plan is None and sig is not None else None
        if self._trace is not None:
            self._trace_kept, self._trace_bytes = Counter(), defaultdict(int)
        if plan is None:
            self._refresh_static()

    def _refresh_static(self) -> None:
        if self._modules is None:
            self._modules = list(self.model.modules())
        self._static = {storage_ptr(t) for m in self._modules
                        for d in (m._parameters, m._buffers) for t in d.values() if t is not None}

    def end(self, ok: bool = True) -> None:
        """End of a forward: flush; count a replayed forward's kept slots, or store the recorded plan."""
        try:
            self.flush()
        finally:
            self._dedup.clear()
            self._by_node.clear()
            self._slot_of.clear()
            self._objs = []
            plan, trace = self._replay, self._trace
            self._replay = self._trace = None
            if plan is not None:
                whole = self._i == len(plan.slots)
                self._count_prefix(plan, self._i, whole)
                if not whole:  # fewer saves than recorded: a departure too
                    self.stats["replay:diverged"] += 1
                    self._plans.pop(self._sig, None)
            elif trace is not None and ok:
                if len(self._plans) >= self.max_plans:
                    self._plans.pop(next(iter(self._plans)))
                self._plans[self._sig] = Plan(trace, self._trace_kept, dict(self._trace_bytes))

    def _count_prefix(self, plan: Plan, n: int, whole: bool) -> None:
        """Add what the first ``n`` replayed slots kept to ``stats`` and the byte counts."""
        if whole:
            self.stats.update(plan.kept_stats)
            for role, nb in plan.kept_bytes.items():
                self.bytes_raw[role] += nb
                self.bytes_kept[role] += nb
            return
        self.stats["saved"] += n
        for _shape, _dtype, role, bits, _prob, why, nb in plan.slots[:n]:
            if not bits:
                self.stats["kept:" + why] += 1
                self.bytes_raw[role] += nb
                self.bytes_kept[role] += nb

    def _diverge(self) -> None:
        """The forward departed from its plan: count the replayed prefix, drop the plan, and take
        the full path with the base role ``other`` for the rest of the forward."""
        plan, self._replay = self._replay, None
        self._count_prefix(plan, self._i, whole=False)
        self.stats["replay:diverged"] += 1
        self._plans.pop(self._sig, None)
        self._roles.clear()
        self._base_role = "other"
        self._refresh_static()

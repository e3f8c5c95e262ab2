"""The memory ledger and the communication ledger.

Every comparison leantrain prints is made of these two ledgers' numbers, and
both are *measured*:

- :class:`MemoryLedger` counts the bytes of live tensors by role: model weights,
  gradients (``.grad`` and any registered gradient buffers), optimizer state
  (every tensor reachable from ``optimizer.state``, including packed 8-bit
  codes and their scales), and saved activations (every tensor autograd saves
  for backward during a forward pass, seen through
  ``torch.autograd.graph.saved_tensors_hooks`` or reported by a packer such as
  AGoQ's through :func:`note_saved`). On CUDA it also reads the allocator's peak.
  Storage shared by several tensors is counted once.
- :class:`CommLedger` counts the bytes each rank sends, per collective, at the
  call (see :mod:`leantrain.runtime.collectives`), split into ``intra`` and ``inter``
  node traffic.

Bytes sent per collective, for a group of ``n`` ranks and a tensor of ``B``
bytes handed to the call, are the bytes this rank puts on the wire under the
bandwidth-optimal algorithm (ring / direct exchange), the convention of NCCL's
"bus bandwidth": all-reduce ``2 (n-1)/n B``; reduce-scatter ``(n-1)/n B`` (B =
the full input); all-gather ``(n-1) B`` (B = this rank's shard); all-to-all the
bytes of the chunks addressed to other ranks; broadcast ``B`` on the source.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

# ---------------------------------------------------------------- helpers


def _storage_key(t: Tensor) -> tuple[str, int]:
    try:
        return (str(t.device), t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
        return (str(t.device), id(t))


def _storage_bytes(t: Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return t.numel() * t.element_size()


def tensors_in(obj) -> Iterator[Tensor]:
    """Every tensor reachable from ``obj`` (tensors, dicts, lists, dataclasses, objects with tensors)."""
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            yield from tensors_in(v)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            yield from tensors_in(getattr(obj, name))


def _local_shard(t: Tensor) -> Tensor:
    """This rank's shard of a ``DTensor`` (FSDP's parameters, gradients and optimizer state), else ``t``.
    (``torch.distributed.tensor`` costs most of a second to import: no DTensor exists before it is.)"""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return t.to_local() if dtensor is not None and isinstance(t, dtensor.DTensor) else t


def count_bytes(tensors: Iterable[Tensor], seen: set | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (each storage once; of a ``DTensor``, this rank's shard)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = _local_shard(t)
        key = _storage_key(t)
        if key in seen:
            continue
        seen.add(key)
        total += _storage_bytes(t)
    return total


# ---------------------------------------------------------------- activations

_local = threading.local()


def _meters() -> list[SavedActivationMeter]:
    if not hasattr(_local, "meters"):
        _local.meters = []
    return _local.meters


def metering() -> bool:
    """Whether a :class:`SavedActivationMeter` is open on this thread."""
    return bool(_meters())


def note_saved(nbytes: int, key: object | None = None, role: str = "other") -> None:
    """Report ``nbytes`` of saved-for-backward memory to every active meter.

    Packers that replace a saved tensor with a compressed form (AGoQ) call this
    with the packed size, so the ledger counts what is really held.
    ``key`` de-duplicates a tensor saved twice.
    """
    for m in _meters():
        m.add(nbytes, key, role)


class SavedActivationMeter:
    """Counts the bytes autograd saves for backward while the context is open.

    Use it around a forward pass (``with meter: loss = model(x)``). Tensors that
    share storage with a model parameter are not activations and are skipped.
    If a packer inside (AGoQ) takes the tensors first, it reports what it keeps
    through :func:`note_saved` instead.
    """

    def __init__(self, params: Iterable[Tensor] = ()):
        self._param_keys = {_storage_key(p) for p in params}
        self.bytes = 0
        self.count = 0
        self.by_role: dict[str, int] = defaultdict(int)
        self._seen: set = set()
        self._hooks = None

    def add(self, nbytes: int, key: object | None, role: str) -> None:
        if key is not None:
            if key in self._seen:
                return
            self._seen.add(key)
        self.bytes += int(nbytes)
        self.count += 1
        self.by_role[role] += int(nbytes)

    def _pack(self, t: Tensor):
        key = _storage_key(t)
        if key not in self._param_keys:
            note_saved(_storage_bytes(t), key, "raw")
        return t

    def __enter__(self) -> SavedActivationMeter:
        _meters().append(self)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        _meters().remove(self)


# ---------------------------------------------------------------- memory ledger


@dataclass
class MemoryLedger:
    """Bytes by role, counted from live tensors. All values are ints (bytes)."""

    weights: int = 0
    grads: int = 0
    optimizer_states: int = 0
    activations: int = 0
    peak_allocated: int | None = None  # CUDA allocator peak, when on CUDA
    extra: dict = field(default_factory=dict)

    @classmethod
    def measure(
        cls,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        activations: int = 0,
        grad_buffers: Iterable[Tensor] = (),
        extra_state: Iterable[Tensor] = (),
    ) -> MemoryLedger:
        params = list(model.parameters())
        seen: set = set()
        weights = count_bytes(params, seen)
        grads = count_bytes([p.grad for p in params if p.grad is not None], seen)
        grads += count_bytes(grad_buffers, seen)
        states = 0
        if optimizer is not None:
            states = count_bytes(tensors_in(list(optimizer.state.values())), seen)
            if hasattr(optimizer, "extra_state_tensors"):
                states += count_bytes(optimizer.extra_state_tensors(), seen)
        states += count_bytes(extra_state, seen)
        peak = None
        if torch.cuda.is_available() and any(p.is_cuda for p in params[:1]):
            peak = torch.cuda.max_memory_allocated()
        return cls(weights, grads, states, activations, peak)

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer_states + self.activations

    def as_dict(self) -> dict:
        return {
            "weights": self.weights,
            "grads": self.grads,
            "optimizer_states": self.optimizer_states,
            "activations": self.activations,
        }


# ---------------------------------------------------------------- communication ledger


class CommLedger:
    """Bytes this rank sent, per collective and per scope (``intra``/``inter``/``world``)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.steps = 0

    def record(self, op: str, nbytes: int, scope: str = "world") -> None:
        self.bytes[(op, scope)] += int(nbytes)
        self.calls[(op, scope)] += 1

    def step(self) -> None:
        """Mark the end of one optimizer step (for per-step averages)."""
        self.steps += 1

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    def by_scope(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for (_, scope), b in self.bytes.items():
            out[scope] += b
        return dict(out)

    def by_op(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for (op, _), b in self.bytes.items():
            out[op] += b
        return dict(out)

    def calls_by_op(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for (op, _), n in self.calls.items():
            out[op] += n
        return dict(out)

    def per_step(self) -> float:
        return self.total / max(self.steps, 1)

    def summary(self) -> dict:
        return {
            "total_bytes": self.total,
            "steps": self.steps,
            "bytes_per_step": self.per_step(),
            "by_scope": self.by_scope(),
            "by_op": self.by_op(),
            "calls_by_op": self.calls_by_op(),
        }

    @contextlib.contextmanager
    def capture(self) -> Iterator[CommLedger]:
        """A fresh ledger that receives every record made while the context is open."""
        sub = CommLedger()
        _comm_stack().append(sub)
        try:
            yield sub
        finally:
            _comm_stack().remove(sub)


#: the process-wide ledger; :mod:`leantrain.runtime.collectives` records into it
COMM = CommLedger()


_COMM_CAPTURES: list[CommLedger] = []  # process-wide: DDP hooks may run on autograd threads


def _comm_stack() -> list[CommLedger]:
    return _COMM_CAPTURES


def record_comm(op: str, nbytes: int, scope: str = "world") -> None:
    """Record bytes sent into the global ledger and every open ``capture()``."""
    COMM.record(op, nbytes, scope)
    for sub in _comm_stack():
        sub.record(op, nbytes, scope)


__all__ = [
    "MemoryLedger",
    "SavedActivationMeter",
    "CommLedger",
    "COMM",
    "record_comm",
    "note_saved",
    "count_bytes",
    "tensors_in",
]

"""The technique protocol: how FORGE, AGoQ, the compressed collectives, the sharded optimizer and
the fine-tuning methods plug into a run.

A technique is a class registered with :func:`register`. The trainer builds every registered
technique whose :meth:`Technique.wanted` says the config asks for it, lets each check the
combination, then calls the hooks below at fixed points of the run. It never names a
technique and never reads a technique's private state::

    @register
    class MyTechnique(Technique):
        name = "mine"
        owns_step = True                         # builds the optimizer (at most one technique does)

        @classmethod
        def wanted(cls, cfg): return cfg.mine.enabled

        def optimizer(self, run, rule): return MyOptimizer(run.model, rule)

Order of a run: ``wanted`` -> ``check`` (all techniques, before any work) -> ``__init__(run)``
(in registration order; a technique may offer ``run.all_reduce`` to those built after it) ->
``optimizer`` (the one that ``owns_step``) -> ``ddp_comm_hook`` (when the run wraps the model in
DDP) -> per step: ``before_forward``, ``after_micro_batch``, ``after_backward`` (or ``zo_step`` in their
place), ``step_metrics``; at the end: ``summary``;
checkpoints: ``state_dict`` / ``load_state_dict``, or a technique's own ``checkpointer`` (state
sharded across ranks); CUDA graphs: ``capture_hooks``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor, nn

from leantrain.config import Config


@dataclass
class Run:
    """What a technique sees of the run it joins."""

    cfg: Config
    model: nn.Module
    device: torch.device
    rank: int = 0
    world: int = 1
    log: Callable[..., None] = print
    # the parameter groups of the optimizer (weight-decay groups), as torch optimizers take them
    # (a technique that replaces the model's parameters, FSDP, rewrites them over its own)
    param_groups: list = field(default_factory=list)
    # a per-tensor gradient all-reduce ``f(tensor, group)`` offered by a communication technique
    # to those that reduce gradients themselves (None: torch.distributed's all_reduce)
    all_reduce: Callable[[Tensor, Any], Any] | None = None
    # a gradient compressor offered by a communication technique to the technique that shards the
    # gradients (the sharded optimizer's buckets; FSDP's reduce-scatter)
    compression: Any = None


class Checkpointer(Protocol):
    """How a technique that shards the model's weights and optimizer state across ranks saves and
    loads them (:meth:`Technique.checkpointer`). Every rank calls both. The checkpoint is the
    directory ``<out>/checkpoints/step_<N>/`` with a ``meta.json`` of the
    :mod:`leantrain.runtime.checkpoint` manifest, so finding, verifying and pruning checkpoints
    work as for the trainer's own."""

    format: str  # meta.json's "format" (a resume at another world size is allowed for a format that reshards)

    def save(self, out_dir: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer, extra_state: dict,
             meta: dict) -> Path:
        """Write step ``step``'s checkpoint of ``model`` and ``opt`` under ``out_dir`` with the run's other
        state (``extra_state``: scheduler, RNG, step, techniques') and ``meta`` in its ``meta.json``."""
        ...

    def load(self, path: Path, model: nn.Module, opt: torch.optim.Optimizer) -> dict:
        """Load ``model`` and ``opt`` from the checkpoint ``path``; returns the ``extra_state`` saved with them."""
        ...


class Technique:
    """One technique of a run. Every hook has a do-nothing default; override what applies.

    Class attributes:
    - ``name``: the technique's name in messages and recipe names.
    - ``owns_step``: it builds the optimizer (:meth:`optimizer`); two such techniques in one run are
      refused, unless all but one ``yields_step``.
    - ``yields_step``: it owns the step only when no other technique of the run does (FSDP: torch's
      optimizer over the shards, unless FORGE's updates in backward step them).
    - ``reduces_gradients``: it does the data-parallel gradient reduction itself (inside backward or
      in its step), so the run does not wrap the model in DDP.
    - ``zeroth_order``: it replaces forward + backward by its own :meth:`zo_step` (loss values only).
    - ``baseline_ok``: it also runs under ``--baseline`` (plain PyTorch): it lays the run out (FSDP2)
      without changing the math of torch's AdamW.
    """

    name: ClassVar[str] = ""
    owns_step: ClassVar[bool] = False
    yields_step: ClassVar[bool] = False
    reduces_gradients: ClassVar[bool] = False
    zeroth_order: ClassVar[bool] = False
    baseline_ok: ClassVar[bool] = False

    @classmethod
    def wanted(cls, cfg: Config) -> bool:
        """Whether ``cfg`` asks for this technique (every technique overrides it)."""
        return False

    @classmethod
    def check(cls, cfg: Config, *, device: torch.device, world: int) -> None:
        """Raise :class:`leantrain.config.ConfigError` (one sentence: what is wrong and which flag
        fixes it) for a combination this technique cannot run in. Called before anything is built."""

    def __init__(self, run: Run):
        self.run = run

    # ---------------------------------------------------------------- building
    def optimizer(self, run: Run, rule) -> torch.optim.Optimizer | None:
        """The run's optimizer, for a technique that ``owns_step``."""
        return None

    def ddp_comm_hook(self) -> tuple[Any, Callable] | None:
        """``(state, hook)`` for ``DistributedDataParallel.register_comm_hook``, or None."""
        return None

    # ---------------------------------------------------------------- each step
    def before_forward(self) -> None:
        """Before each micro-batch's forward (training forwards only)."""

    def after_micro_batch(self) -> None:
        """After each micro-batch's backward."""

    def after_backward(self) -> None:
        """After the last micro-batch's backward, before the optimizer step."""

    def zo_step(self, opt, losses: Callable[[], Tensor]) -> Tensor:
        """A zeroth-order step: ``losses()`` gives the per-example losses of this step's batch at
        the current (perturbed) weights; returns the step's loss. Only for ``zeroth_order``."""
        raise TypeError(f"{type(self).__name__} is not a zeroth-order technique")

    def step_metrics(self, opt) -> dict[str, Any]:
        """Values to log for the step just taken. One-element device tensors are read when the row is
        written, up to ``train.log_every`` steps later: return a fresh tensor, never a buffer that a
        later step overwrites."""
        return {}

    def summary(self, opt) -> dict[str, Any]:
        """The technique's own figures for the run's ``summary.json`` (after the last step)."""
        return {}

    def grad_buffers(self) -> list[Tensor]:
        """Gradient buffers the technique holds (the memory ledger counts them as gradients)."""
        return []

    def clips_gradients(self) -> bool:
        """True when the technique clips gradients itself (the trainer then does not clip)."""
        return False

    # ---------------------------------------------------------------- checkpoints, capture
    def state_dict(self) -> dict:
        """State to checkpoint beside the optimizer's (per rank)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def checkpointer(self) -> Checkpointer | None:
        """The run's checkpointer, for a technique whose weights or optimizer state live sharded
        across ranks (None: the trainer saves ``model.state_dict()`` and each rank's optimizer state)."""
        return None

    def capture_hooks(self, opt) -> list:
        """:class:`leantrain.runtime.capture.CaptureHooks` of work the technique runs inside the step."""
        return []

    @classmethod
    def tag(cls, cfg: Config) -> str:
        """This technique's part of the run's recipe name ("" for none)."""
        return cls.name


_REGISTRY: dict[str, type[Technique]] = {}


def register(cls: type[Technique]) -> type[Technique]:
    """Class decorator: add ``cls`` to the registry (in order: earlier techniques are built first)."""
    if not cls.name:
        raise ValueError(f"{cls.__name__}: a registered technique needs a name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"a technique named {cls.name!r} is registered already ({_REGISTRY[cls.name].__name__})")
    _REGISTRY[cls.name] = cls
    return cls


def registered() -> dict[str, type[Technique]]:
    """Every registered technique class by name, in registration order."""
    return dict(_REGISTRY)


__all__ = ["Checkpointer", "Run", "Technique", "register", "registered"]

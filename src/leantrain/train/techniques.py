"""The built-in techniques: importing their modules registers them (:func:`leantrain.technique.register`),
in this order (a technique built earlier may offer something to one built later)."""

from __future__ import annotations

import importlib

import torch

from leantrain.config import Config, ConfigError
from leantrain.technique import Run, Technique, registered

BUILTIN = (
    "leantrain.forge.technique",
    "leantrain.agoq.technique",
    "leantrain.parallel.technique",
    "leantrain.parallel.fsdp",
    "leantrain.comm.technique",
    "leantrain.finetune.technique",
)


def load_builtin() -> None:
    for name in BUILTIN:
        importlib.import_module(name)


def wanted(cfg: Config) -> list[type[Technique]]:
    """The registered techniques ``cfg`` asks for: the built-in ones in ``BUILTIN``'s order, whatever
    order their modules were first imported in, then the others in registration order."""
    load_builtin()
    rank = {name: i for i, name in enumerate(BUILTIN)}
    ordered = sorted(registered().values(), key=lambda cls: rank.get(cls.__module__, len(BUILTIN)))  # (stable)
    return [cls for cls in ordered if cls.wanted(cfg)]


def check(classes: list[type[Technique]], cfg: Config, *, device, world: int) -> None:
    """Each technique's own checks (their messages name what works instead), then the rules of
    composition: one owner of the step."""
    for cls in classes:
        cls.check(cfg, device=device, world=world)
    step_owner(classes)


def step_owner(classes: list[type[Technique]]) -> type[Technique] | None:
    """The technique class that builds the run's optimizer: the one that ``owns_step`` (one that
    ``yields_step`` only when no other does); raises :class:`ConfigError` for two."""
    owners = [c for c in classes if c.owns_step]
    owners = [c for c in owners if not c.yields_step] or owners
    if len(owners) > 1:
        raise ConfigError(f"{' and '.join(c.name for c in owners)} both own the optimizer step; choose one")
    return owners[0] if owners else None


def validate(cfg: Config, *, device=None, world: int = 1) -> None:
    """Every check a run of ``cfg`` makes before it builds anything (``leantrain config`` and tests)."""
    check(wanted(cfg), cfg, device=device or torch.device("cpu"), world=world)


def build(classes: list[type[Technique]], run: Run) -> list[Technique]:
    return [cls(run) for cls in classes]

"""The model's public extension points for techniques.

- :class:`GradSink`: a module's weight gradient handed to a technique inside backward instead of
  accumulated into ``.grad``. :class:`leantrain.model.LMHead` has a ``grad_sink`` attribute; its
  fused loss computes the head's gradient slice by slice straight into the sink's buffer.
- :func:`claim` / :func:`owner_of` / :func:`release`: a technique that takes over a module's
  forward or backward (its linear function) says so, so that a second technique trying to take
  the same module gets one clear sentence instead of a silent double patch.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Protocol

from torch import Tensor, nn

Fill = Callable[[Tensor | None, Tensor | None], None]
"""``fill(weight_grad, bias_grad)``: writes the gradient into the fp32 buffers it is given (None:
that one is not wanted)."""


class GradSink(Protocol):
    """Takes a module's weight (and bias) gradient in backward.

    ``take(inputs, fill)``: ``inputs`` is what the module saw in forward (the rows the gradient
    sums over); the sink allocates its buffers, calls ``fill`` once to have the gradient written
    into them, and consumes it (e.g. applies an optimizer step). Nothing is returned to autograd:
    the weight's ``.grad`` stays None."""

    def take(self, inputs: Tensor, fill: Fill) -> None: ...


_OWNERS: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


def claim(module: nn.Module, owner: str, name: str = "") -> None:
    """Record that ``owner`` (a technique's name) has taken over ``module``; a module already taken
    by another owner is refused with a ValueError naming both."""
    held = _OWNERS.get(module)
    if held is not None and held != owner:
        what = f"module {name}" if name else f"a {type(module).__name__}"
        raise ValueError(f"{owner}: {what} is already taken over by {held}; detach {held} first")
    _OWNERS[module] = owner


def release(module: nn.Module, owner: str) -> None:
    """Undo :func:`claim` (no-op when ``owner`` does not hold ``module``)."""
    if _OWNERS.get(module) == owner:
        del _OWNERS[module]


def owner_of(module: nn.Module) -> str | None:
    """The technique that has taken over ``module``, or None."""
    return _OWNERS.get(module)

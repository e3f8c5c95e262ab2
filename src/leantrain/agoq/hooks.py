"""Turning AGoQ on for a model: :func:`quantize_activations` (a context, one forward) and
:func:`apply` / :func:`remove` (persistent: hooks on ``model.forward``), :func:`packer_of`
(the :class:`~leantrain.agoq.packer.Packer` applied to a model), and :func:`save` /
:func:`load` for tensors an ``autograd.Function`` keeps on ``ctx`` as attributes.

``torch.autograd.graph.saved_tensors_hooks(pack, unpack)`` sees every tensor saved by a
built-in op *and* by ``ctx.save_for_backward`` in a custom ``autograd.Function`` (FORGE's
linear, ChunkFT's functions); what happens to each is :mod:`leantrain.agoq.packer`'s.
"""

from __future__ import annotations

import contextlib
import weakref

from torch import Tensor, nn

from leantrain.agoq.packer import Packer, active_packers
from leantrain.agoq.policy import Policy
from leantrain.agoq.roles import role_of_module
from leantrain.agoq.saved import Derived, ProbPacked, unpack_saved

__all__ = ["Packer", "Derived", "ProbPacked", "quantize_activations", "apply", "remove", "packer_of", "save", "load",
           "role_of_module"]

@contextlib.contextmanager
def quantize_activations(model: nn.Module, policy: Policy | None = None, *, stage: int = 0,
                         record: bool = False):
    """Within the context, every activation ``model``'s forward saves is packed by ``policy``.

    Yields the :class:`Packer` (its ``stats`` count every saved tensor and its fate).
    The backward may run after the context closes. (No replay: a packer per forward.)
    """
    pk = Packer(model, policy, stage=stage, record=record)
    pk.install()
    try:
        with pk:
            yield pk
    finally:
        pk.remove()


# the Packer apply() attached to each model (weak: a model that is dropped takes its entry along)
_APPLIED: weakref.WeakKeyDictionary[nn.Module, Packer] = weakref.WeakKeyDictionary()


def apply(model: nn.Module, policy: Policy | None = None, *, stage: int = 0, replay: bool = True,
          salt: int | None = None) -> Packer:
    """Persistent AGoQ: every forward of ``model`` packs what it saves; returns the
    :class:`~leantrain.agoq.packer.Packer` (its ``stats``, ``summary()``). Undo with :func:`remove`.

    The hooks open at the start of ``model.forward`` and close at its end, so a loss computed
    outside the model's forward is not packed (leantrain's Llama computes it inside). The
    model's own role (``logits``: the loss) is the base role. ``replay``: forwards with a
    signature seen before follow its recorded plan without the role hooks
    (:mod:`leantrain.agoq.replay`). ``salt``: the rounding noise's (:class:`Packer`). Applying an equal policy at the same stage and replay
    setting again returns the packer already attached (its plans and counts kept); anything
    else replaces it.
    """
    policy = policy or Policy()
    current = _APPLIED.get(model)
    if current is not None and current.policy == policy and current.stage == stage and current.replay == replay:
        return current
    remove(model)
    pk = Packer(model, policy, stage=stage, salt=salt)
    pk.attach(replay=replay)
    _APPLIED[model] = pk
    return pk


def packer_of(model: nn.Module) -> Packer | None:
    """The :class:`~leantrain.agoq.packer.Packer` :func:`apply` attached to ``model``, or None."""
    return _APPLIED.get(model)


def remove(model: nn.Module) -> None:
    """Undo :func:`apply` (no-op when AGoQ is not applied)."""
    pk = _APPLIED.pop(model, None)
    if pk is not None:
        pk.detach()


def save(t: Tensor):
    """Pack ``t`` through the active AGoQ packer (for tensors kept on ``ctx`` as attributes)."""
    st = active_packers()
    return st[-1].pack_hook(t, explicit=True) if st else t


def load(obj) -> Tensor:
    """The tensor :func:`save` packed (identity for a tensor that was not packed)."""
    return unpack_saved(obj)

"""AGoQ: layer-aware ~4-bit saved activations and 8-bit gradients.

    import leantrain as lt
    policy = lt.agoq.Policy()                      # bits per role, group 128, stochastic rounding
    with lt.agoq.quantize_activations(model, policy):
        loss = model(idx, targets)
    loss.backward()

    lt.agoq.apply(model, policy)                   # persistent; lt.agoq.remove(model) undoes it
    acc = lt.agoq.Int8GradAccumulator(model.parameters())   # int8 grad accumulation buffers

The 8-bit all-reduce lives in :mod:`leantrain.comm.int8_allreduce`. See docs/agoq.md.
"""

from leantrain.agoq.calibrate import calibrate, gradient_error
from leantrain.agoq.grad import Int8GradAccumulator
from leantrain.agoq.hooks import (
    Packer,
    apply,
    load,
    packer_of,
    quantize_activations,
    remove,
    role_of_module,
    save,
)
from leantrain.agoq.pack import Packed, pack, unpack
from leantrain.agoq.policy import ALLOWED_BITS, ROLES, Policy

__all__ = [
    "Policy",
    "ROLES",
    "ALLOWED_BITS",
    "quantize_activations",
    "apply",
    "remove",
    "save",
    "load",
    "packer_of",
    "Packer",
    "role_of_module",
    "pack",
    "unpack",
    "Packed",
    "calibrate",
    "gradient_error",
    "Int8GradAccumulator",
]

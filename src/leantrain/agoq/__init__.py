"""AGoQ: layer-aware ~4-bit saved activations and 8-bit gradients.

    import leantrain as lt
    policy = lt.agoq.Policy()                      # bits per role, group 128, stochastic rounding
    with lt.agoq.quantize_activations(model, policy):
        loss = model(idx, targets)
    loss.backward()

    lt.agoq.apply(model, policy)                   # persistent; lt.agoq.remove(model) undoes it
    acc = lt.agoq.Int8GradAccumulator(model.parameters())   # int8 grad accumulation buffers

The 8-bit all-reduce lives in :mod:`leantrain.comm.int8_allreduce`. See ``README.md`` here.
"""

from .calibrate import calibrate, gradient_error
from .grad import Int8GradAccumulator
from .hooks import Packer, apply, load, quantize_activations, remove, role_of_module, save
from .pack import Packed, pack, unpack
from .policy import ALLOWED_BITS, ROLES, Policy

__all__ = [
    "Policy",
    "ROLES",
    "ALLOWED_BITS",
    "quantize_activations",
    "apply",
    "remove",
    "save",
    "load",
    "Packer",
    "role_of_module",
    "pack",
    "unpack",
    "Packed",
    "calibrate",
    "gradient_error",
    "Int8GradAccumulator",
]

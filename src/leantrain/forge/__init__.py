"""FORGE: the optimizer step fused into the weight-gradient computation of every linear layer.

    opt = lt.forge.attach(model, lt.optim.AdamW(lr=3e-4), state_dtype="int8")
    loss.backward()              # every nn.Linear weight is updated inside backward
    opt.step(); opt.zero_grad()  # the other parameters; closes the step

See ``docs/forge.md`` for the exactness statement and the limits.
"""

from leantrain.forge.attach import attach, detach
from leantrain.forge.optimizer import CLIPS, ForgeOptimizer

__all__ = ["attach", "detach", "ForgeOptimizer", "CLIPS"]

"""The reference optimizer: any :mod:`leantrain.optim.rules` rule as a ``torch.optim.Optimizer``.

This is the ordinary, unfused path: gradients are materialized in ``.grad`` by
backward, and ``step()`` applies the rule parameter by parameter in fp32. It is
the yardstick FORGE, the sharded optimizer and the compressed collectives are
tested against.

Parameters may be fp32 or bf16. For bf16 parameters the update is computed in
fp32 and written back either with round-to-nearest or, with
``stochastic_rounding=True``, with unbiased stochastic rounding.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from .rules import Rule
from .state import StateStorage


class Optimizer(torch.optim.Optimizer):
    """``lt.optim.Optimizer(params, rule)``: a drop-in ``torch.optim.Optimizer``.

    Args:
        params: parameters or parameter groups, as for any torch optimizer.
        rule: the element-wise rule (``lt.optim.AdamW(...)`` etc.); its fields are
            the defaults of every param group.
        stochastic_rounding: round bf16/fp16 parameters stochastically after the
            fp32 update (unbiased); otherwise round to nearest.
        seed: seed of the stochastic-rounding stream (reproducible runs).
        state_dtype: how optimizer state is kept between steps: ``"fp32"``, ``"bf16"`` or
            ``"int8"`` (8-bit block-quantized, see :mod:`leantrain.optim.state`).
    """

    def __init__(self, params: Iterable, rule: Rule, *, stochastic_rounding: bool = False, seed: int = 0,
                 state_dtype: str = "fp32"):
        if not isinstance(rule, Rule):
            raise TypeError(f"rule must be a leantrain.optim rule (e.g. lt.optim.AdamW(...)), got {type(rule).__name__}")
        self.rule = rule
        self.stochastic_rounding = stochastic_rounding
        self.seed = seed
        self.storage = StateStorage(state_dtype)
        super().__init__(params, rule.hyper())

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            hp = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("leantrain optimizers do not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state.update(self.storage.init(self.rule, p))
                state["step"] += 1
                signed = self.rule.signed_states
                tensors = {k: self.storage.read(state, k, k in signed, p.shape) for k in self.rule.state_names}
                p_new, new_state = self.rule.update(p, p.grad, tensors, step=state["step"], **hp)
                for k, v in new_state.items():
                    self.storage.write(state, k, v, k in signed)
                write_param(p, p_new, stochastic=self.stochastic_rounding, seed=self.seed + state["step"])
        return loss


def write_param(p: Tensor, value: Tensor, *, stochastic: bool, seed: int) -> None:
    """Store the fp32 ``value`` into ``p`` (any float dtype), rounding as asked."""
    if p.dtype == torch.float32 or not stochastic:
        p.copy_(value)
        return
    if p.dtype != torch.bfloat16:
        raise TypeError(f"stochastic rounding is implemented for bf16 parameters, got {p.dtype}")
    from leantrain.ops import bf16_stochastic_round

    p.copy_(bf16_stochastic_round(value.contiguous(), seed=seed))

"""The reference optimizer: any :mod:`leantrain.optim.rules` rule as a ``torch.optim.Optimizer``.

This is the ordinary, unfused path: gradients are materialized in ``.grad`` by
backward, and ``step()`` applies the rule parameter by parameter in fp32. It is
the yardstick FORGE, the sharded optimizer and the compressed collectives are
tested against.

Parameters may be fp32 or bf16. For bf16 parameters the update is computed in
fp32 and written back either with round-to-nearest or, with
``stochastic_rounding=True``, with unbiased stochastic rounding.

``backend="triton"`` (or ``"auto"`` on a CUDA device) steps each 1-D / 2-D parameter with fp32
or bf16 states in one launch of FORGE's update-only kernel instead of ~15 torch ops: the same
rule in fp32 registers (within 1e-6 relative of the reference in fp32, tested), far less host
time a step. Stochastic rounding then draws from the kernel's counter hash, not from
``bf16_stochastic_round``'s stream: unbiased either way, not the same bits.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from ..ops._backend import resolve
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
        state_dtype: how optimizer state is kept between steps: ``"fp32"``, ``"bf16"``,
            ``"int8"`` or ``"int8p"`` (8-bit block-quantized, see :mod:`leantrain.optim.state`).
        backend: ``"torch"`` (the rule op by op, any device: the reference), ``"triton"``
            (FORGE's update-only kernel for each parameter it takes: 1-D or 2-D, fp32 or bf16,
            fp32 or bf16 states; the others op by op) or ``"auto"`` (triton for CUDA parameters
            when Triton is installed).
    """

    def __init__(self, params: Iterable, rule: Rule, *, stochastic_rounding: bool = False, seed: int = 0,
                 state_dtype: str = "fp32", backend: str = "torch"):
        if not isinstance(rule, Rule):
            raise TypeError(f"rule must be a leantrain.optim rule (e.g. lt.optim.AdamW(...)), got {type(rule).__name__}")
        if backend not in ("torch", "triton", "auto"):
            raise ValueError(f"backend must be 'torch', 'triton' or 'auto', got {backend!r}")
        self.rule = rule
        self.stochastic_rounding = stochastic_rounding
        self.seed = seed
        self.backend = backend
        self.storage = StateStorage(state_dtype)
        self._index: dict[Tensor, int] = {}  # parameter -> its position (the kernel's rounding seed)
        self._backends: dict[bool, str] = {}  # p.is_cuda -> the resolved backend
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
                if self._on_kernel(p, state):
                    self._step_kernel(p, state, hp)
                    continue
                signed = self.rule.signed_states
                tensors = {k: self.storage.read(state, k, k in signed, p.shape) for k in self.rule.state_names}
                p_new, new_state = self.rule.update(p, p.grad, tensors, step=state["step"], **hp)
                for k, v in new_state.items():
                    self.storage.write(state, k, v, k in signed)
                write_param(p, p_new, stochastic=self.stochastic_rounding, seed=self.seed + state["step"])
        return loss

    def _on_kernel(self, p: Tensor, state: dict) -> bool:
        if self.backend == "torch":
            return False
        backend = self._backends.get(p.is_cuda)
        if backend is None:  # (errors as the ops' backends say them: no Triton, a CPU tensor without the interpreter)
            backend = resolve(self.backend, p)
            if backend == "triton":
                from leantrain.forge.kernel import RULE_IDS

                if self.rule.name not in RULE_IDS:  # (a rule the kernel does not have: op by op)
                    backend = "torch"
            self._backends[p.is_cuda] = backend
        floats = (torch.float32, torch.bfloat16)
        return (backend == "triton" and p.dim() in (1, 2) and p.dtype in floats and p.grad.dtype in floats
                and all(state[k].dtype in floats for k in self.rule.state_names))

    def _step_kernel(self, p: Tensor, state: dict, hp: dict) -> None:
        """One launch of FORGE's update-only kernel: reads W, the gradient (fp32 or bf16, as
        stored) and the states, applies the rule in fp32, stores W (stochastic rounding for bf16 W when asked)
        and the states."""
        from leantrain.forge import kernel as K
        from leantrain.ops.rng import kernel_key, step_seed

        as2d = (lambda t: t) if p.dim() == 2 else (lambda t: t.view(1, -1))
        names = self.rule.state_names
        step = state["step"]
        g = p.grad  # fp32 or bf16: the kernel reads either in fp32
        index = self._index.get(p)
        if index is None:  # (a param group added since)
            self._index = {q: i for i, q in enumerate(q for group in self.param_groups for q in group["params"])}
            index = self._index[p]
        key = kernel_key(step_seed(self.seed, index, step))
        K.launch_forge(K.MODE_UPDATE, w=as2d(p.data), states=[as2d(state[k]) for k in names],
                       kinds=[StateStorage.kind_of(state, k) for k in names], qtables=[None] * len(names),
                       rule_name=self.rule.name, hp=hp, step=step,
                       sr=self.stochastic_rounding and p.dtype == torch.bfloat16, key=key, g=as2d(g.contiguous()))



def write_param(p: Tensor, value: Tensor, *, stochastic: bool, seed: int) -> None:
    """Store the fp32 ``value`` into ``p`` (any float dtype), rounding as asked."""
    if p.dtype == torch.float32 or not stochastic:
        p.copy_(value)
        return
    if p.dtype != torch.bfloat16:
        raise TypeError(f"stochastic rounding is implemented for bf16 parameters, got {p.dtype}")
    from leantrain.ops import bf16_stochastic_round

    p.copy_(bf16_stochastic_round(value.contiguous(), seed=seed))

"""The reference optimizer: any :mod:`leantrain.optim.rules` rule as a ``torch.optim.Optimizer``.

This is the ordinary, unfused path: gradients are materialized in ``.grad`` by
backward, and ``step()`` applies the rule parameter by parameter in fp32. It is
the yardstick FORGE, the sharded optimizer and the compressed collectives are
tested against.

Parameters may be fp32 or bf16. For bf16 parameters the update is computed in
fp32 and written back either with round-to-nearest or, with
``stochastic_rounding=True``, with unbiased stochastic rounding.

``backend="triton"`` (or ``"auto"`` on a CUDA device) steps each 1-D / 2-D parameter with fp32
or bf16 states in one launch of the update kernel (:mod:`leantrain.ops.update`, which FORGE
shares) instead of ~15 torch ops: the same
rule in fp32 registers (within 1e-6 relative of the reference in fp32, tested), far less host
time a step. Stochastic rounding then draws from the kernel's counter hash, not from
``bf16_stochastic_round``'s stream: unbiased either way, not the same bits. The small 1-D ones
(norm weights and biases: ``update_launch.bucket_ok``) that share a dtype, state kinds, param group and
step count go in one launch over their concatenation (``update_launch.update_many``), with the bits of
one launch each; a non-finite gradient there reaches the weights as in the reference (one
launch a parameter leaves a non-finite tile alone).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from leantrain.ops._backend import resolve
from leantrain.optim.rules import Rule
from leantrain.optim.state import StateStorage


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
            ``"int8"``, ``"int8p"`` or ``"fp8"`` (8-bit block-quantized, see :mod:`leantrain.optim.state`).
        backend: ``"torch"`` (the rule op by op, any device: the reference), ``"triton"``
            (the update kernel of :mod:`leantrain.ops.update` for each parameter it takes: 1-D or 2-D, fp32 or bf16,
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
        self.buckets = True  # small 1-D parameters of a kind in one kernel launch (False: one launch each)
        self._ones: dict = {}  # (count, device) -> the unit scales of a bucket
        self._kernel = None  # leantrain.ops.update_launch, once a parameter resolves to the Triton backend
        super().__init__(params, rule.hyper())

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            hp = {k: v for k, v in group.items() if k != "params"}
            buckets = None  # the small 1-D parameters stepped together (Buckets, update_many)
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
                    bkey = self._bucket_key(p, state)
                    if bkey is None:
                        self._step_kernel(p, state, hp)
                    else:
                        if buckets is None:
                            buckets = self._kernel.Buckets()
                        buckets.add(bkey, p, p.numel())
                    continue
                signed = self.rule.signed_states
                tensors = {k: self.storage.read(state, k, k in signed, p.shape) for k in self.rule.state_names}
                p_new, new_state = self.rule.update(p, p.grad, tensors, step=state["step"], **hp)
                for k, v in new_state.items():
                    self.storage.write(state, k, v, k in signed)
                write_param(p, p_new, stochastic=self.stochastic_rounding, seed=self.seed + state["step"])
            for ps in buckets or ():
                if len(ps) == 1:
                    self._step_kernel(ps[0], self.state[ps[0]], hp)
                else:
                    self._step_bucket(ps, hp)
        return loss

    def _on_kernel(self, p: Tensor, state: dict) -> bool:
        if self.backend == "torch":
            return False
        backend = self._backends.get(p.is_cuda)
        if backend is None:  # (errors as the ops' backends say them: no Triton, a CPU tensor without the interpreter)
            backend = resolve(self.backend, p)
            if backend == "triton":
                from leantrain.ops import update_launch

                self._kernel = update_launch  # (imported here, once: it imports Triton)
                if self.rule.name not in update_launch.RULE_IDS:  # (a rule the kernel does not have: op by op)
                    backend = "torch"
            self._backends[p.is_cuda] = backend
        floats = (torch.float32, torch.bfloat16)
        return (backend == "triton" and p.dim() in (1, 2) and p.dtype in floats and p.grad.dtype in floats
                and all(state[k].dtype in floats for k in self.rule.state_names))

    def _bucket_key(self, p: Tensor, state: dict) -> tuple | None:
        """What a parameter on the kernel shares with those stepped in the same launch (None: its
        own launch)."""
        kinds = tuple(StateStorage.kind_of(state, k) for k in self.rule.state_names)
        if not self.buckets or not self._kernel.bucket_ok(p, kinds):
            return None
        return p.device, p.dtype, p.grad.dtype, kinds, state["step"]

    def _step_bucket(self, ps: list[Tensor], hp: dict) -> None:
        """Several small 1-D parameters in one launch of the update-only kernel (``update_many``)."""
        K = self._kernel
        names = self.rule.state_names
        dev = ps[0].device
        step = self.state[ps[0]]["step"]
        sr = self.stochastic_rounding and ps[0].dtype == torch.bfloat16
        keys = K.device_keys(self.seed, [self._param_index(p) for p in ps], step, dev) if sr else None
        ones = self._ones.get((len(ps), dev))
        if ones is None:
            ones = self._ones[(len(ps), dev)] = torch.ones(len(ps), device=dev)
        K.update_many([p.data for p in ps], [p.grad for p in ps], [[self.state[p][k] for p in ps] for k in names],
                      [StateStorage.kind_of(self.state[ps[0]], k) for k in names], [None] * len(names),
                      rule_name=self.rule.name, hp=hp, step=step, sr=sr, keys=keys, scale=ones)

    def _param_index(self, p: Tensor) -> int:
        index = self._index.get(p)
        if index is None:  # (a param group added since)
            self._index = {q: i for i, q in enumerate(q for group in self.param_groups for q in group["params"])}
            index = self._index[p]
        return index

    def _step_kernel(self, p: Tensor, state: dict, hp: dict) -> None:
        """One launch of the update kernel: reads W, the gradient (fp32 or bf16, as
        stored) and the states, applies the rule in fp32, stores W (stochastic rounding for bf16 W when asked)
        and the states."""
        from leantrain.ops.rng import kernel_key, step_seed

        as2d = (lambda t: t) if p.dim() == 2 else (lambda t: t.view(1, -1))
        names = self.rule.state_names
        step = state["step"]
        g = p.grad  # fp32 or bf16: the kernel reads either in fp32
        key = kernel_key(step_seed(self.seed, self._param_index(p), step))
        self._kernel.launch_update(w=as2d(p.data), states=[as2d(state[k]) for k in names],
                                   kinds=[StateStorage.kind_of(state, k) for k in names],
                                   qtables=[None] * len(names),
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

"""Element-wise optimizer rules.

A rule is a pure function of (param, grad, state, hyper-parameters, step) ->
(new param, new state), written once in fp32 torch ops. The reference
:class:`leantrain.optim.Optimizer`, FORGE's torch backend and (transcribed)
FORGE's Triton epilogue all use these definitions, so "the same update" means
the same formula everywhere.

Every rule is a small dataclass holding its default hyper-parameters. The
optimizers copy them into ``param_groups`` so that ``torch.optim.lr_scheduler``
and per-group overrides work; ``update`` therefore receives the hyper-parameters
of the parameter's group as keyword arguments, never from ``self``.

Formulas (g = gradient, p = parameter, t = step count starting at 1,
eta = lr, lambda = weight_decay):

- SGD:   b = mu b + g;  d = g + mu b (Nesterov) or b (plain) or g (mu = 0);
         p = (1 - eta lambda) p - eta d          (decoupled weight decay)
- AdamW: m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
         p = (1 - eta lambda) p - eta/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)
         (exactly torch.optim.AdamW's order of operations)
- Lion:  c = b1 m + (1-b1) g;  p = (1 - eta lambda) p - eta sign(c);
         m = b2 m + (1-b2) g
- AdamS: m' = b1 m + (1-b1) g;  v = b2 m^2 + (1-b2) g^2  (m = the *previous* moment);
         p = (1 - eta lambda) p - eta m' / (sqrt(v) + eps)
         (no second-moment state, no bias correction; arXiv 2505.16363)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
from torch import Tensor

State = dict[str, Tensor]


@dataclass
class Rule:
    """Base class: default hyper-parameters plus the element-wise update."""

    lr: float = 1e-3
    weight_decay: float = 0.0

    name: ClassVar[str] = "rule"
    #: names of the per-element state tensors (each shaped like the parameter)
    state_names: ClassVar[tuple[str, ...]] = ()
    #: state tensors that are signed (matters for 8-bit storage maps)
    signed_states: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        if not (self.lr >= 0.0 and math.isfinite(self.lr)):
            raise ValueError(f"{type(self).__name__}: lr must be a finite number >= 0, got {self.lr}")
        if self.weight_decay < 0.0:
            raise ValueError(f"{type(self).__name__}: weight_decay must be >= 0, got {self.weight_decay}")
        if hasattr(self, "betas"):  # AdamW, Lion, AdamS
            _check_betas(self)

    def hyper(self) -> dict:
        """Hyper-parameters as a dict, the ``defaults`` of a torch optimizer."""
        d = asdict(self)
        for k, v in d.items():
            if isinstance(v, list):
                d[k] = tuple(v)
        return d

    def init_state(self, p: Tensor) -> State:
        """Fresh fp32 state for parameter ``p`` (zeros, shaped like ``p``)."""
        return {k: torch.zeros(p.shape, dtype=torch.float32, device=p.device) for k in self.state_names}

    def update(self, p: Tensor, g: Tensor, state: State, *, step: int, **hp) -> tuple[Tensor, State]:
        """Return (new param, new state) in fp32. ``p``, ``g`` and ``state`` are not modified."""
        raise NotImplementedError  # abstract: every concrete rule overrides it

    @staticmethod
    def _decay(p: Tensor, lr: float, weight_decay: float) -> Tensor:
        return p * (1.0 - lr * weight_decay) if weight_decay != 0.0 else p


@dataclass
class SGD(Rule):
    momentum: float = 0.0
    nesterov: bool = False

    name: ClassVar[str] = "sgd"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.nesterov and self.momentum <= 0.0:
            raise ValueError("SGD: nesterov=True needs momentum > 0")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"SGD: momentum must be in [0, 1), got {self.momentum}")

    @property
    def state_names(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("momentum_buffer",) if self.momentum > 0.0 else ()

    @property
    def signed_states(self) -> tuple[str, ...]:  # type: ignore[override]
        return self.state_names

    def update(self, p, g, state, *, step, lr, weight_decay=0.0, momentum=0.0, nesterov=False, **_):
        g = g.float()
        new_state = {}
        if momentum > 0.0:
            buf = state["momentum_buffer"] * momentum + g
            new_state["momentum_buffer"] = buf
            d = g + momentum * buf if nesterov else buf
        else:
            d = g
        return self._decay(p.float(), lr, weight_decay) - lr * d, new_state


@dataclass
class AdamW(Rule):
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2

    name: ClassVar[str] = "adamw"
    state_names: ClassVar[tuple[str, ...]] = ("exp_avg", "exp_avg_sq")
    signed_states: ClassVar[tuple[str, ...]] = ("exp_avg",)

    def update(self, p, g, state, *, step, lr, betas, eps, weight_decay=0.0, **_):
        b1, b2 = betas
        g = g.float()
        m = torch.lerp(state["exp_avg"], g, 1.0 - b1)
        v = state["exp_avg_sq"] * b2 + (1.0 - b2) * g * g
        bc1 = 1.0 - b1**step
        bc2_sqrt = math.sqrt(1.0 - b2**step)
        denom = v.sqrt() / bc2_sqrt + eps
        p_new = self._decay(p.float(), lr, weight_decay) - (lr / bc1) * (m / denom)
        return p_new, {"exp_avg": m, "exp_avg_sq": v}


@dataclass
class Lion(Rule):
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.0

    name: ClassVar[str] = "lion"
    state_names: ClassVar[tuple[str, ...]] = ("exp_avg",)
    signed_states: ClassVar[tuple[str, ...]] = ("exp_avg",)

    def update(self, p, g, state, *, step, lr, betas, weight_decay=0.0, **_):
        b1, b2 = betas
        g = g.float()
        m = state["exp_avg"]
        c = b1 * m + (1.0 - b1) * g
        p_new = self._decay(p.float(), lr, weight_decay) - lr * torch.sign(c)
        return p_new, {"exp_avg": b2 * m + (1.0 - b2) * g}


@dataclass
class AdamS(Rule):
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0

    name: ClassVar[str] = "adams"
    state_names: ClassVar[tuple[str, ...]] = ("exp_avg",)
    signed_states: ClassVar[tuple[str, ...]] = ("exp_avg",)

    def update(self, p, g, state, *, step, lr, betas, eps, weight_decay=0.0, **_):
        b1, b2 = betas
        g = g.float()
        m_prev = state["exp_avg"]
        m = b1 * m_prev + (1.0 - b1) * g
        v = b2 * m_prev * m_prev + (1.0 - b2) * g * g
        p_new = self._decay(p.float(), lr, weight_decay) - lr * (m / (v.sqrt() + eps))
        return p_new, {"exp_avg": m}


RULES: dict[str, type[Rule]] = {cls.name: cls for cls in (SGD, AdamW, Lion, AdamS)}


def make_rule(name: str, **kwargs) -> Rule:
    """Build a rule by name (``sgd``, ``adamw``, ``lion``, ``adams``)."""
    try:
        cls = RULES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown optimizer rule {name!r}; choose one of {sorted(RULES)}") from None
    return cls(**kwargs)


def _check_betas(rule) -> None:
    b = tuple(rule.betas)
    if len(b) != 2 or not all(0.0 <= x < 1.0 for x in b):
        raise ValueError(f"{type(rule).__name__}: betas must be two numbers in [0, 1), got {rule.betas}")
    rule.betas = b


__all__ = ["Rule", "SGD", "AdamW", "Lion", "AdamS", "RULES", "make_rule", "State"]

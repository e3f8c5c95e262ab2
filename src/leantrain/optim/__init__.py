"""Optimizer rules and the reference optimizer (``lt.optim``)."""

from .optimizer import Optimizer, write_param
from .rules import RULES, SGD, AdamS, AdamW, Lion, Rule, make_rule
from .state import STATE_DTYPES, StateStorage

__all__ = ["Rule", "SGD", "AdamW", "Lion", "AdamS", "RULES", "make_rule", "Optimizer", "write_param", "StateStorage", "STATE_DTYPES"]

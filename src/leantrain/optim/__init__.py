"""Optimizer rules and the reference optimizer (``lt.optim``)."""

from leantrain.optim.optimizer import Optimizer, write_param
from leantrain.optim.rules import RULES, SGD, AdamS, AdamW, Lion, Rule, make_rule
from leantrain.optim.state import STATE_DTYPES, StateStorage

__all__ = ["Rule", "SGD", "AdamW", "Lion", "AdamS", "RULES", "make_rule", "Optimizer", "write_param", "StateStorage", "STATE_DTYPES"]

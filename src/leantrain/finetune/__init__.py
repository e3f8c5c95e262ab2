"""Fine-tuning: zeroth-order MeZO and GRZO (no backward pass, no optimizer state) on tasks the
project generates itself; ``leantrain finetune`` runs them (:mod:`leantrain.finetune.run`)."""

from . import tasks
from .zo import GRZO, MeZO

__all__ = ["MeZO", "GRZO", "tasks"]

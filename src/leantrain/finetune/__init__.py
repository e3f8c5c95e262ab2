"""Fine-tuning: zeroth-order MeZO and GRZO (no backward pass, no optimizer state) and ChunkFT
(back-propagation into one working set of the parameters at a time) on tasks the project
generates itself; ``leantrain finetune`` runs them (:mod:`leantrain.train.finetune`)."""

from leantrain.finetune import tasks
from leantrain.finetune.chunkft import ChunkFT
from leantrain.finetune.zo import GRZO, MeZO

__all__ = ["MeZO", "GRZO", "ChunkFT", "tasks"]

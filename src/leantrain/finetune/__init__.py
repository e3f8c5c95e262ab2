"""Fine-tuning: zeroth-order MeZO and GRZO (no backward pass, no optimizer state) and ChunkFT
(back-propagation into one working set of the parameters at a time); as techniques of a run
(:mod:`leantrain.finetune.technique`), ``leantrain finetune --method`` turns them on."""

from leantrain.finetune.chunkft import ChunkFT
from leantrain.finetune.zo import GRZO, MeZO

__all__ = ["MeZO", "GRZO", "ChunkFT"]

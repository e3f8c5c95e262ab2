"""The training loop (``trainer.py``) shared by ``leantrain train`` and ``leantrain finetune``,
and the reports it writes."""

from leantrain.train.trainer import NonFiniteLoss, Trainer

__all__ = ["NonFiniteLoss", "Trainer"]

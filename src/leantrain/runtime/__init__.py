"""What every run needs whatever its techniques: collectives that count their bytes, the memory and
communication ledgers, checkpoint files, DDP's counted all-reduce hook and CUDA-graph capture."""

from leantrain.runtime import capture, checkpoint, collectives, ddp_hooks, ledger  # noqa: E402,F401

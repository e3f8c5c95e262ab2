"""leantrain: memory- and communication-efficient training of Llama-style models.

    import leantrain as lt
    opt = lt.forge.attach(model, lt.optim.AdamW(lr=3e-4))

Submodules: ``config``, ``model``, ``data``, ``trainer``, ``ledger``,
``collectives``, ``ops``, ``optim``, ``forge``, ``agoq``, ``comm``, ``dist``, ``graphs``, ``finetune``.
Technique packages are imported on first attribute access, so ``import
leantrain`` stays cheap and a missing optional dependency (Triton) only matters
where it is used.
"""

import importlib

__version__ = "0.1.0"

_SUBMODULES = {
    "config", "model", "data", "trainer", "ledger", "collectives", "ops", "optim",
    "forge", "agoq", "comm", "dist", "cli", "graphs", "finetune",
}


def __getattr__(name):
    if name in _SUBMODULES:
        mod = importlib.import_module(f"{__name__}.{name}")
        globals()[name] = mod
        return mod
    raise AttributeError(f"module 'leantrain' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | _SUBMODULES)

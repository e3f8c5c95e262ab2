"""leantrain: memory- and communication-efficient training of Llama-style models.

    import leantrain as lt
    opt = lt.forge.attach(model, lt.optim.AdamW(lr=3e-4))

Subpackages: ``config``, ``model``, ``data``, ``runtime``, ``ops``, ``optim``, the techniques
``forge``, ``agoq``, ``comm``, ``parallel`` (``dist`` is its other name) and ``finetune``,
and ``train``.
Technique packages are imported on first attribute access, so ``import
leantrain`` stays cheap and a missing optional dependency (Triton) only matters
where it is used.
"""

import importlib

__version__ = "0.1.0"

_SUBMODULES = {
    "config", "model", "data", "runtime", "ops", "optim",
    "forge", "agoq", "comm", "parallel", "dist", "finetune", "train", "cli",
}
_ALIASES = {"dist": "parallel"}


def __getattr__(name):
    if name in _SUBMODULES:
        mod = importlib.import_module(f"{__name__}.{_ALIASES.get(name, name)}")
        globals()[name] = mod
        return mod
    raise AttributeError(f"module 'leantrain' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | _SUBMODULES)

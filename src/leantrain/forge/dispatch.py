"""Which kernel computes a layer's dW and update on the Triton backend: one rule, :func:`choose_path`.

Paths:

- ``"tiles"``: the fused tile kernel (:mod:`leantrain.forge.kernel`): dW is never materialized.
- ``"split"``: cuBLAS writes dW into one reused workspace, then the update-only kernel
  (:mod:`leantrain.ops.update`) applies the rule.
- ``"ws"``: the warp-specialized Gluon kernel (:mod:`leantrain.forge.ws`, sm_90): the GEMM of one
  tile beside the update of another on every SM; no dW anywhere.

``kernel="auto"`` (the default of ``attach``) picks by the layer's token count T with the
thresholds ``split_tokens`` and ``ws_tokens`` of ``attach``; with their defaults (measured on an
H200, docs/forge.md):

=====================  ==============  ====================================================
where                  path            why
=====================  ==============  ====================================================
CUDA, T < ws_tokens    ws              only when ``ws_tokens`` is set (default None: never):
                                       fastest on one isolated linear, not in the 1b step
CUDA, T >= split_tok.  split           default ``split_tokens`` = 1: every T; cuBLAS's dW +
                                       the update kernel beat the fused tiles at every
                                       1b shape and token count measured
CUDA, T < split_tok.   tiles           only when ``split_tokens`` is raised or None
CPU (interpreter)      tiles           no cuBLAS there to win
=====================  ==============  ====================================================

Whatever the choice, a layer whose dW must be seen whole first (data parallelism, ``clip``
``"layer"`` / ``"est_global"``, a ``fill`` caller, the torch backend) materializes it (``split``);
``ws`` also needs what :func:`ws_fits` checks, else ``split``, and takes no gradient accumulated
over the step's earlier micro-batches (the tiles add it in their epilogue, the split path to the
materialized dW: :mod:`leantrain.forge.accumulate`).
"""

from __future__ import annotations

from typing import Literal

KernelChoice = Literal["auto", "tiles", "split", "ws"]
KERNELS = ("auto", "tiles", "split", "ws")
SPLIT_TOKENS = 1  # default of attach(split_tokens=): always the split path on CUDA (measured faster)
WS_TOKENS = None  # default of attach(ws_tokens=): never the warp-specialized kernel in "auto"


def check_kernel(kernel: str, split_tokens, ws_tokens) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if ws_tokens is not None and (not isinstance(ws_tokens, int) or ws_tokens < 1):
        raise ValueError(f"ws_tokens must be a positive token count or None, got {ws_tokens!r}")
    if split_tokens is not None and (not isinstance(split_tokens, int) or split_tokens < 1):
        raise ValueError(f"split_tokens must be a positive token count or None, got {split_tokens!r}")


def choose_path(kernel: str, tokens: int, *, on_cuda: bool, must_materialize: bool, ws_ok: bool,
                split_tokens: int | None, ws_tokens: int | None) -> str:
    """``"tiles"``, ``"split"`` or ``"ws"`` for one layer update (the table of the module docstring).

    ``must_materialize``: dW must be seen whole (reduction, clipping by this step's norms, a
    ``fill`` caller, the torch backend); ``ws_ok``: the layer fits the warp-specialized kernel on
    this device (:func:`ws_fits` and ``ws.available``)."""
    if must_materialize:
        return "split"
    if kernel == "auto":
        if ws_ok and ws_tokens is not None and tokens < ws_tokens:
            return "ws"
        return "split" if on_cuda and split_tokens is not None and tokens >= split_tokens else "tiles"
    if kernel == "ws":
        return "ws" if ws_ok else "split"
    return kernel


def ws_fits(opt, layer, x2, fill) -> bool:
    """What the warp-specialized kernel needs of a layer besides its inputs (``ws.supported``):
    its tokens, a CUDA weight, no fused bias, fp32 states (with bf16 states the split path was
    faster on every linear of the 1b step; docs/forge.md), nothing that needs dW first (data
    parallelism, clipping by this step's norms, a ``fill`` caller)."""
    return (fill is None and x2 is not None and opt.dp_group is None and opt.clip in ("none", "prev_global")
            and layer.bias is None and layer.weight.is_cuda and opt.storage.dtype == "fp32")

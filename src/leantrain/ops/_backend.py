"""Backend selection shared by every op in ``leantrain.ops``.

``backend="auto"`` picks Triton when the tensor lives on CUDA and Triton imports, torch
otherwise. ``backend="triton"`` on a CPU tensor is allowed only under the Triton
interpreter (``TRITON_INTERPRET=1``, set before ``triton`` is first imported): that is how
the CPU test suite runs the kernels.

Every Triton launch goes through :func:`launch`, which turns off floating-point
contraction (``enable_fp_fusion=False``): the torch reference computes ``a * b + c`` as two
rounded operations, and a fused multiply-add on the GPU would break the bit-exactness of
round-to-nearest codes between the two backends.
"""

from __future__ import annotations

import os

import torch

try:  # Triton is an optional dependency (extra ``triton``).
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
except Exception:  # pragma: no cover - exercised on machines without Triton
    triton = None
    tl = None
    HAS_TRITON = False

BACKENDS = ("auto", "torch", "triton")


def interpreting() -> bool:
    """True when Triton kernels run through the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve(backend: str, *tensors: torch.Tensor) -> str:
    """Return ``"torch"`` or ``"triton"`` for ``backend`` and the tensors it will touch."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    on_cuda = all(t.is_cuda for t in tensors) if tensors else False
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if (on_cuda and HAS_TRITON) else "torch"
    if not HAS_TRITON:
        raise RuntimeError("backend='triton' needs the triton package: pip install 'leantrain[triton]'")
    if not on_cuda and not interpreting():
        raise RuntimeError(
            "backend='triton' on a CPU tensor needs the Triton interpreter: set TRITON_INTERPRET=1 "
            "before importing triton, or use backend='torch' / 'auto'"
        )
    return "triton"


def launch(kernel, grid, *args, **meta) -> None:
    """Launch ``kernel[grid](*args, **meta)`` with FMA contraction disabled (see module doc)."""
    kernel[grid](*args, enable_fp_fusion=False, **meta)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())

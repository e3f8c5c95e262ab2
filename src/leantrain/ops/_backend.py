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


_INTERPRETING: list = [None]


def interpreting() -> bool:
    """True when Triton kernels run through the CPU interpreter (``TRITON_INTERPRET``, which
    Triton reads once, at import: read once here too, it is asked on every launch)."""
    if _INTERPRETING[0] is None:
        _INTERPRETING[0] = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return _INTERPRETING[0]


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


_I32 = 1 << 31
_FAST: dict = {}  # specialization key -> (CompiledKernel, names of the constexpr arguments)
_DIRECT = [None]  # None: undecided; False: off (old Triton, interpreter, or a failed direct call)


def direct_launch_supported() -> bool:
    """Triton >= 3.3: a CompiledKernel's launcher takes every argument, constexprs included, in
    signature order, so a cached one can be called directly (here and in FORGE's launcher)."""
    try:
        major, minor = (int(v) for v in triton.__version__.split(".")[:2])
        return (major, minor) >= (3, 3)
    except Exception:  # noqa: BLE001
        return False


def _direct_ok() -> bool:
    if _DIRECT[0] is None:
        _DIRECT[0] = not interpreting() and direct_launch_supported()
    return _DIRECT[0]


def _spec(v):
    """What Triton specializes a runtime argument on (dtype and 16-byte alignment of tensors,
    ==1 / %16 / 32-bit range of integers); extra detail only costs cache entries."""
    if isinstance(v, torch.Tensor):
        return v.dtype, not v.data_ptr() & 15
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, int):
        return v == 1, not v & 15, -_I32 <= v < _I32
    return type(v)


def launch(kernel, grid, *args, **meta) -> None:
    """Launch ``kernel[grid](*args, **meta)`` with FMA contraction disabled (see module doc).

    On a GPU the CompiledKernel Triton returns is cached under the specialization of the
    arguments (see :func:`_spec`) and later calls with the same specialization call it
    directly: Triton's per-call argument binding and cache-key hashing cost tens of µs of host
    time, more than a small kernel runs (AGoQ packs hundreds of tensors per step). Any
    failure of a direct call turns the fast path off for good."""
    if _DIRECT[0] is False or (_DIRECT[0] is None and not _direct_ok()) or callable(grid):
        kernel[grid](*args, enable_fp_fusion=False, **meta)
        return
    key = (id(kernel), len(grid), torch.cuda.current_device(), tuple(meta.items()), *map(_spec, args))
    try:
        hit = _FAST.get(key)
    except TypeError:  # an unhashable constexpr: the plain launch
        kernel[grid](*args, enable_fp_fusion=False, **meta)
        return
    if hit is not None:
        ck, consts = hit
        try:
            ck[(*grid, 1, 1)[:3]](*args, *[meta[n] for n in consts])
            return
        except (TypeError, IndexError, KeyError):  # a launcher that takes other arguments: never again
            _DIRECT[0] = False
            _FAST.clear()
    ck = kernel[grid](*args, enable_fp_fusion=False, **meta)
    names = list(getattr(kernel, "arg_names", ()))
    consts = names[len(args):]
    if (_DIRECT[0] and ck is not None and hasattr(ck, "__getitem__") and all(n in meta for n in consts)
            and len(getattr(getattr(ck, "src", None), "signature", ())) == len(names)):
        _FAST[key] = (ck, tuple(consts))


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


_OUT_DTYPE_OK = [True]


def mm_fp32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, allow_upcast: bool) -> bool:
    """``out = a @ b`` with an fp32 result (bf16 inputs: fp32 accumulation, never rounded to bf16).

    Returns False when that needs an upcast copy and ``allow_upcast`` is off.
    """
    if a.dtype == torch.float32:
        torch.mm(a, b, out=out)
        return True
    if a.is_cuda and _OUT_DTYPE_OK[0]:
        try:
            torch.mm(a, b, out_dtype=torch.float32, out=out)
            return True
        except (TypeError, RuntimeError):
            _OUT_DTYPE_OK[0] = False
    if not allow_upcast:
        return False
    torch.mm(a.float(), b.float(), out=out)
    return True


_ADDMM_DTYPE_OK = [True]


def addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` for an fp32 ``acc`` (bf16 inputs: fp32 accumulation, the product never
    rounded to bf16). On CUDA one GEMM with beta = 1 (``addmm`` with ``out_dtype``); elsewhere,
    and where that overload is missing, an upcast product added in."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
        return
    if a.is_cuda and _ADDMM_DTYPE_OK[0]:
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            return
        except (TypeError, RuntimeError):
            _ADDMM_DTYPE_OK[0] = False
    acc.addmm_(a.float(), b.float())


def autocast_dtype(device_type: str):
    """The autocast dtype when autocast is on for ``device_type``, else None."""
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except (TypeError, AttributeError, RuntimeError):  # very old torch: no per-device query
        pass
    return None

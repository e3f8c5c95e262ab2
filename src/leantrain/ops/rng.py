"""The one counter-based random number generator of leantrain's stochastic rounding.

Math: a stateless hash of ``(seed, index)`` to 32 bits, evaluated identically by torch and
by Triton so stochastic rounding gives bit-identical results on both backends:

    k    = fmix32(lo32(seed) ^ fmix32(hi32(seed) ^ 0x5BD1E995))      (host, once per call)
    h    = fmix32(hi32(index) ^ k)                                     (0 below 2**32 elements)
    x    = fmix32((lo32(index) * 0x9E3779B9) ^ h)

``fmix32`` is MurmurHash3's finalizer (xor-shift / multiply, full avalanche). For a fixed
seed, ``index -> x`` is a bijection on each 2**32 block, so no two elements of one call get
the same draw. All arithmetic is modulo 2**32: native ``uint32`` in Triton, emulated in torch
on int64 with ``& 0xFFFFFFFF`` and 16-bit split multiplies (no signed overflow).

The uniforms of the integer quantizers come two per hash: element ``i`` takes the low
(``i`` even) or high (``i`` odd) 16 bits of ``x = hash(i >> 1)``:

    u    = (h16 + 1/2) * 2**-16        uniform on the 2**16 midpoints of [0, 1)

Stochastic rounding to integers is ``floor(y + (1 + u)) - 1`` (:mod:`leantrain.ops.quant`),
unbiased up to 2**-17 of a quantization step (the grid's own resolution). Kernels take ``1 + u``
straight from the bits (``0x3F800040 | h16 << 7`` is that float): no integer-to-float
conversion and no ``- 1.0``, which the rounding folds into its directed add. A kernel
quantizing a pair of neighbours computes one hash for both (:func:`uniform1_pair_tl`); on a
GPU (``FAST & HASH_IMAD``) the two floats are built by integer multiply-adds, which run beside the
logic unit that the hash keeps busy. bf16 stochastic rounding (:mod:`leantrain.ops.sr`) adds
``x >> 16`` to the dropped bits directly.

Tiling / bytes: a device helper, no memory traffic of its own.
"""

from __future__ import annotations

import torch
from torch import Tensor

from leantrain.ops._backend import HAS_TRITON

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9
_M1 = 0x85EBCA6B
_M2 = 0xC2B2AE35


def _fmix32_int(x: int) -> int:
    x &= MASK32
    x ^= x >> 16
    x = (x * _M1) & MASK32
    x ^= x >> 13
    x = (x * _M2) & MASK32
    x ^= x >> 16
    return x


def _mix64(s):
    """The 32-bit key of a 64-bit value: a Python int, or a numpy uint64 array (elementwise; every
    product in ``_fmix32_int`` stays below 2**64)."""
    return _fmix32_int((s & MASK32) ^ _fmix32_int((s >> 32) ^ 0x5BD1E995))


def seed_key(seed: int) -> int:
    """Mix a Python int seed (any size, taken mod 2**64) into the 32-bit kernel key."""
    return _mix64(int(seed) & 0xFFFFFFFFFFFFFFFF)


_SEED_MUL, _INDEX_MUL, _STEP_MUL, _MASK48 = 0x9E3779B1, 0x10001, 0x5BD1E995, 0xFFFFFFFFFFFF


def step_seed(seed: int, index: int, step: int) -> int:
    """The stochastic-rounding seed of parameter ``index`` at optimizer step ``step`` of a run
    seeded ``seed`` (48 bits; FORGE and ``lt.optim.Optimizer``'s kernel step)."""
    return (seed * _SEED_MUL + index * _INDEX_MUL + step * _STEP_MUL) & _MASK48


def kernel_key(seed: int) -> int:
    """``seed_key(seed)`` as a signed int32, the form Triton kernels take (``key`` argument).

    Pass it with ``do_not_specialize=["key"]``; kernels reinterpret it as uint32.
    """
    k = seed_key(seed)
    return k - (1 << 32) if k >= (1 << 31) else k


def step_kernel_keys(seed: int, index, step):
    """``kernel_key(step_seed(seed, index[i], step[i]))`` for numpy integer arrays ``index`` and
    ``step`` at once, as an int32 array (a host table of many parameters' keys per step)."""
    import numpy as np

    base = np.uint64((seed * _SEED_MUL) & _MASK48)
    s = (base + np.asarray(index, dtype=np.uint64) * np.uint64(_INDEX_MUL)
         + np.asarray(step, dtype=np.uint64) * np.uint64(_STEP_MUL)) & np.uint64(_MASK48)
    return _mix64(s).astype(np.uint32).view(np.int32)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32), without int64 overflow."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & MASK32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _M1)
    x = x ^ (x >> 13)
    x = _mul32(x, _M2)
    return x ^ (x >> 16)


def hash_u32(seed: int, index: torch.Tensor) -> torch.Tensor:
    """32-bit hash of ``(seed, index)`` as an int64 tensor holding values in [0, 2**32)."""
    idx = index.to(torch.int64)
    k = seed_key(seed)
    h = _fmix32((idx >> 32) ^ k)
    return _fmix32(_mul32(idx & MASK32, GOLDEN) ^ h)


def hash_uniform(seed: int, index: torch.Tensor) -> torch.Tensor:
    """Uniform float32 in (0, 1) (the 2**16 midpoints) for every element of ``index``, given
    ``seed``: the low or high 16 bits of ``hash_u32(seed, index >> 1)`` (module docstring)."""
    idx = index.to(torch.int64)
    h16 = (hash_u32(seed, idx >> 1) >> ((idx & 1) * 16)) & 0xFFFF
    return h16.to(torch.float32) * (2.0**-16) + (2.0**-17)


if HAS_TRITON:
    import triton
    import triton.language as tl

    from leantrain.ops.tl_helpers import HASH_IMAD

    @triton.jit
    def fmix32(x):
        x ^= x >> 16
        x *= 0x85EBCA6B
        x ^= x >> 13
        x *= 0xC2B2AE35
        x ^= x >> 16
        return x

    @triton.jit
    def hash_u32_tl(key, index):
        """uint32 hash of ``index`` (int32/int64 tensor) under ``key = kernel_key(seed)``.

        A uint32 ``index`` means "an element index below 2**32": its high word is 0, so
        ``h = fmix32(key)`` is one scalar per program and each element costs one fmix32 and
        one multiply (the int64 path pays two fmix32 and 64-bit shifts per element)."""
        if index.dtype == tl.uint32:
            h = fmix32(key.to(tl.uint32))
            return fmix32((index * 0x9E3779B9) ^ h)
        else:
            idx = index.to(tl.int64)
            lo = (idx & 0xFFFFFFFF).to(tl.uint32)
            hi = (idx >> 32).to(tl.uint32)
            h = fmix32(hi ^ key.to(tl.uint32))
            return fmix32((lo * 0x9E3779B9) ^ h)

    @triton.jit
    def _one_plus_u16_tl(h16):
        """``1 + (h16 + 1/2) * 2**-16`` from the bits: the float 0x3F800040 | h16 << 7 (exact)."""
        return ((h16 << 7) | 0x3F800040).to(tl.float32, bitcast=True)

    @triton.jit
    def uniform1_tl(key, index):
        """float32 ``1 + u`` with ``u`` equal bit for bit to :func:`hash_uniform` (one hash per
        element; a kernel holding both elements of a pair uses :func:`uniform1_pair_tl`)."""
        h = hash_u32_tl(key, index >> 1)
        return _one_plus_u16_tl((h >> ((index & 1) * 16).to(tl.uint32)) & 0xFFFF)

    @triton.jit
    def uniform1_pair_tl(key, pair, FAST: tl.constexpr):
        """``1 + u`` of elements ``2 * pair`` and ``2 * pair + 1``, from one hash. ``FAST & HASH_IMAD``
        (GPU): ``(h << 16) >> 9`` by ``mad.hi`` and ``(h >> 16) << 7`` by ``mad.lo``, each with
        the ``0x3F800040`` added: integer multiply-adds instead of shift-mask-or logic (same
        bits: the fields never overlap the constant)."""
        h = hash_u32_tl(key, pair)
        if HASH_IMAD & FAST:
            lo = tl.inline_asm_elementwise("mad.hi.u32 $0, $1, 8388608, 1065353280;", "=r,r", [h << 16],
                                           dtype=tl.uint32, is_pure=True, pack=1)
            hi = tl.inline_asm_elementwise("mad.lo.u32 $0, $1, 128, 1065353280;", "=r,r", [h >> 16],
                                           dtype=tl.uint32, is_pure=True, pack=1)
            return lo.to(tl.float32, bitcast=True), hi.to(tl.float32, bitcast=True)
        else:
            return _one_plus_u16_tl(h & 0xFFFF), _one_plus_u16_tl(h >> 16)


# ---------------------------------------------------------------- CUDA-graph replay salt

_SALTS: dict[torch.device, Tensor] = {}
GOLDEN31 = 0x9E3779B1  # the Weyl increment a replay adds to its salt


def _cuda_device(device) -> torch.device:
    d = torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if d.index is None else d


def replay_salt(device, *, create: bool = True) -> Tensor | None:
    """A device int64 scalar in [0, 2**31): 0 until a :class:`GraphedStep` on ``device`` is
    captured, then advanced at the start of every replay, inside the graph. Captured code that
    draws random numbers from integer keys XORs it into them so that replays differ.
    ``create=False``: None when no GraphedStep made it (a graph captured some other way)."""
    d = _cuda_device(device)
    t = _SALTS.get(d)
    if t is None and create:
        t = _SALTS[d] = torch.zeros((), dtype=torch.int64, device=d)
    return t

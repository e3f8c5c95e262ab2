"""Blocked fast Walsh-Hadamard transform, and the transform fused with quantization.

Math: the flattened tensor is cut into blocks of ``b`` elements (power of two, 16..256;
padded with zeros to a whole number of blocks) and each block row-vector ``x`` becomes
    normalized:    y = x H_b / sqrt(b)        (orthonormal, its own inverse)
    unnormalized:  y = x H_b,   inverse x = y H_b / b
with ``H_b`` the Sylvester Hadamard matrix, ``H[i, j] = (-1)**popcount(i & j)`` (symmetric).
Spreading each block's energy evenly, it shrinks the max/RMS ratio of heavy-tailed data
(one outlier of size A in a block becomes b entries of size A/sqrt(b)), which is what makes
low-bit gradient quantization (SDP4Bit) work. When ``x.shape[-1]`` is a multiple of ``b`` the
blocks lie along the last dim and the output keeps ``x``'s shape; otherwise the output is the
1-D padded vector (crop ``[:x.numel()]`` after the inverse).

Tiling (Triton): one program owns ``R`` blocks (an ``[R, b]`` tile, ~4096 elements) and
multiplies it by ``H_b``, built in registers from the popcount parity (never loaded), on the
tensor cores (b = 256 as ``H_16 (x) H_16``: two 16-wide products with a transpose between).
``H`` is +-1, exact in any format, and products accumulate in fp32, so only the input's
representation matters: bf16/fp16 inputs are exact in tf32 (one ``tf32`` product); fp32
inputs are split into three bf16 parts (8 + 8 + 8 significant bits = fp32's 24) whose three
exact products are summed in fp32 ("bf16x3", :func:`_dot_bf16x3`): the transform equals the
fp32 reference up to summation order. On an H200 this runs the b = 32 transform at 98 % of a
device copy (the FMA product, "ieee", 79 %; an in-register radix-2 "butterfly" 97 %) and
b = 256 at 79 % (ieee 51 %); ``FP32_METHOD`` selects the method. Inside a tile offsets are
int32 (64-bit only in the per-program base pointer); bf16 outputs are rounded by the
hardware conversion (round to nearest even; the integer emulation only under the
interpreter, which truncates, and whose bf16 ``tl.dot`` is replaced by the same products in
fp32). The fused ``hadamard_quantize`` reshapes the transformed tile into
``[R * b / group_size, group_size]`` groups and quantizes it in the same program (group_size
and b powers of two; 4 warps); its stochastic-rounding counter is the element index as uint32
when the output has < 2**32 elements (the same hash as the int64 index, whose high word is
then 0).
Bytes per element: hadamard reads and writes ``sizeof(x)``; hadamard_quantize reads
``sizeof(x)`` and writes ``bits / 8`` (+ 4 / group_size).
"""

from __future__ import annotations

import math

import torch

from leantrain.ops import quant
from leantrain.ops._backend import HAS_TRITON, interpreting, launch, resolve
from leantrain.ops.qtensor import QTensor
from leantrain.ops.quant import quantize, quantize_ref
from leantrain.ops.rng import kernel_key
from leantrain.ops.tiles import check_int_format, fast_bits, int_code_range


def _check_block(block: int) -> None:
    if block < 16 or block > 256 or block & (block - 1):
        raise ValueError(f"block must be a power of two in [16, 256], got {block}")


def hadamard_matrix(b: int, device=None) -> torch.Tensor:
    """Sylvester Hadamard matrix ``H_b`` (entries +-1, fp32)."""
    i = torch.arange(b, device=device)
    p = i[:, None] & i[None, :]
    par = torch.zeros_like(p)
    for s in range(max(1, int(math.log2(b)))):
        par ^= (p >> s) & 1
    return (1 - 2 * par).to(torch.float32)


def _factor(block: int, normalized: bool, inverse: bool) -> float:
    if normalized:
        return 1.0 / math.sqrt(block)
    return 1.0 / block if inverse else 1.0


def _out_shape(x: torch.Tensor, block: int):
    if x.dim() and x.shape[-1] % block == 0:
        return x.shape
    return torch.Size([-(-x.numel() // block) * block])


def hadamard_ref(x: torch.Tensor, *, block: int = 32, normalized: bool = True,
                 inverse: bool = False) -> torch.Tensor:
    n = x.numel()
    nb = -(-n // block)
    xp = torch.zeros(nb * block, dtype=torch.float32, device=x.device)
    xp[:n] = x.reshape(-1).to(torch.float32)
    y = (xp.view(nb, block) @ hadamard_matrix(block, x.device)) * _factor(block, normalized, inverse)
    return y.reshape(_out_shape(x, block)).to(x.dtype)


if HAS_TRITON:
    import triton
    import triton.language as tl

    from leantrain.ops.quant_tl import encode_pack_tl
    from leantrain.ops.tl_helpers import cast_out_tl

    @triton.jit
    def _h_tl(B: tl.constexpr, LOG2B: tl.constexpr):
        i = tl.arange(0, B)
        p = i[:, None] & i[None, :]
        par = tl.zeros([B, B], dtype=tl.int32)
        for s in tl.static_range(LOG2B):
            par ^= (p >> s) & 1
        return (1 - 2 * par).to(tl.float32)

    @triton.jit
    def _butterfly_tl(x, R: tl.constexpr, B: tl.constexpr, LOG2B: tl.constexpr):
        """``x [R, B] @ H_B`` as LOG2B radix-2 stages (one add or subtract per element each).

        Each stage butterflies index bit 0 (pairs 2j, 2j+1) and rotates the index bits right
        (result index ``s * B/2 + j``); after LOG2B stages every bit was butterflied once and
        the order is back. Exact fp32 adds, no tensor cores, no H."""
        for _ in tl.static_range(LOG2B):
            a, b = tl.split(tl.reshape(x, [R, B // 2, 2]))
            x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), [R, B])
        return x

    @triton.jit
    def _dot_bf16x3(x, h, EMULATE: tl.constexpr = False):
        """``x @ h`` for fp32 ``x`` and +-1 ``h`` on bf16 tensor cores, exact products: x is
        split into three bf16 parts (8 + 8 + 8 significant bits = fp32's 24), each product
        with +-1 is exact, the three are accumulated in fp32. ``EMULATE`` (the interpreter,
        whose bf16 ``tl.dot`` is unreliable): the same parts, multiplied in fp32."""
        x1 = x.to(tl.bfloat16)
        r = x - x1.to(tl.float32)
        x2 = r.to(tl.bfloat16)
        x3 = (r - x2.to(tl.float32)).to(tl.bfloat16)
        if EMULATE:
            y = tl.dot(x1.to(tl.float32), h, input_precision="ieee")
            y = tl.dot(x2.to(tl.float32), h, y, input_precision="ieee")
            return tl.dot(x3.to(tl.float32), h, y, input_precision="ieee")
        else:
            hb = h.to(tl.bfloat16)
            y = tl.dot(x1, hb, out_dtype=tl.float32)
            y = tl.dot(x2, hb, y, out_dtype=tl.float32)
            return tl.dot(x3, hb, y, out_dtype=tl.float32)

    @triton.jit
    def _dot_h(x, h, PREC: tl.constexpr):
        if PREC == "bf16x3":
            return _dot_bf16x3(x, h)
        elif PREC == "bf16x3_emulated":
            return _dot_bf16x3(x, h, True)
        else:
            return tl.dot(x, h, input_precision=PREC)

    @triton.jit
    def hadamard_tile_tl(x, B: tl.constexpr, LOG2B: tl.constexpr, PREC: tl.constexpr):
        """``x [R, B] @ H_B`` in fp32 (H built from popcount parity, never loaded).

        ``PREC``: "butterfly" (:func:`_butterfly_tl`), "bf16x3" (:func:`_dot_bf16x3`), or a
        ``tl.dot`` input precision ("tf32" is exact when x came from bf16/fp16, "ieee" is the
        FMA product); see :func:`_prec`. B = 256 with a dot uses ``H_256 = H_16 (x) H_16``:
        two [., 16] x [16, 16] products with a transpose between."""
        R: tl.constexpr = x.shape[0]
        if PREC == "butterfly":
            return _butterfly_tl(x, R, B, LOG2B)
        elif B == 256:  # the second product's input is an fp32 sum: never tf32
            h = _h_tl(16, 4)
            if PREC == "bf16x3" or PREC == "bf16x3_emulated":
                y = _dot_h(tl.reshape(x, [R * 16, 16]), h, PREC)
            else:
                y = tl.dot(tl.reshape(x, [R * 16, 16]), h, input_precision="ieee")
            y = tl.reshape(tl.permute(tl.reshape(y, [R, 16, 16]), (0, 2, 1)), [R * 16, 16])
            if PREC == "bf16x3" or PREC == "bf16x3_emulated":
                y = _dot_h(y, h, PREC)
            else:
                y = tl.dot(y, h, input_precision="ieee")
            return tl.reshape(tl.permute(tl.reshape(y, [R, 16, 16]), (0, 2, 1)), [R, 256])
        else:
            return _dot_h(x, _h_tl(B, LOG2B), PREC)

    @triton.jit
    def _hadamard_kernel(x_ptr, y_ptr, n, n_pad, factor, B: tl.constexpr, LOG2B: tl.constexpr,
                         R: tl.constexpr, PREC: tl.constexpr, FAST: tl.constexpr):
        base = tl.program_id(0).to(tl.int64) * (R * B)      # int64 only per program
        rem = tl.minimum(n - base, R * B).to(tl.int32)
        rem_pad = tl.minimum(n_pad - base, R * B).to(tl.int32)
        loc = tl.arange(0, R)[:, None] * B + tl.arange(0, B)[None, :]
        x = tl.load(x_ptr + base + loc, mask=loc < rem, other=0.0).to(tl.float32)
        y = hadamard_tile_tl(x, B, LOG2B, PREC) * factor
        tl.store(y_ptr + base + loc, cast_out_tl(y, y_ptr.dtype.element_ty, FAST), mask=loc < rem_pad)

    @triton.jit(do_not_specialize=["key"])
    def _hadamard_quantize_kernel(x_ptr, data_ptr, scale_ptr, zero_ptr, n, n_pad, n_groups, factor,
                                  key, B: tl.constexpr, LOG2B: tl.constexpr, R: tl.constexpr,
                                  GS: tl.constexpr, BITS: tl.constexpr, SYMMETRIC: tl.constexpr,
                                  STOCHASTIC: tl.constexpr, QLO: tl.constexpr, QHI: tl.constexpr,
                                  PREC: tl.constexpr, IDX32: tl.constexpr, PAIRS: tl.constexpr,
                                  FAST: tl.constexpr):
        T: tl.constexpr = R * B
        G: tl.constexpr = T // GS
        BC: tl.constexpr = GS * BITS // 8
        pid = tl.program_id(0).to(tl.int64)
        base = pid * T                                      # int64 only per program
        rem = tl.minimum(n - base, T).to(tl.int32)
        rem_pad = tl.minimum(n_pad - base, T).to(tl.int32)
        loc = tl.arange(0, R)[:, None] * B + tl.arange(0, B)[None, :]
        x = tl.load(x_ptr + base + loc, mask=loc < rem, other=0.0).to(tl.float32)
        y = tl.reshape(hadamard_tile_tl(x, B, LOG2B, PREC) * factor, [G, GS])
        g = tl.arange(0, G)
        gloc = g[:, None] * GS + tl.arange(0, GS)[None, :]
        if IDX32:  # < 2**32 elements: the uint32 index hashes like the int64 one (high word 0)
            gidx = base.to(tl.uint32) + gloc.to(tl.uint32)
        else:
            gidx = base + gloc
        byts, scale, zero = encode_pack_tl(y, gloc < rem_pad, gidx, key, G, GS, BITS, QLO, QHI, SYMMETRIC,
                                           STOCHASTIC, PAIRS, FAST)
        rows = pid * G + g
        boff = g[:, None] * BC + tl.arange(0, BC)[None, :]
        tl.store(data_ptr + pid * (G * BC) + boff, byts, mask=rows[:, None] < n_groups)
        tl.store(scale_ptr + rows, scale, mask=rows < n_groups)
        if not SYMMETRIC:
            tl.store(zero_ptr + rows, zero, mask=rows < n_groups)


_IDX32_LIMIT = 2**32  # outputs up to this many elements use the uint32 RNG counter
HQ_ELEMS = 0  # hadamard_quantize: elements per program (0: _rows' choice, ~4096)
HQ_WARPS = 4  # measured: 4 warps beat 8 for the fused kernel (tune_s2b)


FP32_METHOD = "bf16x3"  # fp32 inputs: "bf16x3" (fastest on an H200: b32 97 % of copy vs 79 % for
#   "ieee", fused int8 58 % vs 41 %; benchmarks/results/*tune_s2b) | "ieee" | "butterfly"
HALF_METHOD = "tf32"  # bf16/fp16 inputs (exact in tf32): "tf32" | "butterfly"


def _prec(dtype: torch.dtype) -> str:
    """The transform method for inputs of ``dtype`` (see :func:`hadamard_tile_tl`): bf16/fp16
    values are exact in tf32 (one tensor-core product, exact); fp32 values take FP32_METHOD."""
    m = HALF_METHOD if dtype in (torch.bfloat16, torch.float16) else FP32_METHOD
    return m + "_emulated" if m == "bf16x3" and interpreting() else m


def _rows(block: int, multiple: int = 1) -> int:
    return max(16, 4096 // block, multiple)


def hadamard(x: torch.Tensor, *, block: int = 32, normalized: bool = True, inverse: bool = False,
             backend: str = "auto") -> torch.Tensor:
    """Blocked Walsh-Hadamard transform of ``x`` (see the module docstring for shapes)."""
    _check_block(block)
    if resolve(backend, x) == "torch":
        return hadamard_ref(x, block=block, normalized=normalized, inverse=inverse)
    xf = x.reshape(-1).contiguous()
    n = xf.numel()
    shape = _out_shape(x, block)
    y = torch.empty(shape, dtype=x.dtype, device=x.device)
    n_pad = y.numel()
    if n:
        r = _rows(block)
        launch(_hadamard_kernel, (triton.cdiv(n_pad, r * block),), xf, y, n, n_pad,
               _factor(block, normalized, inverse), B=block, LOG2B=int(math.log2(block)), R=r,
               PREC=_prec(x.dtype), FAST=fast_bits(), num_warps=8 if block >= 64 else 4)
    return y


def hadamard_quantize(x: torch.Tensor, *, block: int = 32, normalized: bool = True, bits: int = 8,
                      group_size: int = 128, symmetric: bool = True, stochastic: bool = False,
                      seed: int = 0, backend: str = "auto") -> QTensor:
    """``quantize(hadamard(x, block=block, normalized=normalized), ...)`` in one pass.

    The QTensor describes the *transformed* tensor (shape as :func:`hadamard` returns);
    ``hadamard(dequantize(q), block=block, normalized=normalized, inverse=True)`` recovers
    ``x`` up to quantization error. Triton needs ``group_size`` a power of two; block 256
    runs as two kernels there (see the note in the code).
    """
    _check_block(block)
    check_int_format(bits, group_size)
    if resolve(backend, x) == "torch":
        y = hadamard_ref(x.to(torch.float32), block=block, normalized=normalized)
        q = quantize_ref(y, bits=bits, group_size=group_size, symmetric=symmetric,
                         stochastic=stochastic, seed=seed)
        q.dtype = x.dtype
        return q
    if group_size & (group_size - 1):
        raise ValueError(f"hadamard_quantize on Triton needs a power-of-two group_size, got {group_size}")
    if block == 256:
        # The fused kernel's H_16 (x) H_16 path followed by the regrouping reshape gave wrong
        # values on an H200 (Triton 3.6) while the standalone transform is right: two passes.
        q = quantize(hadamard(x.float(), block=block, normalized=normalized, backend="triton"), bits=bits,
                     group_size=group_size, symmetric=symmetric, stochastic=stochastic, seed=seed,
                     backend="triton")
        q.dtype = x.dtype
        return q
    xf = x.reshape(-1).contiguous()
    n = xf.numel()
    shape = _out_shape(x, block)
    n_pad = math.prod(shape)
    g = -(-n_pad // group_size)
    data = torch.empty(g * group_size * bits // 8, dtype=torch.uint8, device=x.device)
    scale = torch.empty(g, dtype=torch.float32, device=x.device)
    zero = None if symmetric else torch.empty(g, dtype=torch.float32, device=x.device)
    if n:
        r = max(_rows(block, group_size // block), HQ_ELEMS // block)
        qlo, qhi = int_code_range(bits, symmetric)
        launch(_hadamard_quantize_kernel, (triton.cdiv(n_pad, r * block),), xf, data, scale,
               scale if zero is None else zero, n, n_pad, g, _factor(block, normalized, False),
               kernel_key(seed), B=block, LOG2B=int(math.log2(block)), R=r, GS=group_size, BITS=bits,
               SYMMETRIC=symmetric, STOCHASTIC=stochastic, QLO=qlo, QHI=qhi, PREC=_prec(x.dtype),
               IDX32=g * group_size <= _IDX32_LIMIT, PAIRS=quant.PAIR_SR, FAST=fast_bits(),
               num_warps=HQ_WARPS)
    return QTensor(data, scale, zero, shape, x.dtype, bits, group_size, symmetric)

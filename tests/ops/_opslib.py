"""Helpers, tolerances and SQNR floors of the ops tests, stated once.

Tolerances ``(dtype -> atol, rtol)`` for results that are *not* bit-exact by design (the
Hadamard transform: ``tl.dot`` and ``torch.matmul`` sum in different orders). fp32: a few
ulps of the block sum; bf16/fp16: one rounding of the output to 8/11 mantissa bits.
Integer codes, scales and dequantized values of every quantizer are compared bit for bit.
"""

import math
import os

import torch

# Tests run on CUDA with compiled kernels when a GPU is there and the interpreter is off
# (tests/conftest.py turns it off with LEANTRAIN_TEST_GPU=1); else on CPU, interpreted.
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0") else "cpu"

TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (1e-2, 1.6e-2),  # 2**-7 relative: one bf16 rounding
    torch.float16: (1e-3, 2e-3),     # 2**-10 relative: one fp16 rounding
}

# SQNR floors in dB on N(0, 1) data (2**16 elements, group 128 unless stated), measured with
# this code on 2**18 elements (in parentheses) and set ~0.5-1 dB below the measurement.
SQNR_FLOOR_DB = {
    ("int8", True, False): 42.5,   # symmetric RTN (43.7)
    ("int8", True, True): 39.5,    # symmetric SR (40.7)
    ("int8", False, False): 43.5,  # asymmetric RTN (44.6)
    ("int8", False, True): 40.5,   # asymmetric SR (41.6)
    ("int4", True, False): 18.0,   # symmetric RTN (18.6)
    ("int4", True, True): 15.0,    # symmetric SR (15.6)
    ("int4", False, False): 19.5,  # asymmetric RTN (20.0)
    ("int4", False, True): 16.5,   # asymmetric SR (17.0)
    "e4m3": 31.0,                  # FP8 E4M3 (31.8)
    "e5m2": 25.0,                  # FP8 E5M2 (25.8)
    "nvfp4": 19.5,                 # E2M1 / 16-block E4M3 scale (20.4)
    "state8_signed": 38.5,         # dynamic map, block 256 (39.3)
    "state8_unsigned": 44.5,       # on |N(0,1)| (45.3)
}
# Hadamard (block 32) before int4 RTN on Student-t(2) data: 12.5 dB -> 19.3 dB measured.
HADAMARD_INT4_GAIN_DB = 4.0

SIZES = [1, 127, 4097]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def triton_runnable() -> bool:
    from leantrain.ops import _backend

    if not _backend.HAS_TRITON:
        return False
    if DEVICE == "cuda":
        return True
    from leantrain.ops.quant import _quantize_kernel

    return type(_quantize_kernel).__name__ == "InterpretedFunction" and _backend.interpreting()


def sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return 10 * math.log10(x.pow(2).sum().item() / max((x - y).pow(2).sum().item(), 1e-300))


def randn(n, dtype=torch.float32, device=DEVICE, scale=3.0):
    """Fresh non-trivial data: Gaussian with a per-element log-normal spread (never all zero)."""
    x = torch.randn(n, device=device) * torch.exp(torch.randn(n, device=device)) * scale
    return x.to(dtype)


def equal_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)))


def gpu_full_size() -> bool:
    return torch.cuda.is_available() and os.environ.get("LEANTRAIN_GPU_TESTS", "1") != "0"

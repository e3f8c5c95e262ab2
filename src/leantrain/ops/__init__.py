"""Numeric building blocks of leantrain: each a pure-torch reference and a Triton kernel
behind one dispatcher (``backend="auto" | "torch" | "triton"``; auto = Triton on CUDA).

| module        | what                                                                 |
|---------------|----------------------------------------------------------------------|
| ``quant``     | block-wise int8 / int4 quantize, dequantize (RTN and stochastic)     |
| ``multi``     | the same for many tensors in one launch (AGoQ's batched save path)   |
| ``fp8``       | FP8 E4M3 / E5M2 with per-group scales, payload uint8                 |
| ``nvfp4``     | E2M1 in 16-blocks + E4M3 block scale + fp32 tensor scale              |
| ``state8``    | 8-bit optimizer-state codec (dynamic map), Triton epilogue helpers    |
| ``sr``        | fp32 -> bf16 stochastic rounding                                     |
| ``hadamard``  | blocked Walsh-Hadamard transform, fused with quantization            |
| ``reduce``    | dequantize -> fp32 sum over peers -> requantize                      |
| ``bits``      | boolean mask <-> 1 bit per element                                   |
| ``rng``       | the counter-based hash RNG shared by torch and Triton                |
| ``xent``      | the fused LM head + loss's passes (log-sum-exp, softmax gradient)    |
| ``norm``      | RMSNorm forward / backward in one pass each (saves x and rstd only)  |
| ``rope``      | rotary position embedding in one pass each way                       |
"""

from leantrain.ops._backend import HAS_TRITON
from leantrain.ops.bits import pack_bits, unpack_bits
from leantrain.ops.fp8 import dequantize_fp8, quantize_fp8
from leantrain.ops.hadamard import hadamard, hadamard_quantize
from leantrain.ops.multi import dequantize_many, quantize_many
from leantrain.ops.nvfp4 import NVFP4Tensor, dequantize_nvfp4, quantize_nvfp4
from leantrain.ops.qtensor import QTensor
from leantrain.ops.quant import dequantize, quantize
from leantrain.ops.reduce import dequant_sum_requant
from leantrain.ops.rng import hash_uniform, kernel_key, seed_key
from leantrain.ops.sr import bf16_stochastic_round
from leantrain.ops.state8 import StateCodec8

__all__ = [
    "HAS_TRITON", "QTensor", "quantize", "dequantize", "quantize_many", "dequantize_many", "quantize_fp8", "dequantize_fp8",
    "NVFP4Tensor", "quantize_nvfp4", "dequantize_nvfp4", "StateCodec8", "bf16_stochastic_round",
    "hadamard", "hadamard_quantize", "dequant_sum_requant", "pack_bits", "unpack_bits",
    "hash_uniform", "seed_key", "kernel_key",
]

"""GIFT's 4-bit all-reduce: NVFP4 (``leantrain.ops.nvfp4``) on the wire, with the options for gradients.

Each chunk message of AGoQ's two-phase all-reduce (:func:`~leantrain.comm.int8_allreduce.two_phase_all_reduce`)
is one NVFP4 tensor: E2M1 codes two to a byte, an E4M3 scale per 16 elements, an fp32 scale per 4096
elements, as ``ops.quantize_nvfp4`` encodes them (Triton on CUDA, its bit-identical torch reference
elsewhere), with

- ``stochastic=True``: stochastic rounding of the elements from the ops' counter-based generator
  (a seed from the call's ``seed``, this rank and the phase): the decoded sum is unbiased;
- ``scale_round="up"``: block scales rounded up to an E4M3 value, so no element is clipped;
- ``nonfinite="nan"``: a block with a NaN or an infinity decodes as NaN on every rank;
- ``local_scale=True``: the fp32 scales per 4096 elements, so the quantize is one pass over the chunk.

Bytes a message: ``C / 2 + C / 16 + 4 ⌈C / 4096⌉`` for ``C`` elements, i.e. ``(0.5 + 1/16 + 1/1024) / 2
= 0.282`` of a bf16 all-reduce plus padding to 16 elements a chunk.
"""

from __future__ import annotations

import torch
from torch import Tensor

from leantrain.comm._kernels import mix_seed
from leantrain.comm.int8_allreduce import two_phase_all_reduce
from leantrain.ops import NVFP4Tensor, dequantize_nvfp4, quantize_nvfp4
from leantrain.runtime import collectives as C

__all__ = ["BLOCK", "nvfp4_all_reduce", "nvfp4_nbytes"]

BLOCK = 16  # elements an E4M3 scale
GROUP = 4096  # elements an fp32 scale (``local_scale``)


def nvfp4_nbytes(numel: int) -> int:
    """Bytes of one message of ``numel`` elements (a multiple of 16): codes, block scales, fp32 scales."""
    return numel // 2 + numel // BLOCK + 4 * -(-numel // GROUP)


def nvfp4_all_reduce(tensor: Tensor, group=None, *, average: bool = False, stochastic: bool = True,
                     seed: int = 0, scope: str = "world") -> Tensor:
    """All-reduce ``tensor`` in place through NVFP4 (module doc); returns it. ``average`` divides the sum by
    the number of ranks. ``stochastic``: stochastic rounding from ``seed`` (the same seed gives the same
    bits; vary it between calls)."""
    if C.world_size(group) == 1:
        return tensor
    me = C.rank(group)

    def encode(x, k, phase):  # k messages: uint8 (k, C/2 + C/16 + 4)
        out = []
        for i, c in enumerate(x.view(k, -1)):
            q = quantize_nvfp4(c, stochastic=stochastic, seed=mix_seed(seed, me, phase, i), scale_round="up",
                               nonfinite="nan", local_scale=True)
            out.append(torch.cat([q.data, q.block_scale, q.tensor_scale.view(torch.uint8)]))
        return torch.stack(out)

    def decode(buf, chunk):
        nb = chunk // BLOCK
        vals = []
        for m in buf:
            ts = m[chunk // 2 + nb:].clone().view(torch.float32)
            q = NVFP4Tensor(m[:chunk // 2], m[chunk // 2:chunk // 2 + nb], ts, torch.Size([chunk]), torch.float32)
            vals.append(dequantize_nvfp4(q))
        return torch.stack(vals)

    return two_phase_all_reduce(tensor, group, block=BLOCK, encode=encode, decode=decode, average=average,
                                scope=scope)

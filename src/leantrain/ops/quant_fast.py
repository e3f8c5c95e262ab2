"""Integer block quantization (4 / 8 bits) fast on any device: the Triton kernel on CUDA, a
vectorized torch path on CPU.

:func:`quantize_q` and :func:`dequantize_q` give :mod:`leantrain.ops.quant`'s ``QTensor`` layout
and math (symmetric absmax or asymmetric min/max groups, round to nearest or stochastic). On CUDA
they are :func:`~leantrain.ops.quant.quantize` / ``dequantize``. On CPU they skip the reference's
bit-exactness with the kernels: its stochastic-rounding noise comes from a counter hash (~1 s per
10^6 elements on a small CPU), too slow for AGoQ's saved activations or a CPU all-reduce, so here
``torch.rand`` with a seeded generator supplies it, and divisions are torch's. Codes then match
the kernels' in distribution (unbiased), not bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from leantrain.ops.qtensor import QTensor
from leantrain.ops.quant import dequantize, quantize
from leantrain.ops.rng import hash_uniform
from leantrain.ops.tiles import TINY

__all__ = ["quantize_q", "dequantize_q", "pad_groups_edge", "group_uniforms"]


def quantize_q(x: Tensor, bits: int, *, group_size: int = 128, symmetric: bool = True,
               stochastic: bool = False, seed: int = 0, exp: bool = False) -> QTensor:
    """4/8-bit :class:`QTensor` (of ``exp(x)`` with ``exp``): the ops Triton kernel on CUDA, the
    vectorized torch path on CPU."""
    if x.is_cuda:
        return quantize(x, bits=bits, group_size=group_size, symmetric=symmetric, stochastic=stochastic, seed=seed,
                        exp=exp)
    return _quantize_torch(x.float().exp() if exp else x, bits, group_size, symmetric, stochastic, seed)


def dequantize_q(q: QTensor, dtype: torch.dtype | None = None, log: bool = False) -> Tensor:
    """Values of a 4/8-bit :class:`QTensor` (non-stacked), in ``dtype`` or its own dtype;
    ``log``: ``log(max(v, TINY))`` (fp32 math; on CUDA in the dequantize kernel)."""
    if q.data.is_cuda:
        return dequantize(q, dtype=dtype, log=log)
    v = _dequantize_torch(q)
    if log:
        v = v.float().clamp_min_(TINY).log_()
    return v if dtype is None else v.to(dtype)


def group_uniforms(seed: int, n_groups: int, group_size: int, device) -> Tensor:
    """``[n_groups, group_size]`` uniforms in [0, 1): ``torch.rand`` seeded by ``seed`` on CPU,
    :func:`~leantrain.ops.rng.hash_uniform` of the flat index elsewhere."""
    if device.type == "cpu":
        gen = torch.Generator().manual_seed(seed & 0x7FFFFFFFFFFFFFFF)
        return torch.rand(n_groups, group_size, generator=gen)
    idx = torch.arange(n_groups * group_size, device=device, dtype=torch.int64)
    return hash_uniform(seed, idx).view(n_groups, group_size)


def pad_groups_edge(x: Tensor, group_size: int) -> Tensor:
    """Flattened fp32 ``x`` padded (with its last value, so min/max are unchanged) to ``[G, gs]``."""
    flat = x.reshape(-1).float()
    n = flat.numel()
    g = -(-n // group_size)
    pad = g * group_size - n
    if pad:
        flat = torch.cat([flat, flat[-1:].expand(pad)])
    return flat.view(g, group_size)


def _quantize_torch(x: Tensor, bits: int, group_size: int, symmetric: bool, stochastic: bool,
                    seed: int) -> QTensor:
    """4/8-bit codes in the layout of :class:`leantrain.ops.QTensor` (fast CPU path)."""
    xg = pad_groups_edge(x, group_size)
    xg = torch.nan_to_num(xg, nan=0.0, posinf=0.0, neginf=0.0)
    if symmetric:
        qmax, lo = 2 ** (bits - 1) - 1, -(2 ** (bits - 1) - 1)
        rng = xg.abs().amax(1, keepdim=True)
        zero, base = None, xg
    else:
        qmax, lo = 2**bits - 1, 0
        mn = xg.amin(1, keepdim=True)
        rng = xg.amax(1, keepdim=True) - mn
        zero, base = mn, xg - mn
    scale = rng / qmax
    y = base * torch.where(rng > 0, qmax / rng, 0.0)
    y += group_uniforms(seed, *xg.shape, xg.device) if stochastic else 0.5
    code = y.floor_().clamp_(lo, qmax).to(torch.int32)
    if bits == 8:
        data = (code & 0xFF).to(torch.uint8).reshape(-1)
    else:
        c = code & 0xF
        data = (c[:, 0::2] | (c[:, 1::2] << 4)).to(torch.uint8).reshape(-1)
    return QTensor(data, scale.view(-1), None if zero is None else zero.view(-1), x.shape, x.dtype,
                   bits, group_size, symmetric)


def _dequantize_torch(q: QTensor) -> Tensor:
    d = q.data
    if q.bits == 8:
        code = d.view(torch.int8) if q.symmetric else d
    else:
        lo, hi = d & 0xF, d >> 4
        code = torch.stack([lo, hi], 1).reshape(-1)
        if q.symmetric:
            code = code.to(torch.int8)
            code = torch.where(code >= 8, code - 16, code)
    v = code.view(-1, q.group_size).float() * q.scale.unsqueeze(1)
    if q.zero is not None:
        v += q.zero.unsqueeze(1)
    return v.reshape(-1)[: q.numel].view(q.shape).to(q.dtype)

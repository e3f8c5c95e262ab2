"""An 8-bit AdamW in plain torch: the optimizer of torchtune's single-device low-memory recipe
(bitsandbytes' ``PagedAdamW8bit``), reproduced for ``bench_memory.py``'s ``torchtune_recipe``.

The first and second moments are stored blockwise: each run of ``BLOCK`` = 256 elements of a
flattened state keeps one fp32 absmax and 256 uint8 codes. The quantization is **dynamic** (the
bitsandbytes / torchao "dynamic tree" map, :func:`dynamic_map`), not linear: a code indexes a
256-entry table of values in [-1, 1] (m, signed) or [0, 1] (v, unsigned) spread over seven
decades, so the small second moments of a block with one large entry keep a nonzero value (a
linear map would round them to 0 and their update to ``m / eps``). A value is divided by its
block's absmax and rounded to the nearest entry (``torch.bucketize`` on the entries' midpoints).

A step dequantizes a parameter's m and v to fp32, applies torch's AdamW update (decoupled weight
decay, bias correction, ``eps`` added after the square root), quantizes m and v back and writes the
weight in its own dtype (round to nearest). It works through the parameter ``SLICE`` elements at
a time, so its fp32 temporaries are a slice's (bitsandbytes' fused kernel has none). Parameters of
fewer than ``MIN_8BIT`` elements keep fp32 states (bitsandbytes' ``min_8bit_size``).
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK = 256
MIN_8BIT = 4096
SLICE = BLOCK * 65536  # elements dequantized at once (16 Mi: 64 MiB of fp32 a temporary)


def dynamic_map(signed: bool) -> Tensor:
    """bitsandbytes' dynamic map (``create_dynamic_map(signed, max_exponent_bits=7)``): 256
    sorted values in [-1, 1] (signed) or [0, 1]; decade ``i`` (values ``10**(i-6) * [0.1, 1]``)
    holds ``2**i`` (signed: each sign) or ``2**(i+1)`` linearly spaced entries, plus 0 and 1."""
    values = [0.0, 1.0]
    for i in range(7):
        n = 2**i if signed else 2 ** (i + 1)
        bounds = torch.linspace(0.1, 1.0, n + 1, dtype=torch.float64)
        means = ((bounds[:-1] + bounds[1:]) / 2 * 10.0 ** (i - 6)).tolist()
        values += means + ([-x for x in means] if signed else [])
    values += [0.0] * (256 - len(values))
    return torch.tensor(sorted(values), dtype=torch.float32)


class Quantized:
    """A tensor of ``numel`` elements as uint8 codes into ``qmap`` and one fp32 absmax a block."""

    def __init__(self, numel: int, qmap: Tensor, device: torch.device):
        self.numel, self.qmap = numel, qmap.to(device)
        self.mid = ((self.qmap[1:] + self.qmap[:-1]) / 2).contiguous()
        self.codes = torch.full((numel,), int(torch.argmin(qmap.abs())), dtype=torch.uint8, device=device)
        self.absmax = torch.zeros(-(-numel // BLOCK), dtype=torch.float32, device=device)

    def get(self, lo: int, hi: int) -> Tensor:
        """Elements ``[lo, hi)`` in fp32 (``lo`` a multiple of BLOCK)."""
        x = self.qmap[self.codes[lo:hi].long()]
        return _blocks(x, lambda xb, a: xb * a[:, None], self.absmax[lo // BLOCK: -(-hi // BLOCK)])

    def set(self, lo: int, hi: int, x: Tensor) -> None:
        """Store fp32 ``x`` as elements ``[lo, hi)`` (``lo`` a multiple of BLOCK)."""
        absmax = self.absmax[lo // BLOCK: -(-hi // BLOCK)]
        n_full = (hi - lo) // BLOCK
        absmax[:n_full] = x[:n_full * BLOCK].view(n_full, BLOCK).abs().amax(1)
        if n_full < absmax.numel():
            absmax[n_full:] = x[n_full * BLOCK:].abs().amax()
        scaled = _blocks(x, lambda xb, a: xb / a.clamp_min(1e-30)[:, None], absmax)
        self.codes[lo:hi] = torch.bucketize(scaled, self.mid, out_int32=True).to(torch.uint8)

    def tensors(self) -> list[Tensor]:
        return [self.codes, self.absmax]


def _blocks(x: Tensor, fn, absmax: Tensor) -> Tensor:
    """``fn(blocks, absmax)`` over ``x``'s full blocks of BLOCK and its last, partial one."""
    n_full = x.numel() // BLOCK
    out = torch.empty_like(x)
    out[:n_full * BLOCK] = fn(x[:n_full * BLOCK].view(n_full, BLOCK), absmax[:n_full]).reshape(-1)
    if n_full * BLOCK < x.numel():
        out[n_full * BLOCK:] = fn(x[n_full * BLOCK:].view(1, -1), absmax[n_full:]).reshape(-1)
    return out


class Full:
    """The fp32 state of a parameter under MIN_8BIT elements (same interface as Quantized)."""

    def __init__(self, numel: int, device: torch.device):
        self.data = torch.zeros(numel, dtype=torch.float32, device=device)

    def get(self, lo: int, hi: int) -> Tensor:
        return self.data[lo:hi].clone()

    def set(self, lo: int, hi: int, x: Tensor) -> None:
        self.data[lo:hi] = x

    def tensors(self) -> list[Tensor]:
        return [self.data]


class AdamW8bit(torch.optim.Optimizer):
    """``AdamW8bit(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)``: torch's
    AdamW with blockwise 8-bit dynamic-quantized moments (the module docstring). ``state[p]``
    holds ``step``, ``exp_avg`` and ``exp_avg_sq`` (:class:`Quantized` or :class:`Full`)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.signed_map, self.unsigned_map = dynamic_map(True), dynamic_map(False)

    def _state(self, p: Tensor) -> dict:
        st = self.state[p]
        if not st:
            n = p.numel()
            if n >= MIN_8BIT:
                st.update(exp_avg=Quantized(n, self.signed_map, p.device),
                          exp_avg_sq=Quantized(n, self.unsigned_map, p.device))
            else:
                st.update(exp_avg=Full(n, p.device), exp_avg_sq=Full(n, p.device))
            st["step"] = 0
        return st

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    def _update(self, p: Tensor, group: dict) -> None:
        st = self._state(p)
        st["step"] += 1
        lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        bc1, bc2_sqrt = 1 - b1 ** st["step"], (1 - b2 ** st["step"]) ** 0.5
        w, g = p.view(-1), p.grad.view(-1)
        m_state, v_state = st["exp_avg"], st["exp_avg_sq"]
        for lo in range(0, w.numel(), SLICE):
            hi = min(lo + SLICE, w.numel())
            gs = g[lo:hi].float()
            m = m_state.get(lo, hi).lerp_(gs, 1 - b1)
            v = v_state.get(lo, hi).mul_(b2).addcmul_(gs, gs, value=1 - b2)
            ws = w[lo:hi].float().mul_(1 - lr * wd)
            ws.addcdiv_(m, v.sqrt().div_(bc2_sqrt).add_(eps), value=-lr / bc1)
            w[lo:hi] = ws
            m_state.set(lo, hi, m)
            v_state.set(lo, hi, v)

    def state_tensors(self) -> list[Tensor]:
        """Every tensor of the optimizer's state (codes, scales, fp32 states)."""
        return [t for st in self.state.values() for k in ("exp_avg", "exp_avg_sq") if k in st
                for t in st[k].tensors()]

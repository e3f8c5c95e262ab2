"""Zeroth-order fine-tuning: MeZO and GRZO. No backward pass, no gradient, no optimizer state.

**MeZO** (Malladi et al., 2023; SPSA with the seed trick). One step draws ``z ~ N(0, I)`` over
every parameter from a step seed, evaluates the loss at ``θ + εz`` and ``θ - εz`` (perturbing
the weights in place), restores ``θ``, and moves every parameter by
``θ ← θ(1 - lr·wd) - lr·g·z`` with the projected gradient ``g = (ℓ₊ - ℓ₋) / 2ε``, ``z``
regenerated from the same seed instead of stored. Extra memory: one noise block at a time
(:func:`noise_block_for` elements). Restoring by subtraction is exact only up to rounding
(``θ + εz - 2εz + εz`` is a few ulps off ``θ``); in bf16 that error is up to ~0.4 % of a weight a
step (by arithmetic: bf16 keeps 8 significant bits, 2⁻⁸ ≈ 0.4 %),
so MeZO takes fp32 parameters only (GRZO never mutates the weights).

**GRZO** (group-relative zeroth order). Every example ``i`` of the batch gets its own
perturbation of each layer's weight, ``Δᵢ = U ⊙ rᵢ sᵢᵀ``: one Gaussian ``U`` shared by the
batch and per-example random signs ``rᵢ ∈ {±1}^{d_out}``, ``sᵢ ∈ {±1}^{d_in}`` (flipout). The
weights are never changed: forward hooks add ``±σ · rᵢ ⊙ ((xᵢ ⊙ sᵢ) Uᵀ)`` to each linear
layer's output (and ``±σ · x̂ ⊙ (u ⊙ rᵢ)`` to each RMSNorm's). Two forwards give per-example
losses ``ℓᵢ^±``; with ``δᵢ = (ℓᵢ⁺ - ℓᵢ⁻) / 2`` and the advantage ``aᵢ = δᵢ / std(δ)`` (no mean
subtraction), the update is ``W ← W(1 - lr·wd) - lr · U ⊙ (Σᵢ aᵢ rᵢ sᵢᵀ) / (2σB)``. So a batch
of B examples gives B directions for the cost of MeZO's one. Noise and signs come from seeded
``torch.Generator`` s, so ``U`` is regenerated for the update; the signs (``B·(d_out + d_in)``
bytes a layer, int8) are kept from the first forward to the update.

Trained by GRZO: ``nn.Linear`` weights and biases, and the weights of ``leantrain``'s and
torch's ``RMSNorm``. Not trained (left as they are): embeddings, and any weight that is shared
by two modules (tied embeddings / LM head), whose two uses a per-module hook cannot perturb
together. GRZO's ``closure()`` returns a loss per example (MeZO's one number) and must call
the model without ``targets``, so that the LM head's hook sees logits.

**Data parallel** (``torch.distributed`` initialized with more than one rank; ``dp_group=False``
turns it off): every rank perturbs with the same noise, so the weights stay identical on all
ranks, and the only traffic is the losses. MeZO averages ``ℓ₊`` and ``ℓ₋`` over the ranks (one
all-reduce of two numbers). GRZO's signs are drawn for the global batch (every rank draws all of
them from the seeds and uses its own rows), the per-example losses are all-gathered (``2·B``
numbers a rank), and every rank computes the same update from the global batch. The result is the
single process's on the concatenated batch (tested with 2 gloo ranks).

**FSDP2** (parameters that are ``DTensor`` s sharded on dim 0, ``fully_shard``): each rank holds
rows of every weight and perturbs and updates only those, with the noise a single process draws
for them: a noise block that a shard covers in part is drawn (and GRZO's update of it computed)
whole and the shard's part taken (:func:`local_rows`), so the result is the single process's bit
for bit, and only the losses travel besides
FSDP's all-gathers of the weights in each forward. MeZO's forwards then see the perturbed shards
all-gathered; GRZO's hooks run inside the forward, on the all-gathered weights, and its update
writes each rank's rows. (The root module must reshard after its forward, so that a forward
all-gathers the weights as they are now: ``fully_shard(model, reshard_after_forward=True)``.)

Noise is drawn in blocks of rows of a weight, each from its own ``torch.Generator`` seeded by
(run seed, step, parameter, block), so a step's noise is a function of those and of the block
size alone (on one device type: CPU and CUDA generators draw different numbers). The block size
(:func:`noise_block_for`) is 1/256 of the trained elements, between 2¹⁶ and 2²²: at most 0.4 % of
fp32 weights, and few generators a step on a large model (each costs a launch on CUDA).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from leantrain.ops.rng import step_seed
from leantrain.runtime import collectives

NOISE_MIN, NOISE_MAX, NOISE_SHARE = 1 << 16, 1 << 22, 256


def noise_block_for(numel: int) -> int:
    """Elements of noise alive at once for ``numel`` trained elements: ``numel / 256`` within
    [2**16, 2**22]."""
    return min(NOISE_MAX, max(NOISE_MIN, numel // NOISE_SHARE))


def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)


def _row_blocks(rows: int, row_len: int, block: int) -> Iterator[tuple[int, int, int]]:
    """(block index, first row, end row) of ``rows`` rows of ``row_len`` elements, each block at
    most ``block`` elements (one row at least)."""
    per = max(1, block // max(1, row_len))
    for j, r0 in enumerate(range(0, rows, per)):
        yield j, r0, min(rows, r0 + per)


def _noise(seed: int, shape, device) -> Tensor:
    return torch.randn(shape, generator=_generator(device, seed), device=device, dtype=torch.float32)


def local_rows(p: Tensor) -> tuple[Tensor, int]:
    """(the rows of ``p`` this rank holds, the global index of the first): a ``DTensor``'s local
    shard (FSDP2: ``Shard(0)``, the last ranks' shards possibly shorter or empty) and its offset;
    a plain tensor's whole self and 0."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(p, DTensor):
        return p, 0
    if any(isinstance(pl, Shard) and pl.dim != 0 for pl in p.placements):
        raise ValueError(f"zeroth-order methods perturb row shards (Shard(0)) of a DTensor, not {p.placements}")
    local = p.to_local()
    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return local, (offset[0] if local.numel() else 0)


def _overlaps(blocks: Iterator[tuple[int, int, int]], first: int, end: int) -> Iterator[tuple[int, int, int, int, int]]:
    """(block index, block start, block end, overlap start, overlap end) of the ``blocks`` that
    meet the global range [first, end) (a rank's rows)."""
    for j, b0, b1 in blocks:
        lo, hi = max(b0, first), min(b1, end)
        if lo < hi:
            yield j, b0, b1, lo, hi


def _dp(group) -> tuple[object, int, int]:
    """(group, rank, world size): the data-parallel group, None when there is none."""
    if group is False or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None, 0, 1
    world = collectives.world_size(group)
    return (group, collectives.rank(group), world) if world > 1 else (None, 0, 1)


def _signs(seed: int, shape, device) -> Tensor:
    """Random ±1 (int8), each sign drawn independently (not a hash of (row, column): see
    research/memory.md on the rank-1 sign pattern of a linear-congruential hash)."""
    g = _generator(device, seed)
    return torch.randint(0, 2, shape, generator=g, device=device, dtype=torch.int8).mul_(2).sub_(1)


class MeZO(torch.optim.Optimizer):
    """MeZO: ``opt.step(closure)``, ``closure()`` the loss (a number or a 0-d tensor) at the
    current weights; it is called twice, under ``torch.no_grad``.

    ``eps``: the perturbation's scale (one for all groups); ``weight_decay``: decoupled, applied
    in the update as MeZO does (``θ ← θ - lr·(g·z + wd·θ)``); ``seed``: the run's noise seed
    (the step count is mixed in; the same on every rank). ``dp_group``: the data-parallel group
    (default: the whole world when ``torch.distributed`` is initialized; False: none). ``opt.last``:
    ``{"loss", "loss_plus", "loss_minus", "projected_grad"}`` of the last step (global)."""

    def __init__(self, params, lr: float = 1e-6, *, eps: float = 1e-3, weight_decay: float = 0.0, seed: int = 0,
                 noise_block: int | None = None, dp_group=None):
        if lr < 0 or eps <= 0 or weight_decay < 0:
            raise ValueError(f"MeZO: lr >= 0, eps > 0 and weight_decay >= 0, got {lr}, {eps}, {weight_decay}")
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))
        self.eps = float(eps)
        self.seed = int(seed)
        self.steps = 0
        self.last: dict = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.float32:
                    raise ValueError(
                        f"MeZO perturbs the weights in place and restores them by subtraction, which in {p.dtype} "
                        "loses up to ~0.4 % of a weight a step; give it fp32 parameters, or use GRZO (weights never "
                        "mutated)")
                if not p.is_contiguous():
                    raise ValueError("MeZO: parameters must be contiguous")
        self.block = noise_block or noise_block_for(sum(p.numel() for g in self.param_groups for p in g["params"]))
        self._group, _, self._world = _dp(dp_group)

    def _blocks(self) -> Iterator[tuple[dict, Tensor, Tensor]]:
        """(group, the part of a noise block this rank holds as a flat view of a parameter, its noise)
        for the current step. Blocks run over a parameter's global elements; a sharded parameter's
        rank draws each block it meets whole and keeps its part (the single process's numbers)."""
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                key = step_seed(self.seed, index, self.steps)
                local, row0 = local_rows(p)
                flat, first = local.view(-1), row0 * math.prod(p.shape[1:])
                for j, b0, b1, lo, hi in _overlaps(_row_blocks(p.numel(), 1, self.block), first, first + flat.numel()):
                    z = _noise(step_seed(key, j, 1), (b1 - b0,), flat.device)
                    yield group, flat[lo - first:hi - first], z[lo - b0:hi - b0]
                index += 1

    def _perturb(self, scale: float) -> None:
        for _, block, z in self._blocks():
            block.add_(z, alpha=scale)

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor | float]) -> float:  # type: ignore[override]
        if closure is None:
            raise ValueError("MeZO.step needs a closure that returns the loss at the current weights")
        self._perturb(self.eps)
        lp = float(closure())
        self._perturb(-2.0 * self.eps)
        lm = float(closure())
        self._perturb(self.eps)
        if self._world > 1:  # the global batch's losses: the mean of the ranks' means
            p = self.param_groups[0]["params"][0]
            both = torch.tensor([lp, lm], dtype=torch.float64, device=p.device)
            collectives.all_reduce(both, group=self._group)
            lp, lm = (both / self._world).tolist()
        g = (lp - lm) / (2.0 * self.eps)
        if math.isfinite(g):  # a non-finite loss: no update (the weights are restored above)
            for group, block, z in self._blocks():
                lr, wd = group["lr"], group["weight_decay"]
                if wd:
                    block.mul_(1.0 - lr * wd)
                block.add_(z, alpha=-lr * g)
        self.last = {"loss": (lp + lm) / 2, "loss_plus": lp, "loss_minus": lm, "projected_grad": g}
        self.steps += 1
        return (lp + lm) / 2

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["zo"] = {"steps": self.steps, "seed": self.seed, "eps": self.eps}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        zo = state_dict["zo"]
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "zo"})
        self.steps, self.seed, self.eps = int(zo["steps"]), int(zo["seed"]), float(zo["eps"])


def _is_norm(m: nn.Module) -> bool:
    """An RMSNorm with a weight: leantrain's, torch's, or a Hugging Face ``*RMSNorm`` of the Llama
    form ``w ⊙ x / rms(x)`` (Llama, Qwen2, Qwen3, Mistral: ``variance_epsilon``)."""
    from leantrain.model import RMSNorm

    if getattr(m, "weight", None) is None or m.weight.dim() != 1:
        return False
    hf = type(m).__name__.endswith("RMSNorm") and hasattr(m, "variance_epsilon")
    return isinstance(m, (RMSNorm, nn.RMSNorm)) or hf


def _norm_eps(m: nn.Module, dtype) -> float:
    eps = getattr(m, "eps", None)
    if eps is None:
        eps = getattr(m, "variance_epsilon", None)
    return eps if eps is not None else torch.finfo(dtype).eps


class GRZO(torch.optim.Optimizer):
    """GRZO on ``model``'s linear layers and RMSNorm weights: ``opt.step(closure)``,
    ``closure()`` returning the per-example losses ``[B]`` (B >= 2) of one forward at the
    current weights; it is called twice, under ``torch.no_grad``, with the hooks perturbing.

    ``sigma``: the perturbation's scale; ``weight_decay``: decoupled, on weights of two or more
    dimensions only; ``std_floor``: added to ``std(δ)``. ``opt.trained`` / ``opt.frozen``: names
    of the parameters it updates / leaves alone (embeddings, shared weights, frozen ones).
    ``opt.remove()`` takes the hooks off the model. ``opt.last``: the last step's mean loss,
    ``std(δ)`` and the bytes of signs it held. ``noise_block``: elements of noise at once
    (default: :func:`noise_block_for` of the trained elements). ``dp_group``: as MeZO's; every
    rank's closure must return the same number of losses."""

    def __init__(self, model: nn.Module, lr: float = 1e-6, *, sigma: float = 1e-3, weight_decay: float = 0.0,
                 seed: int = 0, std_floor: float = 1e-8, noise_block: int | None = None, dp_group=None):
        if lr < 0 or sigma <= 0 or weight_decay < 0:
            raise ValueError(f"GRZO: lr >= 0, sigma > 0 and weight_decay >= 0, got {lr}, {sigma}, {weight_decay}")
        self.sigma, self.seed, self.std_floor = sigma, seed, std_floor
        self.steps = 0
        self.last: dict = {}
        uses: dict[int, int] = {}
        for m in model.modules():
            for p in m.parameters(recurse=False):
                uses[id(p)] = uses.get(id(p), 0) + 1
        self.modules: list[nn.Module] = []
        for m in model.modules():
            w = getattr(m, "weight", None)
            if not (isinstance(m, nn.Linear) or _is_norm(m)) or w is None or not w.requires_grad or uses[id(w)] > 1:
                continue
            self.modules.append(m)
        taken = {id(p) for m in self.modules for p in m.parameters(recurse=False) if p.requires_grad}
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        self.trained = [names[i] for i in names if i in taken]
        self.frozen = sorted({n for n, p in model.named_parameters(remove_duplicate=False) if id(p) not in taken})
        if not self.modules:
            raise ValueError("GRZO: the model has no trainable nn.Linear or RMSNorm weight that is not shared")
        # one param group of the trained parameters: LR schedulers set its lr as any optimizer's
        super().__init__([p for m in self.modules for p in m.parameters(recurse=False) if p.requires_grad],
                         dict(lr=lr, weight_decay=weight_decay))
        self.block = noise_block or noise_block_for(
            sum(p.numel() for m in self.modules for p in m.parameters(recurse=False) if p.requires_grad))
        self._group, self._rank, self._world = _dp(dp_group)
        self._sign = 0.0  # +1 / -1 inside step(); 0: the hooks do nothing
        self._signs: dict[int, tuple[Tensor, Tensor | None]] = {}
        self._handles = [m.register_forward_hook(self._hook) for m in self.modules]
        self._index = {id(m): i for i, m in enumerate(self.modules)}

    @property
    def lr(self) -> float:
        return self.param_groups[0]["lr"]

    @property
    def weight_decay(self) -> float:
        return self.param_groups[0]["weight_decay"]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # ------------------------------------------------------------------ the perturbed forward
    def _key(self, m: nn.Module) -> int:
        return step_seed(self.seed, self._index[id(m)], self.steps)

    def _signs_of(self, m: nn.Module, batch: int, device) -> tuple[Tensor, Tensor | None]:
        """(r [world·B, d_out], s [world·B, d_in] or None for a norm) of module ``m`` this step,
        the global batch's (this rank's examples are rows rank·B ... rank·B + B - 1); drawn at the
        first forward, kept for the second and the update."""
        rows = batch * self._world
        got = self._signs.get(id(m))
        if got is None or got[0].shape[0] != rows:
            key = self._key(m)
            d_out = m.weight.shape[0]
            r = _signs(step_seed(key, 0, 2), (rows, d_out), device)
            s = _signs(step_seed(key, 1, 2), (rows, m.weight.shape[1]), device) if m.weight.dim() == 2 else None
            got = self._signs[id(m)] = (r, s)
        return got

    def _hook(self, m: nn.Module, inputs, out):
        if not self._sign:
            return None
        x = inputs[0]
        batch = x.shape[0]
        bshape = (batch,) + (1,) * (x.dim() - 2)  # broadcast over the token dimensions
        r, s = self._signs_of(m, batch, x.device)
        mine = slice(self._rank * batch, (self._rank + 1) * batch)
        r, s = r[mine], (None if s is None else s[mine])
        key = self._key(m)
        scale = self._sign * self.sigma
        w = m.weight
        if isinstance(w, DTensor):
            raise ValueError(f"GRZO: {type(m).__name__}'s weight is sharded in its own forward hook (fully_shard on "
                             "the layer itself reshards before it): fully_shard the block that holds it instead")
        if out.shape[-1] != w.shape[0]:
            raise ValueError(f"GRZO: {type(m).__name__}'s output has {out.shape[-1]} features, not {w.shape[0]}: "
                             "call the model without targets (per-example losses from its logits)")
        if w.dim() == 2:  # flipout: out += ±σ · r ⊙ ((x ⊙ s) Uᵀ), U in row blocks
            xs = x * s.view(*bshape, -1).to(x.dtype)
            for j, r0, r1 in _row_blocks(w.shape[0], w.shape[1], self.block):
                u = _noise(step_seed(key, j, 3), (r1 - r0, w.shape[1]), w.device).to(x.dtype)
                out[..., r0:r1] += (xs @ u.t()) * (scale * r[:, r0:r1].view(*bshape, -1).to(x.dtype))
            if getattr(m, "bias", None) is not None and m.bias.requires_grad:
                ub = _noise(step_seed(key, 0, 4), w.shape[:1], w.device)
                out += (scale * ub * r.to(torch.float32)).view(*bshape, -1).to(out.dtype)
        else:  # RMSNorm: out += ±σ · x̂ ⊙ (u ⊙ r)
            xf = x.float()
            eps = _norm_eps(m, x.dtype)
            xhat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            u = _noise(step_seed(key, 0, 3), w.shape, w.device)
            out += (xhat * (scale * u * r.to(torch.float32)).view(*bshape, -1)).to(out.dtype)
        return out

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor]) -> float:
        if closure is None:
            raise ValueError("GRZO.step needs a closure that returns the per-example losses at the current weights")
        try:
            self._sign = 1.0
            lp = closure().detach().float().flatten()
            self._sign = -1.0
            lm = closure().detach().float().flatten()
        finally:
            self._sign = 0.0
        if lp.numel() < 2 or lp.shape != lm.shape:
            raise ValueError(f"GRZO: closure() must return one loss per example, at least 2 (got {tuple(lp.shape)})")
        if self._world > 1:  # every rank gets the global batch's losses, in rank order
            n = torch.tensor([lp.numel()], device=lp.device)
            ns = torch.empty(self._world, dtype=n.dtype, device=n.device)
            collectives.all_gather_into_tensor(ns, n, group=self._group)
            if bool((ns != n).any()):
                raise ValueError(f"GRZO: the ranks' closures returned {ns.tolist()} losses; every rank must return as many")
            both = torch.empty(self._world * 2, lp.numel(), dtype=lp.dtype, device=lp.device)
            collectives.all_gather_into_tensor(both, torch.stack([lp, lm]), group=self._group)
            lp, lm = both[0::2].reshape(-1), both[1::2].reshape(-1)
        delta = (lp - lm) / 2
        std = delta.std()
        sign_bytes = sum(t.numel() for rs in self._signs.values() for t in rs if t is not None)
        ok = bool(torch.isfinite(delta).all())
        if ok:
            a = delta / (std + self.std_floor)
            self._update(a)
        self.last = {"loss": float((lp + lm).mean() / 2), "delta_std": float(std), "sign_bytes": sign_bytes,
                     "updated": ok}
        self._signs.clear()
        self.steps += 1
        return self.last["loss"]

    def _update(self, a: Tensor) -> None:
        batch = a.numel()
        coef = -self.lr / (2.0 * self.sigma * batch)
        for m in self.modules:
            w = m.weight
            key = self._key(m)
            r, s = self._signs.get(id(m), (None, None))
            if r is None:  # the module did not run in this forward: nothing to estimate
                continue
            # (under FSDP this rank's rows, else the whole weight; each product is computed over a
            # whole noise block, as one process does, and this rank's rows taken: bit for bit)
            local, row0 = local_rows(w)
            rows = slice(row0, row0 + local.shape[0])
            ar = a.to(local.device)[:, None] * r.to(torch.float32)  # [B, d_out]
            if w.dim() == 2:
                sf = s.to(torch.float32)
                if self.weight_decay:
                    local.mul_(1.0 - self.lr * self.weight_decay)
                blocks = _row_blocks(w.shape[0], w.shape[1], self.block)
                for j, r0, r1, lo, hi in _overlaps(blocks, rows.start, rows.stop):
                    u = _noise(step_seed(key, j, 3), (r1 - r0, w.shape[1]), local.device)
                    step = (u * (ar[:, r0:r1].t() @ sf))[lo - r0:hi - r0]
                    local[lo - row0:hi - row0].add_(step.to(local.dtype), alpha=coef)
                if getattr(m, "bias", None) is not None and m.bias.requires_grad:
                    bias, b0 = local_rows(m.bias)
                    brows = slice(b0, b0 + bias.shape[0])
                    ub = _noise(step_seed(key, 0, 4), w.shape[:1], local.device)
                    bias.add_((ub * ar.sum(0))[brows].to(bias.dtype), alpha=coef)
            else:
                u = _noise(step_seed(key, 0, 3), w.shape, local.device)
                local.add_((u * ar.sum(0))[rows].to(local.dtype), alpha=coef)

    def state_dict(self) -> dict:
        return {"steps": self.steps, "seed": self.seed, "lr": self.lr, "sigma": self.sigma,
                "weight_decay": self.weight_decay, "std_floor": self.std_floor}

    def load_state_dict(self, sd: dict) -> None:
        self.steps, self.seed = int(sd["steps"]), int(sd["seed"])
        self.param_groups[0]["lr"], self.sigma = float(sd["lr"]), float(sd["sigma"])
        self.param_groups[0]["weight_decay"], self.std_floor = float(sd["weight_decay"]), float(sd["std_floor"])


__all__ = ["MeZO", "GRZO", "noise_block_for"]

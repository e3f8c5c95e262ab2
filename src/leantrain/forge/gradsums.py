"""Per-layer gradient sums of squares of one FORGE step, and the clipping scales made from them.

Every fused layer has a slot (its position in ``ForgeOptimizer.layers``); one more slot holds
the non-fused parameters together. :class:`GradSums` keeps, on the device:

- ``sq[slot]``: this step's sum of squares of the slot's gradient (raw: may be non-finite).
  ``opt.step()`` reads the whole array at once for the global norm and the non-finite report;
- ``scale[slot]``: the clipping scale the slot's update reads (``clip="layer"`` / ``"est_global"``);
- ``clip="est_global"``'s estimate: the running sums ``run = (S, C, Q)`` of this backward,
  each slot's prediction ``pred`` and their ``total`` (see ``ForgeOptimizer._scale_torch``).

Why a kernel. Both clipping modes need a layer's norm before its update. In torch that is
~20 small operations a layer (squares, sum, finiteness, the estimate's running sums, clamp)
and the step of the ``1b`` preset (155 fused layers) became host-bound. :meth:`GradSums.scale_kernel`
does it in one launch: each program sums the squares of its chunk of the materialized dW, stores
the partial, and takes a ticket (an acq_rel atomic); the program holding the last ticket
adds the partials in a fixed order (deterministic) and does the scalar arithmetic. The
arithmetic is the torch reference's, operation by operation (``c / x`` as torch computes a
scalar over a tensor: ``reciprocal(x) * c``; IEEE ``div_rn`` / ``sqrt_rn``), so the two
agree to the bit whenever their sums of squares agree (tests feed integer-valued gradients).
"""

from __future__ import annotations

import torch
from torch import Tensor

from leantrain.ops._backend import HAS_TRITON, interpreting, launch, next_pow2

CLIP_EPS = 1e-6
_GPU_PROGRAMS, _GPU_BLOCK = 264, 4096  # two waves of 132 SMs; 16 KiB of fp32 per iteration
_CPU_PROGRAMS, _CPU_BLOCK = 4, 64  # the interpreter: a few programs, so the ticket path is exercised

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _recip_times(x, c):
        """``c / x`` as torch computes ``python_scalar / tensor``: ``reciprocal(x) * c``."""
        return tl.div_rn(tl.zeros_like(x) + 1.0, x) * c

    @triton.jit
    def _clamp_max1(x):
        """``torch.clamp(x, max=1)``: NaN stays NaN."""
        return tl.where(x != x, x, tl.minimum(x, 1.0))

    # slot, the flags and the program count change from launch to launch: not specialized
    # (an int equal to 1 would compile another kernel at step 2, when predictions first exist)
    @triton.jit(do_not_specialize=["npart", "slot", "has_pred", "have_total"])
    def _clip_scale_kernel(G, n, chunk, npart, PART, TICKET, SQ, SCALE, RUN, PRED, TOTAL, slot, has_pred,
                           have_total, clip, EST: tl.constexpr, BLOCK: tl.constexpr, PBLOCK: tl.constexpr):
        pid = tl.program_id(0)
        start = pid.to(tl.int64) * chunk  # 64-bit offsets: a layer may hold more than 2^31 elements
        end = tl.minimum(start + chunk, n)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for off in range(start, end, BLOCK):
            idx = off + tl.arange(0, BLOCK)
            x = tl.load(G + idx, mask=idx < n, other=0.0).to(tl.float32)  # (chunks are whole blocks: idx < end too)
            acc += x * x
        tl.store(PART + pid, tl.sum(acc, axis=0))
        tl.debug_barrier()  # every thread's store before the ticket (released by the atomic)
        ticket = tl.atomic_add(TICKET, 1, sem="acq_rel")
        if ticket == npart - 1:  # the last program: every partial is visible (acquired)
            offs = tl.arange(0, PBLOCK)
            ss = tl.sum(tl.load(PART + offs, mask=offs < npart, other=0.0), axis=0)
            tl.store(SQ + slot, ss)
            if EST:
                ok = tl.abs(ss) <= 3.4028234663852886e38  # finite (NaN compares false)
                v = tl.where(ok, ss, 0.0)
                s = tl.load(RUN) + v
                c = tl.load(RUN + 1)
                q = tl.load(RUN + 2)
                has = has_pred != 0
                c = tl.where(has, c + v, c)
                q = tl.where(has, q + tl.where(ok, tl.load(PRED + slot), 0.0), q)
                tl.store(RUN, s)
                tl.store(RUN + 1, c)
                tl.store(RUN + 2, q)
                ratio = tl.where(q > 0, tl.div_rn(c, tl.maximum(q, 1e-30)), 0.0)
                est = tl.where(have_total != 0, s + tl.maximum(tl.load(TOTAL) - q, 0.0) * ratio, s)
            else:
                est = ss
            tl.store(SCALE + slot, _clamp_max1(_recip_times(tl.sqrt_rn(est) + 1e-6, clip)))  # 1e-6: CLIP_EPS
            tl.store(TICKET, 0)  # ready for the next launch (stream-ordered after this one)


class GradSums:
    """The device arrays of one optimizer (module docstring); ``nslots`` fused layers."""

    def __init__(self, nslots: int, device, beta: float):
        f32 = dict(dtype=torch.float32, device=device)
        self.nslots, self.beta = nslots, beta
        self.sq = torch.zeros(nslots + 1, **f32)
        self.scale = torch.ones(nslots, **f32)
        self.run = torch.zeros(3, **f32)
        self.pred = torch.zeros(nslots + 1, **f32)
        self.total = torch.zeros((), **f32)
        # one ticket per slot for FORGE kernels that sum their own tiles (kernel.launch_forge(sq=...))
        self.tickets = torch.zeros(nslots + 1, dtype=torch.int32, device=device)
        self.ticket_views = [self.tickets[i] for i in range(nslots + 1)]
        self.has = [False] * (nslots + 1)  # host: a slot has a prediction (a step folded it)
        self.have_total = False  # host: some slot has
        # 0-d views made once: a layer's launch passes its own (no view op per layer)
        self.sq_views = [self.sq[i] for i in range(nslots + 1)]
        self.scale_views = [self.scale[i] for i in range(nslots)]
        self._part: Tensor | None = None
        self._ticket: Tensor | None = None
        self._masks: dict = {}

    # ------------------------------------------------------------------ per layer

    def scale_torch(self, slot: int, est: bool, clip_value: float) -> Tensor:
        """The reference: the scale of ``slot`` from ``sq[slot]`` (already written), in torch ops."""
        ss = self.sq_views[slot]
        if not est:
            return torch.clamp(clip_value / (ss.sqrt() + CLIP_EPS), max=1.0)
        ok = torch.isfinite(ss)
        cur = torch.where(ok, ss, torch.zeros_like(ss))  # a skipped layer adds nothing
        s, c, q = self.run[0] + cur, self.run[1], self.run[2]
        if self.has[slot]:  # a non-finite layer stays in the predicted rest
            c = c + cur
            q = q + torch.where(ok, self.pred[slot], torch.zeros_like(cur))
        self.run.copy_(torch.stack([s, c, q]))
        est_sq = s
        if self.have_total:
            ratio = torch.where(q > 0, c / q.clamp_min(1e-30), torch.zeros_like(q))
            est_sq = s + (self.total - q).clamp_min(0) * ratio
        return torch.clamp(clip_value / (est_sq.sqrt() + CLIP_EPS), max=1.0)

    def scale_kernel(self, slot: int, buf: Tensor, est: bool, clip_value: float) -> Tensor:
        """``sq[slot] = Σ buf²`` and the slot's scale in one launch; returns ``scale[slot]``."""
        n = buf.numel()
        on_gpu = buf.is_cuda and not interpreting()
        programs, block = (_GPU_PROGRAMS, _GPU_BLOCK) if on_gpu else (_CPU_PROGRAMS, _CPU_BLOCK)
        chunk = max(1, -(-n // programs))
        chunk = -(-chunk // block) * block
        npart = max(1, -(-n // chunk))
        if self._part is None or self._part.numel() < programs:
            self._part = torch.empty(programs, dtype=torch.float32, device=buf.device)
            self._ticket = torch.zeros(1, dtype=torch.int32, device=buf.device)
        launch(_clip_scale_kernel, (npart,), buf, n, chunk, npart, self._part, self._ticket, self.sq, self.scale,
               self.run, self.pred, self.total, slot, int(self.has[slot]), int(self.have_total), float(clip_value),
               EST=bool(est), BLOCK=block, PBLOCK=next_pow2(programs))
        return self.scale_views[slot]

    # ------------------------------------------------------------------ end of step

    def fold(self, slots: list[int]) -> None:
        """est_global: fold this step's sums of ``slots`` into their predictions, the geometric
        moving average ``pred ← pred^β · s^(1-β)`` (the first one: ``s``); a non-finite sum keeps
        the old prediction (0 when there is none)."""
        key = tuple(slots)
        masks = self._masks.get(key)
        if masks is None:
            ran = torch.zeros(self.nslots + 1, dtype=torch.bool)
            ran[list(slots)] = True
            masks = self._masks[key] = ran.to(self.sq.device)
        has_before = self._has_mask()
        s, old = self.sq, self.pred
        new = s
        if self.beta > 0:
            tiny = torch.finfo(torch.float32).tiny
            gm = torch.exp(self.beta * old.clamp_min(tiny).log() + (1 - self.beta) * s.clamp_min(tiny).log())
            new = torch.where(has_before, gm, s)
        upd = torch.where(torch.isfinite(s), new, torch.where(has_before, old, torch.zeros_like(old)))
        self.pred.copy_(torch.where(masks, upd, old))
        for i in slots:
            self.has[i] = True
        self._set_total(has_before | masks)

    def _has_mask(self) -> Tensor:
        return torch.tensor(self.has, dtype=torch.bool).to(self.pred.device)

    def _set_total(self, has: Tensor) -> None:
        """``total``: the sum of the predictions of the slots that have one (``has``, on the device)."""
        self.total.copy_(torch.where(has, self.pred, torch.zeros_like(self.pred)).sum())
        self.have_total = any(self.has)

    # ------------------------------------------------------------------ checkpoints

    def predictions(self) -> dict[int, Tensor]:
        """``{slot: prediction}`` of the slots that have one (CPU copies)."""
        return {i: self.pred[i].detach().cpu().clone() for i, h in enumerate(self.has) if h}

    def load_predictions(self, preds: dict[int, Tensor]) -> None:
        self.pred.zero_()
        self.has = [False] * (self.nslots + 1)
        for i, t in preds.items():
            self.pred[i] = t.to(self.pred.device)
            self.has[i] = True
        self._set_total(self._has_mask())


__all__ = ["GradSums", "CLIP_EPS"]

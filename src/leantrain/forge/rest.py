"""``step()`` of ForgeOptimizer (:class:`RestMixin`): the parameters no layer update took (norms,
embeddings, tied weights, unfused biases) stepped from their ``.grad`` with the same rule, and
the step closed: the global norm, the non-finite report, the clip state of the next step.

On the Triton backend a non-fused parameter is stepped by the update kernel (one launch instead
of ~20 small torch ops); the small 1-D ones that share a dtype, state kinds, param group and step
count go in one launch over their concatenation (``update_launch.update_many``).
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from leantrain.forge import launch as K
from leantrain.forge.gradsums import CLIP_EPS
from leantrain.forge.shards import RowShards, local, local_state
from leantrain.ops.rng import kernel_key
from leantrain.runtime import collectives


class RestMixin:
    """``step()`` and the non-fused parameters of :class:`leantrain.forge.optimizer.ForgeOptimizer`."""

    @torch.no_grad()
    def step(self, closure=None):
        """The optimizer step after backward: runs ``closure``, joins the side stream, steps every
        parameter the backward did not (non-linear parameters, weights used outside their layer's
        forward) from its reduced gradient with the non-finite gate and the clip, and records the
        layers' sums of squares for the clip. One function (about 120 lines): its parts share the
        step's gradients, gates and sums in this order."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.join()
        self._end_accumulation()  # (every accumulated layer gradient was consumed by its update)
        # every parameter with a gradient: fused layers leave none, unless a weight was used without
        # its layer's forward (F.linear(x, layer.weight)): then it is stepped here, from its gradient
        rest = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if self.layers and len(rest) > self._n_rest_seen:
            self._warn_unfused(rest)
        self._reduce_grads(rest)
        # the fused layers' sums of squares: already in one device array (slot order)
        slots = sorted(self._ran)
        flag_names = [self.layers[i].name for i in slots]  # then the non-fused parameters'
        fused_sq = tp_sq = None
        if slots:
            if len(slots) == len(self.layers):
                fused_sq = self._sums.sq[: len(slots)]
            else:
                fused_sq = self._sums.sq[torch.tensor(slots, device=self._sums.sq.device)]
            tp = [j for j, i in enumerate(slots) if self.layers[i].tp_group is not None]
            if tp:
                tp_sq = fused_sq[tp]
        names = self._names
        if names is None:
            names = self._names = {p: n for n, p in self.model.named_parameters()}
        grads = []
        for p in rest:
            if p.grad.is_sparse:
                raise RuntimeError("FORGE does not support sparse gradients")
            # bf16 / fp32 gradients as stored (the update kernel reads either; _apply_rule upcasts);
            # of a DTensor (FSDP2) parameter, this rank's shard of FSDP's averaged gradient
            g = local(p.grad)
            grads.append((p, g if g.dtype in (torch.float32, torch.bfloat16) else g.float()))
            flag_names.append(names.get(p, "?"))
        rest_sq = None  # the non-fused parameters' sums of squares: one multi-tensor norm launch, fp32
        if grads:
            rest_sq = torch.stack(torch._foreach_norm([g for _, g in grads], 2, dtype=torch.float32)).square()
            if self.sharded:  # every shard's sum: the whole parameters' (the same on every rank)
                if self._rest_shards is None:
                    self._rest_shards = RowShards.of(grads[0][0], flag_names[len(slots)])
                collectives.all_reduce(rest_sq, group=self._rest_shards.shard_group)
        total, others = None, None
        stacked = finite = None
        if flag_names:  # one array, one isfinite for every layer and parameter (host time: not one per sum)
            if fused_sq is None:
                stacked = rest_sq
            else:  # (read now: the array is rewritten next step)
                stacked = torch.cat([fused_sq, rest_sq]) if rest_sq is not None else fused_sq
            finite = torch.isfinite(stacked)
            total = stacked.sum()
            if tp_sq is not None and self.clip in ("prev_global", "est_global"):  # TP shards: the other ranks' once
                group = next(layer.tp_group for layer in self.layers if layer.tp_group is not None)
                extra = tp_sq.sum()
                shard = extra.clone()
                collectives.all_reduce(extra, group=group)
                others = extra - shard
                total = total + others
        rest_scale = None
        if self.clip == "est_global" and grads:  # every gradient is known now: the exact global norm
            known = torch.where(finite, stacked, torch.zeros_like(stacked)).sum()
            if others is not None:
                known = known + torch.where(torch.isfinite(others), others, torch.zeros_like(others))
            rest_scale = torch.clamp(self.clip_value / (known.sqrt() + CLIP_EPS), max=1.0)
        if grads:
            r0 = len(slots)  # the non-fused parameters' sums come last
            rest_ok = finite[r0:]
            scales = None  # each non-fused parameter's clipping scale (None: not clipped)
            if self.clip == "est_global":
                scales = rest_scale.expand(len(grads))
            elif self.clip == "layer":
                scales = torch.clamp(self.clip_value / (stacked[r0:].sqrt() + CLIP_EPS), max=1.0)
            elif self.clip == "prev_global" and self._clip_scale is not None:
                scales = self._clip_scale.expand(len(grads))
            # the kernel's gate per parameter: its scale (or 1), NaN (store nothing) when not finite
            ones = torch.ones_like(stacked[r0:])
            gates = torch.where(rest_ok, ones if scales is None else scales, torch.full_like(ones, float("nan")))
        buckets = None  # the small 1-D parameters stepped together (kernel.Buckets, update_many)
        for i, (p, g) in enumerate(grads):
            state = self._init_state(p)
            state["step"] += 1
            if not self.sharded and self._rest_on_kernel(p, state):
                bkey = self._bucket_key(p, g, state)
                if bkey is not None:
                    if buckets is None:
                        buckets = K.Buckets()
                    buckets.add(bkey, (i, p, g, state), p.numel())
                else:
                    self._step_rest_kernel(p, g, state, gates[i])
                continue
            g = g.float()
            if scales is not None:
                g = g * scales[i]
            if self.sharded:  # this rank's rows of the parameter and its state (views: written in place)
                self._apply_rule(local(p), g, local_state(state), self._hp(p), state["step"], self.param_index[p],
                                 ~rest_ok[i])
            else:
                self._apply_rule(p, g, state, self._hp(p), state["step"], self.param_index[p], ~rest_ok[i])
        for items in buckets or ():
            if len(items) == 1:
                i, p, g, state = items[0]
                self._step_rest_kernel(p, g, state, gates[i])
            else:
                self._step_rest_bucket(items, gates)
        self._last_flags = (flag_names, None if finite is None else ~finite)
        if total is not None:
            self._last_norm = total.sqrt()
            if self.clip == "prev_global":
                ok = torch.isfinite(self._last_norm)
                new = torch.clamp(self.clip_value / (self._last_norm + CLIP_EPS), max=1.0)
                old = self._clip_scale if self._clip_scale is not None else torch.ones_like(new)
                new = torch.where(ok, new, old)  # a non-finite step keeps the old scale
                if self._clip_scale is None:
                    self._clip_scale = new
                else:  # in place: a captured launch holds this tensor
                    self._clip_scale.copy_(new)
            elif self.clip == "est_global":  # fold this step's sums into the predictions
                units = list(slots)
                unit = [t for t in (None if rest_sq is None else rest_sq.sum(), others) if t is not None]
                if unit:  # the non-fused parameters (and other TP ranks' shards) as one unit
                    self._grad_sums(unit[0].device).sq_views[len(self.layers)].copy_(sum(unit))
                    units.append(len(self.layers))
                self._sums.fold(units)
        if self._sums is not None and self.clip == "est_global":
            self._sums.run.zero_()
        self._ran = []
        self._dyn_ready = False
        self._workspace.release()
        self._shard_workspace.release()
        self._step_id += 1
        return loss

    def _warn_unfused(self, rest: list[Tensor]) -> None:
        """Say once which fused layers' parameters got a gradient (used outside the layer's forward)."""
        self._n_rest_seen = len(rest)
        have = {id(p) for p in rest}
        odd = [layer.name for layer in self.layers
               if id(layer.weight) in have or (layer.bias is not None and id(layer.bias) in have)]
        new = [n for n in odd if n not in self._warned]
        if new:
            self._warned.update(new)
            warnings.warn(f"FORGE: parameters of {', '.join(new)} got a gradient instead of their fused update "
                          "(the weight used without the layer's forward, e.g. F.linear(x, layer.weight), or "
                          "frozen since attach while its bias trains); step() steps them from that gradient "
                          "(the same update, not fused)", stacklevel=3)

    def _rest_on_kernel(self, p: Tensor, state: dict) -> bool:
        """A non-fused parameter is stepped by the kernel's update-only mode (one launch instead
        of ~20 small torch ops: the host time of ``step()``) on the Triton backend, when its
        states are stored as the kernel reads them (8-bit states: 2-D parameters, or 1-D ones of
        a multiple of 16 elements with packed states, viewed as ``[n / 16, 16]``: then the kernel's
        16 x 16 blocks are the flat blocks of 256)."""
        if p.dim() not in (1, 2) or p.dtype not in (torch.float32, torch.bfloat16):
            return False
        if self._backend_for(p) != "triton":
            return False
        kinds = [self.storage.kind_of(state, k) for k in self.rule.state_names]
        return p.dim() == 2 or ("int8" not in kinds and "fp8" not in kinds
                                and ("int8p" not in kinds or p.numel() % 16 == 0))

    def _step_rest_kernel(self, p: Tensor, g: Tensor, state: dict, gate: Tensor) -> None:
        """The rule on a whole non-fused parameter in the kernel's update-only mode. ``gate``
        (fp32 scalar) multiplies the gradient (the clipping scale, or 1) and is NaN when the
        gradient is not finite: the kernel then stores nothing, so the whole parameter keeps
        its value and state (the per-parameter semantics of ``_apply_rule``)."""
        names = self.rule.state_names
        kinds = [self.storage.kind_of(state, k) for k in names]
        packed = p.dim() == 1 and "int8p" in kinds  # [n / 16, 16]: 16 x 16 blocks = flat blocks of 256
        as2d = (lambda t: t) if p.dim() == 2 else (lambda t: t.view(-1, 16)) if packed else (lambda t: t.view(1, -1))
        states = [state[k].view(-1, 1, 16, 16) if packed and kind == "int8p"
                  else state[k] if kind in ("int8", "int8p", "fp8") else as2d(state[k]) for k, kind in zip(names, kinds, strict=True)]
        qt = [self.storage.kernel_table(state, k, k in self.rule.signed_states, p.device) for k in names]
        step = state["step"]
        K.launch_forge(K.MODE_UPDATE, w=as2d(p.data), states=states, kinds=kinds, qtables=qt,
                       rule_name=self.rule.name, hp=self.param_groups[self._group_of[id(p)]], step=step,
                       sr=self.stochastic_rounding, key=kernel_key(self._seed(self.param_index[p], step)),
                       g=as2d(g.contiguous()), scale=gate, approx=self.fast_math)

    def _bucket_key(self, p: Tensor, g: Tensor, state: dict) -> tuple | None:
        """What a non-fused parameter on the kernel must share with others to be stepped in the
        same launch (None: its own launch, ``kernel.bucket_ok``): the device, dtypes, state kinds,
        param group and step count."""
        if not self.rest_buckets or p.dim() != 1:
            return None
        kinds = tuple(self.storage.kind_of(state, k) for k in self.rule.state_names)
        if not K.bucket_ok(p, kinds):
            return None
        return p.device, p.dtype, g.dtype, kinds, self._group_of[id(p)], state["step"]

    def _step_rest_bucket(self, items: list, gates: Tensor) -> None:
        """Step several small 1-D non-fused parameters (``(i, p, g, state)``, ``gates[i]`` each
        one's gate, as :meth:`_step_rest_kernel`) in one update launch (``kernel.update_many``):
        every parameter gets the bits of its own launch; one whose gradient is not finite keeps
        its value and state."""
        ps = [p for _, p, _, _ in items]
        sts = [st for _, _, _, st in items]
        dev = ps[0].device
        ids = tuple(id(p) for p in ps)
        index = self._bucket_index.get(ids)
        if index is None:
            index = self._bucket_index[ids] = torch.tensor([i for i, _, _, _ in items], device=dev)
        names = self.rule.state_names
        step = sts[0]["step"]
        sr = self.stochastic_rounding and ps[0].dtype == torch.bfloat16
        keys = K.device_keys(self.seed, [self.param_index[p] for p in ps], step, dev) if sr else None
        K.update_many([p.data for p in ps], [g for _, _, g, _ in items], [[st[k] for st in sts] for k in names],
                      [self.storage.kind_of(sts[0], k) for k in names],
                      [self.storage.kernel_table(sts[0], k, k in self.rule.signed_states, dev) for k in names],
                      rule_name=self.rule.name, hp=self.param_groups[self._group_of[id(ps[0])]], step=step, sr=sr,
                      keys=keys, scale=gates.index_select(0, index), approx=self.fast_math)

    def _reduce_grads(self, params: list[Tensor]) -> None:
        """Average non-fused grads over DP; sum sequence-parallel partial grads over their TP group."""
        sp = [p for p in params if getattr(p, "_lt_sp_group", None) is not None]
        for p in sp:
            collectives.all_reduce(p.grad, group=p._lt_sp_group)
        if self.dp_group is None or not params:
            return
        flat = torch.cat([p.grad.reshape(-1).float() for p in params])
        self._dp_average(flat)
        off = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[off:off + n].view_as(p.grad))
            off += n

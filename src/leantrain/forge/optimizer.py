"""``lt.forge.attach`` / ``detach`` and ``ForgeOptimizer``: the optimizer step inside backward.

``attach(model, rule)`` swaps the forward of every ``nn.Linear`` (and every module exposing a
``linear_fn``, e.g. ``lt.dist.tp`` layers) for :class:`leantrain.forge.linear.ForgeLinearFn`
and returns a :class:`ForgeOptimizer`. During ``loss.backward()`` each layer's weight (and
bias) is updated as soon as its ``dY`` is known; ``opt.step()`` then steps the remaining
parameters (norms, embeddings, tied weights, non-fused biases) with the same rule from
their ``.grad`` and closes the step (norms for ``clip="prev_global"`` / ``"est_global"``, non-finite
report).

Per layer, in backward (``update_layer``):
1. gradient accumulation: with ``grad_accum > 1``, the backwards of a step's first micro-batches
   add dW into the layer's accumulation buffer and stop here (:mod:`.accumulate`); otherwise a
   layer updated twice before ``step()`` is an error;
2. dW: fused into the Triton kernel's tile loop (nothing materialized), or, when it must be
   seen whole first (data parallel all-reduce, ``clip="layer"`` / ``"est_global"``, the torch backend, or
   the split path on CUDA, :mod:`leantrain.forge.dispatch`), computed into one reused fp32
   workspace (bounded by the largest layer), reduced, clipped, consumed, released;
3. the rule, on the layer's own step count (bias correction), lr and hyper-parameters read
   from ``param_groups`` at that moment (so LR schedulers work);
4. a non-finite gradient leaves the layer (torch backend) or the tile (Triton) untouched.
No host synchronization: flags and norms stay on the device until someone reads
``last_nonfinite`` / ``last_grad_norm``.

The class is assembled from one file per part: the per-layer paths (:mod:`.layer_update`),
gradient accumulation (:mod:`.accumulate`),
``step()`` and the non-fused parameters (:mod:`.rest`), CUDA-graph capture (:mod:`.capture`),
the gradient norms and clip scales (:mod:`.gradsums`), weights sharded by rows as FSDP2's
``DTensor`` s (:mod:`.shards`: each layer's dW reduce-scattered, the rule on this rank's rows);
``attach`` / ``detach`` are in :mod:`.attach`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor, nn

from leantrain.forge.accumulate import AccumulateMixin, check_accumulation
from leantrain.forge.capture import CaptureMixin, _DynTable
from leantrain.forge.dispatch import SPLIT_TOKENS, WS_TOKENS, check_kernel
from leantrain.forge.gradsums import GradSums
from leantrain.forge.layer_update import LayerUpdateMixin, _Workspace
from leantrain.forge.linear import ForgeLayer, patch
from leantrain.forge.rest import RestMixin
from leantrain.forge.shards import ShardedUpdateMixin, check_sharded
from leantrain.model.extension import owner_of
from leantrain.ops.rng import step_seed
from leantrain.optim.rules import Rule
from leantrain.optim.state import StateStorage
from leantrain.runtime import collectives

CLIPS = ("none", "layer", "prev_global", "est_global")
# est_global: each unit's predicted sum of squares is the geometric moving average
# pred <- pred^b * s^(1-b) of its past ones (0: the previous step's); 0.5 was the closest to the
# unclipped baseline on the tiny preset (docs/forge.md).
_EST_BETA = 0.5


def _check_clip(clip: str, clip_value: float) -> None:
    if clip in ("global", "norm", "global_norm"):
        raise ValueError(
            "FORGE updates each layer inside backward, before the global gradient norm exists, so "
            "clipping by the global norm is impossible. Use clip='est_global' (every gradient scaled by "
            "min(1, clip_value / an estimate of this step's global norm)), clip='layer' (each layer's "
            "gradient clipped to norm clip_value on its own) or clip='prev_global' (scaled by "
            "min(1, clip_value / previous step's global norm)), or the unfused lt.optim.Optimizer "
            "with torch.nn.utils.clip_grad_norm_."
        )
    if clip not in CLIPS:
        raise ValueError(f"clip must be one of {CLIPS}, got {clip!r}")
    if clip != "none" and not (clip_value > 0 and math.isfinite(clip_value)):
        raise ValueError(f"clip_value must be a finite number > 0, got {clip_value}")


class ForgeOptimizer(AccumulateMixin, LayerUpdateMixin, ShardedUpdateMixin, RestMixin, CaptureMixin,
                     torch.optim.Optimizer):
    """Returned by :func:`leantrain.forge.attach`; see the module docstring. Not built directly."""

    def __init__(self, model: nn.Module, rule: Rule, *, state_dtype="fp32", stochastic_rounding=True,
                 backend="auto", clip="none", clip_value=1.0, dp_group=None, split_tokens=SPLIT_TOKENS, seed=0,
                 allreduce=None, grad_dtype="fp32", overlap=False, param_groups=None, ws_tokens=WS_TOKENS,
                 fast_math=False, kernel="auto", rest_buckets=True, grad_accum=1, accum_dtype="bf16",
                 accum_error_feedback=True):
        """Check the arguments, find the linear layers to fuse and the rest, make the state storage,
        per-layer bookkeeping and launch caches, and patch the layers. One function (about 95
        lines): each step sets attributes the next reads, and most of its length is the checks."""
        if not isinstance(rule, Rule):
            raise TypeError(f"rule must be a leantrain.optim rule (e.g. lt.optim.AdamW(...)), got {type(rule).__name__}")
        _check_clip(clip, clip_value)
        if backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
        if grad_dtype not in ("fp32", "bf16"):
            raise ValueError(f"grad_dtype must be 'fp32' or 'bf16', got {grad_dtype!r}")
        check_kernel(kernel, split_tokens, ws_tokens)
        check_accumulation(grad_accum, accum_dtype)
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be True or False, got {overlap!r}")
        if any(owner_of(m) == "FORGE" for m in model.modules()):
            raise RuntimeError("FORGE is already attached to this model; call lt.forge.detach(model) first")
        wrapped = [type(m).__name__ for m in model.modules()
                   if type(m).__name__ in ("DistributedDataParallel", "FullyShardedDataParallel")]
        if wrapped:  # their gradient hooks wait for gradients FORGE never materializes
            raise ValueError(f"FORGE: the model is wrapped in {wrapped[0]}, whose gradient reduction waits for "
                             "gradients FORGE never materializes; attach to the unwrapped model: FORGE reduces "
                             "each layer's gradient over data parallelism itself, inside backward (dp_group=)")
        self.rule = rule
        self.storage = StateStorage(state_dtype)
        self.stochastic_rounding = stochastic_rounding
        self.backend = backend
        self.clip, self.clip_value = clip, float(clip_value)
        self.kernel = kernel
        self.split_tokens = split_tokens
        self.ws_tokens = ws_tokens
        self._ws: dict = {}  # device -> whether forge/ws.py's kernel runs there
        self.grad_dtype = grad_dtype
        self.fast_math = bool(fast_math)
        self.seed = int(seed)
        self.overlap = overlap
        self._side: torch.cuda.Stream | None = None  # the updates' stream (overlap, CUDA)
        self._side_busy = False  # work issued on it since the current stream last waited for it
        self._join_task = None  # the backward pass (autograd graph task) whose end joins the side stream
        self._workspace = _Workspace()
        self._backends: dict[bool, str] = {}  # w.is_cuda -> resolved backend
        self._step_id = 0
        self._ran: list[int] = []  # slots of the layers updated in this backward
        self._last_flags: tuple[list[str], Tensor | None] = ([], None)  # names, non-finite flags
        self._last_norm: Tensor | None = None
        self._clip_scale: Tensor | None = None  # prev_global: min(1, c / previous global norm)
        self._names: dict | None = None  # parameter -> name (metrics), built at the first step
        self._n_rest_seen = 0  # the most parameters step() has seen with a gradient (_warn_unfused)
        self._warned: set[str] = set()  # fused layers said to have been used without their forward
        # step() steps the small 1-D non-fused parameters of one kind in one launch (kernel.bucket_ok)
        self.rest_buckets = bool(rest_buckets)
        self._bucket_index: dict = {}  # the parameters' ids -> their positions in step()'s list, on the device
        # each layer's sum of squares of this step, the clip scales, est_global's predictions
        # (by layer slot; one more slot: the non-fused parameters), on the parameters' device
        self._sums: GradSums | None = None
        # device scalars (set_device_scalars): the table, whether it holds this step's rows, the
        # graph phase (None; "dry": a warm-up pass that stores nothing; "capture": recording), and
        # the slots the captured backward updates
        self._dyn: _DynTable | None = None
        self._dyn_meta = None  # (layer indices, param group of each layer as numpy arrays, their state dicts)
        # (step id, each layer's next step, their rounding keys): the next replay's table columns that
        # do not depend on the param groups, made by capture_advance while the GPU runs the replay
        self._dyn_next: tuple | None = None
        self._last_update_sid = -1  # the step id of the last layer update (the graph's guard: O(1) when older)
        self._graph_plan = None  # (layer, weight state, bias state) of each captured slot (capture_advance)
        self._dyn_ready = False
        self._phase: str | None = None
        self._graph_slots: list[int] = []
        # gradient accumulation (forge/accumulate.py): micro-batches counted since the last step,
        # each layer's buffer by slot, the slots whose buffer holds this step's gradient
        self.grad_accum, self.accum_dtype = grad_accum, accum_dtype
        self.accum_error_feedback = bool(accum_error_feedback)
        self._micro = 0
        self._accum: dict = {}  # slot -> a Tensor (bf16 / fp32) or an Int8GradBuffer (int8)
        self._filled: set[int] = set()
        # DTensor (FSDP2) parameters: each layer's row split, the reused buffer of its reduced rows
        self._row_shards: dict = {}
        self._shard_workspace = _Workspace()
        self._rest_shards = None  # the non-fused parameters' split (their sums of squares' all-reduce)

        layers, fused, others = _find_layers(model)
        listed = _listed_groups(param_groups, rule, {id(p) for p in fused + others})
        for layer in layers:  # a bias in another group than its weight: stepped apart, in step()
            b = layer.bias
            if b is not None and listed.get(id(b), 0) != listed.get(id(layer.weight), 0):
                layer.bias = None
                fused = [p for p in fused if p is not b]
                others.append(b)
        params = fused + others
        if not params:
            raise ValueError("FORGE: the model has no trainable parameters")
        self.sharded = check_sharded(params, {p: n for n, p in model.named_parameters()}, state_dtype=state_dtype,
                                     overlap=overlap, grad_accum=grad_accum)
        groups = [{"params": [p for p in params if id(p) not in listed]}]
        for gi, g in enumerate(param_groups or (), 1):
            groups.append(dict({k: v for k, v in g.items() if k != "params"},
                               params=[p for p in params if listed.get(id(p), 0) == gi]))
        super().__init__([g for g in groups if g["params"]], rule.hyper())
        self.model = model
        index = {p: i for i, p in enumerate(params)}
        self.param_index = index
        self._group_of = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        self.layers = layers
        for slot, layer in enumerate(layers):
            layer.index, layer.slot, layer.opt = index[layer.weight], slot, self
            layer.tp_group = getattr(layer.module, "tp_group", None)
            layer.sharded = self.sharded
        self.has_tp = any(layer.tp_group is not None for layer in layers)
        self.dp_group = self._resolve_dp(dp_group)
        self._allreduce = allreduce
        if self.sharded:  # every state now: torch.distributed.checkpoint's loader then finds it
            for layer in layers:  # (instead of making it by a step of its own, which would update)
                self._layer_states(layer)
            for p in others:
                self._init_state(p)
        for layer in layers:
            patch(layer)

    # ------------------------------------------------------------------ setup helpers

    def _resolve_dp(self, dp_group):
        if dp_group is False or self.sharded:  # (DTensor shards: reduced over their mesh, forge/shards.py)
            return None
        if dp_group is not None:
            return dp_group if collectives.world_size(dp_group) > 1 else None
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        if self.has_tp:  # tensor parallel: the whole world is not the data-parallel group
            return None
        return dist.group.WORLD

    def _backend_for(self, t: Tensor) -> str:
        """The resolved backend for tensors on ``t``'s kind of device (cached: a per-layer call)."""
        backend = self._backends.get(t.is_cuda)
        if backend is None:
            from leantrain.ops._backend import resolve

            backend = self._backends[t.is_cuda] = resolve(self.backend, t)
        return backend

    def _init_state(self, p: Tensor, fp32: bool = False) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = 0
            state.update(self._init_sharded_state(p, fp32) if self.sharded
                         else self.storage.init(self.rule, p, force_fp32=fp32))
        return state

    def _hp(self, p: Tensor) -> dict:
        group = self.param_groups[self._group_of[id(p)]]  # read now: LR schedulers change it
        return {k: v for k, v in group.items() if k != "params"}

    def _seed(self, index: int, step: int) -> int:
        return step_seed(self.seed, index, step)

    # ------------------------------------------------------------------ the per-layer update

    def update_layer(self, layer: ForgeLayer, x2: Tensor | None, dy2: Tensor | None, fill=None) -> None:
        """Update ``layer`` from ``dW = dy2ᵀ x2``, or, with ``fill``, from the dW that ``fill(g, gb)``
        writes into the fp32 workspace views ``g [n, k]`` / ``gb [n]`` (``gb`` None without a
        fused bias): for a caller that computes dW in pieces (the fused LM head + loss,
        :mod:`leantrain.model.losses`). Either way the same reduction, clip, NaN gate and rule follow."""
        if torch.is_grad_enabled():  # backward(create_graph=True); a plain backward runs without grad
            with torch.no_grad():
                return self._update_layer_impl(layer, x2, dy2, fill)
        return self._update_layer_impl(layer, x2, dy2, fill)

    def _update_layer_impl(self, layer: ForgeLayer, x2: Tensor | None, dy2: Tensor | None, fill) -> None:
        if self.accumulating:
            return self._accumulate_layer(layer, x2, dy2, fill)
        if self._phase is not None:
            return self._update_layer_graph(layer, x2, dy2, fill)
        if layer.weight.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("FORGE: a layer update is being captured into a CUDA graph that FORGE was not told "
                               "about; pass hooks=[opt.capture_hooks] to GraphedStep")
        if layer.updated_in == self._step_id:
            raise RuntimeError(
                f"FORGE: layer {layer.name!r} got a second gradient before opt.step(). FORGE applies the "
                "update inside backward, and the rules are not additive in the gradient (Adam, Lion, "
                "momentum): for gradient accumulation over micro-batches, attach with grad_accum=k and call "
                "opt.before_micro_batch() before each micro-batch's forward (docs/forge.md), or call "
                "opt.step() after every backward."
            )
        if self._dyn is not None and not self._dyn_ready:  # (each layer's rows at its next step: before the += 1)
            self._upload_dyn(1.0)
        sw, sb = self._layer_states(layer)
        step = self._advance(layer, sw, sb)
        if self.sharded:
            self._update_sharded(layer, x2, dy2, fill, sw, sb, step)
        elif self._backend_for(layer.weight) == "triton":
            self._update_triton(layer, x2, dy2, sw, sb, step, self._path(layer, x2, dy2, fill), fill)
            self._ran.append(layer.slot)
        else:
            self._update_torch(layer, x2, dy2, self._hp(layer.weight), sw, sb, step, fill)

    def _layer_states(self, layer: ForgeLayer):
        """The layer's weight and bias state dicts, made on first use (bias state: fp32)."""
        b = layer.bias
        return self._init_state(layer.weight), None if b is None else self._init_state(b, fp32=True)

    def _advance(self, layer: ForgeLayer, sw: dict, sb: dict | None) -> int:
        """Count the layer's step (its bias shares it) and mark it updated in this step."""
        sw["step"] += 1
        if sb is not None:
            sb["step"] = sw["step"]
        layer.updated_in = self._last_update_sid = self._step_id
        self._dyn_next = None
        return sw["step"]

    def _grad_sums(self, device) -> GradSums:
        if self._sums is None:
            self._sums = GradSums(len(self.layers), device, _EST_BETA)
        return self._sums

    def _scale_torch(self, slot: int) -> Tensor | None:
        """The clipping scale of a fused layer whose sum of squares is in ``sq[slot]`` (torch ops).

        ``clip="est_global"``: ``min(1, c / N̂)``, N̂ the estimate of this step's global norm from
        what is known now. S: this step's sum of squares over the layers reduced so far (this one
        included); C / Q: this step's / the predicted sums over those of them that have a
        prediction; R = (sum of all predictions) - Q, the predicted rest. ``N̂² = S + R · C / Q``:
        the layers still to come, predicted, rescaled by how this step's layers so far compare to
        their prediction (``S`` when nothing is predicted yet). A layer's prediction is a
        geometric moving average of its past sums of squares (``_EST_BETA``; 0: the previous
        step's). The non-fused parameters, stepped last, use the exact global norm. The Triton
        backend computes the same in one launch (:meth:`GradSums.scale_kernel`)."""
        if self.clip in ("layer", "est_global"):
            return self._sums.scale_torch(slot, self.clip == "est_global", self.clip_value)
        if self.clip == "prev_global":
            return self._clip_scale
        return None

    # ------------------------------------------------------------------ metrics

    @property
    def last_nonfinite(self) -> list[str]:
        """Names of the layers / parameters whose gradient was non-finite in the last step (syncs)."""
        names, flags = self._last_flags
        if flags is None:
            return []
        return [n for n, f in zip(names, flags.cpu().tolist(), strict=True) if f]

    def nonfinite_flags(self) -> Tensor | None:
        """The last step's non-finite flags, one per layer / parameter of :attr:`last_nonfinite`,
        as a bool tensor on the device (no sync: the trainer counts them when it logs the step)."""
        return self._last_flags[1]

    @property
    def peak_dw_numel(self) -> int:
        """The most elements FORGE's reused dW workspace held at once since ``attach``: about the
        largest fused layer's gradient (padded to whole row shards under FSDP2), never a sum of
        layers' (``ring`` of them with ``overlap``)."""
        return self._workspace.peak_numel

    @property
    def last_grad_norm(self) -> float | None:
        """Global gradient norm of the last step, before clipping (syncs)."""
        return None if self._last_norm is None else float(self._last_norm)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self):
        self.join()
        sd = super().state_dict()
        sd["forge"] = self.extra_state()
        return sd

    def extra_state(self) -> dict:
        """The optimizer's own state beside torch's per-parameter one (step count, clip scale,
        est_global's predictions): in ``state_dict()["forge"]``, and kept apart by a checkpointer
        that saves only torch's part (DCP, under FSDP)."""
        return {"step_id": self._step_id,
                "clip_scale": None if self._clip_scale is None else self._clip_scale.detach().cpu().clone(),
                "pred_sq": self._predictions()}

    def _predictions(self) -> dict[int, Tensor]:
        """est_global's predictions by parameter index (-1: the non-fused parameters together)."""
        if self._sums is None:
            return {}
        key = [layer.index for layer in self.layers] + [-1]
        return {key[slot]: t for slot, t in self._sums.predictions().items()}

    def load_state_dict(self, state_dict):
        self.join()
        self._dyn_meta = self._graph_plan = self._dyn_next = None  # (they hold the state dicts replaced below)
        sd = dict(state_dict)
        extra = sd.pop("forge", None)
        saved = sd["state"]
        super().load_state_dict(sd)
        # torch casts floating state to the parameter's dtype; restore the stored dtypes exactly
        params = [p for g in self.param_groups for p in g["params"]]
        ids = [i for g in sd["param_groups"] for i in g["params"]]
        for pid, p in zip(ids, params):
            if pid in saved:
                self.state[p] = {k: (v.to(p.device).clone() if isinstance(v, Tensor) else v)
                                 for k, v in saved[pid].items()}
        if extra is not None:
            self.load_extra_state(extra)
        for layer in self.layers:
            layer.updated_in = -1
        self._last_update_sid = -1
        self._micro = 0  # (a checkpoint is taken after a full step: nothing accumulated)
        self._filled.clear()

    def load_extra_state(self, extra: dict) -> None:
        """Restore what :meth:`extra_state` returned."""
        self._step_id = int(extra["step_id"])
        cs = extra["clip_scale"]
        dev = next(p for g in self.param_groups for p in g["params"]).device
        if cs is None:
            self._clip_scale = None
        elif self._clip_scale is not None and self._clip_scale.device == dev:
            self._clip_scale.copy_(cs)  # in place: a captured launch holds this tensor
        else:
            self._clip_scale = cs.to(dev)
        preds = extra.get("pred_sq", {})
        if preds or self._sums is not None:  # keyed by parameter index (-1: the non-fused parameters)
            slot_of = {layer.index: layer.slot for layer in self.layers}
            slot_of[-1] = len(self.layers)
            self._grad_sums(dev).load_predictions({slot_of[int(i)]: t for i, t in preds.items()})


def _listed_groups(param_groups, rule: Rule, trainable: set[int]) -> dict[int, int]:
    """``attach(param_groups=...)`` checked: ``id(p) -> its group's number`` (from 1)."""
    listed: dict[int, int] = {}
    valid = set(rule.hyper())
    for gi, g in enumerate(param_groups or (), 1):
        if not isinstance(g, dict) or "params" not in g:
            raise ValueError(f"attach(param_groups=...): group {gi} must be a dict with 'params'")
        bad = set(g) - valid - {"params"}
        if bad:
            raise ValueError(f"attach(param_groups=...): group {gi} has {sorted(bad)}; the rule's "
                             f"hyper-parameters are {sorted(valid)}")
        ps = [g["params"]] if isinstance(g["params"], Tensor) else list(g["params"])
        for p in ps:
            if id(p) not in trainable:
                raise ValueError(f"attach(param_groups=...): group {gi} lists a tensor that is not a trainable "
                                 "parameter of the model")
            if id(p) in listed:
                raise ValueError(f"attach(param_groups=...): a parameter is in groups {listed[id(p)]} and {gi}")
            listed[id(p)] = gi
    return listed


def _find_layers(model: nn.Module) -> tuple[list[ForgeLayer], list[nn.Parameter], list[nn.Parameter]]:
    """Fused layers, their parameters, and every other trainable parameter (model order)."""
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    layers, fused = [], []
    fused_ids: set[int] = set()
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear) or isinstance(m, nn.modules.linear.NonDynamicallyQuantizableLinear):
            continue  # (the latter: nn.MultiheadAttention's out_proj, whose weight it uses without calling forward)
        w = m.weight
        if not w.requires_grad or w.dim() != 2 or uses[id(w)] > 1 or id(w) in fused_ids:
            continue  # frozen, or shared (tied embedding / LM head): stepped unfused in step()
        b = m.bias
        if b is not None and (not b.requires_grad or uses[id(b)] > 1 or not getattr(m, "forge_fuse_bias", True)):
            b = None
        layers.append(ForgeLayer(name or "<root>", m, w, b, index=-1))
        fused.append(w)
        fused_ids.add(id(w))
        if b is not None:
            fused.append(b)
            fused_ids.add(id(b))
    others = [p for p in model.parameters() if p.requires_grad and id(p) not in fused_ids]
    return layers, fused, others

"""``lt.forge.attach`` / ``detach`` and ``ForgeOptimizer``: the optimizer step inside backward.

``attach(model, rule)`` swaps the forward of every ``nn.Linear`` (and every module exposing a
``linear_fn``, e.g. ``lt.dist.tp`` layers) for :class:`leantrain.forge.linear.ForgeLinearFn`
and returns a :class:`ForgeOptimizer`. During ``loss.backward()`` each layer's weight (and
bias) is updated as soon as its ``dY`` is known; ``opt.step()`` then steps the remaining
parameters (norms, embeddings, tied weights, non-fused biases) with the same rule from
their ``.grad`` and closes the step (norms for ``clip="prev_global"`` / ``"est_global"``, non-finite
report).

Per layer, in backward (``update_layer``):
1. gradient-accumulation guard (a layer updated twice before ``step()`` is an error);
2. dW: fused into the Triton kernel's tile loop (nothing materialized), or, when it must be
   seen whole first (data parallel all-reduce, ``clip="layer"`` / ``"est_global"``, the torch backend, or
   T >= ``split_tokens`` on CUDA where cuBLAS wins), computed into one reused fp32
   workspace (bounded by the largest layer), reduced, clipped, consumed, released;
3. the rule, on the layer's own step count (bias correction), lr and hyper-parameters read
   from ``param_groups`` at that moment (so LR schedulers work);
4. a non-finite gradient leaves the layer (torch backend) or the tile (Triton) untouched.
No host synchronization: flags and norms stay on the device until someone reads
``last_nonfinite`` / ``last_grad_norm``.
"""

from __future__ import annotations

from types import SimpleNamespace

import contextlib
import math
import os
import warnings

import torch
import torch.distributed as dist
from torch import Tensor, nn

from leantrain.runtime import collectives
from leantrain.ops._backend import mm_fp32
from leantrain.ops.rng import step_seed
from leantrain.optim.rules import Rule
from leantrain.optim.state import StateStorage

from leantrain.forge.gradsums import CLIP_EPS as _CLIP_EPS
from leantrain.forge.gradsums import GradSums
from leantrain.forge.linear import ForgeLayer, patch, unpatch
from leantrain.model.extension import owner_of
from leantrain.runtime.capture import CaptureHooks

OVERLAP_RING = 2  # dW workspaces per dtype when the updates run on a side stream
SPLIT_TOKENS = 1  # default of attach(split_tokens=): always the split path on CUDA (measured faster)
WS_TOKENS = None  # default of attach(ws_tokens=): below this many tokens, the warp-specialized kernel (sm_90)
CLIPS = ("none", "layer", "prev_global", "est_global")
# est_global: each unit's predicted sum of squares is the geometric moving average
# pred <- pred^b * s^(1-b) of its past ones (0: the previous step's). 0.5 measured best on tiny
# (benchmarks/results/2026-11-29_cpu_convergence_forge_s2).
_EST_BETA = 0.5
# step(): the small 1-D non-fused parameters (norm weights and biases) that share a dtype, state
# kinds, param group and step count are stepped in one update launch over their concatenation
# (ForgeOptimizer.rest_buckets; kernel.update_many)
REST_BUCKETS_ENV = "LEANTRAIN_FORGE_REST_BUCKETS"  # "0": one update launch per non-fused parameter


def _env_overlap(overlap) -> bool:
    """``attach(overlap=...)``, unless ``LEANTRAIN_FORGE_OVERLAP=0/1`` forces it (benchmarks)."""
    env = os.environ.get("LEANTRAIN_FORGE_OVERLAP")
    if env not in (None, ""):
        if env not in ("0", "1"):
            raise ValueError(f"LEANTRAIN_FORGE_OVERLAP must be 0 or 1, got {env!r}")
        return env == "1"
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be True or False, got {overlap!r}")
    return overlap


def _env_ws_tokens(ws_tokens):
    """``attach(ws_tokens=...)``, unless ``LEANTRAIN_FORGE_WS_TOKENS=N`` forces it (0: never; benchmarks)."""
    env = os.environ.get("LEANTRAIN_FORGE_WS_TOKENS")
    if env not in (None, ""):
        if not env.isdigit():
            raise ValueError(f"LEANTRAIN_FORGE_WS_TOKENS must be a token count (0: never), got {env!r}")
        return int(env) or None
    if ws_tokens is not None and (not isinstance(ws_tokens, int) or ws_tokens < 1):
        raise ValueError(f"ws_tokens must be a positive token count or None, got {ws_tokens!r}")
    return ws_tokens


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


class _Workspace:
    """The reused buffers of a materialized dW (+ db), per dtype, each grown to the largest layer.

    With ``ring > 1`` (the updates run on a side stream, ``attach(overlap=True)``) consecutive
    layers take turns over ``ring`` buffers per dtype, so one layer's dW is written while the
    previous layer's update still reads its own. A buffer handed to a side-stream launch
    (:meth:`read_on`) carries that stream's event; the next :meth:`get` of the same buffer makes the
    current stream wait for it before anything writes (or frees) it."""

    def __init__(self):
        self.bufs: dict[tuple, Tensor] = {}
        self.events: dict[tuple, torch.cuda.Event] = {}
        self.turn = 0
        self.last: tuple | None = None

    def get(self, numel: int, device, dtype=torch.float32, ring: int = 1) -> Tensor:
        if ring > 1:
            self.turn = (self.turn + 1) % ring
        key = self.last = (dtype, self.turn if ring > 1 else 0)
        done = self.events.pop(key, None)
        if done is not None:  # the side stream's update that last read this buffer
            torch.cuda.current_stream(device).wait_event(done)
        buf = self.bufs.get(key)
        if buf is None or buf.numel() < numel or buf.device != torch.device(device):
            self.bufs.pop(key, None)
            buf = self.bufs[key] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]

    def read_on(self, stream) -> None:
        """The buffer :meth:`get` handed out last is read by a launch just issued on ``stream``."""
        done = self.events[self.last] = torch.cuda.Event()
        done.record(stream)

    def joined(self) -> None:
        """The current stream has waited for the side stream: every buffer is free."""
        self.events.clear()

    def release(self) -> None:
        self.bufs.clear()
        self.events.clear()


_KERNEL = []
_NULL = contextlib.nullcontext()


def _kernel():
    """leantrain.forge.kernel, imported on first use (it imports Triton)."""
    if not _KERNEL:
        from leantrain.ops.rng import kernel_key

        from leantrain.forge import kernel

        _KERNEL[:] = [kernel, kernel_key]
    return _KERNEL[0]


class _DynTable:
    """The device table of each fused layer's per-step kernel scalars (``kernel.dyn_row``), one
    row per layer slot, and two page-locked staging copies (CUDA): the whole table goes up in one
    copy per step, issued on the current stream before the step's backward (or graph replay)."""

    def __init__(self, rows: int, device):
        from leantrain.forge.kernel import DYN_COLS

        self.dev = torch.zeros(rows, DYN_COLS, dtype=torch.float32, device=device)
        pin = self.dev.is_cuda
        self.host = [torch.zeros(rows, DYN_COLS, dtype=torch.float32, pin_memory=pin) for _ in range(2 if pin else 1)]
        self.events: list = [None] * len(self.host)
        self.i = 0

    def upload(self, rows) -> None:
        i = self.i = (self.i + 1) % len(self.host)
        if self.events[i] is not None:  # the copy that last read this staging buffer is done
            self.events[i].synchronize()
        self.host[i].numpy()[:] = rows
        self.dev.copy_(self.host[i], non_blocking=self.dev.is_cuda)
        if self.dev.is_cuda:
            self.events[i] = torch.cuda.Event()
            self.events[i].record()


class _LayerHost:
    """Per-layer host cache of the Triton path: state tensors, kinds, 8-bit tables, the param
    group, the reused per-tile sum buffer. Rebuilt when the state dict or a tensor in it is replaced
    (``load_state_dict``)."""

    __slots__ = ("sw", "sb", "checks", "states", "kinds", "qtables", "bstates", "group", "part", "upart", "wpart")

    def __init__(self, sw, sb, checks, states, kinds, qtables, bstates, group):
        self.sw, self.sb, self.checks, self.states, self.kinds = sw, sb, checks, states, kinds
        self.qtables, self.bstates, self.group, self.part, self.upart = qtables, bstates, group, None, None
        self.wpart = None


class ForgeOptimizer(torch.optim.Optimizer):
    """Returned by :func:`attach`; see the module docstring. Not built directly."""

    def __init__(self, model: nn.Module, rule: Rule, *, state_dtype="fp32", stochastic_rounding=True,
                 backend="auto", clip="none", clip_value=1.0, dp_group=None, split_tokens=SPLIT_TOKENS, seed=0,
                 allreduce=None, grad_dtype="fp32", overlap=False, param_groups=None, ws_tokens=WS_TOKENS,
                 fast_math=False):
        if not isinstance(rule, Rule):
            raise TypeError(f"rule must be a leantrain.optim rule (e.g. lt.optim.AdamW(...)), got {type(rule).__name__}")
        _check_clip(clip, clip_value)
        if backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
        if grad_dtype not in ("fp32", "bf16"):
            raise ValueError(f"grad_dtype must be 'fp32' or 'bf16', got {grad_dtype!r}")
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
        self.split_tokens = split_tokens
        self.ws_tokens = _env_ws_tokens(ws_tokens)
        self._ws: dict = {}  # device -> whether forge/ws.py's kernel runs there
        self.grad_dtype = grad_dtype
        self.fast_math = bool(fast_math)
        self.seed = int(seed)
        self.overlap = _env_overlap(overlap)
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
        self.rest_buckets = os.environ.get(REST_BUCKETS_ENV, "1") not in ("", "0")
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
        self.has_tp = any(layer.tp_group is not None for layer in layers)
        self.dp_group = self._resolve_dp(dp_group)
        self._allreduce = allreduce
        for layer in layers:
            patch(layer)

    # ------------------------------------------------------------------ setup helpers

    def _resolve_dp(self, dp_group):
        if dp_group is False:
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
            state.update(self.storage.init(self.rule, p, force_fp32=fp32))
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
        if self._phase is not None:
            return self._update_layer_graph(layer, x2, dy2, fill)
        if layer.updated_in == self._step_id:
            raise RuntimeError(
                f"FORGE: layer {layer.name!r} got a second gradient before opt.step(). FORGE applies the "
                "update inside backward, and the rules are not additive in the gradient (Adam, Lion, "
                "momentum), so gradient accumulation over micro-batches is not supported: use one larger "
                "micro-batch, call opt.step() after every backward, or train with lt.optim.Optimizer."
            )
        if self._dyn is not None and not self._dyn_ready:  # (each layer's rows at its next step: before the += 1)
            self._upload_dyn(1.0)
        sw, sb = self._layer_states(layer)
        step = self._advance(layer, sw, sb)
        backend = self._backend_for(layer.weight)
        if backend == "triton":
            ws = self._ws_layer(layer, x2, dy2, fill)
            self._update_triton(layer, x2, dy2, sw, sb, step,
                                not ws and self._materializes(layer, x2, fill, backend), fill, ws)
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

    def _ws_layer(self, layer: ForgeLayer, x2: Tensor | None, dy2: Tensor | None, fill) -> bool:
        """Whether this layer's update runs the warp-specialized fused kernel (``forge/ws.py``): fewer
        than ``ws_tokens`` tokens, an sm_90 GPU, and nothing that needs dW first (data parallelism,
        clipping by this step's norms, a ``fill`` caller), is outside the kernel's scope (a fused bias,
        8-bit states, inputs ``ws.supported`` refuses) or runs slower there: bf16 states (the
        kernel supports them, but on every linear shape of the 1b step the split path was faster,
        results/2026-12-03_H200_s28/fifth/). Otherwise the split path."""
        if (self.ws_tokens is None or fill is not None or x2 is None or x2.shape[0] >= self.ws_tokens
                or self.dp_group is not None or self.clip not in ("none", "prev_global")
                or layer.bias is not None or not layer.weight.is_cuda or self.storage.dtype != "fp32"):
            return False
        from leantrain.forge import ws

        dev = layer.weight.device
        ok = self._ws.get(dev)
        if ok is None:
            ok = self._ws[dev] = ws.available(dev)
        return ok and ws.supported(x2, dy2, layer.weight)

    def _materializes(self, layer, x2, fill, backend) -> bool:
        return (fill is not None or backend == "torch" or self.dp_group is not None
                or self.clip in ("layer", "est_global")
                or (layer.weight.is_cuda and self.split_tokens is not None and x2.shape[0] >= self.split_tokens))

    # ------------------------------------------------------------------ the updates' side stream

    def _side_stream(self, w: Tensor):
        """The stream the split path's updates run on (``overlap``, CUDA), made on first use; else None."""
        if not (self.overlap and w.is_cuda):
            return None
        if self._side is None:
            self._side = torch.cuda.Stream(w.device)
        return self._side

    def _fork(self, side) -> None:
        """Order ``side`` after the current stream's work so far (this layer's dX and dW), and make
        sure the current stream waits for it again when this backward ends (:meth:`join`)."""
        side.wait_stream(torch.cuda.current_stream(side.device))
        self._side_busy = True
        task = torch._C._current_graph_task_id()
        if task >= 0 and task != self._join_task:  # once per backward pass (one that raised dropped it)
            self._join_task = task
            # run at the end of this backward pass on the stream that called backward() (as DDP's
            # reducer does): what follows (step(), the next forward, a read of W) sees every update
            torch.autograd.Variable._execution_engine.queue_callback(self.join)

    def join(self) -> None:
        """Make the current stream wait for the updates issued on FORGE's side stream. Runs by
        itself at the end of every backward that issued one (and in :meth:`step`,
        :meth:`state_dict`); a caller only needs it around a ``backward`` interrupted by an error."""
        if self._side_busy:
            torch.cuda.current_stream(self._side.device).wait_stream(self._side)
            self._side_busy = False
            self._workspace.joined()

    # ------------------------------------------------------------------ device scalars, CUDA graphs

    def set_device_scalars(self, enabled: bool = True) -> None:
        """Read each step's kernel scalars (lr, bias corrections, rounding keys) from a device
        table filled by one host-to-device copy per step, instead of launch arguments: the same
        bits, and what lets :class:`leantrain.runtime.capture.GraphedStep` capture the fused update (a
        replay reads the table, which is refilled before it). Triton backend only."""
        if not enabled:
            self._dyn, self._dyn_ready = None, False
            return
        if self._backend_for(self.layers[0].weight if self.layers else self.param_groups[0]["params"][0]) != "triton":
            raise ValueError("FORGE: device scalars need the Triton backend (backend='triton', or 'auto' on CUDA)")
        if self._dyn is None:
            self._dyn = _DynTable(max(1, len(self.layers)), self.param_groups[0]["params"][0].device)
        self._dyn_ready = False

    def _next_steps(self):
        """Each layer's next step and its rounding key (numpy arrays, in slot order)."""
        import numpy as np

        from leantrain.ops.rng import step_kernel_keys

        layers = self.layers
        if self._dyn_meta is None:  # (the state dicts: filled in place by _init_state, replaced by load_state_dict)
            self._dyn_meta = (np.array([layer.index for layer in layers], dtype=np.int64),
                              np.array([self._group_of[id(layer.weight)] for layer in layers], dtype=np.int64),
                              [self.state[layer.weight] for layer in layers])
        index, _, states = self._dyn_meta
        steps = np.fromiter((st.get("step", 0) + 1 for st in states), dtype=np.int64, count=len(layers))
        return steps, step_kernel_keys(self.seed, index, steps)

    def _upload_dyn(self, gate: float) -> None:
        """This step's rows (each layer at its next step) into the device table, in one copy.
        Host cost: one row per distinct (param group, step); the steps and keys were made after
        the last replay's launch (:meth:`capture_advance`) when no step count changed since."""
        import numpy as np

        from leantrain.forge.kernel import DYN_COLS, dyn_row

        nxt, self._dyn_next = self._dyn_next, None
        if nxt is not None and nxt[0] == self._step_id:
            steps, keys = nxt[1], nxt[2]
        else:
            steps, keys = self._next_steps()
        layers = self.layers
        gidx = self._dyn_meta[1]
        rows = np.empty((len(layers), DYN_COLS), dtype=np.float32)
        name, groups = self.rule.name, self.param_groups
        if len(layers) and (steps == steps[0]).all() and (gidx == gidx[0]).all():  # the usual case: one row
            rows[:] = dyn_row(name, groups[int(gidx[0])], int(steps[0]), gate)
        else:
            made: dict = {}
            for slot, (gi, st) in enumerate(zip(gidx.tolist(), steps.tolist())):
                r = made.get((gi, st))
                if r is None:
                    r = made[(gi, st)] = dyn_row(name, groups[gi], st, gate)
                rows[slot] = r
        rows[:, 12].view(np.int32)[:] = keys  # the keys' bits
        self._dyn.upload(rows)
        self._dyn_ready = True

    def _update_layer_graph(self, layer, x2, dy2, fill) -> None:
        """A GraphedStep's warm-up ("dry": the kernels run and store nothing) or capture pass:
        the launches of an eager step on the device table, without the host bookkeeping (step
        counts, the accumulation guard), which :meth:`capture_prepare` / :meth:`capture_advance` do
        around each replay."""
        w, b = layer.weight, layer.bias
        if self._phase == "capture" and (not self.state[w] or (b is not None and not self.state[b])):
            raise RuntimeError("FORGE: a layer's optimizer state would be created inside a CUDA graph "
                               "capture; GraphedStep runs a warm-up pass first")
        sw, sb = self._layer_states(layer)
        if self._phase == "dry" and not self._dyn_ready:
            self._upload_dyn(float("nan"))
        backend = self._backend_for(w)
        ws = self._ws_layer(layer, x2, dy2, fill)
        self._update_triton(layer, x2, dy2, sw, sb, sw["step"] + 1,
                            not ws and self._materializes(layer, x2, fill, backend), fill, ws)
        if self._phase == "capture":
            self._graph_slots.append(layer.slot)

    @property
    def capture_hooks(self) -> CaptureHooks:
        """The optimizer's part in a :class:`leantrain.runtime.capture.GraphedStep` (pass it as
        ``hooks=[opt.capture_hooks]``)."""
        return SimpleNamespace(check=self.capture_check, phase=self.capture_phase,
                               prepare=self.capture_prepare, advance=self.capture_advance)

    def capture_check(self) -> None:
        """What a captured FORGE step needs; raises otherwise (GraphedStep calls it)."""
        why = []
        if not self.layers or self._backend_for(self.layers[0].weight) != "triton":
            why.append("the Triton backend (backend='triton', or 'auto' on CUDA)")
        if self.dp_group is not None or self.has_tp:
            why.append("no data or tensor parallelism (their collectives run from the host)")
        if self.clip == "prev_global" and self._clip_scale is None:
            why.append("clip='prev_global': one eager step first (its scale tensor is made by the first step)")
        if self.clip == "est_global" and not (self._sums is not None and all(self._sums.has[:len(self.layers)])):
            why.append("clip='est_global': one eager step first (the captured estimate needs every layer's prediction)")
        if why:
            raise ValueError("GraphedStep with FORGE needs " + "; ".join(why))
        if self._dyn is None:
            self.set_device_scalars(True)

    def capture_phase(self, phase: str | None) -> None:
        """Enter ("dry", "capture") or leave (None) a GraphedStep pass."""
        if phase is None:
            self.join()  # (done by the backward's end already, unless it raised)
        if phase is None and self._phase == "dry":  # the warm-up's traces: nothing happened
            if self._sums is not None:
                self._sums.run.zero_()
            self._workspace.release()
        if phase == "capture":
            self._graph_slots = []
            self._graph_plan = None
        if phase is None:
            self._dyn_ready = False
            self._ran = []
        self._phase = phase

    def capture_prepare(self) -> None:
        """Before a replay: the accumulation guard, this step's table rows (on the stream, before
        the replay). Host time here delays the replay, so the step counts wait for :meth:`capture_advance`."""
        plan = self._graph_plan
        if plan is None:
            plan = self._graph_plan = [(layer, *self._layer_states(layer))
                                       for layer in (self.layers[slot] for slot in self._graph_slots)]
        sid = self._step_id
        if self._last_update_sid == sid and any(layer.updated_in == sid for layer, _, _ in plan):
            raise RuntimeError("FORGE: the graphed step was replayed twice without opt.step() in between "
                               "(gradient accumulation is not supported; see forge/README.md)")
        self._upload_dyn(1.0)

    def capture_advance(self) -> None:
        """After a replay is launched: the bookkeeping the captured backward skipped (each layer's
        step count, the accumulation guard's mark, the layers ``step()`` reads the sums of)."""
        sid = self._step_id
        for layer, sw, sb in self._graph_plan:
            n = sw["step"] = sw["step"] + 1
            if sb is not None:
                sb["step"] = n
            layer.updated_in = sid
        self._last_update_sid = sid
        self._ran = list(self._graph_slots)
        # the next replay's steps and keys now, while the GPU runs this one (step() moves the step id)
        self._dyn_next = (sid + 1, *self._next_steps())

    def _materialize(self, layer, x2, dy2, backend, fill=None, ring=1):
        """dW (and db) of one layer in the reused workspace (``ring`` buffers a dtype taking turns:
        the updates run on a side stream), reduced over the DP group."""
        w, b = layer.weight, layer.bias
        n, k = w.shape
        # grad_dtype="bf16": dW of bf16 inputs as the bf16 matmul gives it (torch's bf16 backward's
        # precision), half the workspace traffic; the Triton update reads it in fp32
        low = (self.grad_dtype == "bf16" and backend == "triton" and fill is None and self.dp_group is None
               and x2.dtype == torch.bfloat16 and dy2.dtype == torch.bfloat16)
        buf = self._workspace.get(n * k + (n if b is not None else 0), w.device,
                                  torch.bfloat16 if low else torch.float32, ring)
        g = buf[: n * k].view(n, k)
        gb = buf[n * k:] if b is not None else None
        done = False
        if fill is not None:
            fill(g, gb)
            done = True
        elif low:
            torch.mm(dy2.t(), x2, out=g)
            if gb is not None:
                torch.sum(dy2, 0, out=gb)
            done = True
        elif backend == "torch" or x2.is_cuda:  # cuBLAS (or CPU BLAS)
            done = mm_fp32(dy2.t(), x2, g, allow_upcast=backend == "torch")
            if done and gb is not None:
                torch.sum(dy2, 0, dtype=torch.float32, out=gb)
        if not done:  # the kernel in "write dW" mode: fp32 accumulation, no upcast copies
            from leantrain.forge.kernel import MODE_WRITE_DW, launch_forge

            launch_forge(MODE_WRITE_DW, x=x2.contiguous(), dy=dy2.contiguous(), g=g, gb=gb)
        if self.dp_group is not None:
            self._dp_average(buf)
        return buf, g, gb

    def _dp_average(self, buf: Tensor) -> None:
        """Average ``buf`` over the data-parallel group: the plain counted all-reduce, or the
        ``allreduce`` callable given to :func:`attach` (e.g. ``lt.comm.int8_all_reduce``)."""
        if self._allreduce is not None:
            self._allreduce(buf, self.dp_group)
        else:
            collectives.all_reduce(buf, group=self.dp_group)
        buf.div_(collectives.world_size(self.dp_group))

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

    def _update_torch(self, layer, x2, dy2, hp, sw, sb, step, fill=None):
        w, b = layer.weight, layer.bias
        buf, g, gb = self._materialize(layer, x2, dy2, "torch", fill)
        sq = self._grad_sums(w.device).sq_views[layer.slot]
        if buf.numel():
            sq.copy_(buf.square().sum())
        else:
            sq.zero_()
        self._ran.append(layer.slot)
        bad = ~torch.isfinite(sq)
        scale = self._scale_torch(layer.slot)
        if scale is not None:
            buf.mul_(scale)
        self._apply_rule(w, g, sw, hp, step, layer.index, bad)
        if b is not None:
            self._apply_rule(b, gb, sb, hp, step, layer.index, bad, sr_offset=w.numel())
        del buf, g, gb

    def _apply_rule(self, p, g, state, hp, step, index, bad, sr_offset=0):
        signed = self.rule.signed_states
        tensors = {k: self.storage.read(state, k, k in signed, p.shape) for k in self.rule.state_names}
        p_new, new_state = self.rule.update(p, g, tensors, step=step, **hp)
        for k, v in new_state.items():
            self.storage.write(state, k, v, k in signed, keep_old=bad)
        if p.dtype == torch.bfloat16 and self.stochastic_rounding:
            from leantrain.ops.sr import bf16_stochastic_round

            v = bf16_stochastic_round(p_new.contiguous(), seed=self._seed(index, step), offset=sr_offset,
                                      backend="torch" if not p.is_cuda else "auto")
        else:
            v = p_new.to(p.dtype)
        p.copy_(torch.where(bad, p, v))

    def _layer_host(self, layer: ForgeLayer, sw: dict, sb: dict | None) -> _LayerHost:
        """The layer's launch arguments that only change when its state tensors are replaced."""
        h = layer.host
        w, b = layer.weight, layer.bias
        group = self.param_groups[self._group_of[id(w)]]
        if h is not None and h.sw is sw and h.sb is sb and h.group is group and all(sw[k] is t for k, t in h.checks):
            return h
        names = self.rule.state_names
        kinds = [self.storage.kind_of(sw, k) for k in names]
        qt = [self.storage.kernel_table(sw, k, k in self.rule.signed_states, w.device) for k in names]
        checks = [(k, sw[k]) for k in names] + [(k + "_absmax", sw[k + "_absmax"]) for k in names if k + "_absmax" in sw]
        h = _LayerHost(sw, sb, tuple(checks), [sw[k] for k in names], kinds, qt,
                       [sb[k] for k in names] if b is not None else [], group)
        layer.host = h
        return h

    def _update_triton(self, layer, x2, dy2, sw, sb, step, materialize, fill=None, ws=False):
        K = _KERNEL[0] if _KERNEL else _kernel()
        w, b = layer.weight, layer.bias
        h = self._layer_host(layer, sw, sb)
        dyn = None if self._dyn is None else (self._dyn.dev, layer.slot)
        key = 0 if dyn is not None else _KERNEL[1](self._seed(layer.index, step))
        sums = self._grad_sums(w.device)
        # hp: the param group itself, read now (LR schedulers change it; "params" is ignored)
        if materialize:
            side = self._side_stream(w)
            buf, g, gb = self._materialize(layer, x2, dy2, "triton", fill, OVERLAP_RING if side is not None else 1)
            if self.clip in ("layer", "est_global"):  # the scale needs this layer's norm first: one launch
                scale = sums.scale_kernel(layer.slot, buf, self.clip == "est_global", self.clip_value)
                own = None
            else:  # the kernel's per-tile sums of squares give the norm: no extra pass over dW
                scale = self._clip_scale if self.clip == "prev_global" else None
                own = (sums.sq_views[layer.slot], sums.ticket_views[layer.slot])  # summed by its last program
            if side is not None:  # after dX (old W) and dW on the current stream; the backward goes on
                self._fork(side)
            with torch.cuda.stream(side) if side is not None else _NULL:
                part = K.launch_forge(K.MODE_UPDATE, w=w, b=b, states=h.states, bias_states=h.bstates,
                                      kinds=h.kinds, qtables=h.qtables, rule_name=self.rule.name, hp=h.group,
                                      step=step, sr=self.stochastic_rounding, key=key, g=g, gb=gb, scale=scale,
                                      part=h.upart, dyn=dyn, sq=None if own is None else own[0],
                                      ticket=None if own is None else own[1], approx=self.fast_math)
            if side is not None:
                self._workspace.read_on(side)
            h.upart = part  # reused next step, like h.part
            del buf, g, gb
        else:
            if x2.stride(-1) != 1:
                x2 = x2.contiguous()
            if dy2.stride(-1) != 1:
                dy2 = dy2.contiguous()
            if ws:
                self._ws_launch(layer, h, x2, dy2, step, key, dyn, sums)
            else:
                part = K.launch_forge(K.MODE_FUSED, x=x2, dy=dy2, w=w, b=b, states=h.states, bias_states=h.bstates,
                                      kinds=h.kinds, qtables=h.qtables, rule_name=self.rule.name, hp=h.group,
                                      step=step, sr=self.stochastic_rounding, key=key,
                                      scale=self._clip_scale if self.clip == "prev_global" else None, part=h.part,
                                      dyn=dyn, sq=sums.sq_views[layer.slot], ticket=sums.ticket_views[layer.slot],
                                      approx=self.fast_math)
                h.part = part  # reused next step (its last program has summed it, stream-ordered)
        torch.autograd.graph.increment_version(w)
        if b is not None:
            torch.autograd.graph.increment_version(b)

    def _ws_launch(self, layer, h, x2, dy2, step, key, dyn, sums) -> None:
        """The layer's fused update by ``forge/ws.py`` (chosen by :meth:`_ws_layer`)."""
        from leantrain.forge import ws

        K = _KERNEL[0]
        w = layer.weight
        scal, flags = K._scalars(self.rule.name, h.group, step)
        part = ws.launch_ws(K.MODE_FUSED, x=x2, dy=dy2, w=w, states=h.states, kinds=h.kinds, part=h.wpart,
                            scal=scal, flags=flags, rule_id=K.RULE_IDS[self.rule.name], sr=self.stochastic_rounding,
                            key=key, scale=self._clip_scale if self.clip == "prev_global" else None, dyn=dyn,
                            dw_bf16=self.grad_dtype == "bf16" and x2.dtype == dy2.dtype == torch.bfloat16,
                            approx=self.fast_math)
        h.wpart = part  # reused next step
        torch.sum(part, 0, out=sums.sq_views[layer.slot])  # the layer's sum of squares (norm, NaN report)

    # ------------------------------------------------------------------ step: the other parameters

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.join()
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
            # bf16 / fp32 gradients as stored (the update kernel reads either; _apply_rule upcasts)
            grads.append((p, p.grad if p.grad.dtype in (torch.float32, torch.bfloat16) else p.grad.float()))
            flag_names.append(names.get(p, "?"))
        rest_sq = None  # the non-fused parameters' sums of squares: one multi-tensor norm launch, fp32
        if grads:
            rest_sq = torch.stack(torch._foreach_norm([g for _, g in grads], 2, dtype=torch.float32)).square()
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
            rest_scale = torch.clamp(self.clip_value / (known.sqrt() + _CLIP_EPS), max=1.0)
        if grads:
            r0 = len(slots)  # the non-fused parameters' sums come last
            rest_ok = finite[r0:]
            scales = None  # each non-fused parameter's clipping scale (None: not clipped)
            if self.clip == "est_global":
                scales = rest_scale.expand(len(grads))
            elif self.clip == "layer":
                scales = torch.clamp(self.clip_value / (stacked[r0:].sqrt() + _CLIP_EPS), max=1.0)
            elif self.clip == "prev_global" and self._clip_scale is not None:
                scales = self._clip_scale.expand(len(grads))
            # the kernel's gate per parameter: its scale (or 1), NaN (store nothing) when not finite
            ones = torch.ones_like(stacked[r0:])
            gates = torch.where(rest_ok, ones if scales is None else scales, torch.full_like(ones, float("nan")))
        buckets = None  # the small 1-D parameters stepped together (kernel.Buckets, update_many)
        for i, (p, g) in enumerate(grads):
            state = self._init_state(p)
            state["step"] += 1
            if self._rest_on_kernel(p, state):
                bkey = self._bucket_key(p, g, state)
                if bkey is not None:
                    if buckets is None:
                        buckets = _kernel().Buckets()
                    buckets.add(bkey, (i, p, g, state), p.numel())
                else:
                    self._step_rest_kernel(p, g, state, gates[i])
                continue
            g = g.float()
            if scales is not None:
                g = g * scales[i]
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
                new = torch.clamp(self.clip_value / (self._last_norm + _CLIP_EPS), max=1.0)
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
        return p.dim() == 2 or "int8" not in kinds and ("int8p" not in kinds or p.numel() % 16 == 0)

    def _step_rest_kernel(self, p: Tensor, g: Tensor, state: dict, gate: Tensor) -> None:
        """The rule on a whole non-fused parameter in the kernel's update-only mode. ``gate``
        (fp32 scalar) multiplies the gradient (the clipping scale, or 1) and is NaN when the
        gradient is not finite: the kernel then stores nothing, so the whole parameter keeps
        its value and state (the per-parameter semantics of ``_apply_rule``)."""
        K = _KERNEL[0] if _KERNEL else _kernel()
        names = self.rule.state_names
        kinds = [self.storage.kind_of(state, k) for k in names]
        packed = p.dim() == 1 and "int8p" in kinds  # [n / 16, 16]: 16 x 16 blocks = flat blocks of 256
        as2d = (lambda t: t) if p.dim() == 2 else (lambda t: t.view(-1, 16)) if packed else (lambda t: t.view(1, -1))
        states = [state[k].view(-1, 1, 16, 16) if packed and kind == "int8p"
                  else state[k] if kind in ("int8", "int8p") else as2d(state[k]) for k, kind in zip(names, kinds, strict=True)]
        qt = [self.storage.kernel_table(state, k, k in self.rule.signed_states, p.device) for k in names]
        step = state["step"]
        K.launch_forge(K.MODE_UPDATE, w=as2d(p.data), states=states, kinds=kinds, qtables=qt,
                       rule_name=self.rule.name, hp=self.param_groups[self._group_of[id(p)]], step=step,
                       sr=self.stochastic_rounding, key=_KERNEL[1](self._seed(self.param_index[p], step)),
                       g=as2d(g.contiguous()), scale=gate, approx=self.fast_math)

    def _bucket_key(self, p: Tensor, g: Tensor, state: dict) -> tuple | None:
        """What a non-fused parameter on the kernel must share with others to be stepped in the
        same launch (None: its own launch, ``kernel.bucket_ok``): the device, dtypes, state kinds,
        param group and step count."""
        if not self.rest_buckets or p.dim() != 1:
            return None
        kinds = tuple(self.storage.kind_of(state, k) for k in self.rule.state_names)
        if not _kernel().bucket_ok(p, kinds):
            return None
        return p.device, p.dtype, g.dtype, kinds, self._group_of[id(p)], state["step"]

    def _step_rest_bucket(self, items: list, gates: Tensor) -> None:
        """Step several small 1-D non-fused parameters (``(i, p, g, state)``, ``gates[i]`` each
        one's gate, as :meth:`_step_rest_kernel`) in one update launch (``kernel.update_many``):
        every parameter gets the bits of its own launch; one whose gradient is not finite keeps
        its value and state."""
        K = _KERNEL[0]
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
    def last_grad_norm(self) -> float | None:
        """Global gradient norm of the last step, before clipping (syncs)."""
        return None if self._last_norm is None else float(self._last_norm)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self):
        self.join()
        sd = super().state_dict()
        sd["forge"] = {"step_id": self._step_id,
                       "clip_scale": None if self._clip_scale is None else self._clip_scale.detach().cpu().clone(),
                       "pred_sq": self._predictions()}
        return sd

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
            self._step_id = int(extra["step_id"])
            cs = extra["clip_scale"]
            dev = params[0].device
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
        for layer in self.layers:
            layer.updated_in = -1
        self._last_update_sid = -1


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


def attach(model: nn.Module, rule: Rule, *, state_dtype: str = "fp32", stochastic_rounding: bool = True,
           backend: str = "auto", clip: str = "none", clip_value: float = 1.0, dp_group=None,
           split_tokens: int | None = SPLIT_TOKENS, seed: int = 0, allreduce=None,
           grad_dtype: str = "fp32", overlap: bool = False, param_groups: list[dict] | None = None,
           ws_tokens: int | None = WS_TOKENS, fast_math: bool = False) -> ForgeOptimizer:
    """Fuse the optimizer step into the backward of every linear layer of ``model``.

    Args:
        model: any ``nn.Module``; every ``nn.Linear`` with an unshared, trainable weight is fused.
            Shared weights (tied embedding / LM head) are left to ``step()``, where the
            embedding's and the head's contributions are already summed in ``.grad``.
        rule: ``lt.optim.SGD / AdamW / Lion / AdamS``; its fields become the param-group defaults.
        state_dtype: ``"fp32"``, ``"bf16"``, ``"int8"`` (256-element blocks with an fp32 absmax each;
            < 4096 elements: fp32) or ``"int8p"`` (the absmax packed into the codes' low bits: exactly
            1 byte an element; < 256 elements: fp32; :mod:`leantrain.optim.state`).
        stochastic_rounding: bf16 weights are stored with unbiased stochastic rounding (else nearest).
        backend: ``"auto"`` (Triton on CUDA, torch elsewhere), ``"torch"`` or ``"triton"``.
        clip: ``"none"``, ``"layer"`` (each layer's gradient, weight and bias together, scaled by
            ``min(1, clip_value / (‖g_layer‖ + 1e-6))``; each non-fused parameter likewise), or
            ``"prev_global"`` (every gradient of step t scaled by ``min(1, clip_value / (‖g_{t-1}‖ + 1e-6))``,
            ‖g_{t-1}‖ the global norm of step t-1's unclipped gradient; step 1 is not clipped), or
            ``"est_global"`` (every gradient scaled by ``min(1, clip_value / (N̂ + 1e-6))``, N̂ an
            estimate of this step's global norm: for a fused layer ``N̂² = S + R · C / Q``, S the
            sum of squares of this step's gradients of the layers reduced so far in this backward,
            this one included, C / Q this step's / the predicted sums of squares of those layers,
            R the predicted sum of squares of all the others (step 1: ``N̂² = S``); a prediction is
            a geometric moving average (``_EST_BETA`` = 0.5) of the unit's past sums of squares;
            the non-fused parameters, stepped last, by the exact global norm. dW is materialized).
        dp_group: data-parallel process group. ``None``: the whole world when torch.distributed is
            initialized with more than one rank and the model has no tensor-parallel layers;
            ``False``: no data parallelism.
        split_tokens: on CUDA, from this many tokens on a layer's dW is computed by cuBLAS into one
            reused buffer (at most one layer's dW alive) and the kernel's update-only mode applied;
            None: always the fused kernel (no dW at all). Default 1: the split path was faster at
            every shape and token count measured on an H200 (1.10-1.35x torch vs 0.42-1.13x
            for the fused kernel on the 1b shapes; forge/README.md).
        seed: seed of the stochastic-rounding streams.
        allreduce: ``fn(tensor, group)`` summing ``tensor`` in place over ``group``, used for the
            data-parallel gradient reductions instead of the plain all-reduce (the trainer passes
            ``lt.comm.int8_all_reduce`` for ``--comm.method int8``). FORGE does not import it:
            techniques are composed by the caller.
        grad_dtype: ``"fp32"`` (a materialized dW is accumulated and stored in fp32: the exactness
            statement of forge/README.md) or ``"bf16"`` (on the Triton backend, a layer whose
            inputs are bf16 gets its split-path dW from the bf16 matmul, rounded to bf16 as torch's
            bf16 backward rounds it: 4 bytes a parameter less traffic; not with data parallelism
            or a ``fill`` caller, which keep fp32). A layer on the warp-specialized kernel
            (``ws_tokens``) then rounds its dW tile to bf16 before the update (``ws.launch_ws(dw_bf16=)``).
        overlap: on CUDA, each split-path update runs on a side stream, beside the rest of the
            backward (the next layers' GEMMs), instead of between them: the same launches and bits.
            The dW workspace becomes two buffers per dtype that layers take turns over (a buffer is
            rewritten only after the update that read it). The current stream waits for the side
            stream at the end of every backward (a callback of the autograd engine), so whatever
            follows ``backward()`` sees the updated weights. Off by default: on one H200 the 1b
            step was no faster with it (likely, not profiled: the backward's kernels leave no SMs
            idle for the updates; forge/README.md). ``LEANTRAIN_FORGE_OVERLAP=0/1`` forces it.
        param_groups: other hyper-parameters for some parameters, as torch optimizers take them:
            dicts of ``"params"`` (parameters of ``model``) and any of the rule's hyper-parameters,
            e.g. ``[{"params": norms_and_biases, "weight_decay": 0.0}]``. Every other parameter is
            in the first group, with the rule's values. A fused layer whose bias is in another
            group than its weight leaves the bias out of its fused update (``step()`` steps it).
        ws_tokens: on an sm_90 GPU (H100 / H200), a layer with fewer tokens than this runs the
            warp-specialized fused kernel of ``forge/ws.py`` (Gluon: the GEMM of one tile beside
            the update of another on every SM; no dW anywhere) instead of the split path, when its
            update fits that kernel (bf16 / fp16 inputs, no fused bias, no data parallelism,
            ``clip`` none or prev_global) and is faster there: fp32 states (with bf16 states the
            split path was faster on every linear of the 1b step); None: never. With
            ``grad_dtype="bf16"`` the kernel hands its dW tile to the update in bf16.
        fast_math: on the Triton backend, AdamW's and AdamS's square root and divisions use the
            GPU's approximate instructions (``sqrt.approx``, ``div.full``: a few ulps) instead of
            IEEE's correctly rounded ones, whose per-element branches to a slow path cost the
            warp-specialized kernel 3-14 % of its time on an H200 (forge/README.md). Every kernel of
            the optimizer then uses them, so fused still equals write-dW + update bit for bit; the
            weights stay within 1e-6 of the exact kernels' after a step (max |ΔW| / max |W|).
            Default off: the exact rule.
    """
    return ForgeOptimizer(model, rule, state_dtype=state_dtype, stochastic_rounding=stochastic_rounding,
                          backend=backend, clip=clip, clip_value=clip_value, dp_group=dp_group,
                          split_tokens=split_tokens, seed=seed, allreduce=allreduce, grad_dtype=grad_dtype,
                          overlap=overlap, param_groups=param_groups, ws_tokens=ws_tokens, fast_math=fast_math)


def detach(model: nn.Module) -> None:
    """Restore the original forward of every layer ``attach`` patched."""
    for m in model.modules():
        layer = getattr(m.__dict__.get("linear_fn") or m.__dict__.get("forward"), "layer", None)
        if isinstance(layer, ForgeLayer):
            unpatch(layer)


__all__ = ["attach", "detach", "ForgeOptimizer", "CLIPS"]

"""The per-layer update inside backward (:class:`LayerUpdateMixin` of ForgeOptimizer): dW
materialized in a reused workspace (the split path, data parallelism, clipping by this step's
norms, the torch backend) or fused into a kernel (the tile kernel, the warp-specialized one),
the clip scale and non-finite gate, the rule; and the side stream the split path's updates run on
with ``overlap``.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from leantrain.forge import launch as K
from leantrain.forge.dispatch import choose_path, ws_fits
from leantrain.forge.linear import ForgeLayer
from leantrain.ops._backend import mm_fp32
from leantrain.ops.rng import kernel_key
from leantrain.runtime import collectives

OVERLAP_RING = 2  # dW workspaces per dtype when the updates run on a side stream
_NULL = contextlib.nullcontext()


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
        self.peak_numel = 0  # the most elements its buffers held at once

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
            self.peak_numel = max(self.peak_numel, sum(b.numel() for b in self.bufs.values()))
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


class _LayerHost:
    """Per-layer host cache of the Triton path: state tensors, kinds, 8-bit tables, the param
    group, the reused per-tile sum buffer. Rebuilt when the state dict or a tensor in it is replaced
    (``load_state_dict``)."""

    __slots__ = ("sw", "sb", "checks", "states", "kinds", "qtables", "bstates", "group", "part", "upart", "wpart")

    def __init__(self, sw, sb, checks, states, kinds, qtables, bstates, group):
        self.sw, self.sb, self.checks, self.states, self.kinds = sw, sb, checks, states, kinds
        self.qtables, self.bstates, self.group, self.part, self.upart = qtables, bstates, group, None, None
        self.wpart = None


class LayerUpdateMixin:
    """The per-layer update paths of :class:`leantrain.forge.optimizer.ForgeOptimizer`."""

    def _path(self, layer: ForgeLayer, x2: Tensor | None, dy2: Tensor | None, fill) -> str:
        """The layer's path on the Triton backend (:func:`leantrain.forge.dispatch.choose_path`)."""
        must = fill is not None or self.dp_group is not None or self.clip in ("layer", "est_global")
        tokens = 0 if x2 is None else x2.shape[0]
        ws_ok = False
        wants_ws = layer.slot not in self._filled and (  # (an accumulated gradient: the tiles or split)
            self.kernel == "ws" or (self.kernel == "auto" and self.ws_tokens is not None and tokens < self.ws_tokens))
        if wants_ws and not must and ws_fits(self, layer, x2, fill):
            from leantrain.forge import ws

            dev = layer.weight.device
            ok = self._ws.get(dev)
            if ok is None:
                ok = self._ws[dev] = ws.available(dev)
            ws_ok = ok and ws.supported(x2, dy2, layer.weight)
        return choose_path(self.kernel, tokens, on_cuda=layer.weight.is_cuda, must_materialize=must, ws_ok=ws_ok,
                           split_tokens=self.split_tokens, ws_tokens=self.ws_tokens)

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

    def _materialize(self, layer, x2, dy2, backend, fill=None, ring=1, reduce=True, pad_rows=None):
        """dW (and db) of one layer in the reused workspace (``ring`` buffers a dtype taking turns:
        the updates run on a side stream), plus the layer's accumulated gradient of the step's
        earlier micro-batches (if any), reduced over the DP group (``reduce``; an accumulating
        micro-batch does not reduce). ``pad_rows``: the workspace holds that many rows of dW (then
        that many of db), the rows past the weight's left as they were (a row-sharded weight's
        reduce-scatter input, :mod:`leantrain.forge.shards`)."""
        w, b = layer.weight, layer.bias
        n, k = w.shape
        rows = n if pad_rows is None else pad_rows
        acc = layer.slot in self._filled
        # grad_dtype="bf16": dW of bf16 inputs as the bf16 matmul gives it (torch's bf16 backward's
        # precision), half the workspace traffic; the Triton update reads it in fp32 (with
        # grad_accum > 1: fp32, to which the accumulated gradient is added)
        low = (self.grad_dtype == "bf16" and backend == "triton" and fill is None and self.dp_group is None
               and self.grad_accum == 1 and x2.dtype == torch.bfloat16 and dy2.dtype == torch.bfloat16)
        buf = self._workspace.get(rows * k + (rows if b is not None else 0), w.device,
                                  torch.bfloat16 if low else torch.float32, ring)
        g = buf[: n * k].view(n, k)
        gb = buf[rows * k: rows * k + n] if b is not None else None
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
            K.launch_forge(K.MODE_WRITE_DW, x=x2.contiguous(), dy=dy2.contiguous(), g=g, gb=gb)
        if acc and reduce:
            self._add_accumulated(layer, buf)
        if reduce and self.dp_group is not None:
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

    def _update_triton(self, layer, x2, dy2, sw, sb, step, path: str, fill=None):
        w, b = layer.weight, layer.bias
        h = self._layer_host(layer, sw, sb)
        dyn = None if self._dyn is None else (self._dyn.dev, layer.slot)
        key = 0 if dyn is not None else kernel_key(self._seed(layer.index, step))
        sums = self._grad_sums(w.device)
        # hp: the param group itself, read now (LR schedulers change it; "params" is ignored)
        if path == "split":
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
            if path == "ws":
                self._ws_launch(layer, h, x2, dy2, step, key, dyn, sums)
            else:  # (the step's accumulated gradient, if any, added in the kernel's epilogue: forge/accumulate.py)
                accum = self._accum[layer.slot] if layer.slot in self._filled else None
                part = K.launch_forge(K.MODE_FUSED, x=x2, dy=dy2, w=w, b=b, states=h.states, bias_states=h.bstates,
                                      kinds=h.kinds, qtables=h.qtables, rule_name=self.rule.name, hp=h.group,
                                      step=step, sr=self.stochastic_rounding, key=key,
                                      scale=self._clip_scale if self.clip == "prev_global" else None, part=h.part,
                                      dyn=dyn, sq=sums.sq_views[layer.slot], ticket=sums.ticket_views[layer.slot],
                                      approx=self.fast_math, accum=accum)
                h.part = part  # reused next step (its last program has summed it, stream-ordered)
                self._filled.discard(layer.slot)
        torch.autograd.graph.increment_version(w)
        if b is not None:
            torch.autograd.graph.increment_version(b)

    def _ws_launch(self, layer, h, x2, dy2, step, key, dyn, sums) -> None:
        """The layer's fused update by ``forge/ws.py`` (chosen by :meth:`_ws_layer`)."""
        from leantrain.forge import ws

        w = layer.weight
        scal, flags = K.scalars(self.rule.name, h.group, step)
        part = ws.launch_ws(K.MODE_FUSED, x=x2, dy=dy2, w=w, states=h.states, kinds=h.kinds, part=h.wpart,
                            scal=scal, flags=flags, rule_id=K.RULE_IDS[self.rule.name], sr=self.stochastic_rounding,
                            key=key, scale=self._clip_scale if self.clip == "prev_global" else None, dyn=dyn,
                            dw_bf16=self.grad_dtype == "bf16" and x2.dtype == dy2.dtype == torch.bfloat16,
                            approx=self.fast_math)
        h.wpart = part  # reused next step
        torch.sum(part, 0, out=sums.sq_views[layer.slot])  # the layer's sum of squares (norm, NaN report)

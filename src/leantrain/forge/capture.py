"""FORGE in a CUDA graph: the device table of each layer's per-step kernel scalars and the
optimizer's part in :class:`leantrain.runtime.capture.GraphedStep` (:class:`CaptureMixin`).

A captured launch cannot take new arguments at replay, so with device scalars on
(``set_device_scalars``) every fused layer reads lr, bias corrections and rounding key from its
row of one device table, refilled by one host-to-device copy before each step or replay. The
host bookkeeping a captured backward skips (step counts, the accumulation guard) runs around
each replay (:meth:`CaptureMixin.capture_prepare`, :meth:`CaptureMixin.capture_advance`).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from leantrain.ops.rng import step_kernel_keys
from leantrain.ops.update import DYN_COLS, DynCol
from leantrain.ops.update_launch import dyn_row
from leantrain.runtime.capture import CaptureHooks


class _DynTable:
    """The device table of each fused layer's per-step kernel scalars (``kernel.dyn_row``), one
    row per layer slot, and two page-locked staging copies (CUDA): the whole table goes up in one
    copy per step, issued on the current stream before the step's backward (or graph replay)."""

    def __init__(self, rows: int, device):
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


class CaptureMixin:
    """Device scalars and the GraphedStep hooks of :class:`leantrain.forge.optimizer.ForgeOptimizer`."""

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
        rows[:, DynCol.KEY].view(np.int32)[:] = keys  # the keys' bits
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
        self._update_triton(layer, x2, dy2, sw, sb, sw["step"] + 1, self._path(layer, x2, dy2, fill), fill)
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
                               "(gradient accumulation is not supported; see docs/forge.md)")
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

"""A training step's forward + backward captured once as a CUDA graph, then replayed.

A step issued op by op costs host time per kernel launch (and AGoQ adds its save path's Python
per saved tensor); when the host needs longer to issue a step than the GPU to run it, the GPU
waits. A CUDA graph replays every kernel of the step from one host call::

    step = GraphedStep(lambda idx, tgt: model(idx, tgt), model.parameters(), idx, tgt)
    for idx, tgt in batches:
        loss = step(idx, tgt)       # new batch copied into the static inputs, graph replayed
        opt.step()                  # p.grad are the graph's gradient tensors

What is captured runs exactly as it did at capture: same shapes, same memory, same kernel
arguments. So (a) every batch must have the capture's shape; (b) gradients are *written*, not
accumulated (each replay overwrites ``p.grad``: no gradient accumulation across replays);
(c) host-side decisions made during the forward are frozen. Random numbers are not: every replay
first advances a device salt (:func:`replay_salt`), and AGoQ's batched quantize launches XOR it
into their stochastic-rounding keys inside the graph, so each replay rounds with new noise
(a save AGoQ packs alone, outside a batch, keeps its capture-time key: log-softmax
probabilities and 2/3-bit saves); (d) nothing in the step may synchronize the host (``.item()``,
data-dependent shapes); (e) no tensor may keep an earlier eager step's autograd graph alive (a
loss kept without ``.detach()``): its gradient-accumulation nodes would run on the wrong stream
and invalidate the capture.
The memory the step allocates lives in the graph's private pool for as long as the graph does.

Work a technique runs inside the step on its own (an optimizer that updates weights in backward)
takes part through :class:`CaptureHooks`: it is told when a pass is a warm-up or the capture,
refills its device-side scalars before each replay and advances its host-side counts after.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import torch
from torch import Tensor

from leantrain.ops.rng import GOLDEN31 as _GOLDEN31
from leantrain.ops.rng import replay_salt

__all__ = ["CaptureHooks", "GraphedStep", "replay_salt"]



class CaptureHooks(Protocol):
    """What a technique that runs its own work inside the step (an optimizer updating weights in
    backward) does around a capture. :class:`GraphedStep` calls them in this order: ``check()``
    once, before anything else; ``phase("dry")`` / ``phase(None)`` around each warm-up pass (its
    work runs and stores nothing), ``phase("capture")`` / ``phase(None)`` around the capture;
    then every call ``prepare()`` before the replay (this step's host-side scalars into device
    tensors) and ``advance()`` after it (host-side step counts)."""

    def check(self) -> None: ...
    def phase(self, name: str | None) -> None: ...
    def prepare(self) -> None: ...
    def advance(self) -> None: ...


class GraphedStep:
    """``fn(*inputs) -> loss`` and ``loss.backward()`` captured as one CUDA graph.

    ``inputs`` are copied into static tensors owned by the step; each call copies its arguments
    into them and replays. ``warmup`` eager steps run first on a side stream (kernels compile,
    AGoQ records its plan, cuBLAS picks its algorithms), as capture requires. ``hooks``: the
    :class:`CaptureHooks` of whatever runs inside the step on its own (an optimizer that
    updates weights in backward is one; pass it).
    """

    def __init__(self, fn: Callable[..., Tensor], params: Iterable[torch.nn.Parameter], *inputs: Tensor,
                 warmup: int = 2, hooks: Sequence[CaptureHooks] = ()):
        self.params = [p for p in params if p.requires_grad]
        self.hooks = list(hooks)
        for h in self.hooks:
            h.check()  # (before anything needs CUDA: says what the technique needs)
        if not torch.cuda.is_available():
            raise RuntimeError("GraphedStep needs a CUDA device (CUDA graphs)")
        if not inputs or any(not isinstance(x, Tensor) or x.device.type != "cuda" for x in inputs):
            raise ValueError("GraphedStep: pass the step's input tensors, on the CUDA device")
        self.inputs = [x.detach().clone() for x in inputs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(max(warmup, 1 if self.hooks else 0)):
                self._zero()
                self._phase("dry")
                fn(*self.inputs).backward()
                self._phase(None)
        torch.cuda.current_stream().wait_stream(side)
        self._zero()
        salt = replay_salt(self.inputs[0].device)  # (made outside the graph's memory)
        self.graph = torch.cuda.CUDAGraph()
        self._phase("capture")
        try:
            with torch.cuda.graph(self.graph):
                salt.add_(_GOLDEN31).bitwise_and_(0x7FFFFFFF)  # a new salt every replay (a Weyl sequence)
                loss = fn(*self.inputs)
                loss.backward()
        finally:
            self._phase(None)
        self.loss = loss.detach()
        self.grads = [p.grad for p in self.params]

    def _phase(self, phase) -> None:
        for h in self.hooks:
            h.phase(phase)

    def _zero(self) -> None:
        for p in self.params:
            p.grad = None

    def __call__(self, *inputs: Tensor) -> Tensor:
        """Copy ``inputs`` in, replay; returns the loss tensor (the same tensor every call)."""
        if len(inputs) != len(self.inputs):
            raise ValueError(f"GraphedStep: {len(inputs)} inputs given, captured with {len(self.inputs)}")
        for s, x in zip(self.inputs, inputs):
            if x.shape != s.shape:
                raise ValueError(f"GraphedStep: input of shape {tuple(x.shape)}, captured with {tuple(s.shape)}")
            if x.data_ptr() != s.data_ptr():
                s.copy_(x, non_blocking=True)
        for h in self.hooks:  # this step's scalars into their device tensors
            h.prepare()
        self.graph.replay()
        for h in self.hooks:  # host-side counts (host time while the GPU runs the replay)
            h.advance()
        for p, g in zip(self.params, self.grads):  # (in case something set p.grad = None in between)
            p.grad = g
        return self.loss

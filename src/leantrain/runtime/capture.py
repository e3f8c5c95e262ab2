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

FORGE (``lt.forge.attach``) is captured too: its in-backward update is part of the graph. The
optimizer reads each step's scalars (lr, bias corrections, stochastic-rounding keys) from a device
table (:meth:`ForgeOptimizer.set_device_scalars`) that every call refills, with the step counts,
before the replay; the warm-up passes run its kernels with a NaN gate, so they store nothing;
``opt.step()`` after each call steps the other parameters as usual. Needs the Triton backend on
CUDA, no data or tensor parallelism; ``clip="prev_global"`` / ``"est_global"`` need one eager step
before the capture. A ``load_state_dict`` of the optimizer afterwards needs a new GraphedStep.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor

_SALTS: dict[torch.device, Tensor] = {}
_GOLDEN31 = 0x9E3779B1


def _cuda_device(device) -> torch.device:
    d = torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if d.index is None else d


def replay_salt(device, *, create: bool = True) -> Tensor | None:
    """A device int64 scalar in [0, 2**31): 0 until a :class:`GraphedStep` on ``device`` is
    captured, then advanced at the start of every replay, inside the graph. Captured code that
    draws random numbers from integer keys XORs it into them so that replays differ.
    ``create=False``: None when no GraphedStep made it (a graph captured some other way)."""
    d = _cuda_device(device)
    t = _SALTS.get(d)
    if t is None and create:
        t = _SALTS[d] = torch.zeros((), dtype=torch.int64, device=d)
    return t


class GraphedStep:
    """``fn(*inputs) -> loss`` and ``loss.backward()`` captured as one CUDA graph.

    ``inputs`` are copied into static tensors owned by the step; each call copies its arguments
    into them and replays. ``warmup`` eager steps run first on a side stream (kernels compile,
    AGoQ records its plan, cuBLAS picks its algorithms), as capture requires.
    """

    def __init__(self, fn: Callable[..., Tensor], params: Iterable[torch.nn.Parameter], *inputs: Tensor,
                 warmup: int = 2):
        self.params = [p for p in params if p.requires_grad]
        forge = {id(o): o for o in (p.__dict__.get("_lt_forge", lambda: None)() for p in self.params) if o is not None}
        if len(forge) > 1:
            raise ValueError("GraphedStep: the parameters belong to more than one FORGE optimizer")
        self.forge = next(iter(forge.values()), None)
        if self.forge is not None:
            self.forge._graph_check()  # (before anything needs CUDA: says what FORGE needs)
        if not torch.cuda.is_available():
            raise RuntimeError("GraphedStep needs a CUDA device (CUDA graphs)")
        if not inputs or any(not isinstance(x, Tensor) or x.device.type != "cuda" for x in inputs):
            raise ValueError("GraphedStep: pass the step's input tensors, on the CUDA device")
        self.inputs = [x.detach().clone() for x in inputs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(max(warmup, 1 if self.forge is not None else 0)):
                self._zero()
                self._forge_phase("dry")  # FORGE's kernels run and store nothing
                fn(*self.inputs).backward()
                self._forge_phase(None)
        torch.cuda.current_stream().wait_stream(side)
        self._zero()
        salt = replay_salt(self.inputs[0].device)  # (made outside the graph's memory)
        self.graph = torch.cuda.CUDAGraph()
        self._forge_phase("capture")
        try:
            with torch.cuda.graph(self.graph):
                salt.add_(_GOLDEN31).bitwise_and_(0x7FFFFFFF)  # a new salt every replay (a Weyl sequence)
                loss = fn(*self.inputs)
                loss.backward()
        finally:
            self._forge_phase(None)
        self.loss = loss.detach()
        self.grads = [p.grad for p in self.params]

    def _forge_phase(self, phase) -> None:
        if self.forge is not None:
            self.forge._graph_phase(phase)

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
        if self.forge is not None:  # this step's scalars into the device table
            self.forge._graph_prepare()
        self.graph.replay()
        if self.forge is not None:  # the step counts (host time while the GPU runs the replay)
            self.forge._graph_advance()
        for p, g in zip(self.params, self.grads):  # (in case something set p.grad = None in between)
            p.grad = g
        return self.loss

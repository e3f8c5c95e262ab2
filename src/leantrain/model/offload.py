"""Activation offloading: a checkpointed block's input held in host memory from the block's
forward to its backward (``model.activation_offload``, with ``model.activation_checkpointing``).

With checkpointing alone the device keeps every block's input across the step (``B·T·dim``
values a block: 1 GiB for the 8b shape at B = 2, T = 2048 in bf16). Here each input is copied
to pinned host memory on a side stream as the forward goes on and the device copy is freed; the
block's backward copies it back (on the compute stream, after the copy out has finished), runs
the block's forward again with gradients on, and back-propagates through it: the recompute of
reentrant checkpointing, with the input fetched from the host. The device then holds the
activations of one block at a time.

The block's parameters get their gradients (or, with FORGE or ChunkFT stepping in backward,
their updates) inside this backward, as under ``torch.utils.checkpoint``. The blocks draw no
random numbers, so the recompute needs no RNG state. On a CPU device the "host copy" is the
tensor itself (nothing to move); the recompute path is the same.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]


def _to_host(x: Tensor) -> tuple[Tensor, torch.cuda.Event | None]:
    """A pinned host copy of ``x``, made on a side stream once ``x`` is written; the event marks
    the copy's end. ``x``'s memory is not reused before the copy has read it (``record_stream``)."""
    if x.device.type != "cuda":
        return x.detach(), None
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    stream = _copy_stream(x.device)
    stream.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(stream):
        host.copy_(x, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    x.record_stream(stream)
    return host, done


def _to_device(host: Tensor, done: torch.cuda.Event | None, device: torch.device) -> Tensor:
    if done is None:
        return host
    torch.cuda.current_stream(device).wait_event(done)
    return host.to(device, non_blocking=True)


class _OffloadedBlock(torch.autograd.Function):
    """``forward(block, x, cos, sin, mask, *trained)``: ``trained`` are the block's parameters that
    require gradients, passed only so that the output requires a gradient when they do (a block
    whose input is frozen still trains its weights); their gradients come from the backward run
    inside :meth:`backward`, which returns none for them."""

    @staticmethod
    def forward(ctx, block: nn.Module, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, *trained) -> Tensor:
        ctx.block, ctx.device, ctx.others, ctx.n_trained = block, x.device, (cos, sin, mask), len(trained)
        ctx.host, ctx.done = _to_host(x)
        return block(x, cos, sin, mask)  # (autograd.Function's forward runs without recording a graph)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x = _to_device(ctx.host, ctx.done, ctx.device).detach().requires_grad_(ctx.needs_input_grad[1])
        ctx.host = ctx.done = None
        with torch.enable_grad():
            out = ctx.block(x, *ctx.others)
        torch.autograd.backward(out, grad_out)
        return (None, x.grad, None, None, None) + (None,) * ctx.n_trained


def offloaded_block(block: nn.Module, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None) -> Tensor:
    """``block(x, cos, sin, mask)`` with ``x`` kept in host memory until the block's backward,
    which recomputes the block (module docstring)."""
    trained = [p for p in block.parameters() if p.requires_grad]
    return _OffloadedBlock.apply(block, x, cos, sin, mask, *trained)

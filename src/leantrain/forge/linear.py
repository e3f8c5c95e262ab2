"""The FORGE linear: an autograd Function whose backward computes dX and then updates W.

``forward`` saves its input (and the weight) with ``ctx.save_for_backward`` so
``saved_tensors_hooks`` (the memory ledger, AGoQ) see every saved tensor. ``backward``
computes ``dX = dY W`` with the *old* W first, then hands ``(X, dY)`` to
:meth:`ForgeOptimizer.update_layer`, which applies the optimizer step to W (and the bias)
from ``dW = dYᵀ X`` without keeping ``dW``: the fused Triton kernel never writes it; the
torch backend computes it, consumes it and drops it before the next layer's backward.
The weight's gradient returned to autograd is ``None``: nothing accumulates in ``.grad``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from leantrain.model.extension import Fill, claim, release
from leantrain.ops._backend import autocast_dtype


@dataclass(eq=False)
class ForgeLayer:
    """One fused layer: its module, fused parameters and bookkeeping (no tensors of its own)."""

    name: str
    module: nn.Module
    weight: nn.Parameter
    bias: nn.Parameter | None
    index: int  # position among all params of the optimizer (stochastic-rounding stream)
    group_index: int = 0
    slot: int = -1  # position in the optimizer's layer list (its per-layer sums and clip scale)
    tp_group: object = None  # the weight is a tensor-parallel shard (norm sums need a TP all-reduce)
    sharded: bool = False  # the weight is a row-sharded DTensor (FSDP2): forward sees it all-gathered
    updated_in: int = -1  # optimizer step id of the last update (gradient accumulation guard)
    opt: object = field(default=None, repr=False)
    host: object = field(default=None, repr=False)  # the optimizer's per-layer launch cache

    def take(self, inputs: Tensor, fill: Fill) -> None:
        """:class:`leantrain.model.extension.GradSink`: the layer's update from a gradient that
        ``fill`` writes (the LM head's fused loss)."""
        self.opt.update_layer(self, inputs, None, fill=fill)


class ForgeLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, layer: ForgeLayer) -> Tensor:
        cdt = autocast_dtype(x.device.type)
        if cdt is not None and x.dtype != cdt:
            x = x.to(cdt)
        # every operand in x's dtype: under autocast F.linear then casts nothing (no context switch needed)
        wc = weight if weight.dtype == x.dtype else weight.to(x.dtype)
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        y = F.linear(x, wc, bias)
        ctx.layer = layer
        ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, weight = ctx.saved_tensors
        layer: ForgeLayer = ctx.layer
        if dy.dtype != x.dtype:
            dy = dy.to(x.dtype)
        dx = None
        if ctx.needs_input_grad[0]:  # old W: before the update below
            dx = dy.matmul(weight if weight.dtype == dy.dtype else weight.to(dy.dtype))
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        dy2 = dy if dy.dim() == 2 else dy.reshape(-1, dy.shape[-1])
        layer.opt.update_layer(layer, x2, dy2)
        return dx, None, None, None


def forge_linear(layer: ForgeLayer, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` whose backward updates ``weight`` (and ``bias``) in place."""
    # (FSDP2: the module holds the all-gathered weight of the DTensor one during forward)
    if weight is not layer.weight and not (layer.sharded and weight.shape == layer.weight.shape):
        raise RuntimeError(f"FORGE: layer {layer.name!r} was called with a weight it was not attached to")
    if not torch.is_grad_enabled() or not weight.requires_grad:  # (frozen since attach: plain linear)
        return F.linear(x, weight, bias)
    if bias is not None and bias is not layer.bias and bias.requires_grad:  # a trainable bias FORGE does not
        # update (shared, or in another param group): added after, so autograd gives it its gradient
        y = ForgeLinearFn.apply(x, weight, None, layer)
        return y + bias.to(y.dtype)
    return ForgeLinearFn.apply(x, weight, bias, layer)


class _LinearForward:
    """Replacement ``forward`` of a plain ``nn.Linear`` (an instance attribute; detach deletes it)."""

    def __init__(self, layer: ForgeLayer):
        self.layer = layer

    def __call__(self, x: Tensor) -> Tensor:
        m = self.layer.module
        return forge_linear(self.layer, x, m.weight, m.bias)


class _LinearFn:
    """Replacement ``linear_fn(x, weight, bias)`` of modules that expose one (``lt.dist.tp``)."""

    def __init__(self, layer: ForgeLayer):
        self.layer = layer

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        return forge_linear(self.layer, x, weight, bias)


def patch(layer: ForgeLayer) -> None:
    """Route ``layer.module``'s matmul through :class:`ForgeLinearFn` (its ``linear_fn`` where it
    has one, else its ``forward``); a module with a ``grad_sink`` (the LM head's fused loss) hands
    its weight gradient to the layer. The module is claimed for FORGE
    (:func:`leantrain.model.extension.claim`)."""
    m = layer.module
    claim(m, "FORGE", layer.name)
    if hasattr(type(m), "linear_fn"):
        m.linear_fn = _LinearFn(layer)
    else:
        m.forward = _LinearForward(layer)
    if hasattr(m, "grad_sink"):
        m.grad_sink = layer


def unpatch(layer: ForgeLayer) -> None:
    m = layer.module
    for attr in ("linear_fn", "forward"):
        if attr in m.__dict__:
            delattr(m, attr)
    if getattr(m, "grad_sink", None) is layer:
        m.grad_sink = None
    release(m, "FORGE")


__all__ = ["ForgeLayer", "ForgeLinearFn", "forge_linear", "patch", "unpatch"]

"""The language-model loss without the logits tensor: the LM head and the cross-entropy fused.

At 1b (vocabulary 32000) and B = 8, T = 1024, the logits are 0.5 GiB in bf16; cross-entropy
then keeps their fp32 log-softmax for backward (1 GiB) and backward makes a gradient of the
logits' size (0.5 GiB) that the head's matmuls need whole. :func:`linear_cross_entropy`
computes ``F.cross_entropy(h @ W.T + b, targets, reduction="none")`` in slices of the
vocabulary instead:

- forward, per slice ``j`` of ``cols`` vocabulary rows: ``z_j = h @ W_j.T`` in fp32 (fp32
  accumulation of the compute dtype's products; unlike ``F.linear``'s bf16 output, never
  rounded to bf16), the targets' logits gathered from it, and a running log-sum-exp. Saved for
  backward: ``h``, ``W`` (a parameter: no copy), the targets and the log-sum-exp per token
  (fp32, ``[N, 1]``). Nothing of the vocabulary's size. (The element-wise passes over a
  slice are one kernel each on CUDA: :mod:`leantrain.ops.xent`.)
- backward, per slice: ``z_j`` again (one more matmul of the head's forward size),
  ``dz_j = g · (exp(z_j - lse) - onehot_j)`` rounded to the compute dtype (as the ``.float()``
  cast of the unfused form rounds it), then ``dW_j = dz_jᵀ h`` into rows ``j`` of dW (fp32
  accumulation; complete over every token: no accumulation across slices) and
  ``dh += dz_j W_j`` (an fp32 accumulator of ``h``'s size; on CUDA one GEMM with beta = 1).

A slice holds ``ceil(budget · V / N)`` columns rounded up to a multiple of 128 (of 8 below 128;
``budget``: ``ModelConfig.loss_chunk`` tokens' worth of logits), so its fp32 logits are about
``budget × V × 4`` bytes whatever the batch: 125 MiB at 1b with the default 1024.

``grad_sink`` (a :class:`leantrain.model.extension.GradSink`): the head's weight gradient goes to
it instead of autograd. The slices write dW into the sink's buffer (``sink.take(h, fill)``);
whatever the sink does with it (an optimizer step inside backward) follows; ``dh`` is computed
with the old W (the slices run before ``fill`` returns). AGoQ: ``h`` is saved with
``ctx.save_for_backward`` under the LM head's module (role ``head_in``); the log-sum-exp
(``[N, 1]``: a reduced statistic) and the integer targets are kept exact.

In fp32 the per-token losses and gradients equal the unfused form's up to the summation order
(≤ 2e-6 relative, tested); in bf16 they differ by the unfused form's rounding of the logits to
bf16, which this form does not do (``tests/test_losses.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from leantrain.model.extension import GradSink
from leantrain.ops._backend import addmm_fp32, autocast_dtype, mm_fp32
from leantrain.ops.xent import slice_lse, softmax_grad

__all__ = ["linear_cross_entropy", "LinearCrossEntropyFn", "slice_cols"]

_ALIGN = 128


def slice_cols(n_rows: int, vocab: int, budget: int) -> int:
    """Vocabulary columns per slice: about ``budget`` rows' worth of logits (0: one slice)."""
    if budget <= 0 or n_rows <= budget:
        return vocab
    cols = -(-budget * vocab // n_rows)
    align = _ALIGN if cols >= _ALIGN else 8  # whole 128-column tiles for the matmuls; small vocabularies: 8
    return min(-(-cols // align) * align, vocab)


def _weight_slice(weight: Tensor, j0: int, j1: int, dtype) -> Tensor:
    """Rows ``j0:j1`` of the weight in the compute dtype (cast once a slice, used by every matmul of it)."""
    w = weight[j0:j1]
    return w if w.dtype == dtype else w.to(dtype)


def _slice_logits(h: Tensor, w: Tensor, bias: Tensor | None, j0: int, buf: Tensor) -> Tensor:
    """fp32 ``h @ w.T (+ b[j0:])`` into ``buf`` (fp32 accumulation, never rounded to ``h``'s dtype)."""
    z = buf.view(-1)[: h.shape[0] * w.shape[0]].view(h.shape[0], w.shape[0])
    mm_fp32(h, w.t(), z, allow_upcast=True)
    if bias is not None:
        z += bias[j0:j0 + w.shape[0]].to(h.dtype).float()
    return z


class LinearCrossEntropyFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, cols: int,
                ignore_index: int, layer) -> Tensor:
        cdt = autocast_dtype(h.device.type) or h.dtype
        if h.dtype != cdt:
            h = h.to(cdt)
        n, vocab = h.shape[0], weight.shape[0]
        lse = torch.full((n,), float("-inf"), dtype=torch.float32, device=h.device)
        zt = torch.zeros(n, dtype=torch.float32, device=h.device)
        valid = targets != ignore_index
        buf = torch.empty(n * cols, dtype=torch.float32, device=h.device)
        for j0 in range(0, vocab, cols):
            j1 = min(vocab, j0 + cols)
            z = _slice_logits(h, _weight_slice(weight, j0, j1, h.dtype), bias, j0, buf)
            part, zt_j = slice_lse(z, targets, j0, ignore_index)
            zt += zt_j
            lse = torch.logaddexp(lse, part)
        del buf
        # a target outside [0, V) (other than ignore_index) gives a NaN loss, not a host sync
        bad = valid & ((targets < 0) | (targets >= vocab))
        loss = torch.where(valid, lse - zt, 0.0).masked_fill_(bad, float("nan"))
        ctx.save_for_backward(h, weight, bias, targets, lse.unsqueeze(1))
        ctx.cols, ctx.ignore_index, ctx.layer = cols, ignore_index, layer
        return loss

    @staticmethod
    def backward(ctx, grad: Tensor):
        h, weight, bias, targets, lse = ctx.saved_tensors
        layer, cols = ctx.layer, ctx.cols
        n, vocab = h.shape[0], weight.shape[0]
        gs = torch.where(targets != ctx.ignore_index, grad.float(), 0.0)
        lse = lse.view(-1)
        need_h = ctx.needs_input_grad[0]
        need_w = layer is None and ctx.needs_input_grad[1]
        need_b = layer is None and bias is not None and ctx.needs_input_grad[2]
        if not (need_h or need_w or need_b or layer is not None):
            return None, None, None, None, None, None, None
        dh = torch.zeros(n, h.shape[1], dtype=torch.float32, device=h.device) if need_h else None

        def fill(gw: Tensor | None, gb: Tensor | None) -> None:
            buf = torch.empty(n * cols, dtype=torch.float32, device=h.device)
            for j0 in range(0, vocab, cols):
                j1 = min(vocab, j0 + cols)
                w = _weight_slice(weight, j0, j1, h.dtype)
                dz = softmax_grad(_slice_logits(h, w, bias, j0, buf), lse, gs, targets, j0, h.dtype)
                if gb is not None:
                    torch.sum(dz, 0, dtype=torch.float32, out=gb[j0:j1])
                if gw is not None:
                    if gw.dtype == torch.float32:
                        mm_fp32(dz.t(), h, gw[j0:j1], allow_upcast=True)
                    else:
                        torch.mm(dz.t(), h, out=gw[j0:j1])
                if dh is not None:  # the old W: FORGE updates it only after fill returns
                    addmm_fp32(dh, dz, w)
                del dz

        dw = db = None
        if layer is not None:
            layer.take(h, fill)
        else:
            if need_w:
                dw = torch.empty_like(weight, dtype=torch.float32 if weight.dtype == torch.float32 else h.dtype)
            if need_b:
                db = torch.empty(vocab, dtype=torch.float32, device=h.device)
            fill(dw, db)
        return (dh.to(h.dtype) if dh is not None else None), dw, db, None, None, None, None


def linear_cross_entropy(h: Tensor, weight: Tensor, targets: Tensor, *, bias: Tensor | None = None,
                         budget: int = 1024, ignore_index: int = -100,
                         grad_sink: GradSink | None = None) -> Tensor:
    """Per-token ``F.cross_entropy(h @ weight.T + bias, targets, reduction="none")`` without the
    logits tensor (module docstring). ``h [N, D]``, ``weight [V, D]``, ``targets [N]`` (``ignore_index``:
    loss 0, no gradient). ``budget``: logits held at once, in rows of ``V`` (0: all at once).
    ``grad_sink``: the head's weight (and bias) gradient goes to it in backward, not to ``.grad``."""
    if h.dim() != 2 or weight.dim() != 2 or h.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: h {tuple(h.shape)} and weight {tuple(weight.shape)} "
                         "must be [N, D] and [V, D]")
    if targets.shape != h.shape[:1]:
        raise ValueError(f"linear_cross_entropy: targets {tuple(targets.shape)} must be [{h.shape[0]}]")
    if budget < 0:
        raise ValueError(f"linear_cross_entropy: budget must be >= 0, got {budget}")
    if grad_sink is not None and not torch.is_grad_enabled():
        grad_sink = None
    cols = slice_cols(h.shape[0], weight.shape[0], budget)
    return LinearCrossEntropyFn.apply(h, weight, bias, targets, cols, ignore_index, grad_sink)

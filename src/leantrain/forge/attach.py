"""``lt.forge.attach`` / ``lt.forge.detach``: turn FORGE on and off for a model."""

from __future__ import annotations

from torch import nn

from leantrain.forge.dispatch import SPLIT_TOKENS, WS_TOKENS, KernelChoice
from leantrain.forge.linear import ForgeLayer, unpatch
from leantrain.forge.optimizer import ForgeOptimizer
from leantrain.optim.rules import Rule


def attach(model: nn.Module, rule: Rule, *, state_dtype: str = "fp32", stochastic_rounding: bool = True,
           backend: str = "auto", clip: str = "none", clip_value: float = 1.0, dp_group=None,
           split_tokens: int | None = SPLIT_TOKENS, seed: int = 0, allreduce=None,
           grad_dtype: str = "fp32", overlap: bool = False, param_groups: list[dict] | None = None,
           ws_tokens: int | None = WS_TOKENS, fast_math: bool = False, kernel: KernelChoice = "auto",
           rest_buckets: bool = True, grad_accum: int = 1, accum_dtype: str = "bf16",
           accum_error_feedback: bool = True) -> ForgeOptimizer:
    """Fuse the optimizer step into the backward of every linear layer of ``model``. (About 100
    lines, most of them this docstring: every keyword is documented here.)

    Args:
        model: any ``nn.Module``; every ``nn.Linear`` with an unshared, trainable weight is fused.
            Shared weights (tied embedding / LM head) are left to ``step()``, where the
            embedding's and the head's contributions are already summed in ``.grad``.
        rule: ``lt.optim.SGD / AdamW / Lion / AdamS``; its fields become the param-group defaults.
        state_dtype: ``"fp32"``, ``"bf16"``, ``"int8"`` (256-element blocks with an fp32 absmax each;
            < 4096 elements: fp32), ``"int8p"`` (the absmax packed into the codes' low bits: exactly
            1 byte an element; < 256 elements: fp32) or ``"fp8"`` (e4m3 codes in int8's blocks and
            bytes, converted by the GPU's own instructions; :mod:`leantrain.optim.state`).
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
            a geometric moving average (0.5) of the unit's past sums of squares;
            the non-fused parameters, stepped last, by the exact global norm. dW is materialized).
        dp_group: data-parallel process group. ``None``: the whole world when torch.distributed is
            initialized with more than one rank and the model has no tensor-parallel layers;
            ``False``: no data parallelism.
        split_tokens: with ``kernel="auto"`` on CUDA, from this many tokens on a layer's dW is computed
            by cuBLAS into one reused buffer (at most one layer's dW alive) and the update kernel
            applied (the split path); None: the fused tile kernel (no dW at all). Default 1: the split
            path was faster at every 1b shape and token count measured on an H200 (docs/forge.md).
        seed: seed of the stochastic-rounding streams.
        allreduce: ``fn(tensor, group)`` summing ``tensor`` in place over ``group``, used for the
            data-parallel gradient reductions instead of the plain all-reduce (the trainer passes
            ``lt.comm.int8_all_reduce`` for ``--comm.method int8``). FORGE does not import it:
            techniques are composed by the caller.
        grad_dtype: ``"fp32"`` (a materialized dW is accumulated and stored in fp32: the exactness
            statement of docs/forge.md) or ``"bf16"`` (on the Triton backend, a layer whose
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
            idle for the updates; docs/forge.md).
        param_groups: other hyper-parameters for some parameters, as torch optimizers take them:
            dicts of ``"params"`` (parameters of ``model``) and any of the rule's hyper-parameters,
            e.g. ``[{"params": norms_and_biases, "weight_decay": 0.0}]``. Every other parameter is
            in the first group, with the rule's values. A fused layer whose bias is in another
            group than its weight leaves the bias out of its fused update (``step()`` steps it).
        ws_tokens: with ``kernel="auto"`` on an sm_90 GPU (H100 / H200), a layer with fewer tokens than this runs the
            warp-specialized fused kernel of ``forge/ws.py`` (Gluon: the GEMM of one tile beside
            the update of another on every SM; no dW anywhere) instead of the split path, when its
            update fits that kernel (bf16 / fp16 inputs, no fused bias, no data parallelism,
            ``clip`` none or prev_global) and is faster there: fp32 states (with bf16 states the
            split path was faster on every linear of the 1b step); None (default): never. With
            ``grad_dtype="bf16"`` the kernel hands its dW tile to the update in bf16.
        fast_math: on the Triton backend, AdamW's and AdamS's square root and divisions use the
            GPU's approximate instructions (``sqrt.approx``, ``div.full``: a few ulps) instead of
            IEEE's correctly rounded ones, whose per-element branches to a slow path cost the
            warp-specialized kernel a few percent of its time (docs/forge.md). Every kernel of
            the optimizer then uses them, so fused still equals write-dW + update bit for bit; the
            weights stay within 1e-6 of the exact kernels' after a step (max |ΔW| / max |W|).
            Default off: the exact rule.
        kernel: which kernel computes a layer's dW and update on the Triton backend: ``"auto"`` (by
            the layer's token count with ``split_tokens`` / ``ws_tokens``: the table of
            :mod:`leantrain.forge.dispatch`), ``"tiles"`` (the fused tile kernel: no dW anywhere),
            ``"split"`` (cuBLAS's dW into one reused workspace, then the update kernel) or ``"ws"``
            (the warp-specialized kernel wherever a layer fits it, else split). A layer whose dW must
            be seen whole (data parallelism, ``clip`` "layer" / "est_global") takes the split path
            whatever the choice.
        rest_buckets: on the Triton backend, ``step()`` steps the small 1-D non-fused parameters
            (norm weights and biases) that share a dtype, state kinds, param group and step count in
            one update launch over their concatenation (the same bits as one launch each); False:
            one launch a parameter.
        grad_accum: micro-batches a step accumulates over. With ``k > 1``, call
            ``opt.before_micro_batch()`` before each micro-batch's forward: the backwards of the
            first ``k - 1`` micro-batches since the last ``step()`` add each layer's dW into the
            layer's accumulation buffer, the k-th adds that sum to its own dW and updates (the split
            path, :mod:`leantrain.forge.accumulate`); divide each micro-batch's loss by ``k``.
        accum_dtype: the accumulation buffers' dtype, ``"bf16"`` (2 bytes a fused parameter),
            ``"fp32"`` (4 bytes: the sum as one big batch's gradient, up to summation order) or
            ``"int8"`` (int8 codes with per-256-element scales and an int8 error-feedback residual:
            2.03 bytes, ~16 bits relative to each group's largest element;
            :class:`leantrain.optim.grad8.Int8GradBuffer`).
        accum_error_feedback: ``accum_dtype="int8"`` only: keep the residual (True) or not (False:
            1.02 bytes a fused parameter, each fold losing up to half a code step of its group).
    """
    return ForgeOptimizer(model, rule, state_dtype=state_dtype, stochastic_rounding=stochastic_rounding,
                          backend=backend, clip=clip, clip_value=clip_value, dp_group=dp_group,
                          split_tokens=split_tokens, seed=seed, allreduce=allreduce, grad_dtype=grad_dtype,
                          overlap=overlap, param_groups=param_groups, ws_tokens=ws_tokens, fast_math=fast_math,
                          kernel=kernel, rest_buckets=rest_buckets, grad_accum=grad_accum, accum_dtype=accum_dtype,
                          accum_error_feedback=accum_error_feedback)


def detach(model: nn.Module) -> None:
    """Restore the original forward of every layer ``attach`` patched."""
    for m in model.modules():
        layer = getattr(m.__dict__.get("linear_fn") or m.__dict__.get("forward"), "layer", None)
        if isinstance(layer, ForgeLayer):
            unpatch(layer)


__all__ = ["attach", "detach"]

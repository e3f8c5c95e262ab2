"""Launching FORGE's kernel (:mod:`leantrain.forge.kernel`): tile configurations, launch plans
cached per signature, and :func:`launch_forge`, one call for the four modes of a layer (the
update-only mode runs the shared update kernel of :mod:`leantrain.ops.update`)."""

from __future__ import annotations

import torch

from leantrain.forge.kernel import (
    ACC_BF16,
    ACC_FP32,
    ACC_INT8,
    ACC_INT8_EF,
    ACC_NONE,
    MODE_ACCUM,
    MODE_FUSED,
    MODE_UPDATE,
    MODE_WRITE_DW,
)
from leantrain.ops._backend import HAS_TRITON, interpreting
from leantrain.ops.tiles import fast_bits
from leantrain.ops.update import DYN_COLS, FLAG_NAMES, RULE_IDS, STATE_KIND
from leantrain.ops.update_launch import (
    Buckets,
    DirectLauncher,
    Plan,
    bucket_ok,
    cdiv,
    device_keys,
    dyn_row,
    epilogue_args,
    launch_update,
    native_cvt,
    rule_scalars,
    scalars,
    state_args,
    update_many,
    update_tile,
)
from leantrain.optim.grad8 import Int8GradBuffer

if HAS_TRITON:
    from leantrain.forge.kernel import _forge_kernel

LARGE_T = 2048  # above this many tokens the fused mode uses 128 x 128 x 32 tiles at 8 warps
FUSED_MAXNREG = 168  # the fused 64 x 64 tile's register cap (three programs an SM; heuristic_config)
INTERP_TILE = {"BLOCK_N": 16, "BLOCK_K": 16, "BLOCK_T": 16, "GROUP_N": 2, "num_warps": 1}  # the CPU interpreter's
_I32 = 1 << 31


def accum_int8_tile(group: int, on_gpu: bool) -> dict:
    """The tile of ``MODE_ACCUM`` into an int8 buffer: rows of one whole group (``BLOCK_K = group``),
    16 of them under the interpreter, 32 at 8 warps on a GPU (a 32 x 256 fp32 tile: 32 registers a
    thread for the accumulator)."""
    if not on_gpu:
        return {"BLOCK_N": 16, "BLOCK_K": group, "BLOCK_T": 16, "GROUP_N": 2, "num_warps": 1}
    return {"BLOCK_N": 32, "BLOCK_K": group, "BLOCK_T": 32, "GROUP_N": 8, "num_warps": 8, "num_stages": 2}


def heuristic_config(mode: int, T: int, int8: bool = False, w_bf16: bool = False, states_bf16: bool = False) -> dict:
    """The tile configuration of a launch on a GPU when the caller pins none (measured on an H200:
    ``benchmarks/tools/tune_kernels.py``, docs/forge.md).

    Fused / write-dW: 64 x 64 tiles, 64-token steps, 4 warps, 3 stages up to ``LARGE_T`` tokens
    (and always with 8-bit states: the 16 x 16 block requantization needs the registers);
    128 x 128 x 32 at 8 warps above. The fused mode's 64 x 64 tile (fp32 / bf16 states) is
    compiled with at most ``FUSED_MAXNREG`` registers a thread: three programs an SM instead of
    two. Update-only: :func:`leantrain.ops.update_launch.update_tile`."""
    if mode == MODE_UPDATE:
        return update_tile(w_bf16, states_bf16, int8)
    if T <= LARGE_T or int8:
        cfg = {"BLOCK_N": 64, "BLOCK_K": 64, "BLOCK_T": 64, "GROUP_N": 8, "num_warps": 4, "num_stages": 3}
        if mode == MODE_FUSED and not int8:
            cfg["maxnreg"] = FUSED_MAXNREG
        return cfg
    return {"BLOCK_N": 128, "BLOCK_K": 128, "BLOCK_T": 32, "GROUP_N": 8, "num_warps": 8, "num_stages": 3}


def accum_args(accum, dummy) -> tuple[int, int, tuple]:
    """``(ACC_KIND, ACC_GROUP, (ACC, ACS, ACR, ACRS))`` of an accumulation buffer: None, a flat fp32 /
    bf16 tensor, or a filled :class:`leantrain.optim.grad8.Int8GradBuffer` (its codes read as int8)."""
    if accum is None:
        return ACC_NONE, 1, (dummy,) * 4
    if isinstance(accum, Int8GradBuffer):
        if accum.codes is None:
            raise ValueError("launch_forge(accum=...): an Int8GradBuffer that holds no sum yet")
        codes, resid = accum.codes, accum.resid
        tensors = (codes.data.view(torch.int8), codes.scale,
                   dummy if resid is None else resid.data.view(torch.int8), dummy if resid is None else resid.scale)
        return (ACC_INT8 if resid is None else ACC_INT8_EF), accum.group_size, tensors
    kinds = {torch.float32: ACC_FP32, torch.bfloat16: ACC_BF16}
    if accum.dtype not in kinds or not accum.is_contiguous():
        raise ValueError(f"launch_forge(accum=...): a contiguous fp32 or bf16 buffer, got {accum.dtype}")
    return kinds[accum.dtype], 1, (accum,) + (dummy,) * 3


def _accum_launch(mode: int, accum, N: int, K: int, has_bias: bool, dummy) -> tuple[int, int, tuple, object]:
    """:func:`accum_args` of a launch after its checks, and the fp32 db an int8 fold of a layer with a
    bias writes for :meth:`~leantrain.optim.grad8.Int8GradBuffer.fold_tail_` (else None). An int8
    ``MODE_ACCUM`` counts its fold (:meth:`~leantrain.optim.grad8.Int8GradBuffer.writable`)."""
    if (mode == MODE_ACCUM and accum is None) or (mode == MODE_WRITE_DW and accum is not None):
        raise ValueError("launch_forge: accum= goes with MODE_ACCUM (required) and MODE_FUSED")
    fold_gb = None
    if accum is not None:
        held = accum.numel if isinstance(accum, Int8GradBuffer) else accum.numel()
        if held != N * K + (N if has_bias else 0):
            raise ValueError(f"launch_forge(accum=...): a buffer of {held} elements for a [{N}, {K}] layer"
                             f"{' with bias' if has_bias else ''}")
        if mode == MODE_ACCUM and isinstance(accum, Int8GradBuffer):
            if K % accum.group_size:
                raise ValueError(f"launch_forge(MODE_ACCUM): an int8 buffer needs K ({K}) a multiple of its group "
                                 f"size ({accum.group_size}); fold with Int8GradBuffer.add_ instead")
            accum.writable(dummy.device)
            if has_bias:  # (its groups span tiles: folded after the launch)
                fold_gb = torch.empty(N, dtype=torch.float32, device=dummy.device)
    return (*accum_args(accum, dummy), fold_gb)


_PLANS: dict = {}
_DIRECT = DirectLauncher(_forge_kernel, "T", "MODE") if HAS_TRITON else None


def _plan(mode: int, N: int, K: int, T: int, int8: bool, tune: dict | None, on_gpu: bool, meta: dict) -> Plan:
    """The launch plan of the fused / write-dW modes: tiles (the interpreter's, ``tune``, or
    :func:`heuristic_config`), grid and the constexpr arguments."""
    if mode == MODE_ACCUM and meta["ACC_KIND"] >= ACC_INT8:  # (whole groups a tile row, whatever ``tune`` says)
        cfg = accum_int8_tile(meta["ACC_GROUP"], on_gpu)
    elif not on_gpu:
        cfg = dict(INTERP_TILE)
    elif tune is not None:
        cfg = {k: v for k, v in tune.items() if k != "EARLY_LOADS"}  # (an update-only option)
    else:
        cfg = heuristic_config(mode, T, int8)
    meta = dict(meta, **cfg)
    consts = _DIRECT.consts(meta) if on_gpu else None
    grid = cdiv(N, cfg["BLOCK_N"]) * cdiv(K, cfg["BLOCK_K"])
    meta["enable_fp_fusion"] = False  # see leantrain.ops._backend
    return Plan(_forge_kernel, meta, consts, (grid,), grid)


def launch_forge(mode: int, *, x=None, dy=None, w=None, b=None, states=(), bias_states=(), kinds=(),
                 qtables=(), g=None, gb=None, scale=None, rule_name="adamw", hp=None, step=1,
                 sr=True, key=0, tune=None, part=None, dyn=None, sq=None, ticket=None, rows=None, approx=False,
                 accum=None, accum_read=True):
    """Launch FORGE's kernel on one layer. Returns the per-tile sum-of-squares tensor.

    ``mode``: ``MODE_FUSED`` (dW of ``x: [T, K]`` and ``dy: [T, N]``, same dtype, contiguous rows,
    and the update of ``w: [N, K]`` and ``b``), ``MODE_WRITE_DW`` (dW / db into ``g`` / ``gb``),
    ``MODE_UPDATE`` (the update from ``g`` / ``gb``: :func:`leantrain.ops.update_launch.launch_update`,
    whose docstring describes ``states``, ``kinds``, ``qtables``, ``scale``, ``dyn``, ``sq`` /
    ``ticket``, ``rows`` and ``approx``). ``tune``: a tile configuration (``BLOCK_N, BLOCK_K,
    BLOCK_T, GROUP_N, num_warps[, num_stages, maxnreg, EARLY_LOADS]``) pinned instead of
    :func:`heuristic_config`'s: for tuning scripts and tests.

    ``accum``: the layer's gradient-accumulation buffer (flat, ``N·K`` weight elements then ``N``
    bias ones: a fp32 / bf16 tensor or an :class:`~leantrain.optim.grad8.Int8GradBuffer`). In
    ``MODE_FUSED`` its sum is added to dW (and db) before the norm and the update (the buffer is
    only read: the caller marks it consumed); ``MODE_ACCUM`` (``w`` and ``b`` give the shapes and are
    not written) stores ``accum + dW`` into it, or ``dW`` with ``accum_read=False`` (the step's first
    micro-batch); into an int8 buffer (``K`` a multiple of its group size) it is the fold of
    :meth:`~leantrain.optim.grad8.Int8GradBuffer.add_` / ``copy_``, the bias's groups folded after
    the launch from an N-element fp32 db."""
    if mode == MODE_UPDATE:
        return launch_update(w=w, g=g, b=b, gb=gb, states=states, bias_states=bias_states, kinds=kinds,
                             qtables=qtables, scale=scale, rule_name=rule_name, hp=hp, step=step, sr=sr, key=key,
                             tune=tune, part=part, dyn=dyn, sq=sq, ticket=ticket, rows=rows, approx=approx)
    if rows is not None:
        raise ValueError("launch_forge(rows=...): the update-only mode only")
    dummy = w if w is not None else g
    N, K = dummy.shape
    dev = dummy.device
    native = native_cvt(dev)
    on_gpu = native > 0
    T = x.shape[0]
    assert x.stride(-1) == 1 and dy.stride(-1) == 1 and x.dtype == dy.dtype
    if not on_gpu and x.dtype != torch.float32 and interpreting():  # the interpreter's tl.dot: wrong on bf16
        x, dy = x.float(), dy.float()  # exact: same products, fp32 accumulation
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    if mode in (MODE_WRITE_DW, MODE_ACCUM):
        has_bias = (gb is not None) if mode == MODE_WRITE_DW else (b is not None)
        states, bias_states, kinds, dyn, b, scale, sq = (), (), (), None, None, None, None
        e = epilogue_args("sgd", {"lr": 0.0}, 1, kinds, qtables, None)
    else:
        e = epilogue_args(rule_name, hp, step, kinds, qtables, dyn)
        has_bias = b is not None
    acc_kind, acc_group, acc_ptrs, fold_gb = _accum_launch(mode, accum, N, K, has_bias, dummy)
    if fold_gb is not None:
        gb = fold_gb
    w_bf16 = w is not None and w.dtype == torch.bfloat16
    pkey = (mode, N, K, T <= LARGE_T, rule_name, e.kind1, e.kind2, len(states), w_bf16, bool(sr), has_bias,
            e.signs, scale is not None, prec, e.flags, native, dyn is not None, sq is not None,
            None if tune is None else tuple(sorted(tune.items())), bool(approx), acc_kind, bool(accum_read),
            acc_group)
    plan = _PLANS.get(pkey)
    if plan is None:
        meta = dict(MODE=mode, RULE=RULE_IDS[rule_name], KIND1=e.kind1, KIND2=e.kind2, NSTATE=len(states),
                    W_BF16=w_bf16, SR=bool(sr), HAS_BIAS=has_bias, HAS_SCALE=scale is not None, PREC=prec,
                    HAS_DYN=dyn is not None, SUM_OUT=sq is not None, IDX32=N * K + N < _I32, NATIVE_CVT=native,
                    SIGN1=e.signs[0], SIGN2=e.signs[1], APPROX=bool(approx), ACC_KIND=acc_kind,
                    ACC_READ=bool(accum_read), ACC_GROUP=acc_group, FAST=fast_bits() if on_gpu else 0,
                    **dict(zip(FLAG_NAMES, e.flags, strict=True)))
        plan = _PLANS[pkey] = _plan(mode, N, K, T, max(e.kind1, e.kind2) >= STATE_KIND["int8"], tune, on_gpu, meta)
    if part is None or part.numel() != plan.nparts or part.device != dev:
        part = torch.empty(plan.nparts, dtype=torch.float32, device=dev)
    sx, sdy = x.stride(0), dy.stride(0)
    args = (x, dy, dummy if w is None else w, dummy if b is None else b,
            *state_args(dummy, states, bias_states, qtables, e.kind1, e.kind2),
            dummy if g is None else g, dummy if gb is None else gb, part, part if scale is None else scale,
            part if dyn is None else dyn[0], part if sq is None else sq, part if ticket is None else ticket,
            *acc_ptrs, T, N, K, sx, sdy, *e.scal, 0 if dyn is not None else int(key),
            0 if dyn is None else dyn[1] * DYN_COLS)
    if on_gpu:
        _DIRECT(plan, pkey, args, (N, K, sx, sdy), (T, *args[-2:]))
    else:
        plan.kernel[plan.grid](*args, **plan.meta)
    if fold_gb is not None:
        accum.fold_tail_(fold_gb, N * K, first=not accum_read)
    return part


__all__ = ["launch_forge", "heuristic_config", "MODE_FUSED", "MODE_WRITE_DW", "MODE_UPDATE", "MODE_ACCUM", "LARGE_T",
           "update_many", "bucket_ok", "Buckets", "device_keys", "rule_scalars", "dyn_row", "scalars", "DYN_COLS",
           "RULE_IDS", "STATE_KIND"]

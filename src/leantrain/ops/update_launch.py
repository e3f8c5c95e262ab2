"""Launching the update kernel of :mod:`leantrain.ops.update`: the rule's scalars, launch plans
(tiles, grid, constexprs) cached per signature, direct launches of the compiled kernel, one
parameter (:func:`launch_update`) or several small ones in one launch (:func:`update_many`).
Used by the reference optimizer (:mod:`leantrain.optim.optimizer`) and by FORGE."""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch

from leantrain.ops._backend import HAS_TRITON, direct_launch_supported, interpreting
from leantrain.ops.update import DYN_COLS, FLAG_NAMES, RULE_IDS, SCALAR_NAMES, STATE_KIND, DynCol

if HAS_TRITON:
    from leantrain.ops.update import _update_kernel


def native_cvt(device) -> int:
    """The kernels' ``NATIVE_CVT`` for tensors on ``device``: 0 under the interpreter or off CUDA (every
    conversion in integer ops), 1 compiled for CUDA (bf16 by the hardware's ``cvt``), 2 also e4m3
    (``cvt.rn.satfinite.e4m3x2.f32``: sm_89 and newer)."""
    device = torch.device(device)
    if device.type != "cuda" or interpreting():
        return 0
    return 2 if _capability(device.index) >= (8, 9) else 1


@functools.cache
def _capability(index) -> tuple:
    return torch.cuda.get_device_capability(index)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)  # plain Python: triton.cdiv is a ConstexprFunction (slow to call from the host)


# ------------------------------------------------------------------ the rule's scalars

_RULE_CACHE: dict = {}


def _rule_consts(rule_name: str, lr: float, wd: float, b1: float, b2: float, eps: float, mom: float,
                 nesterov: bool):
    key = (rule_name, lr, wd, b1, b2, eps, mom, nesterov)
    c = _RULE_CACHE.get(key)
    if c is None:
        lerp_small, lerp_c = True, 0.0
        if rule_name == "adamw":
            w32 = np.float32(1.0 - b1)
            lerp_small = bool(abs(w32) < 0.5)
            lerp_c = float(np.float32(1.0) - w32)
        scal = (lr, 1.0 - lr * wd, lr, 1.0, b1, b2, 1.0 - b1, 1.0 - b2, lerp_c, eps, mom)
        c = (scal, (wd != 0.0, mom > 0.0, bool(nesterov), lerp_small))
        if len(_RULE_CACHE) > 4096:  # a schedule changing lr every step: do not grow without bound
            _RULE_CACHE.clear()
        _RULE_CACHE[key] = c
    return c


def scalars(rule_name: str, hp: dict, step: int):
    """``(the rule's scalars in kernel order (SCALAR_NAMES), its flags (FLAG_NAMES))`` for a param
    group ``hp`` at ``step``; computed as torch would (doubles, cast to fp32 in-kernel)."""
    get = hp.get
    b1, b2 = get("betas", (0.0, 0.0))
    b1, b2 = float(b1), float(b2)
    lr = float(hp["lr"])
    scal, flags = _rule_consts(rule_name, lr, float(get("weight_decay", 0.0)), b1, b2, float(get("eps", 0.0)),
                               float(get("momentum", 0.0)), bool(get("nesterov", False)))
    if rule_name == "adamw":  # bias corrections: the only per-step scalars
        scal = scal[:2] + (lr / (1.0 - b1**step), (1.0 - b2**step) ** 0.5) + scal[4:]
    return scal, flags


def rule_scalars(rule_name: str, hp: dict, step: int) -> dict:
    """:func:`scalars` by name."""
    scal, flags = scalars(rule_name, hp, step)
    return dict(zip(SCALAR_NAMES, scal, strict=True)) | dict(zip(FLAG_NAMES, flags, strict=True))


def dyn_row(rule_name: str, hp: dict, step: int, gate: float = 1.0) -> np.ndarray:
    """One row of the device scalar table (``dyn=``): the rule's scalars as fp32 (the values the
    kernel would get as arguments) and the gate. The key column differs per layer: the caller
    writes it (0 here)."""
    row = np.zeros(DYN_COLS, dtype=np.float32)
    row[:DynCol.GATE] = scalars(rule_name, hp, step)[0]
    row[DynCol.GATE] = gate
    return row


def map_sign(qmap) -> int:
    """1 / 0: ``qmap`` is a :class:`~leantrain.ops.state8.StateCodec8` device table of the signed /
    unsigned dynamic map (the codec marks the tables it makes), whose closed-form encoder is then
    compiled for that sign, or an fp8 state's :class:`~leantrain.ops.update.Fp8Table`; -1: another
    table (the generic encoder, which reads the sign from it)."""
    signed = getattr(qmap, "_lt_signed", None)
    return -1 if signed is None else int(signed)


# ------------------------------------------------------------------ launch plans and direct launches


class Plan(NamedTuple):
    """Everything about one launch that does not change from step to step (cached per signature)."""

    kernel: object  # the @triton.jit function
    meta: dict  # its constexpr and launch options
    consts: tuple | None  # the constexprs in signature order (direct launches)
    grid: tuple
    nparts: int  # programs: the size of the per-tile sum buffer


_I32 = 1 << 31


class DirectLauncher:
    """Launches of one Triton kernel through the CompiledKernel that ``kernel[grid](...)`` returned
    for the same specialization, called directly (Triton >= 3.3): Triton's argument binding and
    cache-key hashing cost more host time than the launch itself. The guard key holds what Triton
    specializes on: each pointer's dtype and 16-byte alignment, each specialized integer's
    (== 1, % 16 == 0, 32-bit range), the 32-bit range of the unspecialized ones, the constexprs
    (in the plan's key) and the device."""

    def __init__(self, kernel, first_int: str, first_const: str):
        names = list(kernel.arg_names)
        self.n_args = len(names)
        self.n_ptrs = names.index(first_int)  # the tensor arguments come first ...
        self.const_names = tuple(names[names.index(first_const):])  # ... the constexprs last
        self.cache: dict = {}
        self.enabled = None  # None: not decided yet; False: off

    def consts(self, meta: dict) -> tuple:
        return tuple(meta[n] for n in self.const_names)

    def __call__(self, plan: Plan, pkey, args: tuple, ints: tuple, wide: tuple) -> None:
        """``ints``: the specialized integer arguments; ``wide``: the unspecialized ones."""
        if self.enabled is None:
            self.enabled = direct_launch_supported()
        if not self.enabled:
            plan.kernel[plan.grid](*args, **plan.meta)
            return
        gkey = (pkey, torch.cuda.current_device(), *[(t.dtype, not t.data_ptr() & 15) for t in args[:self.n_ptrs]],
                *[(v == 1, not v & 15, -_I32 <= v < _I32) for v in ints], *[-_I32 <= v < _I32 for v in wide])
        ck = self.cache.get(gkey)
        if ck is not None:
            try:
                ck[(*plan.grid, 1, 1)[:3]](*args, *plan.consts)  # CompiledKernel wants a 3-D grid
                return
            except (TypeError, IndexError):  # a launcher that does not take this argument list: never again
                self.enabled = False
                self.cache.clear()
        ck = plan.kernel[plan.grid](*args, **plan.meta)
        if (self.enabled and ck is not None and hasattr(ck, "__getitem__")
                and len(getattr(getattr(ck, "src", None), "signature", ())) == self.n_args):
            self.cache[gkey] = ck


# ------------------------------------------------------------------ the update-only launch

INTERP_TILE = {"BLOCK_N": 16, "BLOCK_K": 16, "GROUP_N": 2, "num_warps": 1}  # the CPU interpreter's tiles


def update_tile(w_bf16: bool, states_bf16: bool, int8: bool) -> dict:
    """The update-only kernel's tile on a GPU, by the bytes of W and its states (docs/forge.md):
    8 elements a thread, where the kernel is bound by its instructions (IEEE division and square
    root, the rounding hash, the tile's sum) more than by HBM, and small tiles keep more warps
    resident. 8-bit states: 16 x 64 at two warps (the 8-bit epilogue is bound by its encoder's
    arithmetic); bf16 W: 16 x 128 at 8 warps, with bf16 states also ``EARLY_LOADS`` (W and the
    state read before the tile's sum); fp32 W: 32 x 128 at 16 warps."""
    def tile(bn, bk, warps, early=False):
        return {"BLOCK_N": bn, "BLOCK_K": bk, "BLOCK_T": 16, "GROUP_N": 8, "num_warps": warps, "num_stages": 1,
                "EARLY_LOADS": early}  # (BLOCK_T: no token loop here; kept for tools that print tiles)

    if int8:  # also packed ("int8p") and fp8
        return tile(16, 64, 2)
    if w_bf16:
        return tile(16, 128, 8, early=states_bf16)
    return tile(32, 128, 16)


_PLANS: dict = {}
_DIRECT = DirectLauncher(_update_kernel, "N", "RULE") if HAS_TRITON else None


def update_plan(N: int, K: int, tune: dict | None, on_gpu: bool, meta: dict) -> Plan:
    """Tiles (the interpreter's, ``tune``, or :func:`update_tile`), grid and constexprs."""
    if not on_gpu:
        cfg = dict(INTERP_TILE, EARLY_LOADS=(tune or {}).get("EARLY_LOADS", False))
    elif tune is not None:
        cfg = {"GROUP_N": 8, "num_stages": 1, "EARLY_LOADS": False, **tune}
    else:
        kinds = [meta["KIND1"], meta["KIND2"]][: meta["NSTATE"]]
        cfg = update_tile(meta["W_BF16"], all(k == STATE_KIND["bf16"] for k in kinds),
                          max(meta["KIND1"], meta["KIND2"]) >= STATE_KIND["int8"])
    cfg.pop("BLOCK_T", None)  # (a tile of the fused kernel's given for this one)
    cfg["EARLY_LOADS"] = bool(cfg["EARLY_LOADS"])
    meta = dict(meta, **cfg)
    grid = cdiv(N, cfg["BLOCK_N"]) * cdiv(K, cfg["BLOCK_K"])
    consts = _DIRECT.consts(meta) if on_gpu else None
    meta["enable_fp_fusion"] = False  # see leantrain.ops._backend
    return Plan(_update_kernel, meta, consts, (grid,), grid)


class Launch(NamedTuple):
    """What the rule's epilogue needs besides the tensors (``launch_update``'s and FORGE's)."""

    scal: tuple  # the rule's scalars (SCALAR_NAMES)
    flags: tuple  # its flags (FLAG_NAMES)
    kind1: int
    kind2: int
    signs: tuple  # map_sign of each 8-bit state's table (-1: none)


def epilogue_args(rule_name: str, hp: dict | None, step: int, kinds, qtables, dyn) -> Launch:
    """The scalars, flags and state kinds of one launch (with ``dyn`` the scalars are read from the
    device table: zeros here, the flags still from ``hp``)."""
    scal, flags = scalars(rule_name, hp or {}, step)
    if dyn is not None:
        scal = (0.0,) * len(SCALAR_NAMES)
    nstate = len(kinds)
    kind1 = STATE_KIND[kinds[0]] if nstate > 0 else 0
    kind2 = STATE_KIND[kinds[1]] if nstate > 1 else 0
    int8 = STATE_KIND["int8"]
    signs = (map_sign(qtables[0][0]) if kind1 >= int8 else -1, map_sign(qtables[1][0]) if kind2 >= int8 else -1)
    return Launch(scal, flags, kind1, kind2, signs)


def _codes(t, kind: int):
    """A state tensor as the kernel reads it: fp8 codes (``torch.float8_e4m3fn``) as their uint8 bits."""
    return t.view(torch.uint8) if kind == STATE_KIND["fp8"] else t


def state_args(dummy, states, bias_states, qtables, kind1: int, kind2: int) -> tuple:
    """``S1, S2, A1, A2, BS1, BS2, Q1, Q2`` (``dummy`` for those a launch does not have)."""
    nstate, nb = len(states), len(bias_states)
    int8, fp8 = STATE_KIND["int8"], STATE_KIND["fp8"]
    q1, a1 = qtables[0] if kind1 >= int8 else (dummy, dummy)
    q2, a2 = qtables[1] if kind2 >= int8 else (dummy, dummy)
    q1, q2 = dummy if kind1 == fp8 else q1, dummy if kind2 == fp8 else q2  # (fp8: no map table)
    return (_codes(states[0], kind1) if nstate > 0 else dummy, _codes(states[1], kind2) if nstate > 1 else dummy,
            dummy if a1 is None else a1, dummy if a2 is None else a2,  # (int8p: no absmax tensor)
            bias_states[0] if nb > 0 else dummy, bias_states[1] if nb > 1 else dummy, q1, q2)


def update_meta(e: Launch, *, N: int, K: int, rule_name: str, nstate: int, w_bf16: bool, sr: bool,
                has_bias: bool, has_scale: bool, has_dyn: bool, sum_out: bool, native: int, rows: bool,
                approx: bool) -> dict:
    """The update kernel's constexprs but the tile's (:func:`launch_update`; ``benchmarks/parts/
    update_sass.py`` compiles the kernel from them)."""
    return dict(RULE=RULE_IDS[rule_name], KIND1=e.kind1, KIND2=e.kind2, NSTATE=nstate, W_BF16=w_bf16, SR=bool(sr),
                HAS_BIAS=has_bias, HAS_SCALE=has_scale, HAS_DYN=has_dyn, SUM_OUT=sum_out, IDX32=N * K + N < _I32,
                NATIVE_CVT=native, SIGN1=e.signs[0], SIGN2=e.signs[1], ROWS=rows, APPROX=bool(approx),
                **dict(zip(FLAG_NAMES, e.flags, strict=True)))


def update_args(e: Launch, N: int, K: int, w, g, b, gb, states, bias_states, qtables, scale, part, dyn, sq, ticket,
                rows, key) -> tuple:
    """The update kernel's arguments in signature order (:func:`launch_update`'s, whose names
    these are; the unused pointers are ``w`` or ``part``). Positional: a call a launch."""
    return (w, w if b is None else b, *state_args(w, states, bias_states, qtables, e.kind1, e.kind2),
            g, g if gb is None else gb, part, part if scale is None else scale, part if dyn is None else dyn[0],
            part if sq is None else sq, part if ticket is None else ticket,
            *((part, part, part) if rows is None else rows), N, K, *e.scal,
            0 if dyn is not None else int(key), 0 if dyn is None else dyn[1] * DYN_COLS)


def launch_update(*, w, g, b=None, gb=None, states=(), bias_states=(), kinds=(), qtables=(), scale=None,
                  rule_name="adamw", hp=None, step=1, sr=True, key=0, tune=None, part=None, dyn=None, sq=None,
                  ticket=None, rows=None, approx=False):
    """The rule on one parameter ``w: [N, K]`` (fp32 / bf16) from its gradient ``g`` (fp32 or
    bf16, read in fp32) and ``gb`` (the bias's, with ``b``). Returns the per-tile sums of squares.

    ``states`` the stored state tensors of W (codes ``[RB, CB, 16, 16]`` for int8) and ``kinds``
    their kinds (``"fp32" | "bf16" | "int8" | "int8p" | "fp8"``); ``qtables`` one ``(qmap, absmax)`` per
    int8 state, ``(qmap, None)`` per int8p state, ``(Fp8Table(signed), absmax)`` per fp8 state (None
    otherwise); ``bias_states`` fp32 tensors.
    ``scale``: an optional fp32 scalar tensor multiplied into the gradient (not finite: nothing is
    stored). ``tune``: a tile (``BLOCK_N, BLOCK_K, num_warps[, GROUP_N, num_stages, maxnreg,
    EARLY_LOADS]``) instead of :func:`update_tile`'s (tuning scripts). ``part``: a reused fp32 buffer
    for the per-tile sums, when its size is the launch's tile count. ``dyn``: ``(table, row)``:
    the step's scalars from row ``row`` of the fp32 device table ``[rows, DYN_COLS]`` (:func:`dyn_row`)
    instead of ``hp`` / ``step`` / ``key``. ``sq`` / ``ticket``: a 0-d fp32 and a 0-d int32 tensor
    holding 0: the launch's last program writes the sum of the per-tile sums to ``sq``.
    ``rows``: ``(owner, keys, row0)``, several parameters at once (:func:`update_many`).
    ``approx``: AdamW's / AdamS's square root and divisions approximate (FORGE's ``fast_math``)."""
    N, K = w.shape
    dev = w.device
    native = native_cvt(dev)
    on_gpu = native > 0
    e = epilogue_args(rule_name, hp, step, kinds, qtables, dyn)
    if rows is not None and (scale is None or dyn is not None or b is not None or K != 16):
        raise ValueError("launch_update(rows=...): a [rows, 16] view, with a scale per parameter, no bias, "
                         "no device scalars")
    pkey = (N, K, rows is not None, rule_name, e.kind1, e.kind2, len(states), w.dtype, bool(sr), b is not None,
            e.signs, scale is not None, e.flags, native, dyn is not None, sq is not None,
            None if tune is None else tuple(sorted(tune.items())), bool(approx))
    plan = _PLANS.get(pkey)
    if plan is None:
        plan = _PLANS[pkey] = update_plan(N, K, tune, on_gpu, update_meta(
            e, N=N, K=K, rule_name=rule_name, nstate=len(states), w_bf16=w.dtype == torch.bfloat16, sr=sr,
            has_bias=b is not None, has_scale=scale is not None, has_dyn=dyn is not None, sum_out=sq is not None,
            native=native, rows=rows is not None, approx=approx))
    if part is None or part.numel() != plan.nparts or part.device != dev:
        part = torch.empty(plan.nparts, dtype=torch.float32, device=dev)
    args = update_args(e, N, K, w, g, b, gb, states, bias_states, qtables, scale, part, dyn, sq, ticket, rows, key)
    if on_gpu:
        _DIRECT(plan, pkey, args, (N, K), args[-2:])
    else:
        plan.kernel[plan.grid](*args, **plan.meta)
    return part


# ------------------------------------------------------------------ several small parameters, one launch

BUCKET_MAX = 1 << 20  # update_many: at most this many elements a tensor ...
BUCKET_TOTAL = 1 << 24  # ... and a launch
_ROWS: dict = {}  # (sizes, device) -> the row tables of update_many


def bucket_ok(p: torch.Tensor, kinds) -> bool:
    """Whether the 1-D parameter ``p`` (its states of ``kinds``) can be stepped with others in one
    :func:`update_many` launch: at most ``BUCKET_MAX`` elements, a multiple of 16 (of 256 with
    int8p states: whole blocks; int8 and fp8 states are not taken)."""
    n = p.numel()
    return (p.dim() == 1 and n <= BUCKET_MAX and "int8" not in kinds and "fp8" not in kinds
            and n % (256 if "int8p" in kinds else 16) == 0)


def device_keys(seed: int, indices: list[int], step: int, device) -> torch.Tensor:
    """The rounding keys of parameters ``indices`` at ``step`` (``kernel_key(step_seed(seed, i,
    step))``, what each one's own launch takes) as an int32 tensor on ``device``: the ``keys`` of
    :func:`update_many`."""
    from leantrain.ops.rng import step_kernel_keys

    host = torch.from_numpy(step_kernel_keys(seed, indices, [step] * len(indices)))
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


class Buckets:
    """Items grouped by a key for :func:`update_many`; a key starts another group whenever the
    next item would take its group past ``BUCKET_TOTAL`` elements. Iterating yields the groups."""

    def __init__(self):
        self._groups: dict = {}

    def add(self, key, item, n: int) -> None:
        groups = self._groups.setdefault(key, [])
        if not groups or groups[-1][0] + n > BUCKET_TOTAL:
            groups.append([0, []])
        groups[-1][0] += n
        groups[-1][1].append(item)

    def __iter__(self):
        return (items for groups in self._groups.values() for _, items in groups)


def update_many(ws: list, gs: list, states: list, kinds, qtables, *, rule_name: str, hp: dict, step: int,
                sr: bool, keys: torch.Tensor | None, scale: torch.Tensor, approx: bool = False) -> None:
    """The update on several 1-D tensors in one launch (:func:`bucket_ok` each).

    ``ws`` the parameters' data, ``gs`` their gradients (fp32 or bf16), ``states[j]`` the ``j``-th
    state of each; ``kinds`` / ``qtables`` as :func:`launch_update`'s (one per state, shared);
    ``keys`` int32 (one a tensor: its rounding key; None without stochastic rounding), ``scale``
    fp32 (one a tensor: its gradient's scale, NaN to store nothing of it). W, the gradients and the
    states are concatenated, viewed as ``[rows, 16]``, updated (``launch_update(rows=...)``: each
    row reads its tensor's scale, key and first row, so each tensor gets the bits of its own
    launch) and copied back, one multi-tensor copy a dtype."""
    sizes = [w.numel() for w in ws]
    dev = ws[0].device
    rows = _ROWS.get((tuple(sizes), dev))
    if rows is None:
        nrows = torch.tensor(sizes) // 16
        owner = torch.repeat_interleave(torch.arange(len(sizes), dtype=torch.int32), nrows)
        row0 = (torch.cumsum(nrows, 0) - nrows).to(torch.int32)
        rows = _ROWS[(tuple(sizes), dev)] = (owner.to(dev), row0.to(dev))
    owner, row0 = rows
    w = torch.cat([t.view(-1) for t in ws])
    g = torch.cat([t.reshape(-1) for t in gs])
    flats = [torch.cat([t.view(-1) for t in ts]) for ts in states]
    views = [f.view(-1, 1, 16, 16) if kind == "int8p" else f.view(-1, 16) for f, kind in zip(flats, kinds, strict=True)]
    launch_update(w=w.view(-1, 16), states=views, kinds=kinds, qtables=qtables, rule_name=rule_name, hp=hp,
                  step=step, sr=sr, g=g.view(-1, 16), scale=scale,
                  rows=(owner, row0 if keys is None else keys, row0), approx=approx)
    by_dtype: dict = {}
    for dst, flat in [(ws, w)] + list(zip(states, flats, strict=True)):
        d, src = by_dtype.setdefault(flat.dtype, ([], []))
        d.extend(dst)
        src.extend(t.view_as(x) for t, x in zip(flat.split(sizes), dst, strict=True))
    for d, src in by_dtype.values():
        torch._foreach_copy_(d, src)


__all__ = ["scalars", "rule_scalars", "dyn_row", "launch_update",
           "update_many", "bucket_ok", "Buckets", "device_keys", "update_tile", "update_plan", "update_meta",
           "update_args", "native_cvt"]

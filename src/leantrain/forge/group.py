"""One update launch for several FORGE layers (``attach(..., group_updates=True)``).

A graphed step runs one update kernel per fused layer; each launch costs GPU time beyond its
bytes while a small layer's update ramps up and drains: on the H200 the 1b preset's 155 updates
took 5.141 ms in one graph at one launch a layer and 4.545 ms at one launch a block, for the same
bytes (``benchmarks/results/2026-12-02_H200_s18/seventh/``). This kernel runs the update-only
epilogue of :mod:`leantrain.forge.kernel` over up to :data:`GROUP_MAX` layers at once: a table (one
int64 row per layer: the addresses of W, its states, the 8-bit absmax tables, dW, the layer's sum
of squares and ticket; N, K; the rounding key or the device-scalar row; its first program and
program count) tells each program its layer and tile. Every layer is tiled exactly as its own launch
would tile it, its rounding draws use its own key and element offsets, and its tiles' sums of
squares are summed in the same order, so the result is bit-identical to one launch a layer.

The layers of a launch share W's dtype, the state kinds, dW's dtype, the step, the param group (the
rule's scalars) and the clip scale; none has a bias.
"""

from __future__ import annotations

import os

import torch

from leantrain.ops._backend import HAS_TRITON, interpreting, next_pow2

from . import kernel as K

GROUP_MAX = 8  # layers a launch
GROUP_LAUNCH = dict(tiles=4, grid2d=True, maxnreg=0)  # the kernel's launch shape (see group_launch)
GROUP_LAUNCH_ENV = "LEANTRAIN_FORGE_GROUP_LAUNCH"
_COLS = 13  # table row: W, S1, S2, A1, A2, G, key | dyn offset, first program, N, K, SQ, TICKET, programs

if HAS_TRITON:
    import triton
    import triton.language as tl

    from leantrain.ops.sr import sr_bf16

    from .kernel import _draw, _dyn_scalars, _load_w_state, _rtn_bf16, _rule, _store_state

    @triton.jit
    def _state_ptr(addr, KIND: tl.constexpr):
        if KIND >= 2:
            p = addr.to(tl.pointer_type(tl.uint8))
        elif KIND == 1:
            p = addr.to(tl.pointer_type(tl.bfloat16))
        else:
            p = addr.to(tl.pointer_type(tl.float32))
        return p

    @triton.jit
    def _float_ptr(addr, BF16: tl.constexpr):
        if BF16:
            p = addr.to(tl.pointer_type(tl.bfloat16))
        else:
            p = addr.to(tl.pointer_type(tl.float32))
        return p

    @triton.jit(do_not_specialize=["lr", "decay", "step_size", "bc2_sqrt", "b1", "b2", "omb1", "omb2", "lerp_c",
                                   "eps", "mom"])
    def _forge_group_kernel(
        TAB, n_layers, PART, SCALE, DYN, Q1, Q2,
        lr, decay, step_size, bc2_sqrt, b1, b2, omb1, omb2, lerp_c, eps, mom,
        TP: tl.constexpr, RULE: tl.constexpr, KIND1: tl.constexpr, KIND2: tl.constexpr, NSTATE: tl.constexpr,
        W_BF16: tl.constexpr, G_BF16: tl.constexpr, SR: tl.constexpr, HAS_DECAY: tl.constexpr,
        HAS_MOM: tl.constexpr, NESTEROV: tl.constexpr, LERP_SMALL: tl.constexpr, HAS_SCALE: tl.constexpr,
        HAS_DYN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
        IDX32: tl.constexpr, NATIVE_CVT: tl.constexpr, SIGN1: tl.constexpr, SIGN2: tl.constexpr,
        EARLY_LOADS: tl.constexpr, COLS: tl.constexpr, ALIGNED: tl.constexpr, TILES: tl.constexpr,
        GRID2D: tl.constexpr,
    ):
        # this program's layer (its row of the table) and its program index inside that layer, read
        # once for its TILES tiles. GRID2D: the grid's second axis is the layer (no search of the
        # starts; programs past a layer's count do nothing), else a search of the layers' starts.
        if GRID2D:
            j = tl.program_id(1)
            pid0 = tl.program_id(0)
            row = TAB + j * COLS
            first = tl.load(row + 7).to(tl.int32)
        else:
            gpid = tl.program_id(0)
            starts = tl.load(TAB + n_layers * COLS + tl.arange(0, TP))
            j = tl.sum((starts <= gpid).to(tl.int32), axis=0) - 1
            row = TAB + j * COLS
            first = tl.load(row + 7).to(tl.int32)
            pid0 = gpid - first
        nprog = tl.load(row + 12).to(tl.int32)
        N = tl.load(row + 8).to(tl.int32)
        K_ = tl.load(row + 9).to(tl.int32)
        if ALIGNED:  # what a layer's own launch knows from Triton's specialization: K % 16 == 0 and
            # 16-byte aligned tensors (vector loads and stores)
            K_ = tl.multiple_of(K_, 16)
        W = _float_ptr(tl.load(row + 0), W_BF16)
        S1 = _state_ptr(tl.load(row + 1), KIND1)
        S2 = _state_ptr(tl.load(row + 2), KIND2)
        A1 = tl.load(row + 3).to(tl.pointer_type(tl.float32))
        A2 = tl.load(row + 4).to(tl.pointer_type(tl.float32))
        G = _float_ptr(tl.load(row + 5), G_BF16)
        SQ = tl.load(row + 10).to(tl.pointer_type(tl.float32))
        TICKET = tl.load(row + 11).to(tl.pointer_type(tl.int32))
        if ALIGNED:
            W = tl.multiple_of(W, 16)
            S1 = tl.multiple_of(S1, 16)
            S2 = tl.multiple_of(S2, 16)
            G = tl.multiple_of(G, 16)
        key0 = tl.load(row + 6).to(tl.int32)  # (HAS_DYN: the layer's row offset in DYN)
        num_n = tl.cdiv(N, BLOCK_N)
        num_k = tl.cdiv(K_, BLOCK_K)
        ntiles = num_n * num_k
        kb = tl.cdiv(K_, 16)
        nb = tl.cdiv(N, 16)
        part0 = PART + first * TILES  # the layer's tile sums (TILES slots a program)

        for t in range(pid0 * TILES, tl.minimum(pid0 * TILES + TILES, ntiles)):
            # the tile: as the layer's own launch orders it (kernel._forge_kernel, MODE 2)
            pid = t
            per_group = GROUP_N * num_k
            first_n = (pid // per_group) * GROUP_N
            gsize = tl.minimum(num_n - first_n, GROUP_N)
            pid_n = first_n + ((pid % per_group) % gsize)
            pid_k = (pid % per_group) // gsize
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
            mn = offs_n < N
            mk = offs_k < K_
            mask = mn[:, None] & mk[None, :]
            if IDX32:
                offs = offs_n[:, None] * K_ + offs_k[None, :]
            else:
                offs = offs_n[:, None].to(tl.int64) * K_ + offs_k[None, :]
            blk_n = pid_n * (BLOCK_N // 16) + tl.arange(0, BLOCK_N // 16)
            blk_k = pid_k * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
            am_offs = (offs_n[:, None] // 16) * kb + offs_k[None, :] // 16
            jpos = (offs_n[:, None] % 16) * 16 + offs_k[None, :] % 16
            code_offs = am_offs.to(tl.int64) * 256 + jpos

            key = key0
            acc = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
            if EARLY_LOADS:
                w, s1, s2 = _load_w_state(W, S1, S2, A1, A2, Q1, Q2, offs, code_offs, jpos, mask, blk_n, blk_k, kb,
                                            nb, NSTATE, KIND1, KIND2, BLOCK_N, BLOCK_K)
                if HAS_DYN:
                    lr, decay, step_size, bc2_sqrt, b1, b2, omb1, omb2, lerp_c, eps, mom, gate, key = \
                        _dyn_scalars(DYN, key0)
            ss = tl.sum(tl.sum(acc * acc, axis=1), axis=0)
            tl.store(part0 + t, ss)
            gok = tl.abs(tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32) + ss) < float("inf")
            g = acc
            if HAS_DYN:
                if not EARLY_LOADS:
                    lr, decay, step_size, bc2_sqrt, b1, b2, omb1, omb2, lerp_c, eps, mom, gate, key = \
                        _dyn_scalars(DYN, key0)
                g = g * gate
                gok = gok & (tl.abs(tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32) + gate) < float("inf"))
            if HAS_SCALE:
                sc = tl.load(SCALE)
                g = g * sc
                gok = gok & (tl.abs(tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32) + sc) < float("inf"))
            smask = mask & gok
            pmask = smask
            if KIND1 == 3 or KIND2 == 3:
                pmask = (offs_n < nb * 16)[:, None] & (offs_k < kb * 16)[None, :] & gok
            if not EARLY_LOADS:
                w, s1, s2 = _load_w_state(W, S1, S2, A1, A2, Q1, Q2, offs, code_offs, jpos, mask, blk_n, blk_k, kb,
                                            nb, NSTATE, KIND1, KIND2, BLOCK_N, BLOCK_K)
            p, s1, s2 = _rule(w, g, s1, s2, lr, decay, step_size, bc2_sqrt, b1, b2, omb1, omb2, lerp_c, eps, mom,
                                RULE, HAS_DECAY, HAS_MOM, NESTEROV, LERP_SMALL)
            if W_BF16:
                if SR:
                    tl.store(W + offs, sr_bf16(p, _draw(key, offs, IDX32)), mask=smask)
                else:
                    tl.store(W + offs, _rtn_bf16(p, NATIVE_CVT), mask=smask)
            else:
                tl.store(W + offs, p, mask=smask)
            if NSTATE >= 1:
                _store_state(s1, S1, A1, Q1, offs, code_offs, jpos, smask, pmask, blk_n, blk_k, kb, nb, KIND1,
                               BLOCK_N, BLOCK_K, NATIVE_CVT, SIGN1)
            if NSTATE >= 2:
                _store_state(s2, S2, A2, Q2, offs, code_offs, jpos, smask, pmask, blk_n, blk_k, kb, nb, KIND2,
                               BLOCK_N, BLOCK_K, NATIVE_CVT, SIGN2)

        # the layer's last program sums its tiles' partials into its SQ, in the order its own launch would
        if pid0 < nprog:
            tl.debug_barrier()
            ticket = tl.atomic_add(TICKET, 1, sem="acq_rel")
            if ticket == nprog - 1:
                tot = tl.zeros([1024], dtype=tl.float32)
                for i in range(0, ntiles, 1024):
                    offs_p = i + tl.arange(0, 1024)
                    tot += tl.load(part0 + offs_p, mask=offs_p < ntiles, other=0.0)
                tl.store(SQ, tl.sum(tot, axis=0))
                tl.store(TICKET, 0)


def _addr(t: torch.Tensor | None, dummy: torch.Tensor) -> int:
    return (dummy if t is None else t).data_ptr()


def launch_group(layers: list[dict], *, kinds, qmaps=(None, None), rule_name="adamw", hp=None, step=1, sr=True,
                 scale=None, dyn=None, part=None, tiles=None, grid2d=None, maxnreg=None):
    """The update-only epilogue over ``layers`` in one launch (bit-identical to one
    :func:`kernel.launch_forge` ``MODE_UPDATE`` launch each, ``sq`` / ``ticket`` given).

    Each entry: ``w`` [N, K], ``states`` (their stored tensors), ``absmax`` (one per state: the
    int8 absmax table, else None), ``g`` (dW, [N, K], fp32 or bf16: the same for every layer),
    ``key`` (int: the layer's rounding key; unused with ``dyn``), ``dyn_row`` (its row of the
    device-scalar table, with ``dyn``), ``sq`` / ``ticket`` (its sum of squares and ticket). ``kinds``,
    ``qmaps`` (the 8-bit maps, shared), the rule, ``hp``, ``step``, ``sr``, ``scale`` and ``dyn``
    (the table) are the launch's. ``part``: a reused fp32 buffer of the launch's tile sums (when of
    the right size). ``tiles`` (tiles a program), ``grid2d`` (a grid axis for the layer) and
    ``maxnreg`` (a register cap): the launch's shape, defaults :func:`group_launch`. Returns the
    tile sums' buffer."""
    from leantrain.ops.multi import _table

    if not 0 < len(layers) <= GROUP_MAX:
        raise ValueError(f"launch_group: 1 to {GROUP_MAX} layers, got {len(layers)}")
    w0 = layers[0]["w"]
    dev = w0.device
    on_gpu = dev.type == "cuda" and not interpreting()
    nstate = len(kinds)
    k1 = kinds[0] if nstate > 0 else "fp32"
    k2 = kinds[1] if nstate > 1 else "fp32"
    kind1, kind2 = K.STATE_KIND[k1], K.STATE_KIND[k2]
    w_bf16 = w0.dtype == torch.bfloat16
    g_bf16 = layers[0]["g"].dtype == torch.bfloat16
    # the tile each layer's own launch would get (kernel._plan; never autotuned: see group_ok)
    if not on_gpu:
        cfg = K._interp_config(K.MODE_UPDATE)
    else:
        cfg = K._fixed_config() or K.heuristic_config(K.MODE_UPDATE, 0, max(kind1, kind2) >= 2, w_bf16,
                                                      all(kd == K.STATE_KIND["bf16"] for kd in (kind1, kind2)[:nstate]))
    cfg = dict(cfg)
    forced = os.environ.get(K.EARLY_LOADS_ENV, "")
    if forced:
        cfg["EARLY_LOADS"] = forced != "0"
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    dflt = group_launch()
    tiles = dflt["tiles"] if tiles is None else int(tiles)
    grid2d = dflt["grid2d"] if grid2d is None else bool(grid2d)
    maxnreg = dflt["maxnreg"] if maxnreg is None else int(maxnreg)
    if tiles < 1:
        raise ValueError(f"launch_group: tiles must be >= 1, got {tiles}")
    rows, progs = [], []
    idx32 = aligned = True
    for e in layers:
        w, g = e["w"], e["g"]
        n, k = w.shape
        if w.dtype != w0.dtype or g.dtype != layers[0]["g"].dtype or g.shape != w.shape:
            raise ValueError("launch_group: the layers' W and dW dtypes must match (and dW W's shape)")
        idx32 = idx32 and n * k + n < (1 << 31)
        aligned = aligned and k % 16 == 0 and all(t is None or not t.data_ptr() & 15 for t in (w, g, *e["states"]))
        progs.append(-(-(-(-n // bn) * -(-k // bk)) // tiles))
        st = list(e["states"]) + [None] * (2 - nstate)
        am = list(e.get("absmax") or (None, None)) + [None, None]
        key = K.DYN_COLS * e["dyn_row"] if dyn is not None else int(e["key"])
        rows.append([_addr(w, w), _addr(st[0], w), _addr(st[1], w), _addr(am[0], w), _addr(am[1], w), g.data_ptr(),
                     key, 0, n, k, e["sq"].data_ptr(), e["ticket"].data_ptr(), progs[-1]])
    # one int64 device table, column 7 each layer's first program, the padded starts after the rows
    # (AGoQ's multi-tensor table; captured into a CUDA graph, page-locked and kept for its copy)
    tab, total = _table(rows, progs, dev)
    tp = next_pow2(len(rows))
    if part is None or part.numel() != total * tiles or part.device != dev:
        part = torch.empty(total * tiles, dtype=torch.float32, device=dev)
    scal, flags = K._scalars(rule_name, hp or {}, step) if dyn is None else (K._WRITE_DW_SCALARS[0],
                                                                          K._scalars(rule_name, hp or {}, step)[1])
    signs = tuple(K._map_sign(q) if kd >= 2 else -1 for q, kd in zip(qmaps, (kind1, kind2)))
    q1 = qmaps[0] if kind1 >= 2 else w0
    q2 = qmaps[1] if kind2 >= 2 else w0
    meta = dict(TP=tp, RULE=K.RULE_IDS[rule_name], KIND1=kind1, KIND2=kind2, NSTATE=nstate, W_BF16=w_bf16,
                G_BF16=g_bf16, SR=bool(sr), HAS_DECAY=flags[0], HAS_MOM=flags[1], NESTEROV=flags[2],
                LERP_SMALL=flags[3], HAS_SCALE=scale is not None, HAS_DYN=dyn is not None,
                BLOCK_N=bn, BLOCK_K=bk, GROUP_N=cfg["GROUP_N"], IDX32=idx32, NATIVE_CVT=on_gpu,
                SIGN1=signs[0], SIGN2=signs[1], EARLY_LOADS=bool(cfg.get("EARLY_LOADS", False)), COLS=_COLS,
                ALIGNED=aligned and on_gpu, TILES=tiles, GRID2D=grid2d,
                num_warps=cfg["num_warps"], num_stages=1)
    if on_gpu:
        meta["enable_fp_fusion"] = False
        if maxnreg:
            meta["maxnreg"] = maxnreg
    grid = (max(progs), len(rows)) if grid2d else (total,)
    _forge_group_kernel[grid](tab, len(rows), part, part if scale is None else scale,
                                  part if dyn is None else dyn, q1, q2, *scal, **meta)
    return part


def group_launch() -> dict:
    """The grouped kernel's launch shape: ``tiles`` a program (the table reads that find a
    program's layer are paid once for them), ``grid2d`` (the layer as the grid's second axis,
    instead of a search of the layers' starts) and ``maxnreg`` (0: no register cap); defaults
    :data:`GROUP_LAUNCH`, overridden by ``LEANTRAIN_FORGE_GROUP_LAUNCH`` = "tiles,grid2d,maxnreg"."""
    env = os.environ.get(GROUP_LAUNCH_ENV, "")
    if not env:
        return dict(GROUP_LAUNCH)
    try:
        t, g, m = (int(v) for v in env.split(","))
    except ValueError:
        raise ValueError(f"{GROUP_LAUNCH_ENV}={env!r}: expected 'tiles,grid2d,maxnreg', e.g. '4,1,0'") from None
    if t < 1 or m < 0:
        raise ValueError(f"{GROUP_LAUNCH_ENV}={env!r}: tiles >= 1, maxnreg >= 0")
    return dict(tiles=t, grid2d=bool(g), maxnreg=m)


def group_ok() -> bool:
    """Grouped launches give one launch a layer's bits only at the tiles those launches use: not
    when they are autotuned (``LEANTRAIN_FORGE_AUTOTUNE``)."""
    return HAS_TRITON and os.environ.get(K.AUTOTUNE_ENV, "0") in ("", "0")


__all__ = ["GROUP_MAX", "GROUP_LAUNCH", "launch_group", "group_ok", "group_launch"]

"""FORGE's persistent fused kernel: dW's GEMM on large tiles, the update from an L2 scratch.

Why. The split path (cuBLAS dW, then the update kernel) runs its two halves one after the other,
so on the 1b preset's MLP shapes it cannot pass ~1.4x torch (research/forge.md §8, MEASURED.md).
The plain fused kernel (``kernel._forge_kernel``) would hide the GEMM under the update, but its
epilogue holds the whole tile's W, state and temporaries in registers: only 64 x 64 tiles fit,
and their GEMM is far slower than cuBLAS's.

How. ``NPROG`` programs (a few per SM) each loop over output tiles of ``W``:

1. the tile's ``dW = dYᵀ X`` over **all** T tokens, ``[BLOCK_N, BLOCK_K]`` fp32 (large tiles:
   the GEMM of a good matmul kernel; X / dY read through TMA descriptors or masked pointers);
2. the tile's sum of squares (the layer norm, the tile's finiteness gate), then the accumulator
   is stored to the program's own slot of a scratch buffer (``NPROG`` tiles: it stays in L2);
3. the update in row slices of ``SUB`` rows: each slice reads its gradient back from the
   scratch, W and the state from HBM, applies the rule and stores W and the state, exactly
   as the update-only mode of ``kernel._forge_kernel`` does (the same helpers, the same bits).

Several programs share an SM, so one program's update (bound by HBM) runs beside another's GEMM
(bound by the tensor cores): the overlap a warp-specialized ping-pong kernel schedules by hand,
left here to the SM's warp scheduler.

Bytes per tile: ``T·(BLOCK_N + BLOCK_K)·sizeof(x)`` of dY and X (L2 absorbs the re-reads), W and
its state read and written once (fp32 AdamW: 12 B + 12 B an element), and 4 B an element
written to and read back from the scratch (L2). No dW in HBM.

``WRITE_DW``: store the gradient slices to ``G`` instead of updating (tests: the update equals
the update-only kernel applied to this gradient, bit for bit).
"""

from __future__ import annotations

import torch

from leantrain.forge.kernel import (
    _I32,
    _WRITE_DW_SCALARS,
    RULE_IDS,
    STATE_KIND,
    _map_sign,
    _scalars,
)
from leantrain.ops._backend import HAS_TRITON, interpreting

if HAS_TRITON:
    import triton
    import triton.language as tl

    from leantrain.forge.kernel import _draw, _load_w_state, _rtn_bf16, _rule, _store_state
    from leantrain.ops.sr import sr_bf16

    @triton.jit
    def _tile_coords(tile, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr):
        """Tile ``tile``'s first row and column (grouped order: GROUP_N row blocks share X's columns in L2)."""
        num_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_N * tl.cdiv(K, BLOCK_K)
        first_n = (tile // per_group) * GROUP_N
        gsize = tl.minimum(num_n - first_n, GROUP_N)
        return (first_n + ((tile % per_group) % gsize)) * BLOCK_N, ((tile % per_group) // gsize) * BLOCK_K

    @triton.jit
    def _tile_gemm(X, DY, T, N, K, stride_x, stride_dy, n0, k0, PREC: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, TMA: tl.constexpr):
        """``dYᵀ X`` of one tile over all T tokens, fp32."""
        rn = tl.arange(0, BLOCK_N)
        ck = tl.arange(0, BLOCK_K)
        offs_t = tl.arange(0, BLOCK_T)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for t0 in range(0, T, BLOCK_T):
            if TMA:  # out-of-bounds rows / columns read as zeros
                dy = DY.load([t0, n0])
                x = X.load([t0, k0])
            else:
                t = t0 + offs_t
                mt = t < T
                dy = tl.load(DY + t[:, None].to(tl.int64) * stride_dy + (n0 + rn)[None, :],
                             mask=mt[:, None] & (n0 + rn < N)[None, :], other=0.0)
                x = tl.load(X + t[:, None].to(tl.int64) * stride_x + (k0 + ck)[None, :],
                            mask=mt[:, None] & (k0 + ck < K)[None, :], other=0.0)
            acc = tl.dot(tl.trans(dy), x, acc, input_precision=PREC)
        return acc

    @triton.jit
    def _tile_update(scr, ss, W, S1, S2, A1, A2, Q1, Q2, G, N, K, n0, k0,
                     lr, decay, step_size, bc2_sqrt, b1, b2, omb1, omb2, lerp_c, eps, mom, key,
                     RULE: tl.constexpr, KIND1: tl.constexpr, KIND2: tl.constexpr, NSTATE: tl.constexpr,
                     W_BF16: tl.constexpr, SR: tl.constexpr, HAS_DECAY: tl.constexpr, HAS_MOM: tl.constexpr,
                     NESTEROV: tl.constexpr, LERP_SMALL: tl.constexpr, WRITE_DW: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr, IDX32: tl.constexpr,
                     NATIVE_CVT: tl.constexpr, SIGN1: tl.constexpr, SIGN2: tl.constexpr):
        """The update of one tile whose gradient is in ``scr`` (``[BLOCK_N, BLOCK_K]`` fp32), in
        slices of SUB rows: the update-only mode's epilogue (the same helpers, the same bits).
        ``ss``: the tile's sum of squares (not finite: nothing is stored)."""
        kb = tl.cdiv(K, 16)
        nb = tl.cdiv(N, 16)
        ck = tl.arange(0, BLOCK_K)
        rs = tl.arange(0, SUB)
        for r0 in tl.range(0, BLOCK_N, SUB, num_stages=1):
            offs_n = n0 + r0 + rs
            offs_k = k0 + ck
            mn = offs_n < N
            mk = offs_k < K
            mask = mn[:, None] & mk[None, :]
            if IDX32:
                offs = offs_n[:, None] * K + offs_k[None, :]
            else:
                offs = offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
            g = tl.load(scr + (r0 + rs)[:, None] * BLOCK_K + ck[None, :])
            if WRITE_DW:
                tl.store(G + offs, g, mask=mask)
            else:
                blk_n = (n0 + r0) // 16 + tl.arange(0, SUB // 16)
                blk_k = k0 // 16 + tl.arange(0, BLOCK_K // 16)
                am_offs = (offs_n[:, None] // 16) * kb + offs_k[None, :] // 16
                jpos = (offs_n[:, None] % 16) * 16 + offs_k[None, :] % 16
                code_offs = am_offs.to(tl.int64) * 256 + jpos
                smask = mask & (tl.abs(tl.zeros([SUB, BLOCK_K], dtype=tl.float32) + ss) < float("inf"))
                pmask = smask
                if KIND1 == 3 or KIND2 == 3:
                    pmask = (offs_n < nb * 16)[:, None] & (offs_k < kb * 16)[None, :] & smask
                w, s1, s2 = _load_w_state(W, S1, S2, A1, A2, Q1, Q2, offs, code_offs, jpos, mask, blk_n, blk_k,
                                          kb, nb, NSTATE, KIND1, KIND2, SUB, BLOCK_K)
                p, s1, s2 = _rule(w, g, s1, s2, lr, decay, step_size, bc2_sqrt, b1, b2, omb1, omb2, lerp_c, eps,
                                  mom, RULE, HAS_DECAY, HAS_MOM, NESTEROV, LERP_SMALL)
                if W_BF16:
                    if SR:
                        tl.store(W + offs, sr_bf16(p, _draw(key, offs, IDX32)), mask=smask)
                    else:
                        tl.store(W + offs, _rtn_bf16(p, NATIVE_CVT), mask=smask)
                else:
                    tl.store(W + offs, p, mask=smask)
                if NSTATE >= 1:
                    _store_state(s1, S1, A1, Q1, offs, code_offs, jpos, smask, pmask, blk_n, blk_k, kb, nb, KIND1,
                                 SUB, BLOCK_K, NATIVE_CVT, SIGN1)
                if NSTATE >= 2:
                    _store_state(s2, S2, A2, Q2, offs, code_offs, jpos, smask, pmask, blk_n, blk_k, kb, nb, KIND2,
                                 SUB, BLOCK_K, NATIVE_CVT, SIGN2)

    @triton.jit(do_not_specialize=["T", "key", "lr", "decay", "step_size", "bc2_sqrt", "b1", "b2", "omb1",
                                   "omb2", "lerp_c", "eps", "mom"])
    def _forge_persist_kernel(
        X, DY, W, S1, S2, A1, A2, Q1, Q2, SCR, G, PART, FLAGS,
        T, N, K, stride_x, stride_dy,
        lr, decay, step_size, bc2_sqrt, b1, b2, omb1, omb2, lerp_c, eps, mom, key,
        RULE: tl.constexpr, KIND1: tl.constexpr, KIND2: tl.constexpr, NSTATE: tl.constexpr,
        W_BF16: tl.constexpr, SR: tl.constexpr, HAS_DECAY: tl.constexpr, HAS_MOM: tl.constexpr,
        NESTEROV: tl.constexpr, LERP_SMALL: tl.constexpr, PREC: tl.constexpr, WRITE_DW: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, SUB: tl.constexpr,
        GROUP_N: tl.constexpr, TMA: tl.constexpr, IDX32: tl.constexpr, NATIVE_CVT: tl.constexpr,
        SIGN1: tl.constexpr, SIGN2: tl.constexpr, ROLES: tl.constexpr = 0, RING: tl.constexpr = 2,
    ):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        n_tiles = tl.cdiv(N, BLOCK_N) * tl.cdiv(K, BLOCK_K)
        TILE: tl.constexpr = BLOCK_N * BLOCK_K
        rn = tl.arange(0, BLOCK_N)
        ck = tl.arange(0, BLOCK_K)
        if ROLES == 0:  # every program computes a tile's gradient, then updates it, then the next tile
            scr = SCR + pid.to(tl.int64) * TILE
            for tile in range(pid, n_tiles, nprog):
                n0, k0 = _tile_coords(tile, N, K, BLOCK_N, BLOCK_K, GROUP_N)
                acc = _tile_gemm(X, DY, T, N, K, stride_x, stride_dy, n0, k0, PREC, BLOCK_N, BLOCK_K, BLOCK_T, TMA)
                ss = tl.sum(tl.sum(acc * acc, axis=1), axis=0)
                tl.store(PART + tile, ss)
                tl.store(scr + rn[:, None] * BLOCK_K + ck[None, :], acc)
                tl.debug_barrier()  # the slot's stores visible to every thread of the program
                _tile_update(scr, ss, W, S1, S2, A1, A2, Q1, Q2, G, N, K, n0, k0, lr, decay, step_size, bc2_sqrt,
                             b1, b2, omb1, omb2, lerp_c, eps, mom, key, RULE, KIND1, KIND2, NSTATE, W_BF16, SR,
                             HAS_DECAY, HAS_MOM, NESTEROV, LERP_SMALL, WRITE_DW, BLOCK_N, BLOCK_K, SUB, IDX32,
                             NATIVE_CVT, SIGN1, SIGN2)
                tl.debug_barrier()  # every thread done with the slot before the next tile overwrites it
        else:  # producers (the first nprog / (1 + ROLES) programs) compute gradients into a ring of RING
            # slots each; each producer's ROLES consumers update them (consumer q: its producer's tiles
            # j = q mod ROLES). FLAGS[producer, slot]: 0 free, tile + 1 filled.
            nprod = nprog // (1 + ROLES)
            if pid < nprod:
                j = 0
                for tile in range(pid, n_tiles, nprod):
                    slot = j % RING
                    flag = FLAGS + pid * RING + slot
                    scr = SCR + (pid * RING + slot).to(tl.int64) * TILE
                    n0, k0 = _tile_coords(tile, N, K, BLOCK_N, BLOCK_K, GROUP_N)
                    acc = _tile_gemm(X, DY, T, N, K, stride_x, stride_dy, n0, k0, PREC, BLOCK_N, BLOCK_K, BLOCK_T,
                                     TMA)
                    ss = tl.sum(tl.sum(acc * acc, axis=1), axis=0)
                    while tl.atomic_add(flag, 0, sem="acquire") != 0:  # the slot's last tile updated
                        pass
                    tl.store(PART + tile, ss)
                    tl.store(scr + rn[:, None] * BLOCK_K + ck[None, :], acc)
                    tl.debug_barrier()  # every thread's stores before the flag (released by the atomic)
                    tl.atomic_xchg(flag, tile + 1, sem="release")
                    j += 1
            else:
                c = pid - nprod
                prod = c % nprod
                j = c // nprod
                for tile in range(prod + j * nprod, n_tiles, ROLES * nprod):
                    slot = j % RING
                    flag = FLAGS + prod * RING + slot
                    scr = SCR + (prod * RING + slot).to(tl.int64) * TILE
                    while tl.atomic_add(flag, 0, sem="acquire") != tile + 1:
                        pass
                    n0, k0 = _tile_coords(tile, N, K, BLOCK_N, BLOCK_K, GROUP_N)
                    ss = tl.load(PART + tile)
                    _tile_update(scr, ss, W, S1, S2, A1, A2, Q1, Q2, G, N, K, n0, k0, lr, decay, step_size,
                                 bc2_sqrt, b1, b2, omb1, omb2, lerp_c, eps, mom, key, RULE, KIND1, KIND2, NSTATE,
                                 W_BF16, SR, HAS_DECAY, HAS_MOM, NESTEROV, LERP_SMALL, WRITE_DW, BLOCK_N, BLOCK_K,
                                 SUB, IDX32, NATIVE_CVT, SIGN1, SIGN2)
                    tl.debug_barrier()  # every thread done reading the slot
                    tl.atomic_xchg(flag, 0, sem="release")
                    j += ROLES


DEFAULT_CONFIG = {"BLOCK_N": 128, "BLOCK_K": 128, "BLOCK_T": 64, "SUB": 16, "GROUP_N": 8, "num_warps": 4,
                  "num_stages": 3, "per_sm": 2, "TMA": True}
_INTERP = {"BLOCK_N": 32, "BLOCK_K": 16, "BLOCK_T": 16, "SUB": 16, "GROUP_N": 2, "num_warps": 1, "num_stages": 1,
           "per_sm": 1, "TMA": False}
_SCRATCH: dict = {}


def _buffer(name: str, n: int, device, dtype) -> torch.Tensor:
    """A cached buffer of at least ``n`` elements (the scratch slots; the ring flags, zeros: every
    launch leaves them at zero)."""
    buf = _SCRATCH.get((name, device))
    if buf is None or buf.numel() < n:
        buf = _SCRATCH[(name, device)] = torch.zeros(n, dtype=dtype, device=device)
    return buf


def _sms(device) -> int:
    if device.type != "cuda" or interpreting():
        return 3  # the interpreter: a few programs, each looping over several tiles
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch_persist(*, x, dy, w, states=(), kinds=(), qtables=(), rule_name="adamw", hp=None, step=1, sr=True,
                   key=0, g=None, cfg=None) -> torch.Tensor:
    """Fused dW + update of one layer (no bias) with the persistent kernel; returns the per-tile
    sums of squares. ``g``: write dW there instead of updating. Arguments as ``launch_forge``'s."""
    N, K = w.shape
    T = x.shape[0]
    dev = w.device
    on_gpu = dev.type == "cuda" and not interpreting()
    cfg = dict(cfg or (DEFAULT_CONFIG if on_gpu else _INTERP))
    per_sm = cfg.pop("per_sm", 1)
    roles = cfg.get("ROLES", 0)
    tma = bool(cfg.pop("TMA", False)) and on_gpu
    if not on_gpu and x.dtype != torch.float32:  # the interpreter's tl.dot: wrong on bf16 (exact in fp32)
        x, dy = x.float(), dy.float()
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    bn, bk, bt = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["BLOCK_T"]
    if bn % cfg["SUB"] or cfg["SUB"] % 16:
        raise ValueError("persistent FORGE kernel: SUB must be a multiple of 16 that divides BLOCK_N")
    n_tiles = -(-N // bn) * -(-K // bk)
    if roles:  # producers: one an SM; each with `roles` consumers; RING slots a producer
        nprod = min(n_tiles, _sms(dev))
        if not on_gpu:  # the interpreter runs one program after another: a producer must never wait
            cfg["RING"] = -(-n_tiles // nprod)
        nprog = nprod * (1 + roles)
        slots = nprod * cfg.setdefault("RING", 2)
    else:
        nprog = slots = min(n_tiles, per_sm * _sms(dev))
    scr = _buffer("scratch", slots * bn * bk, dev, torch.float32)
    flags_buf = _buffer("flags", slots, dev, torch.int32)
    part = torch.empty(n_tiles, dtype=torch.float32, device=dev)
    if g is not None:
        scal, flags = _WRITE_DW_SCALARS
    else:
        scal, flags = _scalars(rule_name, hp or {}, step)
    nstate = len(states)
    k1 = kinds[0] if nstate > 0 else "fp32"
    k2 = kinds[1] if nstate > 1 else "fp32"
    kind1, kind2 = STATE_KIND[k1], STATE_KIND[k2]
    s1 = states[0] if nstate > 0 else w
    s2 = states[1] if nstate > 1 else w
    q1, a1 = qtables[0] if kind1 >= 2 else (w, w)
    q2, a2 = qtables[1] if kind2 >= 2 else (w, w)
    a1, a2 = w if a1 is None else a1, w if a2 is None else a2
    xa, dya = x, dy
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        xa = TensorDescriptor.from_tensor(x, [bt, bk])
        dya = TensorDescriptor.from_tensor(dy, [bt, bn])
    signs = (_map_sign(qtables[0][0]) if kind1 >= 2 else -1, _map_sign(qtables[1][0]) if kind2 >= 2 else -1)
    meta = dict(RULE=RULE_IDS[rule_name], KIND1=kind1, KIND2=kind2, NSTATE=nstate, W_BF16=w.dtype == torch.bfloat16,
                SR=bool(sr), HAS_DECAY=flags[0], HAS_MOM=flags[1], NESTEROV=flags[2], LERP_SMALL=flags[3], PREC=prec,
                WRITE_DW=g is not None, TMA=tma, IDX32=N * K + N < _I32, NATIVE_CVT=on_gpu, SIGN1=signs[0],
                SIGN2=signs[1], enable_fp_fusion=False, **cfg)
    _forge_persist_kernel[(nprog,)](xa, dya, w, s1, s2, a1, a2, q1, q2, scr, w if g is None else g, part, flags_buf,
                                    T, N, K, x.stride(0), dy.stride(0), *scal, int(key), **meta)
    return part


__all__ = ["launch_persist", "DEFAULT_CONFIG"]

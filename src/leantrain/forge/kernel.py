"""FORGE's Triton kernel: the weight gradient of a linear layer and the optimizer step, fused.

Math. For ``Y = X Wᵀ (+ b)`` with ``X: [T, K]``, ``dY: [T, N]``, ``W: [N, K]``:
``dW = dYᵀ X`` and ``db = Σ_t dY``. The rule (SGD with momentum / Nesterov, AdamW, Lion,
AdamS; :mod:`leantrain.optim.rules`, transcribed operation by operation: same order, fp32,
no contraction into FMAs except where torch's own ``lerp`` uses one, IEEE ``div_rn`` /
``sqrt_rn``) maps ``(W, dW, state)`` to ``(W', state')``.

Tiling. One program owns one ``[BLOCK_N, BLOCK_K]`` tile of ``W`` and loops over **all** T
tokens in steps of ``BLOCK_T`` (``acc += dY_tᵀ X_t``, fp32 accumulator; no split over tokens:
a dW tile is only a gradient after the whole sum). Programs with ``pid_k == 0`` also sum
``dY`` over tokens for the bias rows of their tile. The epilogue then loads the tile's
``W`` (fp32 or bf16), its state (fp32, bf16, or uint8 codes + one absmax per 16 x 16 block:
tiles are multiples of 16, so they own whole 8-bit blocks and requantize on their own; "int8p"
keeps each block's absmax in the low bits of its first 32 codes, see :mod:`leantrain.optim.state`),
applies the rule in registers and stores ``W`` (fp32; bf16 rounded stochastically with the
counter-based hash of :mod:`leantrain.ops.rng` keyed by (seed, element index), or to
nearest) and the state. The gradient tile is never written to memory.

Modes (``MODE``): 0 fused dW + update; 1 write dW (and db) to ``G`` instead of updating (the
same accumulation, for bit-exact tests and for paths that must reduce dW first); 2 update
from a materialized gradient ``G`` (after a data-parallel all-reduce, a per-layer norm clip,
or a cuBLAS dW for large T): the same epilogue without the token loop.

With ``HAS_DYN`` the per-step scalars (lr, bias corrections, rounding key, ...) are read from a
row of the device array ``DYN`` (``DYN_COLS`` fp32 columns, the key's bits in column 12) instead of
the launch arguments, so a captured launch (CUDA graph) takes each replay's values; column 11 is
a gate multiplied into the gradient (1), or NaN to store nothing (a graph's warm-up run).

Every program also writes the sum of squares of its (unscaled) gradient tile to
``PART[pid]``: the layer's gradient norm (clipping by the previous step's global norm,
metrics) and its non-finite flag. A tile whose sum of squares is not finite (NaN/Inf in
its gradient, or a sum of squares that overflows fp32) stores nothing: its W and state
keep their old bits. Other tiles of the same layer are updated (see forge/README.md).

Bytes per tile (fused mode): reads ``T·(BLOCK_N + BLOCK_K)·sizeof(x)`` of dY and X, then
``BLOCK_N·BLOCK_K·(sizeof(W) + Σ sizeof(state))`` read and written once (fp32 AdamW: 12 B
read + 12 B written per weight element; bf16 W + int8 states: 4 B + 4/256 B each way; int8p:
4 B each way, plus the 32 head codes of each block read a second time, from L1).
Layer total: ``T·(N·⌈K/BK⌉ + K·⌈N/BN⌉)·sizeof(x)`` (X and dY are re-read by every tile row
/ column; L2 absorbs most of it) plus the W/state traffic; no dW write or read.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from leantrain.ops._backend import HAS_TRITON, interpreting

RULE_IDS = {"sgd": 0, "adamw": 1, "lion": 2, "adams": 3}
STATE_KIND = {"none": 0, "fp32": 0, "bf16": 1, "int8": 2, "int8p": 3}
MODE_FUSED, MODE_WRITE_DW, MODE_UPDATE = 0, 1, 2
DYN_COLS = 16  # a row of the device scalars: lr .. mom (11), gate, key bits, padding


if HAS_TRITON:
    import triton
    import triton.language as tl

    from leantrain.ops.rng import hash_u32_tl
    from leantrain.ops.sr import sr_bf16
    from leantrain.ops.state8 import state8_encode, state8_encode_finite

    @triton.jit
    def _draw(key, offs, IDX32: tl.constexpr):
        """The rounding bits of element ``offs``: ``hash_u32_tl(key, offs)``; below 2**32 the
        index's high word is 0 and the uint32 path gives the same bits in one hash round."""
        if IDX32:
            return hash_u32_tl(key, offs.to(tl.uint32))
        return hash_u32_tl(key, offs)

    @triton.jit
    def _rtn_bf16(x, NATIVE: tl.constexpr):
        """fp32 -> bf16, round to nearest even: the hardware conversion (``NATIVE``, compiled), or
        integer ops (the interpreter's cast truncates). The same bits; NaN stays NaN."""
        if NATIVE:
            y = x
        else:
            b = x.to(tl.int32, bitcast=True)
            b = (b + (0x7FFF + ((b >> 16) & 1))) & -65536
            y = tl.where(x != x, x, b.to(tl.float32, bitcast=True))
        return y.to(tl.bfloat16)

    @triton.jit
    def _blocks_to_tile(v, BN: tl.constexpr, BK: tl.constexpr):
        """``[BN/16, BK/16]`` per-block values -> ``[BN, BK]`` (each block's value on its 256 elements)."""
        return tl.reshape(tl.broadcast_to(v[:, None, :, None], [BN // 16, 16, BK // 16, 16]), [BN, BK])

    @triton.jit
    def _packed_absmax(ptr, blk_n, blk_k, kb, nb):
        """``"int8p"``: the absmax of each of the tile's 16 x 16 blocks, ``[BN/16, BK/16]``, from the
        low bits of the block's first 32 codes (read again as a ``[.., 2, 16]`` tensor: a small
        sum per block in two 16-bit halves, which cannot overflow)."""
        r = tl.arange(0, 2)
        c = tl.arange(0, 16)
        base = (blk_n[:, None] * kb + blk_k[None, :]).to(tl.int64) * 256
        valid = (blk_n[:, None] < nb) & (blk_k[None, :] < kb)
        offs = base[:, :, None, None] + (r[:, None] * 16 + c[None, :])[None, None, :, :]
        code = tl.load(ptr + offs, mask=valid[:, :, None, None], other=0).to(tl.int32)
        half = tl.sum((code & 1) << c[None, None, None, :], axis=3)  # [BN/16, BK/16, 2]
        lo = tl.sum(tl.where(r[None, None, :] == 0, half, 0), axis=2)
        hi = tl.sum(tl.where(r[None, None, :] == 1, half, 0), axis=2)
        return (lo | (hi << 16)).to(tl.float32, bitcast=True)

    @triton.jit
    def _load_state(ptr, am_ptr, qmap_ptr, offs, code_offs, jpos, mask, blk_n, blk_k, kb, nb,
                    KIND: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        if KIND == 3:  # int8p: the codes as int8's, the first 32 of a block decoding the odd entry
            code = tl.load(ptr + code_offs, mask=mask, other=0).to(tl.int32)
            am = _packed_absmax(ptr, blk_n, blk_k, kb, nb)
            return tl.load(qmap_ptr + tl.where(jpos < 32, code | 1, code)) * _blocks_to_tile(am, BN, BK)
        elif KIND == 2:  # qmap[code] * absmax, the absmax read once per 16 x 16 block
            code = tl.load(ptr + code_offs, mask=mask, other=0)
            am = tl.load(am_ptr + blk_n[:, None] * kb + blk_k[None, :],
                         mask=(blk_n[:, None] < nb) & (blk_k[None, :] < kb), other=0.0)
            return tl.load(qmap_ptr + code.to(tl.int32)) * _blocks_to_tile(am, BN, BK)
        else:
            return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _load_w_state(W, S1, S2, A1, A2, Q1, Q2, offs, code_offs, jpos, mask, blk_n, blk_k, kb, nb,
                      NSTATE: tl.constexpr, KIND1: tl.constexpr, KIND2: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr):
        """A tile's W and optimizer state, in fp32."""
        w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.zeros([BN, BK], dtype=tl.float32)
        s2 = tl.zeros([BN, BK], dtype=tl.float32)
        if NSTATE >= 1:
            s1 = _load_state(S1, A1, Q1, offs, code_offs, jpos, mask, blk_n, blk_k, kb, nb, KIND1, BN, BK)
        if NSTATE >= 2:
            s2 = _load_state(S2, A2, Q2, offs, code_offs, jpos, mask, blk_n, blk_k, kb, nb, KIND2, BN, BK)
        return w, s1, s2

    @triton.jit
    def _dyn_scalars(DYN, dyn_off):
        """Row ``dyn_off / DYN_COLS`` of the device scalar table: lr .. mom, the gate, the key's bits."""
        row = DYN + dyn_off
        return (tl.load(row + 0), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3), tl.load(row + 4),
                tl.load(row + 5), tl.load(row + 6), tl.load(row + 7), tl.load(row + 8), tl.load(row + 9),
                tl.load(row + 10), tl.load(row + 11), tl.load(row + 12).to(tl.int32, bitcast=True))

    @triton.jit
    def _store_plain(x, ptr, offs, mask, BF16: tl.constexpr, NATIVE_CVT: tl.constexpr, EV: tl.constexpr):
        """Store an fp32 tile as fp32, or as bf16 rounded to nearest (W without stochastic rounding,
        fp32 / bf16 states; also the Gluon kernel's, ``ws.py``); ``EV``: the stores' eviction policy ("": none)."""
        if BF16:
            tl.store(ptr + offs, _rtn_bf16(x, NATIVE_CVT), mask=mask, eviction_policy=EV)
        else:
            tl.store(ptr + offs, x, mask=mask, eviction_policy=EV)

    @triton.jit
    def _store_state(x, ptr, am_ptr, qmap_ptr, offs, code_offs, jpos, mask, pmask, blk_n, blk_k, kb, nb,
                     KIND: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NATIVE_CVT: tl.constexpr,
                     SIGN: tl.constexpr):
        if KIND >= 2:  # 8-bit: absmax of each 16 x 16 block of the tile, then the nearest map entry
            x = tl.where(mask, x, 0.0)
            a4 = tl.reshape(tl.abs(x), [BN // 16, 16, BK // 16, 16])
            am = tl.max(tl.max(a4, axis=3), axis=1)  # [BN/16, BK/16]
            inv = tl.where(am > 0, tl.div_rn(tl.zeros_like(am) + 1.0, tl.where(am > 0, am, 1.0)), 0.0)  # per block
            xn = x * _blocks_to_tile(inv, BN, BK)
            if SIGN >= 0:  # the map's sign known at compile time: the closed form without its selects
                code = state8_encode_finite(xn, tl.abs(xn), qmap_ptr, SIGN == 1)
                code = tl.where(xn == xn, code, 0)  # (NaN -> 0, as state8_encode)
            else:
                code = state8_encode(xn, qmap_ptr)
            if KIND == 3:  # int8p: the first 32 codes of a block move to an odd entry (c even: c + 1 if
                # x >= qmap[c] or c == 0, else c - 1; stored without the low bit) and carry the absmax's
                # bits; every code of the tile's blocks is stored, their zero padding included (pmask)
                head = jpos < 32
                up = (code == 0) | (xn >= tl.load(qmap_ptr + code, mask=head, other=0.0))
                down = ((code & 1) == 0) & ~up  # (an odd c keeps c: c & -2 is c - 1 once the low bit goes)
                base = (code & -2) - (down.to(tl.int32) << 1)
                bits = (_blocks_to_tile(am.to(tl.int32, bitcast=True), BN, BK) >> (jpos & 31)) & 1
                code = tl.where(head, base | bits, code)
                tl.store(ptr + code_offs, code.to(tl.uint8), mask=pmask)
            else:
                any_valid = tl.max(tl.max(tl.reshape(mask.to(tl.int32), [BN // 16, 16, BK // 16, 16]), 3), 1) > 0
                am_mask = (blk_n[:, None] < nb) & (blk_k[None, :] < kb) & any_valid
                tl.store(ptr + code_offs, code.to(tl.uint8), mask=mask)
                tl.store(am_ptr + blk_n[:, None] * kb + blk_k[None, :], am, mask=am_mask)
        else:
            _store_plain(x, ptr, offs, mask, KIND == 1, NATIVE_CVT, "")

    @triton.jit
    def _rule(w, g, s1, s2, lr, decay, step_size, bc2_sqrt, b1, b2, omb1, omb2, lerp_c, eps, mom, z,
              RULE: tl.constexpr, HAS_DECAY: tl.constexpr, HAS_MOM: tl.constexpr, NESTEROV: tl.constexpr,
              LERP_SMALL: tl.constexpr, APPROX: tl.constexpr = False):
        """One element-wise rule in fp32, in the exact operation order of rules.py. ``z``: zeros
        shaped like ``g`` (made by the caller, so that the Gluon kernel of ``ws.py``, whose tensors
        carry layouts, calls this same function). ``APPROX`` (FORGE's ``fast_math``): AdamW's and AdamS's
        square root and divisions by the hardware's approximations (``sqrt.approx``, ``div.full``: a few
        ulps, no branch to a slow path) instead of IEEE's correctly rounded ones."""
        p = w
        if HAS_DECAY:
            p = w * decay
        if RULE == 0:  # SGD
            if HAS_MOM:
                s1 = s1 * mom + g
                if NESTEROV:
                    d = g + mom * s1
                else:
                    d = s1
            else:
                d = g
            p = p - lr * d
        elif RULE == 1:  # AdamW (torch.lerp: fma(w, end - self, self) / fma(-(end - self), 1 - w, end))
            if LERP_SMALL:
                s1 = tl.fma(omb1 + z, g - s1, s1)
            else:
                s1 = tl.fma(-(g - s1), lerp_c + z, g)
            s2 = s2 * b2 + omb2 * g * g
            if APPROX:
                denom = tl.fdiv(tl.sqrt(s2), bc2_sqrt + z) + eps
                p = p - step_size * tl.fdiv(s1, denom)
            else:
                denom = tl.div_rn(tl.sqrt_rn(s2), bc2_sqrt + z) + eps
                p = p - step_size * tl.div_rn(s1, denom)
        elif RULE == 2:  # Lion
            c = b1 * s1 + omb1 * g
            sgn = tl.where(c > 0, 1.0, tl.where(c < 0, -1.0, 0.0))
            p = p - lr * sgn
            s1 = b2 * s1 + omb2 * g
        else:  # AdamS
            m = b1 * s1 + omb1 * g
            v = b2 * s1 * s1 + omb2 * g * g
            if APPROX:
                p = p - lr * tl.fdiv(m, tl.sqrt(v) + eps)
            else:
                p = p - lr * tl.div_rn(m, tl.sqrt_rn(v) + eps)
            s1 = m
        return p, s1, s2

    @triton.jit(do_not_specialize=["T", "key", "lr", "decay", "step_size", "bc2_sqrt", "b1", "b2", "omb1",
                                   "omb2", "lerp_c", "eps", "mom", "dyn_off"])
    def _forge_kernel(
        X, DY, W, B, S1, S2, A1, A2, BS1, BS2, Q1, Q2, G, GB, PART, SCALE, DYN, SQ, TICKET, OWNER, KEYS, ROW0,
        T, N, K, stride_x, stride_dy,
        lr, decay, step_size, bc2_sqrt, b1, b2, omb1, omb2, lerp_c, eps, mom, key, dyn_off,
        MODE: tl.constexpr, RULE: tl.constexpr, KIND1: tl.constexpr, KIND2: tl.constexpr,
        NSTATE: tl.constexpr, W_BF16: tl.constexpr, SR: tl.constexpr, HAS_BIAS: tl.constexpr,
        HAS_DECAY: tl.constexpr, HAS_MOM: tl.constexpr, NESTEROV: tl.constexpr, LERP_SMALL: tl.constexpr,
        HAS_SCALE: tl.constexpr, PREC: tl.constexpr, HAS_DYN: tl.constexpr, SUM_OUT: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, GROUP_N: tl.constexpr,
        IDX32: tl.constexpr, NATIVE_CVT: tl.constexpr, SIGN1: tl.constexpr, SIGN2: tl.constexpr,
        EARLY_LOADS: tl.constexpr, ROWS: tl.constexpr, APPROX: tl.constexpr,
    ):
        pid = tl.program_id(0)
        num_n = tl.cdiv(N, BLOCK_N)
        num_k = tl.cdiv(K, BLOCK_K)
        # grouped ordering: GROUP_N consecutive row blocks share each X column block in L2
        per_group = GROUP_N * num_k
        first_n = (pid // per_group) * GROUP_N
        gsize = tl.minimum(num_n - first_n, GROUP_N)
        pid_n = first_n + ((pid % per_group) % gsize)
        pid_k = (pid % per_group) // gsize

        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        mn = offs_n < N
        mk = offs_k < K
        mask = mn[:, None] & mk[None, :]
        if IDX32:  # N * K + N < 2**31: 32-bit element offsets, one hash round per rounding draw
            offs = offs_n[:, None] * K + offs_k[None, :]
            boffs = offs_n + N * K  # the bias's rounding counters follow W's
        else:
            offs = offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
            boffs = offs_n.to(tl.int64) + N * K
        bias_here = (tl.zeros([BLOCK_N], dtype=tl.int32) + pid_k) == 0  # a tensor: the interpreter
        # cannot combine scalar and tensor booleans
        blk_n = pid_n * (BLOCK_N // 16) + tl.arange(0, BLOCK_N // 16)
        blk_k = pid_k * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
        kb = tl.cdiv(K, 16)
        nb = tl.cdiv(N, 16)
        am_offs = (offs_n[:, None] // 16) * kb + offs_k[None, :] // 16
        jpos = (offs_n[:, None] % 16) * 16 + offs_k[None, :] % 16  # position in its 16 x 16 block's codes
        code_offs = am_offs.to(tl.int64) * 256 + jpos

        if MODE == 2:  # (G: fp32, or bf16 / fp16 read as is: lt.optim.Optimizer's bf16 gradients)
            acc = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:
                accb = tl.load(GB + offs_n, mask=mn & bias_here, other=0.0).to(tl.float32)
            if EARLY_LOADS:  # every read of the tile issued before its sum of squares, whose block-wide
                # reduction (a barrier) the compiler does not move loads across: one memory round
                # trip a tile instead of two (the gradient's, then W's and the state's)
                w, s1, s2 = _load_w_state(W, S1, S2, A1, A2, Q1, Q2, offs, code_offs, jpos, mask, blk_n, blk_k, kb, nb,
                                          NSTATE, KIND1, KIND2, BLOCK_N, BLOCK_K)
                if HAS_DYN:
                    lr, decay, step_size, bc2_sqrt, b1, b2, omb1, omb2, lerp_c, eps, mom, gate, key = \
                        _dyn_scalars(DYN, dyn_off)
        else:
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            accb = tl.zeros([BLOCK_N], dtype=tl.float32)
            offs_t = tl.arange(0, BLOCK_T)
            for t0 in range(0, T, BLOCK_T):
                t = t0 + offs_t
                mt = t < T
                dy = tl.load(DY + t[:, None].to(tl.int64) * stride_dy + offs_n[None, :],
                             mask=mt[:, None] & mn[None, :], other=0.0)
                x = tl.load(X + t[:, None].to(tl.int64) * stride_x + offs_k[None, :],
                            mask=mt[:, None] & mk[None, :], other=0.0)
                acc = tl.dot(tl.trans(dy), x, acc, input_precision=PREC)
                if HAS_BIAS:
                    accb += tl.sum(dy.to(tl.float32), axis=0)

        # per-tile sum of squares: the layer norm and the non-finite flag
        ss = tl.sum(tl.sum(acc * acc, axis=1), axis=0)
        if HAS_BIAS:
            ss += tl.sum(tl.where(mn & bias_here, accb * accb, 0.0), axis=0)
        tl.store(PART + pid, ss)
        ok = tl.abs(tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32) + ss) < float("inf")  # finite tile

        if MODE == 1:
            tl.store(G + offs, acc, mask=mask)
            if HAS_BIAS:
                tl.store(GB + offs_n, accb, mask=mn & bias_here)
        else:
            gok = ok  # the tile-wide conditions to store anything
            g = acc
            if ROWS:  # several parameters, a [rows, 16] view of them: each row's own parameter (OWNER)
                # gives its scale (SCALE: one a parameter, NaN where its gradient is not finite: then
                # none of its rows is stored, and a neighbour sharing the tile still is), and its
                # rounding key (KEYS) and first row (ROW0): a parameter draws the bits its own launch would
                owner = tl.load(OWNER + offs_n, mask=mn, other=0)
                sc_r = tl.load(SCALE + owner, mask=mn, other=0.0)
                g = g * sc_r[:, None]
                gok = (tl.abs(sc_r) < float("inf"))[:, None] & mk[None, :]
            if HAS_DYN:  # the step's scalars from device memory (DYN_COLS): what a CUDA graph replays
                if not EARLY_LOADS:  # (the gate: 1, or NaN to store nothing: a dry run)
                    lr, decay, step_size, bc2_sqrt, b1, b2, omb1, omb2, lerp_c, eps, mom, gate, key = \
                        _dyn_scalars(DYN, dyn_off)
                g = g * gate
                gok = gok & (tl.abs(tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32) + gate) < float("inf"))
            if HAS_SCALE and not ROWS:  # a non-finite scale (set on purpose: the whole parameter is bad) stores nothing
                sc = tl.load(SCALE)
                g = g * sc
                gok = gok & (tl.abs(tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32) + sc) < float("inf"))
            smask = mask & gok
            pmask = smask  # int8p: every code of the tile's 16 x 16 blocks, their zero padding included
            if KIND1 == 3 or KIND2 == 3:
                pmask = (offs_n < nb * 16)[:, None] & (offs_k < kb * 16)[None, :] & gok
            if not EARLY_LOADS:
                w, s1, s2 = _load_w_state(W, S1, S2, A1, A2, Q1, Q2, offs, code_offs, jpos, mask, blk_n, blk_k, kb, nb,
                                          NSTATE, KIND1, KIND2, BLOCK_N, BLOCK_K)
            p, s1, s2 = _rule(w, g, s1, s2, lr, decay, step_size, bc2_sqrt, b1, b2, omb1, omb2, lerp_c, eps, mom,
                              tl.zeros_like(g),
                              RULE, HAS_DECAY, HAS_MOM, NESTEROV, LERP_SMALL, APPROX)
            if W_BF16 and SR:
                if ROWS:  # the element's offset in its own parameter, under its parameter's key
                    key_r = tl.load(KEYS + owner, mask=mn, other=0)
                    row0 = tl.load(ROW0 + owner, mask=mn, other=0)
                    bits = _draw(key_r[:, None], offs - (row0 * K)[:, None], IDX32)
                else:
                    bits = _draw(key, offs, IDX32)
                tl.store(W + offs, sr_bf16(p, bits), mask=smask)
            else:
                _store_plain(p, W, offs, smask, W_BF16, NATIVE_CVT, "")
            if NSTATE >= 1:
                _store_state(s1, S1, A1, Q1, offs, code_offs, jpos, smask, pmask, blk_n, blk_k, kb, nb, KIND1, BLOCK_N, BLOCK_K,
                             NATIVE_CVT, SIGN1)
            if NSTATE >= 2:
                _store_state(s2, S2, A2, Q2, offs, code_offs, jpos, smask, pmask, blk_n, blk_k, kb, nb, KIND2, BLOCK_N, BLOCK_K,
                             NATIVE_CVT, SIGN2)
            if HAS_BIAS:  # bias rows of this tile (pid_k == 0 only); bias state is always fp32
                bmask = mn & bias_here & (tl.max(smask.to(tl.int32), axis=1) > 0)
                gb = accb
                if HAS_SCALE:
                    gb = gb * tl.load(SCALE)
                if HAS_DYN:
                    gb = gb * gate
                wb = tl.load(B + offs_n, mask=bmask, other=0.0).to(tl.float32)
                t1 = tl.zeros_like(gb)
                t2 = tl.zeros_like(gb)
                if NSTATE >= 1:
                    t1 = tl.load(BS1 + offs_n, mask=bmask, other=0.0)
                if NSTATE >= 2:
                    t2 = tl.load(BS2 + offs_n, mask=bmask, other=0.0)
                pb, t1, t2 = _rule(wb, gb, t1, t2, lr, decay, step_size, bc2_sqrt, b1, b2, omb1, omb2, lerp_c,
                                   eps, mom, tl.zeros_like(gb), RULE, HAS_DECAY, HAS_MOM, NESTEROV, LERP_SMALL, APPROX)
                if W_BF16:
                    if SR:
                        tl.store(B + offs_n, sr_bf16(pb, _draw(key, boffs, IDX32)), mask=bmask)
                    else:
                        tl.store(B + offs_n, _rtn_bf16(pb, NATIVE_CVT), mask=bmask)
                else:
                    tl.store(B + offs_n, pb, mask=bmask)
                if NSTATE >= 1:
                    tl.store(BS1 + offs_n, t1, mask=bmask)
                if NSTATE >= 2:
                    tl.store(BS2 + offs_n, t2, mask=bmask)

        if SUM_OUT:  # the last program to finish sums every tile's partial into SQ (no launch of its own)
            tl.debug_barrier()  # every thread's PART store before the ticket (released by the atomic)
            ticket = tl.atomic_add(TICKET, 1, sem="acq_rel")
            nprog = tl.num_programs(0)
            if ticket == nprog - 1:  # every partial is visible (acquired); summed in a fixed order
                tot = tl.zeros([1024], dtype=tl.float32)
                for i in range(0, nprog, 1024):
                    offs_p = i + tl.arange(0, 1024)
                    tot += tl.load(PART + offs_p, mask=offs_p < nprog, other=0.0)
                tl.store(SQ, tl.sum(tot, axis=0))
                tl.store(TICKET, 0)  # ready for the next launch (stream-ordered after this one)

    # -------------------------------------------------------------- tile configurations (H200)
    # research/forge.md §8: 64x64 tiles at 4 warps win at T <= 1024; 128x128x32 at 8 warps at
    # T = 16384; 128x128 at 4 warps spills. Default: the fixed heuristic of `heuristic_config`
    # (no autotuning, nothing to benchmark at warm-up); LEANTRAIN_FORGE_AUTOTUNE=1 autotunes
    # over these configurations per (N, K, T, mode, dtypes) instead.
    def _cfg(bn, bk, bt, w, s):
        return triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "BLOCK_T": bt, "GROUP_N": 8, "EARLY_LOADS": False},
                             num_warps=w, num_stages=s)

    TUNE_CONFIGS = [
        _cfg(64, 64, 64, 4, 3), _cfg(64, 64, 32, 4, 4),
        _cfg(64, 128, 32, 8, 3), _cfg(128, 64, 32, 8, 3), _cfg(128, 128, 32, 8, 3),
    ]
    UPDATE_CONFIGS = [_cfg(64, 64, 16, 4, 1), _cfg(64, 128, 16, 8, 1), _cfg(128, 128, 16, 8, 1)]
    _RESTORE = ["W", "B", "S1", "S2", "A1", "A2", "BS1", "BS2"]
    _KEY = ["N", "K", "T", "MODE", "RULE", "KIND1", "KIND2", "NSTATE", "W_BF16", "HAS_BIAS"]

    def _prune(configs, named_args, **kw):
        def arg(name, default=0):
            return named_args.get(name, kw.get(name, default))

        mode = arg("MODE")
        out = [c for c in configs if (c.kwargs["BLOCK_T"] == 16) == (mode == 2)]
        if max(arg("KIND1"), arg("KIND2")) >= 2:  # 8-bit epilogue: 64 x 64 tiles (compile time, registers)
            out = [c for c in out if c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"] <= 64 * 64] or out
        return out

    _forge_kernel_tuned = triton.autotune(
        configs=TUNE_CONFIGS + UPDATE_CONFIGS, key=_KEY, restore_value=_RESTORE,
        prune_configs_by={"early_config_prune": _prune},
    )(_forge_kernel)

    _ARG_NAMES = list(_forge_kernel.arg_names)
    _N_RUNTIME = _ARG_NAMES.index("MODE")  # runtime arguments come first, then the constexprs
    _CONST_NAMES = tuple(_ARG_NAMES[_N_RUNTIME:])
    _N_PTRS = _ARG_NAMES.index("T")  # the tensor arguments come first


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # plain Python: triton.cdiv is a ConstexprFunction (slow to call from the host)


_INTERP_CONFIG = {"BLOCK_N": 16, "BLOCK_K": 16, "BLOCK_T": 16, "GROUP_N": 2, "num_warps": 1}


def _interp_config(mode: int) -> dict:
    return dict(_INTERP_CONFIG)


FIXED_CONFIG_ENV = "LEANTRAIN_FORGE_TILE"  # e.g. "64,64,64,4,3": pin one tile configuration
AUTOTUNE_ENV = "LEANTRAIN_FORGE_AUTOTUNE"  # "1": autotune over TUNE_CONFIGS / UPDATE_CONFIGS
DIRECT_LAUNCH_ENV = "LEANTRAIN_FORGE_DIRECT_LAUNCH"  # "0": always launch through kernel[grid](...)
EARLY_LOADS_ENV = "LEANTRAIN_FORGE_EARLY_LOADS"  # "1" / "0": force the update kernel's early reads on / off
LARGE_T = 2048  # above this many tokens the fused mode uses 128 x 128 x 32 tiles at 8 warps
FUSED_MAXNREG = 168  # the fused 64 x 64 tile's register cap (three programs an SM; heuristic_config)


def _parse_fixed(v: str) -> dict:
    bn, bk, bt, w, s, *reg = (int(x) for x in v.split(","))
    cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "BLOCK_T": bt, "GROUP_N": 8, "num_warps": w, "num_stages": s}
    if reg:  # a sixth number: the register cap per thread (ptxas maxnreg)
        cfg["maxnreg"] = reg[0]
    return cfg


def _fixed_config():
    v = os.environ.get(FIXED_CONFIG_ENV)
    return _parse_fixed(v) if v else None


def _update_cfg(bn: int, bk: int, warps: int) -> dict:
    return {"BLOCK_N": bn, "BLOCK_K": bk, "BLOCK_T": 16, "GROUP_N": 8, "num_warps": warps, "num_stages": 1}


def heuristic_config(mode: int, T: int, int8: bool = False, w_bf16: bool = False, states_bf16: bool = False) -> dict:
    """The fixed tile configuration used without autotuning (research/forge.md §8, H200).

    Fused / write-dW: 64 x 64 tiles, 64-token steps, 4 warps, 3 stages up to ``LARGE_T`` tokens
    (and always with 8-bit states: the 16 x 16 block requantization needs the registers);
    128 x 128 x 32 at 8 warps above. The fused mode's 64 x 64 tile (fp32 / bf16 states) is
    compiled with at most ``FUSED_MAXNREG`` registers a thread: three programs an SM instead of
    two (233 registers uncapped, a 112-byte spill capped). With fp32 W / m / v it was 11-18 %
    faster on 2048 x 5632 at T = 512 / 2048, 5632 x 2048 at T = 1024 and 32000 x 2048 at T = 2048
    (session 18 ``second/``, ``tune_kernels.py --what forge``), and 8-19 % with fp32, 8-22 % with
    bf16 W and states on the three large shapes at T = 512 / 1024 / 2048 (``fourth/``, ``--what
    forge_split``); a cap of 192 (still two programs) gained nothing, and no 64 x 32 or 32 x 32
    tile (four or more programs an SM) beat the capped 64 x 64. The split path stays faster on
    these shapes (2048 x 5632, T = 512: 0.114 ms with fp32 dW against 0.137 fused, ``second/``).

    Update-only (no pipelining), by the bytes of W and its states: 8 elements a thread, where the
    kernel is bound by its instructions (IEEE division and square root, the rounding hash, the
    tile's sum) more than by HBM, and small tiles keep more warps resident (session 15,
    ``tune_kernels.py --what forge_update16`` on the 1b shapes, bf16 gradient, the same bits at
    every tile; ``benchmarks/results/2026-12-01_H200_s15/``, calls ``third/`` and ``fourth/``, and
    ``2026-12-01_H200_s16/first/``): bf16 W 16 x 128 at 8 warps (bf16 states: 2.70 / 3.06 TB/s on
    2048 x 5632 / 32000 x 2048, against 2.18 / 2.51 at session 8's 64 x 64 x 8 in s15 ``third/``;
    fp32 states: the 1b layers in 7.36 ms a step against 7.55 at 32 x 64 x 8 in s16 ``first/``),
    with bf16 states also ``EARLY_LOADS`` (W and state read before the tile's sum: 5.60 ms against
    5.83, s16 ``first/``; with fp32 states or fp32 W it was slower); fp32 W and states 32 x 128 at
    16 warps (3.29 / 3.65 TB/s against 3.12 / 3.48). 8-bit states: 16 x 64 at two warps (``--what forge_int8``, call
    ``sixth/``, fp32 gradient: 2048 x 5632 in 0.114 ms and 32000 x 2048 in 0.590, against 0.136 and
    0.704 at session 8's 16 x 64 x 1 warp; the 8-bit epilogue is bound by its encoder's arithmetic).
    """
    if mode == MODE_UPDATE:
        if int8:  # also packed ("int8p"): 0.134 / 0.720 ms at two warps, 0.174 / 0.940 at four (s18 ``first/``;
            # 0.175 / 0.966 and 0.190 / 1.016 in s16 ``fifth/``, before the cheaper head-code arithmetic)
            return _update_cfg(16, 64, 2)
        if w_bf16:  # bf16 states: W / state reads issued before the tile's sum (EARLY_LOADS)
            return dict(_update_cfg(16, 128, 8), EARLY_LOADS=states_bf16)
        return _update_cfg(32, 128, 16)
    if T <= LARGE_T or int8:
        cfg = {"BLOCK_N": 64, "BLOCK_K": 64, "BLOCK_T": 64, "GROUP_N": 8, "num_warps": 4, "num_stages": 3}
        if mode == MODE_FUSED and not int8:
            cfg["maxnreg"] = FUSED_MAXNREG
        return cfg
    return {"BLOCK_N": 128, "BLOCK_K": 128, "BLOCK_T": 32, "GROUP_N": 8, "num_warps": 8, "num_stages": 3}


def _map_sign(qmap) -> int:
    """1 / 0: ``qmap`` is a :class:`~leantrain.ops.state8.StateCodec8` device table of the signed /
    unsigned dynamic map (the codec marks the tables it makes), whose closed-form encoder is then
    compiled for that sign; -1: another table (the generic encoder, which reads the sign from it)."""
    signed = getattr(qmap, "_lt_signed", None)
    return -1 if signed is None else int(signed)


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


def _scalars(rule_name: str, hp: dict, step: int):
    """``(scalars tuple in kernel order (lr .. mom), flags (HAS_DECAY, HAS_MOM, NESTEROV, LERP_SMALL))``."""
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
    """Host-side scalars of the epilogue (computed as torch would: doubles, cast to fp32 in-kernel)."""
    scal, flags = _scalars(rule_name, hp, step)
    out = dict(zip(("lr", "decay", "step_size", "bc2_sqrt", "b1", "b2", "omb1", "omb2", "lerp_c", "eps", "mom"), scal, strict=True))
    out.update(zip(("HAS_DECAY", "HAS_MOM", "NESTEROV", "LERP_SMALL"), flags, strict=True))
    return out


_WRITE_DW_SCALARS = _scalars("sgd", {"lr": 0.0}, 1)


class _Plan:
    """Everything about one launch that does not change from step to step (cached per signature)."""

    __slots__ = ("kernel", "meta", "consts", "grid", "nparts", "tuned")

    def __init__(self, kernel, meta, consts, grid, nparts, tuned):
        self.kernel, self.meta, self.consts, self.grid, self.nparts, self.tuned = kernel, meta, consts, grid, nparts, tuned


_PLANS: dict = {}
_FAST: dict = {}  # direct-launch cache: guard key -> CompiledKernel
_DIRECT = [None]  # None: not decided yet; False: off


def _plan(mode, N, K, T, int8, tune, on_gpu, flags_meta) -> _Plan:
    """The launch plan: tiles (interpreter, ``tune``, ``LEANTRAIN_FORGE_TILE``, autotuning or
    :func:`heuristic_config`), grid and the constexpr arguments."""
    if not on_gpu:
        cfg = _interp_config(mode)
        if tune is not None and "EARLY_LOADS" in tune:  # (the interpreter keeps its own tiles)
            cfg["EARLY_LOADS"] = tune["EARLY_LOADS"]
    elif tune is not None:
        cfg = dict(tune)
    else:
        fixed = os.environ.get(FIXED_CONFIG_ENV)
        if fixed:
            cfg = _parse_fixed(fixed)
        elif os.environ.get(AUTOTUNE_ENV, "0") not in ("", "0"):
            cfg = None
        else:
            kinds = [flags_meta["KIND1"], flags_meta["KIND2"]][: flags_meta["NSTATE"]]
            cfg = heuristic_config(mode, T, int8, flags_meta["W_BF16"], all(k == STATE_KIND["bf16"] for k in kinds))
    if cfg is None:  # autotuned: PART sized for the smallest tile (64 x 64), the launched tiles report
        return _Plan(_forge_kernel_tuned, dict(flags_meta, enable_fp_fusion=False), None,
                     lambda m: (_cdiv(N, m["BLOCK_N"]) * _cdiv(K, m["BLOCK_K"]),),
                     _cdiv(N, 64) * _cdiv(K, 64), True)
    cfg = dict(cfg)
    forced = os.environ.get(EARLY_LOADS_ENV, "")  # "0" / "1" override the tile's choice, not ``tune``'s
    early = cfg.get("EARLY_LOADS", False)
    if forced and (tune is None or "EARLY_LOADS" not in tune):
        early = forced != "0"
    cfg["EARLY_LOADS"] = bool(early) and mode == MODE_UPDATE  # (an update-only option)
    meta = dict(flags_meta, **cfg)
    consts = tuple(meta[n] for n in _CONST_NAMES) if on_gpu else None
    grid = _cdiv(N, cfg["BLOCK_N"]) * _cdiv(K, cfg["BLOCK_K"])
    meta["enable_fp_fusion"] = False  # see leantrain.ops._backend.launch
    return _Plan(_forge_kernel, meta, consts, (grid,), grid, False)


def _direct_ok() -> bool:
    """Direct launches of the cached CompiledKernel: Triton >= 3.3 (launchers take every argument,
    constexprs included, in signature order), not turned off by LEANTRAIN_FORGE_DIRECT_LAUNCH=0."""
    if _DIRECT[0] is None:
        from leantrain.ops._backend import direct_launch_supported

        _DIRECT[0] = os.environ.get(DIRECT_LAUNCH_ENV, "1") not in ("", "0") and direct_launch_supported()
    return _DIRECT[0]


_I32 = 1 << 31


def _launch_gpu(plan: _Plan, pkey, args: tuple, ints: tuple) -> None:
    """``_forge_kernel[grid](*args, **meta)``, or the CompiledKernel it returned for the same
    specialization (dtypes, 16-byte alignment of every pointer, integer specializations, device),
    called directly: Triton's argument binding and cache-key hashing cost more host time than
    everything else in a FORGE layer update. The guard key holds what Triton specializes on:
    each pointer's dtype and 16-byte alignment, each specialized integer's (== 1, % 16 == 0,
    32-bit range), the 32-bit range of T and key, the constexprs (in ``pkey``) and the device."""
    if _DIRECT[0] or (_DIRECT[0] is None and _direct_ok()):
        gkey = (pkey, torch.cuda.current_device(), *[(t.dtype, not t.data_ptr() & 15) for t in args[:_N_PTRS]],
                *[(v == 1, not v & 15, -_I32 <= v < _I32) for v in ints],
                -_I32 <= args[_N_PTRS] < _I32, -_I32 <= args[-2] < _I32, -_I32 <= args[-1] < _I32)
        ck = _FAST.get(gkey)
        if ck is not None:
            try:
                ck[(*plan.grid, 1, 1)[:3]](*args, *plan.consts)  # CompiledKernel wants a 3-D grid
                return
            except (TypeError, IndexError):  # a launcher that does not take this argument list: never again
                _DIRECT[0] = False
                _FAST.clear()
        else:
            ck = plan.kernel[plan.grid](*args, **plan.meta)
            if (_DIRECT[0] and ck is not None and hasattr(ck, "__getitem__")
                    and len(getattr(getattr(ck, "src", None), "signature", ())) == len(_ARG_NAMES)):
                _FAST[gkey] = ck
            return
    plan.kernel[plan.grid](*args, **plan.meta)


def launch_forge(mode: int, *, x=None, dy=None, w=None, b=None, states=(), bias_states=(), kinds=(),
                 qtables=(), g=None, gb=None, scale=None, rule_name="adamw", hp=None, step=1,
                 sr=True, key=0, tune=None, part=None, dyn=None, sq=None, ticket=None, rows=None, approx=False):
    """Launch the kernel on one layer. Returns the per-tile sum-of-squares tensor.

    ``x: [T, K]``, ``dy: [T, N]`` (same dtype, contiguous rows); ``w: [N, K]`` (fp32/bf16);
    ``states`` the stored state tensors of W (codes ``[RB, CB, 16, 16]`` for int8) and ``kinds``
    their kinds (``"fp32" | "bf16" | "int8" | "int8p"``);
    ``qtables`` one ``(qmap, absmax)`` per int8 state, ``(qmap, None)`` per int8p state (None otherwise); ``bias_states`` fp32 tensors. ``g``/``gb``: dW/db (written in mode 1, read in mode 2).
    ``scale``: optional fp32 scalar tensor multiplied into the gradient before the rule.
    ``tune``: a tile configuration dict (``BLOCK_N, BLOCK_K, BLOCK_T, GROUP_N, num_warps[, num_stages]``).
    ``part``: optional reused fp32 buffer for the per-tile sums; used when its size is exactly
    the launch's tile count (else a new one is allocated). The returned tensor is the one written.
    ``dyn``: ``(table, row)``: read the step's scalars from row ``row`` of the fp32 device array
    ``table [rows, DYN_COLS]`` (:func:`dyn_row`) instead of ``hp`` / ``step`` / ``key`` (a launch
    captured in a CUDA graph then takes each replay's values).
    ``sq`` / ``ticket``: a 0-d fp32 tensor and a 0-d int32 tensor holding 0: the launch's last
    program writes the sum of the per-tile sums of squares to ``sq`` (fixed order) and resets
    ``ticket``, so no reduction launch has to follow.
    ``rows``: ``(owner, keys, row0)``, update-only mode on several parameters at once (``w``, ``g`` and
    the states: their concatenation viewed as ``[rows, 16]``): ``owner`` (int32, one a row) the row's
    parameter, ``keys`` / ``row0`` (int32, one a parameter) its rounding key and first row, ``scale``
    (fp32, one a parameter) its gradient's scale, NaN where nothing of it may be stored. Each
    parameter gets the bits of its own launch with ``scale=scale[i]`` and ``key=keys[i]``.
    ``approx``: AdamW's / AdamS's square root and divisions approximate (``_rule``'s ``APPROX``; FORGE's
    ``fast_math``).
    """
    dummy = w if w is not None else g
    N, K = dummy.shape
    dev = dummy.device
    on_gpu = dev.type == "cuda" and not interpreting()
    if mode != MODE_UPDATE:
        T = x.shape[0]
        assert x.stride(-1) == 1 and dy.stride(-1) == 1 and x.dtype == dy.dtype
        if not on_gpu and x.dtype != torch.float32 and interpreting():  # the interpreter's tl.dot: wrong on bf16
            x, dy = x.float(), dy.float()  # exact: same products, fp32 accumulation
        sx, sdy = x.stride(0), dy.stride(0)
        prec = "ieee" if x.dtype == torch.float32 else "tf32"
    else:
        T, sx, sdy, prec = 0, 0, 0, "ieee"
        x = dy = dummy
    if mode == MODE_WRITE_DW:
        scal, flags = _WRITE_DW_SCALARS
        dyn = None
    elif dyn is not None:  # the values come from the table; the flags (constexprs) from hp
        scal, flags = _WRITE_DW_SCALARS[0], _scalars(rule_name, hp or {}, step)[1]
    else:
        scal, flags = _scalars(rule_name, hp or {}, step)
    nstate = len(states)
    k1 = kinds[0] if nstate > 0 else "fp32"
    k2 = kinds[1] if nstate > 1 else "fp32"
    kind1, kind2 = STATE_KIND[k1], STATE_KIND[k2]
    has_bias = (b is not None) if mode != MODE_WRITE_DW else (gb is not None)
    w_bf16 = w is not None and w.dtype == torch.bfloat16
    signs = (_map_sign(qtables[0][0]) if kind1 >= 2 else -1, _map_sign(qtables[1][0]) if kind2 >= 2 else -1)
    if rows is not None and (mode != MODE_UPDATE or scale is None or dyn is not None or b is not None or K != 16):
        raise ValueError("launch_forge(rows=...): update-only mode on a [rows, 16] view, with a scale per "
                         "parameter, no bias, no device scalars")
    pkey = (mode, N, K, T <= LARGE_T, rows is not None, rule_name, kind1, kind2, nstate, w_bf16, bool(sr), has_bias, signs,
            scale is not None, prec, flags, on_gpu, dyn is not None, sq is not None, None if tune is None else tuple(sorted(tune.items())),
            os.environ.get(FIXED_CONFIG_ENV), os.environ.get(AUTOTUNE_ENV), os.environ.get(EARLY_LOADS_ENV), bool(approx))
    plan = _PLANS.get(pkey)
    if plan is None:
        meta = dict(MODE=mode, RULE=RULE_IDS[rule_name], KIND1=kind1, KIND2=kind2, NSTATE=nstate, W_BF16=w_bf16,
                    SR=bool(sr), HAS_BIAS=has_bias, HAS_SCALE=scale is not None, PREC=prec, HAS_DYN=dyn is not None,
                    SUM_OUT=sq is not None, IDX32=N * K + N < _I32, NATIVE_CVT=on_gpu,
                    SIGN1=signs[0], SIGN2=signs[1], ROWS=rows is not None, APPROX=bool(approx),
                    HAS_DECAY=flags[0], HAS_MOM=flags[1], NESTEROV=flags[2], LERP_SMALL=flags[3])
        plan = _PLANS[pkey] = _plan(mode, N, K, T, max(kind1, kind2) >= 2, tune, on_gpu, meta)
    s1 = states[0] if nstate > 0 else dummy
    s2 = states[1] if nstate > 1 else dummy
    nb = len(bias_states)
    bs1 = bias_states[0] if nb > 0 else dummy
    bs2 = bias_states[1] if nb > 1 else dummy
    q1, a1 = qtables[0] if kind1 >= 2 else (dummy, dummy)
    q2, a2 = qtables[1] if kind2 >= 2 else (dummy, dummy)
    a1, a2 = dummy if a1 is None else a1, dummy if a2 is None else a2  # (int8p: no absmax tensor)
    if plan.tuned:
        part = torch.zeros(plan.nparts, dtype=torch.float32, device=dev)
    elif part is None or part.numel() != plan.nparts or part.device != dev:
        part = torch.empty(plan.nparts, dtype=torch.float32, device=dev)
    args = (x, dy, dummy if w is None else w, dummy if b is None else b, s1, s2, a1, a2, bs1, bs2, q1, q2,
            dummy if g is None else g, dummy if gb is None else gb, part, part if scale is None else scale,
            part if dyn is None else dyn[0], part if sq is None else sq, part if ticket is None else ticket,
            *((part, part, part) if rows is None else rows), T, N, K, sx, sdy, *scal, 0 if dyn is not None else int(key),
            0 if dyn is None else dyn[1] * DYN_COLS)
    if on_gpu and not plan.tuned:
        _launch_gpu(plan, pkey, args, (N, K, sx, sdy))
    else:
        plan.kernel[plan.grid](*args, **plan.meta)
    return part


BUCKET_MAX = 1 << 20  # update_many: at most this many elements a tensor ...
BUCKET_TOTAL = 1 << 24  # ... and a launch
_ROWS: dict = {}  # (sizes, device) -> the row tables of update_many


def bucket_ok(p: torch.Tensor, kinds) -> bool:
    """Whether the 1-D parameter ``p`` (its states of ``kinds``) can be stepped with others in one
    :func:`update_many` launch: at most ``BUCKET_MAX`` elements, a multiple of 16 (of 256 with
    int8p states: whole blocks; int8 states are not taken)."""
    n = p.numel()
    return p.dim() == 1 and n <= BUCKET_MAX and "int8" not in kinds and n % (256 if "int8p" in kinds else 16) == 0


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
    """The update-only mode on several 1-D tensors in one launch (:func:`bucket_ok` each).

    ``ws`` the parameters' data, ``gs`` their gradients (fp32 or bf16), ``states[j]`` the ``j``-th
    state of each; ``kinds`` / ``qtables`` as :func:`launch_forge`'s (one per state, shared);
    ``keys`` int32 (one a tensor: its rounding key; None without stochastic rounding), ``scale``
    fp32 (one a tensor: its gradient's scale, NaN to store nothing of it). W, the gradients and the
    states are concatenated, viewed as ``[rows, 16]``, updated (``launch_forge(rows=...)``: each
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
    launch_forge(MODE_UPDATE, w=w.view(-1, 16), states=views, kinds=kinds, qtables=qtables, rule_name=rule_name,
                 hp=hp, step=step, sr=sr, g=g.view(-1, 16), scale=scale, rows=(owner, row0 if keys is None else keys, row0),
                 approx=approx)
    by_dtype: dict = {}
    for dst, flat in [(ws, w)] + list(zip(states, flats, strict=True)):
        d, src = by_dtype.setdefault(flat.dtype, ([], []))
        d.extend(dst)
        src.extend(t.view_as(x) for t, x in zip(flat.split(sizes), dst, strict=True))
    for d, src in by_dtype.values():
        torch._foreach_copy_(d, src)


def dyn_row(rule_name: str, hp: dict, step: int, gate: float = 1.0) -> np.ndarray:
    """One row of the device scalar table (``launch_forge(dyn=...)``): the launch arguments
    ``lr .. mom`` as fp32 (the values the kernel would get as arguments) and the gate. Column 12,
    the rounding key's int32 bits, differs per layer: the caller writes it (0 here)."""
    scal, _ = _scalars(rule_name, hp, step)
    row = np.zeros(DYN_COLS, dtype=np.float32)
    row[:11] = scal
    row[11] = gate
    return row


__all__ = ["launch_forge", "update_many", "bucket_ok", "Buckets", "device_keys", "rule_scalars", "dyn_row", "DYN_COLS", "heuristic_config", "MODE_FUSED", "MODE_WRITE_DW", "MODE_UPDATE",
           "RULE_IDS"]

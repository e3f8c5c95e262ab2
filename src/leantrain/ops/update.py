"""The optimizer update epilogue shared by the reference optimizer and FORGE: one rule in fp32
registers on a tile of ``W`` and its state, as Triton code.

Math. A rule of :mod:`leantrain.optim.rules` (SGD with momentum / Nesterov, AdamW, Lion, AdamS)
maps ``(W, g, state)`` to ``(W', state')``; :func:`_rule` transcribes it operation by operation
(same order, fp32, no contraction into FMAs except where torch's own ``lerp`` uses one, IEEE
``div_rn`` / ``sqrt_rn``). A tile's W is fp32 or bf16 (stored rounded to nearest, or
stochastically with the counter hash of :mod:`leantrain.ops.rng` keyed by (seed, element
index)); its state fp32, bf16, or uint8 codes with one absmax per 16 x 16 block ("int8"; "int8p"
keeps each block's absmax in the low bits of its first 32 codes; "fp8" holds e4m3 bit patterns,
:mod:`leantrain.optim.state`).

"fp8" (``KIND == 4``). Encode a block: ``absmax = max(max |y|, 2**-100)``, ``code = e4m3_rne(y *
(448 / absmax))`` (the division IEEE, once a block); decode: ``fp32(code) * (absmax * fp32(1 / 448))``
(one multiply a block, one an element), with
``y`` the state for signed states (``SIGN == 1``) and its square root for unsigned ones
(``SIGN == 0``: the decoded value is squared). Compiled (``NATIVE_CVT``), the conversions are the
hardware's (``cvt.rn.satfinite.e4m3x2.f32``: two elements an instruction, and back through f16);
under the interpreter, whose fp32 -> fp8 cast is not round-to-nearest-even at every binade, integer
ops (:func:`leantrain.ops.fp8.fp8_encode_tl` / ``fp8_decode_tl``) give the same bits.

:func:`_update_tile` is the whole epilogue of one tile (gradient scale and gate, loads, rule,
stores, the bias rows); FORGE's fused kernel (:mod:`leantrain.forge.kernel`) calls it after its
token loop, and :func:`_update_kernel` here after loading a materialized gradient ``G``: the
same code, hence the same bits for the same gradient. A tile whose sum of squares is not finite
stores nothing.

With ``HAS_DYN`` the per-step scalars (lr, bias corrections, rounding key, ...) are read from a
row of the device array ``DYN`` (``DYN_COLS`` fp32 columns: ``DynCol``) instead of the launch
arguments, so a launch captured in a CUDA graph takes each replay's values; the gate column is
multiplied into the gradient (1), or NaN to store nothing (a graph's warm-up run).

The launchers (the update-only launch, several small parameters in one launch, the rule's
scalars) are in :mod:`leantrain.ops.update_launch`.

Bytes per tile (update-only): ``BLOCK_N·BLOCK_K·(sizeof(g) + sizeof(W) + Σ sizeof(state))`` read,
``BLOCK_N·BLOCK_K·(sizeof(W) + Σ sizeof(state))`` written (fp32 AdamW from an fp32 gradient:
16 B read, 12 B written per element).
"""

from __future__ import annotations

from typing import NamedTuple

from leantrain.ops._backend import HAS_TRITON

RULE_IDS = {"sgd": 0, "adamw": 1, "lion": 2, "adams": 3}
STATE_KIND = {"none": 0, "fp32": 0, "bf16": 1, "int8": 2, "int8p": 3, "fp8": 4}
FP8_MAX = 448.0  # "fp8": a block's absmax maps onto the largest finite e4m3 value ...
FP8_FLOOR = 2.0**-100  # ... and is at least this (448 / absmax stays finite, the decode scale normal)
FP8_INV_MAX = 0.0022321429569274187  # fp32(1 / 448): a block's decode scale is absmax * FP8_INV_MAX


class Fp8Table(NamedTuple):
    """What an ``"fp8"`` state gives the epilogue in place of a map table (it has none): its sign,
    compiled in (signed: the e4m3 of the value; unsigned: of its square root). ``_lt_signed``
    as :meth:`leantrain.ops.state8.StateCodec8.qmap_on`'s tables, for ``update_launch.map_sign``."""

    signed: bool

    @property
    def _lt_signed(self) -> bool:
        return self.signed
SCALAR_NAMES = ("lr", "decay", "step_size", "bc2_sqrt", "b1", "b2", "omb1", "omb2", "lerp_c", "eps", "mom")
FLAG_NAMES = ("HAS_DECAY", "HAS_MOM", "NESTEROV", "LERP_SMALL")


class DynCol:
    """Columns of a row of the device scalar table: the 11 rule scalars, the gate, the key's bits."""

    GATE = len(SCALAR_NAMES)  # 11
    KEY = GATE + 1  # 12: the rounding key's int32 bits


DYN_COLS = 16  # a row of the device scalars: lr .. mom (11), gate, key bits, padding


if HAS_TRITON:
    import triton
    import triton.language as tl

    from leantrain.ops.fp8 import fp8_decode_tl, fp8_encode_tl
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
    def _fp8_encode(y, NATIVE: tl.constexpr):
        """fp32 ``y`` (``|y| <= 448 (1 + 2**-23)``) -> its e4m3 bit pattern (uint8), round to nearest
        even: the hardware conversion (``NATIVE >= 2``: sm_89 and newer, ``update_launch.native_cvt``),
        or integer ops (the interpreter's cast is not RNE; older GPUs have no e4m3 cvt)."""
        if NATIVE >= 2:
            return y.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
        return fp8_encode_tl(y, 3, 7, -6).to(tl.uint8)

    @triton.jit
    def _fp8_decode(code, NATIVE: tl.constexpr):
        """An e4m3 bit pattern (uint8) -> fp32, exact."""
        if NATIVE >= 2:
            return code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        return fp8_decode_tl(code.to(tl.int32), 3, 7, -6, True)

    @triton.jit
    def _load_state(ptr, am_ptr, qmap_ptr, offs, code_offs, jpos, mask, blk_n, blk_k, kb, nb,
                    KIND: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NATIVE_CVT: tl.constexpr,
                    SIGN: tl.constexpr):
        if KIND == 4:  # fp8: fp32(code) * (absmax / 448), squared for an unsigned state (its root is stored)
            code = tl.load(ptr + code_offs, mask=mask, other=0)
            am = tl.load(am_ptr + blk_n[:, None] * kb + blk_k[None, :],
                         mask=(blk_n[:, None] < nb) & (blk_k[None, :] < kb), other=0.0)
            v = _fp8_decode(code, NATIVE_CVT) * _blocks_to_tile(am * 0.0022321429569274187, BN, BK)  # FP8_INV_MAX
            if SIGN == 0:
                v = v * v
            return v
        elif KIND == 3:  # int8p: the codes as int8's, the first 32 of a block decoding the odd entry
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
                      BK: tl.constexpr, NATIVE_CVT: tl.constexpr, SIGN1: tl.constexpr, SIGN2: tl.constexpr):
        """A tile's W and optimizer state, in fp32."""
        w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.zeros([BN, BK], dtype=tl.float32)
        s2 = tl.zeros([BN, BK], dtype=tl.float32)
        if NSTATE >= 1:
            s1 = _load_state(S1, A1, Q1, offs, code_offs, jpos, mask, blk_n, blk_k, kb, nb, KIND1, BN, BK,
                             NATIVE_CVT, SIGN1)
        if NSTATE >= 2:
            s2 = _load_state(S2, A2, Q2, offs, code_offs, jpos, mask, blk_n, blk_k, kb, nb, KIND2, BN, BK,
                             NATIVE_CVT, SIGN2)
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
    def _store_state(x, ptr, am_ptr, qmap_ptr, offs, code_offs, jpos, mask, pmask, am_mask, blk_n, blk_k, kb,
                     KIND: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NATIVE_CVT: tl.constexpr,
                     SIGN: tl.constexpr):
        if KIND == 4:  # fp8: absmax of each 16 x 16 block (of the root, unsigned), then e4m3 of y * (448 / absmax)
            if SIGN == 0:
                x = tl.sqrt_rn(x)
            # (no select on ``mask``: outside the tensor every input loaded 0 and each rule maps zeros to
            # zero states, so those elements are 0 in every block's max, as the reference's padding)
            a4 = tl.reshape(tl.abs(x), [BN // 16, 16, BK // 16, 16])
            am = tl.maximum(tl.max(tl.max(a4, axis=3), axis=1), 7.888609052210118e-31)  # FP8_FLOOR = 2**-100
            inv = tl.div_rn(tl.zeros_like(am) + 448.0, am)
            code = _fp8_encode(x * _blocks_to_tile(inv, BN, BK), NATIVE_CVT)
            tl.store(ptr + code_offs, code, mask=mask)
            tl.store(am_ptr + blk_n[:, None] * kb + blk_k[None, :], am, mask=am_mask)
        elif KIND >= 2:  # 8-bit: absmax of each 16 x 16 block of the tile, then the nearest map entry
            x = tl.where(mask, x, 0.0)
            a4 = tl.reshape(tl.abs(x), [BN // 16, 16, BK // 16, 16])
            am = tl.max(tl.max(a4, axis=3), axis=1)  # [BN/16, BK/16]
            inv = tl.where(am > 0, tl.div_rn(tl.zeros_like(am) + 1.0, tl.where(am > 0, am, 1.0)), 0.0)  # per block
            xn = x * _blocks_to_tile(inv, BN, BK)
            if SIGN >= 0:  # the map's sign known at compile time: the closed form without its selects
                code = state8_encode_finite(xn, tl.abs(xn), qmap_ptr, SIGN == 1)  # (NaN -> 0 too)
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
            else:  # (am_mask: the blocks with an element stored)
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

    @triton.jit
    def _tile_coords(pid, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
                     IDX32: tl.constexpr):
        """Program ``pid``'s tile in grouped order (``GROUP_N`` consecutive row blocks share each
        column block in L2) and every offset and mask its epilogue needs."""
        num_n = tl.cdiv(N, BLOCK_N)
        num_k = tl.cdiv(K, BLOCK_K)
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
        return offs_n, offs_k, mn, mk, mask, offs, boffs, bias_here, blk_n, blk_k, kb, nb, jpos, code_offs

    @triton.jit
    def _tile_sumsq(acc, accb, mn, bias_here, PART, pid, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    HAS_BIAS: tl.constexpr):
        """The tile's sum of squares into ``PART[pid]`` (the layer norm, the non-finite flag);
        returns it (:func:`_update_tile` stores nothing of a tile whose sum is not finite)."""
        ss = tl.sum(tl.sum(acc * acc, axis=1), axis=0)
        if HAS_BIAS:
            ss += tl.sum(tl.where(mn & bias_here, accb * accb, 0.0), axis=0)
        tl.store(PART + pid, ss)
        return ss

    @triton.jit
    def _finite(v, R: tl.constexpr, C: tl.constexpr):
        """Whether the scalar ``v`` is finite, as an ``[R, C]`` tensor (the interpreter cannot
        combine scalar and tensor booleans)."""
        return tl.abs(tl.zeros([R, C], dtype=tl.float32) + v) < float("inf")

    @triton.jit
    def _update_tile(acc, accb, ss, w, s1, s2, gate, W, B, S1, S2, A1, A2, BS1, BS2, Q1, Q2, SCALE, DYN,
                     OWNER, KEYS, ROW0, offs_n, offs_k, mn, mk, mask, offs, boffs, bias_here, blk_n, blk_k, kb, nb, jpos,
                     code_offs, K, lr, decay, step_size, bc2_sqrt, b1, b2, omb1, omb2, lerp_c, eps, mom, key,
                     dyn_off, RULE: tl.constexpr, KIND1: tl.constexpr, KIND2: tl.constexpr, NSTATE: tl.constexpr,
                     W_BF16: tl.constexpr, SR: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DECAY: tl.constexpr,
                     HAS_MOM: tl.constexpr, NESTEROV: tl.constexpr, LERP_SMALL: tl.constexpr,
                     HAS_SCALE: tl.constexpr, HAS_DYN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     IDX32: tl.constexpr, NATIVE_CVT: tl.constexpr, SIGN1: tl.constexpr, SIGN2: tl.constexpr,
                     LOADED: tl.constexpr, ROWS: tl.constexpr, APPROX: tl.constexpr):
        """(One function of about 85 lines: a Triton device function whose values stay in registers
        across its phases; split, each part would take and return most of its arguments.)
        The epilogue of one tile: ``acc`` (its gradient, fp32) and ``accb`` (the bias rows')
        scaled and gated, W and the state read (unless ``LOADED``: ``w, s1, s2`` and, with
        ``HAS_DYN``, the scalars and ``gate`` were read by the caller), the rule applied, W and
        the state stored where ``ss`` (the tile's sum of squares) is finite and the gates allow."""
        gok = _finite(ss, BLOCK_N, BLOCK_K)  # the tile-wide conditions to store anything, on the
        blk_ok = _finite(ss, BLOCK_N // 16, BLOCK_K // 16)  # tile and on its 16 x 16 blocks (not ROWS)
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
            if not LOADED:  # (the gate: 1, or NaN to store nothing: a dry run)
                lr, decay, step_size, bc2_sqrt, b1, b2, omb1, omb2, lerp_c, eps, mom, gate, key = \
                    _dyn_scalars(DYN, dyn_off)
            g = g * gate
            gok = gok & _finite(gate, BLOCK_N, BLOCK_K)
            blk_ok = blk_ok & _finite(gate, BLOCK_N // 16, BLOCK_K // 16)
        if HAS_SCALE and not ROWS:  # a non-finite scale (set on purpose: the whole parameter is bad) stores nothing
            sc = tl.load(SCALE)
            g = g * sc
            gok = gok & _finite(sc, BLOCK_N, BLOCK_K)
            blk_ok = blk_ok & _finite(sc, BLOCK_N // 16, BLOCK_K // 16)
        smask = mask & gok
        if ROWS and (KIND1 == 2 or KIND2 == 2 or KIND1 == 4 or KIND2 == 4):  # the gates differ by row: whether a block stores an element
            blk_ok = tl.max(tl.max(tl.reshape(smask.to(tl.int32), [BLOCK_N // 16, 16, BLOCK_K // 16, 16]), 3), 1) > 0
        am_mask = (blk_n[:, None] < nb) & (blk_k[None, :] < kb) & blk_ok  # int8, fp8: the blocks whose absmax is stored
        pmask = smask  # int8p: every code of the tile's 16 x 16 blocks, their zero padding included
        if KIND1 == 3 or KIND2 == 3:
            pmask = (offs_n < nb * 16)[:, None] & (offs_k < kb * 16)[None, :] & gok
        if not LOADED:
            w, s1, s2 = _load_w_state(W, S1, S2, A1, A2, Q1, Q2, offs, code_offs, jpos, mask, blk_n, blk_k, kb, nb,
                                      NSTATE, KIND1, KIND2, BLOCK_N, BLOCK_K, NATIVE_CVT, SIGN1, SIGN2)
        p, s1, s2 = _rule(w, g, s1, s2, lr, decay, step_size, bc2_sqrt, b1, b2, omb1, omb2, lerp_c, eps, mom,
                          tl.zeros_like(g), RULE, HAS_DECAY, HAS_MOM, NESTEROV, LERP_SMALL, APPROX)
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
            _store_state(s1, S1, A1, Q1, offs, code_offs, jpos, smask, pmask, am_mask, blk_n, blk_k, kb, KIND1, BLOCK_N,
                         BLOCK_K, NATIVE_CVT, SIGN1)
        if NSTATE >= 2:
            _store_state(s2, S2, A2, Q2, offs, code_offs, jpos, smask, pmask, am_mask, blk_n, blk_k, kb, KIND2, BLOCK_N,
                         BLOCK_K, NATIVE_CVT, SIGN2)
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

    @triton.jit
    def _sum_out(PART, SQ, TICKET):
        """The last program to finish sums every tile's partial into ``SQ`` in a fixed order (no
        launch of its own) and resets ``TICKET`` for the next launch (stream-ordered after this one)."""
        tl.debug_barrier()  # every thread's PART store before the ticket (released by the atomic)
        ticket = tl.atomic_add(TICKET, 1, sem="acq_rel")
        nprog = tl.num_programs(0)
        if ticket == nprog - 1:  # every partial is visible (acquired)
            tot = tl.zeros([1024], dtype=tl.float32)
            for i in range(0, nprog, 1024):
                offs_p = i + tl.arange(0, 1024)
                tot += tl.load(PART + offs_p, mask=offs_p < nprog, other=0.0)
            tl.store(SQ, tl.sum(tot, axis=0))
            tl.store(TICKET, 0)

    @triton.jit(do_not_specialize=["key", "lr", "decay", "step_size", "bc2_sqrt", "b1", "b2", "omb1", "omb2",
                                   "lerp_c", "eps", "mom", "dyn_off"])
    def _update_kernel(
        W, B, S1, S2, A1, A2, BS1, BS2, Q1, Q2, G, GB, PART, SCALE, DYN, SQ, TICKET, OWNER, KEYS, ROW0,
        N, K, lr, decay, step_size, bc2_sqrt, b1, b2, omb1, omb2, lerp_c, eps, mom, key, dyn_off,
        RULE: tl.constexpr, KIND1: tl.constexpr, KIND2: tl.constexpr, NSTATE: tl.constexpr, W_BF16: tl.constexpr,
        SR: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DECAY: tl.constexpr, HAS_MOM: tl.constexpr,
        NESTEROV: tl.constexpr, LERP_SMALL: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_DYN: tl.constexpr,
        SUM_OUT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
        IDX32: tl.constexpr, NATIVE_CVT: tl.constexpr, SIGN1: tl.constexpr, SIGN2: tl.constexpr,
        EARLY_LOADS: tl.constexpr, ROWS: tl.constexpr, APPROX: tl.constexpr,
    ):
        """The rule on ``W`` from a materialized gradient ``G`` (fp32, or bf16 / fp16 read as is)."""
        pid = tl.program_id(0)
        offs_n, offs_k, mn, mk, mask, offs, boffs, bias_here, blk_n, blk_k, kb, nb, jpos, code_offs = \
            _tile_coords(pid, N, K, BLOCK_N, BLOCK_K, GROUP_N, IDX32)
        acc = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
        accb = tl.zeros([BLOCK_N], dtype=tl.float32)
        if HAS_BIAS:
            accb = tl.load(GB + offs_n, mask=mn & bias_here, other=0.0).to(tl.float32)
        gate = 1.0
        if EARLY_LOADS:  # every read of the tile issued before its sum of squares, whose block-wide
            # reduction (a barrier) the compiler does not move loads across: one memory round
            # trip a tile instead of two (the gradient's, then W's and the state's)
            w, s1, s2 = _load_w_state(W, S1, S2, A1, A2, Q1, Q2, offs, code_offs, jpos, mask, blk_n, blk_k, kb, nb,
                                      NSTATE, KIND1, KIND2, BLOCK_N, BLOCK_K, NATIVE_CVT, SIGN1, SIGN2)
            if HAS_DYN:
                lr, decay, step_size, bc2_sqrt, b1, b2, omb1, omb2, lerp_c, eps, mom, gate, key = \
                    _dyn_scalars(DYN, dyn_off)
        else:
            w = acc
            s1 = acc
            s2 = acc
        ss = _tile_sumsq(acc, accb, mn, bias_here, PART, pid, BLOCK_N, BLOCK_K, HAS_BIAS)
        _update_tile(acc, accb, ss, w, s1, s2, gate, W, B, S1, S2, A1, A2, BS1, BS2, Q1, Q2, SCALE, DYN,
                     OWNER, KEYS, ROW0, offs_n, offs_k, mn, mk, mask, offs, boffs, bias_here, blk_n, blk_k, kb, nb, jpos,
                     code_offs, K, lr, decay, step_size, bc2_sqrt, b1, b2, omb1, omb2, lerp_c, eps, mom, key,
                     dyn_off, RULE, KIND1, KIND2, NSTATE, W_BF16, SR, HAS_BIAS, HAS_DECAY, HAS_MOM, NESTEROV,
                     LERP_SMALL, HAS_SCALE, HAS_DYN, BLOCK_N, BLOCK_K, IDX32, NATIVE_CVT, SIGN1, SIGN2,
                     EARLY_LOADS, ROWS, APPROX)
        if SUM_OUT:
            _sum_out(PART, SQ, TICKET)

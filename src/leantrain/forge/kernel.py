"""FORGE's Triton kernel: the weight gradient of a linear layer and the optimizer step, fused.

Math. For ``Y = X Wᵀ (+ b)`` with ``X: [T, K]``, ``dY: [T, N]``, ``W: [N, K]``:
``dW = dYᵀ X`` and ``db = Σ_t dY``. The rule maps ``(W, dW, state)`` to ``(W', state')``: the
shared epilogue of :mod:`leantrain.ops.update` (its ``_rule``, transcribed operation by operation
from :mod:`leantrain.optim.rules`).

Tiling. One program owns one ``[BLOCK_N, BLOCK_K]`` tile of ``W`` and loops over **all** T
tokens in steps of ``BLOCK_T`` (``acc += dY_tᵀ X_t``, fp32 accumulator; no split over tokens:
a dW tile is only a gradient after the whole sum). Programs with ``pid_k == 0`` also sum
``dY`` over tokens for the bias rows of their tile. The epilogue (``_update_tile``) then loads
the tile's ``W`` and state (fp32, bf16, or 8-bit codes in whole 16 x 16 blocks: tiles are
multiples of 16), applies the rule in registers and stores ``W`` and the state. The gradient
tile is never written to memory.

Modes (``MODE``): ``MODE_FUSED`` dW + update; ``MODE_WRITE_DW`` writes dW (and db) to ``G``
instead (the same accumulation, for bit-exact tests and for paths that must reduce dW first);
``MODE_ACCUM`` adds the dW tile (and db) into a gradient-accumulation buffer (below).
The update from a materialized gradient (``MODE_UPDATE`` of :func:`leantrain.forge.launch.launch_forge`)
is the update-only kernel of :mod:`leantrain.ops.update`, on the same epilogue.

Accumulated gradients (``ACC_KIND``, :mod:`leantrain.forge.accumulate`). The buffer is flat,
W's ``N·K`` elements row-major then the bias's ``N``: element ``(n, k)`` at ``n·K + k``, bias row
``n`` at ``N·K + n`` (the tile's ``offs`` / ``boffs``). ``ACC_FP32`` / ``ACC_BF16``: the values;
``ACC_INT8`` / ``ACC_INT8_EF``: the int8 codes and the fp32 scale of each run of ``ACC_GROUP``
consecutive flat elements (:class:`leantrain.optim.grad8.Int8GradBuffer`; element ``i``'s scale at
``i // ACC_GROUP``, so a tile dequantizes any element without owning whole groups), and with
``_EF`` the error-feedback residual's codes and scales. In ``MODE_FUSED`` the tile's gradient
becomes ``dW + sum`` before its sum of squares and the update, in the split path's order
(``(dW + dequant(codes)) + dequant(residual)``, one fp32 add each, or ``dW + float(buffer)``):
the same bits as the materialized ``dW`` plus the buffer fed to the update-only kernel. In
``MODE_ACCUM`` (fp32 / bf16 buffers) the tile stores ``buffer + dW`` (``ACC_READ``) or ``dW`` (the
step's first micro-batch), rounded to nearest even for bf16: torch's ``buf.add_(dW)`` /
``buf.copy_(dW)``. With int8 buffers ``MODE_ACCUM`` folds the tile as
:meth:`Int8GradBuffer.add_ <leantrain.optim.grad8.Int8GradBuffer.add_>` does: ``v = (dW +
dequant(codes)) + dequant(residual)`` (or ``v = dW``), ``codes = quantize(v)``, ``residual =
quantize(v - dequant(codes))``, round to nearest, each group's scale from its absmax
(:func:`leantrain.ops.quant_tl.encode_tile_tl`, bit-identical to the torch reference). That needs
whole groups in a tile: ``K`` a multiple of ``ACC_GROUP`` and ``BLOCK_K = ACC_GROUP``, each tile
row one group; the bias's groups (runs of ``ACC_GROUP`` bias rows) span tiles, so db is written to
``GB`` and folded by the launcher (:meth:`Int8GradBuffer.fold_tail_`).

Every program (but ``MODE_ACCUM``'s) also writes the sum of squares of its (unscaled) gradient tile to
``PART[pid]``: the layer's gradient norm (clipping, metrics) and its non-finite flag. A tile
whose sum of squares is not finite stores nothing: its W and state keep their old bits. Other
tiles of the same layer are updated.

Bytes per tile (fused mode): reads ``T·(BLOCK_N + BLOCK_K)·sizeof(x)`` of dY and X, then
``BLOCK_N·BLOCK_K·(sizeof(W) + Σ sizeof(state))`` read and written once (fp32 AdamW: 12 B
read + 12 B written per weight element; bf16 W + int8 states: 4 B + 4/256 B each way).
Layer total: ``T·(N·⌈K/BK⌉ + K·⌈N/BN⌉)·sizeof(x)`` (X and dY are re-read by every tile row
/ column; L2 absorbs most of it) plus the W/state traffic; no dW write or read. An accumulated
gradient adds its read (4, 2, or 1 + 4/ACC_GROUP bytes an element, twice with the residual);
``MODE_ACCUM`` reads and writes the buffer once (4 or 2 bytes an element each way; int8: the
codes and scales, the residual's too, with the layer's N fp32 db written and folded apart).
"""

from __future__ import annotations

from leantrain.ops._backend import HAS_TRITON

MODE_FUSED, MODE_WRITE_DW, MODE_UPDATE, MODE_ACCUM = 0, 1, 2, 3
ACC_NONE, ACC_FP32, ACC_BF16, ACC_INT8, ACC_INT8_EF = 0, 1, 2, 3, 4  # ACC_KIND: the accumulation buffer's

if HAS_TRITON:
    import triton
    import triton.language as tl

    from leantrain.ops.quant_tl import encode_tile_tl
    from leantrain.ops.update import _store_plain, _sum_out, _tile_coords, _tile_sumsq, _update_tile

    @triton.jit
    def _add_accum(g, ACC, ACS, ACR, ACRS, offs, mask, ACC_KIND: tl.constexpr, ACC_GROUP: tl.constexpr):
        """``g`` plus the accumulated gradient at flat offsets ``offs``, in fp32 (module docstring)."""
        if ACC_KIND >= 3:  # int8 codes times their group's scale, then the residual's
            grp = offs // ACC_GROUP
            g = g + tl.load(ACC + offs, mask=mask, other=0).to(tl.float32) * tl.load(ACS + grp, mask=mask, other=0.0)
            if ACC_KIND == 4:
                g = g + tl.load(ACR + offs, mask=mask, other=0).to(tl.float32) * tl.load(ACRS + grp, mask=mask,
                                                                                         other=0.0)
        else:
            g = g + tl.load(ACC + offs, mask=mask, other=0.0).to(tl.float32)
        return g

    @triton.jit
    def _accumulate_tile(acc, accb, ACC, offs, boffs, mask, bmask, ACC_KIND: tl.constexpr, ACC_READ: tl.constexpr,
                         HAS_BIAS: tl.constexpr, NATIVE_CVT: tl.constexpr):
        """``MODE_ACCUM``: the buffer's tile (and bias rows) become ``buffer + dW`` (``ACC_READ``) or ``dW``."""
        if ACC_READ:
            acc = tl.load(ACC + offs, mask=mask, other=0.0).to(tl.float32) + acc
        _store_plain(acc, ACC, offs, mask, ACC_KIND == 2, NATIVE_CVT, "")
        if HAS_BIAS:
            if ACC_READ:
                accb = tl.load(ACC + boffs, mask=bmask, other=0.0).to(tl.float32) + accb
            _store_plain(accb, ACC, boffs, bmask, ACC_KIND == 2, NATIVE_CVT, "")

    @triton.jit
    def _fold_int8_tile(acc, ACC, ACS, ACR, ACRS, offs, mask, mn, ACC_KIND: tl.constexpr, ACC_READ: tl.constexpr,
                        ACC_GROUP: tl.constexpr, FAST: tl.constexpr):
        """``MODE_ACCUM``, int8: fold the dW tile into the codes (and the residual) of its groups, one
        a row (``BLOCK_K == ACC_GROUP``; module docstring)."""
        row_group = tl.max(offs // ACC_GROUP, axis=1)
        v = acc
        if ACC_READ:
            v = _add_accum(v, ACC, ACS, ACR, ACRS, offs, mask, ACC_KIND, ACC_GROUP)
        code, scale, _ = encode_tile_tl(v, mask, offs, 0, -127, 127, True, False, FAST)
        tl.store(ACC + offs, code.to(tl.int8), mask=mask)
        tl.store(ACS + row_group, scale, mask=mn)
        if ACC_KIND == 4:  # the requantization error, quantized in its turn
            err = v - code.to(tl.float32) * scale[:, None]
            rcode, rscale, _ = encode_tile_tl(err, mask, offs, 0, -127, 127, True, False, FAST)
            tl.store(ACR + offs, rcode.to(tl.int8), mask=mask)
            tl.store(ACRS + row_group, rscale, mask=mn)

    @triton.jit(do_not_specialize=["T", "key", "lr", "decay", "step_size", "bc2_sqrt", "b1", "b2", "omb1",
                                   "omb2", "lerp_c", "eps", "mom", "dyn_off"])
    def _forge_kernel(
        X, DY, W, B, S1, S2, A1, A2, BS1, BS2, Q1, Q2, G, GB, PART, SCALE, DYN, SQ, TICKET, ACC, ACS, ACR, ACRS,
        T, N, K, stride_x, stride_dy,
        lr, decay, step_size, bc2_sqrt, b1, b2, omb1, omb2, lerp_c, eps, mom, key, dyn_off,
        MODE: tl.constexpr, RULE: tl.constexpr, KIND1: tl.constexpr, KIND2: tl.constexpr,
        NSTATE: tl.constexpr, W_BF16: tl.constexpr, SR: tl.constexpr, HAS_BIAS: tl.constexpr,
        HAS_DECAY: tl.constexpr, HAS_MOM: tl.constexpr, NESTEROV: tl.constexpr, LERP_SMALL: tl.constexpr,
        HAS_SCALE: tl.constexpr, PREC: tl.constexpr, HAS_DYN: tl.constexpr, SUM_OUT: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, GROUP_N: tl.constexpr,
        IDX32: tl.constexpr, NATIVE_CVT: tl.constexpr, SIGN1: tl.constexpr, SIGN2: tl.constexpr,
        APPROX: tl.constexpr, ACC_KIND: tl.constexpr, ACC_READ: tl.constexpr, ACC_GROUP: tl.constexpr,
        FAST: tl.constexpr,
    ):
        pid = tl.program_id(0)
        offs_n, offs_k, mn, mk, mask, offs, boffs, bias_here, blk_n, blk_k, kb, nb, jpos, code_offs = \
            _tile_coords(pid, N, K, BLOCK_N, BLOCK_K, GROUP_N, IDX32)
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
        if MODE == 3:
            if ACC_KIND >= 3:
                _fold_int8_tile(acc, ACC, ACS, ACR, ACRS, offs, mask, mn, ACC_KIND, ACC_READ, ACC_GROUP, FAST)
                if HAS_BIAS:  # (folded by the launcher: a bias group spans tiles)
                    tl.store(GB + offs_n, accb, mask=mn & bias_here)
            else:
                _accumulate_tile(acc, accb, ACC, offs, boffs, mask, mn & bias_here, ACC_KIND, ACC_READ, HAS_BIAS,
                                 NATIVE_CVT)
        else:
            if ACC_KIND != 0:  # the step's earlier micro-batches' gradient, before the norm and the update
                acc = _add_accum(acc, ACC, ACS, ACR, ACRS, offs, mask, ACC_KIND, ACC_GROUP)
                if HAS_BIAS:
                    accb = _add_accum(accb, ACC, ACS, ACR, ACRS, boffs, mn & bias_here, ACC_KIND, ACC_GROUP)
            ss = _tile_sumsq(acc, accb, mn, bias_here, PART, pid, BLOCK_N, BLOCK_K, HAS_BIAS)
            if MODE == 1:
                tl.store(G + offs, acc, mask=mask)
                if HAS_BIAS:
                    tl.store(GB + offs_n, accb, mask=mn & bias_here)
            else:
                _update_tile(acc, accb, ss, acc, acc, acc, 1.0, W, B, S1, S2, A1, A2, BS1, BS2, Q1, Q2, SCALE, DYN,
                             PART, PART, PART, offs_n, offs_k, mn, mk, mask, offs, boffs, bias_here, blk_n, blk_k,
                             kb, nb, jpos, code_offs, K, lr, decay, step_size, bc2_sqrt, b1, b2, omb1, omb2, lerp_c,
                             eps, mom, key, dyn_off, RULE, KIND1, KIND2, NSTATE, W_BF16, SR, HAS_BIAS, HAS_DECAY,
                             HAS_MOM, NESTEROV, LERP_SMALL, HAS_SCALE, HAS_DYN, BLOCK_N, BLOCK_K, IDX32, NATIVE_CVT,
                             SIGN1, SIGN2, False, False, APPROX)
            if SUM_OUT:
                _sum_out(PART, SQ, TICKET)

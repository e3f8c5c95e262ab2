"""FORGE's warp-specialized fused kernel for Hopper (sm_90), written in Gluon.

The plain Triton kernel of ``kernel.py`` runs a tile's GEMM and then its update one after the
other, so the tensor cores idle while the update streams W and the states, and HBM idles while
the GEMM runs; neither occupancy nor splitting the SMs makes them overlap. This kernel schedules the overlap itself, inside each SM (one persistent CTA an SM, three
partitions of warps that run side by side and talk through mbarriers):

- the **loader** (1 warp) streams ``dY[t:t+BT, m0:m0+BM]`` and ``X[t:t+BT, n0:n0+BN]`` by TMA
  into a ring of ``STAGES`` shared-memory slots;
- the **MMA warp group** (4 warps) computes tile ``i``'s ``dW = dYᵀX`` over *all* tokens with
  asynchronous ``wgmma`` (fp32 accumulator in its registers; no split over tokens), then waits
  until the one shared-memory dW slot is free and stores the tile there;
- the **update warps** (the default partition, ``num_warps``) take the tile from the slot, sum
  its squares (the tile's non-finite gate and its share of the layer norm, ``PART[tile]``),
  then read W and the state in row slices of ``SUB`` rows, apply the rule of ``leantrain.ops.update._rule``
  (the same function, hence the same bits as the update-only kernel given the same dW) and
  store W and the state. They read W and the state by TMA from a fourth partition, one warp,
  into a ring of ``SSTAGES`` shared-memory slots (``STATE_TMA``; W and the states need 16-byte
  aligned bases, else plain loads as each slice is updated: ``PLAIN_CONFIG``).

While the update warps work on tile ``i`` the MMA warp group already accumulates tile ``i + 1``
in its registers: the GEMM (tensor cores, shared memory) and the update (HBM) of two tiles
overlap on every SM, which is what the split path (cuBLAS, then the update kernel) cannot do.
The dW tile never leaves the SM.

Bytes per tile: ``T·(BM + BN)·2`` of dY and X read by TMA (from L2 for most tiles), and
``BM·BN·(sizeof W + Σ sizeof state)`` read and written once (fp32 AdamW: 24 B a weight element);
no dW traffic. Shared memory: ``STAGES·BT·(BM + BN)·2 + BM·BN·4`` bytes (3 stages of 64 tokens
at 128 × 128: 96 KiB + 64 KiB; ``BM·BN·2`` for the dW slot with the bf16 hand-over, ``DW16``), and with
``STATE_TMA`` ``SSTAGES·SUB·BN·(sizeof W + Σ sizeof state)`` (2 slots of 16 rows, fp32 W / m / v: 48 KiB).
``DEEP16_CONFIG`` with ``DW16``: 8 slots of 32 tokens (128 KiB) + 32 KiB + 2 state slots (48 KiB).

Scope: bf16 or fp16 X / dY with rows aligned to 16 bytes; W fp32 or bf16 (round to nearest or
stochastic rounding with FORGE's counter hash); states fp32 or bf16; every rule of ``_rule``; no
bias (it keeps the other paths); a clip scale known before the layer's backward
(``clip="prev_global"``) is read from a device scalar, and the step's scalars may be (``dyn``: the
table of ``kernel.launch_forge``, for CUDA graphs). ``MODE`` 1 writes the
tile's dW to ``G`` instead of updating (the bit-exactness tests: fused == write dW + the
update-only kernel). For measurements (``benchmarks/tools/tune_ws.py``, ``forge_probes.py``):
``launch_ws``'s ``PROBE_GEMM`` runs the GEMM alone (the update warps only take each tile's sum of
squares) and ``PROBE_UPDATE`` the update alone (no token is loaded: dW = 0); ``trace`` records the
GPU clock at each tile's events; ``CTAS`` / ``BALANCE`` set the number of programs.

The schedule (``WS_CONFIG`` and its overrides) is picked per layer shape by ``auto_config`` when the
caller gives none: the GEMM bounds the time from T = 2048 (a deeper operand ring) and the update
below it, with the last wave's tail (64-row tiles).

Needs Triton's Gluon (Triton >= 3.6) and an sm_90 GPU; ``available()`` says whether it can run.
"""

from __future__ import annotations

import functools

import torch

from leantrain.ops._backend import HAS_TRITON, interpreting

HAVE_GLUON = False
if HAS_TRITON:
    try:
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.hopper import (
            fence_async_shared,
            mbarrier,
            tma,
            warpgroup_mma,
            warpgroup_mma_wait,
        )
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        # (renamed async_load after Triton 3.6; both spellings work here)
        _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
        HAVE_GLUON = True
    except Exception:  # (an older Triton: no Gluon, or another API)
        HAVE_GLUON = False

# The default (measured on an H200, docs/forge.md): 128 x 128 tiles of W, 64 tokens a stage, 3 stages; 8
# update warps on 16-row slices whose W and state a fourth partition (one warp) loads by TMA into a ring of
# SSTAGES slots (STATE_TMA; 208 KiB of shared memory). DW16=1 (launch_ws(dw_bf16=True), FORGE's
# grad_dtype="bf16"): the MMA group rounds its tile to bf16 (round to nearest, what a bf16 matmul's output
# is) before the hand-over: half the dW slot's shared memory, free for deeper rings.
WS_CONFIG = {"BM": 128, "BN": 128, "BT": 64, "STAGES": 3, "SUB": 16, "STATE_TMA": 1, "SSTAGES": 2,
             "DW16": 0, "GROUP_M": 0, "APPROX": 0, "num_warps": 8, "mma_regs": 232}
MMA_WARPS = 4  # one warp group computes a tile's dW
PLAIN_CONFIG = {"STATE_TMA": 0, "SUB": 32}  # plain loads (what STATE_TMA falls back to on unaligned tensors)
# launch_ws's probe modes, beside MODE_FUSED (0) and MODE_WRITE_DW (1) of forge.kernel. This kernel has no
# update-only mode: MODE_UPDATE is also 2, and passed here it would run the GEMM probe (call by name).
PROBE_GEMM, PROBE_UPDATE = 2, 3
# What launch_ws picks by the layer's shape when not given a config (auto_config). At T >= 2048 the GEMM
# beside the update waits on operands with three 64-token slots in flight: DEEP_CONFIG keeps 256 tokens in
# flight and pays with a one-slot state ring. Below it the update bounds the time, and a short last wave
# leaves SMs idle: ROWS64_CONFIG's 64-row tiles halve that tail; where the last wave is nearly full they
# only add operand traffic and the default stays.
DEEP_CONFIG = {"BT": 32, "STAGES": 8, "SSTAGES": 1}
ROWS64_CONFIG = {"BM": 64, "STAGES": 6}
# With the bf16 hand-over (DW16) the 32 KiB it frees give the deep operand ring its 2-slot state ring back
# from T = 1024; below it the fp32 rule's picks stay.
DEEP16_CONFIG = {"BT": 32, "STAGES": 8, "SSTAGES": 2}
# Tiles walked 16 block rows at a time (GROUP_M, _ws_tile) where a row-major wave would span fewer than 4 block
# rows (on 2048x5632 at T = 2048 a wave then reads 25 operand blocks instead of 47); on shapes whose waves
# span 8 block rows already it is not faster.
GROUPED_CONFIG = {"GROUP_M": 16}

if HAVE_GLUON:
    from leantrain.ops.sr import sr_bf16
    from leantrain.ops.update import DYN_COLS, _draw, _dyn_scalars, _rule, _store_plain

    @gluon.jit
    def _stamp(TR, tr_j, pid, j, EV_ID: gl.constexpr, TRACE: gl.constexpr):
        """``TRACE`` (a probe): the GPU's nanosecond clock at event ``EV_ID`` of this program's ``j``-th tile,
        into ``TR[pid, j, EV_ID]`` (``tune_ws.py trace`` reads the schedule from it)."""
        if TRACE:
            # (pid: an unused input; the op takes at least one)
            t = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [pid], dtype=gl.int64, is_pure=False,
                                          pack=1)
            gl.store(TR + (pid * tr_j + j) * 8 + EV_ID, t)

    @gluon.jit
    def _ws_tile(tile, num_mb, num_nb, GROUP_M: gl.constexpr):
        """The block row and column of the ``tile``-th tile in processing order. ``GROUP_M`` 0: row-major
        (a wave of 132 consecutive tiles on a 16 x 44 grid of 2048x5632 reads 3 dY blocks and all 44 X
        blocks); else ``GROUP_M`` block rows at a time, walked down the rows first (Triton's grouped order:
        with 16, the same wave reads 16 dY and 9 X blocks, about half the operand bytes)."""
        if GROUP_M == 0:
            mb = tile // num_nb
            nb = tile % num_nb
        else:
            per_group = GROUP_M * num_nb
            first = (tile // per_group) * GROUP_M
            gsize = num_mb - first
            if gsize > GROUP_M:
                gsize = GROUP_M
            mb = first + (tile % per_group) % gsize
            nb = (tile % per_group) // gsize
        return mb, nb

    @gluon.jit
    def _ws_load(dy_desc, x_desc, a_bufs, b_bufs, ready, empty, T, num_tiles, num_mb, num_nb,
                 BM: gl.constexpr, BN: gl.constexpr, BT: gl.constexpr, STAGES: gl.constexpr,
                 GROUP_M: gl.constexpr):
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        it = 0
        for tile in range(pid, num_tiles, nprog):
            mb, nb = _ws_tile(tile, num_mb, num_nb, GROUP_M)
            m0 = mb * BM
            n0 = nb * BN
            for t in range(0, T, BT):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)  # (a new barrier: phase 1 done)
                mbarrier.expect(ready.index(s), dy_desc.block_type.nbytes + x_desc.block_type.nbytes)
                _tma_load(dy_desc, [t, m0], ready.index(s), a_bufs.index(s))
                _tma_load(x_desc, [t, n0], ready.index(s), b_bufs.index(s))
                it += 1

    @gluon.jit
    def _ws_mma(a_bufs, b_bufs, ready, empty, dw_smem, dw_ready, dw_empty, T, num_tiles, TR, tr_j,
                BM: gl.constexpr, BN: gl.constexpr, BT: gl.constexpr, STAGES: gl.constexpr, MMA_WARPS: gl.constexpr,
                DW16: gl.constexpr, TRACE: gl.constexpr):
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[MMA_WARPS, 1],
                                                             instr_shape=[16, min(BN, 128), 16])
        it = 0
        n = 0
        for _tile in range(pid, num_tiles, nprog):
            _stamp(TR, tr_j, pid, n, 0, TRACE)  # (0: the GEMM starts)
            acc = gl.zeros([BM, BN], gl.float32, layout=mma_layout)
            prev = 0
            for t in range(0, T, BT):
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                acc = warpgroup_mma(a_bufs.index(s).permute((1, 0)), b_bufs.index(s), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                mbarrier.arrive(empty.index(prev), pred=t > 0)  # the previous stage's wgmma is done
                prev = s
                it += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index(prev))
            _stamp(TR, tr_j, pid, n, 1, TRACE)  # (1: the GEMM is done)
            mbarrier.wait(dw_empty, (n & 1) ^ 1)  # the update warps are done reading tile n - 1
            _stamp(TR, tr_j, pid, n, 2, TRACE)  # (2: the slot is free)
            if DW16:  # (rounded to nearest: a bf16 matmul's output)
                dw_smem.store(acc.to(gl.bfloat16))
            else:
                dw_smem.store(acc)
            mbarrier.arrive(dw_ready)
            n += 1

    @gluon.jit
    def _ws_state_load(w_desc, s1_desc, s2_desc, w_bufs, s1_bufs, s2_bufs, st_ready, st_empty, num_tiles, num_mb,
                       num_nb, NSTATE: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, SUB: gl.constexpr,
                       SSTAGES: gl.constexpr, GROUP_M: gl.constexpr):
        """``STATE_TMA``: streams each slice's W and state by TMA into a ring of ``SSTAGES`` slots,
        in the order the update warps take them (rows and columns past W's are zero-filled)."""
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        nbytes: gl.constexpr = (w_desc.block_type.nbytes + (s1_desc.block_type.nbytes if NSTATE >= 1 else 0)
                                + (s2_desc.block_type.nbytes if NSTATE >= 2 else 0))
        it = 0
        for tile in range(pid, num_tiles, nprog):
            mb, nb = _ws_tile(tile, num_mb, num_nb, GROUP_M)
            m0 = mb * BM
            n0 = nb * BN
            for r in range(BM // SUB):
                s = it % SSTAGES
                mbarrier.wait(st_empty.index(s), ((it // SSTAGES) & 1) ^ 1)
                mbarrier.expect(st_ready.index(s), nbytes)
                _tma_load(w_desc, [m0 + r * SUB, n0], st_ready.index(s), w_bufs.index(s))
                if NSTATE >= 1:
                    _tma_load(s1_desc, [m0 + r * SUB, n0], st_ready.index(s), s1_bufs.index(s))
                if NSTATE >= 2:
                    _tma_load(s2_desc, [m0 + r * SUB, n0], st_ready.index(s), s2_bufs.index(s))
                it += 1

    @gluon.jit
    def _ws_offs(m0, r: gl.constexpr, cols, mk, N, K, SUB: gl.constexpr, IDX32: gl.constexpr,
                 rows_l: gl.constexpr):
        """Element offsets and mask of slice ``r`` (rows ``m0 + r·SUB ..``) of a tile."""
        rows = m0 + r * SUB + gl.arange(0, SUB, layout=rows_l)
        mask = (rows < N)[:, None] & mk[None, :]
        if IDX32:
            offs = rows[:, None] * K + cols[None, :]
        else:
            offs = rows[:, None].to(gl.int64) * K + cols[None, :]
        return offs, mask

    @gluon.jit
    def _ws_read(W, S1, S2, offs, mask, NSTATE: gl.constexpr):
        """A slice's W and state, in fp32 (zeros for states the rule does not have)."""
        w = gl.load(W + offs, mask=mask, other=0.0).to(gl.float32)
        s1 = gl.zeros_like(w)
        s2 = gl.zeros_like(w)
        if NSTATE >= 1:
            s1 = gl.load(S1 + offs, mask=mask, other=0.0).to(gl.float32)
        if NSTATE >= 2:
            s2 = gl.load(S2 + offs, mask=mask, other=0.0).to(gl.float32)
        return w, s1, s2

    @gluon.jit
    def _ws_update(dw_smem, dw_ready, dw_empty, w_bufs, s1_bufs, s2_bufs, st_ready, st_empty,
                   W, S1, S2, G, PART, SCALE, DYN, dyn_off, N, K, num_tiles, num_mb, num_nb,
                   lr, decay, step_size, bc2_sqrt, b1, b2, omb1, omb2, lerp_c, eps, mom, key,
                   MODE: gl.constexpr, RULE: gl.constexpr, KIND1: gl.constexpr, KIND2: gl.constexpr,
                   NSTATE: gl.constexpr, W_BF16: gl.constexpr, SR: gl.constexpr, HAS_DECAY: gl.constexpr,
                   HAS_MOM: gl.constexpr, NESTEROV: gl.constexpr, LERP_SMALL: gl.constexpr, IDX32: gl.constexpr,
                   HAS_SCALE: gl.constexpr, HAS_DYN: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                   SUB: gl.constexpr, STATE_TMA: gl.constexpr, SSTAGES: gl.constexpr,
                   GROUP_M: gl.constexpr, APPROX: gl.constexpr, TR, tr_j, TRACE: gl.constexpr,
                   num_warps: gl.constexpr):
        # The update partition: for each tile, wait for its dW in shared memory, load W and the
        # states, apply the rule, store them. One function (about 90 lines): a Gluon partition is
        # one callable by construction (gl.warp_specialize takes one per partition).
        layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [num_warps, 1], [1, 0])
        rows_l: gl.constexpr = gl.SliceLayout(1, layout)
        cols_l: gl.constexpr = gl.SliceLayout(0, layout)
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        sc = 1.0
        if HAS_SCALE:  # the clip scale (an fp32 device scalar); not finite: store nothing
            sc = gl.load(SCALE)
        gate = 1.0
        if HAS_DYN:  # the step's scalars from device memory (kernel.py's DYN row): what a CUDA graph replays;
            # the gate (1, or NaN to store nothing: a graph's warm-up run) multiplies dW as kernel.py's does
            lr, decay, step_size, bc2_sqrt, b1, b2, omb1, omb2, lerp_c, eps, mom, gate, key = _dyn_scalars(DYN, dyn_off)
        n = 0
        st = 0  # (STATE_TMA: slices taken from the state ring)
        for tile in range(pid, num_tiles, nprog):
            mb, nb = _ws_tile(tile, num_mb, num_nb, GROUP_M)
            m0 = mb * BM
            n0 = nb * BN
            cols = n0 + gl.arange(0, BN, layout=cols_l)
            mk = cols < K
            mbarrier.wait(dw_ready, n & 1)
            _stamp(TR, tr_j, pid, n, 3, TRACE)  # (3: the update warps have the tile)
            ss = 0.0
            for r in gl.static_range(BM // SUB):
                g = dw_smem.slice(r * SUB, SUB).load(layout).to(gl.float32)
                ss += gl.sum(gl.sum(g * g, axis=1), axis=0)
            gl.store(PART + mb * num_nb + nb, ss)  # (row-major, whatever the processing order)
            tile_ok = gl.abs(ss) < float("inf")
            if HAS_SCALE:
                tile_ok = tile_ok & (gl.abs(sc) < float("inf"))
            if HAS_DYN:
                tile_ok = tile_ok & (gl.abs(gate) < float("inf"))
            if MODE == 2:  # (a probe: the GEMM alone, nothing stored but PART)
                mbarrier.arrive(dw_empty)
            elif MODE == 1:
                for r in gl.static_range(BM // SUB):
                    g = dw_smem.slice(r * SUB, SUB).load(layout).to(gl.float32)
                    if r == BM // SUB - 1:
                        mbarrier.arrive(dw_empty)  # the slot is read: the MMA warps may store the next tile
                    offs, mask = _ws_offs(m0, r, cols, mk, N, K, SUB, IDX32, rows_l)
                    gl.store(G + offs, g, mask=mask)
            else:
                for r in gl.static_range(BM // SUB):
                    offs, mask = _ws_offs(m0, r, cols, mk, N, K, SUB, IDX32, rows_l)
                    g = dw_smem.slice(r * SUB, SUB).load(layout).to(gl.float32)
                    if r == BM // SUB - 1:
                        mbarrier.arrive(dw_empty)  # the slot is read: the MMA warps may store the next tile
                    if STATE_TMA:  # the slice from the state ring (the TMA loads' completion makes it visible)
                        slot = st % SSTAGES
                        mbarrier.wait(st_ready.index(slot), (st // SSTAGES) & 1)
                        w = w_bufs.index(slot).load(layout).to(gl.float32)
                        s1 = gl.zeros_like(w)
                        s2 = gl.zeros_like(w)
                        if NSTATE >= 1:
                            s1 = s1_bufs.index(slot).load(layout).to(gl.float32)
                        if NSTATE >= 2:
                            s2 = s2_bufs.index(slot).load(layout).to(gl.float32)
                        fence_async_shared()  # (these reads before the next TMA write of the slot)
                        mbarrier.arrive(st_empty.index(slot))
                        st += 1
                    else:
                        w, s1, s2 = _ws_read(W, S1, S2, offs, mask, NSTATE)
                    if HAS_DYN:
                        g = g * gate
                    if HAS_SCALE:
                        g = g * sc
                    z = gl.zeros_like(g)
                    smask = mask & tile_ok
                    p, s1, s2 = _rule(w, g, s1, s2, lr, decay, step_size, bc2_sqrt, b1, b2, omb1, omb2, lerp_c,
                                      eps, mom, z, RULE, HAS_DECAY, HAS_MOM, NESTEROV, LERP_SMALL, APPROX)
                    if W_BF16 and SR:
                        gl.store(W + offs, sr_bf16(p, _draw(key, offs, IDX32)), mask=smask)
                    else:
                        _store_plain(p, W, offs, smask, W_BF16, True, "")
                    if NSTATE >= 1:
                        _store_plain(s1, S1, offs, smask, KIND1 == 1, True, "")
                    if NSTATE >= 2:
                        _store_plain(s2, S2, offs, smask, KIND2 == 1, True, "")
            _stamp(TR, tr_j, pid, n, 4, TRACE)  # (4: the tile's stores are issued)
            n += 1

    @gluon.jit(do_not_specialize=["T", "lr", "decay", "step_size", "bc2_sqrt", "b1", "b2", "omb1", "omb2",
                                  "lerp_c", "eps", "mom", "key"])
    def _ws_kernel(dy_desc, x_desc, w_desc, s1_desc, s2_desc, W, S1, S2, G, PART, SCALE, DYN, dyn_off, TR, tr_j,
                   T, N, K,
                   lr, decay, step_size, bc2_sqrt, b1, b2, omb1, omb2, lerp_c, eps, mom, key,
                   MODE: gl.constexpr, RULE: gl.constexpr, KIND1: gl.constexpr, KIND2: gl.constexpr,
                   NSTATE: gl.constexpr, W_BF16: gl.constexpr, SR: gl.constexpr, HAS_DECAY: gl.constexpr,
                   HAS_MOM: gl.constexpr, NESTEROV: gl.constexpr, LERP_SMALL: gl.constexpr, IDX32: gl.constexpr,
                   HAS_SCALE: gl.constexpr, HAS_DYN: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                   BT: gl.constexpr, STAGES: gl.constexpr, SUB: gl.constexpr, STATE_TMA: gl.constexpr,
                   SSTAGES: gl.constexpr, MMA_WARPS: gl.constexpr, MMA_REGS: gl.constexpr,
                   DW16: gl.constexpr, GROUP_M: gl.constexpr, APPROX: gl.constexpr, TRACE: gl.constexpr,
                   num_warps: gl.constexpr):
        num_nb = gl.cdiv(K, BN)
        num_mb = gl.cdiv(N, BM)
        num_tiles = num_mb * num_nb
        a_bufs = gl.allocate_shared_memory(dy_desc.dtype, [STAGES, BT, BM], dy_desc.layout)
        b_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BT, BN], x_desc.layout)
        # 128-byte swizzle: the MMA group's stores (8 rows x 8 bytes a warp) and the update warps' row
        # reads both avoid most bank conflicts (an unswizzled [BM, BN] fp32 tile puts 8 rows in one bank)
        dw_dtype: gl.constexpr = gl.bfloat16 if DW16 else gl.float32
        dw_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN], dw_dtype)
        dw_smem = gl.allocate_shared_memory(dw_dtype, [BM, BN], dw_layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        dw_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        dw_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        mbarrier.init(dw_ready, count=1)
        mbarrier.init(dw_empty, count=1)
        if STATE_TMA:  # W and the state of each slice through shared memory, loaded by a fourth partition
            w_bufs = gl.allocate_shared_memory(w_desc.dtype, [SSTAGES, SUB, BN], w_desc.layout)
            s1_bufs = gl.allocate_shared_memory(s1_desc.dtype, [SSTAGES, SUB, BN], s1_desc.layout)
            s2_bufs = gl.allocate_shared_memory(s2_desc.dtype, [SSTAGES, SUB, BN], s2_desc.layout)
            st_ready = gl.allocate_shared_memory(gl.int64, [SSTAGES, 1], mbarrier.MBarrierLayout())
            st_empty = gl.allocate_shared_memory(gl.int64, [SSTAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(SSTAGES):
                mbarrier.init(st_ready.index(i), count=1)
                mbarrier.init(st_empty.index(i), count=1)
        else:  # (placeholders: not used)
            w_bufs, s1_bufs, s2_bufs, st_ready, st_empty = a_bufs, a_bufs, a_bufs, ready, empty
        # (each partition's arguments written out in the call: a tuple held in a variable loses its constexprs)
        if STATE_TMA:
            gl.warp_specialize([
                (_ws_update, (dw_smem, dw_ready, dw_empty, w_bufs, s1_bufs, s2_bufs, st_ready, st_empty,
                              W, S1, S2, G, PART, SCALE, DYN, dyn_off, N, K, num_tiles, num_mb, num_nb,
                              lr, decay, step_size, bc2_sqrt, b1, b2, omb1, omb2, lerp_c, eps, mom, key,
                              MODE, RULE, KIND1, KIND2, NSTATE, W_BF16, SR, HAS_DECAY, HAS_MOM, NESTEROV,
                              LERP_SMALL, IDX32, HAS_SCALE, HAS_DYN, BM, BN, SUB, STATE_TMA, SSTAGES,
                              GROUP_M, APPROX, TR, tr_j, TRACE, num_warps)),
                (_ws_mma, (a_bufs, b_bufs, ready, empty, dw_smem, dw_ready, dw_empty, T, num_tiles, TR, tr_j, BM, BN,
                           BT, STAGES, MMA_WARPS, DW16, TRACE)),
                (_ws_load, (dy_desc, x_desc, a_bufs, b_bufs, ready, empty, T, num_tiles, num_mb, num_nb, BM, BN, BT,
                            STAGES, GROUP_M)),
                (_ws_state_load, (w_desc, s1_desc, s2_desc, w_bufs, s1_bufs, s2_bufs, st_ready, st_empty, num_tiles,
                                  num_mb, num_nb, NSTATE, BM, BN, SUB, SSTAGES, GROUP_M)),
            ], [MMA_WARPS, 1, 1], [MMA_REGS, 24, 24])
        else:
            gl.warp_specialize([
                (_ws_update, (dw_smem, dw_ready, dw_empty, w_bufs, s1_bufs, s2_bufs, st_ready, st_empty,
                              W, S1, S2, G, PART, SCALE, DYN, dyn_off, N, K, num_tiles, num_mb, num_nb,
                              lr, decay, step_size, bc2_sqrt, b1, b2, omb1, omb2, lerp_c, eps, mom, key,
                              MODE, RULE, KIND1, KIND2, NSTATE, W_BF16, SR, HAS_DECAY, HAS_MOM, NESTEROV,
                              LERP_SMALL, IDX32, HAS_SCALE, HAS_DYN, BM, BN, SUB, STATE_TMA, SSTAGES,
                              GROUP_M, APPROX, TR, tr_j, TRACE, num_warps)),
                (_ws_mma, (a_bufs, b_bufs, ready, empty, dw_smem, dw_ready, dw_empty, T, num_tiles, TR, tr_j, BM, BN,
                           BT, STAGES, MMA_WARPS, DW16, TRACE)),
                (_ws_load, (dy_desc, x_desc, a_bufs, b_bufs, ready, empty, T, num_tiles, num_mb, num_nb, BM, BN, BT,
                            STAGES, GROUP_M)),
            ], [MMA_WARPS, 1], [MMA_REGS, 24])


def available(device=None) -> bool:
    """Gluon imported, a compiled (not interpreted) run, and an sm_90 GPU."""
    if not HAVE_GLUON or interpreting() or not torch.cuda.is_available():
        return False
    dev = torch.device("cuda") if device is None else torch.device(device)
    return torch.cuda.get_device_capability(dev)[0] == 9


def supported(x: torch.Tensor, dy: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether a layer's inputs and W fit the kernel (dtypes; TMA's contiguous, 16-byte aligned rows).
    The state kinds (fp32 / bf16) and the absence of a fused bias are the caller's to check."""
    if x.dtype not in (torch.bfloat16, torch.float16) or dy.dtype != x.dtype:
        return False
    if w.dtype not in (torch.float32, torch.bfloat16):
        return False
    N, K = w.shape
    return (x.stride(-1) == 1 and dy.stride(-1) == 1 and N % 8 == 0 and K % 8 == 0
            and x.stride(0) % 8 == 0 and dy.stride(0) % 8 == 0
            and x.data_ptr() % 16 == 0 and dy.data_ptr() % 16 == 0)


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def auto_config(N: int, K: int, T: int, nsm: int, dw_bf16: bool = False) -> dict:
    """The overrides of ``WS_CONFIG`` for a layer of ``N x K`` weights and ``T`` tokens on ``nsm`` SMs
    (the comments at ``DEEP_CONFIG``, ``DEEP16_CONFIG`` and ``GROUPED_CONFIG``): a deep operand ring from
    2048 tokens (from 1024 with a 2-slot state ring when ``dw_bf16``: the tile handed over in bf16), with
    the grouped tile order from 2048 tokens where a row-major wave spans fewer than 4 block rows; 64-row
    tiles below it where 128-row tiles fill less than 95 % of their last wave, else none."""
    group = {}
    if T >= 2048 and nsm < 4 * -(-K // WS_CONFIG["BN"]):  # a wave of row-major tiles spans < 4 block rows
        group = dict(GROUPED_CONFIG)
    if dw_bf16 and T >= 1024:
        return {**DEEP16_CONFIG, **group}
    if T >= 2048:
        return {**DEEP_CONFIG, **group}
    tiles = -(-N // WS_CONFIG["BM"]) * -(-K // WS_CONFIG["BN"])
    waves = -(-tiles // nsm)
    if tiles >= nsm and tiles / (waves * nsm) < 0.95:
        return dict(ROWS64_CONFIG)
    return {}


def resolve_config(config: dict | None, mode: int, tensors=()) -> dict:
    """``WS_CONFIG`` with ``config``'s overrides, and ``STATE_TMA`` as the launch will run it: only in
    the modes that update (0, and the probe 3), and with ``PLAIN_CONFIG`` instead when one of
    ``tensors`` (W and its states) is not 16-byte aligned, which TMA needs."""
    cfg = {**WS_CONFIG, **(config or {})}
    if cfg["STATE_TMA"] and any(t.data_ptr() % 16 for t in tensors):
        cfg.update(PLAIN_CONFIG)
    cfg["STATE_TMA"] = int(bool(cfg["STATE_TMA"]) and mode in (0, PROBE_UPDATE))
    return cfg


def _schedule(cfg: dict) -> dict:
    """The kernel's tile and schedule constexprs from a resolved configuration (launch and compile)."""
    return dict(BM=cfg["BM"], BN=cfg["BN"], BT=cfg["BT"], STAGES=cfg["STAGES"], SUB=cfg["SUB"],
                STATE_TMA=bool(cfg["STATE_TMA"]), SSTAGES=cfg["SSTAGES"],
                MMA_WARPS=MMA_WARPS, MMA_REGS=cfg["mma_regs"],
                DW16=bool(cfg["DW16"]), GROUP_M=int(cfg["GROUP_M"]), APPROX=bool(cfg["APPROX"]),
                num_warps=cfg["num_warps"])


def _programs(ntiles: int, nsm: int, cfg: dict) -> int:
    """How many persistent programs run the tiles: one an SM, or ``CTAS`` (a probe), or with
    ``BALANCE`` as few as keep the number of tiles a program runs (the waves) the same, so that every
    program runs that many but for fewer than one wave's worth (704 tiles on 132 SMs: 118 programs
    of 6 or 5 tiles instead of 132 of 6 or 5, where 88 SMs idle in the sixth wave)."""
    progs = min(ntiles, cfg.get("CTAS") or nsm)
    if cfg.get("BALANCE"):
        progs = -(-ntiles // -(-ntiles // progs))
    return progs


def _kernel_mode(mode: int) -> int:
    """The kernel's ``MODE`` constexpr for a launch mode: the update probe runs mode 0's code on no tokens."""
    if mode not in (0, 1, PROBE_GEMM, PROBE_UPDATE):
        raise ValueError(f"ws: mode {mode}: 0 (fused), 1 (write dW), {PROBE_GEMM} or {PROBE_UPDATE} (probes); "
                         "an update-only launch is ops.update_launch.launch_update's")
    return 0 if mode == PROBE_UPDATE else mode


def _gl_dtype(t: torch.dtype):
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[t]


@functools.cache
def _smem_layout(block: tuple, dtype: torch.dtype):
    """The TMA block's shared-memory layout (cached: building one takes ~6 us of CPU, and a launch needs
    up to five)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), _gl_dtype(dtype))


def launch_ws(mode: int, *, x, dy, w, states=(), kinds=(), g=None, part=None, scal=(), flags=(),
              rule_id: int = 1, sr: bool = True, key: int = 0, scale=None, dyn=None,
              config: dict | None = None, trace: dict | None = None, dw_bf16: bool = False,
              approx: bool = False) -> torch.Tensor:
    """Run the kernel on one layer: ``mode`` 0 (fused dW + update of ``w`` and ``states``) or 1 (dW
    into ``g``); the probes ``PROBE_GEMM`` (2: the GEMM alone, nothing stored but the sums of squares)
    and ``PROBE_UPDATE`` (3: the update alone, with dW = 0: no token is read). ``scal``: the 11 rule scalars of ``ops.update_launch.scalars``;
    ``flags``: its 4 flags; ``scale``: an optional fp32 device scalar multiplied into dW before the rule (the clip scale;
    not finite: nothing is stored), as ``ops.update_launch.launch_update``'s; ``dyn``: ``(table, row)``, the step's
    scalars, gate and key read from that row of the device table of ``ops.update_launch`` instead of ``scal``
    and ``key`` (a launch captured in a CUDA graph). ``config``: overrides of ``WS_CONFIG`` (``{}``: it
    as is); ``None``: ``auto_config``'s for this shape. ``dw_bf16``: the tile rounded to bf16 before the update
    (``DW16``; ``grad_dtype="bf16"``). ``approx``: the rule's square root and divisions approximate
    (``APPROX``; FORGE's ``fast_math``). ``trace`` (a probe): a dict that gets ``"stamps"``,
    int64 ``[programs, tiles a program, 8]``, the GPU clock (ns) at each tile's events: 0 the GEMM
    starts, 1 it is done, 2 the dW slot is free, 3 the update warps have the tile, 4 they are done.
    Returns the per-tile sums of squares (``part``, reused when its size is the tile count)."""
    nstate = len(states)
    s1 = states[0] if nstate > 0 else w
    s2 = states[1] if nstate > 1 else w
    T, K = x.shape
    N = dy.shape[1]
    kmode = _kernel_mode(mode)
    nsm = _num_sms(x.device.index or 0)
    if config is None:
        config = auto_config(N, K, T, nsm, dw_bf16)
    flags_on = {k: 1 for k, on in (("DW16", dw_bf16), ("APPROX", approx)) if on}
    cfg = resolve_config({**config, **flags_on}, mode, (w, s1, s2))
    BM, BN, BT = cfg["BM"], cfg["BN"], cfg["BT"]
    ntiles = -(-N // BM) * -(-K // BN)
    if part is None or part.numel() != ntiles:
        part = torch.empty(ntiles, dtype=torch.float32, device=x.device)
    dy_desc = TensorDescriptor.from_tensor(dy, [BT, BM], _smem_layout((BT, BM), dy.dtype))
    x_desc = TensorDescriptor.from_tensor(x, [BT, BN], _smem_layout((BT, BN), x.dtype))
    if cfg["STATE_TMA"]:  # [SUB, BN] slices of W and the states (K % 8 == 0 by supported(), 16-byte aligned bases above)
        sdesc = [TensorDescriptor.from_tensor(t, [cfg["SUB"], BN], _smem_layout((cfg["SUB"], BN), t.dtype))
                 for t in (w, s1, s2)]
    else:
        sdesc = [dy_desc] * 3  # (placeholders)
    k1 = 1 if nstate > 0 and kinds[0] == "bf16" else 0
    k2 = 1 if nstate > 1 and kinds[1] == "bf16" else 0
    grid = (_programs(ntiles, nsm, cfg),)
    tr_j = -(-ntiles // grid[0])
    if trace is not None:
        trace["stamps"] = torch.zeros(grid[0], tr_j, 8, dtype=torch.int64, device=x.device)
    _ws_kernel[grid](
        dy_desc, x_desc, *sdesc, w, s1, s2, w if g is None else g, part, part if scale is None else scale,
        part if dyn is None else dyn[0], 0 if dyn is None else dyn[1] * DYN_COLS,
        part if trace is None else trace["stamps"], tr_j, 0 if mode == PROBE_UPDATE else T, N, K, *scal,
        0 if dyn is not None else int(key),
        MODE=kmode, RULE=rule_id, KIND1=k1, KIND2=k2, NSTATE=nstate,
        W_BF16=w.dtype == torch.bfloat16, SR=bool(sr),
        HAS_DECAY=flags[0], HAS_MOM=flags[1], NESTEROV=flags[2], LERP_SMALL=flags[3],
        IDX32=N * K + N < 2**31, HAS_SCALE=scale is not None, HAS_DYN=dyn is not None, TRACE=trace is not None,
        **_schedule(cfg),
        enable_fp_fusion=False)  # (no a * b + c contracted into an FMA: the rule's bits, as kernel.py's)
    return part

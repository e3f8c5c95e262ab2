"""Block-wise quantize / dequantize of many tensors in one kernel launch.

``quantize_many(xs, seeds=...)`` equals ``[quantize(x, seed=s) for x, s in zip(xs, seeds)]``
bit for bit (same codes, scales, zero points, same stochastic-rounding draws), and
``dequantize_many(qs)`` equals ``[dequantize(q) for q in qs]``; the math is
:mod:`leantrain.ops.quant`'s. What changes is the host cost: one launch for the whole list
instead of one per tensor. A Triton launch costs tens of µs of host time, more than the
kernel runs for a few-MiB tensor, and AGoQ packs hundreds of saved activations per step.

Tiling (Triton): a table (int64, one row per tensor: addresses, sizes, the RNG key and the
first program of the tensor; :mod:`leantrain.ops.multi_kernels`, which holds the kernels) goes
to the device with the launch; program ``p`` finds its tensor as the number of tensors whose
first program is ``<= p``, minus one, and then does exactly what
:func:`leantrain.ops.quant._quantize_kernel` does for one ``[ROWS, group_size]`` tile of that
tensor (4 or 8 bits and fp32 / bf16 / fp16 per tensor: a launch mixing widths or
dtypes branches on the table's columns). Tensors are read through raw addresses, cast to typed
pointers on a GPU;
under the Triton interpreter (whose bf16 pointers cannot be made from an integer) 16-bit
floats are loaded as their bit patterns and widened exactly (bf16: ``bits << 16``). The
compiler cannot know the alignment of a loaded address: the host checks it and says so
(``ALIGNED``: addresses 16-byte aligned and sizes multiples of 16, when they are). All tensors of one call share group size, symmetry and rounding;
every input must be contiguous. The codes (and the scales) of all tensors of a call are views
of one allocation, freed when the last of them is (host time: one allocation per call, not
per tensor). ``quantize_flat`` / ``dequantize_flat`` (AGoQ's batches) skip even the views: one
buffer and byte offsets, a tensor's ``QTensor`` made only when asked for. Bytes moved are those
of the per-tensor kernels, plus 88 bytes of table per tensor.
"""

from __future__ import annotations

import torch

from leantrain.ops import quant
from leantrain.ops._backend import HAS_TRITON, interpreting, launch, next_pow2, resolve
from leantrain.ops.multi_kernels import _CAPTURED_TABLES, FLOAT_KIND, Col, launch_table  # noqa: F401
from leantrain.ops.qtensor import QTensor
from leantrain.ops.quant import dequantize_ref, quantize_ref
from leantrain.ops.rng import kernel_key
from leantrain.ops.tiles import Tile, check_int_format, fast_bits, tile_shape

if HAS_TRITON:
    from leantrain.ops.multi_kernels import _dequantize_many_kernel, _quantize_many_kernel

__all__ = ["quantize_many", "dequantize_many", "quantize_flat", "dequantize_flat", "flat_qtensor", "FlatLayout"]

# Tiles (0 warps: tile_shape's choice); a program runs ``per_program`` consecutive tiles of one
# tensor (the table lookup and its dependent loads are paid once per program). Measured on an
# H200 (benchmarks/tools/tune_kernels.py --what multi / agoq): quantize, with every size hinted
# divisible by 16, 4096 elements at 4 warps, one tile a program, is the best for 4-bit bf16
# (77.6 % of a copy; mixed widths 58-60 % for every tile tried). Dequantize: 4096 elements at 4
# warps, 2 tiles a program, with the size hints (one 1b AGoQ step's 30 flushes, 15.4 GiB, 5.47 ms
# = 89 % of a copy; 7.84 ms without the hints).
Q_TILE = Tile(elems=4096, warps=4, per_program=1)
DQ_TILE = Tile(elems=4096, warps=4, per_program=2)
FAST_MASK = ~0  # the tiles.FAST bits quantize_many launches with (a tuning tool may clear some)
# Launches that mix dtype kinds or widths compile both paths into one kernel (145 registers a
# thread on sm_90 for AGoQ's flushes, against 56 for 4-bit bf16 alone: benchmarks/tools/sass_count.py).
# So the 4-bit 16-bit-float rows (the word path) go to a launch of their own and the other rows
# to a second one: on an H200 that made an AGoQ-like flush 11-24 % faster, and the AGoQ step too.
# Every launch tells the compiler the addresses are 16-byte aligned and the sizes multiples of 16
# when they are: quantize_many 0.52 ms with the hint vs 1.13 ms without (bf16, one 1b layer's
# saves, H200). With the sizes hinted, the store mask of a dequantize is constant over 16 elements
# and the stores are 16-byte vectors (8 STG.128 a thread for a 4-bit bf16 tile of 4 x 2048
# elements instead of 64 STG.U16: benchmarks/tools/sass_count.py dequant).
_IDX32_LIMIT = 2**32




def _kind(rows: list[list[int]]) -> int:
    """The ``KIND`` constexpr: the dtype kind shared by every row, else -1 (column 9 per row)."""
    kinds = {r[Col.KIND] for r in rows}
    return kinds.pop() if len(kinds) == 1 else -1


def _split(device, dtype, sizes: list[int], align: int) -> tuple[list[torch.Tensor], list[int]]:
    """One allocation cut into views of ``sizes`` elements, each starting at a multiple of
    ``align`` elements: (views, their addresses). One allocation and one split for a whole
    call instead of a few tensor ops per tensor (host time)."""
    cuts, keep, offs, o = [], [], [], 0
    for s in sizes:
        p = -(-s // align) * align
        keep.append(len(cuts))
        cuts.append(s)
        if p > s:  # a padding piece only where one is needed (each view costs host time)
            cuts.append(p - s)
        offs.append(o)
        o += p
    buf = torch.empty(o, dtype=dtype, device=device)
    base, esize = buf.data_ptr(), buf.element_size()
    views = buf.split(cuts)
    if len(cuts) != len(sizes):
        views = [views[i] for i in keep]
    return list(views), [base + esize * off for off in offs]


def _same(values, what: str):
    first = values[0]
    if any(v != first for v in values[1:]):
        raise ValueError(f"quantize_many/dequantize_many: all tensors of one call need the same {what}")
    return first


def quantize_many(xs: list[torch.Tensor], *, bits: int | list[int] = 8, group_size: int = 128,
                  symmetric: bool = True, stochastic: bool = False, seeds: list[int] | None = None,
                  keys: list[int] | None = None, backend: str = "auto") -> list[QTensor]:
    """``[quantize(x, bits=b, seed=s, ...) for x, b, s in zip(xs, bits, seeds)]`` in one launch.

    ``bits``: one width (4 or 8) for all, or one per tensor. ``keys`` (``kernel_key(seed)`` per
    tensor) may be given instead of ``seeds`` by callers that derive them directly. Every ``x``
    must be contiguous, fp32 / bf16 / fp16 (mixed), on one device. See the module docstring.
    """
    if not xs:
        return []
    widths = list(bits) if isinstance(bits, (list, tuple)) else [bits] * len(xs)
    if len(widths) != len(xs):
        raise ValueError(f"quantize_many: {len(xs)} tensors but {len(widths)} bit-widths")
    for b in set(widths):
        check_int_format(b, group_size)
    if keys is None:
        seeds = list(seeds) if seeds is not None else [0] * len(xs)
        if len(seeds) != len(xs):
            raise ValueError(f"quantize_many: {len(xs)} tensors but {len(seeds)} seeds")
        keys = [kernel_key(s) for s in seeds]
    elif len(keys) != len(xs):
        raise ValueError(f"quantize_many: {len(xs)} tensors but {len(keys)} keys")
    device = xs[0].device
    for x in xs:
        if x.dtype not in FLOAT_KIND:
            raise TypeError(f"quantize_many expects fp32/bf16/fp16 tensors, got {x.dtype}")
        if x.device != device:
            raise ValueError("quantize_many/dequantize_many: all tensors of one call need the same device")
    if resolve(backend, *xs) == "torch":
        if seeds is None:
            raise ValueError("quantize_many: the torch backend needs seeds (keys cannot be inverted)")
        return [quantize_ref(x, bits=b, group_size=group_size, symmetric=symmetric, stochastic=stochastic, seed=s)
                for x, b, s in zip(xs, widths, seeds)]
    gs = [-(-x.numel() // group_size) for x in xs]
    # codes, scales (and zero points) of all tensors: one allocation each, 16-byte aligned views
    datas, dps = _split(device, torch.uint8, [g * group_size * b // 8 for g, b in zip(gs, widths)], 16)
    scales, sps = _split(device, torch.float32, gs, 4)
    zeros, zps = ([None] * len(xs), sps) if symmetric else _split(device, torch.float32, gs, 4)
    table = _QuantRows()
    for x, b, k, dp, sp, zp in zip(xs, widths, keys, dps, sps, zps):
        table.add(x, b, k, dp, sp, zp, group_size)
    table.launch(device, group_size, symmetric, stochastic)
    return [QTensor(d, sc, z, x.shape, x.dtype, b, group_size, symmetric)
            for d, sc, z, x, b in zip(datas, scales, zeros, xs, widths)]


class _QuantRows:
    """A quantize launch table being built, one row per non-empty tensor (:func:`quantize_many`
    with each tensor's own addresses; :class:`FlatLayout` with offsets into a buffer not yet
    allocated, its address added at the launch)."""

    __slots__ = ("rows", "low", "words", "half4", "gmax")

    def __init__(self):
        self.rows: list[list[int]] = []
        self.low = 0  # OR of every address and size: the alignment hint holds when its low 4 bits are 0
        self.words = quant.WORD_PAIRS  # every 4-bit 16-bit-float input readable as 32-bit words
        self.half4 = False
        self.gmax = 0

    def add(self, x: torch.Tensor, bits: int, key: int, dp: int, sp: int, zp: int, group_size: int) -> None:
        """The row of contiguous ``x`` quantized to ``bits`` into codes / scales / zero points at
        ``dp`` / ``sp`` / ``zp``."""
        if not x.is_contiguous():
            raise ValueError("quantize_many / quantize_flat need contiguous tensors (pass x.contiguous())")
        n = x.numel()
        if not n:
            return
        g = -(-n // group_size)
        if g > self.gmax:
            self.gmax = g
        xp = x.data_ptr()
        kind = FLOAT_KIND[x.dtype]
        self.rows.append([xp, dp, sp, zp, n, g, key, 0, bits, kind])  # the Col order
        self.low |= xp | dp | sp | zp | n
        if bits == 4 and kind:
            self.half4 = True
            self.words = self.words and not (n & 1 or xp & 3)

    def launch(self, device, group_size: int, symmetric: bool, stochastic: bool, base: int = 0) -> None:
        """Quantize every row (``base`` added to the three output addresses of each)."""
        if not self.rows:
            return
        rows = self.rows
        if base:
            rows = [[r[Col.IN], r[Col.DATA_Q] + base, r[Col.SCALE_Q] + base, r[Col.ZERO_Q] + base, *r[Col.N:]]
                    for r in rows]
        _launch_quantize(rows, device, group_size, symmetric, stochastic, self.gmax * group_size > _IDX32_LIMIT,
                         self.half4 and self.words, self.low | base)


def _launch_quantize(rows: list[list[int]], device, group_size: int, symmetric: bool, stochastic: bool, big: bool,
                     word: bool, low: int) -> None:
    """Launch the quantize kernel on table ``rows``. ``big``: a tensor needs 64-bit indices;
    ``word``: every 4-bit 16-bit-float row can be read as 32-bit words, and those rows go to a
    launch of their own, apart from the others (module comment above :data:`Q_TILE`); ``low``:
    the OR of every address and size (16-byte alignment when its low 4 bits are 0)."""
    parts = [(rows, False)]  # (rows, WORDS)
    if word:
        on_word_path = [r[Col.BITS] == 4 and r[Col.KIND] > 0 for r in rows]
        parts = [([r for r, w in zip(rows, on_word_path) if w], True),
                 ([r for r, w in zip(rows, on_word_path) if not w], False)]
    elems, tile_warps, per_program = Q_TILE
    cols, rows_per, warps = tile_shape(group_size, elems)
    per_prog = rows_per * per_program
    for prow, pword in parts:
        if not prow:
            continue
        tab, total = launch_table(prow, [-(-r[Col.N_GROUPS] // per_prog) for r in prow], device, keyed=stochastic)
        widths = {r[Col.BITS] for r in prow}
        launch(_quantize_many_kernel, (total,), tab, len(prow), TP=next_pow2(len(prow)), KIND=_kind(prow),
               GS=group_size, COLS=cols, ROWS=rows_per, BITS=widths.pop() if len(widths) == 1 else 0,
               SYMMETRIC=symmetric, STOCHASTIC=stochastic, IDX32=not big, ALIGNED=not low & 15,
               NATIVE=not interpreting(), PAIRS=quant.PAIR_SR, FAST=fast_bits() & FAST_MASK, TPP=per_program,
               WORDS=pword, num_warps=tile_warps or warps)


def _align16(n: int) -> int:
    return (n + 15) & ~15


class FlatLayout:
    """The layout of a :func:`quantize_flat` buffer, built one tensor at a time, and the rows of
    its launch table (all but the buffer's address): AGoQ's batches add each save as it comes,
    so a flush only allocates, adds the address, and launches (its host time was the forward's).

    ``offsets[i] = (data, scale, zero)``: byte offsets of tensor ``i``'s codes, fp32 scales and
    zero points (``zero == scale`` when symmetric), each 16-byte aligned."""

    __slots__ = ("group_size", "symmetric", "size", "offsets", "table")

    def __init__(self, group_size: int, symmetric: bool):
        self.group_size, self.symmetric = group_size, symmetric
        self.size = 0  # bytes so far
        self.offsets: list[tuple[int, int, int]] = []
        self.table = _QuantRows()  # output addresses as offsets into the buffer

    def place(self, x: torch.Tensor, bits: int) -> tuple[int, int, int]:
        """Room for ``x`` at ``bits``: its offsets (no launch-table row)."""
        g = -(-x.numel() // self.group_size)
        d = self.size
        sc = d + _align16(g * self.group_size * bits // 8)
        z = end = sc + _align16(4 * g)
        if self.symmetric:
            z = sc
        else:
            end += _align16(4 * g)
        self.size = end
        lay = (d, sc, z)
        self.offsets.append(lay)
        return lay

    def add(self, x: torch.Tensor, bits: int, seed: int) -> tuple[int, int, int]:
        """Place contiguous ``x`` at ``bits`` and add its row (its stochastic-rounding ``seed``)."""
        d, sc, z = lay = self.place(x, bits)
        self.table.add(x, bits, kernel_key(seed), d, sc, z, self.group_size)
        return lay

    def launch(self, device, stochastic: bool) -> torch.Tensor:
        """Allocate the buffer and quantize every tensor added into it (one launch per path)."""
        buf = torch.empty(max(self.size, 16), dtype=torch.uint8, device=device)
        self.table.launch(device, self.group_size, self.symmetric, stochastic, base=buf.data_ptr())
        return buf


def quantize_flat(xs: list[torch.Tensor], bits: list[int], seeds: list[int], *, group_size: int = 128,
                  symmetric: bool = True, stochastic: bool = False, backend: str = "auto",
                  layout: FlatLayout | None = None) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """:func:`quantize_many`'s codes and scales, in one uint8 buffer, without a view or a
    :class:`QTensor` per tensor (per-tensor host time: AGoQ's flushes, hundreds of tensors a
    forward). Returns ``(buffer, layout)``: ``layout[i] = (data, scale, zero)``, byte offsets of
    tensor ``i``'s codes, fp32 scales and zero points (``zero == scale`` when symmetric), each
    16-byte aligned. :func:`flat_qtensor` makes tensor ``i``'s QTensor on demand;
    :func:`dequantize_flat` dequantizes members straight from the buffer. Inputs as for
    :func:`quantize_many` (contiguous fp32 / bf16 / fp16 on one device, 4 or 8 bits).
    ``layout``: the :class:`FlatLayout` of exactly these tensors, widths and seeds, built as they
    came (the caller vouches for it; its table rows are used as they are).
    """
    if not xs:
        return torch.empty(0, dtype=torch.uint8), []
    device = xs[0].device
    if resolve(backend, *xs) == "torch":
        lay = FlatLayout(group_size, symmetric)
        offsets = [lay.place(x, b) for x, b in zip(xs, bits, strict=True)]
        buf = torch.empty(max(lay.size, 16), dtype=torch.uint8, device=device)
        for x, b, s, o3 in zip(xs, bits, seeds, offsets):
            q = quantize_ref(x, bits=b, group_size=group_size, symmetric=symmetric, stochastic=stochastic, seed=s)
            data_off, scale_off, zero_off = o3
            for t, o in ((q.data, data_off), (q.scale, scale_off), (q.zero, zero_off)):
                if t is not None:
                    buf[o:o + t.numel() * t.element_size()].copy_(t.view(torch.uint8))
        return buf, offsets
    for b in set(bits):
        check_int_format(b, group_size)
    if any(x.device != device for x in xs):
        raise ValueError("quantize_flat: all tensors of one call need the same device")
    if layout is None:
        layout = FlatLayout(group_size, symmetric)
        for x, b, s in zip(xs, bits, seeds, strict=True):
            layout.add(x, b, s)
    elif len(layout.offsets) != len(xs) or layout.group_size != group_size or layout.symmetric != symmetric:
        raise ValueError("quantize_flat: the layout given was not built for these tensors")
    return layout.launch(device, stochastic), layout.offsets


def flat_qtensor(buf: torch.Tensor, layout: tuple[int, int, int], shape, dtype: torch.dtype, bits: int,
                 group_size: int, symmetric: bool) -> QTensor:
    """The :class:`QTensor` of one member of a :func:`quantize_flat` buffer (views into it)."""
    n = 1
    for v in shape:
        n *= v
    g = -(-n // group_size)
    d, sc, z = layout
    data = buf[d:d + g * group_size * bits // 8]
    scale = buf[sc:sc + 4 * g].view(torch.float32)
    zero = None if symmetric else buf[z:z + 4 * g].view(torch.float32)
    return QTensor(data, scale, zero, torch.Size(shape), dtype, bits, group_size, symmetric)


def dequantize_flat(buf: torch.Tensor, members: list[tuple[tuple[int, int, int], torch.Size, torch.dtype, int]], *,
                    group_size: int = 128, symmetric: bool = True, backend: str = "auto") -> list[torch.Tensor]:
    """Dequantize members ``(layout, shape, dtype, bits)`` of a :func:`quantize_flat` buffer in one
    launch, each into its own new tensor (freed one by one)."""
    if not members:
        return []
    if resolve(backend, buf) == "torch":
        return [dequantize_ref(flat_qtensor(buf, lay, shape, dt, b, group_size, symmetric))
                for lay, shape, dt, b in members]
    base = buf.data_ptr()
    return _dequantize_into([(base + d, base + sc, base + z, shape, dt, b) for (d, sc, z), shape, dt, b in members],
                            buf.device, group_size, symmetric)


def _dequantize_into(srcs: list[tuple[int, int, int, torch.Size, torch.dtype, int]], device, group_size: int,
                     symmetric: bool) -> list[torch.Tensor]:
    """The Triton path of :func:`dequantize_many` / :func:`dequantize_flat`: ``srcs`` are (codes,
    scales, zero points addresses, shape, output dtype, bits); one new tensor each."""
    out, rows, low = [], [], 0
    for dp, sp, zp, shape, dt, b in srcs:
        o = torch.empty(shape, dtype=dt, device=device)  # one allocation each: freed one by one
        out.append(o)
        n = o.numel()
        if n:
            op = o.data_ptr()
            rows.append([dp, sp, zp, op, n, -(-n // group_size), 0, 0, b, FLOAT_KIND[dt]])  # the Col order
            low |= dp | sp | zp | op | n
    if rows:
        _launch_dequantize(rows, device, group_size, symmetric, low)
    return out


def dequantize_many(qs: list[QTensor], *, dtype: torch.dtype | None = None,
                    backend: str = "auto") -> list[torch.Tensor]:
    """``[dequantize(q, dtype=dtype) for q in qs]`` in one launch (integer, non-stacked QTensors
    of 4 or 8 bits and output dtypes mixed, one group size and symmetry)."""
    if not qs:
        return []
    for q in qs:
        if q.fmt != "int" or q.stacked:
            raise ValueError("dequantize_many takes integer, non-stacked QTensors")
    gs = _same([q.group_size for q in qs], "group_size")
    sym = _same([q.symmetric for q in qs], "symmetric")
    device = _same([q.data.device for q in qs], "device")
    dtypes = [dtype or q.dtype for q in qs]
    for d in set(dtypes):
        if d not in FLOAT_KIND:
            raise TypeError(f"dequantize_many writes fp32/bf16/fp16, got {d}")
    if resolve(backend, *(q.data for q in qs)) == "torch":
        return [dequantize_ref(q, d) for q, d in zip(qs, dtypes)]
    srcs = [(q.data.data_ptr(), q.scale.data_ptr(), (q.scale if q.zero is None else q.zero).data_ptr(), q.shape, d,
             q.bits) for q, d in zip(qs, dtypes)]
    return _dequantize_into(srcs, device, gs, sym)


def _launch_dequantize(rows: list[list[int]], device, group_size: int, symmetric: bool, low: int) -> None:
    """Launch the dequantize kernel on table ``rows`` (``low``: as for :func:`_launch_quantize`)."""
    elems, tile_warps, per_program = DQ_TILE
    cols, rows_per, warps = tile_shape(group_size, elems)
    tab, total = launch_table(rows, [-(-r[Col.N_GROUPS] // (rows_per * per_program)) for r in rows], device)
    widths = {r[Col.BITS] for r in rows}
    launch(_dequantize_many_kernel, (total,), tab, len(rows), TP=next_pow2(len(rows)), KIND=_kind(rows),
           HW_CAST=not interpreting(), GS=group_size, COLS=cols, ROWS=rows_per,
           BITS=widths.pop() if len(widths) == 1 else 0, SYMMETRIC=symmetric, ALIGNED=not low & 15,
           FAST=fast_bits(), TPP=per_program, num_warps=tile_warps or warps)

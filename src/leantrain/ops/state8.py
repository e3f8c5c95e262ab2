"""8-bit optimizer-state codec: block-wise absmax + the bitsandbytes dynamic map.

Math: the tensor is cut into blocks of ``block_size`` (256) elements; each block stores
``absmax`` (fp32, over finite values) and one uint8 code per element:
    xn   = x * (1 / absmax)                      (0 when absmax == 0; non-finite x -> 0)
    code = #{ j : mid_j < xn },  mid_j = (qmap[j] + qmap[j + 1]) * 0.5     (nearest entry)
    x'   = qmap[code] * absmax
``qmap`` is bitsandbytes' ``create_dynamic_map``: 256 sorted fp32 values in [-1, 1]
(signed, for first moments) or [0, 1] (unsigned, for second moments); 7 decades of dynamic
range with more mantissa near 1. Relative round-trip error per element is bounded by half
the local gap of the map (tested), absolute error by ``absmax * max_gap / 2``.

Triton device helpers for epilogues elsewhere (FORGE): :func:`state8_decode` is one gather
from the 1 KiB map; :func:`state8_encode` computes a candidate code in closed form from the
structure of the map and corrects it with one midpoint comparison (one cached gather from
the midpoint table stored after the map), exactly the torch ``searchsorted`` result (see
"closed-form encode" below). Both take the *device table* of :meth:`StateCodec8.qmap_on`:
``table[0:256]`` the map, ``table[256:511]`` its midpoints ``(qmap[j] + qmap[j+1]) * 0.5``
(computed in torch exactly as the reference computes them).

Closed-form encode. Decade ``i`` (0..6) of the map holds ``m_i`` (signed: ``2**i``; unsigned:
``2**(i+1)``) entries ``10**(i-6) * (0.1 + 0.9 * (j + 0.5) / m_i)``, j = 0..m_i-1, linear in j;
the decades are contiguous in the sorted map (signed: positive half at 128..254, the negative
half its mirror ``qmap[254 - k] = -qmap[k]``, 0 at 127, 1.0 at 255; unsigned: 0 at 0, decades
at 1..254, 1.0 at 255). So the real position of ``a = |x|`` in the positive half,
    P(a) = start_i - 0.5 + (a * 10**(6-i) - 0.1) * m_i / 0.9     (a in decade i)
is continuous, piecewise linear and concave (slopes fall by 5x per decade), i.e.
``P(a) = min_i (A_i * a + B_i)``: 7 multiply-adds and 6 minimums, no log, no table. With
``Q = P - 0.1`` (signed, x >= 0), ``253.8 - P`` (signed, x < 0) or ``2 (P - 127) - 0.6``
(unsigned, which has ``P_u = 2 (P_s - 127) - 0.5``), ``Q`` is monotone in x and takes the
value ``Q(mid_k) in [k + 0.15, k + 0.60]`` at every midpoint of the real fp32 map (checked
for both maps: the worst case is the 0.99.. | 1.0 midpoint), far from the fp32 rounding
error of Q (~1e-5). Hence with ``c = clamp(trunc(Q), 0, 254)`` the exact code
``#{k : mid_k < x}`` is ``c`` or ``c + 1``, and it is ``c + (mid_c < x)`` with
``mid_c = (qmap[c] + qmap[c+1]) * 0.5`` read from the midpoint table (the reference's own
values): bit-exact, ties to the lower entry, +-inf to 255 / 0. Per element: one gather
from the 1 KiB midpoint table (the binary search had 16 gathers and 8 dependent steps;
reading both neighbours of the map and averaging them had two, and the L1 wavefronts of
those gathers, not HBM, bounded the encode kernel on an H200) and ~22 ALU instructions on
sm_90 where the map's sign is a compile-time constant (:func:`state8_encode_finite`: the 13
of the lines, no clamp on ``c``: ``|x|`` clamped to 1 keeps ``trunc(Q)`` in [0, 254]).

Tiling (Triton encode): one program owns ``ROWS`` blocks (a ``[ROWS, next_pow2(bs)]`` tile,
``ENCODE_ELEMS`` = 1024 elements at 2 warps, 16 a thread; at least one block); 64-bit
offsets only in the per-program base pointers. Bytes per element: 4 read, 1 written (+ 4 / 256 for absmax); decode the reverse.
"""

from __future__ import annotations

import torch

from leantrain.ops._backend import HAS_TRITON, interpreting, launch, resolve
from leantrain.ops.tiles import ieee_div


def create_dynamic_map(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8) -> torch.Tensor:
    """bitsandbytes' dynamic quantization map (256 sorted fp32 values)."""
    data: list[float] = []
    non_sign_bits = total_bits - 1
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        fraction_items = int(2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed
                             else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1)
        boundaries = torch.linspace(0.1, 1, fraction_items, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    if additional_items > 0:
        boundaries = torch.linspace(0.1, 1, additional_items + 1, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    data.append(0)
    data.append(1.0)
    data += [0.0] * (2**total_bits - len(data))
    data.sort()
    return torch.tensor(data, dtype=torch.float32)


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def state8_decode(code, absmax, qmap_ptr):
        """Device helper: ``qmap[code] * absmax`` (code: integer tensor 0..255; ``qmap_ptr``:
        the device table of :meth:`StateCodec8.qmap_on`)."""
        return tl.load(qmap_ptr + code.to(tl.int32)) * absmax

    @triton.jit
    def _position(a):
        """``P(a) - 0.1`` of the module docstring, |x| >= 2 (and NaN) clamped to 2 so it stays
        small and finite."""
        return _lines(tl.where(a < 2.0, a, 2.0), 1.0, 0.0)

    @triton.jit
    def _lines(a, MUL: tl.constexpr, ADD: tl.constexpr):
        """``MUL (P(a) - 0.1) + ADD`` (module docstring) for a finite ``a >= 0``: the min over the
        decades' lines, each scaled and shifted (``MUL > 0``; exact for ``1, 0``). Fused
        multiply-adds on purpose, and the lines' own rounding: it only picks the candidate code
        (margin >= 0.15 against errors of ~1e-5); the midpoint comparison makes it exact."""
        p = tl.fma(a, 1111111.111111111 * MUL, 127.28888888888889 * MUL + ADD)
        p = tl.minimum(p, tl.fma(a, 222222.22222222222 * MUL, 128.17777777777778 * MUL + ADD))
        p = tl.minimum(p, tl.fma(a, 44444.444444444444 * MUL, 129.95555555555555 * MUL + ADD))
        p = tl.minimum(p, tl.fma(a, 8888.8888888888889 * MUL, 133.51111111111112 * MUL + ADD))
        p = tl.minimum(p, tl.fma(a, 1777.7777777777778 * MUL, 140.62222222222223 * MUL + ADD))
        p = tl.minimum(p, tl.fma(a, 355.55555555555556 * MUL, 154.84444444444446 * MUL + ADD))
        p = tl.minimum(p, tl.fma(a, 71.111111111111111 * MUL, 183.28888888888889 * MUL + ADD))
        return p

    @triton.jit
    def state8_encode_finite(x_normalized, a_normalized, qmap_ptr, SIGNED: tl.constexpr):
        """:func:`state8_encode` for ``x_normalized`` whose ``|x|`` the caller already has
        (``a_normalized``) and a map whose signedness is a compile-time constant: the same codes
        (NaN -> 0, +-inf to the extreme entries) without the sign's selects and without a clamp
        on ``c`` (the encode kernel's and the update epilogue's hot loop).

        ``|x|`` is clamped to 1, not 2: the codes of ``|x| >= 1`` are the extreme ones either way
        (``c`` is 254 or 0 and the midpoint comparison decides), and then ``Q`` needs no clamp:
        signed, ``Q`` lies in [-0.6, 254.4] (x >= 0: ``P - 0.1``; else ``253.8 - P``), unsigned in
        [0.18, 254.4] (x >= 0: ``2 (P - 0.1) - 254.4``, the lines scaled and shifted so; else 0), so
        ``trunc(Q)`` is in [0, 254]. NaN fails ``x >= 0`` and takes the negative branch: ``c = 0``
        and ``mid_0 < NaN`` is false: code 0."""
        a = tl.where(a_normalized < 1.0, a_normalized, 1.0)
        if SIGNED:
            p = _lines(a, 1.0, 0.0)
            q = tl.where(x_normalized >= 0.0, p, 253.8 - p)
        else:
            q = tl.where(x_normalized >= 0.0, _lines(a, 2.0, -254.4), 0.0)
        c = q.to(tl.int32)  # (trunc: -0.6 -> 0)
        mid = tl.load(qmap_ptr + 256 + c)  # (qmap[c] + qmap[c + 1]) * 0.5, precomputed
        return c + (mid < x_normalized).to(tl.int32)

    @triton.jit
    def state8_encode(x_normalized, qmap_ptr):
        """Device helper: nearest-entry code (int32 0..255) of ``x_normalized`` in [-1, 1].

        Exactly ``#{j : mid_j < x}`` (ties go to the lower entry), computed in closed form
        plus one midpoint comparison (module docstring). ``qmap_ptr`` must point at the
        device table of a :func:`create_dynamic_map` map (signed or unsigned, told apart by
        ``qmap[0] < 0``; 256 map entries then 255 midpoints): ``StateCodec8.qmap_on(device)``.
        ``x_normalized`` should be finite (callers zero non-finite values first); NaN gives
        code 0, +-inf the extreme entries.
        """
        x = x_normalized.to(tl.float32)
        signed = tl.load(qmap_ptr) < 0.0
        p = _position(tl.abs(x))
        pos_mul = tl.where(signed, 1.0, 2.0)
        pos_add = tl.where(signed, 0.0, -254.4)
        neg_add = tl.where(signed, 253.8, -1.0)  # unsigned: x < 0 -> Q < 0 -> code 0
        q = tl.where(x < 0.0, neg_add - p, p * pos_mul + pos_add)
        c = tl.minimum(tl.maximum(q.to(tl.int32), 0), 254)  # trunc == floor after the clamp
        mid = tl.load(qmap_ptr + 256 + c)  # (qmap[c] + qmap[c + 1]) * 0.5, precomputed
        code = c + (mid < x).to(tl.int32)
        return tl.where(x == x, code, 0)

    @triton.jit
    def _encode_kernel(x_ptr, codes_ptr, absmax_ptr, qmap_ptr, n, n_blocks,
                       BS: tl.constexpr, COLS: tl.constexpr, ROWS: tl.constexpr, SIGNED: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        base = pid * (ROWS * BS)                      # int64 only here, per program
        rem = tl.minimum(n - base, ROWS * BS).to(tl.int32)
        r = tl.arange(0, ROWS)
        cols = tl.arange(0, COLS)
        loc = r[:, None] * BS + cols[None, :]         # int32 offsets inside the tile
        m = (cols[None, :] < BS) & (loc < rem)
        x = tl.load(x_ptr + base + loc, mask=m, other=0.0).to(tl.float32)
        ax = tl.abs(x)
        fin = ax < float("inf")  # NaN and +-inf -> 0
        x = tl.where(fin, x, 0.0)
        ax = tl.where(fin, ax, 0.0)
        amax = tl.max(ax, axis=1)
        one = tl.zeros_like(amax) + 1.0
        inv = tl.where(amax > 0, tl.div_rn(one, tl.where(amax > 0, amax, 1.0)), 0.0)
        # |x * inv| == |x| * inv exactly (inv >= 0): the abs is not recomputed
        code = state8_encode_finite(x * inv[:, None], ax * inv[:, None], qmap_ptr, SIGNED)
        tl.store(codes_ptr + base + loc, code.to(tl.uint8), mask=m)
        rows = pid * ROWS + r
        tl.store(absmax_ptr + rows, amax, mask=rows < n_blocks)

    @triton.jit
    def _decode_kernel(codes_ptr, absmax_ptr, qmap_ptr, out_ptr, n,
                       BS: tl.constexpr, COLS: tl.constexpr, ROWS: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, COLS)
        idx = rows[:, None] * BS + cols[None, :]
        m = (cols[None, :] < BS) & (idx < n)
        code = tl.load(codes_ptr + idx, mask=m, other=0)
        amax = tl.load(absmax_ptr + rows, mask=rows * BS < n, other=0.0)
        tl.store(out_ptr + idx, state8_decode(code, amax[:, None], qmap_ptr), mask=m)


def block_inverse(absmax: torch.Tensor) -> torch.Tensor:
    """``1 / absmax`` rounded as IEEE division (0 where absmax is 0): the codec's normalization."""
    return torch.where(absmax > 0, ieee_div(1.0, torch.where(absmax > 0, absmax, 1.0)), 0.0)


# Elements per program of the encode kernel (whole blocks) and its warps. Measured on an H200
# (benchmarks/tools/tune_kernels.py): 1024 elements at 2 warps 57.9 % / 59.3 % of a copy at
# 256 MiB / 2 GiB of fp32, against 52.1 % / 52.2 % for 4096 at 4 warps (121 registers a thread
# there, 64 at 16 elements a thread: benchmarks/tools/sass_count.py state8); 8192-element tiles
# 38-40 %.
ENCODE_ELEMS = 1024
ENCODE_WARPS = 2
ENCODE_MAXNREG = 0  # register cap a thread of the encode kernel (0: none; tuning)


class StateCodec8:
    """Encode/decode fp32 optimizer state to uint8 codes + one fp32 absmax per block.

    ``codec.qmap`` (256 fp32, sorted) is what a Triton epilogue passes as ``qmap_ptr`` to
    :func:`state8_encode` / :func:`state8_decode` (move it to the device once:
    ``codec.qmap_on(device)``).
    """

    def __init__(self, signed: bool = True, block_size: int = 256):
        if not (1 <= block_size <= 4096):
            raise ValueError(f"block_size must be in [1, 4096], got {block_size}")
        self.signed = signed
        self.block_size = block_size
        self.qmap = create_dynamic_map(signed)
        self.midpoints = (self.qmap[1:] + self.qmap[:-1]) * 0.5
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def qmap_on(self, device) -> torch.Tensor:
        """The device table Triton helpers take: the 256-entry map, then its 255 midpoints."""
        return self._maps(torch.device(device))[2]

    def _maps(self, device: torch.device):
        if device not in self._on:
            table = torch.cat([self.qmap, self.midpoints]).to(device)
            table._lt_signed = self.signed  # (FORGE's epilogue compiles its encoder for this map's sign)
            self._on[device] = (table[:256], table[256:], table)
        return self._on[device]

    def num_blocks(self, numel: int) -> int:
        return -(-numel // self.block_size)

    def encode(self, x: torch.Tensor, *, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` (any float dtype/shape) -> ``(codes uint8 of x.shape, absmax fp32 [blocks])``."""
        qmap, mids, table = self._maps(x.device)
        n, bs = x.numel(), self.block_size
        nb = self.num_blocks(n)
        if resolve(backend, x) == "triton":
            xf = x.contiguous()
            codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
            absmax = torch.empty(nb, dtype=torch.float32, device=x.device)
            if nb:
                cols, rows = _tile(bs, ENCODE_ELEMS)
                extra = {"maxnreg": ENCODE_MAXNREG} if ENCODE_MAXNREG and not interpreting() else {}
                launch(_encode_kernel, (triton.cdiv(nb, rows),), xf, codes, absmax, table, n, nb,
                       BS=bs, COLS=cols, ROWS=rows, SIGNED=self.signed, num_warps=ENCODE_WARPS, **extra)
            return codes, absmax
        flat = x.reshape(-1).to(torch.float32)
        xg = torch.zeros(nb * bs, dtype=torch.float32, device=x.device)
        xg[:n] = flat
        xg = torch.where(torch.isfinite(xg), xg, 0.0).view(nb, bs)
        absmax = xg.abs().amax(1) if nb else xg.new_zeros(0)
        inv = block_inverse(absmax)
        codes = torch.searchsorted(mids, (xg * inv[:, None]).contiguous(), right=False)
        return codes.reshape(-1)[:n].to(torch.uint8).view(x.shape), absmax

    def decode(self, codes: torch.Tensor, absmax: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
        """``(codes, absmax)`` -> fp32 tensor of ``codes.shape``."""
        qmap, _, table = self._maps(codes.device)
        n, bs = codes.numel(), self.block_size
        if resolve(backend, codes) == "triton":
            out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
            nb = self.num_blocks(n)
            if nb:
                cols, rows = _tile(bs)
                launch(_decode_kernel, (triton.cdiv(nb, rows),), codes.contiguous(), absmax, table,
                       out, n, BS=bs, COLS=cols, ROWS=rows, num_warps=4)
            return out
        flat = qmap[codes.reshape(-1).long()]
        blk = torch.arange(n, device=codes.device) // bs
        return (flat * absmax[blk]).view(codes.shape)


def _tile(block_size: int, elems: int = 2048) -> tuple[int, int]:
    cols = 1 << max(0, (block_size - 1).bit_length())
    return cols, max(1, elems // cols)

"""Sweep kernel variants and launch configurations on a GPU (exploration, not a benchmark).

    PYTHONPATH=src python3 benchmarks/tools/tune_kernels.py --out DIR [--what ops,forge]

For each variant it checks the result against the torch reference first (a variant that
is wrong on this GPU is reported, never timed as a win) and then times it with
``triton.testing.do_bench``. Effective bandwidth as in bench_ops.py: (bytes read + written)
/ median time, next to a device-to-device copy of the same input measured in the same run.
Writes ``tune_ops.json`` / ``tune_forge.json`` under ``--out`` and prints one line per case.
"""

# ruff: noqa: B023 -- closures are called inside the loop iteration that defines them
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))

import torch  # noqa: E402


def _bench(fn, rep=60):
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    return do_bench(fn, warmup=10, rep=rep)


def _recorder(rows: list, copy_gbps: float, log, rep: int = 60, note: str = "max_err"):
    """``rec(case, fn, nbytes, extra)``: time ``fn``, append and log its row (bandwidth next to
    the copy's; ``extra`` stored under ``note``); a failing variant gets an error row."""
    def rec(case, fn, nbytes, extra=None):
        try:
            ms = _bench(fn, rep=rep)
            r = {"case": case, "ms": ms, "gbps": nbytes / ms / 1e6, "frac_copy": nbytes / ms / 1e6 / copy_gbps,
                 note: extra}
        except Exception as e:  # noqa: BLE001
            r = {"case": case, "error": f"{type(e).__name__}: {e}"[:300]}
        rows.append(r)
        log(json.dumps(r))
    return rec


def tune_ops(mib: int, log) -> list[dict]:
    import importlib

    from leantrain import ops

    H = importlib.import_module("leantrain.ops.hadamard")  # the package attribute is the function
    R = importlib.import_module("leantrain.ops.reduce")

    n = mib * (1 << 20) // 4
    x = torch.randn(n, device="cuda")
    xb = x.to(torch.bfloat16)
    y = torch.empty_like(x)
    copy_ms = _bench(lambda: y.copy_(x))
    copy_gbps = 8 * n / copy_ms / 1e6
    rows = [{"case": "copy", "ms": copy_ms, "gbps": copy_gbps, "frac_copy": 1.0}]
    log(f"copy {mib} MiB: {copy_ms:.4f} ms {copy_gbps:.0f} GB/s")

    rec = _recorder(rows, copy_gbps, log)

    # state8 encode / decode (one-gather encode)
    codec = ops.StateCodec8(signed=True)
    xs = x[: 1 << 22]
    c_t, a_t = codec.encode(xs, backend="triton")
    c_r, a_r = codec.encode(xs, backend="torch")
    err = float((c_t.int() - c_r.int()).abs().max())
    S8 = importlib.import_module("leantrain.ops.state8")
    for elems in (2048, 4096, 8192):
        for w in (4, 8):
            S8.ENCODE_ELEMS, S8.ENCODE_WARPS = elems, w
            rec(f"state8 encode elems={elems} warps={w}", lambda: codec.encode(x, backend="triton"),
                5 * n + 4 * n // 256, err)
    S8.ENCODE_ELEMS, S8.ENCODE_WARPS = 4096, 8
    for bits in (4, 8):
        rec(f"quantize int{bits} g128 SR bf16 (AGoQ)",
            lambda bits=bits: ops.quantize(xb, bits=bits, stochastic=True, seed=1, backend="triton"),
            2 * n + n * bits // 8 + 4 * n // 128)
    # Hadamard methods
    xs = x[: 1 << 22]
    for meth in ("ieee", "bf16x3", "butterfly"):
        H.FP32_METHOD = meth
        for b in (32, 256):
            try:
                e = float((ops.hadamard(xs, block=b, backend="triton") - ops.hadamard(xs, block=b, backend="torch")).abs().max())
            except Exception as ex:  # noqa: BLE001
                e = f"{type(ex).__name__}: {ex}"[:200]
            rec(f"hadamard b{b} fp32 {meth}", lambda b=b: ops.hadamard(x, block=b, backend="triton"), 8 * n, e)
        for bits, sr in ((8, False), (4, True)):
            try:
                q = ops.hadamard_quantize(xs, block=32, bits=bits, stochastic=sr, backend="triton")
                r = ops.hadamard_quantize(xs, block=32, bits=bits, stochastic=sr, backend="torch")
                dq, dr = ops.dequantize(q), ops.dequantize(r)
                step = r.scale.repeat_interleave(128)[: dr.numel()].view(dr.shape)
                e = {"max_steps": float(((dq - dr).abs() / step.clamp_min(1e-30)).max()),
                     "frac_diff": float(((dq - dr).abs() > 1e-5 * dr.abs().max()).float().mean()),
                     "scale_rel": float(((q.scale - r.scale).abs() / r.scale.abs().clamp_min(1e-30)).max())}
            except Exception as ex:  # noqa: BLE001
                e = f"{type(ex).__name__}: {ex}"[:200]
            for elems, w in ((0, 8), (0, 4), (8192, 8), (2048, 4)):
                H.HQ_ELEMS, H.HQ_WARPS = elems, w
                rec(f"hadamard_quantize b32 int{bits}{' SR' if sr else ''} g128 fp32 {meth} elems={elems} warps={w}",
                    lambda bits=bits, sr=sr: ops.hadamard_quantize(x, block=32, bits=bits, stochastic=sr,
                                                                   backend="triton"),
                    4 * n + n * bits // 8 + 4 * n // 128, e)
            H.HQ_ELEMS, H.HQ_WARPS = 0, 8
    H.FP32_METHOD = "ieee"
    for meth in ("tf32", "butterfly"):
        H.HALF_METHOD = meth
        xbs = xb[: 1 << 22]
        e = float((ops.hadamard(xbs, block=32, backend="triton").float() - ops.hadamard(xbs, block=32, backend="torch").float()).abs().max())
        rec(f"hadamard b32 bf16 {meth}", lambda: ops.hadamard(xb, block=32, backend="triton"), 4 * n, e)
        rec(f"hadamard_quantize b32 int8 g128 bf16 {meth}",
            lambda: ops.hadamard_quantize(xb, block=32, bits=8, backend="triton"), 2 * n + n + 4 * n // 128)
    H.HALF_METHOD = "tf32"
    # dequant-sum-requant tiles
    k = 8
    m = n // k
    qk = ops.QTensor.stack([ops.quantize(x[i * m:(i + 1) * m], bits=8, backend="triton") for i in range(k)])
    nb = k * m + 4 * k * m // 128 + m // 2 + 4 * m // 128
    for elems in (2048, 4096, 8192):
        for w in (2, 4):
            R.TILE_ELEMS, R.NUM_WARPS = elems, w
            rec(f"dsr k=8 int8->int4 SR elems={elems} warps={w}",
                lambda: ops.dequant_sum_requant(qk, bits_out=4, stochastic=True, backend="triton"), nb)
    R.TILE_ELEMS, R.NUM_WARPS = 4096, 4
    return rows


def _fast_inputs(log) -> dict:
    """The inputs the ``fast`` tuners share: 256 MiB of bf16 (and 256 MiB of fp32), a copy of it
    timed for the bandwidth reference, ten bf16 tensors of a 1b layer's save sizes at 4 and 8
    bits, and a tensor with NaN, -inf and a denormal-range group (the general branch)."""
    n = 128 << 20  # 256 MiB of bf16
    xb = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    yb = torch.empty_like(xb)
    copy_ms = _bench(lambda: yb.copy_(xb))
    copy_gbps = 4 * n / copy_ms / 1e6
    log(f"copy: {copy_ms:.4f} ms {copy_gbps:.0f} GB/s")
    n_small, n_big = 8192 * 2048, 8192 * 5632
    xs = [torch.randn(m, device="cuda", dtype=torch.bfloat16) for m in [n_small] * 6 + [n_big] * 4]
    widths = [4, 8, 4, 4, 4, 8, 4, 4, 4, 8]
    bad = torch.randn(1 << 20, device="cuda", dtype=torch.bfloat16)
    bad[77777], bad[5000], bad[9000:9128] = float("nan"), float("-inf"), 1e-39
    return dict(n=n, xb=xb, x32=torch.randn(64 << 20, device="cuda"), copy_gbps=copy_gbps,
                rows=[{"case": "copy bf16 256 MiB", "ms": copy_ms, "gbps": copy_gbps}], xs=xs, widths=widths,
                nb_many=sum(m.numel() * (2 + b / 8) + 4 * m.numel() / 128 for m, b in zip(xs, widths)),
                seeds=list(range(len(xs))), bad=bad)


def tune_fast(log) -> list[dict]:
    """The GPU-only instruction choices (``quant.FAST`` bits) and the tiles per program of the
    multi-tensor kernels (``multi.Q_TILE[2]`` / ``DQ_TILE[2]``), each variant's codes and
    values checked equal to the portable path's (FAST=0) before it is timed."""
    import importlib

    from leantrain import ops

    Q = importlib.import_module("leantrain.ops.quant")
    T = importlib.import_module("leantrain.ops.tiles")
    M = importlib.import_module("leantrain.ops.multi")
    d = _fast_inputs(log)
    n, xb, x32, xs, widths, nb_many, seeds, rows = (d[k] for k in ("n", "xb", "x32", "xs", "widths", "nb_many",
                                                                   "seeds", "rows"))
    rec = _recorder(rows, d["copy_gbps"], log, rep=40, note="same_as_portable")

    def outputs():
        q4 = ops.quantize(xb[: 1 << 22], bits=4, stochastic=True, seed=3)
        q8 = ops.quantize(x32[: 1 << 22], bits=8, symmetric=False, stochastic=True, seed=3)
        h4 = ops.hadamard_quantize(x32[: 1 << 22], block=32, bits=4, stochastic=True, seed=3)
        qs = M.quantize_many(xs[:3], bits=[4, 8, 4], stochastic=True, seeds=[1, 2, 3])
        return [q4.data, q4.scale, ops.dequantize(q4), q8.data, q8.scale, q8.zero, ops.dequantize(q8),
                h4.data, h4.scale, *[q.data for q in qs], *M.dequantize_many(qs)]

    defaults = T.FAST, Q.WORD_PAIRS, M.Q_TILE, M.DQ_TILE, T.TILE_ELEMS, Q.QUANT_WARPS
    T.FAST, Q.WORD_PAIRS = 0, False
    ref = outputs()
    for fast, words in ((0, False), (7, False), (7, True)):
        T.FAST, Q.WORD_PAIRS = fast, words
        tag = f"FAST={fast} WORDS={int(words)}"
        same = all(torch.equal(a, b) for a, b in zip(outputs(), ref))
        q4 = ops.quantize(xb, bits=4, stochastic=True, seed=1)
        rec(f"{tag} quantize int4 g128 SR bf16", lambda: ops.quantize(xb, bits=4, stochastic=True, seed=1),
            2.5 * n + n / 32, same)
        rec(f"{tag} dequantize int4 g128 -> bf16", lambda: ops.dequantize(q4), 2.5 * n + n / 32, same)
        if not words:
            rec(f"{tag} quantize int8 g128 SR bf16", lambda: ops.quantize(xb, bits=8, stochastic=True, seed=1),
                3 * n + n / 32, same)
            rec(f"{tag} hadamard_quantize b32 int4 SR g128 fp32",
                lambda: ops.hadamard_quantize(x32, block=32, bits=4, stochastic=True),
                x32.numel() * (4.5 + 1 / 32), same)
    for elems in (2048, 4096, 8192):
        for w in (4, 8, 16):
            T.TILE_ELEMS, Q.QUANT_WARPS = elems, w
            same = all(torch.equal(a, b) for a, b in zip(outputs(), ref))
            rec(f"FAST=7 WORDS=1 quantize int4 g128 SR bf16 elems={elems} warps={w}",
                lambda: ops.quantize(xb, bits=4, stochastic=True, seed=1), 2.5 * n + n / 32, same)
    T.TILE_ELEMS, Q.QUANT_WARPS = defaults[4:]
    for qt, dt in (((2048, 4, 1), (2048, 4, 2)), ((2048, 4, 2), (2048, 4, 4)), ((4096, 8, 2), (2048, 4, 8)),
                   ((2048, 8, 2), (4096, 8, 4)), ((4096, 4, 1), (4096, 4, 2))):
        M.Q_TILE, M.DQ_TILE = qt, dt
        same = all(torch.equal(a, b) for a, b in zip(outputs(), ref))
        qs = M.quantize_many(xs, bits=widths, stochastic=True, seeds=seeds)
        rec(f"FAST=7 WORDS=1 quantize_many 10 tensors int4/8 SR bf16 tile={qt}",
            lambda: M.quantize_many(xs, bits=widths, stochastic=True, seeds=seeds), nb_many, same)
        rec(f"FAST=7 dequantize_many 10 tensors -> bf16 tile={dt}", lambda: M.dequantize_many(qs), nb_many, same)
    T.FAST, Q.WORD_PAIRS, M.Q_TILE, M.DQ_TILE, T.TILE_ELEMS, Q.QUANT_WARPS = defaults
    H = importlib.import_module("leantrain.ops.hadamard")
    hdef = H.HQ_ELEMS, H.HQ_WARPS
    for pairs in (True, False):
        Q.PAIR_SR = pairs
        for elems, w in ((0, 4), (8192, 8), (16384, 8), (16384, 16)):
            H.HQ_ELEMS, H.HQ_WARPS = elems, w
            same = all(torch.equal(a, b) for a, b in zip(outputs(), ref))
            rec(f"FAST={T.FAST} PAIRS={int(pairs)} hadamard_quantize b32 int4 SR g128 fp32 elems={elems} warps={w}",
                lambda: ops.hadamard_quantize(x32, block=32, bits=4, stochastic=True), x32.numel() * (4.5 + 1 / 32),
                same)
    Q.PAIR_SR = True
    H.HQ_ELEMS, H.HQ_WARPS = hdef
    return rows


def tune_fast2(log) -> list[dict]:
    """``quant.FAST`` bits 8 (uniforms by integer multiply-adds) and 16 (the
    clean-tile branch), the word path's tile (``quant.WORD_TILE``), the multi-tensor quantize
    tile and the fused Hadamard tile; each variant's outputs checked equal to the portable
    path's (FAST=0) before it is timed."""
    import importlib

    from leantrain import ops

    Q = importlib.import_module("leantrain.ops.quant")
    T = importlib.import_module("leantrain.ops.tiles")
    M = importlib.import_module("leantrain.ops.multi")
    H = importlib.import_module("leantrain.ops.hadamard")
    d = _fast_inputs(log)
    n, xb, x32, xs, widths, nb_many, seeds, rows, bad = (
        d[k] for k in ("n", "xb", "x32", "xs", "widths", "nb_many", "seeds", "rows", "bad"))
    rec = _recorder(rows, d["copy_gbps"], log, rep=40, note="same_as_portable")

    def outputs():
        out = []
        for x in (xb[: 1 << 22], bad, x32[: 1 << 22]):
            for bits in (4, 8):
                q = ops.quantize(x, bits=bits, stochastic=True, seed=3)
                out += [q.data, q.scale, ops.dequantize(q)]
        q8 = ops.quantize(x32[: 1 << 22], bits=8, symmetric=False, stochastic=True, seed=3)
        h4 = ops.hadamard_quantize(x32[: 1 << 22], block=32, bits=4, stochastic=True, seed=3)
        qs = M.quantize_many([*xs[:3], bad], bits=[4, 8, 4, 4], stochastic=True, seeds=[1, 2, 3, 4])
        return [*out, q8.data, q8.scale, q8.zero, h4.data, h4.scale, *[q.data for q in qs],
                *M.dequantize_many(qs)]

    def same():
        return all(torch.equal(a, b) for a, b in zip(outputs(), ref, strict=True))

    defaults = T.FAST, Q.WORD_TILE, M.Q_TILE, H.HQ_ELEMS, H.HQ_WARPS
    T.FAST = 0
    ref = outputs()
    nq4, nq8, nh = 2.5 * n + n / 32, 3 * n + n / 32, x32.numel() * (4.5 + 1 / 32)
    for fast in (7, 15, 23, 31):
        T.FAST = fast
        ok = same()
        q4 = ops.quantize(xb, bits=4, stochastic=True, seed=1)
        rec(f"FAST={fast} quantize int4 g128 SR bf16", lambda: ops.quantize(xb, bits=4, stochastic=True, seed=1),
            nq4, ok)
        rec(f"FAST={fast} quantize int8 g128 SR bf16", lambda: ops.quantize(xb, bits=8, stochastic=True, seed=1),
            nq8, ok)
        rec(f"FAST={fast} dequantize int4 g128 -> bf16", lambda: ops.dequantize(q4), nq4, ok)
        rec(f"FAST={fast} hadamard_quantize b32 int4 SR g128 fp32",
            lambda: ops.hadamard_quantize(x32, block=32, bits=4, stochastic=True), nh, ok)
        rec(f"FAST={fast} quantize_many 10 tensors int4/8 SR bf16",
            lambda: M.quantize_many(xs, bits=widths, stochastic=True, seeds=seeds), nb_many, ok)
    T.FAST = defaults[0]
    for tile in ((4096, 8), (4096, 4), (8192, 8), (8192, 4), (2048, 2), (2048, 4), (16384, 8)):
        Q.WORD_TILE = tile
        rec(f"FAST={T.FAST} quantize int4 g128 SR bf16 word tile={tile}",
            lambda: ops.quantize(xb, bits=4, stochastic=True, seed=1), nq4, same())
    Q.WORD_TILE = defaults[1]
    for qt in ((2048, 4, 2), (4096, 4, 1), (4096, 4, 2), (2048, 2, 2), (4096, 8, 2), (8192, 8, 1), (2048, 2, 4)):
        M.Q_TILE = qt
        rec(f"FAST={T.FAST} quantize_many 10 tensors int4/8 SR bf16 tile={qt}",
            lambda: M.quantize_many(xs, bits=widths, stochastic=True, seeds=seeds), nb_many, same())
    M.Q_TILE = defaults[2]
    for elems, w in ((0, 4), (8192, 4), (8192, 8), (16384, 8), (4096, 2)):
        H.HQ_ELEMS, H.HQ_WARPS = elems, w
        rec(f"FAST={T.FAST} hadamard_quantize b32 int4 SR g128 fp32 elems={elems} warps={w}",
            lambda: ops.hadamard_quantize(x32, block=32, bits=4, stochastic=True), nh, same())
    T.FAST, Q.WORD_TILE, M.Q_TILE, H.HQ_ELEMS, H.HQ_WARPS = defaults
    return rows


def tune_multi(log) -> list[dict]:
    """the multi-tensor quantize with every size hinted divisible by 16 (vector
    loads), with and without the clean-tile branch (``multi.FAST_MASK``), over tiles
    (``multi.Q_TILE``); outputs checked equal to the portable path's before timing."""
    import importlib

    from leantrain import ops

    T = importlib.import_module("leantrain.ops.tiles")
    M = importlib.import_module("leantrain.ops.multi")
    d = _fast_inputs(log)
    xb, xs, widths, nb_many, seeds, rows, bad = (d[k] for k in ("xb", "xs", "widths", "nb_many", "seeds", "rows",
                                                                "bad"))
    nb4 = sum(m.numel() * 2.5 + 4 * m.numel() / 128 for m in xs)
    rec = _recorder(rows, d["copy_gbps"], log, rep=40, note="same_as_portable")

    def outputs():
        qs = M.quantize_many([*xs[:3], bad], bits=[4, 8, 4, 4], stochastic=True, seeds=[1, 2, 3, 4])
        q32 = M.quantize_many([xs[0].float(), xs[1]], bits=[4, 8], stochastic=True, seeds=[1, 2])
        return [t for q in [*qs, *q32] for t in (q.data, q.scale)]

    defaults = T.FAST, M.Q_TILE, M.FAST_MASK
    T.FAST = 0
    ref = outputs()
    T.FAST = defaults[0]
    for mask in (~16, ~0):
        M.FAST_MASK = mask
        for qt in ((2048, 4, 2), (4096, 4, 1), (4096, 4, 2), (2048, 2, 2), (4096, 8, 1), (2048, 2, 1), (8192, 8, 1)):
            M.Q_TILE = qt
            tag = f"FAST={T.FAST & mask} tile={qt}"
            ok = all(torch.equal(a, b) for a, b in zip(outputs(), ref, strict=True))
            rec(f"{tag} quantize_many 10 tensors int4/8 SR bf16",
                lambda: M.quantize_many(xs, bits=widths, stochastic=True, seeds=seeds), nb_many, ok)
            rec(f"{tag} quantize_many 10 tensors int4 SR bf16",
                lambda: M.quantize_many(xs, bits=4, stochastic=True, seeds=seeds), nb4, ok)
    T.FAST, M.Q_TILE, M.FAST_MASK = defaults
    rec("default single quantize int4 g128 SR bf16 (reference point)",
        lambda: ops.quantize(xb, bits=4, stochastic=True, seed=1), 2.5 * xb.numel() + xb.numel() / 32, True)
    return rows


VARIANTS = False  # also sweep alignment hints / tiles of the multi-tensor kernels


def tune_agoq(log) -> list[dict]:
    """quantize_many / dequantize_many on one 1b layer's saves at B = 8 (bf16, 4 and 8 bits, SR)."""
    import importlib

    M = importlib.import_module("leantrain.ops.multi")
    n_small, n_big = 8192 * 2048, 8192 * 5632
    xs = [torch.randn(n, device="cuda", dtype=torch.bfloat16) for n in [n_small] * 6 + [n_big] * 4]
    tot = sum(x.numel() for x in xs)
    a = torch.empty(tot, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    copy_ms = _bench(lambda: b.copy_(a))
    copy_gbps = 4 * tot / copy_ms / 1e6
    rows = [{"case": "copy bf16", "ms": copy_ms, "gbps": copy_gbps}]
    log(f"agoq layer: {tot / 2**20:.0f} M elements, copy {copy_ms:.3f} ms {copy_gbps:.0f} GB/s")
    seeds = list(range(len(xs)))
    defaults = M.Q_TILE, M.DQ_TILE

    def rec(case, fn, nb):
        ms = _bench(fn, rep=40)
        r = {"case": case, "ms": ms, "gbps": nb / ms / 1e6, "frac_copy": nb / ms / 1e6 / copy_gbps}
        rows.append(r)
        log(json.dumps(r))

    from leantrain import ops
    Q = importlib.import_module("leantrain.ops.quant")
    H = importlib.import_module("leantrain.ops.hadamard")
    x32 = torch.randn(64 << 20, device="cuda")
    n32 = x32.numel()
    for pair in (True, False):
        Q.PAIR_SR = pair
        rec(f"quantize_many int4 SR bf16 pairs={pair}", lambda: M.quantize_many(xs, bits=4, stochastic=True,
                                                                               seeds=seeds), tot * 2.5 + tot / 32)
        rec(f"single quantize x10 int4 SR bf16 pairs={pair}",
            lambda: [ops.quantize(x, bits=4, stochastic=True, seed=1) for x in xs], tot * 2.5 + tot / 32)
        for w in (4, 8):
            H.HQ_WARPS = w
            rec(f"hadamard_quantize b32 int4 SR g128 fp32 256MiB pairs={pair} warps={w}",
                lambda: ops.hadamard_quantize(x32, block=32, bits=4, stochastic=True), n32 * 4.5 + n32 / 32)
        H.HQ_WARPS = 4
    Q.PAIR_SR = True
    for bits in (4, 8):
        nb = tot * (2 + bits / 8) + 4 * tot / 128
        q1 = [ops.quantize(x, bits=bits, stochastic=True, seed=1) for x in xs]
        rec(f"single quantize x10 int{bits} SR bf16", lambda: [ops.quantize(x, bits=bits, stochastic=True, seed=1)
                                                             for x in xs], nb)
        rec(f"single dequantize x10 int{bits} -> bf16", lambda: [ops.dequantize(q) for q in q1], nb)
        for elems, w in ((2048, 4), (4096, 8)) if VARIANTS else ():
                M.Q_TILE = M.DQ_TILE = (elems, w, 1)
                qs = M.quantize_many(xs, bits=bits, stochastic=True, seeds=seeds)
                tag = f"elems={elems} warps={w}"
                rec(f"quantize_many int{bits} SR bf16 {tag}",
                    lambda: M.quantize_many(xs, bits=bits, stochastic=True, seeds=seeds), nb)
                rec(f"dequantize_many int{bits} -> bf16 {tag}", lambda: M.dequantize_many(qs), nb)
    M.Q_TILE, M.DQ_TILE = defaults
    return rows


def tune_forge(log) -> list[dict]:
    from leantrain.forge.launch import MODE_FUSED, MODE_UPDATE, MODE_WRITE_DW, launch_forge
    from leantrain.ops._backend import mm_fp32

    hp = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    cfgs = [(64, 64, 64, 4, 3), (64, 128, 64, 4, 3), (128, 64, 64, 4, 3), (128, 128, 32, 8, 3),
            (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 3), (128, 256, 64, 8, 3),
            (256, 128, 64, 8, 3), (128, 128, 128, 8, 2), (64, 256, 64, 8, 3), (256, 64, 64, 8, 3)]
    # TUNE_FORGE_CFGS="bn,bk,bt,warps,stages[,maxnreg];...", TUNE_FORGE_CASES="N,K,T;...": another sweep
    cfgs = [tuple(int(v) for v in c.split(",")) for c in os.environ.get("TUNE_FORGE_CFGS", "").split(";") if c] or cfgs
    cases = [(2048, 5632), (2048, 2048), (5632, 2048), (32000, 2048)]
    cases = [(n, k, t) for n, k in cases for t in (512, 2048, 16384) if not (n == 32000 and t == 16384)]
    cases = [tuple(int(v) for v in c.split(",")) for c in os.environ.get("TUNE_FORGE_CASES", "").split(";") if c] or cases
    rows = []
    for N, K, T in cases:
        torch.manual_seed(0)
        x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(T, N, device="cuda", dtype=torch.bfloat16) * 1e-3
        w = torch.randn(N, K, device="cuda") * 0.02
        m, v = torch.zeros_like(w), torch.zeros_like(w)
        common = dict(w=w, states=[m, v], kinds=["fp32", "fp32"], rule_name="adamw", hp=hp, step=10)
        p = torch.nn.Parameter(w.clone())
        opt = torch.optim.AdamW([p], lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
        buf = torch.empty(N, K, device="cuda")

        def base():
            p.grad = torch.matmul(dy.t(), x).float()
            opt.step()
            p.grad = None

        def mm():
            torch.matmul(dy.t(), x)

        def split():
            mm_fp32(dy.t(), x, buf, allow_upcast=True)
            launch_forge(MODE_UPDATE, g=buf, **common)

        ref = torch.matmul(dy.t().float(), x.float())
        row = {"N": N, "K": K, "T": T, "torch_ms": _bench(base), "matmul_ms": _bench(mm), "split_ms": _bench(split)}
        for c in cfgs:
            tune = {"BLOCK_N": c[0], "BLOCK_K": c[1], "BLOCK_T": c[2], "GROUP_N": 8, "num_warps": c[3],
                    "num_stages": c[4]}
            if len(c) > 5:
                tune["maxnreg"] = c[5]
            name = "x".join(map(str, c))
            try:
                g = torch.zeros(N, K, device="cuda")
                launch_forge(MODE_WRITE_DW, x=x, dy=dy, w=w, g=g, tune=tune)
                err = float((g - ref).abs().max() / ref.abs().max())
                ms = _bench(lambda tune=tune: launch_forge(MODE_FUSED, x=x, dy=dy, tune=tune, **common), rep=40)
                row[name] = {"ms": ms, "rel_err": err}
            except Exception as e:  # noqa: BLE001
                row[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
        best = min((v["ms"], k) for k, v in row.items() if isinstance(v, dict) and "ms" in v)
        row["best"] = best[1]
        row["torch/best"] = row["torch_ms"] / best[0]
        row["torch/split"] = row["torch_ms"] / row["split_ms"]
        log(json.dumps(row))
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def tune_forge_paths(log) -> list[dict]:
    """Update-only tiles (the split path's second half) and low-stage fused tiles, 2048x5632."""
    from leantrain.forge.launch import MODE_FUSED, MODE_UPDATE, launch_forge
    from leantrain.ops._backend import mm_fp32

    hp = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    N, K = 2048, 5632
    w = torch.randn(N, K, device="cuda") * 0.02
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    g = torch.randn(N, K, device="cuda") * 1e-3
    common = dict(w=w, states=[m, v], kinds=["fp32", "fp32"], rule_name="adamw", hp=hp, step=10)
    rows = []
    for c in ((64, 64, 16, 4, 1), (32, 128, 16, 4, 1), (64, 128, 16, 4, 1), (128, 64, 16, 8, 1), (64, 256, 16, 8, 1),
              (32, 256, 16, 4, 1), (128, 128, 16, 8, 1), (16, 256, 16, 2, 1), (32, 64, 16, 2, 1)):
        tune = {"BLOCK_N": c[0], "BLOCK_K": c[1], "BLOCK_T": c[2], "GROUP_N": 8, "num_warps": c[3], "num_stages": c[4]}
        try:
            ms = _bench(lambda tune=tune: launch_forge(MODE_UPDATE, g=g, tune=tune, **common))
            r = {"case": "update " + "x".join(map(str, c)), "ms": ms, "tbps": N * K * 28 / ms / 1e9}
        except Exception as e:  # noqa: BLE001
            r = {"case": "update " + "x".join(map(str, c)), "error": f"{type(e).__name__}: {e}"[:200]}
        log(json.dumps(r))
        rows.append(r)
    for T in (512, 2048):
        x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(T, N, device="cuda", dtype=torch.bfloat16) * 1e-3
        buf = torch.empty(N, K, device="cuda")
        r = {"case": f"mm T={T}", "ms": _bench(lambda: mm_fp32(dy.t(), x, buf, allow_upcast=True))}
        log(json.dumps(r))
        rows.append(r)
        for c in ((64, 64, 32, 4, 1), (64, 64, 64, 4, 1), (64, 64, 32, 4, 2), (64, 64, 64, 4, 2), (64, 128, 32, 4, 2),
                  (32, 64, 64, 4, 2), (64, 64, 64, 8, 3), (64, 64, 128, 4, 2)):
            tune = {"BLOCK_N": c[0], "BLOCK_K": c[1], "BLOCK_T": c[2], "GROUP_N": 8, "num_warps": c[3],
                    "num_stages": c[4]}
            try:
                ms = _bench(lambda tune=tune: launch_forge(MODE_FUSED, x=x, dy=dy, tune=tune, **common))
                r = {"case": f"fused T={T} " + "x".join(map(str, c)), "ms": ms}
            except Exception as e:  # noqa: BLE001
                r = {"case": f"fused T={T} " + "x".join(map(str, c)), "error": f"{type(e).__name__}: {e}"[:200]}
            log(json.dumps(r))
            rows.append(r)
    return rows


def tune_forge_split(log) -> list[dict]:
    """part (a)'s comparison at the 1b shapes, T = 512 / 1024 / 2048, with fp32 W/m/v
    and with bf16 W + bf16 states: torch (bf16 matmul, fp32 copy of dW for fp32 weights, fused
    AdamW), the split path with fp32 and with bf16 dW, its two halves alone, and the fused kernel
    at a few tiles (AdamW, SR); the split path with bf16 dW also timed as a CUDA graph replay (GPU
    time only). ``TUNE_SPLIT_PRECS="fp32"``: W's dtypes; ``TUNE_SPLIT_CFGS="bn,bk,bt,warps,stages[,maxnreg];..."``
    the fused tiles ("none": no fused kernel). (A programmatic dependent
    launch of the update was no faster in the step; git history has it.)"""
    from triton.testing import do_bench_cudagraph

    from leantrain.forge.launch import MODE_FUSED, MODE_UPDATE, launch_forge
    from leantrain.ops._backend import mm_fp32

    hp = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    cfgs = [(64, 64, 64, 4, 3), (64, 64, 64, 8, 3), (64, 64, 32, 4, 4), (128, 128, 32, 8, 3), (128, 64, 64, 4, 3)]
    env_cfgs = os.environ.get("TUNE_SPLIT_CFGS", "")
    if env_cfgs:
        cfgs = [] if env_cfgs == "none" else [tuple(int(v) for v in c.split(",")) for c in env_cfgs.split(";") if c]
    rows = []
    for prec in os.environ.get("TUNE_SPLIT_PRECS", "fp32,bf16").split(","):
        for (N, K) in ((2048, 2048), (2048, 5632), (5632, 2048), (32000, 2048)):
            for T in (512, 1024, 2048):
                torch.manual_seed(0)
                x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
                dy = torch.randn(T, N, device="cuda", dtype=torch.bfloat16) * 1e-3
                wdt = torch.float32 if prec == "fp32" else torch.bfloat16
                w = (torch.randn(N, K, device="cuda") * 0.02).to(wdt)
                m, v = torch.zeros_like(w), torch.zeros_like(w)
                common = dict(w=w, states=[m, v], kinds=[prec, prec], rule_name="adamw", hp=hp, step=10, sr=True)
                p = torch.nn.Parameter(w.clone())
                opt = torch.optim.AdamW([p], lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
                buf = torch.empty(N, K, device="cuda")
                buf16 = torch.empty(N, K, device="cuda", dtype=torch.bfloat16)

                def base():
                    g = torch.matmul(dy.t(), x)
                    p.grad = g.float() if prec == "fp32" else g
                    opt.step()
                    p.grad = None

                def split():
                    mm_fp32(dy.t(), x, buf, allow_upcast=True)
                    launch_forge(MODE_UPDATE, g=buf, **common)

                def split16():
                    torch.mm(dy.t(), x, out=buf16)
                    launch_forge(MODE_UPDATE, g=buf16, **common)

                row = {"prec": prec, "N": N, "K": K, "T": T, "torch_ms": _bench(base), "split_ms": _bench(split),
                       "split_bf16dw_ms": _bench(split16), "split_bf16dw_graph_ms": do_bench_cudagraph(split16, rep=40),
                       "mm_ms": _bench(lambda: torch.mm(dy.t(), x, out=buf16)),
                       "update_ms": _bench(lambda: launch_forge(MODE_UPDATE, g=buf16, **common))}
                for c in cfgs:
                    tune = {"BLOCK_N": c[0], "BLOCK_K": c[1], "BLOCK_T": c[2], "GROUP_N": 8, "num_warps": c[3],
                            "num_stages": c[4]}
                    if len(c) > 5:  # a register cap
                        tune["maxnreg"] = c[5]
                    name = "fused " + "x".join(map(str, c))
                    try:
                        row[name] = _bench(lambda tune=tune: launch_forge(MODE_FUSED, x=x, dy=dy, tune=tune, **common),
                                           rep=40)
                    except Exception as e:  # noqa: BLE001
                        row[name] = f"{type(e).__name__}: {e}"[:160]
                row["torch/split"] = row["torch_ms"] / row["split_ms"]
                row["torch/split_bf16dw"] = row["torch_ms"] / row["split_bf16dw_ms"]
                log(json.dumps(row))
                rows.append(row)
                torch.cuda.empty_cache()
    return rows


def _set_carve(n):
    """cuBLASLt's SM count target (torch's experimental carveout: the GEMM leaves ``n`` SMs free)."""
    torch._C._set_sm_carveout_experimental(n)


def tune_forge_carve(log) -> list[dict]:
    """the split path (bf16 dW GEMM, then the update) in row chunks, each chunk's update on a
    second stream beside the next chunk's GEMM, with the GEMM told to leave SMs free (cuBLASLt's SM count
    target, torch's ``_set_sm_carveout_experimental``) so that the update has somewhere to run (the chunks
    without it were no faster: the GEMM took every SM). fp32 W / m / v, AdamW, against torch (bf16
    matmul, fp32 copy, fused AdamW) and the unchunked split path. Also: the GEMM alone under each carveout
    with cuBLAS and cuBLASLt, and (where torch has them) green contexts. Each pipelined variant is checked
    against the split path (same W / m / v bits, or the largest difference)."""
    from triton.testing import do_bench_cudagraph

    from leantrain.forge.launch import MODE_UPDATE, launch_forge

    hp = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    graphed = os.environ.get("TUNE_CARVE_GRAPH", "0") == "1"
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [tuple(int(v) for v in s.split("x")) for s in
              os.environ.get("TUNE_CARVE_SHAPES", "2048x5632,5632x2048,32000x2048,2048x2048").split(",")]
    ts = [int(v) for v in os.environ.get("TUNE_CARVE_T", "512,1024,2048").split(",")]
    chunks = [int(v) for v in os.environ.get("TUNE_CARVE_CHUNKS", "2,4,8").split(",")]
    carves = [int(v) for v in os.environ.get("TUNE_CARVE_SMS", "16,32,48").split(",")]
    libs = os.environ.get("TUNE_CARVE_LIBS", "cublaslt").split(",")
    sides = {0: torch.cuda.Stream(priority=0), -1: torch.cuda.Stream(priority=-1)}
    rows = [{"sms": nsm, "green_contexts": hasattr(torch.cuda, "green_contexts"),
             "default_blas": str(torch.backends.cuda.preferred_blas_library())}]
    log(json.dumps(rows[0]))
    for (N, K) in shapes:
        for T in ts:
            torch.manual_seed(0)
            x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
            dy = torch.randn(T, N, device="cuda", dtype=torch.bfloat16) * 1e-3
            w0 = torch.randn(N, K, device="cuda") * 0.02
            m0, v0 = torch.randn_like(w0) * 1e-4, torch.rand_like(w0) * 1e-8
            w, m, v = w0.clone(), m0.clone(), v0.clone()
            g16 = torch.empty(N, K, device="cuda", dtype=torch.bfloat16)
            p = torch.nn.Parameter(w0.clone())
            opt = torch.optim.AdamW([p], lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)

            def base():
                p.grad = torch.matmul(dy.t(), x).float()
                opt.step()
                p.grad = None

            def upd(r0, r1, ww, mm_, vv):
                launch_forge(MODE_UPDATE, g=g16[r0:r1], w=ww[r0:r1], states=[mm_[r0:r1], vv[r0:r1]],
                             kinds=["fp32", "fp32"], rule_name="adamw", hp=hp, step=10)

            def split(ww=w, mm_=m, vv=v):
                torch.mm(dy.t(), x, out=g16)
                upd(0, N, ww, mm_, vv)

            def piped(nch, carve, prio, first_full=True, ww=w, mm_=m, vv=v):
                main, side = torch.cuda.current_stream(), sides[prio]
                per = -(-N // nch)
                per = -(-per // 64) * 64  # whole update tiles a chunk
                side.wait_stream(main)
                for i, r0 in enumerate(range(0, N, per)):
                    r1 = min(N, r0 + per)
                    _set_carve(None if (i == 0 and first_full) else carve)
                    torch.mm(dy[:, r0:r1].t(), x, out=g16[r0:r1])
                    side.wait_stream(main)
                    with torch.cuda.stream(side):
                        upd(r0, r1, ww, mm_, vv)
                _set_carve(None)
                main.wait_stream(side)

            row = {"N": N, "K": K, "T": T}
            prev = torch.backends.cuda.preferred_blas_library()
            try:
                row["torch_ms"] = _bench(base)
                row["split_ms"] = _bench(split)
                if graphed:  # GPU time: every variant as a CUDA graph replay (torch's AdamW capturable)
                    pg = torch.nn.Parameter(w0.clone())
                    pg.grad = torch.zeros_like(pg)
                    optg = torch.optim.AdamW([pg], lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                             fused=True, capturable=True)

                    def base_g():
                        pg.grad.copy_(torch.matmul(dy.t(), x))
                        optg.step()

                    base_g()
                    row["torch_graph_ms"] = do_bench_cudagraph(base_g, rep=40)
                    row["split_graph_ms"] = do_bench_cudagraph(split, rep=40)
                    torch.backends.cuda.preferred_blas_library(libs[0])
                    for nch in chunks:
                        for carve in carves:
                            for prio in (0, -1):
                                piped(nch, carve, prio)
                                row[f"gpipe_n{nch}_c{carve}_p{prio}"] = {
                                    "ms": do_bench_cudagraph(lambda: piped(nch, carve, prio), rep=40)}
                    torch.backends.cuda.preferred_blas_library(prev)
                    for lib in ("cublas", libs[0]):  # host time of one dW GEMM call (no synchronization)
                        torch.backends.cuda.preferred_blas_library(lib)
                        for c in (None, carves[0]):
                            _set_carve(c)
                            torch.cuda.synchronize()
                            t0 = time.perf_counter()
                            for _ in range(200):
                                torch.mm(dy.t(), x, out=g16)
                            row[f"host_mm_{lib}_c{c or 0}_us"] = (time.perf_counter() - t0) / 200 * 1e6
                            torch.cuda.synchronize()
                            _set_carve(None)
                    torch.backends.cuda.preferred_blas_library(prev)
                    best = min((val["ms"], k) for k, val in row.items() if k.startswith("gpipe_"))
                    row["best_gpipe"] = best[1]
                    row["torch_graph/split_graph"] = row["torch_graph_ms"] / row["split_graph_ms"]
                    row["torch_graph/best_gpipe"] = row["torch_graph_ms"] / best[0]
                    row["torch/best_gpipe"] = row["torch_ms"] / best[0]
                    log(json.dumps({k: v for k, v in row.items() if not k.startswith("gpipe_")}))
                    rows.append(row)
                    continue
                for lib in ["cublas"] + libs:
                    torch.backends.cuda.preferred_blas_library(lib)
                    for c in [None] + carves:
                        _set_carve(c)
                        row[f"mm_{lib}_c{c or 0}_ms"] = _bench(lambda: torch.mm(dy.t(), x, out=g16))
                    _set_carve(None)
                # the reference update (one step from the same start) for the bit checks
                ref = [w0.clone(), m0.clone(), v0.clone()]
                torch.backends.cuda.preferred_blas_library(prev)
                split(*ref)
                for lib in libs:
                    torch.backends.cuda.preferred_blas_library(lib)
                    for nch in chunks:
                        for carve in carves:
                            for prio in (0, -1):
                                got = [w0.clone(), m0.clone(), v0.clone()]
                                piped(nch, carve, prio, True, *got)
                                torch.cuda.synchronize()
                                same = all(torch.equal(a, b) for a, b in zip(got, ref))
                                diff = float((got[0] - ref[0]).abs().max())
                                ms = _bench(lambda: piped(nch, carve, prio))
                                row[f"pipe_{lib}_n{nch}_c{carve}_p{prio}"] = {"ms": ms, "same": same,
                                                                              "w_maxdiff": diff}
                best = min((val["ms"], k) for k, val in row.items() if k.startswith("pipe_"))
                row["best_pipe"] = best[1]
                row["torch/split"] = row["torch_ms"] / row["split_ms"]
                row["torch/best_pipe"] = row["torch_ms"] / best[0]
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            finally:
                _set_carve(None)
                torch.backends.cuda.preferred_blas_library(prev)
            log(json.dumps({k: v for k, v in row.items() if not k.startswith("pipe_")}))
            rows.append(row)
            torch.cuda.empty_cache()
    return rows


# the 1b preset's fused layers (N, K, count): q / o, k / v, gate / up, down, the LM head
SHAPES_1B = ((2048, 2048, 44), (256, 2048, 44), (5632, 2048, 44), (2048, 5632, 22), (32000, 2048, 1))


def tune_forge_group(log) -> list[dict]:
    """what one update launch a layer costs in a graphed step. The update-only kernel
    on the 1b preset's 155 fused layers (bf16 W + SR, bf16 states, bf16 dW, AdamW, the device
    scalar table and the in-kernel sum, as the graphed step runs it), replayed as one CUDA graph
    (GPU time only): one launch a layer, as FORGE does (155); one a block for its six K = 2048
    layers (q, k, v, o, gate, up stacked as one [15872, 2048] tensor) and one for its down
    projection (45 with the head); and every block's K = 2048 layers as one tensor, every down
    projection as another (3). The same bytes each way (the per-layer launches update row slices
    of the stacked tensors): the difference is what the launches cost. (A grouped kernel, one launch
    for several layers through a table of their addresses, was slower and is not kept.)"""
    import numpy as np
    from triton.testing import do_bench_cudagraph

    from leantrain.forge.launch import MODE_UPDATE, dyn_row, launch_forge

    hp = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    row_np = dyn_row("adamw", hp, 10)
    row_np[12] = np.int32(12345).view(np.float32)
    dyn = torch.tensor(np.stack([row_np]), device="cuda")
    sq = torch.zeros((), device="cuda")
    ticket = torch.zeros((), dtype=torch.int32, device="cuda")
    blocks, widths = 22, (2048, 256, 256, 2048, 5632, 5632)  # q, k, v, o, gate, up: their rows (K = 2048)
    torch.manual_seed(0)

    def alloc(n, k):  # W, m, v, dW
        return ((torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16),
                (torch.randn(n, k, device="cuda") * 1e-3).to(torch.bfloat16),
                (torch.rand(n, k, device="cuda") * 1e-6).to(torch.bfloat16),
                (torch.randn(n, k, device="cuda") * 1e-3).to(torch.bfloat16))

    def rows(t, r0, r1):
        return tuple(x[r0:r1] for x in t)

    per = sum(widths)
    big, down, head = alloc(blocks * per, 2048), alloc(blocks * 2048, 5632), alloc(32000, 2048)
    layers, grouped = [], []
    for b in range(blocks):
        off = b * per
        for n in widths:
            layers.append(rows(big, off, off + n))
            off += n
        layers.append(rows(down, b * 2048, (b + 1) * 2048))
        grouped += [rows(big, b * per, (b + 1) * per), rows(down, b * 2048, (b + 1) * 2048)]
    variants = (("one launch a layer", layers + [head]), ("one a block (+ its down)", grouped + [head]),
                ("three in all", [big, down, head]))

    def launch(t):
        launch_forge(MODE_UPDATE, g=t[3], w=t[0], states=[t[1], t[2]], kinds=["bf16", "bf16"], rule_name="adamw",
                     hp=hp, step=10, sr=True, dyn=(dyn, 0), sq=sq, ticket=ticket)

    out = []
    for name, ts in variants:
        def fn(ts=ts):
            for t in ts:
                launch(t)
        fn()
        torch.cuda.synchronize()
        row = {"variant": name, "launches": len(ts), "graph_ms": do_bench_cudagraph(fn, rep=40),
               "params": sum(t[0].numel() for t in ts)}
        log(json.dumps(row))
        out.append(row)
    return out


def tune_forge_update16(log) -> list[dict]:
    """the update-only kernel with bf16 W + SR and bf16 states (FORGE at torch bf16's
    precisions, bf16 dW, device scalars and the in-kernel sum, as a graphed step runs it) at each
    tile, on the 1b shapes, against torch's fused AdamW on a bf16 parameter with a bf16 gradient.
    Every tile must give the same W / m / v bits (checked against the first tile)."""
    import numpy as np

    from leantrain.forge.launch import DYN_COLS, MODE_UPDATE, dyn_row, launch_forge

    hp = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    tiles = [(64, 64, 8), (64, 64, 4), (64, 128, 8), (64, 128, 4), (128, 128, 8), (128, 64, 8), (64, 256, 8),
             (32, 256, 4), (128, 256, 8), (32, 128, 4), (128, 128, 16), (256, 128, 8)]
    if os.environ.get("TUNE_UPDATE16_TILES"):  # "bn,bk,warps[,maxnreg];...": another sweep
        tiles = [tuple(int(v) for v in t.split(",")) for t in os.environ["TUNE_UPDATE16_TILES"].split(";")]
    row_np = dyn_row("adamw", hp, 10)
    row_np[12] = np.int32(12345).view(np.float32)
    dyn = torch.tensor(np.stack([row_np]), device="cuda")
    assert dyn.shape[1] == DYN_COLS
    prec = os.environ.get("TUNE_UPDATE16_PREC", "wbf16_sbf16")  # or wbf16_sfp32, wfp32_sfp32 (the gradient: bf16)
    wdt = torch.bfloat16 if prec.startswith("wbf16") else torch.float32
    skind = prec.split("_s")[1]
    sdt = torch.bfloat16 if skind == "bf16" else torch.float32
    rows = []
    for (N, K, count) in SHAPES_1B:
        torch.manual_seed(0)
        g = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 1e-3
        w0 = (torch.randn(N, K, device="cuda") * 0.02).to(wdt)
        m0 = (torch.randn(N, K, device="cuda") * 1e-3).to(sdt)
        v0 = (torch.rand(N, K, device="cuda") * 1e-6).to(sdt)
        w, m, v = w0.clone(), m0.clone(), v0.clone()
        sq = torch.zeros((), device="cuda")
        ticket = torch.zeros((), dtype=torch.int32, device="cuda")
        p = torch.nn.Parameter(w0.to(sdt))  # torch: W in the states' dtype (pure bf16, or fp32)
        opt = torch.optim.AdamW([p], lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
        p.grad = g.to(sdt)
        opt.step()

        def torch_step():
            opt.step()

        row = {"N": N, "K": K, "count": count, "torch_adamw_ms": _bench(torch_step)}
        nbytes = N * K * (2 + 2 * (w0.element_size() + 2 * m0.element_size()))  # g read, W / m / v read and written
        row["torch_tbps"] = nbytes / row["torch_adamw_ms"] / 1e9
        ref = None
        early_too = os.environ.get("TUNE_UPDATE16_EARLY", "0") != "0"  # each tile also with EARLY_LOADS
        for (bn, bk, nw, *reg), early in [(t, e) for t in tiles for e in ((False, True) if early_too else (False,))]:
            tune = {"BLOCK_N": bn, "BLOCK_K": bk, "BLOCK_T": 16, "GROUP_N": 8, "num_warps": nw, "num_stages": 1,
                    "EARLY_LOADS": early}
            name = f"{bn}x{bk}x{nw}"
            if reg:
                tune["maxnreg"] = reg[0]
                name += f"x{reg[0]}"
            if early:
                name += "e"

            def run(tune=tune):
                launch_forge(MODE_UPDATE, g=g, w=w, states=[m, v], kinds=[skind, skind], rule_name="adamw", hp=hp,
                             step=10, sr=True, tune=tune, dyn=(dyn, 0), sq=sq, ticket=ticket)
            try:
                w.copy_(w0), m.copy_(m0), v.copy_(v0)
                run()
                out = (w.clone(), m.clone(), v.clone())
                if ref is None:
                    ref = out
                same = all(torch.equal(a, b) for a, b in zip(out, ref, strict=True))
                ms = _bench(run)
                row[name] = {"ms": ms, "tbps": nbytes / ms / 1e9, "same_bits": same}
            except Exception as e:  # noqa: BLE001
                row[name] = {"error": f"{type(e).__name__}: {e}"[:160]}
        log(json.dumps(row))
        rows.append(row)
        torch.cuda.empty_cache()
    totals = {}
    for r in rows:
        for k, val in r.items():
            if isinstance(val, dict) and "ms" in val:
                totals[k] = totals.get(k, 0.0) + r["count"] * val["ms"]
    totals["torch"] = sum(r["count"] * r["torch_adamw_ms"] for r in rows)
    log(json.dumps({"prec": prec, "per_step_ms_1b_fused_layers": totals}))
    rows.append({"prec": prec, "per_step_ms_1b_fused_layers": totals})
    return rows


def tune_tiles(log) -> list[dict]:
    """(1) the state8 encode's tile / warps / register cap at 256 MiB and 2 GiB of
    fp32; (2) the multi-tensor quantize on an AGoQ-like flush (bf16 4- and 8-bit, fp32 4-bit)
    with a register cap on mixed launches and/or the word-path rows in a launch of their own;
    (3) FORGE's split path with dW in L2-sized row chunks, on one stream or with the update of
    chunk i overlapping the GEMM of chunk i+1 on a second stream. Each variant is checked
    against the default (exact codes / same weights) before it is timed."""
    import importlib

    from leantrain import ops

    S8 = importlib.import_module("leantrain.ops.state8")
    M = importlib.import_module("leantrain.ops.multi")
    rows: list[dict] = []
    # (1) state8 encode
    codec = ops.StateCodec8(signed=True)
    for mib in (256, 2048):
        n = mib * (1 << 20) // 4
        x = torch.randn(n, device="cuda")
        y = torch.empty_like(x)
        copy_ms = _bench(lambda: y.copy_(x))
        copy_gbps = 8 * n / copy_ms / 1e6
        log(f"copy fp32 {mib} MiB: {copy_ms:.4f} ms {copy_gbps:.0f} GB/s")
        rows.append({"case": f"copy fp32 {mib} MiB", "ms": copy_ms, "gbps": copy_gbps})
        rec = _recorder(rows, copy_gbps, log, rep=40, note="exact")
        xs = x[: 1 << 22]
        c_r, a_r = codec.encode(xs, backend="torch")
        for elems, w, mr in ((4096, 4, 0), (2048, 4, 0), (4096, 8, 0), (8192, 8, 0), (2048, 2, 0), (4096, 4, 80),
                             (8192, 16, 0), (1024, 2, 0)):
            S8.ENCODE_ELEMS, S8.ENCODE_WARPS, S8.ENCODE_MAXNREG = elems, w, mr
            c_t, a_t = codec.encode(xs, backend="triton")
            ok = bool(torch.equal(c_t, c_r) and torch.equal(a_t, a_r))
            rec(f"state8 encode {mib} MiB elems={elems} warps={w} maxnreg={mr}",
                lambda: codec.encode(x, backend="triton"), 5 * n + 4 * n // 256, ok)
        S8.ENCODE_ELEMS, S8.ENCODE_WARPS, S8.ENCODE_MAXNREG = 4096, 4, 0
        torch.cuda.empty_cache()
    # (2) multi-tensor quantize, an AGoQ-like flush
    n_small, n_big = 8192 * 2048, 8192 * 5632
    xs = [torch.randn(m, device="cuda", dtype=torch.bfloat16) for m in [n_small] * 6 + [n_big] * 4]
    xs += [torch.randn(n_small, device="cuda") for _ in range(2)]
    widths = [4, 8, 4, 4, 8, 8, 4, 4, 4, 8, 4, 4]
    seeds = list(range(len(xs)))
    nb = sum(t.numel() * (t.element_size() + b / 8) + 4 * t.numel() / 128 for t, b in zip(xs, widths))
    tot = sum(t.numel() * t.element_size() for t in xs) // 2
    a = torch.empty(tot, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    copy_ms = _bench(lambda: b.copy_(a))
    copy_gbps = 4 * tot / copy_ms / 1e6
    rows.append({"case": "copy (flush bytes)", "ms": copy_ms, "gbps": copy_gbps})
    rec = _recorder(rows, copy_gbps, log, rep=40, note="same_as_default")
    ref = [t for q in M.quantize_many(xs, bits=widths, stochastic=True, seeds=seeds) for t in (q.data, q.scale)]
    rec("quantize_many AGoQ-like flush (12 tensors, bf16 4/8-bit, fp32 4-bit)",
        lambda: M.quantize_many(xs, bits=widths, stochastic=True, seeds=seeds), nb, True)
    del ref
    torch.cuda.empty_cache()
    # (3) FORGE split path in L2-sized row chunks
    from leantrain.forge.launch import MODE_UPDATE, launch_forge
    from leantrain.ops._backend import mm_fp32

    hp = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    side = torch.cuda.Stream()
    for (N, K) in ((2048, 5632), (5632, 2048), (32000, 2048)):
        for T in (512, 2048):
            torch.manual_seed(0)
            x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
            dy = torch.randn(T, N, device="cuda", dtype=torch.bfloat16) * 1e-3
            w0 = torch.randn(N, K, device="cuda") * 0.02
            st = [torch.zeros_like(w0), torch.zeros_like(w0)]
            buf = torch.empty(N, K, device="cuda")
            p = torch.nn.Parameter(w0.clone())
            opt = torch.optim.AdamW([p], lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)

            def base():
                p.grad = torch.matmul(dy.t(), x).float()
                opt.step()
                p.grad = None

            def split(w, m, v):
                mm_fp32(dy.t(), x, buf, allow_upcast=True)
                launch_forge(MODE_UPDATE, g=buf, w=w, states=[m, v], kinds=["fp32", "fp32"], rule_name="adamw",
                             hp=hp, step=10)

            def chunked(w, m, v, rows_per, two):
                cb = [torch.empty(rows_per, K, device="cuda") for _ in range(2)]
                ev_mm = [torch.cuda.Event() for _ in range(2)]
                ev_up = [torch.cuda.Event() for _ in range(2)]
                main = torch.cuda.current_stream()

                def run():
                    for i, r0 in enumerate(range(0, N, rows_per)):
                        r1 = min(N, r0 + rows_per)
                        j = i % 2
                        g = cb[j][: r1 - r0]
                        if two and i >= 2:
                            main.wait_event(ev_up[j])
                        mm_fp32(dy[:, r0:r1].t(), x, g, allow_upcast=True)
                        s = side if two else main
                        if two:
                            ev_mm[j].record(main)
                            s.wait_event(ev_mm[j])
                        with torch.cuda.stream(s):
                            launch_forge(MODE_UPDATE, g=g, w=w[r0:r1], states=[m[r0:r1], v[r0:r1]],
                                         kinds=["fp32", "fp32"], rule_name="adamw", hp=hp, step=10)
                        if two:
                            ev_up[j].record(s)
                    if two:
                        main.wait_stream(side)
                return run

            row = {"N": N, "K": K, "T": T, "torch_ms": _bench(base)}
            try:
                _chunk_rows(row, split, chunked, w0, st)
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            log(json.dumps(row))
            rows.append(row)
            torch.cuda.empty_cache()
    return rows


def tune_host(log) -> list[dict]:
    """host time of one quantize_many / dequantize_many call on the GPU machine (10
    tensors of 64K bf16 elements: the kernels are short, the host is what is timed), with the
    launch table copied from pageable or page-locked memory, and of the bare table copies.
    Host time = wall time of 200 back-to-back calls without a synchronization, per call."""
    import importlib

    M = importlib.import_module("leantrain.ops.multi")
    rows: list[dict] = []
    xs = [torch.randn(1 << 16, device="cuda", dtype=torch.bfloat16) for _ in range(10)]
    seeds = list(range(10))

    def host_us(fn, n=200):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(n):
                fn()
            best = min(best, (time.perf_counter() - t) / n)
            torch.cuda.synchronize()
        return best * 1e6

    from array import array
    flat = array("q", range(128))
    pageable_table = M.launch_table

    def pinned_table(rows_, progs, device):  # the page-locked variant (multi.py keeps pageable)
        tab, s = pageable_table(rows_, progs, torch.device("cpu"))
        return torch.empty_like(tab, pin_memory=True).copy_(tab).to(device, non_blocking=True), s

    for pinned in (False, True):
        M.launch_table = pinned_table if pinned else pageable_table
        qs = M.quantize_many(xs, bits=4, stochastic=True, seeds=seeds)
        for name, fn in (("quantize_many 10 x 64K bf16 int4", lambda: M.quantize_many(xs, bits=4, stochastic=True,
                                                                                        seeds=seeds)),
                         ("dequantize_many 10", lambda: M.dequantize_many(qs))):
            r = {"case": f"{name} pinned_table={pinned}", "host_us": host_us(fn)}
            rows.append(r)
            log(json.dumps(r))
    M.launch_table = pageable_table
    h = torch.frombuffer(flat, dtype=torch.int64)
    for name, fn in (("table copy, pageable", lambda: h.to("cuda", non_blocking=True)),
                     ("table copy, pinned (alloc + fill + copy)",
                      lambda: torch.empty(128, dtype=torch.int64, pin_memory=True).copy_(h).to("cuda", non_blocking=True)),
                     ("torch.empty cuda x3", lambda: [torch.empty(1 << 16, device="cuda", dtype=torch.uint8)
                                                      for _ in range(3)])):
        r = {"case": name, "host_us": host_us(fn)}
        rows.append(r)
        log(json.dumps(r))
    # does the table copy wait for the stream? time it on the host behind ~2 ms of queued GPU work
    for name, fn in (("table copy, pageable, GPU busy", lambda: h.to("cuda", non_blocking=True)),
                     ("table copy, pinned, GPU busy",
                      lambda: torch.empty(128, dtype=torch.int64, pin_memory=True).copy_(h).to("cuda", non_blocking=True))):
        ts = []
        for _ in range(5):
            torch.cuda.synchronize()
            torch.cuda._sleep(4_000_000)  # ~2 ms at the H200's clock
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e6)
        torch.cuda.synchronize()
        r = {"case": name, "host_us_each": ts}
        rows.append(r)
        log(json.dumps(r))
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            M.quantize_many(xs, bits=4, stochastic=True, seeds=seeds)
        torch.cuda.synchronize()
    log(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    return rows


def _capture_flushes(name: str = "1b", batch: int = 8, seq: int = 1024, device: str = "cuda") -> tuple[list, list]:
    """The preset's AGoQ flushes at (batch, seq), bf16: for each quantize_flat call of one
    forward, [(numel, dtype, bits)]; for each dequantize_flat call of its backward, the same of
    its members."""
    import importlib

    from leantrain.agoq import Policy, apply
    from leantrain.config import preset
    from leantrain.model import Llama

    P = importlib.import_module("leantrain.agoq.pack")
    cfg = preset(name)
    cfg.model.vocab_size = cfg.data.tokenizer_vocab
    torch.manual_seed(0)
    with torch.device(device):
        m = Llama(cfg.model)
    m = m.to(torch.bfloat16)
    apply(m, Policy())
    idx = torch.randint(0, cfg.model.vocab_size, (batch, seq), device=device)
    qcalls, dcalls = [], []
    real_q, real_d = P.quantize_flat, P.dequantize_flat

    def spy_q(xs, bits, seeds, **kw):
        qcalls.append([(x.numel(), x.dtype, b) for x, b in zip(xs, bits)])
        return real_q(xs, bits, seeds, **kw)

    def spy_d(buf, members, **kw):
        dcalls.append([(math.prod(shape), dt, b) for _, shape, dt, b in members])
        return real_d(buf, members, **kw)

    P.quantize_flat, P.dequantize_flat = spy_q, spy_d
    try:
        for _ in range(2):  # the second forward replays the first's plan (what a training step runs)
            qcalls.clear()
            dcalls.clear()
            m(idx, idx).backward()
    finally:
        P.quantize_flat, P.dequantize_flat = real_q, real_d
    return qcalls, dcalls


def tune_agoq_launches(log) -> list[dict]:
    """the quantize / dequantize launches of one AGoQ step on the 1b preset (B = 8,
    T = 1024, the flushes captured from the model, inputs random), timed whole, per launch
    configuration: quantize and dequantize at several tiles (``Q_TILE``, ``DQ_TILE``). Each
    variant's bytes are checked equal to the default's before it is timed."""
    import importlib

    M = importlib.import_module("leantrain.ops.multi")
    qcalls, dcalls = _capture_flushes()
    rows: list[dict] = [{"case": "flushes", "quantize_calls": [[(n, str(d), b) for n, d, b in c] for c in qcalls],
                         "dequantize_calls": [[(n, str(d), b) for n, d, b in c] for c in dcalls]}]
    log(f"captured {len(qcalls)} quantize flushes ({sum(map(len, qcalls))} tensors), "
        f"{len(dcalls)} dequantize calls ({sum(map(len, dcalls))} tensors)")
    g = torch.Generator(device="cuda").manual_seed(0)
    flushes = [[torch.randn(n, device="cuda", generator=g).to(d) for n, d, _ in c] for c in qcalls]
    widths = [[b for _, _, b in c] for c in qcalls]
    seeds = [list(range(len(c))) for c in qcalls]
    q_bytes = sum(x.numel() * (x.element_size() + b / 8) + 4 * x.numel() / 128
                  for xs, ws in zip(flushes, widths) for x, b in zip(xs, ws))
    tot = sum(x.numel() * x.element_size() for xs in flushes for x in xs)
    a = torch.empty(tot // 2, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    copy_ms = _bench(lambda: b.copy_(a))
    copy_gbps = 2 * tot / copy_ms / 1e6
    a = b = None
    rows.append({"case": "copy (the flushes' input bytes)", "ms": copy_ms, "gbps": copy_gbps})
    log(f"inputs {tot / 2**30:.2f} GiB, copy {copy_ms:.3f} ms {copy_gbps:.0f} GB/s")
    rec = _recorder(rows, copy_gbps, log, rep=100, note="same_as_default")

    def quantize_all():
        return [M.quantize_flat(xs, ws, ss, stochastic=True) for xs, ws, ss in zip(flushes, widths, seeds)]

    defaults = M.Q_TILE, M.DQ_TILE
    ref = quantize_all()
    for tile in ((4096, 4, 1), (2048, 4, 1), (4096, 8, 1), (2048, 4, 2)):
        M.Q_TILE = tile
        got = quantize_all()
        ok = all(torch.equal(u[0], v[0]) for u, v in zip(got, ref))
        del got
        rec(f"quantize, one step's flushes: tile={tile}", quantize_all, q_bytes, ok)
    M.Q_TILE = defaults[0]
    # dequantize: every flush's members (as the backward takes them: one call per flush here)
    members = [[(lay, (x.numel(),), x.dtype, w) for lay, x, w in zip(layout, xs, ws)]
               for (buf, layout), xs, ws in zip(ref, flushes, widths)]
    bufs = [buf for buf, _ in ref]

    def dequantize_all():
        return [M.dequantize_flat(buf, mem) for buf, mem in zip(bufs, members)]

    dref = dequantize_all()
    for tile in ((4096, 4, 2), (2048, 4, 4), (2048, 4, 2), (4096, 8, 1), (1024, 4, 4), (4096, 4, 4), (8192, 8, 1)):
        M.DQ_TILE = tile
        got = dequantize_all()
        ok = all(torch.equal(u, v) for gu, gv in zip(got, dref) for u, v in zip(gu, gv))
        del got
        rec(f"dequantize, one step's flushes: tile={tile}", dequantize_all, q_bytes, ok)
    M.Q_TILE, M.DQ_TILE = defaults
    return rows


def tune_forge_int8(log) -> list[dict]:
    """FORGE's update-only kernel (the split path's second half, the default on CUDA)
    with bf16 W + stochastic rounding + int8 AdamW states, per tile / warps, on 1b shapes; and
    the fp32-state update for reference. Each tile's W and states are checked equal to the
    default tile's (the SR hash and the 16 x 16 state blocks do not depend on the tile).
    ``TUNE_INT8_TILES="bn,bk,warps[,maxnreg];..."`` and ``TUNE_INT8_KINDS="int8,int8p,fp8,fp32"`` choose."""
    from leantrain.forge import attach
    from leantrain.forge.launch import MODE_UPDATE, heuristic_config, launch_forge
    from leantrain.optim import AdamW

    rows = []
    kinds = os.environ.get("TUNE_INT8_KINDS", "int8,fp32").split(",")  # int8p: the absmax packed in the codes
    tiles = [tuple(int(v) for v in t.split(",")) for t in os.environ.get("TUNE_INT8_TILES", "").split(";") if t] or [
        (64, 64, 4), (32, 64, 2), (64, 64, 8), (32, 128, 4), (128, 64, 8), (16, 128, 2), (32, 32, 1), (64, 128, 8),
        (16, 64, 1), (32, 256, 8), (128, 128, 8), (16, 64, 2), (16, 64, 4), (32, 64, 8), (16, 128, 4)]
    for (N, K) in ((2048, 5632), (32000, 2048)):
        for sd in kinds:
            torch.manual_seed(0)
            lin = torch.nn.Linear(K, N, bias=False, device="cuda", dtype=torch.bfloat16)
            opt = attach(lin, AdamW(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1), state_dtype=sd,
                         stochastic_rounding=True)
            layer = opt.layers[0]
            x = torch.randn(512, K, device="cuda", dtype=torch.bfloat16)
            dy = torch.randn(512, N, device="cuda", dtype=torch.bfloat16) * 1e-3
            opt._update_layer(layer, x, dy)  # states created and filled once
            opt._step_id += 1
            opt._ran.clear()
            h = layer.host
            g = torch.randn(N, K, device="cuda") * 1e-3
            w = lin.weight.data

            def run(tune, h=h, g=g, w=w):
                launch_forge(MODE_UPDATE, w=w, states=h.states, kinds=h.kinds, qtables=h.qtables, rule_name="adamw",
                             hp=h.group, step=5, sr=True, key=123, g=g, tune=tune)

            absmax = [q[1] for q in h.qtables if q is not None and q[1] is not None]
            snap = [w.clone()] + [t.clone() for t in h.states] + [t.clone() for t in absmax]

            def restore(snap=snap, h=h, w=w, absmax=absmax):
                for dst, src in zip([w, *h.states, *absmax], snap):
                    dst.copy_(src)

            default = heuristic_config(MODE_UPDATE, 0, int8=sd != "fp32")
            run(default)
            ref = [w.clone()] + [t.clone() for t in h.states]
            nbytes = N * K * (4 + 2 * 2 + {"int8": 2 * 2 * (1 + 4 / 256), "int8p": 2 * 2,
                                           "fp8": 2 * 2 * (1 + 4 / 256)}.get(sd, 16))
            for bn, bk, warps, *cap in tiles:  # (a fourth value: ptxas's register cap, maxnreg)
                tune = dict(default, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, **({"maxnreg": cap[0]} if cap else {}))
                case = f"update {N}x{K} bf16 W + SR, {sd} states, tile {bn}x{bk} warps {warps}" + (
                    f" maxnreg {cap[0]}" if cap else "")
                try:
                    restore()
                    run(tune)
                    same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1
                               else torch.equal(a, b) for a, b in zip([w, *h.states], ref))  # (fp8: as bytes)
                    restore()
                    ms = _bench(lambda tune=tune: run(tune), rep=40)
                    r = {"case": case, "ms": ms, "gbps": nbytes / ms / 1e6, "same_as_default": same}
                except Exception as e:  # noqa: BLE001
                    r = {"case": case, "error": f"{type(e).__name__}: {e}"[:300]}
                log(json.dumps(r))
                rows.append(r)
            del opt, lin
            torch.cuda.empty_cache()
    return rows


def _chunk_rows(row, split, chunked, w0, st):
    """Time the split path and the chunked variants of one shape into ``row`` (tune_tiles (3))."""
    N = w0.shape[0]
    split(w0.clone(), st[0].clone(), st[1].clone())
    row["split_ms"] = _bench(lambda: split(w0, *st))
    for rows_per in (256, 512, 1024):
        if rows_per >= N:
            continue
        for two in (False, True):
            # correctness: one chunked update from the same start equals one split update
            wa, ma, va = w0.clone(), st[0].clone(), st[1].clone()
            split(wa, ma, va)
            wb, mb, vb = w0.clone(), st[0].clone(), st[1].clone()
            chunked(wb, mb, vb, rows_per, two)()
            torch.cuda.synchronize()
            ok = bool(torch.equal(wa, wb) and torch.equal(ma, mb) and torch.equal(va, vb))
            ms = _bench(chunked(w0.clone(), st[0].clone(), st[1].clone(), rows_per, two))
            row[f"chunk{rows_per}{'_2s' if two else ''}"] = {"ms": ms, "same": ok}

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--what", default="ops,forge")
    ap.add_argument("--mib", type=int, default=256)
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    what = a.what.split(",")

    def log(s):
        print(s, flush=True)

    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%dT%H:%M:%S")}
    tuners = {"ops": lambda: tune_ops(a.mib, log), "agoq": lambda: tune_agoq(log), "fast": lambda: tune_fast(log),
              "fast2": lambda: tune_fast2(log),
              "multi": lambda: tune_multi(log), "tiles": lambda: tune_tiles(log), "agoq_launches": lambda: tune_agoq_launches(log),
              "forge_int8": lambda: tune_forge_int8(log),
              "host": lambda: tune_host(log),
              "forge_paths": lambda: tune_forge_paths(log), "forge_split": lambda: tune_forge_split(log),
              "forge_update16": lambda: tune_forge_update16(log), "forge": lambda: tune_forge(log),
              "forge_group": lambda: tune_forge_group(log), "forge_carve": lambda: tune_forge_carve(log)}
    for name, tuner in tuners.items():
        if name in what:
            extra = {"mib": a.mib} if name == "ops" else {}
            fname = f"tune_{name}{os.environ.get('TUNE_TAG', '')}.json"
            json.dump({**env, **extra, "rows": tuner()}, open(os.path.join(a.out, fname), "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""quantize_many / dequantize_many equal one quantize / dequantize per tensor, bit for bit."""

import pytest
import torch
from _opslib import DTYPES, randn, triton_runnable

from leantrain.ops import dequantize, quantize
from leantrain.ops.multi import dequantize_many, quantize_many

SHAPES = [(3, 70), (1,), (0,), (4097,), (2, 256), (130,)]


@pytest.mark.parametrize("bits,symmetric", [(8, True), (8, False), (4, True), (4, False)])
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_many_equals_one_per_tensor(backend, device, bits, symmetric, stochastic, dtype):
    xs = [randn(s, dtype, device).reshape(s) if len(s) == 1 else randn(s[0] * s[1], dtype, device).view(s)
          for s in SHAPES]
    xs[3][5], xs[3][9], xs[3][11] = float("nan"), float("inf"), -float("inf")
    seeds = [3, 2**40 + 1, 5, 7, 11, 13]
    kw = dict(bits=bits, group_size=128, symmetric=symmetric, stochastic=stochastic)
    qs = quantize_many(xs, seeds=seeds, backend=backend, **kw)
    for x, s, q in zip(xs, seeds, qs, strict=True):
        r = quantize(x, seed=s, backend="torch", **kw)
        assert q.shape == x.shape and q.dtype == x.dtype
        assert torch.equal(q.data, r.data) and torch.equal(q.scale, r.scale)
        assert (q.zero is None) == symmetric and (symmetric or torch.equal(q.zero, r.zero))
    for out_dtype in (None, torch.float32):
        ds = dequantize_many(qs, dtype=out_dtype, backend=backend)
        for q, d in zip(qs, ds, strict=True):
            r = dequantize(q, dtype=out_dtype, backend="torch")
            assert d.dtype == r.dtype and d.shape == r.shape
            assert torch.equal(d, r)


def test_group_sizes_and_a_single_tensor(device):
    if not triton_runnable():
        pytest.skip("no Triton")
    for gs in (32, 96, 2048):
        x = randn(5000, torch.float32, device)
        (q,) = quantize_many([x], bits=4, group_size=gs, stochastic=True, seeds=[9], backend="triton")
        r = quantize(x, bits=4, group_size=gs, stochastic=True, seed=9, backend="torch")
        assert torch.equal(q.data, r.data) and torch.equal(q.scale, r.scale)
        (d,) = dequantize_many([q], backend="triton")
        assert torch.equal(d, dequantize(r, backend="torch"))


def test_keys_are_the_kernel_keys_of_the_seeds(device):
    if not triton_runnable():
        pytest.skip("no Triton")
    from leantrain.ops import kernel_key

    xs = [randn(300, torch.bfloat16, device), randn(77, torch.bfloat16, device)]
    a = quantize_many(xs, bits=4, stochastic=True, seeds=[1, 2], backend="triton")
    b = quantize_many(xs, bits=4, stochastic=True, keys=[kernel_key(1), kernel_key(2)], backend="triton")
    for p, q in zip(a, b, strict=True):
        assert torch.equal(p.data, q.data)


def test_bad_input_is_refused(device):
    x = randn(256, torch.float32, device)
    with pytest.raises(ValueError, match="seeds"):
        quantize_many([x, x], bits=8, seeds=[0])
    with pytest.raises(TypeError, match="fp32/bf16/fp16"):
        quantize_many([x.double()], bits=8)
    with pytest.raises(ValueError, match="bits"):
        quantize_many([x], bits=5)
    if triton_runnable():
        with pytest.raises(ValueError, match="contiguous"):
            quantize_many([x.view(16, 16).t()], bits=8, backend="triton")
    with pytest.raises(ValueError, match="bit-widths"):
        quantize_many([x, x], bits=[4], seeds=[0, 1])
    q8 = quantize(x, bits=8, backend="torch")
    with pytest.raises(TypeError, match="fp32/bf16/fp16"):
        dequantize_many([q8], dtype=torch.float64)
    with pytest.raises(ValueError, match="same group_size"):
        dequantize_many([q8, quantize(x, bits=8, group_size=64, backend="torch")])
    assert quantize_many([], bits=8) == [] and dequantize_many([]) == []


@pytest.mark.parametrize("stochastic", [False, True])
def test_mixed_bit_widths_in_one_launch(backend, device, stochastic):
    xs = [randn(n, torch.bfloat16, device) for n in (300, 4096, 77, 1000)]
    widths, seeds = [4, 8, 8, 4], [1, 2, 3, 4]
    qs = quantize_many(xs, bits=widths, stochastic=stochastic, seeds=seeds, backend=backend)
    for x, b, s, q in zip(xs, widths, seeds, qs, strict=True):
        r = quantize(x, bits=b, stochastic=stochastic, seed=s, backend="torch")
        assert q.bits == b and torch.equal(q.data, r.data) and torch.equal(q.scale, r.scale)
    for q, d in zip(qs, dequantize_many(qs, backend=backend), strict=True):
        assert torch.equal(d, dequantize(q, backend="torch"))


@pytest.mark.parametrize("tpp", [2, 3])
def test_several_tiles_per_program(device, monkeypatch, tpp):
    """A program running TPP consecutive tiles (the last ones past a tensor's end masked) gives
    the same bytes as one tile per program."""
    if not triton_runnable():
        pytest.skip("no Triton")
    import importlib

    M = importlib.import_module("leantrain.ops.multi")
    monkeypatch.setattr(M, "Q_TILE", M.Tile(256, 4, tpp))
    monkeypatch.setattr(M, "DQ_TILE", M.Tile(256, 4, tpp))
    xs = [randn(n, torch.bfloat16, device) for n in (2, 700, 2048, 5001)]  # 4-bit ones even: word path
    qs = quantize_many(xs, bits=[4, 8, 4, 8], stochastic=True, seeds=[1, 2, 3, 4], backend="triton")
    for x, s, b, q in zip(xs, [1, 2, 3, 4], [4, 8, 4, 8], qs, strict=True):
        r = quantize(x, bits=b, stochastic=True, seed=s, backend="torch")
        assert torch.equal(q.data, r.data) and torch.equal(q.scale, r.scale)
    for q, d in zip(qs, dequantize_many(qs, backend="triton"), strict=True):
        assert torch.equal(d, dequantize(q, backend="torch"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("symmetric", [True, False])
def test_word_path_and_its_fallback(device, dtype, symmetric, monkeypatch):
    """4-bit tensors of a launch, all of even size at 4-byte aligned addresses, are read as
    32-bit words; one odd-sized or misaligned tensor sends the launch down the element path.
    Both equal the reference."""
    if not triton_runnable():
        pytest.skip("no Triton")
    import importlib

    M = importlib.import_module("leantrain.ops.multi")
    big = randn(9000, dtype, device)
    big[3] = float("nan")
    even = [big[:4096], big[4096:4096 + 130], big[6000:6002]]
    kw = dict(bits=4, symmetric=symmetric, stochastic=True)
    seen, launch = [], M.launch

    def spy(kernel, grid, *args, **meta):
        if "WORDS" in meta:
            seen.append(meta["WORDS"])
        return launch(kernel, grid, *args, **meta)

    monkeypatch.setattr(M, "launch", spy)
    for xs in (even, even + [big[7001:7301]], even + [big[8000:8011]]):
        seeds = list(range(len(xs)))
        qs = quantize_many(xs, seeds=seeds, backend="triton", **kw)
        assert seen.pop() == (xs is even)
        for x, s, q in zip(xs, seeds, qs, strict=True):
            r = quantize(x, seed=s, backend="torch", **kw)
            assert torch.equal(q.data, r.data) and torch.equal(q.scale, r.scale)
        for q, d in zip(qs, dequantize_many(qs, backend="triton"), strict=True):
            assert torch.equal(d, dequantize(q, backend="torch"))


def test_mixed_dtypes_in_one_launch(backend, device, monkeypatch):
    """fp32, bf16 and fp16 tensors (4 and 8 bits) in one call, dequantized to their own dtypes
    or to one asked for: each equals its own quantize / dequantize; the word-path rows go to a
    launch of their own, the others to one mixed launch, and dequantize is one launch."""
    import leantrain.ops.multi as M

    launches = []
    real = M.launch
    monkeypatch.setattr(M, "launch", lambda k, g, *a, **kw: (launches.append(kw), real(k, g, *a, **kw)))
    xs = [randn(n, dt, device) for n, dt in ((300, torch.float32), (256, torch.bfloat16), (77, torch.float16),
                                              (1000, torch.bfloat16), (130, torch.float32))]
    bits, seeds = [4, 4, 8, 8, 4], [1, 2, 3, 4, 5]
    qs = quantize_many(xs, bits=bits, stochastic=True, seeds=seeds, backend=backend)
    for x, b, s, q in zip(xs, bits, seeds, qs, strict=True):
        r = quantize(x, bits=b, stochastic=True, seed=s, backend="torch")
        assert q.dtype == x.dtype and torch.equal(q.data, r.data) and torch.equal(q.scale, r.scale)
    if backend == "triton":  # two launches: the word path's rows (the 4-bit bf16 one) apart from the rest
        words = [kw for kw in launches if kw.get("WORDS")]
        assert len(launches) == 2 and len(words) == 1
        assert words[0]["KIND"] == 1 and words[0]["BITS"] == 4  # the bf16 4-bit row alone
        rest = [kw for kw in launches if not kw.get("WORDS")][0]
        assert rest["BITS"] == 0 and rest["KIND"] == -1  # fp32 4-bit, fp16 8-bit, bf16 8-bit: mixed
    for dt in (None, torch.float32):
        launches.clear()
        for q, d in zip(qs, dequantize_many(qs, dtype=dt, backend=backend), strict=True):
            assert torch.equal(d, dequantize(q, dtype=dt, backend="torch"))
        if backend == "triton":
            assert len(launches) == 1


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("stochastic", [False, True])
def test_flat_buffer_equals_many(backend, device, symmetric, stochastic):
    """quantize_flat: the codes, scales and zero points of quantize_many in one buffer, at aligned
    offsets; dequantize_flat of any subset (in any order) equals dequantize_many of those."""
    from leantrain.ops.multi import dequantize_flat, flat_qtensor, quantize_flat

    dts = [torch.float32, torch.bfloat16, torch.float16, torch.bfloat16, torch.float32, torch.bfloat16]
    xs = [randn(s[0] * s[1] if len(s) == 2 else s[0], d, device).reshape(s) for s, d in zip(SHAPES, dts)]
    bits, seeds = [4, 8, 4, 4, 8, 4], [3, 2**40 + 1, 5, 7, 11, 13]
    kw = dict(group_size=128, symmetric=symmetric, stochastic=stochastic)
    qs = quantize_many(xs, bits=bits, seeds=seeds, backend=backend, **kw)
    buf, layout = quantize_flat(xs, bits, seeds, backend=backend, **kw)
    assert buf.dtype == torch.uint8 and len(layout) == len(xs)
    for x, b, q, lay in zip(xs, bits, qs, layout, strict=True):
        assert all(o % 16 == 0 for o in lay) and ((lay[2] == lay[1]) == symmetric or not x.numel())
        f = flat_qtensor(buf, lay, x.shape, x.dtype, b, 128, symmetric)
        assert f.shape == x.shape and f.dtype == x.dtype and f.nbytes == q.nbytes
        assert torch.equal(f.data, q.data) and torch.equal(f.scale, q.scale)
        assert symmetric or torch.equal(f.zero, q.zero)
    pick = [4, 0, 3, 2]
    ds = dequantize_flat(buf, [(layout[i], xs[i].shape, xs[i].dtype, bits[i]) for i in pick], group_size=128,
                         symmetric=symmetric, backend=backend)
    ref = dequantize_many([qs[i] for i in pick], backend="torch")
    for d, r in zip(ds, ref, strict=True):
        assert d.dtype == r.dtype and d.shape == r.shape and torch.equal(d, r)
    assert quantize_flat([], [], [], backend=backend)[1] == []
    if backend == "triton":  # a layout built tensor by tensor (AGoQ's batches) gives the same buffer
        from leantrain.ops.multi import FlatLayout

        lay = FlatLayout(128, symmetric)
        for x, b, s in zip(xs, bits, seeds):
            lay.add(x, b, s)
        buf2, layout2 = quantize_flat(xs, bits, seeds, backend=backend, layout=lay, **kw)
        assert layout2 == layout
        for x, b, o in zip(xs, bits, layout):  # (the padding between members is not written)
            f, f2 = (flat_qtensor(bb, o, x.shape, x.dtype, b, 128, symmetric) for bb in (buf, buf2))
            assert torch.equal(f.data, f2.data) and torch.equal(f.scale, f2.scale)
            assert symmetric or torch.equal(f.zero, f2.zero)
        with pytest.raises(ValueError, match="layout"):
            quantize_flat(xs[:2], bits[:2], seeds[:2], backend=backend, layout=lay, **kw)

import pytest
import torch
from _opslib import DTYPES, SQNR_FLOOR_DB, equal_nan, randn, sqnr_db, triton_runnable

from leantrain.ops import QTensor, dequantize, quantize
from leantrain.ops.quant import dequantize_ref, quantize_ref

CASES = [(b, s) for b in (8, 4) for s in (True, False)]


def _same(a: QTensor, b: QTensor):
    assert torch.equal(a.data, b.data)
    assert torch.equal(a.scale, b.scale)
    assert (a.zero is None) == (b.zero is None)
    if a.zero is not None:
        assert torch.equal(a.zero, b.zero)


@pytest.mark.parametrize("bits,symmetric", CASES)
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,group_size", [(1, 32), (127, 32), (4097, 128), (1000, 96), (300, 4096)])
def test_kernel_matches_reference_bit_exact(backend, device, bits, symmetric, stochastic, dtype, n, group_size):
    x = randn(n, dtype, device)
    kw = dict(bits=bits, group_size=group_size, symmetric=symmetric, stochastic=stochastic, seed=7)
    q = quantize(x, backend=backend, **kw)
    ref = quantize_ref(x, **kw)
    _same(q, ref)
    assert q.data.dtype == torch.uint8 and q.scale.dtype == torch.float32
    assert q.data.numel() == q.num_groups * group_size * bits // 8
    y = dequantize(q, backend=backend)
    assert y.shape == x.shape and y.dtype == dtype
    assert torch.equal(y, dequantize_ref(ref))


@pytest.mark.parametrize("bits,symmetric", CASES)
def test_round_to_nearest_error_bound(bits, symmetric):
    x = randn(4097)
    q = quantize(x, bits=bits, symmetric=symmetric, group_size=64)
    err = (dequantize(q) - x).abs()
    scale = q.scale.repeat_interleave(64)[: x.numel()]
    assert (err <= scale * 0.5 * (1 + 1e-5) + 1e-30).all()


def test_int8_bytes_view_as_int8_and_int4_nibbles():
    x = torch.tensor([1.0, -1.0, 0.5, -0.5] + [0.0] * 28)
    q8 = quantize(x, bits=8, group_size=32)
    assert q8.data.view(torch.int8)[:4].tolist() == [127, -127, 64, -63]  # ties round half up
    q4 = quantize(x, bits=4, group_size=32)
    assert q4.data[0].item() == (7 | ((-7 & 0xF) << 4))  # even element in the low nibble
    assert q4.nbytes == 16 + 4


def test_shape_dtype_override_and_empty(backend, device):
    x = randn(6 * 7, torch.bfloat16, device).view(6, 7)
    q = quantize(x, bits=4, group_size=32, backend=backend)
    assert q.shape == torch.Size([6, 7])
    assert dequantize(q, dtype=torch.float32, backend=backend).dtype == torch.float32
    e = quantize(torch.empty(0, 3, device=device), backend=backend)
    assert e.data.numel() == 0 and dequantize(e, backend=backend).shape == (0, 3)


@pytest.mark.parametrize("bits,symmetric", CASES)
@pytest.mark.parametrize("stochastic", [False, True])
def test_sqnr_floor(bits, symmetric, stochastic):
    x = torch.randn(1 << 16)
    y = dequantize(quantize(x, bits=bits, symmetric=symmetric, stochastic=stochastic, seed=1))
    assert sqnr_db(x, y) >= SQNR_FLOOR_DB[(f"int{bits}", symmetric, stochastic)]


@pytest.mark.parametrize("bits,symmetric", CASES)
def test_stochastic_rounding_unbiased(bits, symmetric):
    """Mean dequantization error over S seeds -> 0: each element's SR error has variance
    <= scale**2 / 4, so its mean over S seeds has standard error <= scale / (2 sqrt(S))."""
    S, n, gs = 256, 512, 64
    x = randn(n, scale=1.0)
    errs = torch.stack([dequantize(quantize(x, bits=bits, symmetric=symmetric, group_size=gs,
                                            stochastic=True, seed=s)) - x for s in range(S)])
    scale = quantize(x, bits=bits, symmetric=symmetric, group_size=gs).scale.repeat_interleave(gs)[:n]
    se = scale / (2 * S**0.5)
    assert (errs.mean(0).abs() <= 6 * se + 1e-12).all()              # per element, 6 SE (n draws)
    assert errs.mean().abs() <= 5 * se.mean() / n**0.5 + 1e-12        # overall, 5 SE
    # and round-to-nearest is *biased* on the same data (the test would catch a non-SR path)
    assert not torch.equal(errs[0], errs[1])


def test_stochastic_seed_reproducible(backend, device):
    x = randn(1000, device=device)
    a = quantize(x, stochastic=True, seed=3, backend=backend)
    b = quantize(x, stochastic=True, seed=3, backend=backend)
    c = quantize(x, stochastic=True, seed=4, backend=backend)
    assert torch.equal(a.data, b.data) and not torch.equal(a.data, c.data)


@pytest.mark.parametrize("bits,symmetric", CASES)
def test_extreme_inputs(backend, device, bits, symmetric):
    gs = 32
    x = randn(5 * gs, device=device)
    x[:gs] = 0.0                                         # all-zero group
    x[gs] = float("nan"); x[gs + 1] = float("inf"); x[gs + 2] = -float("inf")  # noqa: E702
    x[2 * gs: 3 * gs] = torch.randn(gs, device=device) * 1e-42   # denormals
    x[3 * gs] = 3e38                                     # one huge outlier
    q = quantize(x, bits=bits, group_size=gs, symmetric=symmetric, backend=backend)
    _same(q, quantize_ref(x, bits=bits, group_size=gs, symmetric=symmetric))
    y = dequantize(q, backend=backend)
    assert torch.isfinite(y).all() and torch.isfinite(q.scale).all()
    assert torch.equal(y[:gs], torch.zeros(gs, device=device))        # zeros round-trip exactly
    # documented: non-finite inputs are treated as 0 -> decode to the group's level nearest 0
    x0 = torch.where(torch.isfinite(x), x, 0.0)
    assert equal_nan(y, dequantize(quantize(x0, bits=bits, group_size=gs, symmetric=symmetric,
                                            backend=backend), backend=backend))
    if symmetric:
        assert (y[gs: gs + 3] == 0).all()
    # denormal groups: codes are exact (the power-of-two pre-scale keeps them out of overflow)
    den = x[2 * gs: 3 * gs]
    amax = den.abs().max()
    assert (y[2 * gs: 3 * gs] - den).abs().max() <= amax  # finite, bounded
    assert (q.data.view(-1)[2 * gs * bits // 8: 3 * gs * bits // 8] != 0).any()


def test_bad_arguments():
    with pytest.raises(ValueError, match="bits"):
        quantize(torch.randn(8), bits=3)
    with pytest.raises(ValueError, match="group_size"):
        quantize(torch.randn(8), group_size=8192)
    with pytest.raises(ValueError, match="backend"):
        quantize(torch.randn(8), backend="cuda")
    with pytest.raises(TypeError):
        quantize(torch.arange(8))


def test_stack_and_from_buffers_views():
    qs = [quantize(torch.randn(300), bits=4, group_size=64) for _ in range(3)]
    st = QTensor.stack(qs)
    assert st.stacked and st.num_peers == 3 and st.data.shape == (3, qs[0].data.numel())
    fb = QTensor.from_buffers(st.data.reshape(-1), st.scale.reshape(-1), shape=(300,), bits=4, group_size=64)
    assert fb.data.data_ptr() == st.data.data_ptr()
    assert torch.equal(dequantize(fb)[1], dequantize(qs[1]))
    assert torch.equal(st.peer(2).data, qs[2].data)


@pytest.mark.gpu
@pytest.mark.parametrize("bits,symmetric", CASES)
@pytest.mark.parametrize("stochastic", [False, True])
def test_gpu_full_size_bit_exact(bits, symmetric, stochastic):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = randn((1 << 24) + 17, torch.bfloat16, "cuda")
    kw = dict(bits=bits, group_size=128, symmetric=symmetric, stochastic=stochastic, seed=11)
    q, r = quantize(x, backend="triton", **kw), quantize(x, backend="torch", **kw)
    _same(q, r)
    assert torch.equal(dequantize(q, backend="triton"), dequantize(r, backend="torch"))


@pytest.mark.parametrize("symmetric", [True, False])
def test_pairwise_stochastic_rounding_path_gives_the_same_codes(backend, device, monkeypatch, symmetric):
    """4-bit SR draws one hash per byte (PAIR_SR) or one per element: identical codes."""
    import importlib

    Q = importlib.import_module("leantrain.ops.quant")
    x = randn(4097, torch.bfloat16, device)
    kw = dict(bits=4, group_size=64, symmetric=symmetric, stochastic=True, seed=99, backend=backend)
    monkeypatch.setattr(Q, "PAIR_SR", True)
    a = quantize(x, **kw)
    monkeypatch.setattr(Q, "PAIR_SR", False)
    b = quantize(x, **kw)
    _same(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("stochastic", [False, True])
def test_word_path_of_16_bit_inputs(device, monkeypatch, dtype, symmetric, stochastic):
    """4 bits from bf16 and fp16 read 32-bit words of two elements (WORD_PAIRS) where the size
    is even and the address 4-byte aligned, elements otherwise: the same bytes as the reference
    either way (odd sizes, odd offsets, partial groups, NaN/inf)."""
    if not triton_runnable():
        pytest.skip("no Triton")
    import importlib

    Q = importlib.import_module("leantrain.ops.quant")
    big = randn(2 * 4099, dtype, device)
    big[7], big[300], big[301] = float("nan"), float("inf"), -float("inf")
    cases = [big[:8192].view(2, 4096), big[:6].view(2, 3), big[1:4097], big[:4097], big[2:1002]]
    assert Q.word_kind(4, dtype, 6, big[1:].data_ptr()) == 0 and Q.word_kind(4, dtype, 6, big.data_ptr()) > 0
    kw = dict(bits=4, group_size=128, symmetric=symmetric, stochastic=stochastic, seed=5)
    for x in cases:
        r = quantize(x, backend="torch", **kw)
        for words in (True, False):
            monkeypatch.setattr(Q, "WORD_PAIRS", words)
            q = quantize(x, backend="triton", **kw)
            _same(q, r)
            assert torch.equal(dequantize(q, backend="triton"), dequantize(r, backend="torch"))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exp_on_quantize_and_log_on_dequantize(backend, device, bits, dtype):
    """quantize(x, exp=True) quantizes exp(x) without a tensor of it; dequantize(q, log=True)
    returns log(max(v, TINY)) (AGoQ's log-softmax stored as probabilities): against the reference
    on exp(x), codes may differ by one step (the kernel's exp is not torch's in the last bits)."""
    from leantrain.ops.quant import TINY

    x = torch.log_softmax(randn(8 * 300, torch.float32, device).view(8, 300) * 4, -1).to(dtype)
    q = quantize(x, bits=bits, symmetric=False, stochastic=True, seed=7, exp=True, backend=backend)
    r = quantize(x.float().exp(), bits=bits, symmetric=False, stochastic=True, seed=7, backend="torch")
    assert q.shape == x.shape and q.dtype == x.dtype and q.nbytes == r.nbytes
    assert torch.allclose(q.scale, r.scale, rtol=1e-5, atol=0) and torch.allclose(q.zero, r.zero, rtol=1e-5, atol=1e-30)
    v, vr = dequantize(q, dtype=torch.float32, backend=backend), dequantize(r, dtype=torch.float32, backend="torch")
    step = r.scale.repeat_interleave(128)[: x.numel()].view_as(vr)
    assert ((v - vr).abs() <= step * 1.001 + 1e-12).all()
    assert (v - vr).abs().gt(step * 0.5).float().mean() < 0.01  # one-step differences are rare
    lg = dequantize(q, dtype=torch.float32, log=True, backend=backend)
    assert torch.allclose(lg, v.clamp_min(TINY).log(), rtol=1e-5, atol=1e-5)
    assert torch.isfinite(lg).all()
    with pytest.raises(ValueError, match="integer"):
        from leantrain.ops.fp8 import quantize_fp8

        dequantize(quantize_fp8(x.float()), log=True)

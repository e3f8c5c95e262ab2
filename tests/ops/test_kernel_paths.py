"""Code paths of the bandwidth-tuned kernels that the per-op tests do not reach by default:
the closed-form ``state8_encode`` (and ``state8_encode_finite``, the sign a constexpr) on every
boundary of both maps, NaN and +-inf, the reduce kernel's
per-row scales / runtime peer loop / non-power-of-two groups, and the int64 fallback of the
uint32 stochastic-rounding counter (must hash exactly like the uint32 one)."""

import importlib

import pytest
import torch
from _opslib import DEVICE, randn, triton_runnable

from leantrain.ops import QTensor, dequant_sum_requant, hadamard_quantize, quantize
from leantrain.ops._backend import HAS_TRITON
from leantrain.ops.reduce import dequant_sum_requant_ref
from leantrain.ops.state8 import StateCodec8, create_dynamic_map

hadamard_mod = importlib.import_module("leantrain.ops.hadamard")  # the package attribute is the function
reduce_mod = importlib.import_module("leantrain.ops.reduce")
quant_mod = importlib.import_module("leantrain.ops.quant")

if HAS_TRITON:
    import triton
    import triton.language as tl

    from leantrain.ops.state8 import state8_encode, state8_encode_finite

    @triton.jit
    def _encode_elems(x_ptr, out_ptr, qmap_ptr, n, BLOCK: tl.constexpr, SIGN: tl.constexpr):
        """``SIGN``: -1 the generic helper, 1 / 0 the compile-time signed / unsigned one."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i, mask=i < n, other=0.0)
        if SIGN >= 0:
            code = state8_encode_finite(x, tl.abs(x), qmap_ptr, SIGN == 1)
        else:
            code = state8_encode(x, qmap_ptr)
        tl.store(out_ptr + i, code, mask=i < n)


def _needs_triton():
    if not triton_runnable():
        pytest.skip("Triton not runnable here")


def _ulps(v: torch.Tensor, k: int) -> list[torch.Tensor]:
    out, up, dn = [], v.clone(), v.clone()
    for _ in range(k):
        up = torch.nextafter(up, torch.full_like(up, float("inf")))
        dn = torch.nextafter(dn, torch.full_like(dn, -float("inf")))
        out += [up, dn]
    return out


def _check_encode_helper(signed: bool, generic: bool, device: str) -> None:
    q = create_dynamic_map(signed)
    mids = (q[1:] + q[:-1]) * 0.5
    g = torch.Generator().manual_seed(0)
    parts = [q, mids, *_ulps(q, 3), *_ulps(mids, 3),
             torch.rand(1 << 16, generator=g) * 2 - 1,
             torch.sign(torch.randn(1 << 16, generator=g)) * 10 ** (-8 * torch.rand(1 << 16, generator=g)),
             torch.tensor([0.0, -0.0, 1.0, -1.0, 1.0000001, -1.0000001, 2.0, -2.0, 1e30, -1e30, 1e-40,
                           -1e-40, 1e-45, float("inf"), -float("inf")])]
    x = torch.cat(parts).float().contiguous()
    out = torch.empty(x.numel(), dtype=torch.int32, device=device)
    xd = x.to(device)
    table = StateCodec8(signed).qmap_on(device)  # the map, then its midpoints
    assert torch.equal(table[:256].cpu(), q) and torch.equal(table[256:].cpu(), mids)
    sign = -1 if generic else int(signed)
    _encode_elems[(triton.cdiv(x.numel(), 4096),)](xd, out, table, x.numel(), BLOCK=4096, SIGN=sign)
    ref = torch.searchsorted(mids, x, right=False).to(torch.int32)
    assert torch.equal(out.cpu(), ref)
    nan = torch.tensor([float("nan"), -float("nan"), float("nan"), 0.5], device=device)
    o = torch.empty(4, dtype=torch.int32, device=device)
    _encode_elems[(1,)](nan, o, table, 4, BLOCK=16, SIGN=sign)
    assert (o[:3] == 0).all()  # documented: NaN -> code 0 (as the binary search gave)


@pytest.mark.parametrize("generic", [True, False])
@pytest.mark.parametrize("signed", [True, False])
def test_state8_encode_helper_exact_on_all_boundaries(signed, generic):
    """Closed form + one comparison == searchsorted over the midpoints, on every map entry,
    every midpoint (ties go low) and 3 ulps either side, log-spread values, +-inf, |x| > 1,
    NaN; the generic helper and the one whose map sign is a compile-time constant."""
    _needs_triton()
    _check_encode_helper(signed, generic, DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize("generic", [True, False])
@pytest.mark.parametrize("signed", [True, False])
def test_state8_encode_helper_exact_compiled(signed, generic):
    """The same on the GPU, compiled: the hardware's float -> int truncation of the closed form's
    negative values (-0.6 -> 0) and NaN (never converted: it takes the negative branch)."""
    if not torch.cuda.is_available() or DEVICE != "cuda":
        pytest.skip("needs CUDA (compiled, not the interpreter)")
    _check_encode_helper(signed, generic, "cuda")


# (bits, symmetric, group_size) in -> (group_size) out: per-row scales (gs_in % gs_out == 0,
# incl. asymmetric and int4 inputs, and a non-power-of-two output group) and per-element
# scales with a non-power-of-two output group; 7000 elements span several programs, and with
# gs_in = 480 / 80 / 48 a program's first element is not at an input-group start.
REDUCE_CASES = [((8, False, 256), 128), ((4, True, 256), 64), ((4, False, 128), 128),
                ((8, True, 192), 96), ((8, True, 480), 96), ((8, True, 80), 96), ((4, True, 48), 32)]


@pytest.mark.parametrize("inp,gs_out", REDUCE_CASES)
@pytest.mark.parametrize("stochastic", [False, True])
def test_reduce_scale_paths_bit_exact(inp, gs_out, stochastic):
    _needs_triton()
    bits, sym, gs = inp
    qs = [quantize(randn(7000, device=DEVICE), bits=bits, symmetric=sym, group_size=gs) for _ in range(3)]
    kw = dict(bits_out=4, group_size_out=gs_out, symmetric_out=True, stochastic=stochastic, seed=7)
    out = dequant_sum_requant(qs, backend="triton", **kw)
    ref = dequant_sum_requant_ref(QTensor.stack(qs), **kw)
    assert torch.equal(out.data, ref.data) and torch.equal(out.scale, ref.scale)


@pytest.mark.parametrize("k", [1, 3, 17])
def test_reduce_runtime_peer_loop_and_int64_counter(monkeypatch, k):
    """k > _UNROLL_MAX takes the runtime loop; _IDX32_LIMIT = 0 forces the int64 RNG index."""
    _needs_triton()
    qs = [quantize(randn(777, device=DEVICE), bits=8, group_size=128) for _ in range(k)]
    kw = dict(bits_out=4, group_size_out=128, stochastic=True, seed=3)
    ref = dequant_sum_requant_ref(QTensor.stack(qs), symmetric_out=True, **kw)
    a = dequant_sum_requant(qs, backend="triton", **kw)
    monkeypatch.setattr(reduce_mod, "_UNROLL_MAX", 1)
    monkeypatch.setattr(reduce_mod, "_IDX32_LIMIT", 0)
    b = dequant_sum_requant(qs, backend="triton", **kw)
    for o in (a, b):
        assert torch.equal(o.data, ref.data) and torch.equal(o.scale, ref.scale)


@pytest.mark.parametrize("bits,group_size", [(8, 128), (4, 32)])
def test_hadamard_quantize_uint32_counter_equals_int64(monkeypatch, bits, group_size):
    _needs_triton()
    x = randn(4097, device=DEVICE)
    kw = dict(block=32, bits=bits, group_size=group_size, stochastic=True, seed=11, backend="triton")
    a = hadamard_quantize(x, **kw)
    monkeypatch.setattr(hadamard_mod, "_IDX32_LIMIT", 0)
    b = hadamard_quantize(x, **kw)
    assert torch.equal(a.data, b.data) and torch.equal(a.scale, b.scale)


@pytest.mark.parametrize("bits,group_size", [(8, 128), (4, 32)])
def test_quantize_uint32_counter_equals_int64_and_reference(monkeypatch, bits, group_size):
    _needs_triton()
    x = randn(4097, device=DEVICE)
    kw = dict(bits=bits, group_size=group_size, stochastic=True, seed=11)
    ref = quantize(x, backend="torch", **kw)
    a = quantize(x, backend="triton", **kw)
    monkeypatch.setattr(quant_mod, "_IDX32_LIMIT", 0)
    b = quantize(x, backend="triton", **kw)
    for o in (a, b):
        assert torch.equal(o.data, ref.data) and torch.equal(o.scale, ref.scale)


def _tiles_with_bad_groups(dtype, denormals=True):
    """Clean 4096-element tiles, then tiles with NaN, -inf, a denormal-range group (each sends
    its tile down the general branch of ``quant_tl._pair_y_tl``) and an all-zero group (clean)."""
    x = randn(4096 * 6 + 256, device=DEVICE)
    x[4096 + 17] = float("nan")
    x[2 * 4096 + 300] = float("-inf")
    if denormals:
        x[3 * 4096: 3 * 4096 + 128] *= 1e-40
    x[4 * 4096 + 128: 4 * 4096 + 256] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("stochastic", [False, True])
def test_clean_tile_branch_and_general_branch_equal_reference(dtype, bits, stochastic):
    """The clean-tile branch (``FAST & CLEAN_TILE``, portable: the interpreter runs it) and the
    general branch of the same launch give the reference's codes and scales."""
    _needs_triton()
    from leantrain.ops.multi import quantize_many
    from leantrain.ops.quant import quantize_ref

    # (The Triton interpreter widens bf16 denormals wrongly; the 4-bit word path widens by bits.)
    interp_bf16 = dtype == torch.bfloat16 and bits == 8 and DEVICE == "cpu"
    x = _tiles_with_bad_groups(dtype, denormals=not interp_bf16)
    ref = quantize_ref(x, bits=bits, group_size=128, stochastic=stochastic, seed=5)
    got = quantize(x, bits=bits, group_size=128, stochastic=stochastic, seed=5, backend="triton")
    assert torch.equal(got.data, ref.data) and torch.equal(got.scale, ref.scale)
    many = quantize_many([x, x[:4096]], bits=bits, stochastic=stochastic, seeds=[5, 5], backend="triton")
    assert torch.equal(many[0].data, ref.data) and torch.equal(many[0].scale, ref.scale)


def test_symmetric_4bit_rounding_needs_no_clamp():
    """The clamp-free symmetric rounding (``quant_tl._round_tl``): groups whose extreme element
    lands one ulp above 7 (``absmax * RN(7 / absmax) > 7``), every draw of ``u``, stay in
    [-7, 7] and equal the (clamping) reference."""
    _needs_triton()
    from leantrain.ops.quant import quantize_ref

    a = torch.rand(200_000, dtype=torch.float64).mul(8).exp2().float() + 1e-3
    over = a * torch.div(torch.full_like(a, 7.0), a) > 7.0  # fp32 products above 7
    a = a[over][:64]
    assert a.numel() == 64
    x = torch.stack([a.repeat_interleave(64), -a.repeat_interleave(64)], 1).reshape(-1)  # +a, -a, ...
    x = x.to(DEVICE)
    for stochastic in (False, True):
        for seed in range(3):
            ref = quantize_ref(x, bits=4, group_size=128, stochastic=stochastic, seed=seed)
            got = quantize(x, bits=4, group_size=128, stochastic=stochastic, seed=seed, backend="triton")
            assert torch.equal(got.data, ref.data)

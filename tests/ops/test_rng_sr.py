import pytest
import torch
from _opslib import equal_nan, randn, triton_runnable

from leantrain.ops import bf16_stochastic_round, hash_uniform, kernel_key
from leantrain.ops.rng import hash_u32
from leantrain.ops.sr import bf16_stochastic_round_ref

try:
    import triton
    import triton.language as tl

    from leantrain.ops.rng import hash_u32_tl

    @triton.jit(do_not_specialize=["key"])
    def _hash_kernel(i_ptr, o_ptr, key, N: tl.constexpr):
        i = tl.load(i_ptr + tl.arange(0, N))
        tl.store(o_ptr + tl.arange(0, N), hash_u32_tl(key, i).to(tl.int64))
except ImportError:  # pragma: no cover
    _hash_kernel = None


def test_hash_uniform_range_and_moments():
    n = 1 << 16
    u = hash_uniform(123, torch.arange(n))
    assert u.dtype == torch.float32 and (u >= 0).all() and (u < 1).all()
    se = (1 / 12) ** 0.5 / n**0.5
    assert abs(u.mean().item() - 0.5) < 5 * se
    assert abs(u.var().item() - 1 / 12) < 0.01
    # neighbouring counters and seeds are decorrelated
    assert abs(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1].item()) < 5 / n**0.5
    v = hash_uniform(124, torch.arange(n))
    assert abs(torch.corrcoef(torch.stack([u, v]))[0, 1].item()) < 5 / n**0.5


def test_hash_is_a_bijection_per_seed_and_handles_64bit_counters():
    h = hash_u32(5, torch.arange(1 << 16))
    assert h.unique().numel() == 1 << 16 and h.min() >= 0 and h.max() < 2**32
    big = torch.tensor([0, 2**32, 2**40 + 3], dtype=torch.int64)
    assert hash_u32(5, big).unique().numel() == 3


def test_hash_triton_equals_torch(device):
    if not triton_runnable():
        pytest.skip("Triton not runnable here")
    from leantrain.ops._backend import launch

    idx = torch.cat([torch.arange(60), torch.tensor([2**31 - 1, 2**32 + 7, 2**40 + 1, 2**62])]).to(device)
    for seed in (0, 1, 2**31 + 5, 2**63 - 1):
        out = torch.empty(64, dtype=torch.int64, device=device)
        launch(_hash_kernel, (1,), idx, out, kernel_key(seed), N=64)
        assert torch.equal(out, hash_u32(seed, idx))


@pytest.mark.parametrize("n", [1, 127, 4097])
def test_sr_kernel_matches_reference(backend, device, n):
    x = randn(n, device=device)
    x[0] = float("nan")
    if n > 3:
        x[1], x[2] = float("inf"), -float("inf")
    y = bf16_stochastic_round(x, seed=9, offset=1000, backend=backend)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert equal_nan(y.float(), bf16_stochastic_round_ref(x, seed=9, offset=1000).float())
    assert torch.isnan(y[0])
    if n > 3:
        assert y[1] == float("inf") and y[2] == -float("inf")


def test_sr_rounds_to_a_neighbour_and_keeps_bf16_values():
    x = randn(1 << 14)
    y = bf16_stochastic_round(x, seed=1).float()
    down = (x.view(torch.int32) & -65536).view(torch.float32)          # truncation toward 0
    up = ((x.view(torch.int32) & -65536) + 65536).view(torch.float32)
    assert ((y == down) | (y == up)).all()
    b = x.to(torch.bfloat16).float()
    assert torch.equal(bf16_stochastic_round(b, seed=3).float(), b)     # exact values stay


def test_sr_unbiased():
    """Mean over S seeds of (SR(x) - x) -> 0 within 5 standard errors; RNE is biased here."""
    S = 512
    x = torch.full((256,), 1.0 + 2**-9)  # 1/4 of the way between two bf16 values
    errs = torch.stack([bf16_stochastic_round(x, seed=s).float() - x for s in range(S)])
    ulp = 2**-7
    se = ulp * (0.25 * 0.75) ** 0.5 / (S * x.numel()) ** 0.5
    assert abs(errs.mean().item()) < 5 * se
    assert abs((x.to(torch.bfloat16).float() - x).mean().item()) > 100 * se
    # offset shifts the counter: same draws as the matching slice of a longer call
    long = bf16_stochastic_round(torch.cat([x, x]), seed=4)
    assert torch.equal(bf16_stochastic_round(x, seed=4, offset=256), long[256:])


@pytest.mark.gpu
def test_gpu_sr_full_size():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = randn((1 << 26) + 3, device="cuda")
    a = bf16_stochastic_round(x, seed=2, backend="triton")
    b = bf16_stochastic_round(x, seed=2, backend="torch")
    assert torch.equal(a, b)


def test_step_kernel_keys_match_the_scalar_keys():
    """The vectorized host keys (FORGE's device table) equal kernel_key(step_seed(...)) one by one."""
    import numpy as np

    from leantrain.ops.rng import step_kernel_keys, step_seed

    rng = np.random.default_rng(0)
    index, step = rng.integers(0, 10**6, 200), rng.integers(1, 10**7, 200)
    for seed in (0, 3, 2**40 + 7, 2**63 + 11):
        got = step_kernel_keys(seed, index, step)
        assert got.dtype == np.int32
        assert got.tolist() == [kernel_key(step_seed(seed, int(i), int(s))) for i, s in zip(index, step)]

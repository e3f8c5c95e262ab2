"""GIFT's compute on CUDA (run on the GPU machine with LEANTRAIN_TEST_GPU=1): the transforms against the fp64
matrices, the batched eigen-solver against eigh, the statistics (TF32)
and refresh of a CUDA model, the TF32 setting restored afterwards, and the batched transforms in each
transform_dtype."""

import pytest
import torch
from torch import nn

from leantrain.comm.gift import GIFT, top_eigenpairs_batched
from leantrain.comm.gift_transforms import TransformGroup, _Side, _tf32, _two_sided

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _side(dim, r, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.linalg.qr(torch.randn(dim, dim, device="cuda", dtype=torch.float64, generator=g)).Q
    s = torch.logspace(0, -3, dim, device="cuda", dtype=torch.float64)
    return _Side(q[:, :r].float().contiguous(), s[:r].float(), float(s[r:].mean()), 1e-3 * float(s.mean()))


def _dense(sd, inverse):
    c, e = sd.coef(inverse)
    eye = torch.eye(sd.u.shape[0], device="cuda", dtype=torch.float64)
    return c * eye + (sd.u.double() * e.double()) @ sd.u.double().t()


@pytest.mark.parametrize("n,k", [(2560, 2048), (2048, 5632), (1000, 3000)])
def test_two_sided_transform_matches_the_fp64_matrices(n, k):
    a, b = _side(k, 64, 1), _side(n, 64, 2)
    g = torch.randn(n, k, device="cuda")
    for inverse in (True, False):
        ref = _dense(b, inverse) @ g.double() @ _dense(a, inverse)
        out = _two_sided(b, a, g, inverse)
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


def test_batched_eigenpairs_on_cuda_match_eigh():
    fs = []
    for i in range(4):
        x = torch.randn(4096, 1024, device="cuda") * torch.logspace(0, -2 - i, 1024, device="cuda")
        fs.append(x.t() @ x / 4096)
    vals, vecs = top_eigenpairs_batched(fs, 64, seeds=[1, 2, 3, 4])
    for i, f in enumerate(fs):
        want = torch.linalg.eigvalsh(f.double()).flip(0)[:64]
        # the leading values converge first; the 64th sits in a flat part of the spectrum (8 iterations)
        assert torch.allclose(vals[i, :16], want[:16], rtol=1e-3), i
        captured = (vecs[i].t() @ f.double() @ vecs[i]).trace()
        assert captured >= 0.99 * want.sum(), (i, float(captured / want.sum()))
        eye = torch.eye(64, device="cuda", dtype=torch.float64)
        assert torch.allclose(vecs[i].t() @ vecs[i], eye, atol=1e-9)


def test_statistics_and_refresh_of_a_cuda_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 256)).cuda()
    gift = GIFT(model, rank=32, min_numel=1024)
    before = torch.backends.cuda.matmul.fp32_precision
    x = torch.randn(64, 512, device="cuda")
    model(x).square().mean().backward()  # (the statistics' products in TF32)
    assert torch.backends.cuda.matmul.fp32_precision == before
    with _tf32(True):
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    assert torch.backends.cuda.matmul.fp32_precision == before
    gift.reduce_gradients()  # (one process: no reduction; the factors are built from the step's statistics)
    assert all(la.ready for la in gift.layers.values()) and len(gift.layers) == 2
    for la in gift.layers.values():
        g = la.mod.weight.grad
        back = la.unwhiten(la.whiten(g))
        assert ((back - g).norm() / g.norm()).item() < 1e-4


@pytest.mark.parametrize("dtype,tol,euclidean_tol", [("float32", 1e-5, 1e-5), ("tfloat32", 2e-3, 2e-2),
                                                    ("bfloat16", 1e-2, 1e-1)])
def test_batched_transforms_on_cuda_match_the_reference_and_invert(dtype, tol, euclidean_tol):
    """The batched group on 1b-like shapes: fp32 equals the per-layer reference; in every dtype the map back
    inverts the map out (tolerances: the CPU tests' measured bf16 errors, TF32's scaled by its 3 more
    mantissa bits, with margin); a subset of the slots in another order gives the same numbers."""
    n, k, layers = 2560, 2048, 3
    sides = [(_side(k, 64, 2 * i + 1), _side(n, 64, 2 * i + 2)) for i in range(layers)]
    grp = TransformGroup(n, k, dtype)
    grp.rebuild(sides)
    gs = torch.randn(layers, n, k, device="cuda") * torch.logspace(0, -1, k, device="cuda")
    w = gs.clone()
    grp.apply(list(range(layers)), w, True)
    back = w.clone()
    grp.apply(list(range(layers)), back, False)
    sub = gs[[2, 0]].clone()
    grp.apply([2, 0], sub, True)
    assert ((sub - w[[2, 0]]).norm() / w[[2, 0]].norm()).item() < tol
    for (a, b), g, wi, bi in zip(sides, gs, w, back):
        ref = _dense(b, True) @ g.double() @ _dense(a, True)
        assert ((wi.double() - ref).norm() / ref.norm()).item() < tol
        wb = _dense(b, True) @ bi.double() @ _dense(a, True)
        assert ((wb - ref).norm() / ref.norm()).item() < max(tol, 1e-5)
        assert ((bi - g).norm() / g.norm()).item() < euclidean_tol
        if dtype == "float32":
            assert ((wi - _two_sided(b, a, g, True)).norm() / wi.norm()).item() < 1e-5

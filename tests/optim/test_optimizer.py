"""The reference optimizer and the element-wise rules against torch.optim and written-out formulas."""

import copy

import pytest
import torch

import leantrain as lt

# fp32 comparisons with torch.optim: same formula, same order of operations -> tiny drift only
RTOL = 1e-6


def _problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(37, 19, generator=g), torch.randn(19, generator=g), torch.randn(1, generator=g)]
    grads = [[torch.randn(p.shape, generator=g) for p in params] for _ in range(6)]
    return params, grads


def _run(opt_factory, params, grads):
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = opt_factory(ps)
    for step_grads in grads:
        for p, gr in zip(ps, step_grads):
            p.grad = gr.clone()
        opt.step()
    return [p.detach() for p in ps]


def _assert_rel(a, b, rtol=RTOL):
    for x, y in zip(a, b):
        err = ((x - y).abs().max() / y.abs().max().clamp_min(1e-12)).item()
        assert err <= rtol, err


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adamw_matches_torch(wd):
    params, grads = _problem()
    ours = _run(lambda ps: lt.optim.Optimizer(ps, lt.optim.AdamW(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd)), params, grads)
    ref = _run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd, foreach=False), params, grads)
    _assert_rel(ours, ref)


@pytest.mark.parametrize("momentum,nesterov", [(0.0, False), (0.9, False), (0.9, True)])
def test_sgd_matches_torch(momentum, nesterov):
    params, grads = _problem(1)
    ours = _run(lambda ps: lt.optim.Optimizer(ps, lt.optim.SGD(lr=0.05, momentum=momentum, nesterov=nesterov)), params, grads)
    ref = _run(lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=momentum, nesterov=nesterov, foreach=False), params, grads)
    _assert_rel(ours, ref)


def test_sgd_decoupled_weight_decay_formula():
    params, grads = _problem(2)
    lr, wd, mu = 0.05, 0.1, 0.9
    ours = _run(lambda ps: lt.optim.Optimizer(ps, lt.optim.SGD(lr=lr, momentum=mu, weight_decay=wd)), params, grads)
    for i, p0 in enumerate(params):
        p, b = p0.clone(), torch.zeros_like(p0)
        for sg in grads:
            b = mu * b + sg[i]
            p = p * (1 - lr * wd) - lr * b
        _assert_rel([ours[i]], [p])


def test_lion_formula():
    params, grads = _problem(3)
    lr, (b1, b2), wd = 1e-3, (0.9, 0.99), 0.1
    ours = _run(lambda ps: lt.optim.Optimizer(ps, lt.optim.Lion(lr=lr, betas=(b1, b2), weight_decay=wd)), params, grads)
    for i, p0 in enumerate(params):
        p, m = p0.clone(), torch.zeros_like(p0)
        for sg in grads:
            g = sg[i]
            p = p * (1 - lr * wd) - lr * torch.sign(b1 * m + (1 - b1) * g)
            m = b2 * m + (1 - b2) * g
        _assert_rel([ours[i]], [p])


def test_adams_formula():
    params, grads = _problem(4)
    lr, (b1, b2), eps, wd = 1e-2, (0.9, 0.95), 1e-8, 0.05
    ours = _run(lambda ps: lt.optim.Optimizer(ps, lt.optim.AdamS(lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)), params, grads)
    for i, p0 in enumerate(params):
        p, m = p0.clone(), torch.zeros_like(p0)
        for sg in grads:
            g = sg[i]
            v = b2 * m * m + (1 - b2) * g * g  # uses the previous first moment
            m = b1 * m + (1 - b1) * g
            p = (1 - lr * wd) * p - lr * m / (v.sqrt() + eps)
        _assert_rel([ours[i]], [p])


@pytest.mark.parametrize("rule", [lt.optim.AdamW(lr=1e-2), lt.optim.SGD(lr=0.1, momentum=0.9), lt.optim.Lion(lr=1e-3), lt.optim.AdamS(lr=1e-2)])
def test_state_dict_roundtrip_resumes_identically(rule):
    params, grads = _problem(5)
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = lt.optim.Optimizer(ps, rule)
    for sg in grads[:3]:
        for p, g in zip(ps, sg):
            p.grad = g.clone()
        opt.step()
    snap_params = [p.detach().clone() for p in ps]
    sd = copy.deepcopy(opt.state_dict())
    for sg in grads[3:]:
        for p, g in zip(ps, sg):
            p.grad = g.clone()
        opt.step()
    ps2 = [torch.nn.Parameter(p) for p in snap_params]
    opt2 = lt.optim.Optimizer(ps2, rule)
    opt2.load_state_dict(sd)
    for sg in grads[3:]:
        for p, g in zip(ps2, sg):
            p.grad = g.clone()
        opt2.step()
    for a, b in zip(ps, ps2):
        assert torch.equal(a, b)


def test_lr_scheduler_drives_the_rule():
    p = torch.nn.Parameter(torch.ones(4))
    opt = lt.optim.Optimizer([p], lt.optim.SGD(lr=1.0))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    deltas = []
    for _ in range(3):
        before = p.detach().clone()
        p.grad = torch.ones(4)
        opt.step()
        sched.step()
        deltas.append((before - p.detach())[0].item())
    assert deltas == pytest.approx([1.0, 0.5, 0.25])


def test_bf16_params_with_stochastic_rounding_are_unbiased():
    torch.manual_seed(0)
    base = torch.randn(4096).bfloat16()
    # a step far smaller than bf16's spacing: round-to-nearest would lose it entirely
    grad = torch.full((4096,), 1e-4).bfloat16()
    mean_moves = []
    for seed in range(20):
        p = torch.nn.Parameter(base.clone())
        opt = lt.optim.Optimizer([p], lt.optim.SGD(lr=1.0), stochastic_rounding=True, seed=seed)
        p.grad = grad
        opt.step()
        mean_moves.append((base.float() - p.detach().float()).mean().item())
    assert sum(mean_moves) / len(mean_moves) == pytest.approx(grad[0].item(), rel=0.1)


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="betas"):
        lt.optim.AdamW(betas=(0.9, 1.5))
    with pytest.raises(ValueError, match="nesterov"):
        lt.optim.SGD(lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="unknown optimizer rule"):
        lt.optim.make_rule("adam")
    with pytest.raises(TypeError, match="rule"):
        lt.optim.Optimizer([torch.nn.Parameter(torch.ones(1))], torch.optim.SGD)


needs_triton = pytest.mark.skipif(
    not (lt.ops._backend.HAS_TRITON and (lt.ops._backend.interpreting() or torch.cuda.is_available())),
    reason="needs Triton (the interpreter on CPU)")
KERNEL_RULES = {
    "adamw": lambda: lt.optim.AdamW(lr=1e-2, weight_decay=0.1),
    "sgd": lambda: lt.optim.SGD(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01),
    "lion": lambda: lt.optim.Lion(lr=1e-3, weight_decay=0.1),
    "adams": lambda: lt.optim.AdamS(lr=1e-2),
}


@needs_triton
@pytest.mark.parametrize("rule", sorted(KERNEL_RULES))
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_triton_backend_equals_the_reference(rule, state_dtype):
    """backend="triton" (FORGE's update-only kernel per parameter) after 6 steps: the reference's
    weights and states within 1e-6 relative in fp32 (bf16 states: the same stored values,
    within one bf16 ulp of a state's largest element); the 0-D-like [1] parameter included."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    params, grads = _problem(3)
    params = [p.to(dev) for p in params]
    grads = [[x.to(dev) for x in gs] for gs in grads]
    opts = {}

    def factory(backend):
        def make(ps):
            opts[backend] = lt.optim.Optimizer(ps, KERNEL_RULES[rule](), state_dtype=state_dtype, backend=backend)
            return opts[backend]
        return make

    ref = _run(factory("torch"), params, grads)
    got = _run(factory("triton"), params, grads)
    tol = RTOL if state_dtype == "fp32" else 2 ** -7
    _assert_rel(got, ref, tol)
    for pr, pg in zip(opts["torch"].state.values(), opts["triton"].state.values()):
        assert pr["step"] == pg["step"] == 6
        for k in KERNEL_RULES[rule]().state_names:
            _assert_rel([pg[k].float()], [pr[k].float()], tol)


@needs_triton
@pytest.mark.parametrize("rule", ["adamw", "lion"])
def test_triton_backend_reads_bf16_gradients(rule):
    """bf16 parameters and gradients (what the trainer's bf16 model has), round to nearest: the
    kernel reads the bf16 gradient itself; states within 1e-6 of the reference's, weights
    within one bf16 rounding."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    params, grads = _problem(5)
    params = [p.to(dev, torch.bfloat16) for p in params]
    grads = [[x.to(dev, torch.bfloat16) for x in gs] for gs in grads]
    opts = {}

    def factory(backend):
        def make(ps):
            opts[backend] = lt.optim.Optimizer(ps, KERNEL_RULES[rule](), backend=backend)
            return opts[backend]
        return make

    ref = _run(factory("torch"), params, grads)
    got = _run(factory("triton"), params, grads)
    assert all(x.dtype == torch.bfloat16 for x in got)
    _assert_rel([x.float() for x in got], [x.float() for x in ref], 2 ** -7)
    for pr, pg in zip(opts["torch"].state.values(), opts["triton"].state.values()):
        for k in KERNEL_RULES[rule]().state_names:
            _assert_rel([pg[k]], [pr[k]], RTOL)


@needs_triton
def test_triton_backend_bf16_params_round_stochastically():
    """bf16 weights through the kernel: unbiased stochastic rounding (the mean of many SGD
    steps of a tiny update lands on the fp32 result, round to nearest would not move at all)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    w0 = torch.ones(64, 64, device=dev)
    p = torch.nn.Parameter(w0.to(torch.bfloat16))
    opt = lt.optim.Optimizer([p], lt.optim.SGD(lr=1e-4), stochastic_rounding=True, backend="triton")
    for _ in range(20):
        p.grad = torch.ones_like(p)
        opt.step()
    want = 1.0 - 20 * 1e-4  # a step is 1/39 of a bf16 ulp at 1.0 (2^-7 = 0.0078)
    assert abs(p.float().mean().item() - want) < 5e-4
    q = torch.nn.Parameter(w0.to(torch.bfloat16))
    opt = lt.optim.Optimizer([q], lt.optim.SGD(lr=1e-4), stochastic_rounding=False, backend="triton")
    for _ in range(20):
        q.grad = torch.ones_like(q)
        opt.step()
    assert (q == 1).all()


@needs_triton
@pytest.mark.parametrize("rule", sorted(KERNEL_RULES))
@pytest.mark.parametrize("dtype,state_dtype,sr", [(torch.float32, "fp32", False), (torch.bfloat16, "bf16", True),
                                                  (torch.bfloat16, "fp32", True)])
def test_triton_backend_buckets_equal_one_launch_each(rule, dtype, state_dtype, sr, monkeypatch):
    """The small 1-D parameters in one launch (kernel.update_many): the bits of one launch each,
    weights (stochastic rounding included) and states; a 2-D and an odd-sized one beside them."""
    from leantrain.ops import update_launch as K

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(7)
    shapes = [(32,), (48,), (24, 16), (256,), (19,)]
    params = [torch.randn(s, generator=g).to(dev, dtype) for s in shapes]
    grads = [[torch.randn(s, generator=g).to(dev, dtype) for s in shapes] for _ in range(4)]
    calls = []
    real = K.update_many
    monkeypatch.setattr(K, "update_many", lambda ws, *a, **k: calls.append(len(ws)) or real(ws, *a, **k))
    opts, out = {}, {}
    for buckets in (True, False):
        def make(ps, buckets=buckets):
            opt = opts[buckets] = lt.optim.Optimizer(ps, KERNEL_RULES[rule](), state_dtype=state_dtype,
                                                     stochastic_rounding=sr, backend="triton")
            opt.buckets = buckets
            return opt
        out[buckets] = _run(make, params, grads)
    assert calls == [3] * 4  # 32, 48 and 256 together; the 2-D and the 19 alone
    for a, b in zip(out[True], out[False]):
        assert torch.equal(a, b)
    for sa, sb in zip(opts[True].state.values(), opts[False].state.values()):
        for k in KERNEL_RULES[rule]().state_names:
            assert torch.equal(sa[k], sb[k]), k


def test_backend_is_checked(monkeypatch):
    with pytest.raises(ValueError, match="backend"):
        lt.optim.Optimizer([torch.nn.Parameter(torch.ones(2))], lt.optim.SGD(lr=0.1), backend="cuda")
    # "triton" on a CPU tensor without the interpreter: said at the first step, as the ops say it
    monkeypatch.setattr(lt.ops._backend, "interpreting", lambda: False)
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    opt = lt.optim.Optimizer([p], lt.optim.SGD(lr=0.1), backend="triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        opt.step()
    auto = lt.optim.Optimizer([p], lt.optim.SGD(lr=0.1), backend="auto")  # (CPU: the reference)
    auto.step()
    assert torch.allclose(p, torch.full((2,), 0.9))

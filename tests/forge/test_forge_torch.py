"""FORGE, torch backend: exactness against the unfused rule and torch.optim, semantics, errors.

Tolerances: "bit for bit" means ``torch.equal``. Against ``torch.optim`` the summation order of
dW differs (per-layer ``dYᵀX`` vs autograd's), so weights agree to ``max|Δ| / max|W| ≤ 1e-6``.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from _forge_util import RULES, Net, batches, max_rel, pair, train

import leantrain as lt


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("bias", [True, False])
def test_bitwise_equal_to_reference_optimizer(rule, bias):
    """fp32, 5 steps: FORGE (torch backend) == lt.optim.Optimizer on the materialized gradient."""
    torch.manual_seed(0)
    m0, m1 = pair(Net(bias=bias))
    ref = lt.optim.Optimizer(m0.parameters(), RULES[rule]())
    opt = lt.forge.attach(m1, RULES[rule](), backend="torch")
    data = batches(5)
    train(m0, ref, data)
    train(m1, opt, data)
    for (n, a), (_, b) in zip(m0.named_parameters(), m1.named_parameters()):
        assert torch.equal(a, b), n
        for k, v in ref.state[a].items():
            if torch.is_tensor(v):
                assert torch.equal(v, opt.state[b][k]), (n, k)


class _Functional(torch.nn.Module):
    """nn.MultiheadAttention (its out_proj's weight is used without out_proj's forward) and a
    linear whose weight the model uses through F.linear."""

    def __init__(self):
        super().__init__()
        self.att = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        self.side = torch.nn.Linear(16, 16)
        self.fc = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = self.att(x, x, x)[0]
        return self.fc(torch.nn.functional.linear(h, self.side.weight, self.side.bias))


def test_weights_used_without_their_forward_are_still_stepped():
    """MultiheadAttention's out_proj is not fused; a fused layer whose weight the model uses through
    F.linear gets a gradient instead of its fused update: step() steps it from that gradient and
    says so once. Every parameter equals the reference optimizer's, bit for bit."""
    torch.manual_seed(0)
    m0, m1 = pair(_Functional())
    ref = lt.optim.Optimizer(m0.parameters(), RULES["adamw"]())
    opt = lt.forge.attach(m1, RULES["adamw"](), backend="torch")
    assert [layer.name for layer in opt.layers] == ["side", "fc"]
    data = batches(3, shape=(2, 5, 16))
    train(m0, ref, data[:1])
    with pytest.warns(UserWarning, match="side got a gradient"):
        train(m1, opt, data[:1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        train(m1, opt, data[1:])
    train(m0, ref, data[1:])
    for (n, a), (_, b) in zip(m0.named_parameters(), m1.named_parameters()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("shape", [(1, 1, 1), (127, 1, 65), (5, 127, 1)])
def test_odd_shapes(shape):
    k, h, n = shape
    torch.manual_seed(1)
    m0, m1 = pair(Net(k, h, n))
    ref = lt.optim.Optimizer(m0.parameters(), RULES["adamw"]())
    opt = lt.forge.attach(m1, RULES["adamw"](), backend="torch")
    data = batches(5, shape=(3, 7, k))
    train(m0, ref, data)
    train(m1, opt, data)
    for a, b in zip(m0.parameters(), m1.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("which", ["adamw", "sgd"])
def test_matches_torch_optim(which):
    torch.manual_seed(2)
    m0, m1 = pair(Net())
    if which == "adamw":
        ref = torch.optim.AdamW(m0.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                foreach=False)
        rule = lt.optim.AdamW(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    else:
        ref = torch.optim.SGD(m0.parameters(), lr=0.05, momentum=0.9, nesterov=True, foreach=False)
        rule = lt.optim.SGD(lr=0.05, momentum=0.9, nesterov=True)
    opt = lt.forge.attach(m1, rule, backend="torch")
    data = batches(5)
    train(m0, ref, data)
    train(m1, opt, data)
    for a, b in zip(m0.parameters(), m1.parameters()):
        assert max_rel(b, a) <= 1e-6


def test_grad_not_materialized_and_detach():
    torch.manual_seed(3)
    m = Net()
    opt = lt.forge.attach(m, RULES["adamw"](), backend="torch")
    w0 = m.fc1.weight.detach().clone()
    m(batches(1)[0]).square().mean().backward()
    assert m.fc1.weight.grad is None and m.fc2.weight.grad is None and m.fc1.bias.grad is None
    assert m.norm.weight.grad is not None
    assert not torch.equal(m.fc1.weight, w0)  # updated inside backward
    opt.step()
    assert opt.state[m.fc1.weight]["step"] == 1 and opt.state[m.norm.weight]["step"] == 1
    lt.forge.detach(m)
    assert "forward" not in m.fc1.__dict__
    m(batches(1)[0]).square().mean().backward()
    assert m.fc1.weight.grad is not None


def test_lr_scheduler_read_at_backward_time():
    torch.manual_seed(4)
    m0, m1 = pair(Net())
    ref = lt.optim.Optimizer(m0.parameters(), RULES["adamw"]())
    opt = lt.forge.attach(m1, RULES["adamw"](), backend="torch")
    s0 = torch.optim.lr_scheduler.StepLR(ref, step_size=1, gamma=0.5)
    s1 = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for x in batches(4):
        for m, o, s in ((m0, ref, s0), (m1, opt, s1)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
            s.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 / 16)
    for a, b in zip(m0.parameters(), m1.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("state_dtype", ["fp32", "int8", "int8p", "fp8"])
def test_state_dict_resume_bit_identical(state_dtype):
    torch.manual_seed(5)
    data = batches(6, shape=(2, 12, 33))
    m0 = Net(33, 160, 40)  # 160 x 33 and 40 x 160 weights: >= 4096 elements -> 8-bit states
    m1 = copy.deepcopy(m0)
    o0 = lt.forge.attach(m0, RULES["adamw"](), backend="torch", state_dtype=state_dtype, clip="prev_global")
    train(m0, o0, data)
    o1 = lt.forge.attach(m1, RULES["adamw"](), backend="torch", state_dtype=state_dtype, clip="prev_global")
    train(m1, o1, data[:3])
    sd = copy.deepcopy(o1.state_dict())
    msd = copy.deepcopy(m1.state_dict())
    if state_dtype != "fp32":  # (fp8: e4m3 codes, one byte each as int8's)
        assert o1.state[m1.fc1.weight]["exp_avg"].dtype == (torch.float8_e4m3fn if state_dtype == "fp8" else torch.uint8)
    m2 = Net(33, 160, 40)
    m2.load_state_dict(msd)
    o2 = lt.forge.attach(m2, RULES["adamw"](), backend="torch", state_dtype=state_dtype, clip="prev_global")
    o2.load_state_dict(sd)
    train(m2, o2, data[3:])
    for a, b in zip(m0.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_nan_in_one_layer_leaves_it_unchanged():
    torch.manual_seed(6)
    m = Net()
    opt = lt.forge.attach(m, RULES["adamw"](), backend="torch")
    train(m, opt, batches(2))
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    st_before = {k: v.clone() for k, v in opt.state[m.fc1.weight].items() if torch.is_tensor(v)}

    def poison(mod, inp, out):  # NaN only in fc1's output gradient
        out.register_hook(lambda g: torch.full_like(g, float("nan")))

    h = m.fc1.register_forward_hook(poison)
    m(batches(1, seed=9)[0]).square().mean().backward()
    opt.step()
    opt.zero_grad()
    h.remove()
    assert torch.equal(m.fc1.weight, before["fc1.weight"]) and torch.equal(m.fc1.bias, before["fc1.bias"])
    for k, v in st_before.items():
        assert torch.equal(opt.state[m.fc1.weight][k], v)
    assert not torch.equal(m.fc2.weight, before["fc2.weight"])  # the other layers still step
    assert "fc1" in opt.last_nonfinite and "fc2" not in opt.last_nonfinite
    train(m, opt, batches(1, seed=10))
    assert opt.last_nonfinite == [] and all(torch.isfinite(p).all() for p in m.parameters())


def test_gradient_accumulation_rejected():
    m = Net()
    opt = lt.forge.attach(m, RULES["adamw"](), backend="torch")
    x = batches(1)[0]
    m(x).square().mean().backward()
    with pytest.raises(RuntimeError, match="gradient accumulation"):
        m(x).square().mean().backward()
    opt.step()
    m(x).square().mean().backward()  # fine again after step()


def test_global_clip_rejected_with_alternatives():
    with pytest.raises(ValueError, match="clip='layer'.*clip='prev_global'"):
        lt.forge.attach(Net(), RULES["adamw"](), clip="global")
    with pytest.raises(ValueError, match="clip must be one of"):
        lt.forge.attach(Net(), RULES["adamw"](), clip="foo")
    m = Net()
    lt.forge.attach(m, RULES["adamw"]())
    with pytest.raises(RuntimeError, match="already attached"):
        lt.forge.attach(m, RULES["adamw"]())


def _clip_reference(m0, data, mode, c):
    """Unfused reference of the two clipping modes."""
    opt = lt.optim.Optimizer(m0.parameters(), RULES["sgd_mom"]())
    prev = None
    layers = [(m0.fc1.weight, m0.fc1.bias), (m0.norm.weight,), (m0.norm.bias,), (m0.fc2.weight, m0.fc2.bias)]
    for x in data:
        m0(x).square().mean().backward()
        norm = torch.sqrt(sum(p.grad.square().sum() for p in m0.parameters()))
        if mode == "layer":
            for group in layers:
                n = torch.sqrt(sum(p.grad.square().sum() for p in group))
                for p in group:
                    p.grad.mul_(torch.clamp(c / (n + 1e-6), max=1.0))
        elif prev is not None:
            for p in m0.parameters():
                p.grad.mul_(torch.clamp(c / (prev + 1e-6), max=1.0))
        prev = norm
        opt.step()
        opt.zero_grad()
    return prev


@pytest.mark.parametrize("mode", ["layer", "prev_global"])
def test_clipping_semantics(mode):
    torch.manual_seed(7)
    m0, m1 = pair(Net())
    data = [x * 5 for x in batches(4)]
    norm = _clip_reference(m0, data, mode, 0.05)
    opt = lt.forge.attach(m1, RULES["sgd_mom"](), backend="torch", clip=mode, clip_value=0.05)
    train(m1, opt, data)
    assert opt.last_grad_norm == pytest.approx(float(norm), rel=1e-5)
    for a, b in zip(m0.parameters(), m1.parameters()):
        assert max_rel(b, a) <= 1e-6


def test_tied_weights_get_both_contributions():
    """Embedding tied to the head: left unfused, its .grad holds both contributions, one update."""
    torch.manual_seed(8)

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(50, 24)
            self.mid = torch.nn.Linear(24, 24)
            self.head = torch.nn.Linear(24, 50, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, idx):
            return self.head(torch.relu(self.mid(self.emb(idx))))

    m0, m1 = pair(Tied())
    ref = lt.optim.Optimizer(m0.parameters(), RULES["adamw"]())
    opt = lt.forge.attach(m1, RULES["adamw"](), backend="torch")
    assert [layer.name for layer in opt.layers] == ["mid"]
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        idx = torch.randint(0, 50, (4, 9), generator=g)
        for m, o in ((m0, ref), (m1, opt)):
            torch.nn.functional.cross_entropy(m(idx).flatten(0, 1), idx.flatten()).backward()
            o.step()
            o.zero_grad()
    for a, b in zip(m0.parameters(), m1.parameters()):
        assert torch.equal(a, b)


def test_bf16_stochastic_rounding_unbiased():
    """bf16 weights + SR: the mean over 400 seeds of one update equals the fp32 update (within
    4 standard errors + 2 % of a bf16 ulp on > 99 % of elements)."""
    torch.manual_seed(9)
    x = torch.randn(8, 32)
    w_bf = (torch.randn(16, 32) * 0.1).bfloat16()  # start on the bf16 grid: only the update rounds
    rule = lt.optim.SGD(lr=1e-3)
    y = x @ w_bf.float().t()
    target = w_bf.float() - 1e-3 * ((2 * y / y.numel()).t() @ x)  # d mean(y^2) / dW
    outs = []
    for seed in range(400):
        m = torch.nn.Linear(32, 16, bias=False).bfloat16()
        m.weight.data.copy_(w_bf)
        opt = lt.forge.attach(m, rule, backend="torch", seed=seed)
        m(x.bfloat16()).float().square().mean().backward()
        opt.step()
        outs.append(m.weight.detach().float())
    outs = torch.stack(outs)
    mean, se = outs.mean(0), outs.std(0) / 20 + 1e-12
    ulp = w_bf.float().abs() * 2.0**-8
    assert ((mean - target).abs() <= 4 * se + 0.02 * ulp).float().mean() > 0.99
    assert outs.std(0).max() > 0  # it really rounded stochastically


@pytest.mark.parametrize("state_dtype", ["int8", "int8p", "fp8"])
def test_int8_states_track_fp32(state_dtype):
    """AdamW with 8-bit states (packed or not, fp8): after 10 steps the weights differ from the
    fp32-state run by < 5 % of the distance travelled, and the dequantized first moment by < 5 %
    (relative L2; fp8 < 10 %: e4m3 keeps 3 mantissa bits, a step of 2**-3 relative at every scale,
    where the dynamic map steps ~1.4 % of the block max near it)."""
    torch.manual_seed(10)
    m0, m1 = pair(Net(33, 160, 40))
    w_init = m0.fc1.weight.detach().clone()
    o0 = lt.forge.attach(m0, RULES["adamw"](), backend="torch", state_dtype="fp32")
    o1 = lt.forge.attach(m1, RULES["adamw"](), backend="torch", state_dtype=state_dtype)
    data = batches(10)
    train(m0, o0, data)
    train(m1, o1, data)
    assert o1.state[m1.fc1.weight]["exp_avg_sq"].element_size() == 1
    delta = (m0.fc1.weight - w_init).norm()
    assert (m1.fc1.weight - m0.fc1.weight).norm() / delta < 0.05
    m_ref = o0.state[m0.fc1.weight]["exp_avg"]
    m_q = o1.storage.read(o1.state[m1.fc1.weight], "exp_avg", True, m1.fc1.weight.shape)
    assert (m_q - m_ref).norm() / m_ref.norm() < (0.10 if state_dtype == "fp8" else 0.05)


def _no_decay_groups(m):
    """Norm and biases without weight decay, fc2's weight at a tenth of the learning rate."""
    return [{"params": [m.norm.weight, m.norm.bias, m.fc1.bias, m.fc2.bias], "weight_decay": 0.0},
            {"params": [m.fc2.weight], "lr": 1e-3}]


def test_param_groups_equal_the_reference_optimizer():
    """attach(param_groups=...): each group's hyper-parameters, bit for bit the reference optimizer
    with the same groups; a bias in another group than its weight is stepped apart (not fused)."""
    torch.manual_seed(0)
    m0, m1 = pair(Net())
    ref = lt.optim.Optimizer(_no_decay_groups(m0) + [{"params": [m0.fc1.weight]}], RULES["adamw"]())
    opt = lt.forge.attach(m1, RULES["adamw"](), backend="torch", param_groups=_no_decay_groups(m1))
    assert [(layer.name, layer.bias) for layer in opt.layers] == [("fc1", None), ("fc2", None)]
    assert [len(g["params"]) for g in opt.param_groups] == [1, 4, 1]
    assert opt.param_groups[1]["weight_decay"] == 0.0 and opt.param_groups[2]["lr"] == 1e-3
    data = batches(5)
    train(m0, ref, data)
    train(m1, opt, data)
    for (n, a), (_, b) in zip(m0.named_parameters(), m1.named_parameters()):
        assert torch.equal(a, b), n


def test_param_groups_are_checked():
    m = Net()
    with pytest.raises(ValueError, match="weight_dacay.*hyper-parameters are"):
        lt.forge.attach(m, RULES["adamw"](), param_groups=[{"params": [m.norm.weight], "weight_dacay": 0.0}])
    with pytest.raises(ValueError, match="in groups 1 and 2"):
        lt.forge.attach(m, RULES["adamw"](), param_groups=[{"params": [m.norm.weight]}, {"params": [m.norm.weight]}])
    with pytest.raises(ValueError, match="not a trainable parameter"):
        lt.forge.attach(m, RULES["adamw"](), param_groups=[{"params": [torch.nn.Parameter(torch.ones(2))]}])
    with pytest.raises(ValueError, match="with 'params'"):
        lt.forge.attach(m, RULES["adamw"](), param_groups=[{"lr": 0.1}])


def test_a_layer_frozen_after_attach_is_not_updated():
    """requires_grad_(False) after attach: the weight stays; its bias, still trainable, is stepped
    from its gradient in step() (said once)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                            torch.nn.Linear(8, 2))
    opt = lt.forge.attach(m, RULES["adamw"](), backend="torch")
    m[2].weight.requires_grad_(False)
    w0, b0 = m[2].weight.detach().clone(), m[2].bias.detach().clone()
    with pytest.warns(UserWarning, match="frozen since attach"):
        train(m, opt, batches(2, shape=(4, 8)))
    assert torch.equal(m[2].weight, w0)
    assert not torch.equal(m[2].bias, b0)


def test_a_shared_bias_gets_both_contributions():
    """A bias used by two layers is not fused; it is added after each layer's matmul, so its
    gradient sums both uses (the reference optimizer's result, bit for bit)."""
    torch.manual_seed(3)

    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
            self.b.bias = self.a.bias

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

    m0, m1 = pair(Shared())
    ref = lt.optim.Optimizer(m0.parameters(), RULES["adamw"]())
    opt = lt.forge.attach(m1, RULES["adamw"](), backend="torch")
    assert all(layer.bias is None for layer in opt.layers)
    data = batches(3, shape=(4, 8))
    train(m0, ref, data)
    train(m1, opt, data)
    for (n, a), (_, b) in zip(m0.named_parameters(), m1.named_parameters()):
        assert torch.equal(a, b), n


def test_a_ddp_wrapped_model_is_refused(tmp_path):
    """DistributedDataParallel waits for gradients FORGE never makes: attach says what to do instead."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(Net())
        with pytest.raises(ValueError, match="DistributedDataParallel.*attach to the unwrapped model"):
            lt.forge.attach(ddp, RULES["adamw"]())
    finally:
        dist.destroy_process_group()


def test_torch_transformer_encoder_trains_like_the_reference():
    """nn.TransformerEncoder (MultiheadAttention, whose out_proj is left unfused, and two fused
    linears a layer): bit for bit the reference optimizer, and nothing warned."""
    torch.manual_seed(0)
    enc = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True), 2)
    m0, m1 = pair(enc)
    ref = lt.optim.Optimizer(m0.parameters(), RULES["adamw"]())
    opt = lt.forge.attach(m1, RULES["adamw"](), backend="torch")
    assert [layer.name for layer in opt.layers] == [f"layers.{i}.linear{j}" for i in (0, 1) for j in (1, 2)]
    data = batches(3, shape=(2, 7, 32))
    train(m0, ref, data)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(m1, opt, data)
    for (n, a), (_, b) in zip(m0.named_parameters(), m1.named_parameters()):
        assert torch.equal(a, b), n

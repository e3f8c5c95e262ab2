"""FORGE's deferred updates (``attach(defer=True)``): each linear's dW and update issued at the
start of the next FORGE layer's backward (or at the end of the backward pass) instead of right
after its dX. The same updates in the same order, so the same bits: on CPU (torch backend, and
the Triton kernel through the interpreter), eager and, on CUDA, captured by GraphedStep; the
order of the launches is what changes; a fused LM head's ``fill`` update and ``step()`` issue
what is held back first."""

import copy

import pytest
import torch
from _forge_util import RULES, batches
from _forge_util import assert_same_run as _same
from _forge_util import square_loss as _loss
from torch import nn

import leantrain as lt
from leantrain.ops._backend import HAS_TRITON, interpreting

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


class Deep(nn.Module):
    """Four linears of different shapes with elementwise work and a norm between them."""

    def __init__(self, k=32, widths=(48, 64, 40, 24)):
        super().__init__()
        dims = (k, *widths)
        self.fcs = nn.ModuleList(nn.Linear(a, b, bias=i % 2 == 0) for i, (a, b) in enumerate(zip(dims, dims[1:])))
        self.norm = nn.LayerNorm(widths[1])

    def forward(self, x):
        for i, fc in enumerate(self.fcs):
            x = torch.tanh(fc(x))
            if i == 1:
                x = self.norm(x)
        return x


CASES = {  # name: (rule, weight dtype, attach kwargs)
    "adamw_fp32": ("adamw", torch.float32, {}),
    "adamw_bf16_sr_bf16_states": ("adamw", torch.bfloat16, {"state_dtype": "bf16"}),
    "adams_fp32_est_global": ("adams", torch.float32, {"clip": "est_global", "clip_value": 0.05}),
    "lion_fp32_layer_clip": ("lion", torch.float32, {"clip": "layer", "clip_value": 0.05}),
}


def _pair(case, backend="auto", model=Deep):
    rule, dtype, kw = CASES[case]
    torch.manual_seed(0)
    ref_model = model().to(DEV, dtype)
    m = copy.deepcopy(ref_model)
    ref = lt.forge.attach(ref_model, RULES[rule](), seed=3, backend=backend, **kw)
    opt = lt.forge.attach(m, RULES[rule](), seed=3, backend=backend, defer=True, **kw)
    assert opt.defer and not ref.defer
    return ref_model, ref, m, opt, dtype


def _steps(pairs, data):
    for x in data:
        for m, o in pairs:
            _loss(m, x).backward()
            assert o._pending is None  # (issued by the end of the backward pass)
            o.step()
            o.zero_grad()


def test_defer_option_is_checked(monkeypatch):
    with pytest.raises(TypeError, match="defer"):
        lt.forge.attach(Deep(), RULES["adamw"](), defer="yes")
    monkeypatch.setenv("LEANTRAIN_FORGE_DEFER", "2")
    with pytest.raises(ValueError, match="LEANTRAIN_FORGE_DEFER"):
        lt.forge.attach(Deep(), RULES["adamw"]())
    for env, want in (("1", True), ("0", False)):
        monkeypatch.setenv("LEANTRAIN_FORGE_DEFER", env)
        assert lt.forge.attach(Deep(), RULES["adamw"](), defer=not want).defer is want


@pytest.mark.parametrize("case", list(CASES))
def test_defer_equals_in_line(case):
    """4 steps deferred == in line, bit for bit (weights and states), for each rule / precision /
    clip mode (est_global sums the layers reduced so far: the order must be the same)."""
    ref_model, ref, m, opt, dtype = _pair(case, backend="torch" if DEV == "cpu" else "auto")
    _steps(((ref_model, ref), (m, opt)), [x.to(DEV) for x in batches(4, shape=(3, 10, 32), dtype=dtype)])
    _same(m, opt, ref_model, ref)


@pytest.mark.skipif(not (HAS_TRITON and (interpreting() or torch.cuda.is_available())),
                    reason="needs Triton (the interpreter on CPU)")
def test_defer_equals_in_line_triton():
    """The same through the Triton kernel (bf16 W + SR, bf16 states)."""
    ref_model, ref, m, opt, dtype = _pair("adamw_bf16_sr_bf16_states", backend="triton")
    _steps(((ref_model, ref), (m, opt)), [x.to(DEV) for x in batches(3, shape=(2, 8, 32), dtype=dtype)])
    _same(m, opt, ref_model, ref)


def test_each_update_waits_for_the_next_layers_backward(monkeypatch):
    """In line, a layer's update follows its own backward; deferred, it follows the start of the next
    FORGE layer's backward (the elementwise and norm backward between them run first), and the last
    layer's runs at the end of the backward pass. W keeps its old value until then."""
    from leantrain.forge.optimizer import ForgeOptimizer

    events = []
    real_before, real_update = ForgeOptimizer._before_layer_backward, ForgeOptimizer._update_layer

    def before(self):
        events.append(("backward", None))
        return real_before(self)

    def update(self, layer, *a, **k):
        events.append(("update", layer.name))
        return real_update(self, layer, *a, **k)

    monkeypatch.setattr(ForgeOptimizer, "_before_layer_backward", before)
    monkeypatch.setattr(ForgeOptimizer, "_update_layer", update)
    names = [f"fcs.{i}" for i in range(4)][::-1]  # backward order
    for defer in (False, True):
        torch.manual_seed(0)
        m = Deep()
        opt = lt.forge.attach(m, RULES["adamw"](), backend="torch", defer=defer)
        events.clear()
        _loss(m, torch.randn(2, 5, 32)).backward()
        if defer:
            want = [("backward", None)] + [e for n, nxt in zip(names, names[1:])
                                           for e in (("backward", None), ("update", n))] + [("update", names[-1])]
        else:
            want = [e for n in names for e in (("backward", None), ("update", n))]
        assert events == want, (defer, events)
        assert opt._pending is None


def _stop(*args):
    raise RuntimeError("stop")


def test_update_held_back_by_an_interrupted_backward_is_issued_by_join():
    """A backward that raises midway leaves the last layer's update held back (its end-of-backward
    join never ran): join() (as step() and state_dict() call it) issues it, and the run is then the
    in-line run's, which updated that layer before the error."""
    ref_model, ref, m, opt, _ = _pair("adamw_fp32", backend="torch")
    x = torch.randn(2, 5, 32)
    for mm in (ref_model, m):
        mm.fcs[1].register_full_backward_hook(_stop)  # raises once fcs.1's backward is done
        with pytest.raises(RuntimeError, match="stop"):
            _loss(mm, x).backward()
    assert opt._pending is not None and opt._pending[0].name == "fcs.1"
    assert not torch.equal(m.fcs[1].weight, ref_model.fcs[1].weight)  # held back
    opt.join()
    assert opt._pending is None
    _same(m, opt, ref_model, ref)


@needs_cuda
@pytest.mark.gpu
def test_graphed_defer_equals_in_line():
    """GraphedStep captures the deferred updates (the last one from the end-of-backward join):
    4 replays deferred == 4 replays in line, bit for bit."""
    from leantrain.graphs import GraphedStep

    ref_model, ref, m, opt, dtype = _pair("adamw_bf16_sr_bf16_states")
    data = [x.cuda() for x in batches(5, shape=(3, 10, 32), dtype=dtype)]
    steps = {id(o): GraphedStep(lambda x, mm=mm: _loss(mm, x), mm.parameters(), data[0])
             for mm, o in ((ref_model, ref), (m, opt))}
    for x in data[1:]:
        for o in (ref, opt):
            steps[id(o)](x)
            o.step()
            o.zero_grad(set_to_none=True)
    _same(m, opt, ref_model, ref)
    assert opt.state[m.fcs[0].weight]["step"] == len(data) - 1

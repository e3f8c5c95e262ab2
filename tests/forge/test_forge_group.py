"""Grouped updates (``attach(group_updates=True)``): consecutive split-path updates launched
together (forge/group.py) give the bits of one launch a layer: the kernel against
``launch_forge``, and FORGE with and without grouping for every state kind, bf16 + SR, the clip
modes it takes and the device-scalar (CUDA graph) path. On CPU through the Triton interpreter."""

import copy

import pytest
import torch
from _forge_util import RULES, Stack, batches, emulate_replays
from _forge_util import assert_same_run as _same
from _forge_util import square_loss as _loss

import leantrain as lt
from leantrain.ops._backend import HAS_TRITON, interpreting

needs_triton = pytest.mark.skipif(not (HAS_TRITON and (interpreting() or torch.cuda.is_available())),
                                  reason="needs Triton (the interpreter on CPU)")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def Chain(k=32, widths=(48, 32, 40, 24)):
    """Linears of different shapes, most without bias (grouped), one with (not), and a norm."""
    return Stack(k, widths, bias_at={2}, norm_at=0)


CASES = {  # name: (rule, weight dtype, attach kwargs)
    "adamw_fp32": ("adamw", torch.float32, {}),
    "adamw_bf16_sr_bf16_states_bf16_dw": ("adamw", torch.bfloat16, {"state_dtype": "bf16", "grad_dtype": "bf16"}),
    "adamw_bf16_sr_int8": ("adamw", torch.bfloat16, {"state_dtype": "int8"}),
    "adamw_bf16_sr_int8p": ("adamw", torch.bfloat16, {"state_dtype": "int8p"}),
    "lion_bf16_sr_prev_global": ("lion", torch.bfloat16, {"clip": "prev_global", "clip_value": 0.05}),
    "sgd_nesterov_fp32": ("sgd_nesterov", torch.float32, {}),
}


BIG = {"k": 64, "widths": (96, 64, 80, 72)}  # every layer >= 4096 elements: int8 states are 8-bit there


def _pair(case, **extra):
    rule, dtype, kw = CASES[case]
    torch.manual_seed(0)
    ref_model = Chain(**(BIG if kw.get("state_dtype") == "int8" else {})).to(DEV, dtype)
    model = copy.deepcopy(ref_model)
    ref = lt.forge.attach(ref_model, RULES[rule](), backend="triton", seed=3, **kw, **extra)
    opt = lt.forge.attach(model, RULES[rule](), backend="triton", seed=3, group_updates=True, **kw, **extra)
    return ref_model, ref, model, opt, dtype


@pytest.fixture
def launches(monkeypatch):
    """The number of layers of each grouped launch. Off CUDA the fused kernel would run instead of
    the split path (dW, then the update) that grouping defers: the split path is forced (dW by the
    kernel's write-dW mode), for the reference too."""
    from leantrain.forge import group
    from leantrain.forge.optimizer import ForgeOptimizer

    monkeypatch.setattr(ForgeOptimizer, "_materializes", lambda self, layer, x2, fill, backend: True)

    sizes = []
    real = group.launch_group

    def spy(layers, **kw):
        sizes.append(len(layers))
        return real(layers, **kw)

    monkeypatch.setattr(group, "launch_group", spy)
    return sizes


@needs_triton
@pytest.mark.parametrize("case", list(CASES))
def test_grouped_equals_one_launch_a_layer(case, launches):
    """2 steps (int8: 1) with grouped updates == as many with one launch a layer, bit for bit (W, states, step
    counts, the gradient norm); in backward order fc3, fc1 and fc0 (no bias) go in one launch, the
    biased fc2 in its own (launch_forge), and nothing is left pending."""
    ref_model, ref, model, opt, dtype = _pair(case)
    K = model.fcs[0].in_features
    steps = 1 if CASES[case][2].get("state_dtype") == "int8" else 2  # (the big model: interpreter time)
    for x in batches(steps, shape=(1, 8, K), dtype=dtype):
        for m, o in ((ref_model, ref), (model, opt)):
            _loss(m, x.to(DEV)).backward()
            o.step()
            o.zero_grad()
    _same(model, opt, ref_model, ref)
    assert opt._pending == []
    assert launches == [3] * steps
    if DEV == "cpu":
        assert ref.last_grad_norm == opt.last_grad_norm
    else:  # compiled, a tile's sum of squares may reduce in another order (one ulp apart on the H200, s19 first/)
        assert ref.last_grad_norm == pytest.approx(opt.last_grad_norm, rel=1e-6)


@needs_triton
@pytest.mark.parametrize("tiles,grid2d", [(1, False), (3, False), (3, True)])
def test_group_kernel_equals_launch_forge(tiles, grid2d):
    """The grouped kernel at 1 and 3 tiles a program (layers whose tile counts 3 does not divide),
    its layer found by a search or the grid's second axis, against one MODE_UPDATE launch a layer:
    W, m, v and each layer's sum of squares."""
    from leantrain.forge import group
    from leantrain.forge.kernel import MODE_UPDATE, launch_forge

    torch.manual_seed(0)
    hp = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    shapes = [(40, 48), (16, 32), (24, 16)]  # (interpreter tiles 16 x 16: 9, 2 and 2 of them)

    def layer(n, k):
        return dict(w=torch.randn(n, k, device=DEV).to(torch.bfloat16),
                    states=[torch.randn(n, k, device=DEV).to(torch.bfloat16) * 1e-2,
                            torch.rand(n, k, device=DEV).to(torch.bfloat16) * 1e-4],
                    g=torch.randn(n, k, device=DEV).to(torch.bfloat16), key=17 + n,
                    sq=torch.zeros((), device=DEV), ticket=torch.zeros((), dtype=torch.int32, device=DEV))

    mine = [layer(n, k) for n, k in shapes]
    ref = [{k: [x.clone() for x in v] if isinstance(v, list) else v.clone() if torch.is_tensor(v) else v
            for k, v in e.items()} for e in mine]
    group.launch_group(mine, kinds=["bf16", "bf16"], hp=hp, step=3, tiles=tiles, grid2d=grid2d)
    for e in ref:
        launch_forge(MODE_UPDATE, g=e["g"], w=e["w"], states=e["states"], kinds=["bf16", "bf16"], rule_name="adamw",
                     hp=hp, step=3, sr=True, key=e["key"], sq=e["sq"], ticket=e["ticket"])
    for a, b in zip(mine, ref):
        assert torch.equal(a["w"], b["w"]) and not torch.equal(a["w"], a["g"])
        for x, y in zip(a["states"], b["states"]):
            assert torch.equal(x, y)
        assert a["sq"].item() == pytest.approx(b["sq"].item(), rel=0 if DEV == "cpu" else 1e-6)
        assert int(a["ticket"]) == 0


@needs_triton
@pytest.mark.parametrize("case", ["adamw_fp32", "adamw_bf16_sr_bf16_states_bf16_dw"])
def test_grouped_replay_order_equals_the_eager_step(case, launches):
    """The device-scalar path a CUDA graph captures, emulated on CPU (warm-up and capture passes
    store nothing, then prepare / run / advance / step), with grouping, equals eager FORGE without it."""
    ref_model, ref, model, opt, dtype = _pair(case)
    K = model.fcs[0].in_features
    data = [x.to(DEV) for x in batches(2, shape=(1, 8, K), dtype=dtype)]
    emulate_replays(model, opt, data, ref_model, ref)
    _same(model, opt, ref_model, ref)
    assert launches and max(launches) == 3


@needs_triton
def test_nonfinite_layer_in_a_group_keeps_its_bits(launches):
    """A NaN in one grouped layer's gradient: its tiles store nothing (as one launch a layer
    would); the layers launched with it are updated, and the step flags it."""
    ref_model, ref, model, opt, dtype = _pair("adamw_fp32")
    x = batches(1, shape=(1, 8, model.fcs[0].in_features))[0].to(DEV)

    def nan_row(mod, inp, out):  # row 3 of fcs.0's dW becomes NaN
        out.register_hook(lambda g: torch.where(torch.arange(g.shape[-1], device=g.device) == 3, float("nan"), g))

    def poison(m):
        m.fcs[0].register_forward_hook(nan_row)

    for m in (ref_model, model):
        poison(m)
    w0, w1 = model.fcs[0].weight.detach().clone(), model.fcs[1].weight.detach().clone()
    for m, o in ((ref_model, ref), (model, opt)):
        _loss(m, x).backward()
        o.step()
    _same(model, opt, ref_model, ref)
    assert launches == [3]
    assert "fcs.0" in opt.last_nonfinite and "fcs.1" not in opt.last_nonfinite
    assert torch.isfinite(model.fcs[0].weight).all()
    assert torch.equal(model.fcs[0].weight[3], w0[3])  # the poisoned row's tiles kept their bits
    assert not torch.equal(model.fcs[1].weight, w1)  # the layer launched with it was updated


@pytest.mark.parametrize(("option", "var"), [("group_updates", "LEANTRAIN_FORGE_GROUP"),
                                              ("overlap", "LEANTRAIN_FORGE_OVERLAP")])
def test_flag_options_are_checked(option, var, monkeypatch):
    """attach's on / off options take booleans; their environment variables 0 / 1 override them."""
    with pytest.raises(TypeError, match=option):
        lt.forge.attach(Chain(), RULES["adamw"](), **{option: "yes"})
    monkeypatch.setenv(var, "2")
    with pytest.raises(ValueError, match=var):
        lt.forge.attach(Chain(), RULES["adamw"]())
    for env, want in (("1", True), ("0", False)):
        monkeypatch.setenv(var, env)
        assert getattr(lt.forge.attach(Chain(), RULES["adamw"](), **{option: not want}), option) is want


def test_torch_backend_ignores_grouping():
    """On the torch backend (CPU default) there is no split-path launch to group: the same run."""
    torch.manual_seed(0)
    ref_model = Chain()
    model = copy.deepcopy(ref_model)
    ref = lt.forge.attach(ref_model, RULES["adamw"](), backend="torch")
    opt = lt.forge.attach(model, RULES["adamw"](), backend="torch", group_updates=True)
    for x in batches(2, shape=(2, 8, 32)):
        for m, o in ((ref_model, ref), (model, opt)):
            _loss(m, x).backward()
            o.step()
            o.zero_grad()
    _same(model, opt, ref_model, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["adamw_bf16_sr_bf16_states_bf16_dw", "adamw_bf16_sr_int8"])
def test_graphed_grouped_equals_graphed_per_layer(case):
    """GraphedStep captures the grouped launches (their tables read by the graph's copies): 3
    replays with grouping == 3 without, bit for bit, and the grouped step launched fewer updates."""
    from leantrain.graphs import GraphedStep

    ref_model, ref, model, opt, dtype = _pair(case)
    data = [x.cuda() for x in batches(4, shape=(3, 40, model.fcs[0].in_features), dtype=dtype)]
    steps = {id(o): GraphedStep(lambda x, m=m: _loss(m, x), m.parameters(), data[0])
             for m, o in ((ref_model, ref), (model, opt))}
    for x in data[1:]:
        for o in (ref, opt):
            steps[id(o)](x)
            o.step()
            o.zero_grad(set_to_none=True)
    _same(model, opt, ref_model, ref)
    assert opt.group_updates and opt._pending == []

"""FORGE with device scalars (what a CUDA graph captures): the step's lr, bias corrections and
rounding keys read from a device table give the same bits as launch arguments; the warm-up pass
stores nothing; prepare-then-run (a replay's order) equals the eager step. On CPU through the
Triton interpreter; the captured graph itself: tests/test_graphs.py (GPU)."""

import copy

import pytest
import torch
from _forge_util import RULES, Net, batches
from _forge_util import assert_same_run as _same
from _forge_util import square_loss as _loss

import leantrain as lt
from leantrain.ops._backend import HAS_TRITON, interpreting

needs_triton = pytest.mark.skipif(not (HAS_TRITON and (interpreting() or torch.cuda.is_available())),
                                  reason="needs Triton (the interpreter on CPU)")
DEV = "cuda" if torch.cuda.is_available() else "cpu"

CASES = {  # name: (rule, weight dtype, attach kwargs)
    "adamw_fp32": ("adamw", torch.float32, {}),
    "adamw_bf16_sr_int8": ("adamw", torch.bfloat16, {"state_dtype": "int8"}),
    "adamw_bf16_sr_int8p": ("adamw", torch.bfloat16, {"state_dtype": "int8p"}),
    "adamw_bf16_sr_fp8": ("adamw", torch.bfloat16, {"state_dtype": "fp8"}),
    "lion_bf16_sr": ("lion", torch.bfloat16, {}),
    "sgd_nesterov_layer_clip": ("sgd_nesterov", torch.float32, {"clip": "layer", "clip_value": 0.05}),
    "adams_prev_global": ("adams", torch.float32, {"clip": "prev_global", "clip_value": 0.05}),
}


def _model(dtype):
    torch.manual_seed(0)
    return Net(k=40, h=48, n=24).to(DEV, dtype)


def _attach(model, case):
    rule, _, kw = CASES[case]
    return lt.forge.attach(model, RULES[rule](), backend="triton", seed=3, **kw)


@needs_triton
@pytest.mark.parametrize("case", list(CASES))
def test_device_scalars_give_the_argument_bits(case):
    """3 steps with the scalars from the device table == 3 steps with them as launch arguments."""
    dtype = CASES[case][1]
    ref_model = _model(dtype)
    model = copy.deepcopy(ref_model)
    ref, opt = _attach(ref_model, case), _attach(model, case)
    opt.set_device_scalars(True)
    for x in batches(3, shape=(2, 12, 40), dtype=dtype):
        for m, o in ((ref_model, ref), (model, opt)):
            _loss(m, x.to(DEV)).backward()
            o.step()
            o.zero_grad()
    _same(model, opt, ref_model, ref)
    assert opt.state[model.fc1.weight]["step"] == 3


@needs_triton
@pytest.mark.parametrize("case", ["adamw_fp32", "adamw_bf16_sr_int8", "adamw_bf16_sr_int8p", "adamw_bf16_sr_fp8",
                                  "sgd_nesterov_layer_clip"])
def test_replay_order_equals_the_eager_step(case):
    """What GraphedStep does, with the graph replaced by running the same code again (on CPU the
    "captured" launches run at once): a warm-up pass (NaN gate: nothing stored, no step
    counted), a capture pass (the table still gated: nothing stored; the layer slots recorded),
    then per step: prepare (table rows, step counts), the captured backward, opt.step(). The
    weights, states and steps equal eager FORGE's bit for bit."""
    dtype = CASES[case][1]
    ref_model = _model(dtype)
    model = copy.deepcopy(ref_model)
    ref, opt = _attach(ref_model, case), _attach(model, case)
    data = [x.to(DEV) for x in batches(4, shape=(2, 12, 40), dtype=dtype)]
    opt.capture_check()
    before = copy.deepcopy(model)
    for phase in ("dry", "capture"):
        opt.capture_phase(phase)
        _loss(model, data[0]).backward()
        if phase == "dry":
            opt.capture_phase(None)
        for p in model.parameters():
            p.grad = None
    for p, q in zip(model.parameters(), before.parameters()):
        assert torch.equal(p, q)  # neither pass stored anything
    assert all(not s or s["step"] == 0 for s in opt.state.values())  # (states made by the warm-up)
    slots = list(opt._graph_slots)
    assert slots == [1, 0]  # fc2 then fc1: backward order
    for x in data:
        opt.capture_prepare()
        _loss(model, x).backward()  # the "replay"
        opt.capture_advance()
        opt._graph_slots = list(slots)  # (a real replay runs no Python: nothing re-recorded)
        opt.step()
        opt.zero_grad()
        _loss(ref_model, x).backward()
        ref.step()
        ref.zero_grad()
    opt.capture_phase(None)
    _same(model, opt, ref_model, ref)
    assert opt.state[model.fc1.weight]["step"] == len(data)


@needs_triton
def test_replayed_twice_without_step_is_an_error():
    model = _model(torch.float32)
    opt = _attach(model, "adamw_fp32")
    opt.capture_check()
    x = batches(1, shape=(2, 12, 40))[0].to(DEV)
    opt.capture_phase("capture")
    with pytest.raises(RuntimeError, match="created inside a CUDA graph capture"):
        _loss(model, x).backward()  # no warm-up pass: the states do not exist yet
    opt.capture_phase("dry")
    _loss(model, x).backward()
    opt.capture_phase("capture")
    _loss(model, x).backward()
    opt.capture_prepare()
    opt.capture_advance()
    with pytest.raises(RuntimeError, match="replayed twice"):
        opt.capture_prepare()


def test_graph_check_says_what_is_missing():
    model = Net()
    opt = lt.forge.attach(model, RULES["adamw"](), backend="torch")
    with pytest.raises(ValueError, match="Triton backend"):
        opt.set_device_scalars(True)
    with pytest.raises(ValueError, match="GraphedStep with FORGE needs the Triton backend"):
        opt.capture_check()
    lt.forge.detach(model)
    if HAS_TRITON and interpreting():
        opt = lt.forge.attach(model, RULES["adamw"](), backend="triton", clip="prev_global")
        with pytest.raises(ValueError, match="prev_global': one eager step first"):
            opt.capture_check()


def test_next_table_made_after_the_replay_equals_a_fresh_one():
    """capture_advance makes the next replay's steps and rounding keys while the GPU runs the
    current one; the table uploaded from them equals one made from scratch, also after the lr
    changed in between (an LR scheduler), and nothing stale is used after an eager update or a
    load_state_dict (both move step counts)."""
    from leantrain.forge.optimizer import _DynTable

    model = Net(k=40, h=48, n=24)
    opt = lt.forge.attach(model, RULES["adamw"](), backend="torch", seed=3)
    x = batches(1, shape=(2, 12, 40))[0]
    _loss(model, x).backward()
    opt.step()
    opt.zero_grad()
    opt._dyn = _DynTable(len(opt.layers), "cpu")
    opt._graph_slots = [layer.slot for layer in opt.layers]

    def fresh():
        opt._dyn_next = None
        opt._upload_dyn(1.0)
        return opt._dyn.dev.clone()

    for lr in (1e-2, 3e-3):  # the second round: the scheduler moved lr after the precompute
        opt.capture_prepare()
        opt.capture_advance()
        assert opt._dyn_next is not None and opt._dyn_next[0] == opt._step_id + 1
        opt._step_id += 1  # (what step() does)
        for g in opt.param_groups:
            g["lr"] = lr
        nxt = opt._dyn_next
        opt._upload_dyn(1.0)
        cached = opt._dyn.dev.clone()
        assert opt._dyn_next is None  # (used once)
        assert torch.equal(cached, fresh())
        assert torch.equal(torch.from_numpy(nxt[1]), torch.tensor([opt.state[layer.weight]["step"] + 1
                                                                   for layer in opt.layers]))
        assert cached[0, 0].item() == pytest.approx(lr)
    opt.capture_advance()
    sw, sb = opt._layer_states(opt.layers[0])
    opt._advance(opt.layers[0], sw, sb)  # an eager update: step counts moved
    assert opt._dyn_next is None
    opt.capture_advance()
    opt.load_state_dict(opt.state_dict())
    assert opt._dyn_next is None

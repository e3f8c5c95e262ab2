"""FORGE's updates on a side stream (``attach(overlap=True)``, on CUDA) give the bits of
the same updates run in line: eager, with the side stream held back (a race on the ring of dW
workspaces, or a read of W before the end-of-backward join, would show), and captured by
GraphedStep. On CPU: the option's checks, and that nothing changes there."""

import copy

import pytest
import torch
from _forge_util import RULES, batches
from _forge_util import assert_same_run as _same
from _forge_util import square_loss as _loss
from torch import nn

import leantrain as lt
from leantrain.forge import launch as forge_kernel

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class Deep(nn.Module):
    """Five linears of different shapes (the ring of two workspaces wraps twice) and a norm."""

    def __init__(self, k=64, widths=(96, 128, 80, 112, 48)):
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
    "adamw_bf16_sr_bf16_states_bf16_dw": ("adamw", torch.bfloat16, {"state_dtype": "bf16", "grad_dtype": "bf16"}),
    "adamw_bf16_sr_int8": ("adamw", torch.bfloat16, {"state_dtype": "int8"}),
    "adamw_bf16_sr_int8p": ("adamw", torch.bfloat16, {"state_dtype": "int8p"}),
    "adamw_bf16_sr_fp8": ("adamw", torch.bfloat16, {"state_dtype": "fp8"}),
    "lion_fp32_layer_clip": ("lion", torch.float32, {"clip": "layer", "clip_value": 0.05}),
    "adams_fp32_est_global": ("adams", torch.float32, {"clip": "est_global", "clip_value": 0.05}),
}


def _pair(case):
    rule, dtype, kw = CASES[case]
    torch.manual_seed(0)
    ref_model = Deep().cuda().to(dtype)
    model = copy.deepcopy(ref_model)
    ref = lt.forge.attach(ref_model, RULES[rule](), seed=3, overlap=False, **kw)
    opt = lt.forge.attach(model, RULES[rule](), seed=3, overlap=True, **kw)
    data = [x.cuda() for x in batches(5, shape=(3, 40, 64), dtype=dtype)]
    return ref_model, ref, model, opt, data


@pytest.fixture
def slow_side(monkeypatch):
    """Every update launch first holds its stream for ~1 ms (torch.cuda._sleep): on the side stream,
    the backward's next layers run far ahead of the updates. Returns the streams the updates ran on."""
    real = forge_kernel.launch_forge
    streams = []

    def launch(mode, **kw):
        if mode == forge_kernel.MODE_UPDATE:
            streams.append(torch.cuda.current_stream())
            torch.cuda._sleep(2_000_000)
        return real(mode, **kw)

    monkeypatch.setattr(forge_kernel, "launch_forge", launch)
    return streams


def test_overlap_option_is_checked():
    """attach(overlap=...) takes a boolean."""
    with pytest.raises(TypeError, match="overlap"):
        lt.forge.attach(Deep(), RULES["adamw"](), overlap="yes")
    for want in (True, False):
        assert lt.forge.attach(Deep(), RULES["adamw"](), overlap=want).overlap is want


def test_workspace_ring_takes_turns():
    """With a ring of two, consecutive layers get different buffers and every second one the same
    (per dtype; each grown to the largest request); a ring of one always hands out one buffer."""
    from leantrain.forge.optimizer import _Workspace

    ws = _Workspace()
    a, b, c = (ws.get(n, "cpu", torch.float32, ring=2) for n in (100, 40, 60))
    assert (a.numel(), b.numel(), c.numel()) == (100, 40, 60)
    assert a.data_ptr() != b.data_ptr() and a.data_ptr() == c.data_ptr()
    d = ws.get(500, "cpu", torch.float32, ring=2)  # b's turn: grown
    assert d.numel() == 500 and len(ws.bufs) == 2
    e = ws.get(10, "cpu", torch.bfloat16, ring=2)
    assert e.dtype == torch.bfloat16 and len(ws.bufs) == 3
    one = _Workspace()
    assert one.get(30, "cpu").data_ptr() == one.get(20, "cpu").data_ptr()
    ws.release()
    assert not ws.bufs and not ws.events


def test_overlap_changes_nothing_off_cuda():
    """On CPU (torch backend) there is no side stream: overlap on and off are the same run."""
    torch.manual_seed(0)
    ref_model = Deep()
    model = copy.deepcopy(ref_model)
    ref = lt.forge.attach(ref_model, RULES["adamw"](), overlap=False)
    opt = lt.forge.attach(model, RULES["adamw"](), overlap=True)
    for x in batches(3, shape=(2, 8, 64)):
        for m, o in ((ref_model, ref), (model, opt)):
            _loss(m, x).backward()
            o.step()
            o.zero_grad()
    assert opt._side is None
    _same(model, opt, ref_model, ref)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("slow", [False, True])
def test_overlap_equals_in_line(case, slow, request):
    """5 eager steps with the updates on the side stream == in line, bit for bit. Held back, the
    side stream finishes long after the backward issued everything: the weights read right after
    backward() (before step()) are still the updated ones (the end-of-backward join), and the dW
    workspaces were not rewritten under a running update (the ring's events)."""
    streams = request.getfixturevalue("slow_side") if slow else None
    ref_model, ref, model, opt, data = _pair(case)
    for x in data:
        _loss(ref_model, x).backward()
        _loss(model, x).backward()
        after = [p.clone() for p in model.parameters()]  # on the current stream, right after backward
        fused = [i for i, p in enumerate(model.parameters()) if p.grad is None]  # (updated in backward)
        assert len(fused) == 8  # five weights, three biases
        for i, q in enumerate(ref_model.parameters()):
            if i in fused:
                assert torch.equal(after[i], q), i
        for o in (ref, opt):
            o.step()
            o.zero_grad()
    assert opt._side is not None and not opt._side_busy
    if slow:  # the reference's updates ran in line, this optimizer's on its side stream
        assert {s.cuda_stream for s in streams} == {torch.cuda.current_stream().cuda_stream, opt._side.cuda_stream}
    assert len(opt._workspace.bufs) == 0  # released by step()
    _same(model, opt, ref_model, ref)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("slow", [False, True])
def test_graphed_overlap_equals_in_line(slow, request):
    """GraphedStep captures the side stream's updates (forked from and joined into the capture):
    4 replays with overlap == 4 replays in line, bit for bit (both captured the same way)."""
    if slow:
        request.getfixturevalue("slow_side")
    from leantrain.runtime.capture import GraphedStep

    ref_model, ref, model, opt, data = _pair("adamw_bf16_sr_int8")
    steps = {}
    for m, o in ((ref_model, ref), (model, opt)):
        steps[id(o)] = GraphedStep(lambda x, m=m: _loss(m, x), m.parameters(), data[0],
                                   hooks=[o.capture_hooks] if hasattr(o, "capture_hooks") else [])
    for x in data[1:]:
        for o in (ref, opt):
            steps[id(o)](x)
            o.step()
            o.zero_grad(set_to_none=True)
    _same(model, opt, ref_model, ref)
    assert opt.state[model.fcs[0].weight]["step"] == len(data) - 1

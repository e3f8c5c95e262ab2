"""The split path's updates as programmatic dependent launches (``LEANTRAIN_FORGE_PDL=1``, Hopper):
an update's programs may start while the dW GEMM before it finishes, reading W and its state
first and dW only after ``gdc_wait``. The bits must be those of plain launches: eager, under
GraphedStep, for bf16 / fp32 / 8-bit states. Off CUDA (and in the interpreter) the option is off."""

import pytest
import torch
from _forge_util import RULES, batches
from _forge_util import assert_same_run as _same
from _forge_util import square_loss as _loss
from test_forge_overlap import Deep

import leantrain as lt
from leantrain.forge import kernel as forge_kernel

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CASES = {  # name: (rule, weight dtype, attach kwargs)
    "adamw_bf16_sr_bf16_states_bf16_dw": ("adamw", torch.bfloat16, {"state_dtype": "bf16", "grad_dtype": "bf16"}),
    "adamw_fp32": ("adamw", torch.float32, {}),
    "adamw_bf16_sr_int8p": ("adamw", torch.bfloat16, {"state_dtype": "int8p"}),
    "lion_fp32_layer_clip": ("lion", torch.float32, {"clip": "layer", "clip_value": 0.05}),
}


def test_pdl_is_off_on_cpu(monkeypatch):
    monkeypatch.setenv(forge_kernel.PDL_ENV, "1")
    assert forge_kernel.pdl_enabled(torch.device("cpu")) is False
    monkeypatch.setenv(forge_kernel.PDL_ENV, "0")
    assert forge_kernel.pdl_enabled(torch.device("cpu")) is False


def test_pdl_request_ignored_off_gpu():
    """launch_forge(pdl=True) where it cannot apply (CPU / interpreter): a plain launch, same bits."""
    torch.manual_seed(0)
    n, k = 32, 48
    g = torch.randn(n, k)
    outs = []
    for pdl in (False, True):
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(1))
        m, v = torch.zeros_like(w), torch.zeros_like(w)
        forge_kernel.launch_forge(forge_kernel.MODE_UPDATE, w=w, states=[m, v], kinds=["fp32", "fp32"], g=g,
                                  rule_name="adamw", hp={"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8,
                                                         "weight_decay": 0.1}, step=1, pdl=pdl)
        outs.append((w, m, v))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def _run(case, pdl, monkeypatch, graphed=False):
    monkeypatch.setenv(forge_kernel.PDL_ENV, "1" if pdl else "0")
    rule, dtype, kw = CASES[case]
    torch.manual_seed(0)
    model = Deep().cuda().to(dtype)
    opt = lt.forge.attach(model, RULES[rule](), seed=3, **kw)
    data = [x.cuda() for x in batches(5, shape=(3, 40, 64), dtype=dtype)]
    step = None
    if graphed:
        from leantrain.graphs import GraphedStep

        step = GraphedStep(lambda x: _loss(model, x), model.parameters(), data[0])
        data = data[1:]
    for x in data:
        if step is not None:
            step(x)
        else:
            _loss(model, x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return model, opt


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("graphed", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_pdl_equals_plain_launches(case, graphed, monkeypatch):
    ref_model, ref = _run(case, False, monkeypatch, graphed)
    model, opt = _run(case, True, monkeypatch, graphed)
    dev = next(model.parameters()).device
    assert ref._pdl.get(dev) is False
    if torch.cuda.get_device_capability(dev)[0] >= 9:  # Hopper: PDL must really be in use
        assert opt._pdl.get(dev) is True
        assert any(p.meta.get("launch_pdl") for p in forge_kernel._PLANS.values())
    _same(model, opt, ref_model, ref)

"""FORGE with grad_dtype="bf16": a bf16 layer's materialized dW is the bf16 matmul's, as in
torch's bf16 backward; the update applied to it is the reference rule's."""

import copy

import pytest
import torch
from _forge_util import RULES, Net, batches, max_rel, train

import leantrain as lt
from leantrain.ops._backend import HAS_TRITON, interpreting

needs_triton = pytest.mark.skipif(not (HAS_TRITON and (interpreting() or torch.cuda.is_available())),
                                  reason="needs Triton (the interpreter on CPU)")


@needs_triton
@pytest.mark.parametrize("rule", ["adamw", "lion", "sgd_mom"])
def test_bf16_grads_follow_the_reference_on_bf16_grads(rule):
    """bf16 model, 3 steps: FORGE (Triton, dW in bf16; clip="layer" at a bound never reached, so
    every layer takes the materialized path, also on CPU) against ``lt.optim.Optimizer`` on
    autograd's bf16 gradients, both rounding to nearest. Weights within one bf16 rounding,
    states within 1e-3 (a weight that rounded the other way changes the next gradient a little)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    ref_model = Net().to(dev, torch.bfloat16)
    model = copy.deepcopy(ref_model)
    data = [x.to(dev) for x in batches(3, dtype=torch.bfloat16)]
    ref = lt.optim.Optimizer(ref_model.parameters(), RULES[rule](), backend="torch")
    opt = lt.forge.attach(model, RULES[rule](), backend="triton", stochastic_rounding=False,
                          clip="layer", clip_value=1e30, grad_dtype="bf16")
    train(ref_model, ref, data)
    train(model, opt, data)
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert p.dtype == torch.bfloat16
        assert max_rel(p.float(), q.float()) <= 2 ** -7, name
    for p, q in zip(model.parameters(), ref_model.parameters()):
        for k in RULES[rule]().state_names:
            assert max_rel(opt.state[p][k].float(), ref.state[q][k].float()) < 1e-3, k


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_workspace_dtype_follows_the_inputs(dtype):
    """grad_dtype="bf16" materializes dW in bf16 for bf16 inputs only; fp32 inputs keep fp32."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = Net().to(dev, dtype)
    opt = lt.forge.attach(model, RULES["adamw"](), backend="triton", clip="layer", clip_value=1e30,
                          grad_dtype="bf16")
    seen, real_get = [], opt._workspace.get

    def get(numel, device, dt=torch.float32, ring=1):
        seen.append(dt)
        return real_get(numel, device, dt, ring)

    opt._workspace.get = get
    model(batches(1, dtype=dtype)[0].to(dev)).float().square().mean().backward()
    opt.step()
    assert seen == [dtype, dtype]  # the two linears


def test_grad_dtype_is_checked():
    with pytest.raises(ValueError, match="grad_dtype"):
        lt.forge.attach(Net(), RULES["adamw"](), grad_dtype="fp16")

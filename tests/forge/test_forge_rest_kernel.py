"""Non-fused parameters (norms, embeddings) stepped by the kernel's update-only mode."""

import copy

import pytest
import torch
from _forge_util import RULES, Net, batches, train
from torch import nn

import leantrain as lt
from leantrain.ops._backend import HAS_TRITON, interpreting
from leantrain.optim.state import StateStorage

pytestmark = pytest.mark.skipif(not (HAS_TRITON and (interpreting() or torch.cuda.is_available())),
                                reason="needs Triton (interpreter or CUDA)")
DEV = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"  # compiled on a GPU


class EmbNet(nn.Module):
    """An untied embedding (2-D, non-fused) and a LayerNorm (1-D) around one linear."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(40, 24)
        self.norm = nn.LayerNorm(24)
        self.fc = nn.Linear(24, 40)

    def forward(self, idx):
        return self.fc(self.norm(self.emb(idx)))


def _torch_and_triton(base, rule, steps, monkeypatch, **attach_kw):
    """Train copies of ``base`` with FORGE on the torch and the Triton backend on the same data.
    Returns (shapes stepped by the rest kernel, parameters by backend, norm weight's state by backend)."""
    calls = []
    real = lt.forge.ForgeOptimizer._step_rest_kernel
    monkeypatch.setattr(lt.forge.ForgeOptimizer, "_step_rest_kernel",
                        lambda self, p, *a: calls.append(tuple(p.shape)) or real(self, p, *a))
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 40, (3, 7), generator=g).to(DEV) for _ in range(steps)]
    out, states = {}, {}
    for backend in ("torch", "triton"):
        m = copy.deepcopy(base)
        opt = lt.forge.attach(m, RULES[rule](), backend=backend, **attach_kw)
        for idx in data:
            loss = nn.functional.cross_entropy(m(idx).flatten(0, 1), idx.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        out[backend] = {n: p.detach().clone() for n, p in m.named_parameters()}
        states[backend] = opt.state[m.norm.weight]
    return calls, out, states


@pytest.mark.parametrize("rule", ["adamw", "sgd_mom", "lion"])
def test_rest_params_on_the_kernel_match_the_torch_rule(rule, monkeypatch):
    torch.manual_seed(0)
    calls, out, _ = _torch_and_triton(EmbNet().to(DEV), rule, 4, monkeypatch)
    assert len(calls) == 3 * 4  # emb, norm weight, norm bias: on the kernel (triton only)
    for n in ("emb.weight", "norm.weight", "norm.bias"):
        torch.testing.assert_close(out["triton"][n], out["torch"][n], rtol=1e-6, atol=1e-7, msg=n)


def test_nonfinite_gradient_leaves_the_whole_rest_parameter_unchanged():
    torch.manual_seed(0)
    m = Net().to(DEV)
    opt = lt.forge.attach(m, RULES["adamw"](), backend="triton")
    train(m, opt, [b.to(DEV) for b in batches(2)])
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    m.norm.weight.register_hook(lambda gr: torch.where(torch.arange(gr.numel(), device=gr.device) == 5, float("nan"), gr))
    train(m, opt, [b.to(DEV) for b in batches(1, seed=3)])
    assert torch.equal(m.norm.weight, before["norm.weight"])  # one NaN element: nothing of it stepped
    assert not torch.equal(m.norm.bias, before["norm.bias"])  # its finite neighbour did step
    assert "norm.weight" in opt.last_nonfinite


class WideEmbNet(EmbNet):
    """EmbNet with 272 features: the norm's 1-D states are packed 8-bit (two flat blocks, the
    second partial), run on the kernel as a [17, 16] view."""

    def __init__(self):
        nn.Module.__init__(self)
        self.emb = nn.Embedding(40, 272)
        self.norm = nn.LayerNorm(272)
        self.fc = nn.Linear(272, 40)


def test_rest_params_with_packed_int8_states_on_the_kernel_match_the_torch_rule(monkeypatch):
    torch.manual_seed(0)
    calls, out, states = _torch_and_triton(WideEmbNet().to(DEV), "adamw", 2, monkeypatch, state_dtype="int8p")
    assert set(calls) == {(40, 272), (272,)} and len(calls) == 3 * 2
    st = states["triton"]
    assert st["exp_avg"].dtype == torch.uint8 and st["exp_avg"].shape == (512,) and "exp_avg_absmax" not in st
    for k in ("exp_avg", "exp_avg_sq"):  # the same states up to the codes a last-bit difference of
        # the rule flips (the paths' rule arithmetic differs in its last bits, as the fp32 test's 1e-6)
        assert (st[k] != states["torch"][k]).float().mean() < 0.05, k
        a, b = (StateStorage.read(s, k, k == "exp_avg", (272,)) for s in (st, states["torch"]))
        assert (a - b).abs().max() <= 0.03 * b.abs().max(), k
    for n in ("emb.weight", "norm.weight", "norm.bias"):
        torch.testing.assert_close(out["triton"][n], out["torch"][n], rtol=1e-4, atol=1e-6, msg=n)

"""The save path: every saved tensor goes through the packer (counted), roles come from module
context (custom autograd Functions included), never-quantize rules, dedup, persistent apply,
and the tiny Llama's gradients with AGoQ stay within a stated bound of the exact ones."""

import pytest
import torch
from _agoqlib import count_saved
from torch import nn

import leantrain as lt
from leantrain.agoq import Policy, apply, quantize_activations, remove
from leantrain.agoq.calibrate import gradient_error, param_grads
from leantrain.config import ModelConfig, preset
from leantrain.model import Llama

SMALL = ModelConfig(vocab_size=512, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, max_seq_len=64)


def _batch(vocab, B, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (B, T), generator=g), torch.randint(0, vocab, (B, T), generator=g)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-proj-swiglu", "separate"])
@pytest.mark.parametrize("fused_loss", [True, False])
def test_hook_sees_every_saved_tensor(fused_loss, fused):
    torch.manual_seed(0)
    m = Llama(ModelConfig(**{**SMALL.__dict__, "fused_loss": fused_loss, "fused_proj": fused, "fused_swiglu": fused}))
    idx, tgt = _batch(512, 2, 64)
    n_plain, _ = count_saved(lambda: m(idx, tgt))
    with quantize_activations(m, Policy(), record=True) as pk:
        loss = m(idx, tgt)
    st = pk.stats
    assert st["saved"] == n_plain == len(pk.log)
    decided = st["packed"] + st["dedup"] + st["derived"] + sum(v for k, v in st.items() if k.startswith("kept:"))
    assert decided == st["saved"]  # nothing skipped silently
    # recomputed, not stored (policy.derive): the down projection's input (from the fused SwiGLU's
    # saves: "swiglu"), and op by op silu(g) as well ("silu", "mul")
    derived = ["down_in"] if fused else ["gate_up", "down_in"]
    assert [e["role"] for e in pk.log if e["why"] == "derived"] == derived * SMALL.n_layers
    packed_roles = {e["role"] for e in pk.log if e["why"] == "packed"}
    # the fused LM head + loss saves no log-softmax: only its input (head_in) and the lse (a stat)
    assert packed_roles == {"qkv_in", "attn", "o_in", "mlp_in", "gate_up", "norm", "head_in"} | (
        set() if fused_loss else {"logits"})
    kept = {e["why"] for e in pk.log if e["bits"] is None}
    assert {"param", "integer", "stat"} <= kept
    if fused_loss:  # the lse [N, 1] (no grad, a statistic), kept exact under the LM head's role
        assert any(e["role"] == "head_in" and e["shape"] == (2 * 64, 1) and e["bits"] is None for e in pk.log)
    for e in pk.log:  # rstd (last dim 1) and the SDPA log-sum-exp are never quantized
        if e["shape"][-1:] == (1,) or (e["role"] == "attn" and len(e["shape"]) == 3):
            assert e["bits"] is None, e
    if not fused:
        assert st["dedup"] >= 2 * SMALL.n_layers  # q/k/v share one input, gate/up another
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


class _SaveFn(torch.autograd.Function):
    """Saves its input with save_for_backward (FORGE-style) and one tensor on ctx via agoq.save."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        ctx.extra = lt.agoq.save(x * 1.0)  # a ctx attribute goes through the same packer
        return x @ w.t()

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        extra = lt.agoq.load(ctx.extra)
        assert extra.shape == x.shape and extra.dtype == x.dtype
        return gy @ w, gy.flatten(0, -2).t() @ x.flatten(0, -2)


class _MyLinear(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) * 0.1)

    def forward(self, x):
        return _SaveFn.apply(x, self.weight)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = _MyLinear(64, 64)
        self.up_proj = nn.Linear(64, 64, bias=False)

    def forward(self, x):
        h = self.fc(x)
        mask = x[..., :1] > 0  # a boolean mask saved by masked_fill
        return (self.up_proj(h) + self.up_proj(h).relu()).masked_fill(mask, 0.0).square().mean()


def test_custom_function_and_masks_go_through_the_packer():
    torch.manual_seed(0)
    net = _Net()
    x = torch.randn(4, 32, 64, requires_grad=True)
    with quantize_activations(net, Policy(min_numel=64), record=True) as pk:
        loss = net(x)
    roles = [(e["role"], e["bits"], e["why"]) for e in pk.log]
    assert ("linear_in", 4, "packed") in roles  # custom Function's save_for_backward, role from the module
    assert ("linear_in", None, "param") in roles
    assert pk.stats["bits1"] == 1  # the boolean mask: 1 bit
    assert sum(1 for e in pk.log if e["role"] == "linear_in" and e["why"] in ("packed", "dedup")) == 2
    assert pk.stats["dedup"] >= 1  # up_proj saves h twice
    loss.backward()  # _SaveFn.backward checks the ctx-attribute tensor came back whole
    assert x.grad is not None and net.fc.weight.grad is not None


def test_apply_and_remove_persistent():
    torch.manual_seed(0)
    m = Llama(SMALL)
    idx, tgt = _batch(512, 2, 32)
    pk = apply(m, Policy())
    m(idx, tgt).backward()
    first = pk.stats["packed"]
    assert first > 0
    m(idx, tgt).backward()
    assert pk.stats["packed"] == 2 * first
    remove(m)
    assert not m._forward_hooks and not m._forward_pre_hooks
    assert all(not mod._forward_hooks and not mod._forward_pre_hooks for mod in m.modules())
    m(idx, tgt).backward()
    assert pk.stats["packed"] == 2 * first


# Per-layer bound, tiny preset model, B = 4, T = 128, default policy (stochastic rounding):
# measured max 0.29 (layers.0 down_proj; with 4-bit attention it was 0.49 on the q/k
# projections), the whole gradient 0.14, every layer <= 0.2x the batch-to-batch difference.
# We require every layer <= 0.6 and <= 0.5x the gradient's own sampling noise (the relative
# difference between two batches' gradients, >= 1.2 for every layer here: AGoQ's error is far
# below SGD's own noise). A random-init model hides the attention problem (see
# test_agoq_fidelity.py and agoq/README.md "Convergence").
PER_LAYER_BOUND = 0.6
TOTAL_BOUND = 0.2


@pytest.mark.slow
def test_tiny_llama_gradients_within_bound():
    cfg = preset("tiny").model
    torch.manual_seed(0)
    m = Llama(cfg)
    b2 = [_batch(cfg.vocab_size, 4, 128, seed=11)]
    b1 = [_batch(cfg.vocab_size, 4, 128, seed=1)]
    ref = param_grads(m, b1)
    ref2 = param_grads(m, b2)
    e = gradient_error(m, b1, Policy(), reference=ref)
    assert e["total"] < TOTAL_BOUND
    for name, err in e["per_param"].items():
        noise = ((ref2[name] - ref[name]).norm() / ref[name].norm()).item()
        assert err < PER_LAYER_BOUND, (name, err)
        assert err < 0.5 * noise, (name, err, noise)
    # 8 bits everywhere: an order of magnitude closer
    e8 = gradient_error(m, b1, Policy(**{r: 8 for r in lt.agoq.ROLES}), reference=ref)
    assert e8["total"] < 0.02


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_bf16_model_backward_runs(dtype):
    torch.manual_seed(0)
    m = Llama(SMALL).to(dtype)
    idx, tgt = _batch(512, 2, 32)
    with quantize_activations(m, Policy()):
        loss = m(idx, tgt)
    loss.backward()
    assert all(p.grad.dtype == dtype and torch.isfinite(p.grad).all() for p in m.parameters())

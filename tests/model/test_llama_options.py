"""Llama's options for models brought from Hugging Face: attention_bias, qk_norm, head_dim,
rope_scaling, sliding_window (each off by default, the default model unchanged)."""

import dataclasses

import pytest
import torch

from leantrain.config import ModelConfig
from leantrain.model import Llama, rope_tables
from leantrain.model.llama import rope_inv_freq

CFG = ModelConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=24)


def test_default_model_has_no_new_parameters():
    names = set(Llama(CFG).state_dict())
    assert not any(n.endswith(".bias") or "q_norm" in n or "k_norm" in n for n in names)
    assert Llama(CFG).layers[0].self_attn.qkv_proj.weight.shape == (32 + 2 * 16, 32)


@pytest.mark.parametrize("fused", [True, False])
def test_biases_and_qk_norm_load_in_either_projection_layout(fused):
    torch.manual_seed(0)
    cfg = dataclasses.replace(CFG, attention_bias=True, qk_norm=True, head_dim=12, fused_proj=fused)
    src = Llama(cfg)
    with torch.no_grad():
        for p in src.parameters():
            p.add_(0.1 * torch.randn_like(p))
    dst = Llama(dataclasses.replace(cfg, fused_proj=not fused))
    dst.load_state_dict(src.state_dict())
    x = torch.randint(0, 61, (2, 10))
    torch.testing.assert_close(dst(x), src(x), atol=1e-5, rtol=1e-5)
    attn = src.layers[0].self_attn
    assert attn.q_norm.weight.shape == (12,) and attn.o_proj.weight.shape == (32, 4 * 12)


def test_biases_start_at_zero():
    model = Llama(dataclasses.replace(CFG, attention_bias=True))
    assert all(torch.count_nonzero(p) == 0 for n, p in model.named_parameters() if n.endswith(".bias"))


def test_rope_scaling_identities():
    base = rope_inv_freq(16, 10000.0)
    # llama3 with factor 1 scales nothing
    torch.testing.assert_close(rope_inv_freq(16, 10000.0, scaling="llama3", factor=1.0), base)
    # llama3: the highest frequencies kept, the lowest divided by factor
    scaled = rope_inv_freq(16, 500000.0, scaling="llama3", factor=8.0, low_freq_factor=1.0,
                           high_freq_factor=4.0, original_max_seq_len=64)
    plain = rope_inv_freq(16, 500000.0)
    assert scaled[0] == plain[0] and torch.isclose(scaled[-1], plain[-1] / 8)
    # linear factor 2: position 2t sees what position t saw
    cos2, _ = rope_tables(16, 20, 10000.0, scaling="linear", factor=2.0)
    cos1, _ = rope_tables(16, 10, 10000.0)
    torch.testing.assert_close(cos2[::2], cos1)
    with pytest.raises(ValueError, match="yarn"):
        rope_inv_freq(16, 10000.0, scaling="yarn")


def test_sliding_window_refuses_longer_sequences():
    model = Llama(dataclasses.replace(CFG, sliding_window=8))
    assert model(torch.randint(0, 61, (1, 8))).shape == (1, 8, 61)
    with pytest.raises(ValueError, match="sliding window") as err:
        model(torch.randint(0, 61, (1, 9)))
    assert "\n" not in str(err.value)


def test_forge_steps_a_model_with_biases_and_qk_norm_as_the_reference_does():
    """Every matrix stays an nn.Linear (the biases with them): FORGE's fused step equals the
    unfused reference optimizer on a Qwen-shaped model."""
    import copy

    import leantrain as lt

    torch.manual_seed(0)
    m0 = Llama(dataclasses.replace(CFG, attention_bias=True, qk_norm=True, head_dim=12))
    m1 = copy.deepcopy(m0)
    rule = lt.optim.AdamW(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    ref, opt = lt.optim.Optimizer(m0.parameters(), rule), lt.forge.attach(m1, rule, backend="torch")
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        idx = torch.randint(0, 61, (2, 12), generator=g)
        for model, o in ((m0, ref), (m1, opt)):
            model(idx[:, :-1], idx[:, 1:]).backward()
            o.step()
            o.zero_grad()
    for (name, a), (_, b) in zip(m0.named_parameters(), m1.named_parameters(), strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5, msg=name)
    assert m1.layers[0].self_attn.qkv_proj.bias.abs().sum() > 0

"""Presets: functions returning a whole :class:`~leantrain.config.Config` (model sizes and the
training settings that go with them)."""

from __future__ import annotations

from leantrain.config.tree import Config, ConfigError, ModelConfig


def tiny() -> Config:
    """~3 M parameters: CPU, well under a second per step on 2 cores."""
    return Config(preset="tiny")


def small() -> Config:
    c = Config(preset="small")
    c.model = ModelConfig(dim=384, n_layers=6, n_heads=6, n_kv_heads=2, ffn_dim=1024, max_seq_len=512)
    c.data.tokenizer_vocab, c.data.seq_len = 8192, 256
    c.optim.lr = 1.5e-3
    return c


def m125() -> Config:
    c = Config(preset="125m")
    c.model = ModelConfig(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048, max_seq_len=1024)
    c.data.tokenizer_vocab, c.data.seq_len, c.data.batch_size = 32000, 1024, 8
    c.data.max_corpus_mb = 64.0
    c.optim.lr = 6e-4
    c.train.dtype = "bf16"
    return c


def b1() -> Config:
    """The TinyLlama-1.1B shape."""
    c = Config(preset="1b")
    c.model = ModelConfig(dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_dim=5632, max_seq_len=2048)
    c.data.tokenizer_vocab, c.data.seq_len, c.data.batch_size = 32000, 1024, 4
    c.data.max_corpus_mb = 64.0
    c.optim.lr = 3e-4
    c.train.dtype, c.train.weights = "bf16", "bf16"
    return c


def b7() -> Config:
    """The Llama-2-7B shape (32k vocabulary, no grouped-query attention), set for one-GPU
    fine-tuning: bf16 weights, batch 1 of 1024 tokens."""
    c = b1()
    c.preset = "7b"
    c.model = ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008, max_seq_len=4096)
    c.data.batch_size, c.optim.lr = 1, 2e-5
    return c


def b8() -> Config:
    """The Llama-3-8B shape (128k vocabulary, 8 K/V heads, RoPE base 500k), set for one-GPU
    fine-tuning: bf16 weights, batch 1 of 1024 tokens. ``--data.tokenizer-vocab 32000`` gives the
    shape with a 32k vocabulary."""
    c = b7()
    c.preset = "8b"
    c.model = ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, max_seq_len=8192,
                          rope_theta=500000.0)
    c.data.tokenizer_vocab = 128256
    return c


PRESETS = {"tiny": tiny, "small": small, "125m": m125, "1b": b1, "7b": b7, "8b": b8}


def preset(name: str) -> Config:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None

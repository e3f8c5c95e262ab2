"""Hugging Face directories in and out (leantrain.model.hf) against ``transformers`` itself:
tiny random Llama / Mistral / Qwen2 / Qwen3 models built and saved with ``save_pretrained`` here
(no download), loaded by leantrain, written back, loaded by ``AutoModelForCausalLM``.

Tolerance: fp32 logits of magnitude ~1 agree to atol 2e-5, rtol 1e-5 (the same math; the
summation order of SDPA and the matmuls differs)."""

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[dev]')")

from safetensors.torch import load_file, save_file  # noqa: E402

from leantrain.config import ConfigError, ModelConfig, preset  # noqa: E402
from leantrain.model import Llama  # noqa: E402
from leantrain.model.hf import from_pretrained, load_hf, save_hf, save_hf_state  # noqa: E402

ATOL, RTOL = 2e-5, 1e-5
SIZES = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
HAS_QWEN3 = hasattr(transformers, "Qwen3Config")


def _hf_config(kind: str):
    if kind == "llama":
        return transformers.LlamaConfig(**SIZES)
    if kind == "llama3-tied":  # Llama-3.1 RoPE, tied head, head_dim apart from hidden / heads
        return transformers.LlamaConfig(**SIZES, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE,
                                        tie_word_embeddings=True, head_dim=16)
    if kind == "llama-linear":
        return transformers.LlamaConfig(**SIZES, rope_scaling={"rope_type": "linear", "factor": 2.0})
    if kind == "mistral":
        return transformers.MistralConfig(**SIZES, sliding_window=32)
    if kind == "qwen2":
        return transformers.Qwen2Config(**SIZES, tie_word_embeddings=True)
    if kind == "qwen3":
        return transformers.Qwen3Config(**SIZES, head_dim=16)
    raise AssertionError(kind)


KINDS = ["llama", "llama3-tied", "llama-linear", "mistral", "qwen2",
         pytest.param("qwen3", marks=pytest.mark.skipif(not HAS_QWEN3, reason="this transformers has no Qwen3"))]


def _hf_model(kind: str, seed: int = 0):
    """A random transformers model, every weight (norms and biases too) away from its init."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(kind)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return model


def _tokens(seed: int = 1, length: int = 24):
    return torch.randint(0, SIZES["vocab_size"], (2, length), generator=torch.Generator().manual_seed(seed))


def _hf_logits(model, idx):
    with torch.no_grad():
        return model(idx).logits.float()


def _load_transformers(path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info.get("mismatched_keys"), info
    return model.eval()


@pytest.mark.parametrize("kind", KINDS)
def test_load_then_export_matches_transformers(kind, tmp_path):
    hf = _hf_model(kind)
    hf.save_pretrained(tmp_path / "hf")
    idx = _tokens()
    want = _hf_logits(hf, idx)

    model = from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(model(idx), want, atol=ATOL, rtol=RTOL)

    save_hf(model, tmp_path / "out", max_shard_bytes=20_000)  # (shards with an index, too)
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    back = _load_transformers(tmp_path / "out")
    assert type(back) is type(hf)
    torch.testing.assert_close(_hf_logits(back, idx), want, atol=ATOL, rtol=RTOL)


def test_sharded_checkpoint_loads(tmp_path):
    hf = _hf_model("llama")
    hf.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1
    cfg, state, tok = load_hf(tmp_path / "hf")
    assert tok is None and cfg.n_layers == 2 and "layers.1.self_attn.qkv_proj.weight" in state
    model = Llama(cfg)
    model.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(_tokens()), _hf_logits(hf, _tokens()), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("tied", [False, True])
def test_leantrain_model_exports_as_llama(tied, tmp_path):
    torch.manual_seed(0)
    cfg = dataclasses.replace(preset("tiny").model, tie_embeddings=tied)
    model = Llama(cfg).eval()
    save_hf(model, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is tied
    assert ("lm_head.weight" in load_file(tmp_path / "out" / "model.safetensors")) is not tied
    back = _load_transformers(tmp_path / "out")
    idx = _tokens(length=20)
    with torch.no_grad():
        torch.testing.assert_close(_hf_logits(back, idx), model(idx), atol=ATOL, rtol=RTOL)


def test_checkpoint_state_without_tied_head_exports(tmp_path):
    """A checkpoint's state (a tied head stored once, separate projections) goes through save_hf_state."""
    cfg = ModelConfig(vocab_size=97, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=48, tie_embeddings=True,
                      fused_proj=False)
    model = Llama(cfg)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_hf_state(cfg, state, tmp_path / "out")
    _load_transformers(tmp_path / "out")
    with pytest.raises(ConfigError, match="not empty"):
        save_hf_state(cfg, state, tmp_path / "out")
    with pytest.raises(ConfigError, match="'layers.0.extra.weight'"):
        save_hf_state(cfg, {**state, "layers.0.extra.weight": torch.zeros(1)}, tmp_path / "other")


def _wordlevel_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "hello", "world", "[UNK]"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def test_tokenizer_in_and_out(tmp_path):
    template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=_wordlevel_tokenizer(), bos_token="<s>",
                                                eos_token="</s>", pad_token="<pad>")
    fast.chat_template = template
    hf = _hf_model("llama")
    hf.save_pretrained(tmp_path / "hf")
    fast.save_pretrained(tmp_path / "hf")

    _, _, tok = load_hf(tmp_path / "hf")
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.chat_template) == (1, 2, 0, template)
    assert tok.encode("hello world") == [3, 4]

    save_hf(from_pretrained(tmp_path / "hf"), tmp_path / "out", tokenizer=tok)
    back = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert back.eos_token == "</s>" and back.pad_token == "<pad>" and back.chat_template == template
    assert back("hello world", add_special_tokens=False)["input_ids"] == [3, 4]
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text())["eos_token_id"] == 2


def _edit_config(path, **fields):
    config = json.loads((path / "config.json").read_text())
    config.update(fields)
    (path / "config.json").write_text(json.dumps(config))


@pytest.fixture
def llama_dir(tmp_path):
    _hf_model("llama").save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


@pytest.mark.parametrize("fields, message", [
    (dict(model_type="gpt2"), "model_type 'gpt2' is not supported"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}, rope_parameters=None), "rope_scaling type 'yarn'"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(attention_dropout=0.1), "attention_dropout"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(logit_softcap=30.0), "'logit_softcap'"),
])
def test_unmodelled_config_fields_are_refused(llama_dir, fields, message):
    _edit_config(llama_dir, **fields)
    with pytest.raises(ConfigError, match=message) as err:
        load_hf(llama_dir)
    assert "\n" not in str(err.value)


def test_bad_weights_are_refused(llama_dir, tmp_path):
    weights = llama_dir / "model.safetensors"
    state = load_file(weights)
    save_file({**state, "model.layers.0.extra.weight": torch.zeros(2)}, weights, metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="'model.layers.0.extra.weight' maps to nothing"):
        load_hf(llama_dir)
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, weights, metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="lacks 'model.layers.1.mlp.up_proj.weight'"):
        load_hf(llama_dir)
    weights.unlink()
    with pytest.raises(ConfigError, match="neither model.safetensors nor"):
        load_hf(llama_dir)
    with pytest.raises(ConfigError, match="no config.json"):
        load_hf(tmp_path)


def test_missing_shard_is_refused(tmp_path):
    _hf_model("llama").save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    next((tmp_path / "hf").glob("model-*.safetensors")).unlink()
    with pytest.raises(ConfigError, match="names the shard"):
        load_hf(tmp_path / "hf")


def test_mistral_window_is_kept_and_enforced(tmp_path):
    _hf_model("mistral").save_pretrained(tmp_path / "hf")
    model = from_pretrained(tmp_path / "hf")
    assert model.cfg.sliding_window == 32
    with pytest.raises(ValueError, match="sliding window"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_export_command_writes_a_model_transformers_loads(corpus, tmp_path):
    """`leantrain export RUN OUT`: the run's newest checkpoint as an HF directory, no missing or
    unexpected keys, the same logits as the run's model."""
    from helpers import tiny_config
    from leantrain.cli import main as cli_main
    from leantrain.train import Trainer

    run = tmp_path / "run"
    tr = Trainer(tiny_config(corpus, **{"train.steps": "2", "train.ckpt_every": "2"}), run)
    tr.fit()
    assert cli_main(["export", str(run), str(tmp_path / "hf")]) == 0
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    idx = torch.randint(0, tr.cfg.model.vocab_size, (2, 16))
    tr.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(hf.float()(idx).logits, tr.model.float()(idx), atol=2e-5, rtol=1e-5)
    assert cli_main(["export", str(tmp_path / "nothing"), str(tmp_path / "hf2")]) == 2

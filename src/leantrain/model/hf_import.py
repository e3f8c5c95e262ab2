"""Reading a Hugging Face model directory into leantrain (:mod:`leantrain.model.hf` says what is
mapped and what is refused): :func:`config_from_hf`, :func:`load_hf_state`, :func:`load_tokenizer`,
:func:`load_hf`, :func:`from_pretrained`."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from leantrain.config import ConfigError, ModelConfig
from leantrain.model.llama import Llama

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# config.json fields that do not change the function the weights compute (bookkeeping, generation
# defaults, initialisation, the KV cache, sliced matmuls of the same product).
_HARMLESS_FIELDS = frozenset({
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
    "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "initializer_range", "pretraining_tp",
    "return_dict", "output_hidden_states", "output_attentions", "torchscript", "tie_encoder_decoder",
    "is_encoder_decoder", "is_decoder", "add_cross_attention", "id2label", "label2id", "problem_type",
    "tokenizer_class", "prefix", "sep_token_id", "decoder_start_token_id", "task_specific_params",
    "chunk_size_feed_forward", "cross_attention_hidden_size", "finetuning_task", "max_length",
    "use_return_dict", "auto_map", "max_window_layers", "_attn_implementation_autoset", "attn_implementation",
    "do_sample", "temperature", "top_p", "top_k", "num_beams", "repetition_penalty", "max_new_tokens", "min_length",
})
# fields read by config_from_hf (each checked, mapped, or refused when its value changes the math)
_MAPPED_FIELDS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
    "rope_scaling", "rope_parameters", "tie_word_embeddings", "hidden_act", "attention_bias", "mlp_bias",
    "attention_dropout", "sliding_window", "use_sliding_window", "layer_types", "use_mrope",
})
# keys a rope_scaling / rope_parameters dictionary may hold
_ROPE_KEYS = frozenset({"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
                        "original_max_position_embeddings"})


@dataclass
class HFTokenizer:
    """A ``tokenizers.Tokenizer`` with the ids and chat template a Hugging Face directory records.

    ``eos_ids``: every id that ends a generation (``generation_config.json`` may list several);
    ``config``: the directory's ``tokenizer_config.json`` as read (written back on export).
    ``encode`` adds no special tokens unless asked (documents are separated by ``eot_id``)."""

    tokenizer: object
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    chat_template: str | None = None
    eos_ids: tuple[int, ...] = ()
    config: dict = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    @property
    def eot_id(self) -> int | None:
        return self.eos_id

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], *, add_special_tokens: bool = False) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids, *, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def save(self, path: str | Path) -> None:
        """Write ``tokenizer.json`` to ``path`` (a file name)."""
        self.tokenizer.save(str(path))


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None


def _token_id(tok, value) -> int | None:
    """The id of a special token as tokenizer_config.json writes it (a string or {"content": ...})."""
    if isinstance(value, dict):
        value = value.get("content")
    return tok.token_to_id(value) if isinstance(value, str) else None


def _first(value) -> int | None:
    if isinstance(value, list):
        return value[0] if value else None
    return value


def load_tokenizer(source) -> HFTokenizer | None:
    """An :class:`HFTokenizer` from a Hugging Face directory (None when it has no
    ``tokenizer.json``), a ``tokenizer.json`` file, a ``tokenizers.Tokenizer`` (or an object holding
    one as ``.tokenizer``: :class:`leantrain.data.Tokenizer`) or an
    :class:`HFTokenizer` (returned as it is). Special ids come from ``tokenizer_config.json``'s
    tokens, else ``generation_config.json``, else ``config.json``; a tokenizer with no record of
    its end token takes ``<|endoftext|>`` (leantrain's own BPE) as one when it has it."""
    from tokenizers import Tokenizer

    if source is None or isinstance(source, HFTokenizer):
        return source
    if isinstance(getattr(source, "tokenizer", None), Tokenizer):  # (leantrain's BPE wrapper)
        source = source.tokenizer
    if isinstance(source, Tokenizer):
        return HFTokenizer(source, eos_id=source.token_to_id("<|endoftext|>"))
    path = Path(source)
    if path.is_file():
        tok = Tokenizer.from_file(str(path))
        return HFTokenizer(tok, eos_id=tok.token_to_id("<|endoftext|>"))
    if not (path / "tokenizer.json").is_file():
        return None
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tcfg = _read_json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").is_file() else {}
    gen = _read_json(path / "generation_config.json") if (path / "generation_config.json").is_file() else {}
    model = _read_json(path / "config.json") if (path / "config.json").is_file() else {}

    def special(name: str) -> int | None:
        found = _token_id(tok, tcfg.get(f"{name}_token"))
        for record in (gen, model):
            if found is None:
                found = _first(record.get(f"{name}_token_id"))
        return found

    eos_id = special("eos")
    if eos_id is None:
        eos_id = tok.token_to_id("<|endoftext|>")
    listed = gen.get("eos_token_id", model.get("eos_token_id"))
    eos_ids = tuple(listed) if isinstance(listed, list) else ((eos_id,) if eos_id is not None else ())
    template = tcfg.get("chat_template")
    if isinstance(template, list):  # [{"name", "template"}, ...]: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    return HFTokenizer(tok, bos_id=special("bos"), eos_id=eos_id, pad_id=special("pad"), chat_template=template,
                       eos_ids=eos_ids, config=tcfg)


def _rope_from_hf(hf: dict, where: str) -> dict:
    """ModelConfig's rope fields from rope_theta / rope_scaling (or rope_parameters)."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    merged = {**params, **scaling}
    for key in merged:
        if key not in _ROPE_KEYS:
            raise ConfigError(f"{where}: rope_scaling field {key!r} is not modelled by leantrain")
    theta = float(hf.get("rope_theta", merged.get("rope_theta", 10000.0)))
    kind = merged.get("rope_type", merged.get("type", "default"))
    out = dict(rope_theta=theta)
    if kind == "default":
        return out
    if kind == "linear":
        return {**out, "rope_scaling": "linear", "rope_factor": float(merged["factor"])}
    if kind == "llama3":
        return {**out, "rope_scaling": "llama3", "rope_factor": float(merged["factor"]),
                "rope_low_freq_factor": float(merged["low_freq_factor"]),
                "rope_high_freq_factor": float(merged["high_freq_factor"]),
                "rope_original_max_seq_len": int(merged["original_max_position_embeddings"])}
    raise ConfigError(f"{where}: rope_scaling type {kind!r} is not modelled; leantrain maps 'default', "
                      "'linear' and 'llama3'")


def _sliding_window_from_hf(hf: dict, model_type: str, where: str) -> int | None:
    layer_types = hf.get("layer_types") or []
    for t in layer_types:
        if t not in ("full_attention", "sliding_attention"):
            raise ConfigError(f"{where}: layer_types entry {t!r} is not modelled by leantrain")
    if model_type == "mistral":
        active = True
    else:  # (qwen2 / qwen3: the window applies only with use_sliding_window)
        active = bool(hf.get("use_sliding_window")) or "sliding_attention" in layer_types
    window = hf.get("sliding_window")
    return int(window) if active and window is not None else None


def _check_fields(hf: dict, model_type: str, where: str) -> None:
    """Refuse every field whose value changes the function and is not modelled."""
    for key in hf:
        if key not in _HARMLESS_FIELDS and key not in _MAPPED_FIELDS:
            raise ConfigError(f"{where}: config field {key!r} is not modelled by leantrain; remove it from "
                              "config.json only if it does not change what the model computes")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ConfigError(f"{where}: hidden_act {hf['hidden_act']!r} is not modelled; leantrain's MLP is SwiGLU (silu)")
    if hf.get("mlp_bias"):
        raise ConfigError(f"{where}: mlp_bias true is not modelled; leantrain's MLP has no biases")
    if hf.get("attention_bias") and model_type != "qwen2":
        raise ConfigError(f"{where}: attention_bias true in a {model_type} model also biases o_proj, which is not modelled")
    if float(hf.get("attention_dropout") or 0.0) > 0:
        raise ConfigError(f"{where}: attention_dropout {hf['attention_dropout']} is not modelled (leantrain's "
                          "attention has no dropout); set it to 0.0 in config.json to train without it")
    if hf.get("use_mrope"):
        raise ConfigError(f"{where}: use_mrope true (multimodal RoPE) is not modelled by leantrain")


def config_from_hf(hf: dict, *, where: str = "config.json") -> ModelConfig:
    """The :class:`ModelConfig` of a Hugging Face ``config.json`` (as a dict); ``where`` names the
    file in errors. Raises :class:`ConfigError` naming the first field it cannot model."""
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"{where}: model_type {model_type!r} is not supported; leantrain maps "
                          f"{', '.join(MODEL_TYPES)}")
    _check_fields(hf, model_type, where)
    try:
        dim, n_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        head_dim = hf.get("head_dim")
        cfg = ModelConfig(
            vocab_size=int(hf["vocab_size"]), dim=dim, n_layers=int(hf["num_hidden_layers"]), n_heads=n_heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or n_heads), ffn_dim=int(hf["intermediate_size"]),
            max_seq_len=int(hf.get("max_position_embeddings", 2048)), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            head_dim=None if head_dim is None or int(head_dim) * n_heads == dim else int(head_dim),
            attention_bias=model_type == "qwen2", qk_norm=model_type == "qwen3",
            sliding_window=_sliding_window_from_hf(hf, model_type, where),
            **_rope_from_hf(hf, where),
        )
    except KeyError as e:
        raise ConfigError(f"{where}: the field {e.args[0]!r} is missing") from None
    if cfg.head_dim is None and cfg.dim % cfg.n_heads:
        raise ConfigError(f"{where}: hidden_size {cfg.dim} does not divide into {cfg.n_heads} heads and head_dim is not set")
    return cfg


def _weight_files(path: Path) -> list[Path]:
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConfigError(f"{index} has no weight_map")
        files = [path / name for name in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise ConfigError(f"{index} names the shard {f.name}, which is missing from {path}")
        return files
    if single.is_file():
        return [single]
    pickled = " (pickled .bin weights are not read: save the model with safe_serialization)" if any(
        path.glob("*.bin")) else ""
    raise ConfigError(f"{path} has neither model.safetensors nor model.safetensors.index.json{pickled}")


def _hf_to_leantrain_name(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def _fuse_projections(state: dict, n_layers: int) -> dict:
    """q/k/v into ``qkv_proj`` (rows [q; k; v]) and gate/up into ``gate_up_proj`` (rows [gate; up]),
    weights and biases alike: the layout of ``ModelConfig.fused_proj``."""
    groups = (("self_attn", ("q_proj", "k_proj", "v_proj"), "qkv_proj"), ("mlp", ("gate_proj", "up_proj"), "gate_up_proj"))
    for i in range(n_layers):
        for module, parts, fused in groups:
            for kind in ("weight", "bias"):
                names = [f"layers.{i}.{module}.{p}.{kind}" for p in parts]
                if all(n in state for n in names):
                    state[f"layers.{i}.{module}.{fused}.{kind}"] = torch.cat([state.pop(n) for n in names], 0)
    return state


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """leantrain's parameter names and shapes for ``cfg`` (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = Llama(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def load_hf_state(path: str | Path, cfg: ModelConfig, *, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """The weights of a Hugging Face directory under leantrain's names for ``cfg`` (in
    ``cfg.fused_proj``'s layout; when tied, ``lm_head.weight`` is the embeddings' tensor), read with ``safetensors``.
    A tensor that maps to nothing, a missing one, or one of the wrong shape is refused by name."""
    from safetensors import safe_open

    path = Path(path)
    want = expected_shapes(dataclasses.replace(cfg, fused_proj=False))
    state: dict[str, Tensor] = {}
    for f in _weight_files(path):
        with safe_open(str(f), framework="pt") as reader:
            for hf_name in reader.keys():
                name = _hf_to_leantrain_name(hf_name)
                if name.endswith("rotary_emb.inv_freq"):  # (RoPE's frequencies: recomputed from the config)
                    continue
                if name not in want:
                    raise ConfigError(f"{f.name}: tensor {hf_name!r} maps to nothing in a leantrain model of this config")
                tensor = reader.get_tensor(hf_name)
                if tuple(tensor.shape) != want[name]:
                    raise ConfigError(f"{f.name}: tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                                      f"config.json implies {want[name]}")
                state[name] = tensor.to(dtype) if dtype is not None else tensor
    if cfg.tie_embeddings and "lm_head.weight" in state:
        head = state.pop("lm_head.weight")
        if "embed_tokens.weight" in state and not torch.equal(head, state["embed_tokens.weight"]):
            raise ConfigError(f"{path}: lm_head.weight differs from the embeddings but tie_word_embeddings is true")
    if cfg.tie_embeddings and "embed_tokens.weight" in state:  # (one tensor under both names, as Llama's state_dict has)
        state["lm_head.weight"] = state["embed_tokens.weight"]
    missing = [k for k in want if k not in state]
    if missing:
        hf_name = missing[0] if missing[0].startswith("lm_head") else f"model.{missing[0]}"
        raise ConfigError(f"{path}: the checkpoint lacks {hf_name!r}" + (f" and {len(missing) - 1} more tensors"
                                                                          if len(missing) > 1 else ""))
    return _fuse_projections(state, cfg.n_layers) if cfg.fused_proj else state


def load_hf(path: str | Path, *, dtype: torch.dtype | None = None) -> tuple[ModelConfig, dict[str, Tensor], HFTokenizer | None]:
    """``(config, state_dict, tokenizer)`` of a Hugging Face model directory: ``config.json``,
    ``model.safetensors`` or ``model.safetensors.index.json`` with its shards, and the tokenizer
    files (None without ``tokenizer.json``). ``dtype``: the weights' dtype (None: as stored).
    ``Llama(config).load_state_dict(state_dict)`` loads it (strict)."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"{path} is not a directory; give a Hugging Face model directory (config.json and safetensors)")
    if not (path / "config.json").is_file():
        raise ConfigError(f"{path} is not a Hugging Face model directory: it has no config.json")
    cfg = config_from_hf(_read_json(path / "config.json"), where=str(path / "config.json"))
    state = load_hf_state(path, cfg, dtype=dtype)
    return cfg, state, load_tokenizer(path)


def from_pretrained(path: str | Path, *, dtype: torch.dtype | None = None, **overrides) -> Llama:
    """A :class:`Llama` holding a Hugging Face directory's weights. ``overrides``: ModelConfig
    fields to set apart from the directory's (e.g. ``max_seq_len``, ``fused_loss``);
    ``dtype``: the model's dtype (None: fp32)."""
    cfg, state, _ = load_hf(path)
    model = Llama(dataclasses.replace(cfg, **overrides))
    model.load_state_dict(state)
    return model.to(dtype) if dtype is not None else model

"""Writing a leantrain model as a Hugging Face directory (:mod:`leantrain.model.hf` says what is
written): :func:`config_to_hf`, :func:`hf_state`, :func:`save_hf_state`, :func:`save_hf`."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import Tensor

from leantrain.config import ConfigError, ModelConfig
from leantrain.model.hf_import import HFTokenizer, expected_shapes, load_tokenizer
from leantrain.model.llama import Llama, head_dim_of

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM"}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hf_model_type(cfg: ModelConfig) -> str:
    """The Hugging Face model_type that computes what ``cfg`` does: qwen3 with ``qk_norm``, qwen2
    with ``attention_bias``, mistral with a ``sliding_window``, llama otherwise."""
    if cfg.qk_norm and cfg.attention_bias:
        raise ConfigError("model: qk_norm with attention_bias has no Hugging Face counterpart "
                          "(Qwen3's attention_bias also biases o_proj)")
    if cfg.qk_norm:
        return "qwen3"
    if cfg.attention_bias:
        return "qwen2"
    return "mistral" if cfg.sliding_window is not None else "llama"


def _rope_to_hf(cfg: ModelConfig) -> dict | None:
    if cfg.rope_scaling == "none":
        return None
    if cfg.rope_scaling == "linear":
        return {"rope_type": "linear", "factor": cfg.rope_factor}
    return {"rope_type": "llama3", "factor": cfg.rope_factor, "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_seq_len}


def config_to_hf(cfg: ModelConfig, *, tokenizer: HFTokenizer | None = None,
                 dtype: torch.dtype = torch.float32) -> dict:
    """The Hugging Face ``config.json`` (as a dict) of a leantrain model of ``cfg``."""
    model_type = hf_model_type(cfg)
    out = {
        "architectures": [_ARCHITECTURES[model_type]], "model_type": model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": head_dim_of(cfg),
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": _rope_to_hf(cfg),
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu", "attention_dropout": 0.0,
        "torch_dtype": _DTYPE_NAMES.get(dtype, "float32"), "use_cache": True,
    }
    if model_type in ("llama", "qwen3"):
        out["attention_bias"] = False
    if model_type == "llama":
        out["mlp_bias"] = False
    if model_type == "mistral":
        out["sliding_window"] = cfg.sliding_window
    if model_type in ("qwen2", "qwen3"):  # (the window, when set, on every layer: max_window_layers 0)
        out.update(use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window,
                   max_window_layers=0 if cfg.sliding_window is not None else cfg.n_layers)
    if tokenizer is not None:
        out.update(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
    return out


def _strip_wrappers(name: str) -> str:
    """A name without the prefixes DDP (``module.``) and torch.compile (``_orig_mod.``) add."""
    for prefix in ("module.", "_orig_mod."):
        while name.startswith(prefix):
            name = name[len(prefix):]
    return name


def hf_state(cfg: ModelConfig, state: dict[str, Tensor], *, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """``state`` (a leantrain model's state dict, either projection layout; a tied LM head may be
    absent) under Hugging Face's names: fused projections split, no ``lm_head.weight`` when tied,
    every tensor contiguous and owning its memory. A tensor leantrain does not know is refused."""
    head_dim = head_dim_of(cfg)
    splits = {
        "qkv_proj": (("q_proj", "k_proj", "v_proj"), (cfg.n_heads * head_dim, cfg.n_kv_heads * head_dim,
                                                     cfg.n_kv_heads * head_dim)),
        "gate_up_proj": (("gate_proj", "up_proj"), (cfg.ffn_dim, cfg.ffn_dim)),
    }
    want = expected_shapes(dataclasses.replace(cfg, fused_proj=False))
    out: dict[str, Tensor] = {}
    for raw_name, tensor in state.items():
        name = _strip_wrappers(raw_name)
        module, _, kind = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        pieces = [(name, tensor)]
        if leaf in splits:
            parts, sizes = splits[leaf]
            pieces = [(f"{parent}.{p}.{kind}", t) for p, t in zip(parts, tensor.split(list(sizes), 0), strict=True)]
        for piece_name, piece in pieces:
            if piece_name not in want or tuple(piece.shape) != want[piece_name]:
                raise ConfigError(f"state dict: tensor {raw_name!r} {tuple(tensor.shape)} is not part of a "
                                  "leantrain model of this config")
            if piece_name == "lm_head.weight" and cfg.tie_embeddings:
                continue
            hf_name = piece_name if piece_name == "lm_head.weight" else f"model.{piece_name}"
            piece = piece.detach().to("cpu", dtype) if dtype is not None else piece.detach().cpu()
            out[hf_name] = piece.contiguous().clone()
    missing = [k for k in want if (k if k == "lm_head.weight" else f"model.{k}") not in out
               and not (k == "lm_head.weight" and cfg.tie_embeddings)]
    if missing:
        raise ConfigError(f"state dict: {missing[0]!r} is missing" + (f" and {len(missing) - 1} more tensors"
                                                                     if len(missing) > 1 else ""))
    return out


def _shards(state: dict[str, Tensor], max_shard_bytes: int) -> list[dict[str, Tensor]]:
    """Tensors in order, a new shard whenever the next would take one past ``max_shard_bytes`` (a
    tensor larger than that is a shard of its own)."""
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def _write_weights(state: dict[str, Tensor], out: Path, max_shard_bytes: int) -> None:
    from safetensors.torch import save_file

    shards = _shards(state, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_tokenizer(tok: HFTokenizer, out: Path, max_seq_len: int) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` (its special tokens, chat template and
    length) into the directory ``out``: what ``AutoTokenizer`` and :func:`load_tokenizer` read."""
    tok.save(out / "tokenizer.json")
    tcfg = dict(tok.config)
    tcfg.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    tcfg.setdefault("model_max_length", max_seq_len)
    for name, token_id in (("bos", tok.bos_id), ("eos", tok.eos_id), ("pad", tok.pad_id)):
        if token_id is not None and f"{name}_token" not in tcfg:
            tcfg[f"{name}_token"] = tok.tokenizer.id_to_token(token_id)
    if tok.chat_template is not None:
        tcfg["chat_template"] = tok.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2, ensure_ascii=False))


def _generation_config(tok: HFTokenizer | None) -> dict:
    if tok is None:
        return {}
    eos = list(tok.eos_ids) if len(tok.eos_ids) > 1 else tok.eos_id
    return {k: v for k, v in (("bos_token_id", tok.bos_id), ("eos_token_id", eos), ("pad_token_id", tok.pad_id))
            if v is not None}


def save_hf_state(cfg: ModelConfig, state: dict[str, Tensor], out_dir: str | Path, *, tokenizer=None,
                  max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, dtype: torch.dtype | None = None,
                  overwrite: bool = False) -> Path:
    """Write ``state`` (a leantrain state dict of a model of ``cfg``, e.g. a checkpoint's
    ``model.safetensors``) as a Hugging Face directory ``out_dir``: ``config.json``,
    ``generation_config.json``, ``model.safetensors`` (or shards of at most ``max_shard_bytes``
    with ``model.safetensors.index.json``), and with ``tokenizer`` (anything
    :func:`leantrain.model.hf_import.load_tokenizer` takes) ``tokenizer.json`` and
    ``tokenizer_config.json``. ``dtype``: the weights' dtype (None: as in ``state``). The files are
    written to a temporary directory beside ``out_dir`` and moved into place at the end; an
    existing non-empty ``out_dir`` is refused unless ``overwrite``."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ConfigError(f"{out} exists and is not empty; choose a new directory or pass overwrite")
    tok = load_tokenizer(tokenizer)
    tensors = hf_state(cfg, state, dtype=dtype)
    weight_dtype = next(iter(tensors.values())).dtype if tensors else torch.float32
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _write_weights(tensors, tmp, max_shard_bytes)
        hf_cfg = config_to_hf(cfg, tokenizer=tok, dtype=weight_dtype)
        (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(_generation_config(tok), indent=2))
        if tok is not None:
            write_tokenizer(tok, tmp, cfg.max_seq_len)
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def save_hf(model: Llama, out_dir: str | Path, *, tokenizer=None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
            dtype: torch.dtype | None = None, overwrite: bool = False) -> Path:
    """Write a :class:`Llama` as a Hugging Face directory (:func:`save_hf_state` with the model's
    config and state dict); ``transformers.AutoModelForCausalLM.from_pretrained(out_dir)`` loads it."""
    return save_hf_state(model.cfg, model.state_dict(), out_dir, tokenizer=tokenizer,
                         max_shard_bytes=max_shard_bytes, dtype=dtype, overwrite=overwrite)

"""Where a model's weights come from: a Hugging Face model directory or a leantrain run.

``train.init_from`` (``leantrain train --from DIR``), ``leantrain eval --from DIR`` and
``leantrain generate --from DIR`` accept

- a Hugging Face model directory (``config.json`` with a ``model_type``, safetensors weights,
  tokenizer files; :func:`leantrain.model.hf.load_hf` says what is mapped), or
- a leantrain run directory (its newest intact checkpoint and the run's ``tokenizer.json``) or
  one checkpoint directory (``meta.json``).

:func:`open_source` reads the model's config and tokenizer (not yet its weights:
``Pretrained.weights()``); :func:`apply_model` puts that config into a run's ``Config``: the
architecture (sizes, vocabulary, RoPE, biases, norms) is the source's, the runtime fields
(``RUNTIME_FIELDS``: fused kernels, ``loss_chunk``, activation checkpointing) stay the run's, and
``model.max_seq_len`` is the run's when the user set it apart from the preset's value (a model
made for 131072 positions need not build RoPE tables that long), else the source's.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from leantrain import config as config_mod
from leantrain.config import Config, ConfigError, ModelConfig
from leantrain.data.tokenizer import Tokenizer
from leantrain.model.hf import HFTokenizer, load_hf_state, load_tokenizer
from leantrain.model.hf_import import config_from_hf
from leantrain.runtime import checkpoint

# ModelConfig fields that choose how the model runs, not what it computes: the run's own values
RUNTIME_FIELDS = ("sdpa_gqa", "fused_loss", "fused_norm", "fused_rope", "fused_proj", "fused_swiglu", "loss_chunk",
                  "activation_checkpointing")


@dataclass
class Pretrained:
    """A model to start from: its config, its tokenizer (None when the source has none), where it is."""

    model: ModelConfig
    tokenizer: HFTokenizer | Tokenizer | None
    path: Path
    checkpoint: Path | None = None  # a leantrain checkpoint directory; None: a Hugging Face directory

    @property
    def describe(self) -> str:
        return str(self.checkpoint) if self.checkpoint is not None else f"the Hugging Face model {self.path}"

    def weights(self) -> dict:
        """The state dict (leantrain names) of the model of ``self.model``."""
        if self.checkpoint is None:
            return load_hf_state(self.path, self.model)
        state = checkpoint.load_model_state(self.checkpoint)[0]
        if self.model.tie_embeddings and "lm_head.weight" not in state:  # (a tied head is saved once)
            state["lm_head.weight"] = state["embed_tokens.weight"]
        return state


def is_hf_dir(path: Path) -> bool:
    """A directory with a Hugging Face ``config.json`` (one naming a ``model_type``)."""
    cfg = path / "config.json"
    if not cfg.is_file() or (path / "meta.json").exists() or (path / "checkpoints").is_dir():
        return False
    try:
        return "model_type" in json.loads(cfg.read_text())
    except (OSError, ValueError):
        return False


def open_source(source: str | Path, log=print) -> Pretrained:
    """The model config and tokenizer of a Hugging Face directory, a run or a checkpoint directory."""
    path = Path(source).expanduser()
    if not path.is_dir():
        raise ConfigError(f"--from {source}: no such directory; give a Hugging Face model directory, a run "
                          "directory or a checkpoint directory")
    if is_hf_dir(path):
        hf = json.loads((path / "config.json").read_text())
        return Pretrained(config_from_hf(hf, where=str(path / "config.json")), load_tokenizer(path), path)
    ckpt = checkpoint.resolve(path, log)
    if ckpt is None:
        raise ConfigError(f"--from {source}: neither a Hugging Face model directory (config.json with a "
                          "model_type) nor a leantrain run or checkpoint directory")
    meta = checkpoint.read_meta(ckpt)
    if "config" not in meta:
        raise ConfigError(f"checkpoint {ckpt} has no config in its meta.json")
    return Pretrained(config_mod.from_dict(meta["config"]).model, run_tokenizer(ckpt, path), path, checkpoint=ckpt)


def run_tokenizer(ckpt: Path, path: Path):
    """The tokenizer a run kept (:meth:`leantrain.train.trainer.Trainer._keep_tokenizer`) beside the
    checkpoint ``ckpt`` (or in ``path``): a Hugging Face model's (with ``tokenizer_config.json``) or
    a BPE's ``tokenizer.json``; None when there is none."""
    for where in (ckpt.parent.parent, path):
        if (where / "tokenizer_config.json").is_file() and (where / "tokenizer.json").is_file():
            return load_tokenizer(where)
        if (where / "tokenizer.json").is_file():
            return Tokenizer.load(where / "tokenizer.json")
    return None


def apply_model(cfg: Config, pre: Pretrained) -> None:
    """Set ``cfg.model`` to ``pre``'s architecture with the run's runtime fields (module docstring).
    A model field the user set (apart from the preset's value) that disagrees with the source is
    refused, as is a ``data.seq_len`` beyond the model's positions or sliding window."""
    given, defaults = cfg.model, config_mod.preset(cfg.preset).model
    runtime = {name: getattr(given, name) for name in RUNTIME_FIELDS}
    user_len = given.max_seq_len if given.max_seq_len != defaults.max_seq_len else None
    for f in dataclasses.fields(ModelConfig):
        mine, theirs = getattr(given, f.name), getattr(pre.model, f.name)
        if f.name in RUNTIME_FIELDS or f.name in ("max_seq_len", "vocab_size"):
            continue
        if mine != getattr(defaults, f.name) and mine != theirs:
            raise ConfigError(f"model.{f.name} {mine} disagrees with {pre.describe} ({theirs}): the model's "
                              f"architecture comes from --from; drop --model.{f.name.replace('_', '-')}")
    cfg.model = dataclasses.replace(pre.model, **runtime)
    if user_len is not None:
        cfg.model.max_seq_len = user_len
    window = cfg.model.sliding_window
    if cfg.data.seq_len > cfg.model.max_seq_len:
        raise ConfigError(f"data.seq_len ({cfg.data.seq_len}) exceeds the model's max_seq_len "
                          f"({cfg.model.max_seq_len}); pass a shorter --data.seq-len")
    if window is not None and cfg.data.seq_len > window:
        raise ConfigError(f"data.seq_len ({cfg.data.seq_len}) exceeds the sliding window of {pre.describe} "
                          f"({window} tokens), which is not modelled; pass --data.seq-len {window} or less")


def build_config(preset_name: str, toml_path: str | None, overrides: dict, log=print) -> Config:
    """:func:`leantrain.config.build` for a run with ``train.init_from``: the source's model is put
    in (:func:`apply_model`) before the config is validated, so that its sizes and positions, not
    the preset's, are what ``data.seq_len`` is checked against."""
    toml = config_mod.load_toml(toml_path) if toml_path else {}
    cfg = config_mod.preset(toml.get("preset", preset_name) if preset_name is None else preset_name)
    config_mod.apply_dict(cfg, toml)
    for key, value in overrides.items():
        config_mod.set_field(cfg, key, value)
    apply_model(cfg, open_source(cfg.train.init_from, log=log))
    config_mod.validate(cfg)
    return cfg


def check_vocabulary(pre: Pretrained, data_vocab: int) -> None:
    """The data's token ids must be ids of the model's embedding (a tokenizer may be smaller than it)."""
    if data_vocab > pre.model.vocab_size:
        raise ConfigError(f"the data's tokenizer has {data_vocab} tokens, more than the {pre.model.vocab_size} "
                          f"embeddings of {pre.describe}; use the model's own tokenizer")

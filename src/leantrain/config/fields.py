"""Setting fields: ``--section.field value`` overrides, TOML files, renamed keys, validation, and
the documentation of each field."""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from pathlib import Path
from typing import Literal, get_args, get_origin, get_type_hints

from leantrain.config.presets import preset
from leantrain.config.tree import LOGGERS, Config, ConfigError, logger_names


def _sections(cfg: Config) -> dict[str, object]:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if dataclasses.is_dataclass(getattr(cfg, f.name))}


def _coerce(value, tp, where: str):
    origin, args = get_origin(tp), get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            if type(None) in args:
                return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not a valid choice; choose one of {list(args)}")
        return value
    if origin is tuple:
        items = value.split(",") if isinstance(value, str) else list(value)
        if len(items) != len(args):
            raise ConfigError(f"{where}: expected {len(args)} comma-separated values, got {value!r}")
        return tuple(_coerce(v, a, where) for v, a in zip(items, args, strict=True))
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected an integer, got {value!r}") from None
    if tp is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if tp is str:
        return str(value)
    raise ConfigError(f"{where}: unsupported field type {tp}")


# keys of older configs -> their place in this tree
RENAMED = {
    "dist.comm": "comm.method",
    **{f"dist.scape_{k}": f"comm.scape.{k}" for k in ("density", "score", "dense_steps", "catch_up")},
    **{f"dist.gift_{k}": f"comm.gift.{k}" for k in ("rank", "refresh_every", "min_numel", "whiten", "format")},
}


def set_field(cfg: Config, dotted: str, value) -> None:
    """Set ``section.field`` or ``section.sub.field`` (dashes allowed for underscores) to
    ``value``, with type checks."""
    key = dotted.replace("-", "_")
    if key in RENAMED:
        raise ConfigError(f"--{dotted} is now --{RENAMED[key].replace('_', '-')}")
    sections = _sections(cfg)
    if "." not in key:
        raise ConfigError(f"config key {dotted!r} must look like section.field; sections: {sorted(sections)}")
    parts = key.split(".")
    if parts[0] not in sections:
        raise ConfigError(f"unknown config section {parts[0]!r}; valid sections: {sorted(sections)}"
                          + _suggest(parts[0], sections))
    sec, where = sections[parts[0]], parts[0]
    for name in parts[1:-1]:  # nested sections (comm.scape.density)
        sub = getattr(sec, name, None)
        if not dataclasses.is_dataclass(sub):
            raise ConfigError(f"unknown config section {where}.{name}; [{where}] has no sub-section {name!r}")
        sec, where = sub, f"{where}.{name}"
    fname = parts[-1]
    hints = get_type_hints(type(sec))
    fields = {f.name for f in dataclasses.fields(sec)}
    if fname not in fields or dataclasses.is_dataclass(getattr(sec, fname)):
        valid = _leaf_names(sec)
        raise ConfigError(f"unknown config key {where}.{fname}; valid keys of [{where}]: {valid}"
                          + _suggest(fname, valid, prefix=f"{where}."))
    setattr(sec, fname, _coerce(value, hints[fname], f"{where}.{fname}"))


def _leaf_names(sec) -> list[str]:
    out = []
    for f in dataclasses.fields(sec):
        v = getattr(sec, f.name)
        out += [f"{f.name}.{n}" for n in _leaf_names(v)] if dataclasses.is_dataclass(v) else [f.name]
    return out


def _suggest(word: str, choices, prefix: str = "") -> str:
    import difflib

    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def field_docs() -> dict[str, str]:
    """``section.field`` -> the comment beside the field in this file (its documentation)."""
    import inspect
    import re

    docs, cls_of = {}, {}
    for name, sec in _sections(Config()).items():
        stack = [(name, sec)]
        while stack:
            where, obj = stack.pop()
            cls_of[type(obj).__name__] = where
            stack += [(f"{where}.{f.name}", getattr(obj, f.name)) for f in dataclasses.fields(obj)
                      if dataclasses.is_dataclass(getattr(obj, f.name))]
    current, above = None, []
    for line in inspect.getsource(inspect.getmodule(Config)).splitlines():
        if line.startswith("class "):
            current, above = cls_of.get(line[6:].split(":")[0].split("(")[0]), []
            continue
        if line.strip().startswith("#"):
            above.append(line.strip().lstrip("#").strip())
            continue
        m = re.match(r"    (\w+): [^=]+= [^#]*(?:#\s*(.*))?$", line)
        if current and m:
            docs[f"{current}.{m.group(1)}"] = (m.group(2) or " ".join(above)).strip()
        above = []
    return docs


def apply_dict(cfg: Config, d: dict, prefix: str = "") -> None:
    """Set every leaf of a nested dict (a TOML file, a saved config) on ``cfg``."""
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict):
            apply_dict(cfg, v, key)
        elif key == "preset":
            continue
        else:
            set_field(cfg, key, v)


def load_toml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None


def build(preset_name: str = "tiny", toml_path: str | None = None, overrides: dict | None = None) -> Config:
    """Preset, then TOML file, then ``--section.field`` overrides; validated."""
    toml = load_toml(toml_path) if toml_path else {}
    cfg = preset(toml.get("preset", preset_name) if preset_name is None else preset_name)
    apply_dict(cfg, toml)
    for k, v in (overrides or {}).items():
        set_field(cfg, k, v)
    validate(cfg)
    return cfg


def from_dict(d: dict) -> Config:
    """Rebuild a Config from ``to_dict()`` output (e.g. a checkpoint's config.json); keys of older
    configs (``RENAMED``) are read at their new place."""
    cfg = Config(preset=d.get("preset", "tiny"))
    flat = {}

    def walk(x: dict, prefix: str) -> None:
        for k, v in x.items():
            key = f"{prefix}.{k}" if prefix else k
            walk(v, key) if isinstance(v, dict) else flat.__setitem__(RENAMED.get(key, key), v)

    walk({k: v for k, v in d.items() if isinstance(v, dict)}, "")
    for k, v in flat.items():
        set_field(cfg, k, v)
    return cfg


def validate(cfg: Config) -> None:
    m, d, t = cfg.model, cfg.data, cfg.train
    unknown_loggers = [name for name in logger_names(t.loggers) if name not in LOGGERS]
    checks = [
        (d.seq_len >= 2, "data.seq_len must be at least 2"),
        (d.seq_len <= m.max_seq_len, f"data.seq_len ({d.seq_len}) exceeds model.max_seq_len ({m.max_seq_len})"),
        (d.batch_size >= 1 and d.grad_accum >= 1, "data.batch_size and data.grad_accum must be >= 1"),
        (0.0 < d.val_fraction < 1.0, "data.val_fraction must be in (0, 1)"),
        (t.steps >= 1, f"train.steps must be at least 1, got {t.steps}"),
        (math.isfinite(cfg.optim.lr) and cfg.optim.lr > 0, f"optim.lr must be a finite number > 0, got {cfg.optim.lr}"),
        (m.n_kv_heads >= 1 and m.n_heads % m.n_kv_heads == 0,
         f"model.n_heads ({m.n_heads}) must be a multiple of model.n_kv_heads ({m.n_kv_heads})"),
        (m.head_dim is not None or (m.dim % m.n_heads == 0 and (m.dim // m.n_heads) % 2 == 0),
         f"model.dim ({m.dim}) must divide into model.n_heads ({m.n_heads}) heads of even size "
         f"(e.g. --model.dim {max(m.n_heads * 2, (m.dim // (2 * m.n_heads)) * 2 * m.n_heads)})"),
        (m.activation_checkpointing or not m.activation_offload,
         "model.activation_offload moves the inputs that activation checkpointing keeps: set "
         "--model.activation-checkpointing true too"),
        (m.loss_chunk >= 0, "model.loss_chunk must be >= 0 (0: the loss in one piece)"),
        (d.tokenizer_vocab >= 300, "data.tokenizer_vocab must be at least 300 (256 bytes + specials)"),
        (cfg.dist.replicate >= 1, f"dist.replicate must be >= 1 (1: plain FSDP), got {cfg.dist.replicate}"),
        (cfg.agoq.batch_mib >= 0 and cfg.agoq.unpack_mib >= 0,
         "agoq.batch_mib and agoq.unpack_mib must be >= 0 (0: pack each save at once / dequantize a whole batch)"),
        (not unknown_loggers, "train.loggers names the unknown logger(s) "
         f"{', '.join(map(repr, unknown_loggers))}; choose a comma-separated list of {', '.join(LOGGERS)}"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)


def parse_overrides(argv: list[str]) -> dict:
    """``["--model.dim", "256", "--optim.lr=1e-3"]`` -> ``{"model.dim": "256", "optim.lr": "1e-3"}``."""
    out, i = {}, 0
    while i < len(argv):
        a = argv[i]
        if not a.startswith("--") or "." not in a.split("=", 1)[0]:
            raise ConfigError(f"unexpected argument {a!r}; config fields are given as --section.field value")
        if "=" in a:
            k, v = a[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(argv):
                raise ConfigError(f"{a} needs a value")
            k, v = a[2:], argv[i + 1]
            i += 2
        out[k] = v
    return out

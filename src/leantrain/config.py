"""One tree of typed dataclasses: the whole configuration of a leantrain run.

``Config`` has one section per concern (``model``, ``data``, ``optim``,
``train``, ``forge``, ``agoq``, ``dist``, ``comm`` with ``comm.scape`` and ``comm.gift``,
``finetune``). Presets are functions returning a
full ``Config``; a TOML file or ``--section.field value`` arguments override
fields of a preset. Unknown keys and ill-typed values are rejected with a
message that lists the valid choices.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args, get_origin, get_type_hints


@dataclass
class ModelConfig:
    vocab_size: int = 4096  # set from the tokenizer when the data is loaded
    dim: int = 192
    n_layers: int = 4
    n_heads: int = 6
    n_kv_heads: int = 2  # grouped-query attention: n_heads / n_kv_heads queries share a K/V head
    ffn_dim: int = 512
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    # the width of one attention head; None: dim // n_heads. Set apart from dim / n_heads by Qwen3
    # and some Llama / Mistral models (q / k / v / o_proj are then n_heads x head_dim wide).
    head_dim: int | None = None
    # biases on q, k and v (Qwen2 / Qwen2.5; o_proj has none): in qkv_proj they are concatenated
    # like the weights' rows, [q; k; v].
    attention_bias: bool = False
    # RMSNorm over each head of q and of k (weights of head_dim, eps norm_eps) before RoPE (Qwen3).
    qk_norm: bool = False
    # RoPE frequency scaling. "linear": every frequency divided by rope_factor (positions
    # interpolated). "llama3" (Llama-3.1 / 3.2): wavelengths longer than
    # rope_original_max_seq_len / rope_low_freq_factor divided by rope_factor, shorter than
    # rope_original_max_seq_len / rope_high_freq_factor kept, the band between blended linearly.
    rope_scaling: Literal["none", "linear", "llama3"] = "none"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0  # "llama3" only
    rope_high_freq_factor: float = 4.0  # "llama3" only
    rope_original_max_seq_len: int = 8192  # "llama3" only: the context length the model was trained at
    # sliding-window attention (Mistral): each token sees this many tokens; None: no window. The
    # attention here is causal over the whole sequence, which is the window's attention for
    # sequences up to the window; forward refuses a longer sequence.
    sliding_window: int | None = None
    # GQA inside SDPA (enable_gqa): attention saves K/V at n_kv_heads, not repeated to n_heads
    # (1/8 of the K/V activation bytes at 1b). false: repeat K/V before SDPA (for SDPA backends
    # without GQA; the same values).
    sdpa_gqa: bool = True
    # the LM head and the cross-entropy fused (leantrain.model.losses): the logits are computed, used and
    # dropped in vocabulary slices, forward and backward; no logits tensor, no log-softmax saved
    # (at 1b, B = 8: 0.5 GiB of bf16 logits, 1 GiB of fp32 log-softmax, 0.5 GiB of their gradient).
    # false: the logits, then the cross-entropy in chunks of loss_chunk tokens.
    fused_loss: bool = True
    # RMSNorm as one autograd function (leantrain.ops.norm; Triton kernels on CUDA): saves x and
    # rstd only, where the op-by-op form saves an fp32 copy of x and the normalized x as well (at 1b,
    # B = 8: 6 bytes instead of 2 per element of the residual stream, 45 norms). false: op by op
    # (the same forward values; backward gradients equal up to rounding).
    fused_norm: bool = True
    # RoPE as one autograd function (leantrain.ops.rope; a Triton kernel on CUDA): one launch each
    # for q and k forward and backward instead of ~9 ops each; the same forward bit for bit.
    fused_rope: bool = True
    # q/k/v as one linear (qkv_proj) and gate/up as one (gate_up_proj), as Megatron-LM fuses them:
    # one GEMM each forward and two backward instead of three / two, and one optimizer update (FORGE:
    # 4 launches a block instead of 7). The same function; a model state dict of either layout loads
    # into the other (optimizer states do not carry over). false: the separate linears.
    fused_proj: bool = True
    # SwiGLU as one autograd function (leantrain.ops.swiglu; a Triton kernel on CUDA): saves gate and
    # up only, where silu(gate) * up also saves silu(gate) (a third of the MLP's intermediate saves:
    # at 1b, B = 8, by arithmetic, 5632 x 8192 bf16 values a layer); one kernel forward and one backward. The same function
    # (silu(gate) not rounded to bf16 before the product). false: op by op.
    fused_swiglu: bool = True
    # logits held at once, in tokens' worth (0: all at once): the fused loss's vocabulary slices
    # hold about loss_chunk x vocab logits; the unfused loss runs in chunks of loss_chunk tokens
    # (each chunk's fp32 logits, log-softmax and gradients a chunk's size; the same values).
    loss_chunk: int = 1024
    # activation checkpointing: each block's forward runs again in backward (torch.utils.checkpoint,
    # non-reentrant), so across the step only the blocks' inputs are kept (at 1b: 4 KiB a token a
    # block instead of ~100 KiB), for ~1/3 more compute. Composes with FORGE (a block's weights
    # change in its own backward, after the recompute that reads them); not with AGoQ (which
    # compresses exactly the saved activations that checkpointing drops).
    activation_checkpointing: bool = False


@dataclass
class DataConfig:
    path: str | None = None  # None: the embedded corpus (the running Python's standard library)
    seq_len: int = 128
    batch_size: int = 16  # sequences per micro-batch per rank
    grad_accum: int = 1  # micro-batches per optimizer step
    tokenizer_vocab: int = 4096  # BPE vocabulary trained on the corpus
    val_fraction: float = 0.05  # share of files (or of tokens for a single file) held out
    max_corpus_mb: float = 24.0  # cap on the embedded corpus text, for quick set-up
    # MB of a text corpus the BPE tokenizer is trained on, sampled over the whole corpus (larger
    # corpora are still tokenized whole)
    tokenizer_sample_mb: float = 64.0
    bin_vocab_size: int | None = None  # vocabulary of a .bin token file without <file>.bin.json / meta.json
    bin_dtype: Literal["uint16", "uint32"] | None = None  # its ids' dtype (default uint16, or its metadata's)
    # the tokenizer of text data: a tokenizer.json file or a Hugging Face model directory; None: a
    # BPE of tokenizer_vocab tokens trained on the corpus (or, with train.init_from, the model's own)
    tokenizer: str | None = None
    # what a .jsonl holds: auto (from the first line's fields), text ({"text"}), instruct
    # ({"prompt", "completion"} or {"prompt", "response"}), chat ({"messages": [{"role",
    # "content"}, ...]}, rendered with the tokenizer's chat template; leantrain/data/examples.py)
    format: Literal["auto", "text", "instruct", "chat"] = "auto"
    # instruct / chat data: the loss only on completion / assistant tokens (false: on every token)
    mask_prompt: bool = True
    # instruct / chat data: several examples per sequence, no attention and no loss across them,
    # positions restarting at each (false: one example per sequence, padded)
    pack: bool = True
    # a held-out file scored every train.eval_every steps in place of the val_fraction split:
    # text, instruct / chat (the loss on what training trains on) or multiple choice ({"prompt",
    # "choices", "answer"}: accuracy too); the whole file each time (leantrain/train/evalset.py)
    eval_path: str | None = None


@dataclass
class OptimConfig:
    name: Literal["adamw", "sgd", "lion", "adams"] = "adamw"
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    schedule: Literal["cosine", "constant", "linear"] = "cosine"
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    decay_1d: bool = True  # false: no weight decay on 1-D parameters (norm weights, biases), as most LLM recipes
    momentum: float = 0.9  # SGD only
    nesterov: bool = False  # SGD only
    grad_clip: float = 1.0  # global-norm clipping (0 = off); see forge.clip for FORGE
    # lt.optim.Optimizer's step: auto = FORGE's update-only kernel per parameter on CUDA (one
    # launch each), the rule op by op elsewhere; torch = op by op always (the reference)
    backend: Literal["auto", "torch", "triton"] = "auto"


@dataclass
class TrainConfig:
    steps: int = 300
    seed: int = 1337
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["fp32", "bf16"] = "fp32"  # bf16: bf16 autocast (fp32 weights) or pure bf16 weights, see weights
    weights: Literal["fp32", "bf16"] = "fp32"
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 8
    ckpt_every: int = 100
    keep_checkpoints: int = 2
    sample_tokens: int = 80  # tokens of text generated at the end (0 = none)
    on_nonfinite: Literal["stop", "skip"] = "stop"
    progress: bool = True
    threads: int = 0  # torch CPU threads (0 = leave torch's default)
    # forward + backward captured once as a CUDA graph and replayed (leantrain/graphs.py): one host
    # call a step instead of a launch per kernel; one device, no FORGE, no gradient accumulation
    cuda_graph: bool = False
    # the model to start from (--from): a Hugging Face model directory (config.json, safetensors,
    # tokenizer files) or a leantrain run / checkpoint directory. The architecture and weights are
    # its; its tokenizer encodes the data (no BPE is trained); the model.* runtime fields (fused
    # kernels, loss_chunk, activation_checkpointing) and a model.max_seq_len set apart from the
    # preset's stay the run's (leantrain/train/init_from.py). None: random weights of the preset.
    init_from: str | None = None
    loggers: str = "jsonl"  # comma list of jsonl (metrics.jsonl, always written), tensorboard, wandb (train/trackers.py)
    wandb_project: str = "leantrain"  # the W&B project a wandb logger's run goes to


# the names train.loggers may list
LOGGERS = ("jsonl", "tensorboard", "wandb")


def logger_names(loggers: str) -> list[str]:
    """``"jsonl, tensorboard"`` -> ``["jsonl", "tensorboard"]`` (empty items dropped)."""
    return [name.strip() for name in loggers.split(",") if name.strip()]


@dataclass
class ForgeConfig:
    enabled: bool = False
    state_dtype: Literal["fp32", "bf16", "int8", "int8p"] = "fp32"
    stochastic_rounding: bool = True
    backend: Literal["auto", "torch", "triton"] = "auto"
    # global-norm clipping needs the norm before any update, impossible inside backward.
    # auto: est_global (this step's global norm estimated from the layers reduced so far; see
    # forge/README.md); layer / prev_global / est_global clip at clip_value (0: optim.grad_clip)
    clip: Literal["auto", "none", "layer", "prev_global", "est_global"] = "auto"
    clip_value: float = 0.0  # 0: use optim.grad_clip
    # a materialized dW (the split path) in fp32, or for bf16 layers in bf16 as torch's bf16
    # backward gives it (half its traffic; see forge/README.md)
    grad_dtype: Literal["fp32", "bf16"] = "fp32"
    # AdamW's / AdamS's sqrt and divisions by the GPU's approximate instructions (a few ulps; the
    # Triton kernels only; see forge/README.md)
    fast_math: bool = False
    # the dW kernel: auto (the measured per-shape choice: leantrain.forge.dispatch), tiles (the
    # fused tile loop), split (cuBLAS dW into one reused buffer + the update kernel), ws (the
    # warp-specialized fused kernel, Hopper)
    kernel: Literal["auto", "tiles", "split", "ws"] = "auto"


@dataclass
class AgoqConfig:
    enabled: bool = False
    bits: float = 4.0  # bit-width of the roles the default policy keeps at 4 bits (see agoq/README.md)
    group_size: int = 128
    stochastic: bool = True
    grad_bits: int = 0  # 8: int8 gradient accumulation buffers with error feedback (0 = off)
    pipeline_stage: int = 0
    pipeline_stages: int = 1
    roles: str = ""  # per-role bits over the default policy, e.g. "attn=4,norm=8" (16 = keep)
    logits_format: Literal["prob", "logp"] = "prob"  # log-softmax stored as exp(logp) or as is
    batch_mib: float = 512.0  # CUDA: saves packed per batch of this many MiB (0 = one launch per tensor)
    unpack_mib: float = 128.0  # CUDA: dequantized copies made at once in backward (0 = a whole batch)
    seed: int = 0  # stochastic-rounding noise seed
    replay: bool = True  # forwards with a seen signature follow their recorded save plan (agoq/README.md)
    derive: str = "silu,mul,swiglu"  # saves recomputed from other saves instead of stored: any of silu, mul, swiglu; "" (agoq/README.md)


@dataclass
class DistConfig:
    """How the processes of a ``torchrun`` job share the work."""

    # ddp: every rank holds the whole model and optimizer; gradients all-reduced (DDP, or inside
    # backward with FORGE). sharded: lt.parallel.ShardedOptimizer (ZeRO-style: optimizer state and
    # fp32 master weights sharded; gradients reduce-scattered, weights all-gathered)
    mode: Literal["ddp", "sharded"] = "ddp"
    intra_node_size: int = 0  # ranks per (pretend) node; 0 = LOCAL_WORLD_SIZE
    timeout_s: float = 120.0  # a collective that waits longer fails the job


@dataclass
class ScapeConfig:
    """SCAPE (``--comm.method scape``): sparse gradient traffic from first-moment masks."""

    density: float = 0.1  # fraction of each shard's coordinates sent a step
    score: Literal["m", "m_age"] = "m_age"  # mask by |m|, or |m| times the steps since the last update
    dense_steps: int = 1  # the first steps are dense
    catch_up: int = 10  # an update stands for the steps since the last one, at most this many (0: off)
    # mask scores relative to their tensor's mean |m| (each tensor gets its share of the mask)
    per_tensor: bool = False


@dataclass
class GiftConfig:
    """GIFT (``--comm.method gift``): FP8 / NVFP4 gradient all-reduce in K-FAC-whitened coordinates."""

    rank: int = 64  # eigenpairs kept per K-FAC factor (0: full rank)
    refresh_every: int = 10  # steps between factor refreshes
    min_numel: int = 16384  # the smallest linear weight sent whitened (smaller ones: sent as they are)
    whiten: bool = True  # false: every gradient sent unwhitened (the baseline GIFT improves on)
    format: Literal["e4m3", "nvfp4"] = "e4m3"  # FP8 E4M3, or NVFP4-style 4-bit (stochastic rounding)


@dataclass
class CommConfig:
    """Compressed gradient communication between data-parallel ranks.

    method: none (bf16/fp32 as the weights are); int8 (AGoQ's precision-preserving 8-bit
    all-reduce; dist.mode ddp, with or without FORGE); sdp4bit and scape (dist.mode sharded);
    gift (dist.mode ddp, without FORGE)."""

    method: Literal["none", "int8", "sdp4bit", "scape", "gift"] = "none"
    scape: ScapeConfig = field(default_factory=ScapeConfig)
    gift: GiftConfig = field(default_factory=GiftConfig)


@dataclass
class FinetuneConfig:
    """Fine-tuning methods (``leantrain finetune --method``) and the generated smoke-test tasks."""

    # full: back-propagation into every weight (the run's optimizer; FORGE with forge.enabled);
    # chunkft: into one chunk of the weights at a time; mezo / grzo: zeroth order (forwards only)
    method: Literal["full", "chunkft", "mezo", "grzo"] = "full"
    # a generated task as the data (leantrain/data/tasks.py): training on its answers, scored by
    # the choice among its candidates, encoded with train.init_from's tokenizer (without one:
    # data.tokenizer, or the BPE of data.path / the embedded corpus); none: the data of data.path
    task: Literal["none", "compare", "lookup", "parity"] = "none"
    eps: float = 1e-3  # the perturbation's scale (MeZO's eps, GRZO's sigma)
    num_chunks: int = 4  # ChunkFT: chunks of the parameters
    interval: int = 1  # ChunkFT: steps each chunk stays active
    eval_examples: int = 512  # examples of the generated task scored at each evaluation


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    forge: ForgeConfig = field(default_factory=ForgeConfig)
    agoq: AgoqConfig = field(default_factory=AgoqConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    preset: str = "tiny"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- presets


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


PRESETS = {"tiny": tiny, "small": small, "125m": m125, "1b": b1}


def preset(name: str) -> Config:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None


# ---------------------------------------------------------------- overrides


class ConfigError(ValueError):
    """A configuration the user wrote is wrong; the message says how to fix it."""


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
        (m.loss_chunk >= 0, "model.loss_chunk must be >= 0 (0: the loss in one piece)"),
        (d.tokenizer_vocab >= 300, "data.tokenizer_vocab must be at least 300 (256 bytes + specials)"),
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

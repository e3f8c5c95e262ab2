"""``--train.memory-budget``: the memory-first recipe. Estimate one device's peak bytes for a
run's configuration and pick the fastest set of leantrain's memory techniques that fits.

The budget is the peak of the bytes the run's tensors hold (torch's ``max_memory_allocated``):
on a 24 GB card leave about 1.5 GB for the CUDA context and the allocator's cache (``22GB``).

The estimate counts what the ledger counts (:mod:`leantrain.runtime.ledger`): weights,
gradients, optimizer state, saved activations, plus the step's largest transient (a layer's
weight gradient, the loss's logits slice). Its parts, for ``P`` parameters, ``L`` layers and
``N`` tokens a micro-batch:

- weights: ``P`` x 2 (bf16) or 4 bytes;
- torch-style AdamW (``full``): a gradient per weight plus two fp32 states;
- FORGE: no weight gradient for the linear layers (stepped inside backward), the states in
  ``forge.state_dtype`` (int8, fp8: one byte and a scale per 256), the other parameters' gradients;
- ChunkFT: the largest chunk's state (``finetune.chunk_state_dtype``) and, unless it steps inside
  backward (``--forge``), that chunk's fp32 gradient rows;
- saved activations per layer and token, from the layer's shapes (bf16): the two norms' inputs,
  q / k / v and the attention output, the MLP's gate / up and their product; with activation
  checkpointing one block input per layer plus one block's saves; AGoQ stores them at about
  ``agoq.bits`` bits.

The plans, fastest first: the configuration as given; FORGE with bf16 weights and bf16 states;
with int8 states and AGoQ; with int8 states and activation checkpointing (AGoQ does not compose
with checkpointing); then ChunkFT stepping inside backward (bf16 weights and state,
checkpointed) with 4, 8, ..., 256 chunks. The first whose estimate is within the budget less :data:`HEADROOM` is applied to the
config (its fields are the run's ``config.json``); when none is, the run is refused with the
leanest plan's figure. Zeroth-order methods hold no gradient or state: only their weights and
one forward's activations are checked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from leantrain.config import Config, ConfigError

HEADROOM = 0.03  # of the budget, kept for what the estimate leaves out
BLOCK_ELEMS = 1 << 22  # ChunkFT's row blocks (its default ``block_elems``)
_UNITS = {"gb": 1e9, "gib": 2 ** 30, "mb": 1e6, "mib": 2 ** 20, "tb": 1e12, "tib": 2 ** 40}


def parse_bytes(text: str) -> int:
    """``"24GB"`` -> 24e9, ``"22.5GiB"`` -> 22.5 * 2**30 (a unit is required)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B)\s*", text, flags=re.IGNORECASE)
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"train.memory_budget must be a size with its unit, such as 24GB or 22GiB; got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass
class Estimate:
    weights: int
    grads: int
    states: int
    activations: int
    transient: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.states + self.activations + self.transient


def _shapes(cfg: Config) -> dict:
    m = cfg.model
    # (a model from train.init_from has its vocabulary; a new one gets the tokenizer's, set later)
    vocab = m.vocab_size if cfg.train.init_from else cfg.data.tokenizer_vocab
    hd = m.head_dim or m.dim // m.n_heads
    q, kv = m.n_heads * hd, m.n_kv_heads * hd
    per_layer = m.dim * (q + 2 * kv) + q * m.dim + 3 * m.dim * m.ffn_dim + 2 * m.dim
    linear = m.dim * (q + 2 * kv) + q * m.dim + 3 * m.dim * m.ffn_dim  # (the layers FORGE steps in backward)
    head = 0 if m.tie_embeddings else vocab * m.dim
    return {"vocab": vocab, "q": q, "kv": kv, "layer": per_layer, "linear": m.n_layers * linear + head,
            "params": m.n_layers * per_layer + vocab * m.dim + head + m.dim,
            "largest": max(vocab * m.dim, m.dim * 2 * m.ffn_dim, m.dim * (q + 2 * kv)), "row": max(m.dim, m.ffn_dim)}


def parameter_count(cfg: Config) -> int:
    """The parameters of the model ``cfg`` describes (embedding, blocks, final norm, head)."""
    return _shapes(cfg)["params"]


def _state_bytes(dtype: str) -> float:
    return {"fp32": 4.0, "bf16": 2.0, "int8": 1.0 + 4.0 / 256, "int8p": 1.0, "fp8": 1.0 + 4.0 / 256}[dtype]


def estimate(cfg: Config) -> Estimate:
    """One device's bytes at the step's peak for ``cfg`` (one micro-batch's activations)."""
    m, s = cfg.model, _shapes(cfg)
    wb = 2 if cfg.train.weights == "bf16" else 4
    ab = 2 if (cfg.train.dtype == "bf16" or cfg.train.weights == "bf16") else 4
    tokens = cfg.data.batch_size * cfg.data.seq_len
    P = s["params"]
    method = cfg.finetune.method
    zeroth = method in ("mezo", "grzo")
    block_saves = (4 * m.dim + 2 * s["q"] + 2 * s["kv"] + 3 * m.ffn_dim) * ab  # bytes a token, one block
    if cfg.agoq.enabled:
        block_saves = int(block_saves * (cfg.agoq.bits + 1.0) / (8 * ab))  # (codes plus a scale per group)
    if zeroth:
        acts = 0
    elif m.activation_checkpointing:  # (every block's input, unless offloaded; one block's saves)
        acts = tokens * ((0 if m.activation_offload else m.n_layers * m.dim * ab) + block_saves)
    else:
        acts = tokens * m.n_layers * block_saves
    # the loss: the fused head keeps no logits; a slice of the vocabulary in fp32 at a time
    loss = tokens * (min(s["vocab"], 8192) if m.fused_loss else s["vocab"]) * 4 * 2
    if zeroth:
        grads = states = 0
        transient = loss + 4 * min(1 << 22, s["largest"])
    elif method == "chunkft":
        chunk = P / max(cfg.finetune.num_chunks, 1) + s["row"]  # (cuts fall between rows)
        states = int(2 * _state_bytes(cfg.finetune.chunk_state_dtype) * chunk)
        grads = 0 if cfg.forge.enabled else int(4 * chunk)
        transient = loss + 6 * 4 * min(BLOCK_ELEMS, s["largest"])  # (a row block's gradient and temporaries)
    elif cfg.forge.enabled:
        states = int(2 * _state_bytes(cfg.forge.state_dtype) * P)
        grads = (P - s["linear"]) * 4
        transient = loss + 4 * s["largest"]  # (a layer's dW where the split path materializes it)
    else:
        states, grads = 8 * P, P * wb
        transient = loss + 4 * s["largest"]
    return Estimate(P * wb, int(grads), int(states), int(acts), int(transient))


def plans(cfg: Config) -> list[tuple[str, dict]]:
    """The candidate plans, fastest first: (a name, the config fields it sets). A run asked for
    ChunkFT keeps it (only its chunks and precision change)."""
    out: list[tuple[str, dict]] = [("as given", {})]
    if cfg.finetune.method in ("mezo", "grzo"):
        return out
    if cfg.finetune.method != "chunkft":
        forge = {"train.weights": "bf16", "forge.enabled": True, "forge.state_dtype": "bf16"}
        out += [("FORGE, bf16 weights and states", forge),
                ("FORGE, bf16 weights, int8 states, AGoQ", {**forge, "forge.state_dtype": "int8", "agoq.enabled": True}),
                ("FORGE, bf16 weights, int8 states, activation checkpointing",
                 {**forge, "forge.state_dtype": "int8", "agoq.enabled": False, "model.activation_checkpointing": True})]
    for n in (4, 8, 16, 32, 64, 128, 256):
        out.append((f"ChunkFT + FORGE, {n} chunks, bf16 weights and state, activation checkpointing",
                    {"train.weights": "bf16", "forge.enabled": True, "forge.state_dtype": "fp32", "agoq.enabled": False,
                     "finetune.method": "chunkft", "finetune.num_chunks": n, "finetune.chunk_state_dtype": "bf16",
                     "model.activation_checkpointing": True}))
    # the leanest: the blocks' inputs in host memory too (two host copies of them a step)
    out.append(("ChunkFT + FORGE, 256 chunks, bf16 weights and state, activation checkpointing, the blocks' "
                "inputs offloaded to host memory", {**out[-1][1], "model.activation_offload": True}))
    return out


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _apply(cfg: Config, fields: dict) -> None:
    for key, value in fields.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)


def _with(cfg: Config, fields: dict) -> Config:
    import copy

    c = copy.deepcopy(cfg)
    _apply(c, fields)
    return c


def fit(cfg: Config, *, log=print) -> str:
    """Apply the fastest plan whose estimate fits ``train.memory_budget`` to ``cfg``; return its
    name. A ConfigError when none fits."""
    budget = parse_bytes(cfg.train.memory_budget)
    if cfg.dist.mode != "ddp":
        raise ConfigError(f"train.memory_budget plans one device holding the whole model; with dist.mode "
                          f"{cfg.dist.mode} drop --train.memory-budget")
    limit = budget * (1 - HEADROOM)
    tried = []
    for name, fields in plans(cfg):
        est = estimate(_with(cfg, fields))
        tried.append((name, est))
        if est.total <= limit:
            _apply(cfg, fields)
            log(f"memory budget {_size(budget)}: {name} (estimated peak {_size(est.total)}: weights "
                f"{_size(est.weights)}, gradients {_size(est.grads)}, optimizer state {_size(est.states)}, "
                f"activations {_size(est.activations)}, transient {_size(est.transient)})")
            return name
    name, est = tried[-1]
    raise ConfigError(
        f"train.memory_budget {cfg.train.memory_budget}: the leanest plan ({name}) needs about "
        f"{_size(est.total)} for this model (weights alone {_size(est.weights)}) at "
        f"{cfg.data.batch_size} x {cfg.data.seq_len} tokens, over {_size(limit)} "
        f"({100 * (1 - HEADROOM):.0f} % of the budget); raise the budget or lower data.batch_size / data.seq_len")


__all__ = ["Estimate", "HEADROOM", "estimate", "fit", "parse_bytes", "plans"]

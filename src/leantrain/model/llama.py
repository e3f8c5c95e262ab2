"""Llama, built from a :class:`leantrain.config.ModelConfig`.

RMSNorm (one autograd function, ``fused_norm``), rotary position embeddings (RoPE; one
function, ``fused_rope``), SwiGLU feed-forward, grouped-query attention through
``scaled_dot_product_attention`` (``enable_gqa``: K/V are neither repeated nor saved for
backward at the query heads' count), optional tied embedding / LM head, the cross-entropy
fused with the LM head in vocabulary slices, no logits tensor (``fused_loss``,
:class:`LMHead`), or after the logits in chunks of ``loss_chunk`` tokens
(:func:`chunked_cross_entropy`); optional activation checkpointing per block
(``activation_checkpointing``; with ``activation_offload`` the blocks' inputs wait in host memory,
:mod:`leantrain.model.offload`); q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj``
(``fused_proj``, the default: fewer, larger GEMMs and optimizer updates; checkpoints load either
way), and SwiGLU as one function saving gate and up only (``fused_swiglu``, the default).
Options for models brought from Hugging Face (:mod:`leantrain.model.hf`), all off by default:
q/k/v biases (``attention_bias``, concatenated like the weights), an RMSNorm per head on q and k
(``qk_norm``), a head width apart from ``dim / n_heads`` (``head_dim``), RoPE frequency scaling
(``rope_scaling``: "linear" or "llama3"), and a sliding window (``sliding_window``: stored; a
longer sequence is refused).
Every matrix is an ``nn.Linear`` (``x @ W.T``), which is what FORGE, AGoQ and ChunkFT hook
into. ``forward(idx, targets)`` returns the mean cross-entropy loss; ``forward(idx)`` returns
logits; ``reduction="none"`` gives per-example losses (zeroth-order fine-tuning uses them).

Packed sequences (``document_ids``, or ``idx`` given as :class:`Packed`): several documents in one
row, each a contiguous run of one id; a token attends only to earlier tokens of its own document
(SDPA with a block-diagonal causal mask) and its RoPE position counts from its document's first
token, so each document's logits are those it has alone. Targets of -100 add nothing to the loss.
Incremental decoding (``cache``, a :class:`KVCache`): the keys and values of the tokens already
seen are kept per layer, and a forward of the next tokens attends over them (:meth:`Llama.generate`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from leantrain.config import ModelConfig
from leantrain.model.extension import GradSink
from leantrain.model.losses import linear_cross_entropy
from leantrain.model.offload import offloaded_block
from leantrain.ops.norm import rms_norm, rms_norm_fwd_ref
from leantrain.ops.rope import rope, rope_ref
from leantrain.ops.swiglu import swiglu, swiglu_ref


class RMSNorm(nn.Module):
    """``round_x(x · rstd) · weight``, normalized in fp32. ``fused``: one autograd function that
    saves ``x`` and ``rstd`` only (:func:`leantrain.ops.norm.rms_norm`; Triton on CUDA);
    otherwise op by op (autograd keeps an fp32 copy of ``x`` and the normalized ``x`` too)."""

    def __init__(self, dim: int, eps: float = 1e-5, fused: bool = True):
        super().__init__()
        self.eps = eps
        self.fused = fused
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if self.fused:
            return rms_norm(x, self.weight, self.eps)
        return rms_norm_fwd_ref(x, self.weight, self.eps)[0]  # (the same ops, through autograd)


def head_dim_of(cfg: ModelConfig) -> int:
    """The width of one attention head: ``cfg.head_dim``, else ``dim // n_heads``."""
    return cfg.head_dim if cfg.head_dim is not None else cfg.dim // cfg.n_heads


def rope_inv_freq(head_dim: int, theta: float, *, scaling: str = "none", factor: float = 1.0,
                  low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                  original_max_seq_len: int = 8192, device=None) -> Tensor:
    """RoPE's ``head_dim / 2`` angular frequencies ``theta^(-2i / head_dim)``, scaled as
    :class:`leantrain.config.ModelConfig`'s ``rope_scaling`` says ("none", "linear", "llama3";
    the formulas of Hugging Face's ``rope_type`` of the same names)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling == "none":
        return inv_freq
    if scaling == "linear":
        return inv_freq / factor
    if scaling != "llama3":
        raise ValueError(f"rope scaling {scaling!r} is not modelled; use 'none', 'linear' or 'llama3'")
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = original_max_seq_len / low_freq_factor  # longer: divided by factor
    high_freq_wavelen = original_max_seq_len / high_freq_factor  # shorter: kept
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_seq_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, blended, scaled)


def rope_tables(head_dim: int, seq_len: int, theta: float, device=None, **scaling) -> tuple[Tensor, Tensor]:
    """``(cos, sin)`` of shape ``(seq_len, head_dim / 2)``; ``scaling``: :func:`rope_inv_freq`'s
    keywords."""
    inv_freq = rope_inv_freq(head_dim, theta, device=device, **scaling)
    t = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # (T, hd/2)
    return freqs.cos(), freqs.sin()


def rope_scaling_of(cfg: ModelConfig) -> dict:
    """:func:`rope_inv_freq`'s scaling keywords from a :class:`ModelConfig`."""
    return dict(scaling=cfg.rope_scaling, factor=cfg.rope_factor, low_freq_factor=cfg.rope_low_freq_factor,
                high_freq_factor=cfg.rope_high_freq_factor, original_max_seq_len=cfg.rope_original_max_seq_len)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: (B, H, T, hd); rotate pairs (x[..., :hd/2], x[..., hd/2:]) (the Hugging Face layout), op
    by op (``fused_rope=False``; :func:`leantrain.ops.rope.rope` is the one-function form)."""
    return rope_ref(x, cos, sin)


def rope_at(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: (B, H, T, hd) rotated by per-token tables ``cos, sin (B, T, hd/2)`` (positions that restart
    per document): :func:`apply_rope`'s arithmetic, each token at its own position."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Packed(NamedTuple):
    """Packed sequences as one model input: ``tokens (B, T)`` and ``document_ids (B, T)`` (each
    document a contiguous run of one id). ``model(Packed(...), targets)`` is
    ``model(tokens, targets, document_ids=...)``: callers that pass ``(x, y)`` through (the
    trainer, DDP) pass packed batches unchanged."""

    tokens: Tensor
    document_ids: Tensor


def document_positions(document_ids: Tensor) -> Tensor:
    """Each token's position in its document (0 at a document's first token): ``(B, T)``."""
    t = torch.arange(document_ids.shape[1], device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return t - torch.where(starts, t, 0).cummax(dim=1).values


def document_mask(document_ids: Tensor) -> Tensor:
    """``(B, 1, T, T)`` bool, true where query ``i`` may attend to key ``j``: ``j <= i`` in the same document."""
    T = document_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=document_ids.device).tril()
    return (document_ids[:, :, None] == document_ids[:, None, :]).logical_and(causal)[:, None]


class KVCache:
    """The keys and values of positions ``[0, length)`` of every layer, for incremental decoding.

    ``Llama.forward(idx, cache=cache)`` runs the tokens ``idx`` at positions ``length ..
    length + T - 1`` over the cached ones, appends their keys and values and advances ``length``.
    Buffers of ``max_len`` positions are made at the first forward, in the keys' dtype."""

    def __init__(self, n_layers: int, max_len: int):
        self.max_len, self.length = max_len, 0
        self.keys: list[Tensor | None] = [None] * n_layers
        self.values: list[Tensor | None] = [None] * n_layers

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write ``k, v (B, H_kv, T, hd)`` at ``length``; the keys and values of every position so far."""
        if self.keys[layer] is None:
            shape = (k.shape[0], k.shape[1], self.max_len, k.shape[3])
            self.keys[layer], self.values[layer] = k.new_empty(shape), v.new_empty(shape)
        end = self.length + k.shape[2]
        self.keys[layer][:, :, self.length:end] = k
        self.values[layer][:, :, self.length:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]


def _fuse_keys(parts: tuple[str, ...], fused: str):
    """A load_state_dict pre-hook: a checkpoint of the separate linears (``parts``) loads into
    the fused one (their weights, and biases if any, stacked by rows, in order)."""

    def hook(state_dict, prefix, *args):
        for kind in ("weight", "bias"):
            names = [f"{prefix}{p}.{kind}" for p in parts]
            if f"{prefix}{fused}.{kind}" not in state_dict and all(n in state_dict for n in names):
                state_dict[f"{prefix}{fused}.{kind}"] = torch.cat([state_dict.pop(n) for n in names], 0)

    return hook


def _split_keys(fused: str, parts: tuple[str, ...], sizes):
    """A load_state_dict pre-hook: a checkpoint of the fused linear loads into the separate ones."""

    def hook(state_dict, prefix, *args):
        for kind in ("weight", "bias"):
            name = f"{prefix}{fused}.{kind}"
            if name in state_dict and not any(f"{prefix}{p}.{kind}" in state_dict for p in parts):
                for p, w in zip(parts, state_dict.pop(name).split(list(sizes), 0)):
                    state_dict[f"{prefix}{p}.{kind}"] = w

    return hook


class Attention(nn.Module):
    """Causal grouped-query attention: q/k/v projections (with biases: ``attention_bias``), an
    RMSNorm per head on q and k (``qk_norm``), RoPE, SDPA, ``o_proj``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = head_dim_of(cfg)
        self.sdpa_gqa = cfg.sdpa_gqa
        self.rope = rope if cfg.fused_rope else apply_rope
        self.sizes = (cfg.n_heads * self.head_dim, cfg.n_kv_heads * self.head_dim, cfg.n_kv_heads * self.head_dim)
        self.fused = cfg.fused_proj
        bias = cfg.attention_bias
        if self.fused:  # rows [q; k; v]
            self.qkv_proj = nn.Linear(cfg.dim, sum(self.sizes), bias=bias)
            self._register_load_state_dict_pre_hook(_fuse_keys(("q_proj", "k_proj", "v_proj"), "qkv_proj"))
        else:
            self.q_proj = nn.Linear(cfg.dim, self.sizes[0], bias=bias)
            self.k_proj = nn.Linear(cfg.dim, self.sizes[1], bias=bias)
            self.v_proj = nn.Linear(cfg.dim, self.sizes[2], bias=bias)
            self._register_load_state_dict_pre_hook(_split_keys("qkv_proj", ("q_proj", "k_proj", "v_proj"), self.sizes))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps, cfg.fused_norm)
            self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps, cfg.fused_norm)
        self.qk_norm = cfg.qk_norm
        self.o_proj = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None = None,
                cache: tuple[KVCache, int] | None = None) -> Tensor:
        """``cos, sin``: the position tables (rows from position 0, or of the cache's length on), or
        per-token tables ``(B, T, hd/2)`` of packed sequences; ``mask``: where a query may attend
        (None: causal); ``cache``: (the cache, this layer's index)."""
        B, T, _ = x.shape
        if self.fused:  # (split: its backward is one cat of dq, dk, dv)
            q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
            v = v.contiguous()  # (attention saves v: as a view it would keep all of q, k, v alive)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(B, T, self.n_heads, self.head_dim)
        k = k.view(B, T, self.n_kv, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        rotate = rope_at if cos.dim() == 3 else self.rope
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if cache is not None:
            k, v = cache[0].update(cache[1], k, v)
        gqa = self.n_kv != self.n_heads
        if gqa and not self.sdpa_gqa:
            rep = self.n_heads // self.n_kv
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           enable_gqa=gqa and self.sdpa_gqa)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ffn_dim, self.fused, self.fused_swiglu = cfg.ffn_dim, cfg.fused_proj, cfg.fused_swiglu
        if self.fused:  # rows [gate; up]
            self.gate_up_proj = nn.Linear(cfg.dim, 2 * cfg.ffn_dim, bias=False)
            self._register_load_state_dict_pre_hook(_fuse_keys(("gate_proj", "up_proj"), "gate_up_proj"))
        else:
            self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
            self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
            self._register_load_state_dict_pre_hook(_split_keys("gate_up_proj", ("gate_proj", "up_proj"),
                                                                (cfg.ffn_dim, cfg.ffn_dim)))
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        if self.fused and self.fused_swiglu:  # (the one output's halves; their gradient written as one)
            return self.down_proj(swiglu(self.gate_up_proj(x)))
        if self.fused:  # (gate and up: strided halves of one output)
            gate, up = self.gate_up_proj(x).split(self.ffn_dim, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(swiglu(gate, up) if self.fused_swiglu else swiglu_ref(gate, up))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.fused_norm)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.fused_norm)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None = None, cache=None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LMHead(nn.Linear):
    """The output projection. ``head(h)``: the logits. ``head(h, targets)``: the per-token
    cross-entropy of those logits, computed in vocabulary slices without the logits tensor
    (:func:`leantrain.model.losses.linear_cross_entropy`; ``budget``: logits held at once, in tokens).

    Its matmul goes through ``linear_fn`` (as ``lt.parallel.tp``'s layers' does), which a
    technique may replace. ``grad_sink`` (:class:`leantrain.model.extension.GradSink`, None by
    default): set by a technique that consumes the head's weight gradient in backward; the fused
    loss then writes dW into it slice by slice. Called as a module, so saved-tensor hooks see the
    saved input under the LM head's role."""

    linear_fn = staticmethod(F.linear)

    def __init__(self, dim: int, vocab: int, budget: int):
        super().__init__(dim, vocab, bias=False)
        self.budget = budget
        self.grad_sink: GradSink | None = None

    def forward(self, x: Tensor, targets: Tensor | None = None, ignore_index: int = -100) -> Tensor:
        if targets is None:
            return self.linear_fn(x, self.weight, self.bias)
        return linear_cross_entropy(x, self.weight, targets, bias=self.bias, budget=self.budget,
                                    ignore_index=ignore_index, grad_sink=self.grad_sink)


def chunked_cross_entropy(logits: Tensor, targets: Tensor, chunk: int, ignore_index: int = -100) -> Tensor:
    """Per-token cross-entropy of ``logits [N, V]`` (any float dtype; computed in fp32) against
    ``targets [N]``, ``chunk`` rows at a time (0: all at once).

    Each chunk is its own ``F.cross_entropy`` node: its fp32 copy, log-softmax (what backward
    keeps) and gradients are a chunk's size. The whole-batch form holds ~4 such fp32 passes at
    once (at 1b, B = 8, vocab 32000: 1 GiB each), which is where a step's memory peaks. Every
    row's math is unchanged, so the loss and the gradient are those of the one-piece form."""
    n = logits.shape[0]
    if chunk <= 0 or n <= chunk:
        return F.cross_entropy(logits.float(), targets, reduction="none", ignore_index=ignore_index)
    # (split's backward concatenates the chunks' gradients.)
    return torch.cat([F.cross_entropy(x.float(), t, reduction="none", ignore_index=ignore_index)
                      for x, t in zip(logits.split(chunk), targets.split(chunk), strict=True)])


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.head_dim is None and cfg.dim % cfg.n_heads:
            raise ValueError(f"model: dim ({cfg.dim}) must divide into n_heads ({cfg.n_heads}) heads, "
                             "or head_dim must be set")
        if cfg.n_heads % cfg.n_kv_heads or head_dim_of(cfg) % 2 or head_dim_of(cfg) < 2:
            raise ValueError(f"model: heads must be of even size (got {head_dim_of(cfg)}) and n_heads "
                             f"({cfg.n_heads}) a multiple of n_kv_heads ({cfg.n_kv_heads})")
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.fused_norm)
        self.lm_head = LMHead(cfg.dim, cfg.vocab_size, cfg.loss_chunk)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        cos, sin = rope_tables(head_dim_of(cfg), cfg.max_seq_len, cfg.rope_theta, **rope_scaling_of(cfg))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = 0.02
        for name, p in self.named_parameters():
            if name.endswith(".bias"):
                nn.init.zeros_(p)
            elif p.dim() == 1:
                nn.init.ones_(p)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * self.cfg.n_layers))
            else:
                nn.init.normal_(p, 0.0, std)

    def compile_blocks(self, backend: str = "inductor") -> None:
        """``torch.compile`` each block in place (``nn.Module.compile``: parameter names and the
        state dict are unchanged, so checkpoints and exports are those of the eager model)."""
        for layer in self.layers:
            layer.compile(backend=backend)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def _positions(self, idx: Tensor, document_ids: Tensor | None, cache: KVCache | None):
        """(cos, sin, mask) of a forward: the tables from position 0 and causal attention; per-token
        tables and the block-diagonal mask of packed documents; or the rows after the cache's
        positions and a mask over them."""
        T = idx.shape[1]
        start = 0 if cache is None else cache.length
        if start + T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {start + T} exceeds model.max_seq_len {self.cfg.max_seq_len}")
        if self.cfg.sliding_window is not None and start + T > self.cfg.sliding_window:
            raise ValueError(f"sequence length {start + T} exceeds the model's sliding window "
                             f"({self.cfg.sliding_window} tokens), which is not modelled; use sequences "
                             "of at most that many tokens")
        if document_ids is not None:
            if cache is not None:
                raise ValueError("packed sequences (document_ids) cannot be decoded with a KV cache")
            pos = document_positions(document_ids)
            return self.rope_cos[pos], self.rope_sin[pos], document_mask(document_ids)
        if start == 0:
            return self.rope_cos, self.rope_sin, None
        keys = torch.arange(start + T, device=idx.device)
        mask = keys[None, :] <= (start + torch.arange(T, device=idx.device))[:, None]
        return self.rope_cos[start:], self.rope_sin[start:], mask

    def forward(self, idx: Tensor | Packed, targets: Tensor | None = None, reduction: str = "mean", *,
                document_ids: Tensor | None = None, cache: KVCache | None = None) -> Tensor:
        """The mean loss against ``targets`` (-100: no loss), per-example losses (``reduction="none"``:
        computed from the head's logits, which a forward hook on the head sees),
        or the logits (no ``targets``). ``document_ids``: packed sequences (module docstring);
        ``cache``: incremental decoding (the cache advances by ``idx``'s length)."""
        if isinstance(idx, Packed):
            idx, document_ids = idx
        cos, sin, mask = self._positions(idx, document_ids, cache)
        x = self.embed_tokens(idx)
        ckpt = self.cfg.activation_checkpointing and self.training and torch.is_grad_enabled()
        for i, layer in enumerate(self.layers):
            if ckpt and self.cfg.activation_offload:
                x = offloaded_block(layer, x, cos, sin, mask)
            elif ckpt:  # (the blocks draw no random numbers: no RNG state to save and restore)
                x = checkpoint(layer, x, cos, sin, mask, use_reentrant=False, preserve_rng_state=False)
            else:
                x = layer(x, cos, sin, mask, None if cache is None else (cache, i))
        if cache is not None:
            cache.length += idx.shape[1]
        h = self.norm(x)
        if targets is None:
            return self.lm_head(h)
        if self.cfg.fused_loss and reduction == "mean":
            loss = self.lm_head(h.flatten(0, 1), targets.flatten())
        else:
            loss = chunked_cross_entropy(self.lm_head(h).flatten(0, 1), targets.flatten(), self.cfg.loss_chunk)
        if reduction == "none":  # per-example mean over its tokens
            mask = (targets != -100).float()
            return (loss.view_as(targets) * mask).sum(1) / mask.sum(1).clamp_min(1.0)
        if reduction != "mean":
            raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
        return loss.sum() / (targets != -100).sum().clamp_min(1)

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, temperature: float = 0.8, top_k: int | None = 40,
                 generator=None, *, use_cache: bool = True, stop_ids=()) -> Tensor:
        """``idx`` followed by up to ``max_new_tokens`` tokens: greedy (``temperature`` 0) or sampled
        from the softmax at ``temperature`` over the ``top_k`` likeliest (None: all). With
        ``use_cache`` and room for them all in ``max_seq_len``, each new token is one forward of
        one position over a :class:`KVCache`; otherwise each step runs the last ``max_seq_len``
        tokens whole. Stops early once every row has produced one of ``stop_ids``."""
        cache = None
        if use_cache and idx.shape[1] + max_new_tokens <= self.cfg.max_seq_len:
            cache = KVCache(self.cfg.n_layers, idx.shape[1] + max_new_tokens)
        stop = torch.tensor(list(stop_ids), device=idx.device, dtype=idx.dtype)
        done = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
        step_input = idx
        for _ in range(max_new_tokens):
            if cache is None:
                step_input = idx[:, -self.cfg.max_seq_len:]
            logits = self(step_input, cache=cache)[:, -1, :].float()
            if temperature <= 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    v, _ = torch.topk(logits, min(top_k, logits.shape[-1]))
                    logits[logits < v[:, [-1]]] = -float("inf")
                nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat((idx, nxt), dim=1)
            step_input = nxt
            done |= torch.isin(nxt[:, 0], stop)
            if len(stop) and bool(done.all()):
                break
        return idx

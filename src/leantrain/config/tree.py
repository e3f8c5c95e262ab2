"""The sections of the configuration tree, one dataclass each, and ``Config``, the whole tree.

A field's comment (beside it, or the lines above it) is its documentation: ``leantrain config``
prints it (:func:`leantrain.config.field_docs` reads this file).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal


class ConfigError(ValueError):
    """A configuration the user wrote is wrong; the message says how to fix it."""


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
    # with activation_checkpointing: each block's input in pinned host memory from its forward to
    # its backward (copied out on a side stream, back before the recompute; leantrain/model/offload.py),
    # so the device holds one block's activations, not every block's input. One process only.
    activation_offload: bool = False


@dataclass
class DataConfig:
    path: str | None = None  # None: the embedded corpus (the running Python's standard library)
    seq_len: int = 128
    batch_size: int = 16  # sequences per micro-batch per rank
    grad_accum: int = 1  # micro-batches per optimizer step
    tokenizer_vocab: int = 4096  # BPE vocabulary trained on the corpus
    val_fraction: float = 0.05  # share of files (or of tokens for a single file) held out; none with eval_path
    max_corpus_mb: float = 24.0  # cap on the embedded corpus text, for quick set-up
    # MB of a text corpus the BPE tokenizer is trained on, sampled over the whole corpus (larger
    # corpora are still tokenized whole)
    tokenizer_sample_mb: float = 64.0
    bin_vocab_size: int | None = None  # vocabulary of a .bin token file without <file>.bin.json / meta.json
    bin_dtype: Literal["uint16", "uint32"] | None = None  # its ids' dtype (default uint16, or its metadata's)
    # the tokenizer of text data: a tokenizer.json file or a Hugging Face model directory; None: a
    # BPE of tokenizer_vocab tokens trained on the corpus (or, with train.init_from, the model's own)
    tokenizer: str | None = None
    # what a record file (.jsonl, .json, .parquet, a datasets directory: leantrain/data/records.py)
    # holds: auto (from the first record's fields), text ({"text"}), instruct
    # ({"prompt", "completion"} or {"prompt", "response"}), chat ({"messages": [{"role",
    # "content"}, ...]}, rendered with the tokenizer's chat template; leantrain/data/examples.py)
    format: Literal["auto", "text", "instruct", "chat"] = "auto"
    # instruct / chat data: the loss only on completion / assistant tokens (false: on every token)
    mask_prompt: bool = True
    # instruct / chat data: several examples per sequence, no attention and no loss across them,
    # positions restarting at each (false: one example per sequence, padded)
    pack: bool = True
    # a held-out file scored every train.eval_every steps in place of the val_fraction split (then
    # nothing of data.path is held out):
    # text, instruct / chat (the loss on what training trains on) or multiple choice ({"prompt",
    # "choices", "answer"}: accuracy too), in any file data.path reads (a DatasetDict directory: its
    # validation, else test, split); the whole file each time (leantrain/train/evalset.py)
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
    # one device's memory budget, e.g. "24GB" or "22GiB": the fastest plan of leantrain's memory
    # techniques whose estimated peak fits is applied (leantrain/train/budget.py); "": as given
    memory_budget: str = ""
    # a progress line every log_every steps; every step has its row in metrics.jsonl, but the rows'
    # values are read from the device only after a log step (no host sync on the steps between)
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
    # compile each transformer block with torch.compile (after the techniques attach; one graph
    # per block, so a technique's hooks between blocks stay eager); techniques that cannot run
    # compiled refuse it (docs/configuration.md)
    compile: bool = False
    compile_backend: str = "inductor"  # torch.compile's backend (aot_eager: no code generation, for checks)
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
    state_dtype: Literal["fp32", "bf16", "int8", "int8p", "fp8"] = "fp32"
    stochastic_rounding: bool = True
    backend: Literal["auto", "torch", "triton"] = "auto"
    # global-norm clipping needs the norm before any update, impossible inside backward.
    # auto: est_global (this step's global norm estimated from the layers reduced so far; see
    # docs/forge.md); layer / prev_global / est_global clip at clip_value (0: optim.grad_clip)
    clip: Literal["auto", "none", "layer", "prev_global", "est_global"] = "auto"
    clip_value: float = 0.0  # 0: use optim.grad_clip
    # a materialized dW (the split path) in fp32, or for bf16 layers in bf16 as torch's bf16
    # backward gives it (half its traffic; see docs/forge.md)
    grad_dtype: Literal["fp32", "bf16"] = "fp32"
    # AdamW's / AdamS's sqrt and divisions by the GPU's approximate instructions (a few ulps; the
    # Triton kernels only; see docs/forge.md)
    fast_math: bool = False
    # the dW kernel: auto (the measured per-shape choice: leantrain.forge.dispatch), tiles (the
    # fused tile loop), split (cuBLAS dW into one reused buffer + the update kernel), ws (the
    # warp-specialized fused kernel, Hopper)
    kernel: Literal["auto", "tiles", "split", "ws"] = "auto"
    accum_dtype: Literal["bf16", "fp32", "int8"] = "bf16"  # data.grad_accum > 1: each fused layer's gradient sum (docs/forge.md)
    # accum_dtype int8: keep the int8 error-feedback residual (2.03 bytes a parameter) or not (1.02)
    accum_error_feedback: bool = True


@dataclass
class AgoqConfig:
    enabled: bool = False
    bits: float = 4.0  # bit-width of the roles the default policy keeps at 4 bits (see docs/agoq.md)
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
    replay: bool = True  # forwards with a seen signature follow their recorded save plan (docs/agoq.md)
    derive: str = "silu,mul,swiglu"  # saves recomputed from other saves instead of stored: any of silu, mul, swiglu; "" (docs/agoq.md)


@dataclass
class DistConfig:
    """How the processes of a ``torchrun`` job share the work."""

    # ddp: every rank holds the whole model and optimizer; gradients all-reduced (DDP, or inside
    # backward with FORGE). sharded: lt.parallel.ShardedOptimizer (ZeRO-style: optimizer state and
    # fp32 master weights sharded; gradients reduce-scattered, weights all-gathered). fsdp: PyTorch
    # FSDP2 (weights, gradients and optimizer state sharded per block; DCP checkpoints, docs/fsdp.md)
    mode: Literal["ddp", "sharded", "fsdp"] = "ddp"
    intra_node_size: int = 0  # ranks per (pretend) node; 0 = LOCAL_WORLD_SIZE
    # sharded: MiB of fp32 gradient a bucket (one reduce-scatter and one weight all-gather each, launched
    # during backward); larger buckets launch fewer kernels a step (SCAPE's compute: docs/scape.md)
    bucket_mb: float = 25.0
    timeout_s: float = 120.0  # a collective that waits longer fails the job
    replicate: int = 1  # fsdp: data-parallel replicas (HSDP), each sharding over world/replicate ranks; 1: plain FSDP
    param_dtype: Literal["fp32", "bf16"] = "fp32"  # fsdp: the dtype weights are all-gathered and computed in
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"  # fsdp: the dtype gradients are reduce-scattered in
    cpu_offload: bool = False  # fsdp: sharded weights, gradients and optimizer state live in CPU memory


@dataclass
class ScapeConfig:
    """SCAPE (``--comm.method scape``): sparse gradient traffic from first-moment masks."""

    density: float = 0.1  # fraction of each shard's coordinates sent a step
    # mask by |m|, by |m| times the steps since the last update, or by the owner's own error-feedback
    # residual on its shard (the gradient it has accumulated and not yet sent)
    score: Literal["m", "m_age", "residual"] = "m_age"
    explore: float = 0.1  # share of the mask taken from a rotating window instead of the top scores
    dense_steps: int = 1  # the first steps are dense
    # an update stands for the steps since the last one, at most this many (0: off); None: 10 for each
    # tenfold fall of the density, 10 * log10(1 / density) (10 at 90 % sparsity, 20 at 99 %)
    catch_up: int | None = None
    # steps: an update moves min(τ, catch_up) steps' distance; sign: that where the mean gradient
    # agrees in sign with the first moment, its square root where it does not (noise random-walks)
    catch_up_mode: Literal["steps", "sign"] = "sign"
    # mask scores relative to their tensor's mean |m| (each tensor gets its share of the mask)
    per_tensor: bool = False
    # the first moment's β1 on the masked updates (AdamS, AdamW); 0: the optimizer's. A coordinate is
    # updated once in ~1/density steps, so the optimizer's 0.9 averages over ten times the steps
    beta1: float = 0.8
    # the density falls geometrically from 1 to `density` over the first steps (0: off); None: 100 steps
    # for each tenfold fall, 100 * log10(1 / density) (100 at 90 % sparsity, 200 at 99 %)
    warmup: int | None = None


@dataclass
class GiftConfig:
    """GIFT (``--comm.method gift``): FP8 / NVFP4 gradient all-reduce in K-FAC-whitened coordinates."""

    rank: int = 64  # eigenpairs kept per K-FAC factor (0: full rank)
    refresh_every: int = 10  # steps between factor refreshes
    min_numel: int = 16384  # the smallest linear weight sent whitened (smaller ones: sent as they are)
    whiten: bool = True  # false: every gradient sent unwhitened (the baseline GIFT improves on)
    format: Literal["e4m3", "nvfp4"] = "e4m3"  # FP8 E4M3, or NVFP4-style 4-bit (stochastic rounding)
    # precision of the whitening transforms' products with the gradients (docs/gift.md): fp32; TF32 on
    # CUDA (fp32 elsewhere); bf16 (under 1 % error in the whitened metric, below E4M3's rounding)
    transform_dtype: Literal["float32", "tfloat32", "bfloat16"] = "float32"
    # whiten only layers whose estimated gain (Euclidean / GIFT error in the K-FAC metric, measured by
    # each layer's root at every refresh) is at least this; the others are sent Euclidean (0: all whitened)
    min_gain: float = 0.0
    # the most tokens a layer's K-FAC statistics take from a refresh step's forward and backward, evenly
    # strided (0: every token); a wide layer's statistics otherwise cost more than the step (docs/gift.md)
    stat_tokens: int = 0


@dataclass
class Sdp4bitConfig:
    """SDP4Bit (``--comm.method sdp4bit``): 4-bit two-level gradient reduce-scatter and 4-bit
    weight-difference all-gather (docs/sdp4bit.md)."""

    # the 4-bit weight-difference all-gather; None: on with dist.mode sharded, off with fsdp (FSDP
    # keeps no whole weights between steps to take the difference from, so true is refused there)
    weights: bool | None = None


@dataclass
class CommConfig:
    """Compressed gradient communication between data-parallel ranks.

    method: none (bf16/fp32 as the weights are); int8 (AGoQ's precision-preserving 8-bit
    all-reduce; dist.mode ddp, with or without FORGE; under dist.mode fsdp its 8-bit
    reduce-scatter, without FORGE); sdp4bit (dist.mode sharded; its gradient
    half also with dist.mode fsdp); scape (dist.mode sharded); gift (dist.mode ddp, without FORGE)."""

    method: Literal["none", "int8", "sdp4bit", "scape", "gift"] = "none"
    sdp4bit: Sdp4bitConfig = field(default_factory=Sdp4bitConfig)
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
    # ChunkFT: the chunks' optimizer state (device arena and host block); the rule computes in fp32.
    # With --forge, ChunkFT steps its working set inside backward (no gradient tensor held).
    chunk_state_dtype: Literal["fp32", "bf16"] = "fp32"
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

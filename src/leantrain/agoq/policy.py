"""The AGoQ policy: how many bits each saved activation gets, by role and pipeline stage.

Roles (what a saved tensor *is*, known from the module that is running when autograd saves
it; see :mod:`leantrain.agoq.hooks`):

=============  ==========================================================  =====
role           saved tensor (Llama)                                        bits
=============  ==========================================================  =====
``qkv_in``     input of q/k/v_proj (the attention RMSNorm's output)         4
``attn``       q, k, v, out saved by SDPA inside the attention              8
``o_in``       input of o_proj (attention output, heads merged)             4
``mlp_in``     input of gate/up_proj (the MLP RMSNorm's output)             4
``gate_up``    SiLU input, up output (SwiGLU); SiLU output derived          4
``down_in``    input of down_proj (SiLU(gate) * up): derived                (0)
``norm``       RMSNorm input (residual stream) and normalized x             4
``head_in``    input of the LM head (final RMSNorm output)                  8
``logits``     log-softmax (saved by cross-entropy), stored as p = exp      4, min/max on p
``linear_in``  input of any other Linear-like module                        4
``other``      any other float tensor                                       8
``mask``       boolean tensors                                              1 (exact)
=============  ==========================================================  =====

Derived (``derive``, default ``"silu,mul,swiglu"``): not stored at all, recomputed in backward
from saves already packed: SiLU's output from its input ``ĝ``, the down projection's input as
``silu(ĝ)·û`` (op by op: ``mul``; ``model.fused_swiglu``'s one function: ``swiglu``)
(:class:`leantrain.agoq.saved.Derived`). Measured on the tiny preset, this lowers
the gradient error too (every parameter together: 0.147 → 0.137; down_proj's worst layer:
0.29 → 0.25; ``benchmarks/tools/agoq_derive_error.py``). Its input is then
the product of two 4-bit tensors, not a heavy-tailed product quantized on its own grid.
``derive=""`` packs them at their roles' widths (4 bits) as before.

Never quantized (kept as they are): parameters, buffers and views of them, integer tensors,
tensors that do not require grad (RoPE tables, constants), reduced statistics (a last
dimension of 1 such as RMSNorm's rstd, and SDPA's log-sum-exp / softmax statistics: fp32
tensors of lower rank than q inside attention), and tensors under ``min_numel`` elements.

Why these widths: linear inputs feed ``dW = dYᵀX``, a sum over tokens in which
unbiased (stochastic-rounding) 4-bit noise averages out; the SwiGLU tensors set the local
derivative of an element-wise op and tolerate 4 bits as well. The residual stream / norm
input is the quantity RMSNorm divides by its own RMS: an outlier-heavy, sensitive tensor
(COAT keeps it fine-grained), so 8 bits. Attention: SDPA's backward recomputes the
probabilities ``exp(q·k/√d - lse)`` from the saved q, k and the *exact* saved log-sum-exp, so
an error in q or k is exponentiated and not renormalized; once attention is sharp (a trained
model) 4-bit q/k give gradient errors larger than the gradient itself (1.49x after 300 tiny
steps), 8 bits 1.5 %.
Log-softmax backward reads only ``p = exp(logp)``: AGoQ stores ``p`` (``logits_format =
"prob"``, min/max grid on ``p``, stochastic rounding unbiased in ``p``), where a grid on
``logp`` gives every probability the same relative error and a bias through ``exp``; 4 bits on
``p`` cost less gradient error than 4 bits on ``logp`` and free the bytes that 8-bit attention
needs. The measured gradient error of each choice is in ``docs/agoq.md`` (``calibrate``
re-measures it on your model).

Pipeline rule (1F1B): stage ``s`` of ``p`` stages holds ``k(s) = min(p - s, m)`` micro-batches'
activations in flight (``m`` micro-batches per step). AGoQ makes the held bytes ``k(s) * b(s)``
about equal across stages: ``b(s) = floor_allowed(b_role * k̄ / k(s))``, where ``k̄`` is the
mean of ``k`` over stages, ``floor_allowed`` the largest allowed width (2, 3, 4, 8) not above
the value, clamped to ``[min_bits, 8]``. E.g. p = 4, m ≥ 4, ``b_role = 4``: k = 4, 3, 2, 1,
k̄ = 2.5, bits = 2, 3, 4, 8 (k·b = 8, 9, 8, 8; mean 4.25 bits). Earlier stages get fewer bits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

ROLES = ("qkv_in", "attn", "o_in", "mlp_in", "gate_up", "down_in", "norm", "head_in", "logits",
         "linear_in", "other")
ALLOWED_BITS = (2, 3, 4, 8)
DERIVATIONS = ("silu", "mul", "swiglu")  # saves AGoQ can recompute instead of storing (Policy.derive)
KEEP = 16  # a role given 16 (or more) bits is not quantized


@dataclass
class Policy:
    """Bits per role (16 = keep as is), group size, rounding, and the pipeline-stage rule."""

    qkv_in: int = 4
    attn: int = 8
    o_in: int = 4
    mlp_in: int = 4
    gate_up: int = 4
    down_in: int = 4
    norm: int = 4
    head_in: int = 8
    logits: int = 4
    linear_in: int = 4
    other: int = 8
    group_size: int = 128  # elements per scale (64-128 advised; 2/3 bits need a multiple of 8)
    stochastic: bool = True  # stochastic rounding (unbiased)
    min_numel: int = 1024  # smaller tensors are kept as they are
    pipeline_stages: int = 1  # p
    micro_batches: int = 0  # m (0: = p, the 1F1B steady state)
    min_bits: int = 2  # the stage rule never goes below this
    seed: int = 0
    # "prob": the log-softmax is stored as p = exp(logp) on a min/max grid (backward uses only
    # exp(logp): stochastic rounding of p is unbiased in what backward reads); "logp": as is
    logits_format: str = "prob"
    # On CUDA, 4/8-bit saves are packed in batches: one quantize launch per batch (flushed when
    # the tensors waiting hold this many MiB, and at the end of the forward) and dequantize
    # launches of up to unpack_mib each in backward. The waiting tensors stay alive until the flush: this
    # bounds the extra memory. 0: each tensor is packed at once (one launch per tensor). 512 MiB:
    # few flushes, each ~0.27 ms of host time under the profiler, on a forward that is host-bound.
    batch_mib: float = 512.0
    # In backward, a batch member's first unpack dequantizes, in the same launch, the members saved
    # before it (the next ones backward takes), up to this many MiB of dequantized tensors: this
    # bounds the copies alive at once, whatever the batch's size. 0: every live member at once.
    unpack_mib: float = 128.0
    # saves recomputed in backward from other saves' packed copies instead of stored (comma list,
    # "" = none): "silu" (SwiGLU's silu(g) from SiLU's saved input g: no more error than storing
    # it), "mul" (the down projection's input silu(g)·u from those two: two 4-bit errors in the
    # product instead of one), "swiglu" (the same input from the saves of SwiGLU as one function,
    # model.fused_swiglu). See docs/agoq.md for the measured memory and gradient error.
    derive: str = "silu,mul,swiglu"

    def __post_init__(self):
        for r in ROLES:
            b = getattr(self, r)
            if b not in ALLOWED_BITS and b < KEEP:
                raise ValueError(f"agoq.Policy.{r}={b}: bits must be one of {ALLOWED_BITS} or >= {KEEP} (keep)")
        if not (8 <= self.group_size <= 4096) or self.group_size % 8:
            raise ValueError(f"agoq.Policy.group_size={self.group_size}: use a multiple of 8 in [8, 4096] (64-128 advised)")
        if self.pipeline_stages < 1:
            raise ValueError("agoq.Policy.pipeline_stages must be >= 1")
        if self.min_bits not in ALLOWED_BITS:
            raise ValueError(f"agoq.Policy.min_bits must be one of {ALLOWED_BITS}")
        if self.batch_mib < 0:
            raise ValueError(f"agoq.Policy.batch_mib={self.batch_mib}: use >= 0 (0 packs each tensor at once)")
        if self.unpack_mib < 0:
            raise ValueError(f"agoq.Policy.unpack_mib={self.unpack_mib}: use >= 0 (0 dequantizes a batch at once)")
        if self.logits_format not in ("prob", "logp"):
            raise ValueError(f"agoq.Policy.logits_format={self.logits_format!r}: use 'prob' or 'logp'")
        unknown = [x for x in self.derive.split(",") if x and x not in DERIVATIONS]
        if unknown:
            raise ValueError(f"agoq.Policy.derive={self.derive!r}: {unknown} unknown; use a comma list of "
                             f"{', '.join(DERIVATIONS)} ('' for none)")

    # ------------------------------------------------------------------ stage rule

    def in_flight(self, stage: int) -> int:
        """Micro-batches whose activations stage ``stage`` holds under 1F1B: min(p - s, m)."""
        p = self.pipeline_stages
        m = self.micro_batches or p
        if not 0 <= stage < p:
            raise ValueError(f"stage {stage} is outside 0..{p - 1}")
        return min(p - stage, m)

    def stage_factor(self, stage: int) -> float:
        p = self.pipeline_stages
        mean_k = sum(self.in_flight(s) for s in range(p)) / p
        return mean_k / self.in_flight(stage)

    def bits_for(self, role: str, stage: int = 0) -> int:
        """Bits for a tensor of ``role`` on pipeline ``stage`` (16 = keep, 1 for masks)."""
        if role == "mask":
            return 1
        if role not in ROLES:
            role = "other"
        b = getattr(self, role)
        if b >= KEEP or self.pipeline_stages == 1:
            return b
        want = b * self.stage_factor(stage)
        fits = [a for a in ALLOWED_BITS if a <= want]
        chosen = fits[-1] if fits else ALLOWED_BITS[0]
        return max(self.min_bits, min(8, chosen))

    def average_bits(self, numel_by_role: dict[str, int], stage: int = 0) -> float:
        """Element-weighted mean bit-width (16 for kept roles) over ``numel_by_role``."""
        tot = sum(numel_by_role.values())
        if not tot:
            return 0.0
        return sum(min(self.bits_for(r, stage), 16) * n for r, n in numel_by_role.items()) / tot

    def replace(self, **kw) -> Policy:
        return dataclasses.replace(self, **kw)

    def role_bits(self) -> dict[str, int]:
        return {r: getattr(self, r) for r in ROLES}

    @classmethod
    def from_config(cls, cfg) -> Policy:
        """From a :class:`leantrain.config.AgoqConfig`: ``bits`` becomes every 4-bit role's width,
        then ``roles`` (``"attn=8,logits=4"``; 16 = keep) sets single roles."""
        b = int(round(cfg.bits))
        base = cls()
        kw = {r: b for r in ROLES if getattr(base, r) == 4}
        kw.update(parse_roles(getattr(cfg, "roles", "") or ""))
        return cls(**kw, group_size=cfg.group_size, stochastic=cfg.stochastic,
                   pipeline_stages=max(1, cfg.pipeline_stages),
                   logits_format=getattr(cfg, "logits_format", base.logits_format),
                   batch_mib=getattr(cfg, "batch_mib", base.batch_mib),
                   unpack_mib=getattr(cfg, "unpack_mib", base.unpack_mib), seed=getattr(cfg, "seed", base.seed),
                   derive=getattr(cfg, "derive", base.derive))


def parse_roles(spec: str) -> dict[str, int]:
    """``"attn=8, logits=4"`` -> ``{"attn": 8, "logits": 4}`` (unknown roles are an error)."""
    out = {}
    for item in spec.replace(";", ",").split(","):
        item = item.strip()
        if not item:
            continue
        role, sep, bits = item.partition("=")
        role = role.strip()
        if not sep or role not in ROLES:
            raise ValueError(f"agoq.roles: {item!r} is not ROLE=BITS with ROLE one of {ROLES}")
        try:
            out[role] = int(bits)
        except ValueError:
            raise ValueError(f"agoq.roles: {item!r}: bits must be an integer") from None
    return out

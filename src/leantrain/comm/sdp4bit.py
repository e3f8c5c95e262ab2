"""SDP4Bit: ~4-bit communication for sharded data parallelism (arXiv 2410.15526).

A compressor has two halves, both used by :class:`leantrain.parallel.ShardedOptimizer` once per
bucket and step (the plain, uncompressed versions are :class:`NoCompression`):

``start_reduce_scatter(flat, topo)`` -- the gradient reduce-scatter. ``flat`` holds ``n``
contiguous shards of ``S`` elements (shard ``r`` belongs to group rank ``r``); the result is
the *sum* over ranks of this rank's shard, in fp32. SDP4Bit replaces the reduce-scatter by two
``all_to_all_single`` hops (TLq-HS, "two-level quantization with Hadamard smoothing"):

1. swizzle: view ``flat`` as ``[inter, intra, S]`` and permute to ``[intra, inter, S]``, so
   that the chunk for local peer ``j`` holds the shards of ranks ``j, j+intra, j+2 intra, ..``
   (the ranks it will later talk to over the inter-node network);
2. blocked Hadamard transform (block 32, orthonormal) and 8-bit quantization (group 512,
   stochastic rounding), fused (``ops.hadamard_quantize``);
3. all-to-all inside the node (codes uint8 + fp32 scales);
4. dequantize the ``intra`` pieces, sum in fp32, requantize to 4 bits (group 128) in one
   pass (``ops.dequant_sum_requant``) -- still in the Hadamard domain, the transform is linear;
5. all-to-all across nodes (one rank per node, same local index);
6. dequantize the ``inter`` pieces, sum in fp32, inverse Hadamard: my shard.

On one node only hops 2-3 and 6 run (8-bit); with one rank per node only the 4-bit hop runs.
Shards whose size is not a multiple of ``lcm(32, 512, 128)`` are zero-padded per shard (the
optimizer pads its buckets so this costs nothing there). ``pipeline=P`` cuts each shard into
``P`` column chunks: all intra hops are launched at once and the inter hop of chunk ``c``
is in flight while chunk ``c+1`` is being requantized. Bytes per gradient element sent, per
rank: intra ``(intra-1)/intra * (1 + 4/512)``, inter ``(inter-1)/inter * (0.5 + 4/128)/intra``.

``start_weight_gather(shard_new, current, topo)`` -- the weight all-gather (qWD). Each rank
quantizes the *difference* between its new fp32 master shard and the current model weights of
that shard to 4 bits (levels -7..7, group 2048, stochastic rounding) and all-gathers codes and
scales; every rank adds the dequantized differences to its current weights, so all ranks hold
bit-identical weights, and the next difference is taken against these reconstructed weights:
the quantization error is carried into the next step (implicit error feedback), the master
stays exact. Bytes per weight element: ``(n-1)/n * (0.5 + 4/2048)`` (bf16: ``(n-1)/n * 2``).

No error-feedback buffers, so there is no compressor state to checkpoint; the stochastic-
rounding streams are derived from (seed, step, bucket, rank, hop), so a resumed run draws the
same numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from leantrain.comm._kernels import (
    QTensor,
    dequant_sum_requant,
    dequantize,
    hadamard,
    hadamard_quantize,
    mix_seed,
    quantize,
)
from leantrain.comm.topology import Topology
from leantrain.runtime import collectives as C


class Pending:
    """A communication in flight; ``wait()`` completes it (once) and returns its result."""

    def __init__(self, finish):
        self._finish = finish
        self._done = False
        self._result = None

    def wait(self):
        if not self._done:
            self._result = self._finish()
            self._finish = None
            self._done = True
        return self._result


def _wait(*works) -> None:
    for w in works:
        if w is not None:
            w.wait()


class NoCompression:
    """Plain collectives: fp32 (or the buffer's dtype) reduce-scatter, model-dtype all-gather."""

    name = "none"
    needs_current_weights = False

    def alignment(self, topo: Topology) -> int:
        return 1

    def start_reduce_scatter(self, flat: Tensor, topo: Topology, *, seed: int = 0, key: int = 0,
                             state: dict | None = None) -> Pending:
        out = torch.empty(flat.numel() // topo.world, dtype=flat.dtype, device=flat.device)
        w = C.reduce_scatter_tensor(out, flat, group=topo.group, scope="world", async_op=True)
        return Pending(lambda: (_wait(w), out)[1])

    def start_weight_gather(self, shard: Tensor, topo: Topology, *, dtype: torch.dtype,
                            current: Tensor | None = None, seed: int = 0, key: int = 0) -> Pending:
        src = shard.to(dtype)
        out = torch.empty(topo.world * src.numel(), dtype=dtype, device=src.device)
        w = C.all_gather_into_tensor(out, src, group=topo.group, scope="world", async_op=True)
        return Pending(lambda: (_wait(w), out)[1])

    def reduce_scatter(self, inp: Tensor, topo: Topology, *, seed: int = 0) -> Tensor:
        return self.start_reduce_scatter(inp, topo, seed=seed).wait()

    # Per-bucket hooks of ShardedOptimizer (``key``: the bucket's index; ``state``: its optimizer
    # state on this rank). No-ops here; a sparse compressor (SCAPE) uses them.
    def init_state(self, padded: int, shard: int, rule, device) -> dict:
        """Extra per-bucket optimizer state the compressor keeps (checkpointed with the shard)."""
        return {}

    def bind_bucket(self, key: int, offsets: list[int], sizes: list[int], start: int, shard: int) -> None:
        """The bucket's layout: each parameter's offset and size in the flat bucket, and this
        rank's shard ``[start, start + shard)``."""

    def update_index(self, key: int, topo: Topology, state: dict) -> tuple[Tensor | None, Tensor | None]:
        """The shard-local coordinates this step updates (None: all), and the number of steps each
        update stands for (None: one each)."""
        return None, None

    def catch_up_moves(self, span: Tensor, g_mean: Tensor, state: dict[str, Tensor]) -> Tensor:
        """How many one-step moves each update of ``update_index``'s coordinates makes, given the
        steps it stands for (``span``), its mean gradient and its rule state before the update."""
        return span

    def update_hyper(self, hyper: dict) -> dict:
        """The rule's hyperparameters for the update of ``update_index``'s coordinates, given the group's."""
        return hyper

    def after_update(self, key: int, state: dict, topo: Topology) -> None:
        """Called once a bucket's shard has been stepped, before its weight gather."""

    def resume(self, states: dict[int, dict], topo: Topology) -> None:
        """Called after the optimizer loaded a checkpoint (on every rank)."""


@dataclass
class SDP4Bit(NoCompression):
    """The SDP4Bit compressor (see the module docstring). Defaults are the paper's.

    Args:
        weight_bits: bits of the weight-difference all-gather (4: levels -7..7).
        weight_group: group size of the weight-difference quantizer.
        grad_bits: (intra-node, inter-node) bits of the gradient all-to-alls.
        grad_groups: (intra-node, inter-node) quantization group sizes.
        hadamard_block: block of the Walsh-Hadamard transform (power of two, 16..256).
        hadamard: smooth gradients with the transform before quantizing.
        stochastic: stochastic rounding (unbiased) everywhere; else round to nearest.
        pipeline: chunks per shard in the gradient path (comm/compute overlap).
        quantize_weights / quantize_grads: turn either half off (ablations).
        seed: base seed of the stochastic-rounding streams.
    """

    weight_bits: int = 4
    weight_group: int = 2048
    grad_bits: tuple[int, int] = (8, 4)
    grad_groups: tuple[int, int] = (512, 128)
    hadamard_block: int = 32
    hadamard: bool = True
    stochastic: bool = True
    pipeline: int = 1
    quantize_weights: bool = True
    quantize_grads: bool = True
    seed: int = 0

    name = "sdp4bit"

    def __post_init__(self):
        self.grad_bits = tuple(self.grad_bits)
        self.grad_groups = tuple(self.grad_groups)
        for b in (self.weight_bits, *self.grad_bits):
            if b not in (4, 8):
                raise ValueError(f"SDP4Bit: bits must be 4 or 8, got {b}")
        if len(self.grad_bits) != 2 or len(self.grad_groups) != 2:
            raise ValueError("SDP4Bit: grad_bits and grad_groups are (intra-node, inter-node) pairs")
        for g in (self.weight_group, *self.grad_groups):
            if g < 2 or g > 4096 or g & (g - 1):
                raise ValueError(f"SDP4Bit: group sizes must be powers of two in [2, 4096], got {g}")
        hb = self.hadamard_block
        if hb < 16 or hb > 256 or hb & (hb - 1):
            raise ValueError(f"SDP4Bit: hadamard_block must be a power of two in [16, 256], got {hb}")
        if self.pipeline < 1:
            raise ValueError(f"SDP4Bit: pipeline must be >= 1, got {self.pipeline}")

    @property
    def needs_current_weights(self) -> bool:  # type: ignore[override]
        return self.quantize_weights

    # ------------------------------------------------------------------ sizes

    def alignment(self, topo: Topology) -> int:
        """Shard sizes that are multiples of this need no padding inside the compressor."""
        if not self.quantize_grads:
            return 1
        a = math.lcm(*self.grad_groups, self.hadamard_block if self.hadamard else 1)
        return a * self.pipeline

    # ------------------------------------------------------------------ gradients

    def _encode(self, x: Tensor, bits: int, group: int, seed: int) -> QTensor:
        if self.hadamard:
            return hadamard_quantize(x, block=self.hadamard_block, normalized=True, bits=bits,
                                     group_size=group, stochastic=self.stochastic, seed=seed)
        return quantize(x, bits=bits, group_size=group, stochastic=self.stochastic, seed=seed)

    def _decode_sum(self, data: Tensor, scale: Tensor, n: int, bits: int, group: int) -> Tensor:
        q = QTensor.from_buffers(data, scale, shape=(n,), bits=bits, group_size=group)
        s = dequantize(q, dtype=torch.float32).sum(0)
        if self.hadamard:
            s = hadamard(s, block=self.hadamard_block, normalized=True, inverse=True)
        return s

    def start_reduce_scatter(self, flat: Tensor, topo: Topology, *, seed: int = 0, key: int = 0,
                             state: dict | None = None) -> Pending:
        if not self.quantize_grads or topo.world == 1:
            return NoCompression.start_reduce_scatter(self, flat.float(), topo, seed=seed)
        n, intra, inter = topo.world, topo.intra, topo.inter
        S = flat.numel() // n
        if S * n != flat.numel():
            raise ValueError(f"reduce-scatter input of {flat.numel()} elements is not {n} equal shards")
        A = self.alignment(topo)
        Sp = -(-S // A) * A
        x = flat.view(n, S)
        if Sp != S:
            x = F.pad(x.float(), (0, Sp - S))
        P = self.pipeline
        Cn = Sp // P
        (b1, b2), (g1, g2) = self.grad_bits, self.grad_groups
        base = mix_seed(self.seed, seed, topo.rank)
        if intra == 1:  # one rank per node: the 4-bit inter-node hop only
            first = ("inter", topo.inter_group, b2, g2)
        else:
            first = ("intra", topo.intra_group, b1, g1)
        scope1, group1, bits1, gs1 = first
        stage1 = []
        for c in range(P):
            xc = x[:, c * Cn:(c + 1) * Cn]
            # swizzle [inter, intra, C] -> [intra, inter, C]: peer j's chunk = shards j, j+intra, ...
            xs = xc.reshape(inter, intra, Cn).transpose(0, 1).to(torch.float32).contiguous().view(-1)
            q = self._encode(xs, bits1, gs1, mix_seed(base, c, 1))
            rd, rs = torch.empty_like(q.data), torch.empty_like(q.scale)
            w1 = C.all_to_all_single(rd, q.data, group=group1, scope=scope1, async_op=True)
            w2 = C.all_to_all_single(rs, q.scale, group=group1, scope=scope1, async_op=True)
            stage1.append((rd, rs, w1, w2))

        def finish() -> Tensor:
            outs: list = [None] * P
            stage2 = []
            for c, (rd, rs, w1, w2) in enumerate(stage1):
                _wait(w1, w2)
                if intra == 1 or inter == 1:  # one hop: decode, sum, inverse transform
                    outs[c] = self._decode_sum(rd, rs, Cn, bits1, gs1)
                    continue
                q = QTensor.from_buffers(rd, rs, shape=(inter * Cn,), bits=b1, group_size=g1)
                q2 = dequant_sum_requant(q, bits_out=b2, group_size_out=g2, stochastic=self.stochastic,
                                         seed=mix_seed(base, c, 2))
                rd2, rs2 = torch.empty_like(q2.data), torch.empty_like(q2.scale)
                v1 = C.all_to_all_single(rd2, q2.data, group=topo.inter_group, scope="inter", async_op=True)
                v2 = C.all_to_all_single(rs2, q2.scale, group=topo.inter_group, scope="inter", async_op=True)
                stage2.append((c, rd2, rs2, v1, v2))
            for c, rd2, rs2, v1, v2 in stage2:
                _wait(v1, v2)
                outs[c] = self._decode_sum(rd2, rs2, Cn, b2, g2)
            out = outs[0] if P == 1 else torch.cat(outs)
            return out[:S] if Sp != S else out

        return Pending(finish)

    # ------------------------------------------------------------------ weights

    def start_weight_gather(self, shard: Tensor, topo: Topology, *, dtype: torch.dtype,
                            current: Tensor | None = None, seed: int = 0, key: int = 0) -> Pending:
        if not self.quantize_weights or topo.world == 1:
            return NoCompression.start_weight_gather(self, shard, topo, dtype=dtype, seed=seed)
        if current is None:
            raise ValueError("SDP4Bit weight gather needs the current flat model weights (current=...)")
        n, S = topo.world, shard.numel()
        cur = current.view(n, S)
        diff = shard.to(torch.float32) - cur[topo.rank].to(torch.float32)
        q = quantize(diff, bits=self.weight_bits, group_size=self.weight_group, stochastic=self.stochastic,
                     seed=mix_seed(self.seed, seed, topo.rank, 3))
        data = torch.empty(n * q.data.numel(), dtype=torch.uint8, device=shard.device)
        scale = torch.empty(n * q.scale.numel(), dtype=torch.float32, device=shard.device)
        w1 = C.all_gather_into_tensor(data, q.data, group=topo.group, scope="world", async_op=True)
        w2 = C.all_gather_into_tensor(scale, q.scale, group=topo.group, scope="world", async_op=True)

        def finish() -> Tensor:
            _wait(w1, w2)
            qs = QTensor.from_buffers(data, scale, shape=(S,), bits=self.weight_bits, group_size=self.weight_group)
            d = dequantize(qs, dtype=torch.float32)  # (n, S)
            return (cur.to(torch.float32) + d).view(-1)

        return Pending(finish)


# ---------------------------------------------------------------------- bytes model


def bytes_per_element(scheme: str, *, world: int, intra: int, compressor: SDP4Bit | None = None) -> dict:
    """Analytic bytes sent per rank per model element and step, by scope.

    ``scheme``: ``"bf16"`` (bf16 reduce-scatter + all-gather), ``"fp32"`` (fp32 reduce-scatter,
    bf16 all-gather -- ``ShardedOptimizer`` without compression on a bf16 model), or
    ``"sdp4bit"``. Flat collectives over the whole group are filed under ``world``.
    """
    n, inter = world, world // intra
    f = (n - 1) / n
    if scheme == "bf16":
        return {"world": 2 * f + 2 * f}
    if scheme == "fp32":
        return {"world": 4 * f + 2 * f}
    if scheme != "sdp4bit":
        raise ValueError(f"unknown scheme {scheme!r}; one of bf16, fp32, sdp4bit")
    c = compressor or SDP4Bit()
    (b1, b2), (g1, g2) = c.grad_bits, c.grad_groups
    w = f * (c.weight_bits / 8 + 4 / c.weight_group)
    out = {"world": w, "intra": 0.0, "inter": 0.0}
    if intra > 1:
        out["intra"] = (intra - 1) / intra * (b1 / 8 + 4 / g1)
        if inter > 1:
            out["inter"] = (inter - 1) / inter * (b2 / 8 + 4 / g2) / intra
    elif inter > 1:
        out["inter"] = f * (b2 / 8 + 4 / g2)
    return out


__all__ = ["SDP4Bit", "NoCompression", "Pending", "bytes_per_element"]

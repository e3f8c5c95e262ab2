"""SCAPE: sparse gradient communication with masks from the first moment (arXiv 2607.01678).

A compressor of :class:`leantrain.parallel.ShardedOptimizer` (``compression=lt.comm.SCAPE(0.1)``)
for rules with a first moment (``exp_avg``: AdamS, which it was designed for; AdamW, Lion,
SGD with momentum work too). Per bucket and step, with ``S`` elements a shard, ``world`` ranks
and ``k = round(density * S)`` (over the first ``warmup`` steps a larger share, falling
geometrically from all of ``S``):

1. **The mask.** After the owner of a shard has stepped it, it picks ``k`` coordinates of its
   shard: the largest scores (``|m|`` of the first moment ``exp_avg``, with ``per_tensor`` over
   the mean ``|m|`` of its parameter tensor on the shard, by default times the steps since the
   coordinate was last updated; ``score="residual"``: the owner's residual instead), plus a
   rotating window of ``explore * k`` coordinates (so every coordinate is visited every
   ``S / (explore * k)`` steps whatever its score). The pieces are all-gathered asynchronously
   (as a bitmap, or as int32 indices when that is smaller) and used at the next step: the all-gather overlaps that step's forward and
   backward, and every rank holds the same global mask. The first step, before any mask, is
   dense.
2. **Gradients.** Each rank adds its error-feedback residual to its flat gradient, takes the
   ``k`` masked coordinates of every shard (``[world, k]``: no indices on the wire, the mask
   is global) and reduce-scatters that compact buffer in ``value_dtype``; the owner gets the
   sum over ranks of its shard's ``k`` coordinates. Whatever was not sent stays in the
   residual (and the rounding of the sent values to ``value_dtype``) and is sent, accumulated,
   when its coordinate is next on the mask (``error_feedback=False``: dropped). The sum over
   ranks itself runs in ``value_dtype``: its rounding is not fed back.
3. **The update** runs on the masked coordinates only: their weights and rule state change,
   the others' weights, ``m`` (and AdamW's ``v``) stay as they were, weight decay included (no
   dense step: with a zero gradient AdamS would still move every weight by about
   ``lr * b1 / sqrt(b2) * sign(m)``). AdamS's second moment ``b2 m² + (1 - b2) g²`` is
   rebuilt from ``m`` and the one reduced buffer, as the paper does. A coordinate that waited
   ``τ`` steps gets the rule on its mean gradient and ``min(τ, catch_up)`` times the move (an
   Adam-type step is normalized: one step for ``τ`` steps' gradient would lose the rest). With
   ``catch_up_mode="sign"`` (the default) a coordinate whose mean gradient disagrees in sign with
   ``m`` moves ``sqrt(min(τ, catch_up))`` times instead: its gradient is mostly noise, over which
   dense Adam-type steps random-walk about ``sqrt(τ)`` steps' distance in ``τ`` steps, not ``τ``.
   The masked updates use their own first-moment decay ``beta1`` (0.8): a coordinate's ``m`` changes
   once a selection, not once a step.
4. **Weights.** Only masked coordinates changed, so each rank all-gathers the new values of
   its shard's ``k`` coordinates (model dtype) and every rank writes them into its weights.

Bytes per element a rank sends, per step (``f = (world-1)/world``): gradients
``f * density * size(value_dtype)``, weights ``f * density * size(model dtype)``, the mask
``f * min(1/8, 4 * density)``; dense fp32 reduce-scatter + bf16 all-gather: ``f * (4 + 2)``.

State: the residual (one fp32 buffer the size of the bucket on every rank: as large as the
model's fp32 gradient) and each shard coordinate's last updated step (int32, ``scape_last``)
live in the optimizer's bucket state, so per-rank checkpoints hold them; the masks are
rebuilt from the loaded state (a collective inside ``load_state_dict``), so a resumed run is
bit-identical. The consolidated (any world size) form leaves the residual out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from leantrain.comm.sdp4bit import NoCompression, Pending, _wait
from leantrain.comm.topology import Topology
from leantrain.runtime import collectives as C

_TABLES: dict = {}  # device -> _tables(device)


def _tables(dev) -> tuple[Tensor, Tensor, Tensor]:
    """On ``dev``: the bit values (uint8 ``[1, 2, ..., 128]``), each byte value's popcount (int32 ``[256]``)
    and the position (0..7) of its ``j+1``-th set bit (int64 ``[256, 8]``, 0 where there is none). Made
    once a device: a host-to-device copy a call would wait for the device."""
    if dev not in _TABLES:
        bits = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)
        pop = torch.tensor([bin(v).count("1") for v in range(256)], dtype=torch.int32)
        nth = torch.tensor([([i for i in range(8) if v >> i & 1] + [0] * 8)[:8] for v in range(256)])
        _TABLES[dev] = (bits.to(dev), pop.to(dev), nth.to(dev))
    return _TABLES[dev]


def pack_bits(mask: Tensor) -> Tensor:
    """Bool ``[n]`` (n a multiple of 8) -> uint8 ``[n / 8]``, bit ``i`` of byte ``j`` = element ``8j + i``."""
    return (mask.view(-1, 8).to(torch.uint8) * _tables(mask.device)[0]).sum(1, dtype=torch.uint8)


def unpack_bits(packed: Tensor) -> Tensor:
    """The inverse of :func:`pack_bits`."""
    return (packed.unsqueeze(-1) & _tables(packed.device)[0]).ne(0).reshape(*packed.shape[:-1], -1)


def bitmap_indices(packed: Tensor, k: int) -> Tensor:
    """The positions of the set bits of each row of ``packed`` (uint8 ``[rows, n / 8]``, :func:`pack_bits`'s
    layout), ascending, as int64 ``[rows, k]``; every row must hold exactly ``k`` set bits. Unlike
    ``nonzero`` it never waits for the device. Over the rows laid end to end, the ``i``-th set bit lies
    in the first byte where the running count of set bits reaches ``i + 1`` (a scan of the bytes'
    popcounts, then a binary search a bit), at that byte's ``(i + 1 - count before it)``-th set bit;
    row ``r`` starts at count ``r * k``."""
    dev = packed.device
    rows, nb = packed.shape
    _, popcount, nth_bit = _tables(dev)
    byte = packed.reshape(-1).long()
    pop = popcount[byte]
    count = pop.cumsum(0, dtype=torch.int32)
    want = torch.arange(1, rows * k + 1, dtype=torch.int32, device=dev)
    at = torch.searchsorted(count, want)
    nth = want - (count[at] - pop[at]) - 1
    pos = at * 8 + nth_bit[byte[at], nth]
    return pos.view(rows, k).sub_(torch.arange(rows, device=dev).mul_(nb * 8).unsqueeze(1))


def catch_up_steps(density: float) -> int:
    """SCAPE's default catch-up cap: 10 steps for each tenfold fall of the density from 1 (10 at ``density``
    0.1, 20 at 0.01, 0 (off) near 1, where a coordinate seldom waits)."""
    return round(10 * math.log10(1 / density))


def warmup_steps(density: float) -> int:
    """SCAPE's default density warm-up: 100 steps for each tenfold fall of the density from 1 (100 at
    ``density`` 0.1, 200 at 0.01, 0 at 1)."""
    return round(100 * math.log10(1 / density))


@dataclass
class SCAPE(NoCompression):
    """``SCAPE(density=0.1, *, explore=0.1, value_dtype=torch.bfloat16, error_feedback=True,
    catch_up=None, score="m_age", dense_steps=1, per_tensor=False, catch_up_mode="sign", beta1=0.8,
    warmup=None)``.

    ``density``: fraction of each shard's coordinates sent a step (0.1: 90 % sparsity).
    ``explore``: fraction of those ``k`` taken from a rotating window instead of the top scores.
    ``value_dtype``: dtype of the reduced gradient values (bf16 halves the bytes of fp32; the sum
    over ranks then runs in bf16 too).
    ``score``: ``"m"`` ranks coordinates by ``|m|``; ``"m_age"`` by ``|m|`` times the steps since
    the coordinate's last update (an estimate of the gradient waiting in the ranks' residuals);
    ``"residual"`` by the owner's own residual on its shard, that gradient itself as far as one rank
    holds it (Deep Gradient Compression's top-k of the accumulated gradient; the sum over ranks is
    unknown to the owner).
    ``catch_up``: an update ``τ`` steps after the previous one applies the rule to the mean
    gradient ``Σg / τ`` and moves ``τ`` times as far, ``τ`` capped at ``catch_up`` (0: off, each
    update one step's move, however long the coordinate waited). None (the default): 10 steps for each
    tenfold fall of the density, ``10 * log10(1 / density)`` (10 at 90 %, 20 at 99 %): a coordinate
    waits about ``1 / density`` steps, and at 99 % a cap of 20 ended closer to dense AdamS than 10 in
    six of six paired comparisons on the tiny and small presets, and than 30 after 1000 steps
    (``docs/scape.md``).
    ``catch_up_mode``: ``"steps"`` moves ``min(τ, catch_up)`` times; ``"sign"`` (default) does so
    where the mean gradient agrees in sign with the first moment and moves ``sqrt(min(τ, catch_up))``
    times where it does not (noise; the move of a random walk over ``τ`` steps).
    ``dense_steps``: the first steps are dense (the first always is: it has no mask).
    ``warmup``: the density falls geometrically from 1 to ``density`` over the first ``warmup`` steps
    (step ``n`` sends ``density ** (n / warmup)`` of each shard), the sparsity warm-up of Deep Gradient
    Compression: early steps, whose gradients change fastest, are sent (almost) whole (0: off). None
    (the default): tenfold fewer coordinates every 100 steps, ``100 * log10(1 / density)`` steps (100 at
    90 %, 200 at 99 %), the best of those measured at each. On the tiny preset at 90 %, 100 steps took the
    mean gap to dense AdamS from +3.2 % (6 seeds) to -2.4 % (9 seeds, one host), at 0.16x of dense's bytes
    over its 300 steps instead of 0.094x; at 99 %, 200 steps took it from +28 % to +2.3 %, where 100 left
    +8.5 % (``docs/scape.md``).
    ``beta1``: the first moment's decay on the masked updates of AdamS or AdamW (None: the rule's). A
    coordinate is updated about once in ``1 / density`` steps, so the rule's ``β1`` (0.9: ten updates)
    averages its gradient over ten times as many steps as dense AdamS's does; 0.8 (five updates) took the
    tiny preset's gap at 90 % from +7.5 % to +0.3 % (``docs/scape.md``).
    ``per_tensor``: a score is divided by the mean ``|m|`` of its parameter tensor on the shard, so
    every tensor gets about its share of the mask (an Adam-type step is about as large in every
    tensor, whatever its gradients' scale; raw ``|m|`` favours the tensors of large gradients).
    Off by default: on the tiny preset it did not close the gap at 90 % (``docs/scape.md``).
    Defaults from the sweeps in ``docs/scape.md``."""

    density: float = 0.1
    explore: float = 0.1
    value_dtype: torch.dtype = torch.bfloat16
    error_feedback: bool = True
    catch_up: int | None = None
    score: str = "m_age"
    dense_steps: int = 1
    per_tensor: bool = False
    catch_up_mode: str = "sign"
    beta1: float | None = 0.8
    warmup: int | None = None

    name = "scape"

    def __post_init__(self):
        if not 0.0 < self.density <= 1.0:
            raise ValueError(f"SCAPE: density must be in (0, 1], got {self.density}")
        if not 0.0 <= self.explore < 1.0:
            raise ValueError(f"SCAPE: explore must be in [0, 1), got {self.explore}")
        if self.score not in ("m", "m_age", "residual"):
            raise ValueError(f"SCAPE: score must be 'm', 'm_age' or 'residual', got {self.score!r}")
        if self.score == "residual" and not self.error_feedback:
            raise ValueError("SCAPE: score='residual' ranks the error-feedback residual; it needs error_feedback=True")
        if self.dense_steps < 1:
            raise ValueError(f"SCAPE: dense_steps must be >= 1 (the first step has no mask), got {self.dense_steps}")
        if self.catch_up is None:
            self.catch_up = catch_up_steps(self.density)
        if self.warmup is None:
            self.warmup = warmup_steps(self.density)
        if self.warmup < 0:
            raise ValueError(f"SCAPE: warmup must be >= 0, got {self.warmup}")
        if self.catch_up < 0:
            raise ValueError(f"SCAPE: catch_up must be >= 0, got {self.catch_up}")
        if self.catch_up_mode not in ("steps", "sign"):
            raise ValueError(f"SCAPE: catch_up_mode must be 'steps' or 'sign', got {self.catch_up_mode!r}")
        if self.beta1 is not None and not 0.0 <= self.beta1 < 1.0:
            raise ValueError(f"SCAPE: beta1 must be in [0, 1) or None (the rule's), got {self.beta1}")
        if self.value_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"SCAPE: value_dtype must be float32, bfloat16 or float16, got {self.value_dtype}")
        self._mask: dict[int, Tensor] = {}  # bucket -> [world, k] int64 shard-local indices in force (sorted)
        self._next: dict[int, Pending] = {}  # bucket -> the next step's mask, in flight
        self._sent: dict[int, Tensor] = {}  # bucket -> the residual after this step's send, not yet committed
        self._moment = "exp_avg"  # the rule's first-moment state (set by init_state)
        self._rule = ""  # the rule's name (set by init_state)
        # bucket -> the parameter of each shard coordinate (int64) and each parameter's count on the shard
        self._tensor_of: dict[int, tuple[Tensor, Tensor]] = {}

    @property
    def needs_current_weights(self) -> bool:  # type: ignore[override]
        return True

    def alignment(self, topo: Topology) -> int:
        return 8  # (shards pack into whole bytes of bitmap)

    def bind_bucket(self, key: int, offsets: list[int], sizes: list[int], start: int, shard: int) -> None:
        ids = torch.full((shard,), len(sizes), dtype=torch.int64)  # (padding: a tensor of its own)
        for i, (off, n) in enumerate(zip(offsets, sizes, strict=True)):
            lo, hi = max(off, start), min(off + n, start + shard)
            if lo < hi:
                ids[lo - start:hi - start] = i
        self._tensor_of[key] = (ids, torch.bincount(ids, minlength=len(sizes) + 1).clamp_(min=1))

    def _tensor_mean(self, key: int, abs_m: Tensor) -> Tensor:
        """Each shard coordinate's tensor's mean ``|m|`` on the shard."""
        ids, count = self._tensor_of[key]
        if ids.device != abs_m.device:
            ids, count = self._tensor_of[key] = (ids.to(abs_m.device), count.to(abs_m.device))
        mean = torch.zeros(count.numel(), device=abs_m.device).index_add_(0, ids, abs_m) / count
        return mean.clamp_(min=1e-30)[ids]

    def k(self, shard: int, step: int | None = None) -> int:
        """Coordinates a shard of ``shard`` sends at step ``step`` (1-based; None: after the warm-up)."""
        d = self.density
        if step is not None and step < self.warmup:
            d = self.density ** (step / self.warmup)
        return max(1, min(shard, round(d * shard)))

    # ------------------------------------------------------------------ optimizer hooks
    def init_state(self, padded: int, shard: int, rule, device) -> dict:
        moments = [n for n in ("exp_avg", "momentum_buffer") if n in rule.state_names]
        if not moments:
            raise ValueError(f"SCAPE takes its masks from the first moment; rule {rule.name!r} has none "
                             "(use AdamS, AdamW, Lion or SGD with momentum)")
        self._moment = moments[0]
        self._rule = rule.name
        st = {"scape_residual": torch.zeros(padded, dtype=torch.float32, device=device)} if self.error_feedback \
            else {}
        if self._tracks_age:  # the step at which each coordinate of this rank's shard was last updated
            st["scape_last"] = torch.zeros(shard, dtype=torch.int32, device=device)
        return st

    def update_index(self, key: int, topo: Topology, state: dict) -> tuple[Tensor | None, Tensor | None]:
        """This step's masked coordinates of this rank's shard (sorted; None: a dense step) and,
        with ``catch_up``, the steps each covers (since its last update, at most ``catch_up``)."""
        m = self._mask_in_force(key)
        if m is None:
            return None, None
        idx = m[topo.rank]
        if not self.catch_up:
            return idx, None
        return idx, (int(state["step"]) - state["scape_last"][idx]).clamp_(1, self.catch_up).float()

    def update_hyper(self, hyper: dict) -> dict:
        if self.beta1 is None or self._rule not in ("adams", "adamw"):
            return hyper
        return {**hyper, "betas": (self.beta1, hyper["betas"][1])}

    def catch_up_moves(self, span: Tensor, g_mean: Tensor, state: dict[str, Tensor]) -> Tensor:
        if self.catch_up_mode == "steps":
            return span
        return torch.where(torch.sign(g_mean) == torch.sign(state[self._moment]), span, span.sqrt())

    def _mask_in_force(self, key: int) -> Tensor | None:
        pend = self._next.pop(key, None)
        if pend is not None:
            self._mask[key] = pend.wait()
        return self._mask.get(key)

    def after_update(self, key: int, state: dict, topo: Topology) -> None:
        """Commit the residual, record the step at which the updated coordinates were updated, and
        launch the all-gather of the next step's mask, built from the owner's first moment after
        this step."""
        if key in self._sent:
            state["scape_residual"] = self._sent.pop(key)
        if self._tracks_age:
            mask, step = self._mask.get(key), int(state["step"])
            if mask is None:  # (a dense step)
                state["scape_last"].fill_(step)
            else:
                state["scape_last"][mask[topo.rank]] = step
        if int(state["step"]) < self.dense_steps:  # the next step is dense too
            self._mask.pop(key, None)
            return
        self._next[key] = self._gather_mask(state, topo, key)

    def resume(self, states: dict[int, dict], topo: Topology) -> None:
        """After a checkpoint load: rebuild the masks the loaded state implies (collective)."""
        self._mask.clear()
        self._next.clear()
        self._sent.clear()
        for key, st in states.items():
            if int(st["step"]) >= max(1, self.dense_steps):
                self._next[key] = self._gather_mask(st, topo, key)

    @property
    def _tracks_age(self) -> bool:
        return bool(self.catch_up) or self.score == "m_age"

    def _gather_mask(self, state: dict, topo: Topology, key: int) -> Pending:
        m, step = state[self._moment], int(state["step"])
        S, world = m.numel(), topo.world
        k = self.k(S, step + 1)  # (the mask is used at the next step)
        if self.score == "residual":  # the gradient waiting in this rank's residual (its share of the sum's)
            score = state["scape_residual"].view(world, S)[topo.rank].abs()
        else:
            score = m.detach().float().abs()
        if self.per_tensor and key in self._tensor_of:  # |m| relative to its tensor's mean |m| on the shard
            score.div_(self._tensor_mean(key, score))
        if self.score == "m_age":  # |m| times the steps since the last update: the gradient mass waiting
            score.mul_((step + 1 - state["scape_last"]).float())
        n_ex = min(k, int(self.explore * k))
        if n_ex:
            window = (step * n_ex + torch.arange(n_ex, device=m.device)) % S
            score[window] = float("inf")
        idx = torch.topk(score, k, sorted=False).indices.sort().values
        if S // 8 <= 4 * k:  # a bitmap is the smaller message
            bits = torch.zeros(S, dtype=torch.bool, device=m.device)
            bits[idx] = True
            out = torch.empty(world * (S // 8), dtype=torch.uint8, device=m.device)
            w = C.all_gather_into_tensor(out, pack_bits(bits), group=topo.group, scope="world", async_op=True)

            def finish() -> Tensor:
                _wait(w)
                return bitmap_indices(out.view(world, S // 8), k)
        else:
            out = torch.empty(world * k, dtype=torch.int32, device=m.device)
            w = C.all_gather_into_tensor(out, idx.to(torch.int32), group=topo.group, scope="world", async_op=True)

            def finish() -> Tensor:
                _wait(w)
                return out.view(world, k).long()
        return Pending(finish)

    # ------------------------------------------------------------------ the collectives
    def start_reduce_scatter(self, flat: Tensor, topo: Topology, *, seed: int = 0, key: int = 0,
                             state: dict | None = None) -> Pending:
        world = topo.world
        acc = flat.float()
        if self.error_feedback and state is not None:
            acc = acc + state["scape_residual"]
        mask = self._mask_in_force(key)
        if mask is None:  # no mask (the first dense_steps steps): dense, nothing left over
            if self.error_feedback and state is not None:
                self._sent[key] = torch.zeros_like(acc)
            return NoCompression.start_reduce_scatter(self, acc, topo)
        S = acc.numel() // world
        rows = acc.view(world, S)
        picked = rows.gather(1, mask)
        send = picked.to(self.value_dtype)
        if self.error_feedback and state is not None:  # what stays behind (with value_dtype's rounding):
            self._sent[key] = rows.scatter_(1, mask, picked - send.float()).view(-1)  # acc is our own sum
        send = send.view(-1)
        got = torch.empty(mask.shape[1], dtype=self.value_dtype, device=acc.device)
        w = C.reduce_scatter_tensor(got, send, group=topo.group, scope="world", async_op=True)
        mine = mask[topo.rank]

        def finish() -> Tensor:
            _wait(w)
            return torch.zeros(S, dtype=torch.float32, device=acc.device).index_copy_(0, mine, got.float())

        return Pending(finish)

    def start_weight_gather(self, shard: Tensor, topo: Topology, *, dtype: torch.dtype,
                            current: Tensor | None = None, seed: int = 0, key: int = 0) -> Pending:
        mask = self._mask.get(key)
        if mask is None or current is None:
            return NoCompression.start_weight_gather(self, shard, topo, dtype=dtype, seed=seed)
        world, k = mask.shape
        vals = shard.index_select(0, mask[topo.rank]).to(dtype)
        out = torch.empty(world * k, dtype=dtype, device=shard.device)
        w = C.all_gather_into_tensor(out, vals, group=topo.group, scope="world", async_op=True)

        def finish() -> Tensor:
            _wait(w)
            return current.view(world, -1).scatter_(1, mask, out.view(world, k)).view(-1)

        return Pending(finish)


__all__ = ["SCAPE", "bitmap_indices", "catch_up_steps", "pack_bits", "unpack_bits", "warmup_steps"]

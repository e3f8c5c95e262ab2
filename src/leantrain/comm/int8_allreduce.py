"""Precision-preserving 8-bit all-reduce (AGoQ), as a function and as a DDP comm hook; its first
phase alone is an 8-bit reduce-scatter (:func:`int8_reduce_scatter`, FSDP2's with ``comm/fsdp.py``).

One all-reduce of a flat tensor of ``N`` elements over ``n`` ranks, with ``G = group_size``:

1. pad to ``n * C`` elements (``C`` a multiple of ``G``), cut into ``n`` chunks; quantize each
   group of ``G`` to int8 codes (symmetric absmax, one fp32 scale per group);
2. **all-to-all**: chunk ``i``'s codes and scales go to rank ``i`` (one uint8 message per
   peer: ``C`` code bytes followed by the ``C/G`` scales' bytes);
3. the owner dequantizes its ``n - 1`` peers' chunks, adds its own chunk *unquantized*, sums
   in fp32 (and divides by ``n`` when averaging): the only rounding so far is each peer's one
   quantization;
4. requantize the reduced chunk **once** (int8 + fp32 scales) and **all-gather** it; every rank
   dequantizes the same bytes, so all ranks end with bit-identical results.

Never requantized at a hop (a ring all-reduce of int8 would round ``n - 1`` times). Error per
element: ``<= sum_{j != owner} s_j / 2 + s_out / 2`` for round-to-nearest, ``s = absmax/127``
of the element's group on rank ``j`` / of the reduced group.

Bytes this rank sends (counted by :mod:`leantrain.runtime.collectives`): ``2 (n-1)/n * n C (1 + 4/G)``,
i.e. ``(1 + 4/G) / 2`` of a bf16 all-reduce of the same tensor (0.508 at G = 256,
0.504 at G = 512) plus padding; an fp32 all-reduce costs 4x more. Eight-bit codes plus any
per-group scale cannot be below one half of bf16: the scales are the price of the precision.

Both NCCL and gloo implement the two collectives used (``all_to_all_single`` with equal
splits, ``all_gather_into_tensor``).

As a DDP comm hook it rounds every step's gradients in one layout of its own, not in DDP's
buckets: which elements share a scale and which rank owns (keeps exact) which element depend on
the layout, and DDP's buckets change after a process's first iteration (DDP rebuilds them in the
order gradients became ready), so a run resumed from a checkpoint would round its first step
differently from an uninterrupted run. The hook's layout is the parameters in the order of DDP's
construction-time buckets (the layout of every process's first iteration), cut into pieces of
``piece_numel`` elements; a resumed run (its state's ``state_dict`` loaded: the seed counter)
continues bit-identically.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from leantrain.ops.qtensor import QTensor
from leantrain.ops.quant_fast import quantize_q
from leantrain.runtime import collectives as C

__all__ = ["Int8AllReduceState", "int8_allreduce_hook", "int8_all_reduce", "int8_reduce_scatter", "two_phase_all_reduce"]


@dataclass
class Int8AllReduceState:
    """State of the DDP hook: process group, group size of the scales, rounding, the hook's layout."""

    group: object = None
    group_size: int = 256
    stochastic: bool = False  # stochastic rounding of both quantizations (unbiased)
    seed: int = 0
    scope: str = "world"  # ledger scope of the bytes sent
    piece_numel: int = 1 << 22  # elements of one int8_all_reduce (bounds its fp32 temporaries)
    calls: int = 0  # pieces reduced so far (varies the rounding seed); in ``state_dict``
    order: dict = field(default_factory=dict, repr=False)  # id(parameter) -> its place in the hook's layout
    pending: list = field(default_factory=list, repr=False)  # this step's (buffer, future, parameters, gradients)

    def state_dict(self) -> dict:
        """What a checkpoint keeps for a bit-identical resume (the seed counter)."""
        return {"calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.calls = int(state.get("calls", 0))


def _payload(q: QTensor, k: int) -> Tensor:
    """``k`` peers' codes + scales as one uint8 tensor ``(k, C + 4 C/G)``."""
    data = q.data.view(k, -1)
    scale = q.scale.contiguous().view(k, -1).view(torch.uint8)
    return torch.cat([data, scale], 1)


def _unpayload(buf: Tensor, chunk: int, group_size: int) -> tuple[Tensor, Tensor]:
    """``(k, C + 4 C/G)`` uint8 -> (codes int8 ``(k, C/G, G)``, scales fp32 ``(k, C/G, 1)``)."""
    k = buf.shape[0]
    codes = buf[:, :chunk].contiguous().view(torch.int8).view(k, -1, group_size)
    scale = buf[:, chunk:].contiguous().view(torch.float32).view(k, -1, 1)
    return codes, scale


def _reduce_to_owners(x: Tensor, n: int, chunk: int, group, *, encode, decode, average: bool, scope: str) -> Tensor:
    """Phase 1 of the module doc: fp32 ``x`` of ``n`` chunks of ``chunk`` elements, chunk ``i`` sent
    encoded to rank ``i`` (one all-to-all); returns this rank's chunk summed over the ranks in fp32
    (its own copy exact, the peers' decoded), divided by ``n`` when ``average``."""
    send = encode(x, n, 0)
    recv = torch.empty_like(send)
    C.all_to_all_single(recv, send, group=group, scope=scope)
    vals = decode(recv, chunk)  # (n, C): every peer's quantized copy of my chunk
    vals[C.rank(group)] = x.view(n, chunk)[C.rank(group)]  # own chunk: exact, not its quantized copy
    red = vals.sum(0)
    if average:
        red /= n
    return red


def two_phase_all_reduce(tensor: Tensor, group, *, block: int, encode, decode, average: bool = False,
                         scope: str = "world") -> Tensor:
    """The module doc's two phases with any codec, in place on ``tensor``; returns it. The padded tensor's
    ``n`` chunks are multiples of ``block`` elements. ``encode(x, k, phase)``: fp32 ``[k * C]`` -> uint8
    ``(k, bytes)``, one message a chunk (phase 0: the copies sent to the owners, 1: the reduced chunk);
    ``decode(buf, C)``: uint8 ``(k, bytes)`` -> fp32 ``(k, C)``. GIFT's FP8 all-reduce runs it too."""
    n = C.world_size(group)
    if n == 1:
        return tensor
    flat = tensor.detach().reshape(-1).float()
    numel = flat.numel()
    chunk = -(-numel // (n * block)) * block
    x = torch.zeros(n * chunk, dtype=torch.float32, device=tensor.device)
    x[:numel] = flat
    red = _reduce_to_owners(x, n, chunk, group, encode=encode, decode=decode, average=average, scope=scope)
    mine = encode(red, 1, 1).reshape(-1)
    out = torch.empty(n * mine.numel(), dtype=torch.uint8, device=tensor.device)
    C.all_gather_into_tensor(out, mine, group=group, scope=scope)
    tensor.copy_(decode(out.view(n, -1), chunk).reshape(-1)[:numel].view_as(tensor))
    return tensor


def int8_all_reduce(tensor: Tensor, group=None, *, group_size: int = 256, average: bool = False,
                    stochastic: bool = False, seed: int = 0, scope: str = "world") -> Tensor:
    """All-reduce ``tensor`` in place through int8 (see the module doc); returns it.

    ``average=True`` divides the sum by the number of ranks (DDP's convention).
    """
    if C.world_size(group) == 1:
        return tensor
    encode, decode = _int8_codec(group_size, stochastic, seed)
    return two_phase_all_reduce(tensor, group, block=group_size, encode=encode, decode=decode, average=average,
                                scope=scope)


def _int8_codec(group_size: int, stochastic: bool, seed: int):
    """(encode, decode) of :func:`two_phase_all_reduce` for int8 codes + one fp32 scale per ``group_size``."""
    if group_size % 2 or group_size < 2:
        raise ValueError(f"int8 collectives: group_size must be even and >= 2, got {group_size}")

    def encode(x, k, phase):
        return _payload(quantize_q(x, 8, group_size=group_size, stochastic=stochastic, seed=seed + phase), k)

    def decode(buf, chunk):
        codes, scale = _unpayload(buf, chunk, group_size)
        return (codes.float() * scale).view(buf.shape[0], chunk)

    return encode, decode


def int8_reduce_scatter(output: Tensor, input: Tensor, group=None, *, group_size: int = 256, average: bool = False,
                        stochastic: bool = False, seed: int = 0, scope: str = "world") -> Tensor:
    """Reduce-scatter through int8: ``input`` holds ``n`` contiguous chunks of ``output.numel()``
    elements, chunk ``i`` for rank ``i`` (``reduce_scatter_tensor``'s layout, FSDP2's); ``output``
    gets this rank's chunk summed over the ranks (``average``: divided by ``n``). Phase 1 of the
    module doc alone: each chunk, padded to a multiple of ``group_size``, is quantized once (int8 +
    one fp32 scale per group) and sent to its owner, who adds its own chunk unquantized and sums in
    fp32. Error per element ``<= sum_{j != owner} s_j / 2`` (round to nearest); bytes this rank
    sends ``(n-1)/n * n C (1 + 4/G)``: ``(1 + 4/G) / 2`` of a bf16 reduce-scatter's, plus padding.
    Returns ``output``."""
    n = C.world_size(group)
    if n == 1:
        return output.copy_(input.view_as(output))
    numel = output.numel()
    if input.numel() != n * numel:
        raise ValueError(f"int8_reduce_scatter: input has {input.numel()} elements, not {n} x {numel}")
    encode, decode = _int8_codec(group_size, stochastic, seed)
    chunk = -(-numel // group_size) * group_size
    x = torch.zeros(n, chunk, dtype=torch.float32, device=input.device)
    x[:, :numel] = input.detach().reshape(n, numel)
    red = _reduce_to_owners(x.view(-1), n, chunk, group, encode=encode, decode=decode, average=average, scope=scope)
    output.copy_(red[:numel].view_as(output))
    return output


def int8_allreduce_hook(state: Int8AllReduceState, bucket):
    """DDP comm hook: ``ddp.register_comm_hook(Int8AllReduceState(), int8_allreduce_hook)``.

    Averages the step's gradients over ranks through :func:`int8_all_reduce`, in the hook's own
    layout (the module doc): each bucket's future completes when DDP hands over its last bucket,
    which reduces them all (synchronously).
    """
    if bucket.index() == 0:  # (DDP hands buckets over in index order: a new step)
        state.pending = []
    fut = torch.futures.Future()
    state.pending.append((bucket.buffer(), fut, bucket.parameters(), bucket.gradients()))
    if bucket.is_last():
        _reduce_step(state)
    return fut


def _reduce_step(state: Int8AllReduceState) -> None:
    """Reduce every gradient of ``state.pending`` in the hook's layout; complete their futures."""
    entries, state.pending = state.pending, []
    if not state.order:  # the first iteration: DDP's construction-time buckets
        state.order = {id(p): i for i, p in enumerate(p for _, _, params, _ in entries for p in params)}
    placed = sorted(((state.order[id(p)], g) for _, _, params, grads in entries for p, g in zip(params, grads)),
                    key=lambda item: item[0])
    for piece in _pieces([g.reshape(-1) for _, g in placed], state.piece_numel):
        flat = torch.cat([part.float() for part in piece])
        state.calls += 1
        int8_all_reduce(flat, state.group, group_size=state.group_size, average=True, stochastic=state.stochastic,
                        seed=state.seed * 1_000_003 + 2 * state.calls, scope=state.scope)
        for part, reduced in zip(piece, flat.split([part.numel() for part in piece])):
            part.copy_(reduced)
    for buf, fut, _, _ in entries:
        fut.set_result(buf)


def _pieces(flats: list[Tensor], size: int):
    """The concatenation of ``flats`` cut every ``size`` elements: lists of views, each ``size`` long
    (the last may be shorter)."""
    piece, room = [], size
    for flat in flats:
        start = 0
        while start < flat.numel():
            take = min(room, flat.numel() - start)
            piece.append(flat[start:start + take])
            start, room = start + take, room - take
            if room == 0:
                yield piece
                piece, room = [], size
    if piece:
        yield piece


# DDP checks annotations by identity (strings, as ``from __future__ import annotations`` makes them,
# are rejected): state them as objects.
int8_allreduce_hook.__annotations__ = {"state": Int8AllReduceState, "bucket": dist.GradBucket,
                                       "return": torch.futures.Future[torch.Tensor]}

"""FORGE on weights sharded by rows across ranks: PyTorch FSDP2's ``DTensor`` parameters
(:class:`ShardedUpdateMixin` of ForgeOptimizer; ``--dist.mode fsdp --forge``).

FSDP2 (``torch.distributed.fsdp.fully_shard``) keeps each parameter as a ``DTensor`` placed
``Shard(0)`` on its mesh's shard dimension (and ``Replicate()`` on the replicate one, HSDP): rank
``r`` of ``S`` holds rows ``[r c, min(n, (r + 1) c))`` of an ``n``-row weight, ``c = ceil(n / S)``
(``torch.chunk``'s split; the last ranks may hold fewer rows, or none). During a block's forward
and backward FSDP all-gathers the whole weight, so FORGE's linear sees it whole and its backward
has the whole ``X`` and ``dY``. Per fused layer, in backward:

1. ``dW = dYᵀ X`` (and ``db``) into FORGE's reused workspace, padded to ``S c`` rows: the only
   whole-size gradient, one layer's at a time (the workspace is reused by the next layer);
2. reduce-scattered over the shard dimension into this rank's ``c`` rows (a second reused
   buffer), all-reduced over the replicate dimension (HSDP), divided by the number of
   data-parallel ranks (FSDP's average);
3. the layer's sum of squares: this rank's rows' sum all-reduced over the shard dimension (the
   clip and the non-finite gate then see the whole layer's, the same on every rank);
4. the rule on this rank's rows of the weight (``param.to_local()``, written in place: FSDP's next
   all-gather reads it) with this rank's rows of the state (``DTensor`` s placed as the weight, so
   ``torch.distributed.checkpoint`` saves and reshards them as it does torch's AdamW's).

No ``.grad`` is made for a fused weight, so FSDP's own reduce-scatter skips it (FSDP2 leaves out a
parameter whose gradient is None). The other parameters (norms, embeddings) get their averaged
gradient shards from FSDP and are stepped on their shards by ``step()`` (:mod:`.rest`), their sums
of squares all-reduced over the shard dimension.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from leantrain.forge.linear import ForgeLayer
from leantrain.runtime import collectives


def _dtensor_class():
    """``DTensor`` once something made one (importing ``torch.distributed.tensor`` costs most of a
    second: no DTensor exists before it is imported)."""
    import sys

    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def is_sharded(t: Tensor) -> bool:
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def local(t: Tensor) -> Tensor:
    """This rank's part of a ``DTensor`` (a view: writing it writes the shard), else ``t``."""
    return t.to_local() if is_sharded(t) else t


def local_state(state: dict) -> dict:
    """A parameter's state dict with each ``DTensor`` replaced by this rank's part (views)."""
    return {k: local(v) if isinstance(v, Tensor) else v for k, v in state.items()}


@dataclass(frozen=True)
class RowShards:
    """How a ``DTensor`` parameter is split over ranks: by rows over ``shard_group``, replicated
    over ``replicate_groups``; ``rows_per_rank`` the padded row count ``c``, ``local_rows`` this
    rank's real ones, ``dp_size`` the ranks its gradient is averaged over."""

    shard_group: object
    replicate_groups: tuple
    shard_size: int
    rows_per_rank: int
    local_rows: int
    dp_size: int

    @classmethod
    def of(cls, p: Tensor, owner: str) -> RowShards:
        from torch.distributed.tensor import Replicate, Shard

        mesh, placements = p.device_mesh, p.placements
        shard_dims = [i for i, pl in enumerate(placements) if isinstance(pl, Shard)]
        if (len(shard_dims) != 1 or placements[shard_dims[0]].dim != 0
                or not all(isinstance(pl, (Shard, Replicate)) for pl in placements)):
            raise ValueError(f"FORGE: {owner} is a DTensor placed {placements}; FORGE updates weights sharded by "
                             "rows on one mesh dimension (FSDP2's Shard(0), with Replicate() for HSDP)")
        dim = shard_dims[0]
        size = mesh.size(dim)
        rows = -(-p.shape[0] // size)
        return cls(mesh.get_group(dim), tuple(mesh.get_group(i) for i in range(mesh.ndim) if i != dim), size,
                   rows, p.to_local().shape[0], mesh.size())


def check_sharded(params: list[Tensor], names: dict, *, state_dtype: str, overlap: bool, grad_accum: int) -> bool:
    """Whether FORGE's parameters are ``DTensor`` shards (all or none, fp32, one mesh); raises
    ``ValueError`` for what FORGE cannot do on them."""
    sharded = [p for p in params if is_sharded(p)]
    if not sharded:
        return False
    if len(sharded) != len(params):
        plain = next(names.get(p, "?") for p in params if not is_sharded(p))
        raise ValueError(f"FORGE: some parameters are DTensor shards and {plain} is not; shard every parameter "
                         "(fully_shard the root module too) or none")
    if len({id(p.device_mesh) for p in sharded}) != 1:
        raise ValueError("FORGE: the sharded parameters live on different device meshes; use one mesh")
    wrong = [(why, flag) for bad, why, flag in (
        (any(p.dtype != torch.float32 for p in params), "bf16 weights need stochastic rounding of the shards",
         "keep fp32 weights"),
        (state_dtype != "fp32", f"{state_dtype} states are quantized in blocks that do not follow the row shards",
         "use state_dtype fp32"),
        (overlap, "the side stream's updates would race FSDP's resharding", "use overlap=False"),
        (grad_accum > 1, "an accumulated gradient would be a whole-size buffer per layer",
         "use grad_accum 1 (a larger micro-batch)")) if bad]
    if wrong:
        why, flag = wrong[0]
        raise ValueError(f"FORGE on DTensor shards (FSDP2): {why}; {flag}")
    return True


class ShardedUpdateMixin:
    """The per-layer update of a fused layer whose weight is a row-sharded ``DTensor`` (module docstring)."""

    def _shards_of(self, layer: ForgeLayer) -> RowShards:
        info = self._row_shards.get(layer.slot)
        if info is None:
            info = self._row_shards[layer.slot] = RowShards.of(layer.weight, layer.name)
        return info

    def _reduce_rows(self, full: Tensor, out: Tensor, info: RowShards) -> Tensor:
        """This rank's rows of ``full`` (``[S c, ...]``) averaged over the data-parallel ranks, in ``out``."""
        collectives.reduce_scatter_tensor(out, full, group=info.shard_group)
        for group in info.replicate_groups:
            collectives.all_reduce(out, group=group)
        return out.div_(info.dp_size)[: info.local_rows]

    def _update_sharded(self, layer: ForgeLayer, x2, dy2, fill, sw: dict, sb: dict | None, step: int) -> None:
        """dW whole (padded), reduce-scattered to this rank's rows, its global sum of squares, the
        clip scale and non-finite gate, the rule on this rank's rows (torch ops or the update kernel)."""
        info = self._shards_of(layer)
        w, b = layer.weight, layer.bias
        n, k = w.shape
        padded = info.shard_size * info.rows_per_rank
        buf, g, gb = self._materialize(layer, x2, dy2, "torch", fill, reduce=False, pad_rows=padded)
        full_w = buf[: padded * k].view(padded, k)
        if padded > n:  # the padding rows: zeros (they come back to no rank as real rows)
            full_w[n:].zero_()
        rows = info.rows_per_rank
        out = self._shard_workspace.get(rows * k + (rows if b is not None else 0), g.device)
        g_local = self._reduce_rows(full_w, out[: rows * k].view(rows, k), info)
        gb_local = None
        if b is not None:
            full_b = buf[padded * k: padded * (k + 1)]
            full_b[n:].zero_()
            gb_local = self._reduce_rows(full_b, out[rows * k:], info)
        del buf, g, gb, full_w
        sq = self._grad_sums(w.device).sq_views[layer.slot]
        local_sq = g_local.square().sum() + (gb_local.square().sum() if gb_local is not None else 0.0)
        sq.copy_(local_sq)
        collectives.all_reduce(sq, group=info.shard_group)
        self._ran.append(layer.slot)
        bad = ~torch.isfinite(sq)
        scale = self._scale_torch(layer.slot)
        if scale is not None:
            g_local = g_local * scale
            gb_local = None if gb_local is None else gb_local * scale
        if info.local_rows:
            self._apply_rule(local(w), g_local, local_state(sw), self._hp(w), step, layer.index, bad)
            if b is not None:
                self._apply_rule(local(b), gb_local, local_state(sb), self._hp(w), step, layer.index, bad,
                                 sr_offset=w.numel())

    def _init_sharded_state(self, p: Tensor, fp32: bool) -> dict:
        """Fresh state of a ``DTensor`` parameter: this rank's rows, as ``DTensor`` s placed as ``p``."""
        from torch.distributed.tensor import DTensor

        part = self.storage.init(self.rule, p.to_local(), force_fp32=fp32)
        return {k: DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                      run_check=False) for k, v in part.items()}


__all__ = ["RowShards", "ShardedUpdateMixin", "check_sharded", "is_sharded", "local", "local_state"]

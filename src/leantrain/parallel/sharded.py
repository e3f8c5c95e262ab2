"""``ShardedOptimizer``: a Megatron-style distributed optimizer on plain ``torch.distributed``.

Every rank keeps the full model weights (fp32 or bf16). The trainable parameters are laid
out, in reverse registration order (about the order backward produces their gradients), in
flat *buckets* of about ``bucket_mb`` MiB, each padded so it splits into ``world`` equal
shards (times the compressor's alignment). Rank ``r`` owns shard ``r`` of every bucket: the
fp32 master weights and the optimizer state of those elements, nothing else. One step:

1. backward fills ``.grad`` as usual; a post-accumulate-grad hook on every parameter notices
   when a bucket's gradients are all there and launches its reduce-scatter at once
   (asynchronous, in bucket order on every rank), so communication overlaps the rest of
   backward. Gradient accumulation: a second backward before ``step()`` marks the buckets it
   touches stale and ``step()`` reduces them again from the accumulated ``.grad``; use
   ``with opt.no_sync():`` around all but the last micro-batch to skip the wasted launches.
2. ``step()``: wait for each bucket's reduced shard, divide by ``world`` (gradients are
   averaged), optionally clip by the global norm, apply the rule to the fp32 master shard,
   and launch the weight all-gather of that bucket before moving to the next one.
3. wait for the all-gathers and write every parameter: all ranks end with identical weights.

With ``compression=lt.comm.SDP4Bit()`` the reduce-scatter is the two-level quantized all-to-all
and the all-gather carries 4-bit weight differences (see :mod:`leantrain.comm.sdp4bit`); with
``compression=lt.comm.SCAPE(density)`` both carry only the coordinates of a global mask taken
from the first moment, and only those coordinates are stepped (see :mod:`leantrain.comm.scape`).
Only ``reduce_scatter_tensor``, ``all_gather_into_tensor``, ``all_to_all_single``,
``all_reduce`` and ``broadcast`` are used, so gloo (CPU) and NCCL (CUDA) both work.

Parameters that get no gradient in a step are treated as having a zero gradient (the rule
still applies weight decay and momentum to them), as in Megatron-LM; parameters with
``requires_grad=False`` are left out. ``.grad`` must not be modified between the backward
and ``step()`` (the hooks may already have sent it): clip with ``max_grad_norm=`` instead, or
pass ``overlap=False`` to read ``.grad`` only in ``step()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from leantrain.comm._kernels import mix_seed
from leantrain.comm.sdp4bit import NoCompression
from leantrain.comm.topology import get_topology
from leantrain.optim.rules import Rule
from leantrain.parallel.buckets import Bucket, build_buckets
from leantrain.parallel.checkpoint import CheckpointMixin
from leantrain.runtime import collectives as C


class ShardedOptimizer(CheckpointMixin, torch.optim.Optimizer):
    """``ShardedOptimizer(model_or_params, rule, *, group=None, intra_node_size=None, compression=None)``.

    Args:
        model_or_params: an ``nn.Module`` (its trainable parameters, with names for
            checkpoints), an iterable of parameters, or a list of param-group dicts.
        rule: the element-wise rule (``lt.optim.AdamW(...)`` etc.); its fields are the
            defaults of every param group (``lr`` etc. live in ``param_groups``, so
            ``torch.optim.lr_scheduler`` works).
        group: the data-parallel process group (default: world).
        intra_node_size: ranks per node (default ``LOCAL_WORLD_SIZE``, else one node); only
            the compressor's two-level path uses it.
        compression: ``None`` (plain fp32 reduce-scatter, model-dtype all-gather) or a
            compressor such as ``lt.comm.SDP4Bit()``.
        bucket_mb: bucket size in MiB of fp32 gradient.
        master_dtype: dtype of the sharded master weights (fp32).
        overlap: launch reduce-scatters from backward hooks (else all in ``step()``).
        max_grad_norm: clip the averaged gradient to this global L2 norm (``grad_norm`` holds
            the norm before clipping after each step).
        broadcast_init: copy rank 0's weights to every rank at construction (as DDP does).
    """

    def __init__(
        self,
        model_or_params: nn.Module | Iterable,
        rule: Rule,
        *,
        group=None,
        intra_node_size: int | None = None,
        compression=None,
        bucket_mb: float = 25,
        master_dtype: torch.dtype = torch.float32,
        overlap: bool = True,
        max_grad_norm: float | None = None,
        broadcast_init: bool = True,
    ):
        if not isinstance(rule, Rule):
            raise TypeError(f"rule must be a leantrain.optim rule (e.g. lt.optim.AdamW(...)), got {type(rule).__name__}")
        names = None
        if isinstance(model_or_params, nn.Module):
            named = [(n, p) for n, p in model_or_params.named_parameters() if p.requires_grad]
            names = [n for n, _ in named]
            params = [p for _, p in named]
        else:
            params = list(model_or_params)
        if not params:
            raise ValueError("ShardedOptimizer got no trainable parameters")
        self.rule = rule
        self.compression = compression if compression is not None else NoCompression()
        self.master_dtype = master_dtype
        self.overlap = overlap
        self.max_grad_norm = max_grad_norm
        self.grad_norm: float | None = None
        super().__init__(params, rule.hyper())
        self._all_params = [p for g in self.param_groups for p in g["params"]]
        if names is not None and len(names) != len(self._all_params):
            names = None
        self.param_names = names
        self.topo = get_topology(group, intra_node_size)
        self.group = group
        dev = {p.device for p in self._all_params}
        if len(dev) != 1:
            raise ValueError(f"ShardedOptimizer needs all parameters on one device, got {sorted(map(str, dev))}")
        if broadcast_init and self.topo.world > 1:
            src = 0 if group in (None, dist.group.WORLD) else dist.get_global_rank(group, 0)
            with torch.no_grad():
                for p in self._all_params:
                    C.broadcast(p.data, src, group=group, scope="world")
        self.buckets: list[Bucket] = build_buckets(
            self.param_groups, world=self.topo.world, rank=self.topo.rank,
            align=self.compression.alignment(self.topo), bucket_bytes=int(bucket_mb * 2**20),
        )
        with torch.no_grad():
            for b in self.buckets:
                master = self._flat_weights(b, self.master_dtype)[b.start:b.start + b.shard].clone()
                self.state[b.index] = {"step": 0, "master": master, **rule.init_state(master),
                                       **self.compression.init_state(b.padded, b.shard, rule, master.device)}
                self.compression.bind_bucket(b.index, b.offsets, [p.numel() for p in b.params], b.start, b.shard)
        self._sync = True
        self._next = 0  # next bucket to launch from the hooks
        self._hooks = []
        if overlap:
            for b in self.buckets:
                for p in b.params:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(b)))

    # ------------------------------------------------------------------ helpers

    def add_param_group(self, param_group):  # noqa: D102
        if getattr(self, "buckets", None) is not None:
            raise RuntimeError("ShardedOptimizer: add_param_group after construction is not supported; "
                                      "pass every group to the constructor")
        super().add_param_group(param_group)

    @staticmethod
    def _flat_weights(b: Bucket, dtype) -> Tensor:
        flat = torch.zeros(b.padded, dtype=dtype, device=b.params[0].device)
        for p, off in zip(b.params, b.offsets, strict=True):
            flat[off:off + p.numel()].copy_(p.detach().reshape(-1))
        return flat

    @staticmethod
    def _flat_grads(b: Bucket) -> Tensor:
        flat = torch.zeros(b.padded, dtype=torch.float32, device=b.params[0].device)
        for p, off in zip(b.params, b.offsets, strict=True):
            if p.grad is not None:
                if p.grad.is_sparse:
                    raise RuntimeError("ShardedOptimizer does not support sparse gradients")
                flat[off:off + p.numel()].copy_(p.grad.reshape(-1))
        return flat

    def _fail(self, what: str, e: BaseException):
        raise RuntimeError(
            f"ShardedOptimizer ({what}) on rank {self.topo.rank} of {self.topo.world}: a collective failed "
            f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}). Another rank has "
            "probably exited, crashed or stalled: check the other ranks' logs; the wait is bounded by the "
            "process group's timeout."
        ) from e

    def _launch(self, b: Bucket) -> None:
        try:
            st = self.state[b.index]
            b.pending = self.compression.start_reduce_scatter(
                self._flat_grads(b), self.topo, seed=mix_seed(st["step"] + 1, b.index), key=b.index, state=st)
        except RuntimeError as e:
            self._fail(f"gradient reduce-scatter of bucket {b.index}", e)

    def _make_hook(self, b: Bucket):
        def hook(p: Tensor) -> None:
            if not self._sync:
                return
            if b.pending is not None:  # gradients changed after the bucket was sent
                b.dirty = True
                return
            b.ready.add(id(p))
            with torch.no_grad():
                while self._next < len(self.buckets):
                    nb = self.buckets[self._next]
                    if nb.pending is None and len(nb.ready) < len(nb.params):
                        break
                    if nb.pending is None:
                        self._launch(nb)
                    self._next += 1

        return hook

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside do not launch communication (non-final micro-batches)."""
        prev, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = prev

    # ------------------------------------------------------------------ step

    def _update(self, b: Bucket, g: Tensor) -> None:
        st = self.state[b.index]
        st["step"] += 1
        master = st["master"]
        names = self.rule.state_names
        # a sparse compressor's coordinates, and how many steps each update stands for (None: one)
        idx, span = self.compression.update_index(b.index, self.topo, st)
        cuts = None  # where each segment's coordinates start and end in the sorted idx (None: all of idx)
        if idx is not None and [(lo, hi) for lo, hi, _ in b.segments] != [(0, b.shard)]:
            edges = torch.tensor([e for lo, hi, _ in b.segments for e in (lo, hi)], device=idx.device)
            cuts = torch.searchsorted(idx, edges.to(idx.dtype)).tolist()  # (the bucket's one wait for the device)
        for j, (lo, hi, gi) in enumerate(b.segments):
            group = self.param_groups[gi]
            hp = {k: v for k, v in group.items() if k != "params"}
            if idx is None:
                p_new, s_new = self.rule.update(master[lo:hi], g[lo:hi], {k: st[k][lo:hi] for k in names},
                                                step=st["step"], **hp)
                master[lo:hi].copy_(p_new)
                for k, v in s_new.items():
                    st[k][lo:hi].copy_(v)
                continue
            part = slice(None) if cuts is None else slice(cuts[2 * j], cuts[2 * j + 1])
            sel = idx[part]  # only these coordinates: the others keep weight and state
            if sel.numel():
                p0, gs = master[sel], g[sel]
                old = {k: st[k][sel] for k in names}
                sp = None if span is None else span[part]
                if sp is not None:  # the rule on the mean gradient, the move times the steps it covers
                    gs = gs / sp
                    sp = self.compression.catch_up_moves(sp, gs, old)
                p_new, s_new = self.rule.update(p0, gs, old, step=st["step"], **self.compression.update_hyper(hp))
                if sp is not None:
                    p_new = p0 + sp * (p_new - p0)
                master.index_copy_(0, sel, p_new.to(master.dtype))
                for k, v in s_new.items():
                    st[k].index_copy_(0, sel, v.to(st[k].dtype))
        self.compression.after_update(b.index, st, self.topo)

    def _gather(self, b: Bucket):
        st = self.state[b.index]
        dtype = b.params[0].dtype
        cur = self._flat_weights(b, dtype) if self.compression.needs_current_weights else None
        return self.compression.start_weight_gather(st["master"], self.topo, dtype=dtype, current=cur,
                                                    seed=mix_seed(st["step"], b.index), key=b.index)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        world = self.topo.world
        try:
            for b in self.buckets:  # anything the hooks did not send (or sent too early)
                if b.pending is not None and b.dirty:
                    b.pending.wait()
                    b.pending = None
                if b.pending is None:
                    self._launch(b)
            gathers = []
            if self.max_grad_norm is None:
                for b in self.buckets:
                    g = b.pending.wait().div_(world)
                    self._update(b, g)
                    gathers.append(self._gather(b))
            else:
                grads = [b.pending.wait().div_(world) for b in self.buckets]
                sq = torch.stack([g.float().pow(2).sum() for g in grads]).sum().reshape(1)
                C.all_reduce(sq, group=self.group, scope="world")
                norm = float(sq.sqrt())
                self.grad_norm = norm
                coef = self.max_grad_norm / (norm + 1e-6)
                for b, g in zip(self.buckets, grads, strict=True):
                    if coef < 1.0:
                        g.mul_(coef)
                    self._update(b, g)
                    gathers.append(self._gather(b))
            for b, pend in zip(self.buckets, gathers, strict=True):
                full = pend.wait()
                for p, off in zip(b.params, b.offsets, strict=True):
                    p.copy_(full[off:off + p.numel()].view_as(p))
        except RuntimeError as e:
            if str(e).startswith("ShardedOptimizer ("):
                raise
            self._fail("step", e)
        finally:
            for b in self.buckets:
                b.pending, b.dirty = None, False
                b.ready.clear()
            self._next = 0
        return loss


__all__ = ["ShardedOptimizer"]

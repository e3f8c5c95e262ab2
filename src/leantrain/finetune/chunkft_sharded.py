"""ChunkFT over FSDP2's shards (``finetune --method chunkft --dist.mode fsdp``).

Under FSDP2 every rank holds ``DTensor`` row shards (``Shard(0)``) of every weight, all-gathers a
block's weights for its forward and backward, and reduce-scatters its gradients. ChunkFT's plan
is the single process's (:func:`leantrain.finetune.chunkft.plan_chunks` over the parameters'
global shapes, in ``named_parameters()`` order): the same chunks, the same schedule (each chunk
``interval`` steps in turn) on every rank. What a rank steps of a chunk's piece (rows
``[lo, hi)`` of a parameter) is the part of those rows its shard holds, and only those rows get
optimizer state: the active chunk's state on a rank is about ``1/world`` of one process's.

- **Gradients.** The active chunk's parameters have ``requires_grad`` on, the others off, set
  before each step's forward. FSDP2 reads the flag of each sharded parameter when it all-gathers
  it (``FSDPParam.to_unsharded``), so backward stops at the first active block and saves nothing
  before it, and FSDP reduce-scatters only the gradients that exist. A parameter is trainable
  whole, so a piece that holds part of a parameter's rows gets (and reduce-scatters) the whole
  parameter's gradient, of which its rows are used; one process's ChunkFT computes only those rows
  (its patched linears), which FSDP's all-gathered weights cannot be patched for.
- **The step** applies the rule to each local piece's rows, in row blocks; the active chunk's
  gradient norm (clipping, ``max_norm``) and each piece's finiteness come from the pieces'
  squared norms summed over the shard group (one all-reduce of one value a piece, uncounted like
  ``clip_grad_norm_``'s), so every rank clips and skips alike.
- **State** moves between the device arena (the largest chunk's local state) and a host block
  as in :class:`~leantrain.finetune.chunkft.ChunkFT`. ``state_dict()`` holds this rank's rows
  and the layout of the shards; ``load_state_dict`` takes only a state of the same layout (the
  same world size): a resume at another world size would need each chunk's state resharded
  across the ranks' files.

The weights must be fp32 (FSDP's shards under ``train.weights fp32``); there is no in-backward
step (``in_backward``): FSDP reduce-scatters a block's gradients as its backward ends, after a
piece's weight gradient was needed.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from leantrain.finetune.chunkft import (
    STATE_DTYPES,
    Piece,
    _host_block,
    end_chunk_step,
    plan_chunks,
    restore_chunks,
)
from leantrain.finetune.zo import local_rows
from leantrain.optim.rules import Rule, make_rule
from leantrain.runtime.checkpoint import CheckpointError


@dataclass(eq=False)
class LocalPiece:
    """The rows of ``piece`` this rank's shard holds: local rows ``[start, end)`` (maybe none)."""

    piece: Piece
    start: int
    end: int
    row: int  # elements a row

    @property
    def numel(self) -> int:
        return (self.end - self.start) * self.row

    def view(self, local: Tensor) -> Tensor:
        return local[self.start:self.end]


def _local_piece(piece: Piece) -> LocalPiece:
    """``piece``'s rows in this rank's shard of its parameter (global rows ``[first, first + rows)``)."""
    local, first = local_rows(piece.param)
    p = piece.param
    rows = local.shape[0] if local.dim() else 1
    start = min(max(piece.lo - first, 0), rows)
    end = max(min(piece.hi - first, rows), start)
    return LocalPiece(piece, start, end, p.numel() // p.shape[0] if p.dim() and p.shape[0] else 1)


class ShardedChunkFT(torch.optim.Optimizer):
    """``ShardedChunkFT(fsdp_model, rule="adamw", num_chunks=4, interval=1, **hyper)``: ChunkFT's
    schedule over the ``DTensor`` shards of a ``fully_shard``ed model (the module doc). The
    arguments are :class:`~leantrain.finetune.chunkft.ChunkFT`'s, less ``in_backward``,
    ``stochastic_rounding`` and ``seed`` (fp32 weights only). ``no_sync()`` keeps FSDP's gradients
    unreduced (micro-batches before the last)."""

    in_backward = False

    def __init__(self, model: nn.Module, rule: str | Rule = "adamw", *, num_chunks: int = 4, interval: int = 1,
                 max_norm: float = 0.0, offload: bool = True, block_elems: int = 1 << 22, state_dtype: str = "fp32",
                 **hyper):
        if isinstance(rule, str):
            rule = make_rule(rule, **hyper)
        elif hyper:
            raise ValueError("ChunkFT: pass hyper-parameters in the rule object or with a rule name, not both")
        if interval < 1:
            raise ValueError(f"ChunkFT: interval must be >= 1, got {interval}")
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("ChunkFT: the model has no trainable parameters")
        if any(p.dtype != torch.float32 for _, p in named):
            raise ValueError("ChunkFT over FSDP shards steps fp32 shards: keep train.weights fp32")
        self.model, self.rule = model, rule
        self.num_chunks, self.interval, self.max_norm = num_chunks, interval, float(max_norm)
        self.offload, self.block_elems, self.state_dtype = offload, int(block_elems), STATE_DTYPES[state_dtype]
        super().__init__([p for _, p in named], rule.hyper())
        self.chunks = plan_chunks(named, num_chunks, self.state_dtype.itemsize * len(rule.state_names))
        self.local = [[_local_piece(pc) for pc in chunk] for chunk in self.chunks]
        mesh = named[0][1].device_mesh
        self.group = mesh.get_group("shard") if "shard" in (mesh.mesh_dim_names or ()) else mesh.get_group()
        self.device = named[0][1].to_local().device
        self.chunk_steps, self.chunk_norms = [0] * num_chunks, [0.0] * num_chunks
        self.active, self.in_interval = 0, 0
        self.sizes = [sum(lp.numel for lp in chunk) * len(rule.state_names) for chunk in self.local]
        self.arena = torch.zeros(max(self.sizes), dtype=self.state_dtype, device=self.device)
        self._block = _host_block(self, sum(self.sizes))
        self.host = list(torch.split(self._block, self.sizes))
        self.stored = [False] * num_chunks
        self.last: dict = {}
        self._activate(0)

    # ------------------------------------------------------------------ chunks
    @staticmethod
    def _key(lp: LocalPiece) -> str:
        return f"{lp.piece.name}[{lp.piece.lo}:{lp.piece.hi}]"

    def _views(self, k: int, src: Tensor) -> dict[str, dict[str, Tensor]]:
        """Chunk ``k``'s local state in ``src`` (the arena or its host part) by piece key and state name."""
        out, off = {}, 0
        for lp in self.local[k]:
            shape = lp.view(lp.piece.param.to_local()).shape
            out[self._key(lp)] = {}
            for name in self.rule.state_names:
                out[self._key(lp)][name] = src[off:off + lp.numel].view(shape)
                off += lp.numel
        return out

    def _activate(self, k: int) -> None:
        """Chunk ``k``'s parameters trainable, the others frozen (FSDP reads the flags at its next all-gather)."""
        self.active = k
        mine = {id(pc.param) for pc in self.chunks[k]}
        for p in self.param_groups[0]["params"]:
            p.requires_grad_(id(p) in mine)
            p.grad = None
        self.hot = self._views(k, self.arena)

    def _swap(self, k: int) -> None:
        """The active chunk's state out to its host part, chunk ``k``'s in (zeros the first time)."""
        old = self.active
        if self.sizes[old]:
            self.host[old].copy_(self.arena[:self.sizes[old]])
            self.stored[old] = True
        n = self.sizes[k]
        if self.stored[k]:
            self.arena[:n].copy_(self.host[k])
        else:
            self.arena[:n].zero_()
        self._activate(k)

    @contextlib.contextmanager
    def no_sync(self):
        """Micro-batches before the last: FSDP accumulates the unsharded gradients, reduces in the last."""
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    # ------------------------------------------------------------------ the step
    def _piece_grads(self) -> list[Tensor | None]:
        """Each active local piece's gradient rows (None where its parameter has no gradient)."""
        out = []
        for lp in self.local[self.active]:
            g = lp.piece.param.grad
            out.append(None if g is None else lp.view(g.to_local() if hasattr(g, "to_local") else g))
        return out

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        chunk, grads = self.local[self.active], self._piece_grads()
        sq = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32).square() if g is not None and g.numel()
                          else torch.zeros((), device=self.device) for g in grads])
        dist.all_reduce(sq, group=self.group)  # (each piece's squared norm over the ranks' rows)
        has = [float(x) for x in sq.tolist()]
        skipped = [self._key(lp) for lp, s in zip(chunk, has) if not math.isfinite(s)]
        norm = math.sqrt(sum(s for s in has if math.isfinite(s)))
        scale = self.max_norm / (norm + 1e-6) if self.max_norm > 0 and norm > self.max_norm else 1.0
        self.chunk_norms[self.active] = norm
        self.chunk_steps[self.active] += 1
        step = self.chunk_steps[self.active]
        hp = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        for lp, g in zip(chunk, grads):
            key = self._key(lp)
            if g is None or key in skipped or not lp.numel:
                continue
            w, st = lp.view(lp.piece.param.to_local()), self.hot[key]
            rows = max(1, self.block_elems // lp.row)
            for r0 in range(0, w.shape[0], rows):
                sl = slice(r0, r0 + rows)
                gs = g[sl] * scale if scale != 1.0 else g[sl]
                p_new, st_new = self.rule.update(w[sl], gs, {n: t[sl].float() for n, t in st.items()}, step=step, **hp)
                w[sl].copy_(p_new)
                for n, t in st_new.items():
                    st[n][sl].copy_(t)
        end_chunk_step(self, step, norm, skipped)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for pc in self.chunks[self.active]:
            pc.param.grad = None

    # ------------------------------------------------------------------ memory and checkpoints
    def device_state_bytes(self) -> int:
        """Bytes on the device beyond the weight shards now: the state arena (the largest chunk's
        local state) and the active parameters' gradient shards."""
        from leantrain.runtime.ledger import count_bytes

        grads = [pc.param.grad.to_local() for pc in self.chunks[self.active] if pc.param.grad is not None]
        return count_bytes([self.arena, *grads, *([] if self.offload else [self._block])])

    def host_state_bytes(self) -> int:
        from leantrain.runtime.ledger import count_bytes

        return count_bytes([self._block]) if self.offload else 0

    def plan(self) -> list[list[list]]:
        return [[[pc.name, pc.lo, pc.hi] for pc in chunk] for chunk in self.chunks]

    def layout(self) -> list[list[int]]:
        """Each chunk's local rows ``[start, end)`` per piece: what this rank's state covers."""
        return [[[lp.start, lp.end] for lp in chunk] for chunk in self.local]

    def state_dict(self) -> dict:
        state = []
        for k in range(self.num_chunks):
            has = (k == self.active and self.chunk_steps[k]) or (k != self.active and self.stored[k])
            src = self.arena if k == self.active else self.host[k]
            state.append({key: {n: t.cpu().clone() for n, t in st.items()} for key, st in self._views(k, src).items()}
                         if has else {})
        return {"rule": self.rule.name, "plan": self.plan(), "layout": self.layout(),
                "world": dist.get_world_size(self.group), "chunk_steps": list(self.chunk_steps),
                "chunk_norms": list(self.chunk_norms), "state_dtype": str(self.state_dtype).removeprefix("torch."),
                "active": self.active, "in_interval": self.in_interval, "interval": self.interval, "state": state,
                "param_groups": [{k: v for k, v in self.param_groups[0].items() if k != "params"}]}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("rule") != self.rule.name or sd.get("plan") != self.plan() or \
                sd.get("state_dtype") != str(self.state_dtype).removeprefix("torch."):
            raise ValueError("ChunkFT.load_state_dict: the checkpoint was made with another rule, model, "
                             "num_chunks or state_dtype (its chunk plan differs)")
        if sd.get("layout") != self.layout():
            raise CheckpointError(f"ChunkFT under FSDP keeps each rank's rows of its chunks' optimizer state in that "
                                  f"rank's file: resume with the {sd.get('world')} processes it was saved with")
        self.param_groups[0].update(sd["param_groups"][0])
        self.chunk_steps, self.chunk_norms = list(sd["chunk_steps"]), list(sd["chunk_norms"])
        self.interval, self.in_interval = sd["interval"], sd["in_interval"]
        restore_chunks(self, sd, [lps if size else [] for lps, size in zip(self.local, self.sizes, strict=True)])


__all__ = ["LocalPiece", "ShardedChunkFT"]

"""ChunkFT: full-parameter fine-tuning one working set (chunk) of the parameters at a time.

The trainable parameters are cut into ``num_chunks`` chunks of about equal bytes (weight,
gradient and optimizer state counted together), in ``named_parameters()`` order, so a chunk is
a contiguous run of layers; a parameter that straddles a boundary is cut between rows (dim 0:
the output rows of a linear, the vocabulary rows of an embedding, a run of a 1-D weight's
elements). Row slices of a contiguous tensor are contiguous views, so a chunk's weights are
stepped in place.

One chunk is active at a time and the chunks take turns, ``interval`` steps each:
- **Gradients.** Linear layers (``nn.Linear``, and modules with a ``linear_fn`` such as the LM
  head) and embeddings run through autograd functions whose backward always computes the input
  gradient in full but the weight gradient only for the active rows, into a buffer the size of
  those rows (``dYᵀX`` on the rows' columns of ``dY``; an embedding's rows by autograd's own
  embedding backward on the tokens that fall in them, deterministic on CUDA). Nothing is
  written to ``.grad``. Parameters of other modules (norm weights) get their ordinary, whole
  ``.grad`` while any part of them is active (small); only the active part is stepped.
  Parameters of inactive chunks have ``requires_grad`` off, so backward stops at the first
  active layer and saves no activations before it.
- **Optimizer state.** Any :mod:`leantrain.optim.rules` rule, in fp32. Only the active chunk's
  state is on the parameters' device, in one flat buffer the size of the largest chunk's state;
  each chunk's state otherwise waits in its part of one flat host buffer, allocated whole at
  construction and, on CUDA, page-locked to its exact size (``cudaHostRegister``: torch's pinned
  allocator rounds a request up to a power of two, and pinning chunk by chunk at its first swap
  stalled the first pass through the chunks for seconds). At a change of chunk the device
  buffer is copied out to the old chunk's part and the new chunk's copied in, on a copy stream
  of their own: the copies run beside the next forward and backward, and the next ``step()``
  waits for them. Each chunk counts its own steps (AdamW's bias correction follows the updates
  the chunk actually received).
- **The step** applies the rule to the active rows in row blocks (at most ``block_elems``
  elements at once), so its temporaries are a block's, not the chunk's.

- **In backward** (``in_backward=True``, FORGE's idea applied to the working set): each active
  piece of a linear layer or an embedding is stepped inside backward as soon as its weight
  gradient exists, row block by row block, so no gradient tensor larger than one block is ever
  held, not even for the working set. The input gradient is computed before the weight changes.
  A weight used by two modules (tied embeddings) and 1-D weights (norms) are stepped by
  ``step()`` as before. Clipping then uses the chunk's gradient norm from its previous step (the
  step's own norm is known only after backward); a row block whose gradient is not finite is not
  stepped. With gradient accumulation the micro-batches run under ``no_sync()`` (as the trainer
  does) add into the row buffers and the last one steps.
- **Precision.** ``state_dtype="bf16"`` keeps the optimizer state (device arena and host block)
  in bf16 (half the bytes; the rule still computes in fp32). bf16 weights are written with
  stochastic rounding (``stochastic_rounding``, keyed by ``seed``, the parameter, the step and the
  element), so small updates are not lost to rounding.

Gradient accumulation works (backward adds into the row buffers); clipping (``max_norm``) is
by the active chunk's gradient norm. A piece whose gradient is not finite is not stepped
(``last["skipped"]`` names it). ``state_dict()`` holds the plan, the schedule and every chunk's
state; ``load_state_dict`` resumes bit for bit.

Reference: ChunkFT (arXiv 2605.21177; ``research/memory.md`` §1b). Differences from the
authors' code: the cold state stays fp32 (theirs is stored as bf16 by default, lossy), every
chunk has its own step count (theirs shares one a parameter), and RMSNorm's gradient is
autograd's (theirs uses LayerNorm's formula, a bug).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable
from contextlib import nullcontext as _nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from leantrain.finetune.chunk_layers import EmbeddingForward, LinearFn, LinearForward, chunk_linear
from leantrain.model.extension import claim, owner_of, release
from leantrain.ops.rng import step_seed
from leantrain.ops.sr import bf16_stochastic_round
from leantrain.optim.rules import Rule, make_rule

STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(eq=False)
class Piece:
    """Rows ``[lo, hi)`` of parameter ``name`` (dim 0) in one chunk."""

    name: str
    param: nn.Parameter
    lo: int
    hi: int

    @property
    def numel(self) -> int:
        return (self.hi - self.lo) * (self.param[0].numel() if self.param.dim() > 1 else 1)

    def view(self, t: Tensor) -> Tensor:
        return t[self.lo:self.hi]


def plan_chunks(named: list[tuple[str, nn.Parameter]], num_chunks: int, state_bytes: int) -> list[list[Piece]]:
    """Cut ``named`` parameters (in order) into ``num_chunks`` runs of about equal bytes: each
    element costs its weight and gradient bytes plus ``state_bytes`` of optimizer state. Cuts
    fall between rows; a ValueError if some chunk would be empty (fewer rows than chunks)."""
    if num_chunks < 1:
        raise ValueError(f"ChunkFT: num_chunks must be >= 1, got {num_chunks}")
    rows = []  # (name, param, bytes a row, number of rows)
    for name, p in named:
        if p.numel() == 0:
            continue
        n_rows = p.shape[0] if p.dim() else 1
        per_row = (p.numel() // max(n_rows, 1)) * (2 * p.element_size() + state_bytes)
        rows.append((name, p, per_row, n_rows))
    total = sum(r * n for _, _, r, n in rows)
    chunks: list[list[Piece]] = [[] for _ in range(num_chunks)]
    done = 0  # bytes before the current row
    for name, p, per_row, n_rows in rows:
        lo = 0
        while lo < n_rows:
            k = min(num_chunks - 1, done * num_chunks // total)
            end_bytes = (k + 1) * total // num_chunks  # where chunk k ends
            hi = n_rows if k == num_chunks - 1 else min(n_rows, max(lo + 1, lo + -(-(end_bytes - done) // per_row)))
            chunks[k].append(Piece(name, p, lo, hi))
            done += (hi - lo) * per_row
            lo = hi
    if any(not c for c in chunks):
        raise ValueError(f"ChunkFT: {num_chunks} chunks is more than the model's parameters have rows to cut")
    return chunks


class ChunkFT(torch.optim.Optimizer):
    """``lt.finetune.ChunkFT(model, rule="adamw", num_chunks=4, interval=1, **hyper)``.

    Use it as any optimizer: ``loss.backward(); opt.step(); opt.zero_grad()``. ``rule``: a name
    (``sgd``, ``adamw``, ``lion``, ``adams``) or a :mod:`leantrain.optim.rules` rule; keyword
    arguments (``lr``, ``weight_decay``, ``betas``, ...) override its defaults and land in the
    one param group, so LR schedulers work. ``interval``: steps a chunk stays active.
    ``max_norm``: clip the active chunk's gradient to this norm (0: no clipping).
    ``offload``: keep inactive chunks' state in host memory (pinned on CUDA); off, it stays on
    the device. ``in_backward``: step the active rows inside backward (no gradient tensor held).
    ``state_dtype``: ``"fp32"`` or ``"bf16"``. ``stochastic_rounding``: for bf16 weights, keyed by
    ``seed``. ``detach()`` restores the model's own forwards.
    """

    def __init__(self, model: nn.Module, rule: str | Rule = "adamw", *, num_chunks: int = 4, interval: int = 1,
                 max_norm: float = 0.0, offload: bool = True, block_elems: int = 1 << 22, in_backward: bool = False,
                 state_dtype: str = "fp32", stochastic_rounding: bool = True, seed: int = 0, **hyper):
        if isinstance(rule, str):
            rule = make_rule(rule, **hyper)
        elif hyper:
            raise ValueError("ChunkFT: pass hyper-parameters in the rule object or with a rule name, not both")
        if interval < 1:
            raise ValueError(f"ChunkFT: interval must be >= 1, got {interval}")
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"ChunkFT: state_dtype must be one of {sorted(STATE_DTYPES)}, got {state_dtype!r}")
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("ChunkFT: the model has no trainable parameters")
        self.rule = rule
        self.num_chunks, self.interval, self.max_norm = num_chunks, interval, float(max_norm)
        self.offload, self.block_elems = offload, int(block_elems)
        self.in_backward, self.state_dtype = bool(in_backward), STATE_DTYPES[state_dtype]
        self.stochastic_rounding, self.seed = bool(stochastic_rounding), int(seed)
        super().__init__([p for _, p in named], rule.hyper())
        self.index = {id(p): i for i, (_, p) in enumerate(named)}  # (each parameter's rounding stream)
        self.chunks = plan_chunks(named, num_chunks, self.state_dtype.itemsize * len(rule.state_names))
        self.chunk_steps = [0] * num_chunks
        self.active, self.in_interval = 0, 0
        devs = {p.device for _, p in named}
        if len(devs) != 1:
            raise ValueError(f"ChunkFT: the parameters are on several devices ({sorted(map(str, devs))})")
        self.device = devs.pop()
        # every chunk's state as one flat fp32 run: the piece's states in rule.state_names order
        self.sizes = [sum(pc.numel for pc in chunk) * len(rule.state_names) for chunk in self.chunks]
        self.arena = torch.zeros(max(self.sizes), dtype=self.state_dtype, device=self.device)  # the active chunk's
        # each chunk's state while it is inactive: its part of one block (host, or the device
        # without offload); stored[k]: chunk k has state there (else it starts from zeros)
        self._block = _host_block(self, sum(self.sizes))
        self.host = list(torch.split(self._block, self.sizes))
        self.stored = [False] * num_chunks
        self._copy = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._ready = None  # an event on the copy stream: the active chunk's state is in the arena
        self.hot: dict[str, dict[str, Tensor]] = {}  # the active chunk's state: views into the arena
        self.grads: dict[int, tuple[Piece, Tensor]] = {}  # id(param) -> (active piece, its gradient rows)
        # in_backward: the pieces stepped in this step's backward, with their gradient's sum of
        # squares (on the device); each chunk's gradient norm at its last step (the clipping estimate)
        self.stepped: dict[str, Tensor] = {}
        self.chunk_norms = [0.0] * num_chunks
        self.accumulating = False  # under no_sync(): a micro-batch before the last (nothing is stepped)
        self.last: dict = {}
        self._patched: list[tuple[nn.Module, str]] = []
        self._patch(model)
        self._activate(0)

    # ------------------------------------------------------------------ model hooks
    def _patch(self, model: nn.Module) -> None:
        for name, m in model.named_modules():  # (all checked before any is patched)
            if owner_of(m) not in (None, "ChunkFT"):
                raise ValueError(f"ChunkFT: module {name} is already taken over by {owner_of(m)}; "
                                 f"detach {owner_of(m)} first")
        for name, m in model.named_modules():
            if isinstance(m, (nn.Linear, nn.Embedding)) or hasattr(type(m), "linear_fn"):
                claim(m, "ChunkFT", name)
            if hasattr(type(m), "linear_fn"):
                m.linear_fn = LinearFn(self)
                self._patched.append((m, "linear_fn"))
            elif isinstance(m, nn.Linear):
                m.forward = LinearForward(m, self)
                self._patched.append((m, "forward"))
            elif isinstance(m, nn.Embedding):
                if m.max_norm is not None or m.sparse:
                    raise ValueError(f"ChunkFT: embedding {name} uses max_norm or sparse gradients (not supported)")
                m.forward = EmbeddingForward(m, self)
                self._patched.append((m, "forward"))
        self._sliced = {id(m.weight) for m, _ in self._patched}
        self._sliced |= {id(m.bias) for m, _ in self._patched if getattr(m, "bias", None) is not None}
        uses: dict[int, int] = {}
        for m, _ in self._patched:
            uses[id(m.weight)] = uses.get(id(m.weight), 0) + 1
        self._shared = {key for key, n in uses.items() if n > 1}  # (tied: stepped by step(), after both backwards)

    def detach(self) -> None:
        """Restore the patched modules' own forwards and every parameter's ``requires_grad``."""
        for m, attr in self._patched:
            if attr in m.__dict__:
                delattr(m, attr)
            release(m, "ChunkFT")
        self._patched.clear()
        for p in self.param_groups[0]["params"]:
            p.requires_grad_(True)

    # ------------------------------------------------------------------ gradients
    def add_grad(self, p: Tensor, make: Callable[[int, int], Tensor]) -> None:
        """Add the gradient rows of ``p``'s active piece (``make(lo, hi)``), if it has one."""
        entry = self.grads.get(id(p))
        if entry is None:
            return
        piece, g = entry
        if self.in_backward and not self.accumulating and id(p) not in self._shared and p.dim() > 1:
            self._step_in_backward(piece, g, make)
            self.grads[id(p)] = (piece, None)
            return
        new = make(piece.lo, piece.hi)
        self.grads[id(p)] = (piece, new if g is None else g.add_(new))

    @contextlib.contextmanager
    def no_sync(self):
        """Micro-batches before the last of an accumulated step: gradients are only added up."""
        self.accumulating = True
        try:
            yield
        finally:
            self.accumulating = False

    def _step_in_backward(self, piece: Piece, held: Tensor | None, make: Callable[[int, int], Tensor]) -> None:
        """Step ``piece`` now, row block by row block, from each block's gradient (``make``, plus
        the rows accumulated by earlier micro-batches), clipped by the chunk's last norm."""
        self._wait()  # (the chunk's state is in the arena)
        scale = self._clip_scale(self.chunk_norms[self.active])
        w, st, key = piece.view(piece.param), self.hot[self._key(piece)], self._key(piece)
        sq = torch.zeros((), dtype=torch.float32, device=w.device)
        rows = max(1, self.block_elems // w[0].numel())
        with torch.no_grad():
            for r0 in range(0, w.shape[0], rows):
                r1 = min(r0 + rows, w.shape[0])
                g = make(piece.lo + r0, piece.lo + r1)
                if held is not None:
                    g = g + held[r0:r1]
                block_sq = torch.linalg.vector_norm(g, dtype=torch.float32).square()
                sq += block_sq
                self._update_rows(piece, slice(r0, r1), g, st, self.chunk_steps[self.active] + 1, scale,
                                  finite=torch.isfinite(block_sq))
        self.stepped[key] = sq

    def _clip_scale(self, norm: float) -> float:
        return self.max_norm / (norm + 1e-6) if self.max_norm > 0 and norm > self.max_norm else 1.0

    def _update_rows(self, piece: Piece, sl: slice, g: Tensor, st: dict[str, Tensor], step: int, scale: float,
                     finite: Tensor | None = None) -> None:
        """The rule on rows ``sl`` of ``piece``: fp32 math, the state stored back in its dtype, the
        weight by stochastic rounding when it is bf16 (keyed by the parameter, step and element).
        ``finite``: a device flag; where it is false nothing changes (no host sync)."""
        group = self.param_groups[0]
        hp = {k: v for k, v in group.items() if k != "params"}
        w = piece.view(piece.param)[sl]
        gs = g * scale if scale != 1.0 else g
        p_new, st_new = self.rule.update(w, gs, {n: t[sl].float() for n, t in st.items()}, step=step, **hp)
        if finite is not None:
            p_new = torch.where(finite, p_new, w.float())
            st_new = {n: torch.where(finite, t, st[n][sl].float()) for n, t in st_new.items()}
        if w.dtype == torch.bfloat16 and self.stochastic_rounding:
            row = w[0].numel()
            seed = step_seed(self.seed, self.index[id(piece.param)], step)
            p_new = bf16_stochastic_round(p_new.contiguous(), seed=seed, offset=(piece.lo + (sl.start or 0)) * row)
        w.copy_(p_new)
        for n, t in st_new.items():
            st[n][sl].copy_(t)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.stepped = {}
        for key, (piece, _) in self.grads.items():
            self.grads[key] = (piece, None)
        for piece in self.chunks[self.active]:
            piece.param.grad = None

    def _grad_of(self, piece: Piece) -> Tensor | None:
        """The piece's gradient rows: the sliced buffer, plus the rows of ``.grad`` where autograd
        gave the parameter an ordinary gradient (norm weights; a weight used outside its module)."""
        g = self.grads[id(piece.param)][1] if id(piece.param) in self._sliced else None
        full = piece.param.grad
        if full is not None:
            g = piece.view(full) if g is None else g + piece.view(full)
        return g

    # ------------------------------------------------------------------ chunks
    @staticmethod
    def _key(piece: Piece) -> str:
        return f"{piece.name}[{piece.lo}:{piece.hi}]"

    def _views(self, k: int) -> dict[str, dict[str, Tensor]]:
        """Chunk ``k``'s state as views into the arena, by piece key and state name."""
        out, off = {}, 0
        for pc in self.chunks[k]:
            shape = pc.view(pc.param).shape
            out[self._key(pc)] = {}
            for name in self.rule.state_names:
                out[self._key(pc)][name] = self.arena[off:off + pc.numel].view(shape)
                off += pc.numel
        return out

    def _activate(self, k: int) -> None:
        """Make chunk ``k`` the working set: its parameters trainable (the others frozen). Its state
        is in the arena once the copy stream gets there (``_wait``)."""
        self.active = k
        chunk = self.chunks[k]
        mine = {id(pc.param) for pc in chunk}
        for p in self.param_groups[0]["params"]:
            p.requires_grad_(id(p) in mine)
            p.grad = None
        self.grads = {id(pc.param): (pc, None) for pc in chunk if id(pc.param) in self._sliced}
        self.hot = self._views(k)

    def _swap(self, k: int) -> None:
        """Copy the active chunk's state out of the arena and chunk ``k``'s in (zeros the first
        time), on the copy stream after the work queued so far; then activate ``k``."""
        old, cuda = self.active, self._copy is not None
        if cuda:
            self._copy.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy) if cuda else _nullcontext():
            n = self.sizes[old]
            if n:
                self.host[old].copy_(self.arena[:n], non_blocking=cuda)
                self.stored[old] = True
            n = self.sizes[k]
            if not self.stored[k]:
                self.arena[:n].zero_()
            else:
                self.arena[:n].copy_(self.host[k], non_blocking=cuda)
            if cuda:
                self._ready = torch.cuda.Event()
                self._ready.record(self._copy)
        self._activate(k)

    def _wait(self) -> None:
        """The current stream waits for the copy stream's last swap."""
        if self._ready is not None:
            torch.cuda.current_stream(self.device).wait_event(self._ready)
            self._ready = None

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        chunk = self.chunks[self.active]
        self._wait()
        grads = {self._key(pc): self._grad_of(pc) for pc in chunk if self._key(pc) not in self.stepped}
        # each piece's norm, one reduction (no temporary the piece's size): a NaN or Inf anywhere in
        # it (or a norm past fp32's range) and the piece is not stepped; the pieces stepped in
        # backward left their sums of squares (read here, one sync)
        norms = {key: float(torch.linalg.vector_norm(g, dtype=torch.float32)) for key, g in grads.items()
                 if g is not None}
        if self.stepped:
            norms.update(zip(self.stepped, torch.stack(list(self.stepped.values())).sqrt().tolist(), strict=True))
        skipped = [key for key, n in norms.items() if not math.isfinite(n)]
        norm = math.sqrt(sum(n * n for key, n in norms.items() if key not in skipped))
        # in backward the step's own norm comes too late: the chunk's last one clips it (and the rest)
        scale = self._clip_scale(self.chunk_norms[self.active] if self.in_backward else norm)
        self.chunk_norms[self.active] = norm
        self.chunk_steps[self.active] += 1
        step = self.chunk_steps[self.active]
        for pc in chunk:
            key = self._key(pc)
            g = grads.get(key)
            if g is None or key in skipped:
                continue
            w, st = pc.view(pc.param), self.hot[key]
            rows = max(1, self.block_elems // w[0].numel())
            for r0 in range(0, w.shape[0], rows):
                sl = slice(r0, r0 + rows)
                self._update_rows(pc, sl, g[sl], st, step, scale)
        self.stepped = {}
        end_chunk_step(self, step, norm, skipped)
        return loss

    # ------------------------------------------------------------------ memory and checkpoints
    def device_state_bytes(self) -> int:
        """Bytes on the device beyond the weights now: the state arena (the largest chunk's state)
        and the gradients held, the rows' buffers and the ordinary ``.grad`` of the active
        parameters autograd steps whole."""
        from leantrain.runtime.ledger import count_bytes

        plain = [pc.param.grad for pc in self.chunks[self.active] if pc.param.grad is not None]
        held = [self.arena, *(g for _, g in self.grads.values() if g is not None), *plain]
        if not self.offload:
            held.append(self._block)
        return count_bytes(held)

    def host_state_bytes(self) -> int:
        """Bytes of the chunks' state block in host memory (0 without ``offload``): every chunk's
        state, allocated at construction."""
        from leantrain.runtime.ledger import count_bytes

        return count_bytes([self._block]) if self.offload else 0

    def plan(self) -> list[list[list]]:
        return [[[pc.name, pc.lo, pc.hi] for pc in chunk] for chunk in self.chunks]

    def _chunk_state(self, k: int) -> dict[str, dict[str, Tensor]]:
        """Chunk ``k``'s state (CPU copies) by piece key and state name; {} before its first step."""
        if k == self.active:
            src = self.arena
        elif self.stored[k]:
            src = self.host[k]
        else:
            return {}
        out, off = {}, 0
        for pc in self.chunks[k]:
            out[self._key(pc)] = {}
            for name in self.rule.state_names:
                out[self._key(pc)][name] = src[off:off + pc.numel].view(pc.view(pc.param).shape).cpu().clone()
                off += pc.numel
        return out

    def state_dict(self) -> dict:
        self._wait()
        if self._copy is not None:
            self._copy.synchronize()  # (the host buffers are complete)
        state = [self._chunk_state(k) if (k == self.active and self.chunk_steps[k]) or self.stored[k]
                 else {} for k in range(self.num_chunks)]
        return {"rule": self.rule.name, "plan": self.plan(), "chunk_steps": list(self.chunk_steps),
                "chunk_norms": list(self.chunk_norms), "state_dtype": str(self.state_dtype).removeprefix("torch."),
                "active": self.active, "in_interval": self.in_interval, "interval": self.interval,
                "state": state, "param_groups": [{k: v for k, v in self.param_groups[0].items() if k != "params"}]}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("rule") != self.rule.name or sd.get("plan") != self.plan() or \
                sd.get("state_dtype", "float32") != str(self.state_dtype).removeprefix("torch."):
            raise ValueError("ChunkFT.load_state_dict: the checkpoint was made with another rule, model, "
                             "num_chunks or state_dtype (its chunk plan differs)")
        self._wait()
        if self._copy is not None:
            self._copy.synchronize()  # (no copy into or out of the host block is in flight)
        self.param_groups[0].update(sd["param_groups"][0])
        self.chunk_steps = list(sd["chunk_steps"])
        self.chunk_norms = list(sd.get("chunk_norms", [0.0] * self.num_chunks))
        self.interval, self.in_interval = sd["interval"], sd["in_interval"]
        restore_chunks(self, sd, self.chunks)


def end_chunk_step(opt, step: int, norm: float, skipped: list) -> None:
    """After a chunk's step: record it (``opt.last``), drop the gradients, and move to the next
    chunk once the active one has had its ``interval`` steps. ChunkFT's and ShardedChunkFT's."""
    opt.last = {"chunk": opt.active, "chunk_step": step, "grad_norm": norm, "skipped": skipped}
    opt.zero_grad()
    opt.in_interval += 1
    if opt.in_interval >= opt.interval and opt.num_chunks > 1:
        opt.in_interval = 0
        opt._swap((opt.active + 1) % opt.num_chunks)


def restore_chunks(opt, sd: dict, pieces: list[list]) -> None:
    """Put the chunks' saved state of ``sd`` back: the active chunk's into the device arena, the
    others' into their host blocks (``pieces[k]``: chunk ``k``'s pieces, in the saved order; an
    empty list skips the chunk), then activate the saved active chunk. ChunkFT's and
    ShardedChunkFT's ``load_state_dict``."""
    opt.stored = [False] * opt.num_chunks
    opt.arena.zero_()
    for k, chunk_state in enumerate(sd["state"]):
        if not chunk_state or not pieces[k]:
            continue
        flat = torch.cat([chunk_state[opt._key(pc)][name].reshape(-1).to(opt.state_dtype)
                          for pc in pieces[k] for name in opt.rule.state_names])
        if k == sd["active"]:
            opt.arena[:flat.numel()].copy_(flat)
        else:
            opt.host[k].copy_(flat)
            opt.stored[k] = True
    opt._activate(sd["active"])


def _host_block(opt: ChunkFT, n: int) -> Tensor:
    """A flat fp32 buffer of ``n`` elements for the inactive chunks' state: on the device without
    offload; else in host memory, page-locked on CUDA (so the copies run asynchronously) to its
    exact size by ``cudaHostRegister`` and unregistered when ``opt`` is collected."""
    if not opt.offload or opt.device.type != "cuda":
        return torch.zeros(n, dtype=opt.state_dtype, device="cpu" if opt.offload else opt.device)
    block = torch.zeros(n, dtype=opt.state_dtype)  # (zeroed by torch's threads: the pages exist before locking)
    if n:
        nbytes = n * block.element_size()
        err = int(torch.cuda.cudart().cudaHostRegister(block.data_ptr(), nbytes, 0))
        if err:
            raise RuntimeError(f"ChunkFT: page-locking {nbytes} bytes of host memory failed (CUDA error {err}); "
                               "pass offload=False to keep the state on the device")
        # the finalizer holds the block: its memory is unregistered before it can be freed
        weakref.finalize(opt, _unpin, block).atexit = False
    return block


def _unpin(block: Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(block.data_ptr())


__all__ = ["ChunkFT", "Piece", "plan_chunks", "chunk_linear"]

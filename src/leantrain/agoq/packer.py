"""The one save path: every tensor autograd saves during a forward goes through ``Packer``.

``torch.autograd.graph.saved_tensors_hooks(pack, unpack)`` sees every tensor saved by a
built-in op *and* by ``ctx.save_for_backward`` in a custom ``autograd.Function`` (FORGE's
linear, ChunkFT's functions). A function that must keep a tensor on ``ctx`` as an
attribute instead uses :func:`save` / :func:`load`, which go through the same packer.

Roles come from module context: forward pre/post hooks on the model's modules push and pop
the role of the module that is running (q_proj -> ``qkv_in``, RMSNorm -> ``norm``, the
attention body -> ``attn``, ...; see :func:`role_of_module`), so the packer knows what it
is packing, including tensors a custom Function saves inside a Linear-like module.

Per saved tensor, in order: parameter/buffer (or a view of one) -> kept, not counted (it is
not an activation); integer -> kept; bool -> 1-bit mask; reduced statistic (last dim 1:
RMSNorm's rstd) -> kept; no grad required (RoPE tables, constants) -> kept; fp32 of rank <= 3
in attention (SDPA's log-sum-exp) -> kept as a statistic; fewer than ``min_numel`` elements -> kept; otherwise
quantized to ``policy.bits_for(role, stage)`` (a log-softmax output, which cross-entropy
saves, as ``p = exp(logp)`` when ``policy.logits_format == "prob"``: :class:`ProbPacked`;
stochastic-rounding noise is fresh for every tensor of every forward: tensor ``n`` of a
packer gets the seed ``base + n * golden`` with ``base = _mix(policy.seed, packer number)``).
On CUDA the 4/8-bit ones are packed in batches (:class:`leantrain.agoq.pack.PackBatch`, one
launch per batch; flushed at ``policy.batch_mib`` waiting bytes and at the end of the forward).
A tensor saved twice (same storage, offset, shape, strides and version, still alive) is
packed once and shared. Every decision is counted in ``Packer.stats``, so nothing is skipped
silently; every byte kept is reported to the memory ledger through
:func:`leantrain.runtime.ledger.note_saved`.

Replay (the plan a persistent :func:`leantrain.agoq.apply` records and follows) is
:mod:`leantrain.agoq.replay`; derived saves are :mod:`leantrain.agoq.derive`.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import Counter, defaultdict

import torch
from torch import Tensor, nn

from leantrain.agoq.derive import DeriveMixin
from leantrain.agoq.pack import PackBatch, pack
from leantrain.agoq.policy import KEEP, Policy
from leantrain.agoq.replay import Plan, ReplayMixin, signature
from leantrain.agoq.roles import role_of_module
from leantrain.agoq.saved import ProbPacked, add_use, is_log_softmax, storage_ptr, unpack_saved
from leantrain.runtime.ledger import metering, note_saved

__all__ = ["Packer", "active_packers"]

_M64 = (1 << 64) - 1
_M63 = (1 << 63) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15
_PACKERS = itertools.count(1)  # process-wide: each Packer draws fresh rounding noise


def _mix(*xs: int) -> int:
    """A 63-bit seed from integers (splitmix64 chain). Every bit depends on every input: torch's
    CPU generator uses only a seed's low 32 bits, so ``(a << 32) + n`` would repeat the noise."""
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h = (h ^ (x & _M64)) & _M64
        h = (h + 0x9E3779B97F4A7C15) & _M64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _M64
        h ^= h >> 31
    return h & 0x7FFFFFFFFFFFFFFF


_local = threading.local()
_BITS_KEY = {b: f"bits{b}" for b in (1, 2, 3, 4, 8)}
_HALF = (torch.bfloat16, torch.float16)


def active_packers() -> list[Packer]:
    """This thread's open packers, innermost last."""
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


class Packer(ReplayMixin, DeriveMixin):
    """Packs saved activations of ``model`` by ``policy``; counts every decision in ``stats``.

    ``batch_devices`` / ``batch_backend``: where 4/8-bit saves go through :class:`PackBatch`
    (CUDA; tests add "cpu" with the Triton interpreter) and the ops backend the batches use.
    ``max_plans``: recorded forwards kept for replay (one per signature; see the module docstring).
    ``salt``: mixed into the rounding noise's seed with ``policy.seed`` (None: a fresh one per packer
    of the process; a run passes its own, so that its noise does not depend on what ran before it).
    """

    batch_devices: tuple[str, ...] = ("cuda",)
    batch_backend: str = "auto"
    max_plans: int = 8

    def __init__(self, model: nn.Module, policy: Policy | None = None, *, stage: int = 0,
                 record: bool = False, salt: int | None = None):
        self.model = model
        self.policy = policy or Policy()
        self.stage = stage
        self.record = record
        self.log: list[dict] = []  # one entry per saved tensor when record=True
        self.stats: Counter = Counter()
        self.bytes_raw: dict[str, int] = defaultdict(int)  # by role, before packing (dedup'd)
        self.bytes_kept: dict[str, int] = defaultdict(int)  # by role, what is held
        self.numel: dict[str, int] = defaultdict(int)  # by role, elements packed (stored)
        self.derived_numel: dict[str, int] = defaultdict(int)  # by role, elements derived (0 bytes)
        self._roles: list[str] = []
        self._base_role = "other"  # the role outside every hooked module
        self._handles: list = []  # role hooks
        self._root_handles: list = []  # attach's enter / leave hooks
        self.replay = False  # attach(replay=...)
        self._dedup: dict = {}
        self._static: set[int] = set()
        self._n = 0
        self._salt = next(_PACKERS) if salt is None else salt
        self._base_seed = _mix(self.policy.seed, self._salt)  # tensor n: base + n * golden (mod 2**63)
        # open batches by (symmetry, word path): 4-bit 16-bit floats apart from the rest (8-bit, fp32),
        # so each flush is one launch of one compiled path (a mixed batch launched two); each
        # batch's waiting bytes: when they sum to policy.batch_mib, the fullest batch is flushed
        self._batches: dict[tuple[bool, bool], PackBatch] = {}
        self._waiting: dict[tuple[bool, bool], int] = {}
        self._modules: list[nn.Module] | None = None
        self._bits: dict[str, int] = {}
        self._ctx = None
        self._plans: dict[tuple, Plan] = {}  # signature -> recorded forward
        self._replay: Plan | None = None  # the plan this forward follows
        self._i = 0  # its next slot
        self._trace: list[tuple] | None = None  # the slots this forward records
        self._trace_kept: Counter = Counter()
        self._trace_bytes: dict[str, int] = defaultdict(int)
        self._sig: tuple | None = None
        # this forward's packed (or derived) saves by autograd identity (grad_fn, output_nr):
        # the sources of derived saves (policy.derive)
        self._by_node: dict[tuple[int, int], tuple] = {}
        self._derive: frozenset[str] = frozenset()  # policy.derive, read by begin() each forward
        self._slot_of: dict[int, int] = {}  # recording: id(packed or derived save) -> its slot
        self._objs: list = []  # replay: this forward's save objects by slot (derived saves' sources)

    # ------------------------------------------------------------------ module hooks

    def install(self, root_role: str = "logits", *, root: bool = True) -> None:
        """Role hooks on every module with a role; ``root=False``: not on the model itself (its
        role is then the base role, see :func:`apply`)."""
        self.remove()
        for name, m in self.model.named_modules():
            if m is self.model and not root:
                continue
            role = root_role if m is self.model else role_of_module(name, m)
            if role is None:
                continue
            self._handles.append(m.register_forward_pre_hook(self._push(role)))
            self._handles.append(m.register_forward_hook(self._pop, always_call=True))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def state_dict(self) -> dict:
        """Where the rounding noise is: the count of tensors packed so far (a resumed run continues
        the noise of an uninterrupted one)."""
        return {"tensors_packed": self._n}

    def load_state_dict(self, state: dict) -> None:
        self._n = int(state["tensors_packed"])

    def attach(self, *, replay: bool = True) -> None:
        """Persistent packing (:func:`leantrain.agoq.apply`): open at the start of every
        ``model.forward``, close at its end; ``replay``: follow recorded plans."""
        self.replay = replay
        self.install(root=False)
        self._root_handles = [self.model.register_forward_pre_hook(self._enter_forward, with_kwargs=True),
                              self.model.register_forward_hook(self._leave_forward, always_call=True)]

    def detach(self) -> None:
        """Undo :meth:`attach`: every hook off."""
        self.remove()
        for h in self._root_handles:
            h.remove()
        self._root_handles.clear()

    def _enter_forward(self, mod, args, kwargs):
        sig = None
        if self.replay:
            sig = (signature(args, kwargs), mod.training, self.stage, tuple(vars(self.policy).values()))
        self._roles.clear()
        self._base_role = "logits"
        self.open(sig)
        if self._replay is not None:
            self.remove()  # role hooks: not needed to follow a plan
        elif not self._handles:
            self.install(root=False)  # (this hook runs before the children: they see their roles)
        # (a pre-hook's return value would replace the forward's arguments)

    def _leave_forward(self, mod, args, out):
        self.close(ok=out is not None)  # (None: the forward raised; its partial trace is not kept)

    def _push(self, role):
        def hook(mod, args):
            self._roles.append(role)
        return hook

    def _pop(self, mod, args, out):
        if self._roles:
            self._roles.pop()

    @property
    def role(self) -> str:
        return self._roles[-1] if self._roles else self._base_role

    # ------------------------------------------------------------------ saved-tensor hooks

    def flush(self) -> None:
        """Pack every waiting tensor (one launch per open batch) and close the batches."""
        batches, self._batches, self._waiting = self._batches, {}, {}
        for b in batches.values():
            b.flush()

    def __enter__(self) -> Packer:
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close(ok=exc[0] is None)

    def open(self, sig: tuple | None = None) -> None:
        """Start packing (the saved-tensor hooks on); ``sig``: the forward's signature, for replay."""
        plan = None
        if sig is not None and not self.record and not metering():
            plan = self._plans.get(sig)
        self.begin(plan, sig)
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self.pack_hook, self.unpack_hook)
        self._ctx.__enter__()
        active_packers().append(self)

    def close(self, ok: bool = True) -> None:
        active_packers().remove(self)
        ctx, self._ctx = self._ctx, None
        ctx.__exit__(None, None, None)
        self.end(ok)

    def _keep(self, t: Tensor, reason: str, role: str, report: bool = True, sp: int | None = None):
        self.stats["kept:" + reason] += 1
        nb = 0
        if report:
            key = ("raw", str(t.device), storage_ptr(t) if sp is None else sp)
            nb = t.untyped_storage().nbytes() if t.device.type != "meta" else 0
            note_saved(nb, key, role)
            if key not in self._dedup:
                self._dedup[key] = None
                self.bytes_raw[role] += nb
                self.bytes_kept[role] += nb
            else:
                nb = 0
        if self._trace is not None:
            self._trace.append((t.shape, t.dtype, role, 0, False, reason, nb))
            self._trace_kept["saved"] += 1
            self._trace_kept["kept:" + reason] += 1
            self._trace_bytes[role] += nb
        if self.record:
            self.log.append({"role": role, "shape": tuple(t.shape), "dtype": str(t.dtype), "bits": None, "why": reason})
        return t

    def classify(self, t: Tensor, role: str, explicit: bool = False, sp: int | None = None) -> tuple[str, int]:
        """("pack", bits) or ("keep:<reason>", 0) for tensor ``t`` saved under ``role``.

        ``explicit``: handed over by :func:`save` from inside an ``autograd.Function``'s
        forward, where grad mode is off, so ``requires_grad`` says nothing. ``sp``: ``t``'s
        storage address, when the caller has it.
        """
        if (storage_ptr(t) if sp is None else sp) in self._static:  # (pack_hook takes weights and their views first)
            return "keep:param", 0
        if t.dtype == torch.bool:
            return "pack", 1
        if not t.is_floating_point():
            return "keep:integer", 0
        if t.dim() >= 1 and t.shape[-1] == 1:  # (RMSNorm's rstd: made without grad inside its function)
            return "keep:stat", 0
        if not t.requires_grad and not explicit:
            return "keep:no_grad", 0
        if role == "attn" and t.dtype == torch.float32 and t.dim() <= 3:
            return "keep:stat", 0
        if t.numel() < self.policy.min_numel:
            return "keep:small", 0
        bits = self._bits.get(role)
        if bits is None:
            bits = self._bits[role] = self.policy.bits_for(role, self.stage)
        if bits >= KEEP:
            return "keep:policy", 0
        return "pack", bits

    def pack_hook(self, t: Tensor, explicit: bool = False):
        plan = self._replay
        if plan is not None:  # follow the recorded forward
            i = self._i
            if i < len(plan.slots):
                shape, dtype, role, bits, prob, why, _ = plan.slots[i]
                if t.shape == shape and t.dtype is dtype:
                    if not bits:
                        self._i = i + 1
                        return t
                    base = t._base
                    if (dtype is torch.bool or ((t.requires_grad or explicit)
                                                and type(t if base is None else base) is not nn.Parameter)) \
                            and (not prob or is_log_softmax(t)):
                        if type(why) is tuple:  # derived: rebuilt from this forward's saves, by slot
                            d = self._rebuild(why)
                            if d is not None:
                                self._i = i + 1
                                self._objs[i] = obj = self._store_derived(t, role, base, d)
                                return obj
                        else:
                            self._i = i + 1
                            self._objs[i] = obj = self._store(t, role, bits, prob, base)
                            return obj
            self._diverge()
        return self._full(t, explicit)

    def _full(self, t: Tensor, explicit: bool):
        """The full path: classify ``t`` by its role and what it is, then keep or pack it."""
        self.stats["saved"] += 1
        base = t._base
        if type(t if base is None else base) is nn.Parameter:  # fast path: weights, their views
            if self.record or self._trace is not None:
                return self._keep(t, "param", self.role, report=False)
            self.stats["kept:param"] += 1
            return t
        role = self.role if t.dtype != torch.bool else "mask"
        sp = storage_ptr(t)
        decision, bits = self.classify(t, role, explicit, sp)
        if decision != "pack":
            return self._keep(t, decision[5:], role, report=decision != "keep:param", sp=sp)
        prob = role == "logits" and self.policy.logits_format == "prob" and is_log_softmax(t)
        if self._trace is not None:
            self._trace.append((t.shape, t.dtype, role, bits, prob, "", 0))
            self._trace_kept["saved"] += 1
        return self._store(t, role, bits, prob, base, sp)

    def _store(self, t: Tensor, role: str, bits: int, prob: bool, base: Tensor | None, sp: int | None = None):
        """Pack ``t`` (``role``, ``bits``; ``prob``: as probabilities), or share the packed copy
        of the same tensor saved earlier in this forward."""
        stats = self.stats
        key = (storage_ptr(t) if sp is None else sp, t.storage_offset(), t.shape, t.stride(), t.dtype, t._version)
        hit = self._dedup.get(key)
        if hit is not None and hit[0]() is not None:  # the owner alive: storage not reused
            stats["dedup"] += 1
            if self.record:
                self.log.append({"role": role, "shape": tuple(t.shape), "dtype": str(t.dtype), "bits": bits, "why": "dedup"})
            add_use(hit[1])  # one more backward node unpacks it: dequantized (log(p) taken) once for all
            return hit[1]
        # (replay rebuilds derived saves from its plan: no autograd graph walk there)
        gf = t.grad_fn if self._derive and self._replay is None else None
        if gf is not None:
            d = self._derived(t, gf)
            if d is not None:
                self._by_node[(id(gf), t.output_nr)] = (gf, d, t.shape, t.dtype)
                if self._trace is not None:  # the slot records how to rebuild it
                    self._trace[-1] = (*self._trace[-1][:5], self._recipe(d), 0)
                    self._slot_of[id(d)] = len(self._trace) - 1
                return self._store_derived(t, role, base, d, key)
        self._n += 1
        pol = self.policy
        seed = (self._base_seed + self._n * _GOLDEN64) & _M63
        batch = None
        if prob:  # (exp inside the quantize kernel: no GiB-sized tensor of probabilities at 1b)
            p = ProbPacked(pack(t.detach(), bits, group_size=pol.group_size, stochastic=pol.stochastic, seed=seed,
                                symmetric=False, exp=True), t.dtype)
        else:
            symmetric = role != "logits"
            if bits in (4, 8) and pol.batch_mib > 0 and (t.is_cuda if self.batch_devices == ("cuda",)
                                                         else t.device.type in self.batch_devices):
                bkey = (symmetric, bits == 4 and t.dtype in _HALF)
                batch = self._batches.get(bkey)
                if batch is None:
                    batch = self._batches[bkey] = PackBatch(pol.group_size, symmetric, pol.stochastic,
                                                        self.batch_backend, int(pol.unpack_mib * 2**20))
                p = batch.register(t, bits, seed)  # (pack() without its checks: a float tensor, 4 or 8 bits)
            else:
                p = pack(t, bits, group_size=pol.group_size, stochastic=pol.stochastic, seed=seed,
                         symmetric=symmetric)
        n = t.numel()
        nb = n * t.element_size()
        if batch is not None:
            wait = self._waiting
            wait[bkey] = wait.get(bkey, 0) + nb
            if sum(wait.values()) >= pol.batch_mib * 2**20:  # the fullest batch only: the other keeps filling
                full = max(wait, key=wait.get)
                del wait[full]
                self._batches.pop(full).flush()
        # A view made on the fly (F.linear flattens its input) dies at once; its base holds the
        # storage, so a weak reference to the base proves the memory was not reused.
        self._dedup[key] = (weakref.ref(t if base is None else base), p)
        if gf is not None:  # a possible source of a later derived save
            self._by_node[(id(gf), t.output_nr)] = (gf, p, t.shape, t.dtype)
            if self._trace is not None:
                self._slot_of[id(p)] = len(self._trace) - 1
        stats["packed"] += 1
        stats[_BITS_KEY[bits]] += 1
        self.numel[role] += n
        self.bytes_raw[role] += nb
        self.bytes_kept[role] += p.nbytes
        if self._replay is None:  # (no meter is open during a replay: see open())
            note_saved(p.nbytes, ("agoq", id(p)), role)
        if self.record:
            self.log.append({"role": role, "shape": tuple(t.shape), "dtype": str(t.dtype), "bits": bits, "why": "packed"})
        return p

    @staticmethod
    def unpack_hook(obj):
        return unpack_saved(obj)

    def summary(self) -> dict:
        raw, kept = sum(self.bytes_raw.values()), sum(self.bytes_kept.values())
        return {"stats": dict(self.stats), "bytes_raw": raw, "bytes_kept": kept,
                "ratio": kept / raw if raw else 0.0,
                "by_role": {r: {"raw": self.bytes_raw[r], "kept": self.bytes_kept[r]} for r in self.bytes_raw}}

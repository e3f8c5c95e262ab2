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

Replay (persistent :func:`apply`, what the trainer uses): the decisions above cost Python on
each of the ~940 saves of a 1b forward, and the role module hooks slow every module call; on
a GPU that host time, not the kernels, set AGoQ's step time. So the first forward with a new
signature (the tensor arguments' shapes, dtypes and devices, the other arguments, grad and
training mode, the policy) runs the full path with the role hooks installed and records one
slot per save: shape, dtype, role, bits. The next forwards with that signature run with the
role hooks removed and follow the slots: a save whose shape and dtype match its slot is kept
or packed as recorded (dedup still checked live), without classifying it again; the counts of
kept tensors are added in bulk at the end of the forward, so ``stats`` and the byte counts
equal the full path's. A save that does not match its slot (a forward that departs from the
recorded one; a slot recorded as a log-softmax that gets another tensor; fewer saves than
recorded) ends the replay: that save and the rest of the forward take the full path with
the role ``"other"`` (its bits, 8 by default: there is no module context to read), the
replayed prefix is counted, ``stats["replay:diverged"]`` is incremented, and the plan is
dropped, so the next forward records anew. Matching is by shape and dtype: a model whose saves
change with state the signature does not see (a flag on a module) can have saves packed at
the widths of the recorded saves of the same shape, until a mismatch shows;
``apply(..., replay=False)`` avoids it. Forwards metered by a
:class:`leantrain.runtime.ledger.SavedActivationMeter`, and packers with ``record=True``, always run
the full path.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections import Counter, defaultdict
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from leantrain.runtime.ledger import metering, note_saved
from leantrain.agoq.pack import TINY, PackBatch, Packed, dequantize_q, pack, unpack
from leantrain.agoq.policy import KEEP, Policy

__all__ = ["Packer", "Derived", "quantize_activations", "apply", "remove", "save", "load", "role_of_module"]

_QKV = ("q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value", "c_attn", "query", "key", "value")
_OUT = ("o_proj", "out_proj", "dense", "c_proj")
_MLP_IN = ("gate_proj", "up_proj", "gate_up_proj", "w1", "w3", "fc1", "c_fc")
_DOWN = ("down_proj", "w2", "fc2")
_HEAD = ("lm_head", "output", "head")


def _linear_like(m: nn.Module) -> bool:
    if isinstance(m, nn.Linear):
        return True
    w = getattr(m, "weight", None)
    return isinstance(w, Tensor) and w.dim() == 2 and not isinstance(m, nn.Embedding)


def role_of_module(name: str, m: nn.Module) -> str | None:
    """The role of tensors saved while ``m`` (named ``name``) runs, or None to inherit."""
    leaf = name.rsplit(".", 1)[-1]
    cls = type(m).__name__
    if _linear_like(m):
        if leaf in _QKV:
            return "qkv_in"
        if leaf in _OUT:
            return "o_in"
        if leaf in _MLP_IN:
            return "mlp_in"
        if leaf in _DOWN:
            return "down_in"
        if leaf in _HEAD:
            return "head_in"
        return "linear_in"
    if cls.endswith(("RMSNorm", "LayerNorm", "Norm")) or isinstance(m, nn.LayerNorm):
        return "norm"
    if "Attention" in cls:
        return "attn"
    if "MLP" in cls or "FeedForward" in cls:
        return "gate_up"
    return None


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


@dataclass
class ProbPacked:
    """A log-softmax stored as ``p = exp(logp)`` (``Packed``); unpacks to ``log(p)``.

    Log-softmax backward reads only ``exp(logp)``: rounding ``p`` stochastically keeps exactly
    that unbiased, and its error is absolute in ``p`` (largest where ``p`` is largest), where a
    grid on ``logp`` gives every probability the same relative error and, through ``exp``, a bias.
    """

    packed: Packed
    dtype: torch.dtype
    uses: int = 1  # backward nodes holding it (log-softmax and the NLL loss after it: 2)
    taken: int = 0
    cache: Tensor | None = None  # log(p), kept until the last of those nodes took it

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes

    def unpack(self) -> Tensor:
        """``log(p)``, computed once for all ``uses`` (each pass over the logits is a GiB at 1b)."""
        self.taken += 1
        more = self.taken % self.uses  # nodes of this backward still to take it (retain_graph: rounds)
        c = self.cache
        if c is not None:
            if not more:
                self.cache = None
            return c
        pk = self.packed  # (used by this object only)
        if pk.kind == "q":  # log in the dequantize pass
            out = dequantize_q(pk.payload, torch.float32, log=True).reshape(pk.shape)
        else:  # (2/3 bits: a new tensor, changed in place)
            out = unpack(pk).float().clamp_min_(TINY).log_()  # p = 0 -> -88, not -inf: exp() gives 1e-38
        out = out.to(self.dtype)
        if more:
            self.cache = out
        return out


def _is_log_softmax(t: Tensor) -> bool:
    """The output of log_softmax (cross-entropy saves it): its grad_fn is already set when saved."""
    return t.grad_fn is not None and type(t.grad_fn).__name__.startswith("LogSoftmaxBackward")


class Derived:
    """A saved tensor not stored at all: recomputed in backward by ``fn`` from other saves'
    packed copies (0 bytes held). ``silu``: SwiGLU's product saves ``silu(g)`` while SiLU's
    backward saves ``g``; AGoQ keeps ``g`` only and gives the product ``silu(ĝ)`` (SiLU's slope
    is within [-0.1, 1.1], so ``ĝ``'s error passes through at most 1.1×; the measured gradient
    error is lower than with ``silu(g)`` packed on its own: agoq/README.md). ``mul``: a product
    of two saves (the down projection's input ``silu(g)·u``, through the view ``F.linear`` takes
    of it) as ``silu(ĝ)·û``. ``uses``: the unpacks one backward will make. The result is
    computed once a backward, at the first of them, and kept until the last (:meth:`unpack`), so
    it unpacks each source once: the first consumer adds one use to every source below it, the
    others none."""

    __slots__ = ("fn", "srcs", "uses", "taken", "cache")
    nbytes = 0

    def __init__(self, fn, srcs: tuple):
        self.fn, self.srcs, self.uses, self.taken, self.cache = fn, srcs, 0, 0, None

    def add_use(self) -> None:
        self.uses += 1
        if self.uses == 1:
            for s in self.srcs:
                _add_use(s)

    def unpack(self) -> Tensor:
        """``fn`` of the sources, computed once for all ``uses`` of one backward (``silu(ĝ)``: the
        product's backward and the down projection's input both take it) and kept until the last
        of them took it (as :meth:`ProbPacked.unpack`)."""
        if self.uses <= 1:
            return self.fn(*(_unpack_any(s) for s in self.srcs))
        self.taken += 1
        more = self.taken % self.uses
        c = self.cache
        if c is None:
            c = self.fn(*(_unpack_any(s) for s in self.srcs))
            if more:
                self.cache = c
        elif not more:
            self.cache = None
        return c


def _add_use(obj) -> None:
    if isinstance(obj, Derived):
        obj.add_use()
    else:
        obj.uses += 1


def _mul(a: Tensor, b: Tensor) -> Tensor:
    return a * b


def _swiglu(g: Tensor, u: Tensor | None = None) -> Tensor:
    """SwiGLU's output from its saves (``model.fused_swiglu``): ``g`` and ``u``, or one tensor
    holding both as halves."""
    from leantrain.ops.swiglu import swiglu

    return swiglu(g, u)


class _Reshape:
    __slots__ = ("shape",)

    def __init__(self, shape):
        self.shape = shape

    def __call__(self, x: Tensor) -> Tensor:
        return x.reshape(self.shape)


# autograd node of a saved tensor -> (derivation name, its function of the node's inputs)
_DERIVE = {"SiluBackward0": ("silu", torch.nn.functional.silu), "MulBackward0": ("mul", _mul),
           "SwigluFnBackward": ("swiglu", _swiglu)}
# views of one input (F.linear flattens its input to 2-D: the down projection saves such a view)
_VIEWS = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"})


def _out_shape(how: str, srcs: list) -> torch.Size:
    """The shape a derivation gives from its sources' (one shape; SwiGLU over one tensor's halves:
    half its last dim)."""
    shape = srcs[0][1]
    return shape[:-1] + (shape[-1] // 2,) if how == "swiglu" and len(srcs) == 1 else shape


def _unpack_any(obj):
    if isinstance(obj, Packed):
        return unpack(obj)
    if isinstance(obj, (ProbPacked, Derived)):
        return obj.unpack()
    return obj


def _storage_ptr(t: Tensor) -> int:
    """The address of ``t``'s storage: its data pointer less its offset (``untyped_storage()``
    builds a Python object per call, on a hook that runs ~940 times a forward)."""
    try:
        return t.data_ptr() - t.storage_offset() * t.element_size()
    except (RuntimeError, NotImplementedError):
        return -id(t)


_local = threading.local()
_BITS_KEY = {b: f"bits{b}" for b in (1, 2, 3, 4, 8)}
_HALF = (torch.bfloat16, torch.float16)


def _active() -> list[Packer]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


class _Plan:
    """The saves of one recorded forward: a slot ``(shape, dtype, role, bits, prob, why, nbytes)``
    per save (``bits`` 0: kept for reason ``why``, ``nbytes`` reported for it; ``prob``: a
    log-softmax stored as probabilities), and the totals of the kept slots, added in bulk."""

    __slots__ = ("slots", "kept_stats", "kept_bytes")

    def __init__(self, slots: list[tuple], kept_stats: Counter, kept_bytes: dict[str, int]):
        self.slots, self.kept_stats, self.kept_bytes = slots, kept_stats, kept_bytes


def _signature(args: tuple, kwargs: dict) -> tuple:
    """What a forward's saves depend on, from its arguments: tensors by shape, dtype and device,
    anything else by value (its type if it cannot be hashed)."""
    def one(a):
        if isinstance(a, Tensor):
            return (a.shape, a.dtype, a.device)
        try:
            hash(a)
            return a
        except TypeError:
            return type(a)

    return (tuple(one(a) for a in args), tuple((k, one(v)) for k, v in sorted(kwargs.items())),
            torch.is_grad_enabled())


class Packer:
    """Packs saved activations of ``model`` by ``policy``; counts every decision in ``stats``.

    ``batch_devices`` / ``batch_backend``: where 4/8-bit saves go through :class:`PackBatch`
    (CUDA; tests add "cpu" with the Triton interpreter) and the ops backend the batches use.
    ``max_plans``: recorded forwards kept for replay (one per signature; see the module docstring).
    """

    batch_devices: tuple[str, ...] = ("cuda",)
    batch_backend: str = "auto"
    max_plans: int = 8

    def __init__(self, model: nn.Module, policy: Policy | None = None, *, stage: int = 0,
                 record: bool = False):
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
        self._root_handles: list = []  # apply's enter / leave hooks
        self._dedup: dict = {}
        self._static: set[int] = set()
        self._n = 0
        self._salt = next(_PACKERS)
        self._base_seed = _mix(self.policy.seed, self._salt)  # tensor n: base + n * golden (mod 2**63)
        # open batches by (symmetry, word path): 4-bit 16-bit floats apart from the rest (8-bit, fp32),
        # so each flush is one launch of one compiled path (a mixed batch launched two); each
        # batch's waiting bytes: when they sum to policy.batch_mib, the fullest batch is flushed
        self._batches: dict[tuple[bool, bool], PackBatch] = {}
        self._waiting: dict[tuple[bool, bool], int] = {}
        self._modules: list[nn.Module] | None = None
        self._bits: dict[str, int] = {}
        self._ctx = None
        self._plans: dict[tuple, _Plan] = {}  # signature -> recorded forward
        self._replay: _Plan | None = None  # the plan this forward follows
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

    def begin(self, plan: _Plan | None = None, sig: tuple | None = None) -> None:
        """Start of a forward: clear the dedup table; replay ``plan``, or record one under ``sig``
        (None: neither), else refresh the storages of parameters and buffers.

        The module list is walked once (``named_modules`` recursion costs ~1 ms a forward on a
        1b model); each forward re-reads the modules' parameter and buffer dicts, so replaced
        tensors are seen."""
        self._dedup.clear()
        self._by_node.clear()
        self._slot_of.clear()
        self._objs = [None] * len(plan.slots) if plan is not None else []
        self._derive = frozenset(x for x in self.policy.derive.split(",") if x)
        self._bits = {}  # role -> bits this forward (the policy may have been changed between forwards)
        self._replay, self._i, self._sig = plan, 0, sig
        self._trace = [] if plan is None and sig is not None else None
        if self._trace is not None:
            self._trace_kept, self._trace_bytes = Counter(), defaultdict(int)
        if plan is None:
            self._refresh_static()

    def _refresh_static(self) -> None:
        if self._modules is None:
            self._modules = list(self.model.modules())
        self._static = {_storage_ptr(t) for m in self._modules
                        for d in (m._parameters, m._buffers) for t in d.values() if t is not None}

    def end(self, ok: bool = True) -> None:
        """End of a forward: flush; count a replayed forward's kept slots, or store the recorded plan."""
        try:
            self.flush()
        finally:
            self._dedup.clear()
            self._by_node.clear()
            self._slot_of.clear()
            self._objs = []
            plan, trace = self._replay, self._trace
            self._replay = self._trace = None
            if plan is not None:
                whole = self._i == len(plan.slots)
                self._count_prefix(plan, self._i, whole)
                if not whole:  # fewer saves than recorded: a departure too
                    self.stats["replay:diverged"] += 1
                    self._plans.pop(self._sig, None)
            elif trace is not None and ok:
                if len(self._plans) >= self.max_plans:
                    self._plans.pop(next(iter(self._plans)))
                self._plans[self._sig] = _Plan(trace, self._trace_kept, dict(self._trace_bytes))

    def _count_prefix(self, plan: _Plan, n: int, whole: bool) -> None:
        """Add what the first ``n`` replayed slots kept to ``stats`` and the byte counts."""
        if whole:
            self.stats.update(plan.kept_stats)
            for role, nb in plan.kept_bytes.items():
                self.bytes_raw[role] += nb
                self.bytes_kept[role] += nb
            return
        self.stats["saved"] += n
        for _shape, _dtype, role, bits, _prob, why, nb in plan.slots[:n]:
            if not bits:
                self.stats["kept:" + why] += 1
                self.bytes_raw[role] += nb
                self.bytes_kept[role] += nb

    def _diverge(self) -> None:
        """The forward departed from its plan: count the replayed prefix, drop the plan, and take
        the full path with the base role ``other`` for the rest of the forward."""
        plan, self._replay = self._replay, None
        self._count_prefix(plan, self._i, whole=False)
        self.stats["replay:diverged"] += 1
        self._plans.pop(self._sig, None)
        self._roles.clear()
        self._base_role = "other"
        self._refresh_static()

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
        _active().append(self)

    def close(self, ok: bool = True) -> None:
        _active().remove(self)
        ctx, self._ctx = self._ctx, None
        ctx.__exit__(None, None, None)
        self.end(ok)

    def _keep(self, t: Tensor, reason: str, role: str, report: bool = True, sp: int | None = None):
        self.stats["kept:" + reason] += 1
        nb = 0
        if report:
            key = ("raw", str(t.device), _storage_ptr(t) if sp is None else sp)
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
        if (_storage_ptr(t) if sp is None else sp) in self._static:  # (pack_hook takes weights and their views first)
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
                            and (not prob or _is_log_softmax(t)):
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
        sp = _storage_ptr(t)
        decision, bits = self.classify(t, role, explicit, sp)
        if decision != "pack":
            return self._keep(t, decision[5:], role, report=decision != "keep:param", sp=sp)
        prob = role == "logits" and self.policy.logits_format == "prob" and _is_log_softmax(t)
        if self._trace is not None:
            self._trace.append((t.shape, t.dtype, role, bits, prob, "", 0))
            self._trace_kept["saved"] += 1
        return self._store(t, role, bits, prob, base, sp)

    def _store(self, t: Tensor, role: str, bits: int, prob: bool, base: Tensor | None, sp: int | None = None):
        """Pack ``t`` (``role``, ``bits``; ``prob``: as probabilities), or share the packed copy
        of the same tensor saved earlier in this forward."""
        stats = self.stats
        key = (_storage_ptr(t) if sp is None else sp, t.storage_offset(), t.shape, t.stride(), t.dtype, t._version)
        hit = self._dedup.get(key)
        if hit is not None and hit[0]() is not None:  # the owner alive: storage not reused
            stats["dedup"] += 1
            if self.record:
                self.log.append({"role": role, "shape": tuple(t.shape), "dtype": str(t.dtype), "bits": bits, "why": "dedup"})
            _add_use(hit[1])  # one more backward node unpacks it: dequantized (log(p) taken) once for all
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

    def _derived(self, t: Tensor, gf) -> Derived | None:
        """A :class:`Derived` for ``t`` when the policy recomputes it (``policy.derive``) from saves
        already made in this forward: ``t`` is the output of SiLU (``silu``) or of a product
        (``mul``), or a view of one, whose inputs are such saves, or outputs derivable in turn
        (``t``'s dtype; a product's inputs of its shape). None otherwise (``t`` is then packed)."""
        name = type(gf).__name__
        if name in _VIEWS:
            if not t.is_contiguous():
                return None
            (node, nr), = gf.next_functions
            src = self._source(node, nr, t.dtype, t.numel(), 1)
            return None if src is None else Derived(_Reshape(t.shape), (src[0],))
        how = _DERIVE.get(name)
        if how is None or how[0] not in self._derive:
            return None
        srcs = self._sources(gf, how[0], t.dtype, t.numel(), 1)
        if srcs is None or _out_shape(how[0], srcs) != t.shape:
            return None
        return Derived(how[1], tuple(x[0] for x in srcs))

    def _sources(self, node, how: str, dtype, numel: int, depth: int) -> list | None:
        """(save, shape) of each input of the derivable ``node`` (derivation ``how``) whose output
        has ``numel`` elements (one input of twice as many for a SwiGLU over one tensor's halves)."""
        nxt = node.next_functions
        n_in = numel * 2 if how == "swiglu" and len(nxt) == 1 else numel
        srcs = [self._source(n, k, dtype, n_in, depth) for n, k in nxt]
        return None if any(x is None for x in srcs) or len({x[1] for x in srcs}) != 1 else srcs

    def _source(self, node, nr: int, dtype, numel: int, depth: int) -> tuple | None:
        """(save, shape): the packed or derived save giving output ``nr`` of autograd ``node``,
        made derivable here if the policy allows (registered, so later saves share it)."""
        if node is None:
            return None
        hit = self._by_node.get((id(node), nr))
        if hit is not None:
            ok = hit[0] is node and hit[3] == dtype and hit[2].numel() == numel
            return (hit[1], hit[2]) if ok else None
        how = _DERIVE.get(type(node).__name__)
        if how is None or how[0] not in self._derive or depth > 2:
            return None
        srcs = self._sources(node, how[0], dtype, numel, depth + 1)
        if srcs is None:
            return None
        d, shape = Derived(how[1], tuple(x[0] for x in srcs)), _out_shape(how[0], srcs)
        self._by_node[(id(node), nr)] = (node, d, shape, dtype)
        return d, shape

    def _recipe(self, d: Derived) -> tuple:
        """How to rebuild ``d`` from saves of a forward with the same plan: ``(fn, parts)`` with a
        part ``("slot", i)`` for a save of slot ``i`` and a nested recipe for an intermediate."""
        return (d.fn, tuple(("slot", self._slot_of[id(s)]) if id(s) in self._slot_of else self._recipe(s)
                            for s in d.srcs))

    def _rebuild(self, recipe: tuple) -> Derived | None:
        fn, parts = recipe
        srcs = []
        for part in parts:
            src = self._objs[part[1]] if part[0] == "slot" else self._rebuild(part)
            if src is None:  # (a source slot this forward did not pack: take the full path)
                return None
            srcs.append(src)
        return Derived(fn, tuple(srcs))

    def _store_derived(self, t: Tensor, role: str, base: Tensor | None, d: Derived, key: tuple | None = None) -> Derived:
        d.add_use()
        if key is None:
            key = (_storage_ptr(t), t.storage_offset(), t.shape, t.stride(), t.dtype, t._version)
        self._dedup[key] = (weakref.ref(t if base is None else base), d)
        nb = t.numel() * t.element_size()
        self.stats["derived"] += 1
        self.derived_numel[role] += t.numel()
        self.bytes_raw[role] += nb
        note_saved(0, ("agoq", id(d)), role)
        if self.record:
            self.log.append({"role": role, "shape": tuple(t.shape), "dtype": str(t.dtype), "bits": 0, "why": "derived"})
        return d

    @staticmethod
    def unpack_hook(obj):
        return _unpack_any(obj)

    def summary(self) -> dict:
        raw, kept = sum(self.bytes_raw.values()), sum(self.bytes_kept.values())
        return {"stats": dict(self.stats), "bytes_raw": raw, "bytes_kept": kept,
                "ratio": kept / raw if raw else 0.0,
                "by_role": {r: {"raw": self.bytes_raw[r], "kept": self.bytes_kept[r]} for r in self.bytes_raw}}


@contextlib.contextmanager
def quantize_activations(model: nn.Module, policy: Policy | None = None, *, stage: int = 0,
                         record: bool = False):
    """Within the context, every activation ``model``'s forward saves is packed by ``policy``.

    Yields the :class:`Packer` (its ``stats`` count every saved tensor and its fate).
    The backward may run after the context closes. (No replay: a packer per forward.)
    """
    pk = Packer(model, policy, stage=stage, record=record)
    pk.install()
    try:
        with pk:
            yield pk
    finally:
        pk.remove()


def apply(model: nn.Module, policy: Policy | None = None, *, stage: int = 0, replay: bool = True) -> Packer:
    """Persistent AGoQ: every forward of ``model`` packs what it saves. Undo with :func:`remove`.

    The hooks open at the start of ``model.forward`` and close at its end, so a loss computed
    outside the model's forward is not packed (leantrain's Llama computes it inside). The
    model's own role (``logits``: the loss) is the base role. ``replay``: forwards with a
    signature seen before follow its recorded plan without the role hooks (module docstring).
    """
    remove(model)
    pk = Packer(model, policy, stage=stage)

    def _enter(mod, args, kwargs):
        sig = None
        if replay:
            sig = (_signature(args, kwargs), mod.training, pk.stage, tuple(vars(pk.policy).values()))
        pk._roles.clear()
        pk._base_role = "logits"
        pk.open(sig)
        if pk._replay is not None:
            pk.remove()  # role hooks: not needed to follow a plan
        elif not pk._handles:
            pk.install(root=False)  # (this hook runs before the children: they see their roles)
        # (a pre-hook's return value would replace the forward's arguments)

    def _leave(mod, args, out):
        pk.close(ok=out is not None)  # (None: the forward raised; its partial trace is not kept)

    pk.install(root=False)
    pk._root_handles = [model.register_forward_pre_hook(_enter, with_kwargs=True),
                        model.register_forward_hook(_leave, always_call=True)]
    model._agoq_packer = pk
    return pk


def remove(model: nn.Module) -> None:
    """Undo :func:`apply` (no-op when AGoQ is not applied)."""
    pk = model.__dict__.pop("_agoq_packer", None)
    if pk is not None:
        pk.remove()
        for h in pk._root_handles:
            h.remove()
        pk._root_handles.clear()


def save(t: Tensor):
    """Pack ``t`` through the active AGoQ packer (for tensors kept on ``ctx`` as attributes)."""
    st = _active()
    return st[-1].pack_hook(t, explicit=True) if st else t


def load(obj) -> Tensor:
    """The tensor :func:`save` packed (identity for a tensor that was not packed)."""
    return _unpack_any(obj)

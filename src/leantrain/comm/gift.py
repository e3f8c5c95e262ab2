"""GIFT: the data-parallel gradient all-reduce in FP8 or NVFP4, in K-FAC-whitened coordinates.

A linear layer ``y = x Wᵀ`` has the K-FAC factors ``A = E[x xᵀ]`` (``K x K``, its inputs) and
``B = E[δ δᵀ]`` (``N x N``, the gradients of its outputs). FP8 quantization of the raw gradient
``G`` (``N x K``) spends its few mantissa bits the same way on every coordinate, and the
coordinates of ``G`` are far from isotropic. GIFT sends the whitened gradient instead and maps the
sum back:

    G̃ = B^{-1/2} G A^{-1/2}    (each rank, its own gradient)
    Σ G̃  through the FP8 all-reduce below
    Ĝ = B^{1/2} (Σ G̃) A^{1/2}

The map is linear, so summing in the whitened space is exact as long as every rank uses the same
factors. The quantization error is then spread evenly in the geometry that K-FAC gives the loss:
in that metric, ``‖B^{-1/2} (Ĝ - G) A^{-1/2}‖``, it is FP8's rounding of a near-isotropic tensor, where
Euclidean FP8's error is amplified along the directions of low curvature. This is the "distortion"
that GIFT reduces; in the Euclidean metric its error is larger (``results/gift_2026-12-03_cpu.md``).

**The factors.** Every ``refresh_every`` steps, each layer's input and output-gradient statistics
are taken on that step by the layer's *root* rank (layer ``i``'s root is rank ``i mod n``: the
eigendecompositions are spread over the ranks). The root keeps an EMA of them and takes the top
``rank`` eigenpairs, with the rest of the spectrum replaced by its mean ``σ`` (from the trace:
``A ≈ U diag(s) Uᵀ + σ (I - U Uᵀ)``). On a factor much larger than ``rank`` the eigenpairs come from
:func:`top_eigenpairs_batched`, a subspace iteration warm-started from the basis in use and batched
over the root's factors of one size (``O(dim² rank)``, where the full ``torch.linalg.eigh``, used on
small factors, is ``O(dim³)``). It damps both by ``damping`` times the mean eigenvalue and
broadcasts ``U``, ``s`` and ``σ``. Every rank then builds the same transforms from the same
numbers: the whitened sum maps back exactly, and the factors' traffic is ``(K + N) · rank`` floats
a layer per refresh, not ``K² + N²``. Between refreshes the factors are stale; that costs precision,
never correctness. Applying them costs ``4 · N · K · rank`` multiply-adds a layer and step, run
for the layers of one weight shape at once (``comm/gift_transforms.py``: batched products on a stack of
their gradients, the buffer the all-reduce then sends), in ``transform_dtype`` (fp32 by default; TF32
or bf16 products are cheaper: the map back is still the inverse of the map out as applied, with the
bases as rounded, and only the products' rounding of the gradients adds error).

**Which layers** (the selection "where it pays"): ``nn.Linear`` weights with at least ``min_numel``
elements (not subclasses with their own forward, such as the model's LM head that returns the loss).
Everything else (norms, embeddings, small layers, biases) goes through the same FP8
all-reduce in its own coordinates, i.e. Euclidean FP8. With ``min_gain``, a layer whose root estimates
at a refresh that whitening gains less than that (:meth:`GIFT._gain`) is sent Euclidean until the next.

**The FP8 all-reduce** (:func:`fp8_all_reduce`) is AGoQ's two-phase scheme (``int8_allreduce.py``)
with an E4M3 codec: the padded tensor is cut into ``n`` chunks. Blocks of ``block`` elements are
scaled to E4M3's range (absmax → 448, one fp32 scale a block) and rounded to nearest even
(``ops.quantize_fp8``: Triton on CUDA). An all-to-all sends chunk ``i`` to rank ``i``. The owner adds
its own chunk unquantized, sums in fp32, requantizes once and all-gathers. All ranks end with the
same bytes. Bytes sent, counted by :mod:`leantrain.runtime.collectives`: ``(1 + 4 / block) / 2`` of a bf16 all-reduce (0.502 at the default
``block = 1024``) plus padding, plus the factors' broadcasts on refresh steps.

**4 bits** (``format="nvfp4"``, ``comm/fp4.py``): the same all-reduce with NVFP4 messages (E2M1
codes, E4M3 scales of 16 elements, an fp32 scale per 4096; stochastic rounding): ``0.282`` of bf16's
bytes. Whitening matters more there: E2M1 has one mantissa bit.

Use::

    gift = lt.comm.GIFT(model)           # after the process group is up; before the first forward
    loss.backward()
    gift.reduce_gradients()              # averages every gradient over the group (instead of DDP): the
                                         # whitened layers a shape at a time, the rest in model order
    opt.step()

:meth:`GIFT.errors` measures, on the gradients at hand, the relative error of GIFT and of Euclidean
FP8 against the exact average in both metrics; ``benchmarks/bench_gift.py`` reports it on a real model.
"""

from __future__ import annotations

from itertools import groupby

import torch
import torch.distributed as dist
from torch import Tensor, nn

from leantrain.comm.fp4 import GROUP as FP4_GROUP
from leantrain.comm.fp4 import nvfp4_all_reduce
from leantrain.comm.gift_transforms import TRANSFORM_DTYPES, TransformGroup, _Side, _tf32
from leantrain.comm.int8_allreduce import two_phase_all_reduce
from leantrain.ops import QTensor, dequantize_fp8, dequantize_nvfp4, quantize_fp8, quantize_nvfp4
from leantrain.runtime import collectives as C

__all__ = ["GIFT", "fp8_all_reduce", "fp8_dequantize", "fp8_quantize", "top_eigenpairs"]


def fp8_quantize(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """``x`` (fp32, ``numel`` a multiple of ``block``) -> E4M3 codes as uint8 ``[numel]`` and one fp32
    scale a block ``[numel / block]`` (absmax / 448): ``ops.quantize_fp8`` (Triton on CUDA), round to
    nearest even; a block holding a non-finite value gets a NaN scale, so it decodes as NaN (the
    optimizer's checks see it)."""
    q = quantize_fp8(x, fmt="e4m3", group_size=block, nonfinite="nan")
    return q.data, q.scale


def fp8_dequantize(codes: Tensor, scale: Tensor, block: int) -> Tensor:
    """Inverse of :func:`fp8_quantize`: fp32 ``[numel]``."""
    n = codes.numel()
    return dequantize_fp8(QTensor(codes, scale, None, torch.Size([n]), torch.float32, 8, block, True, "e4m3"))


def fp8_all_reduce(tensor: Tensor, group=None, *, block: int = 1024, average: bool = False,
                   scope: str = "world") -> Tensor:
    """All-reduce ``tensor`` in place through FP8 E4M3 (the module doc's two phases, AGoQ's
    ``two_phase_all_reduce`` with this codec); returns it. ``average`` divides the sum by the number of ranks."""
    if block < 1:
        raise ValueError(f"fp8_all_reduce: block must be >= 1, got {block}")

    def encode(x, k, phase):  # k messages of codes + scale bytes: uint8 (k, C + 4 C / block)
        codes, scale = fp8_quantize(x, block)
        return torch.cat([codes.view(k, -1), scale.contiguous().view(k, -1).view(torch.uint8)], 1)

    def decode(buf, chunk):
        codes = buf[:, :chunk].contiguous().reshape(-1)
        scale = buf[:, chunk:].contiguous().view(torch.float32).reshape(-1)
        return fp8_dequantize(codes, scale, block).view(buf.shape[0], chunk)

    return two_phase_all_reduce(tensor, group, block=block, encode=encode, decode=decode, average=average,
                                scope=scope)


_OVERSAMPLE = 16  # extra columns of the subspace iteration


def _orthonormalize(y: Tensor) -> Tensor:
    """Orthonormal columns spanning those of ``y`` (fp64, batched ``(b, d, k)``): CholeskyQR2, two rounds of
    ``y ← y R⁻¹`` with ``Rᵀ R = yᵀ y`` (products, a ``k x k`` Cholesky and a triangular solve, which batch
    well on a GPU); Householder QR when a Gram matrix is not positive definite or ``y`` is too ill-conditioned
    for it (a Cholesky diagonal below ``1e-7`` of the largest: CholeskyQR2 is accurate up to about ``1e8``)."""
    for _ in range(2):
        low, info = torch.linalg.cholesky_ex(y.mT @ y)
        diag = low.diagonal(dim1=-2, dim2=-1).abs()
        if bool((info != 0).any() or (diag.amin(-1) < 1e-7 * diag.amax(-1)).any()):
            return torch.linalg.qr(y).Q
        y = torch.linalg.solve_triangular(low.mT, y, upper=True, left=False)
    return y


def top_eigenpairs(f: Tensor, r: int, *, warm: Tensor | None = None, seed: int = 0,
                   iters: int | None = None) -> tuple[Tensor, Tensor]:
    """The ``r`` largest eigenvalues (descending, fp64) and their eigenvectors ``(dim, r)`` of the
    symmetric PSD ``f``: :func:`top_eigenpairs_batched` of one factor."""
    s, u = top_eigenpairs_batched([f], r, warm=[warm], seeds=[seed], iters=iters)
    return s[0], u[0]


def top_eigenpairs_batched(fs: list[Tensor], r: int, *, warm: list[Tensor | None] | None = None,
                           seeds: list[int] | None = None, iters: int | None = None) -> tuple[Tensor, Tensor]:
    """Top-``r`` eigenpairs of several symmetric PSD factors of one size, by subspace iteration with
    Rayleigh-Ritz: ``r + 16`` columns a factor (its ``warm`` basis, then Gaussian ones from its seed, on
    its device), ``iters`` products with the factor and an orthonormalization each (default 3 when every
    factor is warm-started, else 8), then the eigenpairs of ``Qᵀ f Q`` (``(r + 16)²``, on the CPU: small
    symmetric eigenproblems are latency-bound on a GPU). The products with ``f`` run in its dtype (fp32
    factors are not copied to fp64); the bases and the small problems in fp64, batched over the factors.
    Returns values ``(b, r)`` and orthonormal vectors ``(b, dim, r)``; the values are Ritz values (each at
    most the true one).
    Costs ``O(dim² r)`` a product where ``eigh`` costs ``O(dim³)``."""
    dim = fs[0].shape[0]
    if any(f.shape != (dim, dim) for f in fs):
        raise ValueError(f"top_eigenpairs_batched: factors of one square shape, got {[tuple(f.shape) for f in fs]}")
    warm = warm or [None] * len(fs)
    seeds = seeds or list(range(len(fs)))
    k = min(dim, r + _OVERSAMPLE)
    qs = []
    for f, w, sd in zip(fs, warm, seeds):
        have = 0 if w is None else min(k, w.shape[1])
        rnd = torch.randn(dim, k - have, generator=torch.Generator(f.device).manual_seed(sd % (1 << 63)),
                          device=f.device, dtype=torch.float64)
        qs.append(rnd if w is None else torch.cat([w[:, :have].to(rnd), rnd], 1))
    if iters is None:
        iters = 3 if all(w is not None for w in warm) else 8

    def product(q):  # f_i @ q_i, each in its factor's dtype, stacked in fp64
        return torch.stack([(f @ qi.to(f.dtype)).double() for f, qi in zip(fs, q)])

    q = _orthonormalize(torch.stack(qs))
    for _ in range(iters):
        q = _orthonormalize(product(q))
    t = q.mT @ product(q)
    s, v = torch.linalg.eigh(((t + t.mT) / 2).cpu())
    s, v = s.to(q.device), v.to(q.device)
    return s.flip(-1)[..., :r].clamp_min(0), q @ v.flip(-1)[..., :r]


class _Layer:
    def __init__(self, name: str, mod: nn.Linear, index: int, root: int, group: TransformGroup):
        self.name, self.mod, self.index, self.root, self.group = name, mod, index, root, group
        self.a_ema: Tensor | None = None  # (root only) EMA of E[x xᵀ]
        self.b_ema: Tensor | None = None  # (root only) EMA of E[δ δᵀ]
        self.a_new: Tensor | None = None  # this refresh step's sums and token counts
        self.b_new: Tensor | None = None
        self.na = self.nb = 0
        self.A: _Side | None = None  # the factors every rank uses
        self.B: _Side | None = None
        self.slot = -1  # its place in its group's stacks (set by the group's rebuild)
        self.euclidean = False  # its root measured too small a gain at the last refresh (``min_gain``)

    @property
    def ready(self) -> bool:
        return self.A is not None

    def _apply(self, g: Tensor, inverse: bool) -> Tensor:
        x = g.to(torch.float32, copy=True)
        self.group.apply([self.slot], x[None], inverse)
        return x

    def whiten(self, g: Tensor) -> Tensor:
        """``B^{-1/2} g A^{-1/2}`` (a new fp32 tensor), through the batched transforms GIFT sends with."""
        return self._apply(g, True)

    def unwhiten(self, g: Tensor) -> Tensor:
        """The map back: the exact inverse of :meth:`whiten` (``gift_transforms``' module doc)."""
        return self._apply(g, False)


class GIFT:
    """FP8 gradient all-reduce in K-FAC-whitened coordinates for a data-parallel ``model`` (module
    doc). Call :meth:`reduce_gradients` after each backward instead of DDP's reduction.

    ``rank``: eigenpairs kept a factor (``None``: full rank); ``refresh_every``: steps between factor refreshes
    (statistics are taken on the refresh steps only); ``ema``: the roots' EMA of the statistics across
    refreshes; ``damping``: added to each factor, times its mean eigenvalue; ``min_numel``: the smallest
    ``nn.Linear`` weight sent whitened; ``block``: elements per FP8 scale; ``whiten=False``: the same FP8
    all-reduce in Euclidean coordinates (the baseline); ``bucket_numel``: elements a bucket, one FP8 all-reduce
    each (a chunk of whitened layers of one shape, or consecutive other parameters). ``format="nvfp4"``: the
    all-reduce in NVFP4-style 4-bit (``comm/fp4.py``, block 16; ``block`` is then unused), with stochastic
    rounding unless ``stochastic=False`` (seeded by the step and bucket: a resumed run rounds as the
    uninterrupted one). ``solver``: how the roots find the top eigenpairs (``"auto"``: subspace iteration on a
    factor with ``rank + 16 <= dim / 4``, else the full ``eigh``). ``tf32``: on CUDA, the statistics' products
    (``x xᵀ``, ``δ δᵀ``) in TF32 (the factors they estimate are damped and averaged). ``transform_dtype``: the
    precision of the whitening transforms' products with the gradients, ``"float32"``, ``"tfloat32"`` or
    ``"bfloat16"`` (``comm/gift_transforms.py``; in each the map back inverts the map out as applied).
    ``min_gain``: on each refresh a layer's root estimates the gain of whitening, Euclidean error / GIFT's error
    in the K-FAC metric, from one pass of its own gradient through the wire codec (:meth:`_gain`); a layer below
    ``min_gain`` is sent Euclidean until the next refresh (the root's decision is broadcast with the factors:
    every rank agrees). ``0``: every layer whitened. ``stat_tokens``: the most tokens (rows) a layer's
    statistics take from one forward or backward, evenly strided (``0``: all): ``δ δᵀ`` of a wide layer costs
    ``tokens · n²``, more than the step's own products (on the 1b, 1024 of 4096 tokens barely change the gains:
    docs/gift.md)."""

    def __init__(self, model: nn.Module, group=None, *, rank: int | None = 64, refresh_every: int = 10,
                 ema: float = 0.95, damping: float = 1e-3, min_numel: int = 1 << 14, block: int = 1024,
                 whiten: bool = True, bucket_numel: int = 1 << 25, format: str = "e4m3",
                 stochastic: bool = True, solver: str = "auto", tf32: bool = True, scope: str = "world",
                 transform_dtype: str = "float32", min_gain: float = 0.0, stat_tokens: int = 0):
        if format not in ("e4m3", "nvfp4"):
            raise ValueError(f"GIFT: format must be 'e4m3' or 'nvfp4', got {format!r}")
        if solver not in ("auto", "eigh", "subspace"):
            raise ValueError(f"GIFT: solver must be 'auto', 'eigh' or 'subspace', got {solver!r}")
        if refresh_every < 1:
            raise ValueError(f"GIFT: refresh_every must be >= 1, got {refresh_every}")
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"GIFT: ema must be in [0, 1), got {ema}")
        if damping <= 0:
            raise ValueError(f"GIFT: damping must be > 0 (the factors are inverted), got {damping}")
        if transform_dtype not in TRANSFORM_DTYPES:
            raise ValueError(f"GIFT: transform_dtype must be one of {TRANSFORM_DTYPES}, got {transform_dtype!r}")
        if min_gain < 0:
            raise ValueError(f"GIFT: min_gain must be >= 0 (0: every layer whitened), got {min_gain}")
        if stat_tokens < 0:
            raise ValueError(f"GIFT: stat_tokens must be >= 0 (0: every token), got {stat_tokens}")
        if rank is not None and rank < 1:
            raise ValueError(f"GIFT: rank must be >= 1 or None (full rank), got {rank}")
        self.group, self.rank, self.refresh_every, self.ema = group, rank, refresh_every, ema
        self.damping, self.block, self.whiten, self.scope = damping, block, whiten, scope
        self.bucket_numel, self.format, self.stochastic, self.solver = bucket_numel, format, stochastic, solver
        self.tf32, self.transform_dtype, self.min_gain = tf32, transform_dtype, min_gain
        self.stat_tokens = stat_tokens
        self.world = C.world_size(group) if dist.is_available() and dist.is_initialized() else 1
        self.me = C.rank(group) if self.world > 1 else 0
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.layers: dict[int, _Layer] = {}  # id(weight) -> layer
        self.groups: dict[tuple[int, int], TransformGroup] = {}  # weight shape -> its layers' transforms
        self.steps = 0
        self._hooks = []
        if whiten:
            # (a subclass with its own forward, e.g. the model's LMHead that returns the loss, has no outputs
            # to take B from: it stays Euclidean)
            mods = [(n, m) for n, m in model.named_modules()
                    if isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward
                    and m.weight.requires_grad and m.weight.numel() >= min_numel]
            for i, (name, mod) in enumerate(mods):
                if id(mod.weight) in self.layers:  # (a weight shared by two layers: the first one's factors)
                    continue
                shape = tuple(mod.weight.shape)
                if shape not in self.groups:
                    self.groups[shape] = TransformGroup(*shape, dtype=transform_dtype)
                layer = _Layer(name, mod, index=i, root=i % self.world, group=self.groups[shape])
                self.layers[id(mod.weight)] = layer
                self._hooks.append(mod.register_forward_hook(self._forward_hook(layer)))

    # ------------------------------------------------------------------ statistics

    @property
    def _collect(self) -> bool:
        """Whether this step is a refresh step: its forward and backward take statistics."""
        return self.steps % self.refresh_every == 0

    def _forward_hook(self, layer: _Layer):
        def hook(mod, inputs, out):
            if not (self._collect and layer.root == self.me and torch.is_grad_enabled() and mod.training
                    and isinstance(out, Tensor) and out.shape[-1:] == (mod.out_features,)):
                return
            x = self._rows(inputs[0].detach().reshape(-1, inputs[0].shape[-1])).float()
            with _tf32(self.tf32):
                a = x.t() @ x
            layer.a_new = a if layer.a_new is None else layer.a_new + a
            layer.na += x.shape[0]
            if out.requires_grad:
                def grad_hook(g):
                    g = self._rows(g.detach().reshape(-1, g.shape[-1])).float()
                    with _tf32(self.tf32):
                        b = g.t() @ g
                    layer.b_new = b if layer.b_new is None else layer.b_new + b
                    layer.nb += g.shape[0]
                out.register_hook(grad_hook)
        return hook

    def _rows(self, t: Tensor) -> Tensor:
        """At most ``stat_tokens`` rows of ``t``, evenly strided (all of them when ``stat_tokens`` is 0)."""
        n = t.shape[0]
        if not self.stat_tokens or n <= self.stat_tokens:
            return t
        return t[::-(-n // self.stat_tokens)]

    def remove(self) -> None:
        """Remove the statistics hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # ------------------------------------------------------------------ factors

    def _decompose(self, fs: list[Tensor], warms: list, seeds: list[int]) -> list[tuple[Tensor, Tensor, float, float]]:
        """For factors of one size: each one's top eigenpairs, the mean of the rest of its spectrum (from the
        trace) and its damping (times the mean eigenvalue). Low rank on a large factor (``solver="auto"``:
        ``rank + 16 <= dim / 4``): :func:`top_eigenpairs_batched`, warm-started from the bases in use;
        otherwise the full ``eigh`` in fp64, one factor at a time."""
        dim = fs[0].shape[0]
        r = dim if self.rank is None else min(self.rank, dim)
        traces = [float(f.diagonal().double().sum()) for f in fs]
        if self.solver == "subspace" or (self.solver == "auto" and r < dim and r + _OVERSAMPLE <= dim // 4):
            vals, vecs = top_eigenpairs_batched(fs, r, warm=warms, seeds=seeds)
        else:
            pairs = [torch.linalg.eigh(f.double()) for f in fs]
            vals = [v.clamp_min(0).flip(0)[:r] for v, _ in pairs]
            vecs = [u.flip(1)[:, :r] for _, u in pairs]
        out = []
        for tr, sv, u in zip(traces, vals, vecs):
            sigma = max(tr - float(sv.sum()), 0.0) / (dim - r) if r < dim else 0.0
            out.append((u.float().contiguous(), sv.float().contiguous(), sigma, self.damping * tr / dim + 1e-30))
        return out

    def _refresh_all(self, layers: list[_Layer]) -> None:
        """Each root folds this step's statistics of its layers into their EMAs and decomposes all their
        factors (batched by size); then, layer by layer in model order, the root broadcasts the layer's
        factors and every rank builds the same transforms from them (every rank runs the same broadcasts
        in the same order: they pair up)."""
        mine = [la for la in layers if la.root == self.me and la.na and la.nb]
        jobs = []  # (layer, side 0 = A / 1 = B, factor, warm basis, seed)
        for la in mine:
            a, b = la.a_new / la.na, la.b_new / la.nb
            if la.a_ema is None:
                la.a_ema, la.b_ema = a, b
            else:
                la.a_ema.mul_(self.ema).add_(a, alpha=1 - self.ema)
                la.b_ema.mul_(self.ema).add_(b, alpha=1 - self.ema)
            for j, (f, side) in enumerate(((la.a_ema, la.A), (la.b_ema, la.B))):
                jobs.append((la, j, f, None if side is None else side.u, (self.steps * 1_000_003 + la.index) * 2 + j))
        done = {}
        jobs.sort(key=lambda jb: jb[2].shape[0])
        for _, group in groupby(jobs, key=lambda jb: jb[2].shape[0]):
            group = list(group)
            res = self._decompose([jb[2] for jb in group], [jb[3] for jb in group], [jb[4] for jb in group])
            done.update({(id(jb[0]), jb[1]): rs for jb, rs in zip(group, res)})
        for la in layers:
            n_, k_ = la.mod.weight.shape
            ra = k_ if self.rank is None else min(self.rank, k_)
            rb = n_ if self.rank is None else min(self.rank, n_)
            # [have, U_A, s_A, σ_A, λ_A, U_B, s_B, σ_B, λ_B]: one broadcast a layer
            buf = torch.zeros(1 + k_ * ra + ra + 2 + n_ * rb + rb + 2, device=la.mod.weight.device)
            if (id(la), 0) in done:
                parts = [torch.full((1,), 2.0 if self._euclidean(la, done) else 1.0, device=buf.device)]
                for j in (0, 1):
                    u, sv, sigma, lam = done[(id(la), j)]
                    parts += [u.reshape(-1), sv, torch.tensor([sigma, lam], device=buf.device)]
                buf.copy_(torch.cat(parts))
            la.a_new = la.b_new = None
            la.na = la.nb = 0
            if self.world > 1:
                C.broadcast(buf, self._global_rank(la.root), group=self.group, scope=self.scope)
            flag = buf[0].item()  # 0: the root saw no statistics (the old factors stay); 1: whiten; 2: Euclidean
            if not flag:
                continue
            la.euclidean = flag == 2
            o = 1
            sides = []
            for dim, r in ((k_, ra), (n_, rb)):
                u = buf[o:o + dim * r].view(dim, r)
                o += dim * r
                sv = buf[o:o + r]
                o += r
                sigma, lam = buf[o:o + 2].tolist()
                o += 2
                sides.append(_Side(u.clone(), sv.clone(), sigma, lam))
            la.A, la.B = sides
        self._rebuild_groups()

    def _euclidean(self, la: _Layer, done: dict) -> bool:
        """Whether the root sends ``la`` Euclidean until the next refresh: its gain under ``min_gain``."""
        grad = la.mod.weight.grad
        if self.min_gain <= 0 or grad is None:
            return False
        a, b = (_Side(*done[(id(la), j)]) for j in (0, 1))
        return self._gain(a, b, grad.float()) < self.min_gain

    def _gain(self, a: _Side, b: _Side, g: Tensor) -> float:
        """The estimated gain of whitening ``g`` with the factors ``a``, ``b``: the K-FAC-metric error of a
        pass of ``g`` through the wire codec over that of its whitened form (one local quantization each,
        round to nearest: a proxy for the all-reduce's, which quantizes the sum again)."""
        grp = TransformGroup(*g.shape, dtype=self.transform_dtype)
        grp.rebuild([(a, b)])

        def white(x):
            out = x.clone()
            grp.apply([0], out[None], True)
            return out

        w = white(g)
        euclidean = (white(self._wire_round_trip(g)) - w).norm()
        gift = (self._wire_round_trip(w) - w).norm()
        return float(euclidean / gift.clamp_min(1e-30))

    def _wire_round_trip(self, x: Tensor) -> Tensor:
        """``x`` (fp32) quantized and dequantized once by the all-reduce's codec (round to nearest)."""
        flat = x.reshape(-1)
        multiple = FP4_GROUP if self.format == "nvfp4" else self.block
        v = torch.nn.functional.pad(flat, (0, (-flat.numel()) % multiple))
        if self.format == "nvfp4":
            v = dequantize_nvfp4(quantize_nvfp4(v, scale_round="up", nonfinite="nan", local_scale=True))
        else:
            v = fp8_dequantize(*fp8_quantize(v, self.block), self.block)
        return v.reshape(-1)[:flat.numel()].view_as(x)

    def state_dict(self) -> dict:
        """The step count, and per layer its root's statistics EMA and the factors in use (a resumed run
        whitens as the uninterrupted one would)."""
        def side(sd):
            return None if sd is None else {"u": sd.u, "s": sd.s, "sigma": sd.sigma, "lam": sd.lam}

        return {"steps": self.steps, "layers": {la.name: {"a_ema": la.a_ema, "b_ema": la.b_ema, "A": side(la.A),
                                                           "B": side(la.B), "euclidean": la.euclidean}
                                               for la in self.layers.values()}}

    def load_state_dict(self, state: dict) -> None:
        names = {la.name: la for la in self.layers.values()}
        if set(state["layers"]) != set(names):
            raise ValueError(f"GIFT state for layers {sorted(state['layers'])}, this model has {sorted(names)}")
        self.steps = state["steps"]
        for name, st in state["layers"].items():
            la = names[name]
            dev = la.mod.weight.device  # (a checkpoint may load onto the CPU)

            def to(t, dev=dev):
                return None if t is None else t.to(dev)

            la.a_ema, la.b_ema = to(st["a_ema"]), to(st["b_ema"])
            la.A, la.B = (None if sd is None else _Side(to(sd["u"]), to(sd["s"]), sd["sigma"], sd["lam"])
                          for sd in (st["A"], st["B"]))
            la.euclidean = st.get("euclidean", False)
        self._rebuild_groups()

    def _global_rank(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    # ------------------------------------------------------------------ the reduction

    def reduce_gradients(self) -> None:
        """Average every parameter's gradient over the group, in place: ``nn.Linear`` weights of at least
        ``min_numel`` elements in whitened coordinates, the rest as they are. On a refresh step (every
        ``refresh_every``, the first included) the factors are rebuilt first from the statistics that
        step's forward and backward took. The whitened layers go first, a weight shape at a time
        (:meth:`whitened_chunks`): each chunk's gradients copied into one fp32 stack, whitened in place
        (:class:`TransformGroup`), one low-precision all-reduce of the stack, mapped back, copied back. Then
        the other gradients, one all-reduce a bucket of consecutive parameters of about ``bucket_numel``
        elements in model order. The transient fp32 buffers are a chunk's or a bucket's, not the model's;
        the layout depends only on the parameters' order and sizes and the layers sent whitened. Counts the
        step."""
        params = [p for p in self.params if p.grad is not None]
        if self._collect:
            self._refresh_all([self.layers[id(p)] for p in params if id(p) in self.layers])
        if self.world > 1:
            bucket = 0
            for grp, slots, grads in self.whitened_chunks(params):
                x = torch.stack(grads, out=grads[0].new_empty((len(grads), grp.n, grp.k), dtype=torch.float32))
                grp.apply(slots, x, True)
                self._all_reduce(x.view(-1), self.steps * 65_537 + bucket, self.scope)
                grp.apply(slots, x, False)
                torch._foreach_copy_(grads, list(x.unbind(0)))
                del x  # (one stack alive at a time)
                bucket += 1
            rest = [p for p in params if not self._whitened(p)]
            start, size = 0, 0
            for i, p in enumerate(rest):
                size += p.numel()
                if size >= self.bucket_numel or i == len(rest) - 1:
                    self._reduce_bucket(rest[start:i + 1], self.steps * 65_537 + bucket)
                    start, size, bucket = i + 1, 0, bucket + 1
        self.steps += 1

    def whitened_chunks(self, params: list) -> list[tuple[TransformGroup, list[int], list[Tensor]]]:
        """The gradients of ``params`` that are sent whitened (ready layers not sent Euclidean), as
        ``(group, slots, gradients)``: a weight shape at a time, in slot order, in chunks of at most
        ``bucket_numel`` elements (at least one layer)."""
        by_group: dict[int, list[tuple[int, Tensor]]] = {}
        for p in filter(self._whitened, params):
            la = self.layers[id(p)]
            by_group.setdefault(id(la.group), []).append((la.slot, p.grad))
        chunks = []
        for grp in self.groups.values():
            items = sorted(by_group.get(id(grp), []), key=lambda item: item[0])
            per = max(1, self.bucket_numel // (grp.n * grp.k))
            for i in range(0, len(items), per):
                chunk = items[i:i + per]
                chunks.append((grp, [slot for slot, _ in chunk], [g for _, g in chunk]))
        return chunks

    def _whitened(self, p: Tensor) -> bool:
        """Whether ``p``'s gradient is sent whitened: a ready layer's weight, not sent Euclidean."""
        la = self.layers.get(id(p))
        return la is not None and la.ready and not la.euclidean

    def _rebuild_groups(self) -> None:
        """Restack every group's factors from its ready layers (after a refresh or a state load)."""
        for grp in self.groups.values():
            ready = [la for la in self.layers.values() if la.group is grp and la.ready]
            for slot, la in enumerate(ready):
                la.slot = slot
            grp.rebuild([(la.A, la.B) for la in ready])

    def _all_reduce(self, flat: Tensor, seed: int, scope: str) -> Tensor:
        """The average over the group of ``flat`` through the low-precision all-reduce, in place."""
        if self.format == "nvfp4":
            return nvfp4_all_reduce(flat, self.group, average=True, stochastic=self.stochastic, seed=seed, scope=scope)
        return fp8_all_reduce(flat, self.group, block=self.block, average=True, scope=scope)

    def _reduce_bucket(self, params: list, seed: int) -> None:
        """One bucket's all-reduce of the gradients of ``params`` as they are, written back in place."""
        flat = torch.cat([p.grad.float().reshape(-1) for p in params])
        self._all_reduce(flat, seed, self.scope)
        pieces = flat.split([p.numel() for p in params])
        torch._foreach_copy_([p.grad for p in params], [t.view(p.shape) for t, p in zip(pieces, params)])

    @staticmethod
    def ddp_noop_hook(state, bucket):
        """A DDP comm hook that sends nothing (``ddp.register_comm_hook(None, GIFT.ddp_noop_hook)``), for a
        model wrapped in DDP whose gradients GIFT reduces after backward (:meth:`reduce_gradients`).
        GIFT does not reduce DDP's buckets: their composition changes when DDP rebuilds them after the
        first step, and FP8 blocks and chunk owners would change with it. Reduced once over all
        parameters in a fixed layout, a gradient's result depends only on the gradients (a resumed run
        reduces as the uninterrupted one did)."""
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    # ------------------------------------------------------------------ measurement

    @torch.no_grad()
    def errors(self) -> dict[str, dict[str, float]]:
        """For each whitened layer, on the gradients at hand (before :meth:`reduce_gradients`): the
        relative error against the exact average (an fp32 all-reduce, not counted in the ledger) of
        GIFT (``"gift"``) and of the same low-precision all-reduce on the raw gradient (``"euclidean"``),
        each in the Euclidean metric and in the whitened one (``"..._whitened"``:
        ``‖B^{-1/2} E A^{-1/2}‖ / ‖B^{-1/2} Ḡ A^{-1/2}‖``). Its two all-reduces are counted in the ledger
        under the scope ``"probe"``."""
        out = {}
        for layer in self.layers.values():
            if not layer.ready or layer.mod.weight.grad is None:
                continue
            g = layer.mod.weight.grad.float()
            exact = g.clone()
            if self.world > 1:
                dist.all_reduce(exact, group=self.group)
                exact /= self.world
            seed = -(self.steps * 65_537 + layer.index + 1)  # (not a seed a reduction uses)
            euc = self._all_reduce(g.clone(), seed, "probe")
            wh = self._all_reduce(layer.whiten(g), seed, "probe")
            gift = euc if layer.euclidean else layer.unwhiten(wh)  # (what the reduction sends)
            w_exact = layer.whiten(exact)

            def rel(e, ref):
                return float(e.norm() / ref.norm().clamp_min(1e-30))

            out[layer.name] = {"gift": rel(gift - exact, exact), "euclidean": rel(euc - exact, exact),
                               "gift_whitened": rel(layer.whiten(gift) - w_exact, w_exact),
                               "euclidean_whitened": rel(layer.whiten(euc) - w_exact, w_exact)}
        return out

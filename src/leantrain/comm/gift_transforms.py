"""GIFT's whitening transforms, batched over the layers of one weight shape.

Each side of a whitened layer is a damped K-FAC factor kept as low-rank eigenpairs plus the mean of the
rest of its spectrum (:class:`_Side`): ``F = U diag(s) Uᵀ + σ (I - U Uᵀ)``, so that a power of it is
``F^p = c I + U M Uᵀ`` with a scalar ``c`` and an ``r x r`` matrix ``M`` (``diag((s+λ)^p - (σ+λ)^p)``).
Both transforms of a gradient ``g`` (``N x K``) are then

    B^p g A^p = c_a c_b g + [c_b P M_a + U_b M_b S M_a, U_b] @ [U_aᵀ ; c_a M_b Q]
    with P = g U_a (N x r_a), Q = U_bᵀ g (r_b x K), S = U_bᵀ P (r_b x r_a):

three products of ``g`` with the thin bases (``4 N K r`` multiply-adds) and small ones.
:class:`TransformGroup` holds the bases and matrices of all the layers of one shape stacked (``[L, K, r]``,
``[L, N, r]``, ``[L, r, r]``), rebuilt on each refresh, and runs the small products for all of them at
once as batched matmuls. The three products with ``g`` run layer by layer, reading each gradient where it
lies and writing each result where it is wanted (in place into the gradient, or into a given tensor): a
batched product would first need the layers' gradients copied into one stacked tensor, a pass over the
gradients as long as the product's own, where a layer's own product costs one launch.
Per layer and direction that is three launches of the large products; the small ops run once a group.
(Run layer by layer, the small ops took more than half of a 2048 x 2048 layer's transform time on an
H200, ``benchmarks/results/comm/2026-12-03_H200_gift-cost.json``; for the 1b's 88 layers a step makes
about 700 kernel-launching calls batched against about 3100 layer by layer, counted on the CPU.)

**The map back is the exact inverse of the map out.** The whitening uses ``M = diag(e)``; the map back
uses the ``M'`` that inverts ``c I + U M Uᵀ`` exactly for the basis as the products see it (rounded to the
product precision), by Woodbury: ``(c I + U M Uᵀ)^{-1} = c^{-1} I + U M' Uᵀ`` with
``M' = -c^{-2} M (I + G M / c)^{-1}``, ``G = Uᵀ U`` (computed in fp64; ``G = I`` up to the rounding,
``M' = diag((s+λ)^{1/2} - (σ+λ)^{1/2})`` up to it). Without it, the rounding of an orthonormal basis to
bf16 (``UᵀU = I + O(2^-8)``) would be amplified by ``(s/σ)^{1/2}`` in the round trip. Every rank uses
the same factors, so the map back of the summed whitened gradients is the same linear map on every rank.

``transform_dtype``: ``"float32"`` (the products in fp32), ``"tfloat32"`` (the same tensors, products in
TF32 on CUDA: fp32 off CUDA), ``"bfloat16"`` (the bases stored in bf16, each gradient cast to bf16 for its
two thin products, the final product ``left @ right`` in bf16 added to the fp32 ``c_a c_b g``). The small
ops run in fp32 in all three.

**Split products** (``split = s > 1``). ``P`` (``N x r``) and ``Q`` (``r x K``) are thin: a GEMM library
tiles their outputs into a few dozen blocks, fewer than a GPU has multiprocessors. Split in ``s`` along
their inner dimension, each is one batched product of ``s`` slices read in place (``g``'s column blocks
for ``P``, its row blocks for ``Q``: strided views, no copy), ``s`` times the blocks, then a sum of ``s``
small partial products (``s r`` floats a row or column: ``s r / K`` of a pass over ``g``).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

TRANSFORM_DTYPES = ("float32", "tfloat32", "bfloat16")


@contextlib.contextmanager
def _tf32(enabled: bool):
    """Matrix products of fp32 CUDA tensors in TF32 inside the block (nothing changes on the CPU)."""
    if not enabled or not torch.cuda.is_available():
        yield
        return
    mm = torch.backends.cuda.matmul
    prev, mm.fp32_precision = mm.fp32_precision, "tf32"
    try:
        yield
    finally:
        mm.fp32_precision = prev


class _Side:
    """One K-FAC factor as low-rank eigenpairs + the mean of the rest: its powers ±1/2, damped.
    Built on every rank from the same broadcast numbers (the same transforms everywhere)."""

    def __init__(self, u: Tensor, s: Tensor, sigma: float, lam: float):
        self.u, self.s, self.sigma, self.lam = u, s, sigma, lam  # u: (dim, r), orthonormal columns
        self.full = u.shape[1] == u.shape[0]
        self._coef = {}  # inverse -> (c, e), computed once
        for inverse, d, c in ((True, (s + lam).rsqrt(), (sigma + lam) ** -0.5),
                              (False, (s + lam).sqrt(), (sigma + lam) ** 0.5)):
            self._coef[inverse] = (0.0, d) if self.full else (c, d - c)

    def coef(self, inverse: bool) -> tuple[float, Tensor]:
        """``(c, e)`` with ``F^{∓1/2} = c I + U diag(e) Uᵀ`` (``-`` when ``inverse``); full rank: ``c = 0``."""
        return self._coef[inverse]


def _two_sided(b: _Side, a: _Side, g: Tensor, inverse: bool) -> Tensor:
    """The per-layer reference of one transform, ``B^{∓1/2} g A^{∓1/2}`` with the diagonal ``M = diag(e)`` of
    both directions (the module doc's formula), in ``g``'s dtype: the definition the batched
    :class:`TransformGroup` is tested against."""
    ca, ea = a.coef(inverse)
    cb, eb = b.coef(inverse)
    p = g @ a.u  # (N, ra)
    q = b.u.t() @ g  # (rb, K)
    sm = b.u.t() @ p  # (rb, ra)
    left = torch.cat([cb * p * ea + b.u @ (eb[:, None] * sm * ea[None, :]), b.u], 1)
    right = torch.cat([a.u.t(), ca * eb[:, None] * q], 0)
    return torch.addmm(g, left, right, beta=ca * cb)


def _exact_inverse(c: float, m: Tensor, u: Tensor) -> tuple[float, Tensor]:
    """``(c', M')`` with ``c' I + U M' Uᵀ = (c I + U M Uᵀ)^{-1}`` exactly for this ``U`` (fp64 ``m`` diagonal
    ``r x r``, ``u`` ``dim x r``): Woodbury (module doc); full rank (``c = 0``, ``U`` square):
    ``M' = G^{-1} M^{-1} G^{-1}``."""
    gram = u.mT @ u
    if c == 0.0:
        gi = torch.linalg.inv(gram)
        return 0.0, gi @ torch.diag(1 / m.diagonal()) @ gi
    eye = torch.eye(m.shape[0], dtype=m.dtype, device=m.device)
    x = torch.linalg.solve(eye + m @ gram / c, m).mT  # M (I + G M / c)^{-1}
    return 1 / c, -x / c**2


class TransformGroup:
    """The whitened layers of one weight shape ``N x K`` and their transforms, batched (module doc).

    :meth:`rebuild` stacks the layers' factors (on each refresh and state load); :meth:`apply` whitens or
    maps back any subset of them. ``dtype``: one of :data:`TRANSFORM_DTYPES`; ``split``: the thin products'
    split (module doc)."""

    def __init__(self, n: int, k: int, dtype: str = "float32", split: int = 1):
        if dtype not in TRANSFORM_DTYPES:
            raise ValueError(f"GIFT: transform_dtype must be one of {TRANSFORM_DTYPES}, got {dtype!r}")
        self.n, self.k, self.dtype = n, k, dtype
        self.split = split  # (module doc; one that does not divide N and K runs unsplit)
        self.store = torch.bfloat16 if dtype == "bfloat16" else torch.float32  # the bases and the products
        self.size = 0  # layers stacked

    def rebuild(self, sides: list[tuple[_Side, _Side]]) -> None:
        """Stack the factors ``(A, B)`` of the group's layers (slot ``i``: ``sides[i]``): the bases in the
        product precision, and per direction ``c_a c_b`` (a float a layer), ``c_b M_a``, ``M_b``, ``M_a`` and
        ``c_a M_b`` (fp32, ``[L, r, r]``)."""
        self.size = len(sides)
        if not sides:
            return
        self.ua = self._round(torch.stack([a.u for a, _ in sides]))  # [L, K, ra]
        self.ub = self._round(torch.stack([b.u for _, b in sides]))  # [L, N, rb]
        self.ua32, self.ub32 = self.ua.float(), self.ub.float()  # (the small ops' copies: r/K of a gradient)
        self.coef = {}  # inverse -> (cc floats, c_b M_a, M_b, M_a, c_a M_b)
        for inverse in (True, False):
            cc, cbma, mb_, ma_, camb = [], [], [], [], []
            for i, (a, b) in enumerate(sides):
                (ca, ma), (cb, mb) = (self._matrix(sd, u, inverse) for sd, u in ((a, self.ua[i]), (b, self.ub[i])))
                cc.append(ca * cb)
                cbma.append(cb * ma)
                mb_.append(mb)
                ma_.append(ma)
                camb.append(ca * mb)
            self.coef[inverse] = (cc, *(torch.stack(t).float() for t in (cbma, mb_, ma_, camb)))

    def _round(self, u: Tensor) -> Tensor:
        """The bases as the products see them: in bf16, or (``"tfloat32"``) fp32 rounded to TF32's 10
        mantissa bits, which TF32 products then read unchanged (the map back inverts what is applied)."""
        if self.dtype != "tfloat32":
            return u.to(self.store)
        bits = u.float().contiguous().view(torch.int32)
        return ((bits + (1 << 12)) & ~((1 << 13) - 1)).view(torch.float32)

    @staticmethod
    def _matrix(side: _Side, u: Tensor, inverse: bool) -> tuple[float, Tensor]:
        """``(c, M)`` of one side and direction: the whitening's ``diag(e)``; the map back: its exact inverse
        for the basis ``u`` as stored (:func:`_exact_inverse`)."""
        c, e = side.coef(True)
        m = torch.diag(e.double())
        return (c, m) if inverse else _exact_inverse(c, m, u.double())

    def apply(self, slots: list[int], srcs: list[Tensor], dsts: list[Tensor], inverse: bool) -> None:
        """Write ``B^{∓1/2} src A^{∓1/2}`` (``-``: ``inverse``, the whitening) of the layers in ``slots`` into
        ``dsts`` (fp32 ``N x K`` tensors; a ``dst`` may be its ``src``: in place)."""
        if not slots:
            return
        every = slots == list(range(self.size))
        pick = (lambda t: t) if every else (lambda t: t[slots])  # noqa: E731  (all: the stacks, no copy)
        ua, ub, ua32, ub32 = (pick(t) for t in (self.ua, self.ub, self.ua32, self.ub32))
        cc, cbma, mb, ma, camb = self.coef[inverse]
        cc = cc if every else [cc[s] for s in slots]
        cbma, mb, ma, camb = (pick(t) for t in (cbma, mb, ma, camb))
        n_, ra, rb = len(slots), ua.shape[-1], ub.shape[-1]
        dev = ua.device
        p = torch.empty(n_, self.n, ra, dtype=self.store, device=dev)
        q = torch.empty(n_, rb, self.k, dtype=self.store, device=dev)
        with _tf32(self.dtype == "tfloat32"):
            # the two thin products, layer by layer, into the stacks (unbind: one call for a stack's views)
            for g, ua_i, ubt_i, p_i, q_i in zip(srcs, ua.unbind(0), ub.mT.unbind(0), p.unbind(0), q.unbind(0)):
                self.thin_products(g.to(self.store), ua_i, ubt_i, p_i, q_i)
            p, q = p.float(), q.float()
            msm = torch.bmm(torch.bmm(mb, torch.bmm(ub32.mT, p)), ma)  # M_b S M_a
            left = torch.cat([torch.baddbmm(torch.bmm(p, cbma), ub32, msm), ub32], -1).to(self.store)
            right = torch.cat([ua32.mT, torch.bmm(camb, q)], 1).to(self.store)
            for src, dst, left_i, right_i, beta in zip(srcs, dsts, left.unbind(0), right.unbind(0), cc):
                self._final(src, left_i, right_i, beta, dst)

    def thin_products(self, g: Tensor, ua: Tensor, ubt: Tensor, p: Tensor, q: Tensor) -> None:
        """``p = g @ ua`` and ``q = ubt @ g`` of one layer: a product each, or with ``split`` (dividing ``N``
        and ``K``) a batched product each of ``split`` slices of the inner dimension (module doc), the
        partial products summed in fp32."""
        s, n, k = self.split, self.n, self.k
        if s <= 1 or n % s or k % s:
            torch.mm(g, ua, out=p)
            torch.mm(ubt, g, out=q)
            return
        cols = g.view(n, s, k // s).transpose(0, 1)  # [s, N, K/s]: g's column blocks, in place
        p.copy_(torch.bmm(cols, ua.view(s, k // s, -1)).sum(0, dtype=torch.float32))
        rows_t = ubt.view(-1, s, n // s).transpose(0, 1)  # [s, r, N/s]: Ubᵀ's column blocks
        q.copy_(torch.bmm(rows_t, g.view(s, n // s, k)).sum(0, dtype=torch.float32))

    def _final(self, src: Tensor, left: Tensor, right: Tensor, beta: float, dst: Tensor) -> None:
        """``dst = beta src + left @ right``: one ``addmm`` in fp32 / TF32 (in place when ``dst`` is ``src``);
        in bf16 the product in bf16, added to the fp32 ``beta src`` in one elementwise pass."""
        if self.store == torch.bfloat16:
            torch.add(torch.mm(left, right), src, alpha=beta, out=dst)
        elif dst is src:
            dst.addmm_(left, right, beta=beta)
        else:
            torch.addmm(src, left, right, beta=beta, out=dst)

"""GIFT's whitening transforms, batched over the layers of one weight shape.

Each side of a whitened layer is a damped K-FAC factor kept as low-rank eigenpairs plus the mean of the
rest of its spectrum (:class:`_Side`): ``F = U diag(s) Uᵀ + σ (I - U Uᵀ)``, so that a power of it is
``F^p = c I + U M Uᵀ`` with a scalar ``c`` and an ``r x r`` matrix ``M`` (``diag((s+λ)^p - (σ+λ)^p)``).
Both transforms of a gradient ``g`` (``N x K``) are then

    B^p g A^p = c_a c_b g + [c_b P M_a + U_b M_b S M_a, U_b] @ [U_aᵀ ; c_a M_b Q]
    with P = g U_a (N x r_a), Q = U_bᵀ g (r_b x K), S = U_bᵀ P (r_b x r_a):

three products of ``g`` with the thin bases (``4 N K r`` multiply-adds) and small ones.
:class:`TransformGroup` holds the bases and matrices of all the layers of one shape stacked (``[L, K, r]``,
``[L, N, r]``, ``[L, r, r]``), rebuilt on each refresh, and transforms a stack of its layers' gradients
(``[n, N, K]``, fp32, in place): the two thin products as one batched product each, the small ones batched,
the final product layer by layer (each layer's ``c_a c_b`` is its own scalar). The stack is the all-reduce's
buffer (``GIFT.reduce_gradients``): the gradients are copied into it once, as every bucket's gradients are
concatenated into one, and copied back once. Batched, the thin outputs (``N x r``, ``r x K``: a few dozen
tiles a layer, fewer than a GPU has multiprocessors) fill the GPU, and a shape's transforms take a few
dozen launches where layer by layer they took a few a layer.

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
    maps back a stack of the gradients of any subset of them. ``dtype``: one of :data:`TRANSFORM_DTYPES`."""

    def __init__(self, n: int, k: int, dtype: str = "float32"):
        if dtype not in TRANSFORM_DTYPES:
            raise ValueError(f"GIFT: transform_dtype must be one of {TRANSFORM_DTYPES}, got {dtype!r}")
        self.n, self.k, self.dtype = n, k, dtype
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

    def apply(self, slots: list[int], x: Tensor, inverse: bool) -> None:
        """Overwrite each ``x[i]`` with ``B^{∓1/2} x[i] A^{∓1/2}`` (``-``: ``inverse``, the whitening) of the layer
        in ``slots[i]``: ``x`` is an fp32 ``[len(slots), N, K]`` stack (any strides a batched product reads)."""
        if not slots:
            return
        if x.shape != (len(slots), self.n, self.k) or x.dtype != torch.float32:
            raise ValueError(f"GIFT: a stack of {len(slots)} fp32 {self.n}x{self.k} gradients expected, got "
                             f"{x.dtype} {tuple(x.shape)}")
        first = slots[0]
        if slots == list(range(first, first + len(slots))):  # (a run of slots, as GIFT sends them: views)
            def pick(t):
                return t[first:first + len(slots)]
        else:  # (device ops alone: indexing with a list would copy it to the device and wait for it)
            def pick(t):
                return torch.stack([t[s] for s in slots])
        ua, ub, ua32, ub32 = (pick(t) for t in (self.ua, self.ub, self.ua32, self.ub32))
        cc, cbma, mb, ma, camb = self.coef[inverse]
        cc = [cc[s] for s in slots]
        cbma, mb, ma, camb = (pick(t) for t in (cbma, mb, ma, camb))
        with _tf32(self.dtype == "tfloat32"):
            g = x.to(self.store)  # (fp32: x itself)
            p = torch.bmm(g, ua).float()  # [n, N, ra]
            q = torch.bmm(ub.mT, g).float()  # [n, rb, K]
            del g
            msm = torch.bmm(torch.bmm(mb, torch.bmm(ub32.mT, p)), ma)  # M_b S M_a
            left = torch.cat([torch.baddbmm(torch.bmm(p, cbma), ub32, msm), ub32], -1).to(self.store)
            right = torch.cat([ua32.mT, torch.bmm(camb, q)], 1).to(self.store)
            for x_i, left_i, right_i, beta in zip(x.unbind(0), left.unbind(0), right.unbind(0), cc):
                self._final(x_i, left_i, right_i, beta)

    def _final(self, x: Tensor, left: Tensor, right: Tensor, beta: float) -> None:
        """``x = beta x + left @ right`` in place: one ``addmm`` in fp32 / TF32; in bf16 the product in bf16,
        added to the fp32 ``beta x`` in one elementwise pass."""
        if self.store == torch.bfloat16:
            torch.add(torch.mm(left, right), x, alpha=beta, out=x)
        else:
            x.addmm_(left, right, beta=beta)

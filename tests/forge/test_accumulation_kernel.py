"""FORGE's tile kernel with gradient accumulation (forge/kernel.py ``ACC_KIND``, ``MODE_ACCUM``).

The fused path (the accumulated sum added in the kernel's epilogue; ``MODE_ACCUM`` adding dW into
the buffer) against the split path it replaces (dW written by the same kernel's write-dW mode, the
buffer added with torch as forge/accumulate.py does, then the update-only kernel): the same fp32
operations in the same order, so W, the bias and the states agree bit for bit. On CUDA the bias
sum ``Σ_t dY`` may come out 1 ulp apart between kernel variants (tl.sum's reduction tree follows
the register layout the compiler picks, test_forge_kernel.py): there the bias rows are compared
within ``BIAS_RTOL`` (one fp32 ulp; a bf16 buffer's rounding of it: one bf16 ulp). The per-tile
sums of squares are added in another tiling by the two paths: the layer's sum within 1e-6.

Shapes are not multiples of the interpreter's 16 x 16 tiles (33 x 20, 21 tokens); on the GPU
machine (``LEANTRAIN_TEST_GPU=1``) the same tests run compiled.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _forge_util import RULES, Net, assert_same_run, batches, max_rel

import leantrain as lt
from leantrain.ops._backend import HAS_TRITON, interpreting
from leantrain.optim.grad8 import Int8GradBuffer
from leantrain.optim.state import StateStorage

pytestmark = pytest.mark.skipif(not (HAS_TRITON and (interpreting() or torch.cuda.is_available())),
                                reason="needs Triton (interpreter or CUDA)")
DEV = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
BIAS_RTOL = {torch.float32: 2**-23, torch.bfloat16: 2**-7}
N, K, T = 33, 20, 21
ACCUMS = ["fp32", "bf16", "int8", "int8-noef"]


def _launch():
    from leantrain.forge import launch

    return launch


def _inputs(n=N, k=K, t=T, seed=0, wdtype=torch.float32, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g).to(DEV)
    dy = torch.randn(t, n, generator=g).to(DEV)
    w = (torch.randn(n, k, generator=g) * 0.1).to(wdtype).to(DEV)
    b = (torch.randn(n, generator=g) * 0.1).to(wdtype).to(DEV) if bias else None
    return x, dy, w, b


def _buffer(accum: str, numel: int, seed=1):
    """An accumulation buffer holding a sum of two random gradients (as two micro-batches leave it)."""
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(numel, generator=g).to(DEV) * 4 for _ in range(2)]
    if accum.startswith("int8"):
        buf = Int8GradBuffer(numel, error_feedback=accum == "int8", backend="torch")
        buf.copy_(parts[0])
        buf.add_(parts[1])
        return buf
    return (parts[0] + parts[1]).to({"fp32": torch.float32, "bf16": torch.bfloat16}[accum])


def _states(rule, w, b):
    st = StateStorage("fp32").init(rule, w)
    bst = StateStorage("fp32").init(rule, b) if b is not None else {}
    names = rule.state_names
    return [st[s] for s in names], [bst[s] for s in names] if b is not None else []


def _split_grad(x, dy, n, k, bias, accum):
    """dW (and db) written by the kernel, plus the accumulated sum, as forge/accumulate.py adds it."""
    K_ = _launch()
    g = torch.empty(n * k + (n if bias else 0), device=DEV)
    K_.launch_forge(K_.MODE_WRITE_DW, x=x, dy=dy, g=g[: n * k].view(n, k), gb=g[n * k:] if bias else None)
    if isinstance(accum, Int8GradBuffer):
        accum.add_to(g)
    elif accum is not None:
        g.add_(accum)
    return g


def _update_both(rule_key, accum_kind, *, bias, wdtype=torch.float32, n=N, k=K, poison=None):
    """(W, b, states, layer sum of squares) of the fused path and of the split path after one update."""
    K_ = _launch()
    rule = RULES[rule_key]()
    hp = dict(rule.hyper())
    x, dy, w0, b0 = _inputs(n, k, wdtype=wdtype, bias=bias)
    accum = _buffer(accum_kind, n * k + (n if bias else 0))
    if poison is not None:
        accum[poison] = float("nan")
    out = []
    for fused in (True, False):
        w, b = w0.clone(), None if b0 is None else b0.clone()
        st, bst = _states(rule, w, b)
        kw = dict(w=w, b=b, states=st, bias_states=bst, kinds=["fp32"] * len(st), qtables=[None] * len(st),
                  rule_name=rule.name, hp=hp, step=1, sr=True, key=12345)
        if fused:
            part = K_.launch_forge(K_.MODE_FUSED, x=x, dy=dy, accum=accum, **kw)
        else:
            g = _split_grad(x, dy, n, k, bias, accum)
            part = K_.launch_forge(K_.MODE_UPDATE, g=g[: n * k].view(n, k), gb=g[n * k:] if bias else None, **kw)
        out.append((w, b, st, bst, part.double().sum()))
    return out


def _assert_bias_close(a, b):
    if DEV == "cuda":
        assert max_rel(a.float(), b.float()) <= BIAS_RTOL[a.dtype]
    else:
        assert torch.equal(a, b)


@pytest.mark.parametrize("accum", ACCUMS)
@pytest.mark.parametrize("bias", [True, False])
def test_fused_update_with_accumulated_sum_equals_split_path(accum, bias):
    (w0, b0, s0, bs0, ss0), (w1, b1, s1, bs1, ss1) = _update_both("adamw", accum, bias=bias)
    assert torch.equal(w0, w1)
    for a, b in zip(s0, s1):
        assert torch.equal(a, b)
    if bias:
        _assert_bias_close(b0, b1)
        for a, b in zip(bs0, bs1):
            _assert_bias_close(a, b)
    assert float(ss0) == pytest.approx(float(ss1), rel=1e-6)


@pytest.mark.parametrize("accum", ["bf16", "int8"])
def test_fused_update_with_accumulated_sum_bf16_weights(accum):
    """bf16 W and bias with stochastic rounding, SGD with momentum: the same draws, the same bits."""
    (w0, b0, s0, _, _), (w1, b1, s1, _, _) = _update_both("sgd_mom", accum, bias=True, wdtype=torch.bfloat16)
    assert torch.equal(w0, w1)
    assert torch.equal(s0[0], s1[0])
    _assert_bias_close(b0, b1)


def test_nonfinite_accumulated_sum_gates_its_tile():
    """A NaN in the accumulated sum: its tile keeps W and the state (as a NaN in dW would), the
    other tiles are updated, as on the split path."""
    w_init = _inputs()[2]
    (w0, _, s0, _, ss0), (w1, _, s1, _, _) = _update_both("adamw", "fp32", bias=False, poison=0)
    assert not torch.isfinite(ss0)
    assert torch.equal(w0, w1)
    assert torch.equal(w0[0, 0], w_init[0, 0])  # (element 0's tile is not stored)
    assert not torch.equal(w0, w_init)  # (the other tiles are)
    assert torch.equal(s0[0], s1[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_accumulate_mode_equals_torch_add_and_copy(dtype, bias):
    """``MODE_ACCUM``: the buffer becomes ``buffer + dW`` (``accum_read``) or ``dW`` (the step's
    first micro-batch), as ``buf.add_(dW)`` / ``buf.copy_(dW)`` give it (bf16: rounded to nearest)."""
    K_ = _launch()
    x, dy, w, b = _inputs(bias=bias)
    numel = N * K + (N if bias else 0)
    start = _buffer("fp32", numel).to(dtype)
    w_before = w.clone()
    g = _split_grad(x, dy, N, K, bias, None)
    for read, expected in ((True, start.clone().add_(g)), (False, torch.empty_like(start).copy_(g))):
        buf = start.clone()
        K_.launch_forge(K_.MODE_ACCUM, x=x, dy=dy, w=w, b=b, accum=buf, accum_read=read)
        assert torch.equal(buf[: N * K], expected[: N * K])
        if bias:
            _assert_bias_close(buf[N * K:], expected[N * K:])
    assert torch.equal(w, w_before)  # (W gives the shape only)


def test_launch_rejects_a_wrong_buffer():
    K_ = _launch()
    x, dy, w, b = _inputs()
    with pytest.raises(ValueError, match="elements"):
        K_.launch_forge(K_.MODE_ACCUM, x=x, dy=dy, w=w, b=b, accum=torch.zeros(N * K, device=DEV))
    with pytest.raises(ValueError, match="MODE_ACCUM"):
        K_.launch_forge(K_.MODE_ACCUM, x=x, dy=dy, w=w, b=b)
    with pytest.raises(ValueError, match="multiple of its group size"):  # (K = 20: groups span rows)
        K_.launch_forge(K_.MODE_ACCUM, x=x, dy=dy, w=w, b=b, accum=_buffer("int8", N * K + N))


@pytest.mark.parametrize("error_feedback", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_accumulate_mode_int8_equals_int8_grad_buffer_folds(error_feedback, bias):
    """``MODE_ACCUM`` into an int8 buffer (K = 512: two groups a weight row; the bias's 17 rows one
    padded group, folded after the launch): three micro-batches (``copy_``, then ``add_`` twice) leave
    the codes, scales, residual and fold count of :class:`Int8GradBuffer`'s torch folds of the same dW.
    (N = 17: a whole 16-row tile and a one-row tail.)"""
    K_ = _launch()
    n, k = 17, 512
    numel = n * k + (n if bias else 0)
    fused = Int8GradBuffer(numel, error_feedback=error_feedback, backend="torch")
    torch_folds = Int8GradBuffer(numel, error_feedback=error_feedback, backend="torch")
    for micro in range(3):
        x, dy, w, b = _inputs(n, k, seed=micro, bias=bias)
        K_.launch_forge(K_.MODE_ACCUM, x=x, dy=dy, w=w, b=b, accum=fused, accum_read=micro > 0)
        g = _split_grad(x, dy, n, k, bias, None)
        (torch_folds.add_ if micro else torch_folds.copy_)(g)
    assert fused.folds == torch_folds.folds
    if not error_feedback:
        assert fused.resid is None and torch_folds.resid is None
    pairs = [(fused.codes, torch_folds.codes)] + ([(fused.resid, torch_folds.resid)] if error_feedback else [])
    for q_fused, q_torch in pairs:
        if DEV == "cuda" and bias:  # (db 1 ulp apart: compare the bias's sum by value)
            assert torch.equal(q_fused.data[: n * k], q_torch.data[: n * k])
            continue
        assert torch.equal(q_fused.data, q_torch.data)
        assert torch.equal(q_fused.scale, q_torch.scale)
    if DEV == "cuda" and bias:
        tail = slice(n * k, numel)
        assert torch.allclose(fused.value()[tail], torch_folds.value()[tail], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ through the optimizer

MICRO, STEPS = 4, 2


def _train(model, opt, data):
    for batch in data:
        for rows in batch.chunk(MICRO):
            opt.before_micro_batch()
            (model(rows).float().square().mean() / MICRO).backward()
        opt.step()
        opt.zero_grad()


def _fused_and_split_runs(rule, accum_dtype, device, width=33, hidden=65):
    """The same Net trained with k = MICRO micro-batches by the fused tiles and by the split path."""
    torch.manual_seed(0)
    base = Net(k=width, h=hidden).to(device)
    data = [x.to(device) for x in batches(STEPS, shape=(MICRO * 2, 12, width))]
    runs = []
    for kernel in ("tiles", "split"):
        model = copy.deepcopy(base)
        opt = lt.forge.attach(model, rule, backend="triton", kernel=kernel, grad_accum=MICRO,
                              accum_dtype=accum_dtype)
        _train(model, opt, data)
        runs.append((model, opt))
    return runs


@pytest.mark.skipif(DEV == "cuda", reason="bit for bit where both paths compute dW with the kernel (CPU)")
@pytest.mark.parametrize("accum_dtype,width", [
    ("fp32", 33),
    pytest.param("bf16", 33, marks=pytest.mark.slow),
    pytest.param("int8", 256, marks=pytest.mark.slow),  # (int8 folds of the Triton quantizer, interpreted)
])
def test_k4_accumulation_fused_equals_split_path(accum_dtype, width):
    """k = 4 micro-batches, 2 steps, AdamW, on the Triton backend (interpreter): the fused tiles
    (``MODE_ACCUM``, the accumulated sum in the update's epilogue) give the split path's weights and
    states bit for bit. Without a layer whose int8 groups span weight rows (fp32 / bf16 buffers; int8
    with ``width`` 256: fc1's K) the fused run's accumulating micro-batches make no fp32 dW workspace
    for that layer; with 256, fc2's K = 17 still takes the workspace, so the int8 run has a layer of
    each kind. Net's hidden width 17 (a whole 16-row tile and a one-row tail) keeps the interpreted
    quantizer's folds to a few seconds."""
    (m_fused, o_fused), (m_split, o_split) = _fused_and_split_runs(RULES["adamw"](), accum_dtype, "cpu", width,
                                                                   hidden=17)
    assert_same_run(m_fused, o_fused, m_split, o_split)
    assert o_split.peak_dw_numel >= o_split.layers[0].weight.numel()
    if accum_dtype != "int8":
        assert o_fused.peak_dw_numel == 0  # no fp32 dW, in any micro-batch
    elif width == 256:
        assert 0 < o_fused.peak_dw_numel < o_fused.layers[0].weight.numel()  # (fc2's only)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("accum_dtype,width,tol", [("fp32", 33, 1e-5), ("bf16", 33, 1e-3), ("int8", 256, 1e-3)])
def test_k4_accumulation_fused_close_to_split_path_on_cuda(accum_dtype, width, tol):
    """Compiled: the split path's dW is cuBLAS's (another summation order, a few fp32 ulps), so the
    runs agree within ``tol`` of max |W| after 2 steps of SGD with momentum (lr 0.05): 1e-5 with
    fp32 buffers; bf16 / int8 buffers can round a partial sum one step apart (2^-8 of an element,
    1/254 of a group's largest), moving a weight by lr times that: 1e-3. The fused run's fp32 /
    bf16 buffers are filled without the dW workspace."""
    (m_fused, o_fused), (m_split, _) = _fused_and_split_runs(RULES["sgd_mom"](), accum_dtype, "cuda", width)
    for (n, a), b in zip(m_fused.named_parameters(), m_split.parameters()):
        assert max_rel(a, b) <= tol, n
    if accum_dtype != "int8":
        assert o_fused.peak_dw_numel == 0

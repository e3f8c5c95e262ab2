"""SCAPE in ShardedOptimizer on real gloo processes (2 and 4 ranks).

- density 1 (no exploration, fp32 values) gives the dense ShardedOptimizer's weights bit for bit;
- a step changes only masked coordinates (no dense step), at most ``world * k`` a bucket, and
  every rank holds the same weights and the same mask;
- the mask is the owner's top ``|m|`` (relative to its tensor's mean ``|m|`` on the shard) times
  the steps waited, plus the rotating window, from the state after the previous step;
- per-tensor scores give every tensor its share of the mask, however small its gradients;
- nothing is lost with error feedback: the sum of every gradient sent so far plus every rank's
  residual is the sum of all ranks' gradients;
- the bytes on the wire (the ledger's count of the tensors passed to the collectives);
- a checkpoint resumes bit for bit (the residual in the shard, the masks rebuilt);
- a tiny model learns with 90 % sparsity about as well as dense AdamS.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import leantrain as lt
from dist_utils import resumes_bit_identically, run_distributed
from leantrain.comm.scape import SCAPE, bitmap_indices, pack_bits, unpack_bits
from leantrain.config import ModelConfig
from leantrain.model import Llama

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)
GLOBAL_BATCH = 8


def make_model(seed=0):
    torch.manual_seed(seed)
    return Llama(CFG)


def batch(step, rank, world):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, CFG.vocab_size, (GLOBAL_BATCH, 12), generator=g)
    y = (x * 7 + 3) % CFG.vocab_size  # a learnable map (the convergence check)
    per = GLOBAL_BATCH // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def tensor_ids(offsets, sizes, start, shard):
    """The parameter of each coordinate of the shard ``[start, start + shard)`` (padding: ``len(sizes)``)."""
    ids = torch.full((shard,), len(sizes), dtype=torch.int64)
    for i, (off, n) in enumerate(zip(offsets, sizes, strict=True)):
        lo, hi = max(off, start), min(off + n, start + shard)
        if lo < hi:
            ids[lo - start:hi - start] = i
    return ids


def relative(abs_m, ids):
    """``|m|`` over its tensor's mean ``|m|`` (the same operations as SCAPE's, for equal ties)."""
    n = int(ids.max()) + 1
    mean = torch.zeros(n, device=abs_m.device).index_add_(0, ids, abs_m)
    mean /= torch.bincount(ids, minlength=n).clamp_(min=1)
    return abs_m / mean.clamp_(min=1e-30)[ids]


def flat(model):
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


def adams():
    return lt.optim.AdamS(lr=3e-3, weight_decay=0.1)


def _dense_equivalence(rank, world):
    out = []
    for comp in (None, SCAPE(1.0, explore=0.0, value_dtype=torch.float32, catch_up=0, beta1=None)):
        m = make_model()
        o = lt.dist.ShardedOptimizer(m, adams(), bucket_mb=0.02, compression=comp)
        for s in range(4):
            x, y = batch(s, rank, world)
            m(x, y).backward()
            o.step()
            o.zero_grad()
        out.append(flat(m))
    return torch.equal(out[0], out[1])


class Recorder(SCAPE):
    """SCAPE that keeps what each reduce-scatter delivered (the test's view of the wire)."""

    def start_reduce_scatter(self, flat, topo, **kw):
        pend = super().start_reduce_scatter(flat, topo, **kw)
        finish = pend._finish

        def record():
            got = finish()
            self.delivered.append((kw["key"], got.clone()))
            return got

        pend._finish = record
        return pend


def _sparse_steps(rank, world, density):
    m = make_model()
    comp = Recorder(density, value_dtype=torch.float32, per_tensor=True, warmup=0)  # (a bf16 sum over ranks rounds: not fed back)
    comp.delivered = []
    opt = lt.dist.ShardedOptimizer(m, adams(), bucket_mb=0.02, compression=comp)
    total = torch.zeros(sum(b.padded for b in opt.buckets))  # every rank's gradient, summed, all steps
    changed, limits, masks_ok, masks_same = [], [], True, True
    for s in range(6):
        x, y = batch(s, rank, world)
        m(x, y).backward()
        g = torch.cat([opt._flat_grads(b) for b in opt.buckets])
        dist.all_reduce(g)
        total += g
        # the mask in force this step must be the owner's top |m| + window of the state after step s-1
        if s > 0:
            for b in opt.buckets:
                st = opt.state[b.index]
                mom, last = torch.empty(b.padded), torch.empty(b.padded, dtype=torch.int32)
                dist.all_gather_into_tensor(mom, st["exp_avg"].contiguous())
                dist.all_gather_into_tensor(last, st["scape_last"].contiguous())
                k = comp.k(b.shard)
                n_ex = int(comp.explore * k)
                want = []
                for r in range(world):
                    sl = slice(r * b.shard, (r + 1) * b.shard)  # (score m_age: |m| times the steps waited)
                    ids = tensor_ids(b.offsets, [p.numel() for p in b.params], r * b.shard, b.shard)
                    score = relative(mom[sl].abs(), ids) * (st["step"] + 1 - last[sl]).float()
                    score[(st["step"] * n_ex + torch.arange(n_ex)) % b.shard] = float("inf")
                    want.append(torch.topk(score, k).indices.sort().values)
                got = comp._mask_in_force(b.index)
                masks_ok &= torch.equal(got, torch.stack(want))
                allm = [torch.empty_like(got) for _ in range(world)]
                dist.all_gather(allm, got)
                masks_same &= all(torch.equal(a, got) for a in allm)
        before = flat(m)
        opt.step()
        opt.zero_grad()
        changed.append(int((flat(m) != before).sum()))
        limits.append(sum(world * comp.k(b.shard) for b in opt.buckets))
    # conservation: what was delivered (summed over the owners) plus every rank's residual
    sent = torch.zeros_like(total)
    base = 0
    starts = {}
    for b in opt.buckets:
        starts[b.index] = base
        base += b.padded
    for key, got in comp.delivered:
        b = opt.buckets[key]
        piece = torch.zeros(b.padded)
        piece[b.start:b.start + b.shard] = got
        dist.all_reduce(piece)  # the owners' pieces side by side
        sent[starts[key]:starts[key] + b.padded] += piece
    resid = torch.cat([opt.state[b.index]["scape_residual"] for b in opt.buckets])
    dist.all_reduce(resid)
    err = float((sent + resid - total).abs().max() / total.abs().max())
    return {"changed": changed, "limits": limits, "masks_ok": masks_ok, "masks_same": masks_same,
            "weights": flat(m).numpy(), "conservation": err}


def _bytes(rank, world, density, steps):
    m = make_model()
    opt = lt.dist.ShardedOptimizer(m, adams(), bucket_mb=0.05, compression=SCAPE(density, warmup=0) if density else None)
    for s in range(steps):
        x, y = batch(s, rank, world)
        with lt.runtime.ledger.COMM.capture() as led:
            m(x, y).backward()
            opt.step()
            opt.zero_grad()
    return led.by_op(), sum(b.padded for b in opt.buckets), [b.shard for b in opt.buckets]


def _resume(rank, world):
    def build(seed):
        m = make_model(seed)
        # (a warm-up to step 5: the resume at step 3 lands in it, and the density still falls after)
        return m, lt.dist.ShardedOptimizer(m, adams(), bucket_mb=0.02, compression=SCAPE(0.1, warmup=5))

    return resumes_bit_identically(build, batch, rank, world, 3, 7)


def _learns(rank, world):
    losses = {}
    for name, comp in (("dense", None), ("scape90", SCAPE(0.1, warmup=0))):
        m = make_model()
        o = lt.dist.ShardedOptimizer(m, lt.optim.AdamS(lr=1e-2), bucket_mb=0.05, compression=comp)
        for s in range(60):
            x, y = batch(s, rank, world)
            loss = m(x, y)
            loss.backward()
            o.step()
            o.zero_grad()
        x, y = batch(10_000, rank, world)
        with torch.no_grad():
            losses[name] = float(m(x, y))
    return losses


def _suite(rank, world):
    out = {"dense": _dense_equivalence(rank, world), "sparse": _sparse_steps(rank, world, 0.1)}
    if world == 2:
        out["sparse99"] = _sparse_steps(rank, world, 0.01)
        out["bytes"] = {d: _bytes(rank, world, d, 2) for d in (0, 0.1, 0.01)}
        out["resume"] = _resume(rank, world)
        out["learns"] = _learns(rank, world)
    return out


pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def suites():
    return {w: run_distributed(_suite, w, timeout=400) for w in (2, 4)}


def test_bits_round_trip():
    m = torch.rand(8 * 37) < 0.3
    assert torch.equal(unpack_bits(pack_bits(m)), m)


def test_bitmap_indices_are_the_set_bits_in_order():
    g = torch.Generator().manual_seed(0)
    rows, n, k = 5, 8 * 41, 37
    bits = torch.zeros(rows, n, dtype=torch.bool)
    for r in range(rows):
        bits[r, torch.randperm(n, generator=g)[:k]] = True
    got = bitmap_indices(pack_bits(bits.reshape(-1)).view(rows, n // 8), k)
    assert torch.equal(got, bits.nonzero()[:, 1].view(rows, k))


def test_parameter_groups_step_with_their_own_hyperparameters():
    """Two parameter groups in one bucket (two segments of the shard). Dense (density 1): the weights
    equal two optimizers' of one group each, bit for bit. Sparse: a group at lr 0 never moves while
    the other's masked coordinates do."""
    rule = lt.optim.AdamS(lr=1e-2, weight_decay=0.1)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))

    def groups(m, lr2):
        return [{"params": [m[0].weight, m[2].weight]},
                {"params": [m[0].bias, m[2].bias], "lr": lr2, "weight_decay": 0.0}]

    def train(m, opts, steps=5):
        for _ in range(steps):
            for o in opts:
                o.zero_grad(set_to_none=True)
            m(x).pow(2).mean().backward()
            for o in opts:
                o.step()

    def scape(density):
        return SCAPE(density, value_dtype=torch.float32, explore=0.0, warmup=0)

    m1, m2 = _mlp(), _mlp()
    opt = lt.dist.ShardedOptimizer(groups(m1, 3e-2), rule, bucket_mb=1, compression=scape(1.0))
    assert len(opt.buckets) == 1 and len(opt.buckets[0].segments) == 2
    train(m1, [opt])
    train(m2, [lt.dist.ShardedOptimizer(g["params"], lt.optim.AdamS(**{**rule.hyper(), **{
        k: v for k, v in g.items() if k != "params"}}), bucket_mb=1, compression=scape(1.0)) for g in groups(m2, 3e-2)])
    for a, b in zip(m1.parameters(), m2.parameters(), strict=True):
        assert torch.equal(a, b)

    m3, m0 = _mlp(), _mlp()
    opt = lt.dist.ShardedOptimizer(groups(m3, 0.0), rule, bucket_mb=1, compression=scape(0.3))
    train(m3, [opt], steps=4)
    before = [m3[0].weight.detach().clone(), m3[2].weight.detach().clone()]
    train(m3, [opt], steps=1)
    assert torch.equal(m3[0].bias, m0[0].bias) and torch.equal(m3[2].bias, m0[2].bias)
    moved = sum(int((a != b).sum()) for a, b in zip((m3[0].weight, m3[2].weight), before, strict=True))
    assert 0 < moved <= SCAPE(0.3, warmup=0).k(opt.buckets[0].shard)  # (a masked step)


def test_bad_arguments():
    with pytest.raises(ValueError, match="density"):
        SCAPE(0.0)
    with pytest.raises(ValueError, match="first moment"):
        SCAPE().init_state(8, 4, lt.optim.SGD(lr=0.1, momentum=0.0), "cpu")
    with pytest.raises(ValueError, match="catch_up_mode"):
        SCAPE(catch_up_mode="sqrt")
    with pytest.raises(ValueError, match="beta1"):
        SCAPE(beta1=1.0)
    with pytest.raises(ValueError, match="error_feedback"):
        SCAPE(score="residual", error_feedback=False)


@pytest.mark.parametrize("world", [2, 4])
def test_density_one_is_the_dense_optimizer(suites, world):
    assert all(r["dense"] for r in suites[world])


@pytest.mark.parametrize("world,key", [(2, "sparse"), (2, "sparse99"), (4, "sparse")])
def test_sparse_steps(suites, world, key):
    res = [r[key] for r in suites[world]]
    for r in res:
        assert r["masks_ok"] and r["masks_same"]
        assert (r["weights"] == res[0]["weights"]).all()  # identical weights on every rank
        assert r["conservation"] < 1e-5, r["conservation"]  # nothing lost (error feedback)
        changed, limits = r["changed"], r["limits"]
        assert changed[0] > 2 * limits[0]  # the first step, before any mask, is dense
        for c, lim in zip(changed[1:], limits[1:], strict=True):
            assert 0 < c <= lim  # only masked coordinates move: no dense step


def test_bytes_on_the_wire(suites):
    world, f = 2, 0.5  # f = (world - 1) / world
    dense, padded, shards = suites[2][0]["bytes"][0]
    assert dense["reduce_scatter"] == f * 4 * padded and dense["all_gather"] == f * 4 * padded
    for density in (0.1, 0.01):
        ops, padded2, shards2 = suites[2][0]["bytes"][density]
        k = [SCAPE(density).k(s) for s in shards2]
        mask = [f * world * min(s // 8, 4 * kk) for s, kk in zip(shards2, k, strict=True)]
        assert ops["reduce_scatter"] == f * world * 2 * sum(k)  # bf16 values, no indices
        assert ops["all_gather"] == f * world * 4 * sum(k) + sum(mask)  # fp32 weights' values and the masks
        ratio = (ops["reduce_scatter"] + ops["all_gather"]) / (dense["reduce_scatter"] + dense["all_gather"])
        assert ratio < {0.1: 0.1, 0.01: 0.013}[density], ratio


def test_checkpoint_resumes_bit_identically(suites):
    assert all(r["resume"] for r in suites[2])


def test_a_tiny_model_learns_at_90_percent_sparsity(suites):
    losses = suites[2][0]["learns"]
    # from about ln(64) = 4.2 (untrained), 60 steps: dense AdamS ~0.02, SCAPE 90 % ~0.3 (2 ranks)
    assert losses["dense"] < 0.1 and losses["scape90"] < 1.0, losses


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.GELU(), torch.nn.Linear(33, 7))


@pytest.mark.parametrize("catch_up,score,dense,per_tensor,mode,beta1,warmup", [
    (0, "m", 1, True, "steps", None, 0), (4, "m", 1, True, "steps", None, 0), (0, "m_age", 1, True, "steps", None, 0),
    (10, "m_age", 3, True, "steps", None, 0), (10, "m_age", 1, False, "steps", None, 0),
    (10, "m_age", 1, False, "sign", None, 0), (10, "m_age", 1, False, "sign", 0.8, 0),
    (10, "m_age", 1, False, "sign", 0.8, 6), (10, "residual", 1, False, "sign", 0.8, 6),
    (10, "residual", 1, True, "sign", 0.8, 0)])
def test_one_process_matches_a_reference_of_the_algorithm(catch_up, score, dense, per_tensor, mode, beta1, warmup,
                                                          device="cpu"):
    """World 1 (no process group), one bucket: the optimizer's weights after 8 steps equal, bit for
    bit, a plain-torch rendering of the algorithm (dense first step, masks from the updated first
    moment plus the window, error feedback, masked AdamS steps, catch-up spans, the masked updates'
    own β1, the density's warm-up)."""
    rule = lt.optim.AdamS(lr=1e-2, weight_decay=0.1)
    m1, m2 = _mlp().to(device), _mlp().to(device)
    comp = SCAPE(0.25, value_dtype=torch.float32, catch_up=catch_up, score=score, dense_steps=dense,
                 per_tensor=per_tensor, catch_up_mode=mode, beta1=beta1, warmup=warmup)
    masked = rule.hyper() if beta1 is None else {**rule.hyper(), "betas": (beta1, rule.betas[1])}
    opt = lt.dist.ShardedOptimizer(m1, rule, bucket_mb=1, compression=comp)
    (b,) = opt.buckets
    S = b.padded

    def k_at(n):  # coordinates sent at step n: the density falls from 1 as 0.25 ** (n / warmup)
        return max(1, min(S, round((0.25 ** (n / warmup) if n < warmup else 0.25) * S)))

    names = {id(p): n for n, p in m1.named_parameters()}
    params2 = [dict(m2.named_parameters())[names[id(q)]] for q in b.params]  # (the bucket's order)

    def layout(ts):
        out = torch.zeros(S, device=device)
        for t, off in zip(ts, b.offsets, strict=True):
            out[off:off + t.numel()] = t.detach().reshape(-1)
        return out

    w, mom, resid = layout(params2), torch.zeros(S, device=device), torch.zeros(S, device=device)
    last, mask = torch.zeros(S, dtype=torch.int64, device=device), None
    moved, limit, shortened = [], [], 0
    for step in range(1, 9):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=g).to(device), torch.randn(8, 7, generator=g).to(device)
        for m in (m1, m2):
            torch.nn.functional.mse_loss(m(x), y).backward()
        before = layout(list(b.params))
        opt.step()
        opt.zero_grad()
        moved.append(int((layout(list(b.params)) != before).sum()))
        limit.append(k_at(step) if mask is not None else S)
        acc = layout([p.grad for p in params2]) + resid
        m2.zero_grad()
        if mask is None:
            w, st = rule.update(w, acc, {"exp_avg": mom}, step=step, **rule.hyper())
            mom, resid = st["exp_avg"], torch.zeros(S, device=device)
            last.fill_(step)
        else:
            sent, resid = acc[mask], acc.clone()
            resid[mask] = 0.0
            p0, st0 = w[mask], {"exp_avg": mom[mask]}
            if catch_up:
                span = (step - last[mask]).clamp(1, catch_up).float()
                if mode == "sign":  # (noise, a mean gradient against m, moves sqrt(span) steps' distance)
                    moves = torch.where(torch.sign(sent / span) == torch.sign(st0["exp_avg"]), span, span.sqrt())
                else:
                    moves = span
                shortened += int((moves != span).sum())
                p_new, st = rule.update(p0, sent / span, st0, step=step, **masked)
                p_new = p0 + moves * (p_new - p0)
            else:
                p_new, st = rule.update(p0, sent, st0, step=step, **masked)
            w[mask], mom[mask] = p_new, st["exp_avg"]
            last[mask] = step
        ids = tensor_ids(b.offsets, [p.numel() for p in b.params], 0, S).to(device)
        base = resid.abs() if score == "residual" else mom.abs()  # (residual: the gradient not yet sent)
        prio = relative(base, ids) if per_tensor else base
        prio = prio * (step + 1 - last).float() if score == "m_age" else prio
        k = k_at(step + 1)
        n_ex = int(comp.explore * k)
        prio[(step * n_ex + torch.arange(n_ex, device=device)) % S] = float("inf")
        mask = torch.topk(prio, k).indices.sort().values if step >= dense else None
        with torch.no_grad():
            for p, off in zip(params2, b.offsets, strict=True):
                p.copy_(w[off:off + p.numel()].view_as(p))
    assert torch.equal(layout(list(b.params)), layout(params2))
    assert all(x > 2 * k_at(8) for x in moved[:dense]) and all(0 < x <= n for x, n in zip(moved, limit))
    if warmup:  # (the density falls over the warm-up: more coordinates move early)
        sparse = limit[dense:]
        assert all(a >= b for a, b in zip(sparse, sparse[1:])) and sparse[0] > sparse[-1] == k_at(8)
        assert moved[dense] > k_at(8)
    assert (shortened > 0) == (mode == "sign")  # (the sign rule did shorten some moves)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
@pytest.mark.parametrize("score", ["m_age", "residual"])
def test_one_process_matches_the_reference_on_cuda(score):
    test_one_process_matches_a_reference_of_the_algorithm(10, score, 3, True, "sign", 0.8, 6, device="cuda")


def test_the_trainers_defaults_are_the_compressors():
    from leantrain.config import ScapeConfig

    c, s = ScapeConfig(), SCAPE()
    assert (c.density, c.explore, c.score, c.dense_steps, c.per_tensor, c.catch_up_mode, c.beta1 or None) == \
        (s.density, s.explore, s.score, s.dense_steps, s.per_tensor, s.catch_up_mode, s.beta1)
    defaults = {f.name: f.default for f in dataclasses.fields(SCAPE)}
    assert c.warmup is None and defaults["warmup"] is None and c.catch_up is None and defaults["catch_up"] is None


def test_the_default_warmup_and_catch_up_grow_with_each_tenfold_fall_of_the_density():
    assert [SCAPE(d).warmup for d in (1.0, 0.1, 0.05, 0.01, 0.001)] == [0, 100, 130, 200, 300]
    assert [SCAPE(d).catch_up for d in (1.0, 0.1, 0.05, 0.01, 0.001)] == [0, 10, 13, 20, 30]  # (10 a tenfold fall)
    assert SCAPE(0.01, catch_up=10).catch_up == 10 and SCAPE(0.01, catch_up=0).catch_up == 0
    assert SCAPE(0.01, warmup=50).warmup == 50 and SCAPE(0.01, warmup=0).warmup == 0
    assert SCAPE(0.01).k(10_000, 100) == 1000 and SCAPE(0.01).k(10_000, 200) == 100  # 10 %, then 1 %
    with pytest.raises(ValueError, match="warmup"):
        SCAPE(0.1, warmup=-1)


def test_without_error_feedback_nothing_is_kept_and_steps_stay_masked():
    m = _mlp()
    comp = SCAPE(0.25, error_feedback=False, warmup=0)
    opt = lt.dist.ShardedOptimizer(m, lt.optim.AdamS(lr=1e-2), bucket_mb=1, compression=comp)
    (b,) = opt.buckets
    assert "scape_residual" not in opt.state[b.index]
    moved = []
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 7, generator=g)
        torch.nn.functional.mse_loss(m(x), y).backward()
        before = flat(m)
        opt.step()
        opt.zero_grad()
        moved.append(int((flat(m) != before).sum()))
    assert moved[0] > 2 * comp.k(b.padded) and all(0 < x <= comp.k(b.padded) for x in moved[1:])


def _mask_shares(per_tensor: bool) -> list[float]:
    """One process, an MLP whose first layer's gradients are 1000x the others': after 6 steps, each
    weight's share of the mask over its share of the coordinates (1: its fair share)."""
    m = _mlp()
    m[0].weight.register_hook(lambda g: g * 1000.0)
    comp = SCAPE(0.1, per_tensor=per_tensor, explore=0.0, warmup=0)
    opt = lt.dist.ShardedOptimizer(m, lt.optim.AdamS(lr=1e-2), bucket_mb=1, compression=comp)
    (b,) = opt.buckets
    for step in range(6):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 7, generator=g)
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()
    mask = comp._mask_in_force(b.index)[0]
    ids = tensor_ids(b.offsets, [p.numel() for p in b.params], 0, b.shard)
    picked = torch.bincount(ids[mask], minlength=len(b.params) + 1)[:len(b.params)].float()
    sizes = torch.tensor([p.numel() for p in b.params], dtype=torch.float32)
    share = picked / mask.numel() / (sizes / sizes.sum())
    return share[sizes >= 100].tolist()  # (the weights: a bias's fair share is a few coordinates)


def test_per_tensor_scores_give_every_tensor_its_share_of_the_mask():
    """AdamS moves every tensor about as far whatever its gradients' scale, so the mask must too:
    with raw |m| the tensor of 1000x gradients takes the whole mask and the others starve."""
    fair, raw = _mask_shares(True), _mask_shares(False)
    assert all(0.3 < share < 3.0 for share in fair), fair
    assert min(raw) == 0.0, raw  # (the mechanism: without per-tensor scores some tensor gets nothing)


@pytest.mark.parametrize("key,value,match", [("density", 0.0, "density"), ("beta1", 1.0, "beta1"),
                                             ("explore", 1.0, "explore"), ("warmup", -1, "warmup"),
                                             ("catch_up", -1, "catch_up")])
def test_the_trainer_refuses_bad_settings_with_a_sentence(key, value, match):
    from leantrain.comm.technique import ShardCompression
    from leantrain.config import ConfigError, build

    cfg = build("tiny", overrides={"dist.mode": "sharded", "optim.name": "adams", "comm.method": "scape",
                                   f"comm.scape.{key}": value})
    with pytest.raises(ConfigError, match=f"comm.scape.{match}"):
        ShardCompression.check(cfg, device="cpu", world=2)

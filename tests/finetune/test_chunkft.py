"""ChunkFT: the plan cuts the parameters into byte-balanced chunks that cover every row once; a
step equals the rule applied to the rows of the full gradient (per-chunk step counts), for every
rule, tied or untied embeddings, biases and odd shapes; only the active rows hold gradient and
device state; backward stops at the first active layer; clipping, accumulation, non-finite
gradients and checkpoints behave; a tiny Llama learns a generated task."""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import CharTok
from leantrain import config as C
from leantrain.data import tasks
from leantrain.finetune import ChunkFT
from leantrain.finetune.chunkft import plan_chunks
from leantrain.model import Llama
from leantrain.optim.rules import make_rule


def _llama(tie: bool = False, vocab: int = 97, seed: int = 0) -> Llama:
    cfg = C.build("tiny", overrides={"model.dim": "48", "model.n_layers": "2", "model.n_heads": "4",
                                     "model.n_kv_heads": "2", "model.ffn_dim": "80", "model.max_seq_len": "32", "data.seq_len": "32",
                                     "model.tie_embeddings": str(tie).lower()})
    cfg.model.vocab_size = vocab
    torch.manual_seed(seed)
    return Llama(cfg.model)


class _Odd(nn.Module):
    """Odd shapes, biases, an embedding with a padding row, a weight used by two modules (tied)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(37, 13, padding_idx=3)
        self.a = nn.Linear(13, 29)
        self.norm = nn.LayerNorm(29)
        self.b = nn.Linear(29, 13, bias=True)
        self.head = nn.Linear(13, 37, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(self.b(self.norm(F.gelu(self.a(self.emb(idx))))))


def _loss(model, idx, tgt):
    return F.cross_entropy(model(idx).flatten(0, 1).float(), tgt.flatten())


def _reference_step(model, plan, k, states, steps, rule, hp, scale=1.0):
    """The rule on rows [lo, hi) of each piece of chunk ``k``, from the full ``.grad``."""
    pmap = dict(model.named_parameters())
    with torch.no_grad():
        for name, lo, hi in plan[k]:
            p = pmap[name]
            key = f"{name}[{lo}:{hi}]"
            st = states.setdefault(key, rule.init_state(p[lo:hi]))
            p_new, st_new = rule.update(p[lo:hi], p.grad[lo:hi] * scale if scale != 1.0 else p.grad[lo:hi], st,
                                        step=steps[k], **hp)
            p[lo:hi].copy_(p_new)
            states[key] = st_new


def test_plan_covers_every_row_once_in_balanced_chunks():
    model = _llama()
    named = list(model.named_parameters())
    for n in (1, 2, 3, 5, 8):
        chunks = plan_chunks(named, n, 8)
        per = {name: [] for name, _ in named}
        sizes = []
        for chunk in chunks:
            sizes.append(sum(pc.numel * (2 * 4 + 8) for pc in chunk))
            for pc in chunk:
                per[pc.name].append((pc.lo, pc.hi))
        order = [(pc.name, pc.lo) for chunk in chunks for pc in chunk]
        assert [x[0] for x in order] == sorted([x[0] for x in order], key=[m for m, _ in named].index)  # in order
        for name, p in named:  # contiguous, complete, no overlap
            ranges = sorted(per[name])
            assert ranges[0][0] == 0 and ranges[-1][1] == p.shape[0]
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        total = sum(sizes)
        biggest_row = max(p[0].numel() * 16 for _, p in named)
        assert all(abs(s - total / n) <= biggest_row for s in sizes), (n, sizes)
    with pytest.raises(ValueError, match="more than the model's parameters have rows"):
        plan_chunks([("w", nn.Parameter(torch.zeros(3, 4)))], 4, 8)


@pytest.mark.parametrize("rule_name,hp", [("adamw", {"lr": 1e-2, "weight_decay": 0.1}),
                                          ("sgd", {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
                                          ("lion", {"lr": 1e-3}), ("adams", {"lr": 1e-3})])
@pytest.mark.parametrize("tie", [False, True])
def test_steps_equal_the_rule_on_the_full_gradients_rows(rule_name, hp, tie):
    """Three chunks, interval 2: every weight, bit for bit, as the rule applied to the active rows
    of autograd's whole gradient with each chunk's own step count."""
    m0 = _llama(tie=tie)
    a, b = copy.deepcopy(m0), copy.deepcopy(m0)
    opt = ChunkFT(a, rule_name, num_chunks=3, interval=2, **hp)
    rule = make_rule(rule_name, **hp)
    plan, states, steps = opt.plan(), {}, [0, 0, 0]
    g = torch.Generator().manual_seed(1)
    for it in range(9):
        idx, tgt = torch.randint(0, 97, (3, 11), generator=g), torch.randint(0, 97, (3, 11), generator=g)
        k = (it // 2) % 3
        assert opt.active == k
        _loss(a, idx, tgt).backward()
        opt.step()
        b.zero_grad(set_to_none=True)
        _loss(b, idx, tgt).backward()
        steps[k] += 1
        _reference_step(b, plan, k, states, steps, rule, rule.hyper())
    assert opt.chunk_steps == steps
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name


def test_odd_shapes_biases_padding_and_a_shared_weight():
    m0 = _Odd()
    a, b = copy.deepcopy(m0), copy.deepcopy(m0)
    opt = ChunkFT(a, "adamw", num_chunks=4, lr=1e-2)
    rule = make_rule("adamw", lr=1e-2)
    plan, states, steps = opt.plan(), {}, [0] * 4
    cut = [name for chunk in plan for name, lo, hi in chunk if (lo, hi) != (0, dict(a.named_parameters())[name].shape[0])]
    assert cut, "some parameter straddles a chunk boundary"
    g = torch.Generator().manual_seed(2)
    for it in range(8):
        idx = torch.randint(0, 37, (2, 7), generator=g)
        idx[0, 0] = 3  # the padding row gets no gradient
        tgt = torch.randint(0, 37, (2, 7), generator=g)
        _loss(a, idx, tgt).backward()
        opt.step()
        b.zero_grad(set_to_none=True)
        _loss(b, idx, tgt).backward()
        steps[it % 4] += 1
        _reference_step(b, plan, it % 4, states, steps, rule, rule.hyper())
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(pa, pb, rtol=1e-6, atol=1e-7), name


def test_only_the_active_rows_hold_gradients_and_device_state():
    model = _llama()
    opt = ChunkFT(model, "adamw", num_chunks=4, lr=1e-3)
    idx, tgt = torch.randint(0, 97, (2, 9)), torch.randint(0, 97, (2, 9))
    total_state = 8 * sum(p.numel() for p in model.parameters())
    assert opt.host_state_bytes() == total_state  # one block for every chunk's state, from the start
    for k in range(4):
        _loss(model, idx, tgt).backward()
        active = {pc.name for pc in opt.chunks[k]}
        for name, p in model.named_parameters():
            assert p.requires_grad == (name in active), name
            if p.dim() == 2:  # linears and the embedding: no .grad, the rows' buffer instead
                assert p.grad is None, name
        for pc in opt.chunks[k]:
            g = opt._grad_of(pc)
            assert g is not None and g.shape[0] == pc.hi - pc.lo, pc.name
        rows = sum(pc.numel for pc in opt.chunks[k])
        rows2d = sum(pc.numel for pc in opt.chunks[k] if pc.param.dim() == 2)
        whole1d = sum(p.numel() for p in {id(pc.param): pc.param for pc in opt.chunks[k] if pc.param.dim() == 1}.values())
        # the state arena (AdamW's two fp32 states of the largest chunk), the linears' / embedding's
        # gradient rows, the norms' whole .grad
        assert opt.sizes[k] == 2 * rows
        assert opt.device_state_bytes() == 4 * max(opt.sizes) + 4 * rows2d + 4 * whole1d
        assert 4 * max(opt.sizes) < 1.1 * total_state / 4
        opt.step()
    assert opt.host_state_bytes() == total_state and all(opt.stored)  # each swapped out once


def test_backward_saves_nothing_before_the_first_active_layer():
    """With the last chunk active (the LM head's rows), the blocks' forward saves far less."""
    model = _llama()
    opt = ChunkFT(model, "adamw", num_chunks=4, lr=1e-3)
    idx = torch.randint(0, 97, (2, 16))

    def saved_bytes():
        n = [0]

        def pack(t):
            n[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(idx).sum().backward()
        opt.zero_grad()
        return n[0]

    first = saved_bytes()
    for _ in range(3):
        opt.step()  # (zero gradients: the weights move by weight decay only)
    assert opt.active == 3
    last = saved_bytes()
    assert last < 0.5 * first, (first, last)


def test_clipping_accumulation_and_a_non_finite_piece():
    m0 = _llama()
    a, b = copy.deepcopy(m0), copy.deepcopy(m0)
    opt = ChunkFT(a, "sgd", num_chunks=2, lr=0.1, max_norm=0.05)
    rule = make_rule("sgd", lr=0.1)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, 97, (2, 8), generator=g), torch.randint(0, 97, (2, 8), generator=g)) for _ in range(2)]
    for idx, tgt in batches:  # two backward passes, one step: the gradients add up
        _loss(a, idx, tgt).backward()
        _loss(b, idx, tgt).backward()
    opt.step()
    plan = opt.plan()
    pmap = dict(b.named_parameters())
    norm = math.sqrt(sum(float(pmap[n].grad[lo:hi].pow(2).sum()) for n, lo, hi in plan[0]))
    assert opt.last["grad_norm"] == pytest.approx(norm, rel=1e-5) and norm > 0.05
    _reference_step(b, plan, 0, {}, [1, 0], rule, rule.hyper(), scale=0.05 / (norm + 1e-6))
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(pa, pb, rtol=1e-5, atol=1e-7), name
    # a NaN in one piece's gradient: that piece keeps its weights, the others move
    before = {n: p.detach().clone() for n, p in a.named_parameters()}
    _loss(a, *batches[0]).backward()
    piece = next(pc for pc in opt.chunks[1] if pc.param.dim() == 2)
    opt._grad_of(piece)[0, 0] = float("nan")
    opt.step()
    assert opt.last["skipped"] == [f"{piece.name}[{piece.lo}:{piece.hi}]"]
    after = dict(a.named_parameters())
    assert torch.equal(piece.view(after[piece.name]), piece.view(before[piece.name]))
    assert torch.isfinite(after[piece.name]).all()
    moved = [pc for pc in opt.chunks[1] if pc is not piece and pc.param.dim() == 2]
    assert moved and all(not torch.equal(pc.view(after[pc.name]), pc.view(before[pc.name])) for pc in moved)


def test_checkpoint_resumes_bit_for_bit():
    g = torch.Generator().manual_seed(4)
    data = [(torch.randint(0, 97, (2, 8), generator=g), torch.randint(0, 97, (2, 8), generator=g)) for _ in range(7)]
    m0 = _llama()
    a = copy.deepcopy(m0)
    oa = ChunkFT(a, "adamw", num_chunks=3, interval=2, lr=1e-2)
    for idx, tgt in data:
        _loss(a, idx, tgt).backward()
        oa.step()
    b = copy.deepcopy(m0)
    ob = ChunkFT(b, "adamw", num_chunks=3, interval=2, lr=1e-2)
    for idx, tgt in data[:3]:
        _loss(b, idx, tgt).backward()
        ob.step()
    sd, weights = ob.state_dict(), copy.deepcopy(b.state_dict())
    c = _llama(seed=9)
    c.load_state_dict(weights)
    oc = ChunkFT(c, "adamw", num_chunks=3, interval=2, lr=1e-2)
    oc.load_state_dict(sd)
    assert (oc.active, oc.in_interval, oc.chunk_steps) == (ob.active, ob.in_interval, ob.chunk_steps)
    for idx, tgt in data[3:]:
        _loss(c, idx, tgt).backward()
        oc.step()
    for (name, pa), pc in zip(a.named_parameters(), c.parameters()):
        assert torch.equal(pa, pc), name
    with pytest.raises(ValueError, match="chunk plan differs"):
        ChunkFT(_llama(), "adamw", num_chunks=2).load_state_dict(sd)


def test_lr_scheduler_errors_and_detach():
    model = _llama()
    opt = ChunkFT(model, "adamw", num_chunks=2, lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-4)
    opt.step()
    sched.step()
    with pytest.raises(ValueError, match="interval must be >= 1"):
        ChunkFT(_llama(), num_chunks=2, interval=0)
    with pytest.raises(ValueError, match="not both"):
        ChunkFT(_llama(), make_rule("adamw"), lr=1.0)
    opt.detach()
    assert all(p.requires_grad for p in model.parameters())
    assert "forward" not in model.layers[0].mlp.down_proj.__dict__ and "linear_fn" not in model.lm_head.__dict__
    import leantrain as lt

    f = _llama()
    lt.forge.attach(f, lt.optim.AdamW(lr=1e-3), backend="torch")
    with pytest.raises(ValueError, match="already taken over by FORGE"):
        ChunkFT(f, "adamw")


def test_chunkft_learns_a_task():
    """A tiny Llama from random weights learns ``compare`` with 4 chunks, as in test_zo."""
    tok = CharTok()
    cfg = C.build("tiny", overrides={"model.dim": "32", "model.n_layers": "1", "model.n_heads": "2",
                                     "model.n_kv_heads": "1", "model.ffn_dim": "64",
                                     "model.vocab_size": str(tok.eot_id + 1)})
    torch.manual_seed(0)
    model = Llama(cfg.model)
    opt = ChunkFT(model, "adamw", num_chunks=4, lr=3e-3)
    evalb = tasks.encode(tasks.examples("compare", 256, seed=9), tok, tok.eot_id)
    acc0, loss0 = tasks.accuracy(model, evalb)
    train = tasks.examples("compare", 150 * 16, seed=0)
    for step in range(150):
        b = tasks.encode(train[step * 16:(step + 1) * 16], tok, tok.eot_id)
        model.train()
        tasks.losses(model, b).mean().backward()
        opt.step()
    model.eval()
    acc1, loss1 = tasks.accuracy(model, evalb)
    assert loss1 < loss0 - 0.05, (loss0, loss1)
    assert acc1 > max(acc0, 0.6), (acc0, acc1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
def test_cuda_offload_through_pinned_memory():
    """On CUDA the inactive chunks' state lives in pinned host memory and comes back bit for bit:
    the same weights as with the state kept on the device, and as the reference."""
    m0 = _llama().cuda()
    a, b, c = copy.deepcopy(m0), copy.deepcopy(m0), copy.deepcopy(m0)
    oa = ChunkFT(a, "adamw", num_chunks=3, lr=1e-2)
    ob = ChunkFT(b, "adamw", num_chunks=3, lr=1e-2, offload=False)
    rule = make_rule("adamw", lr=1e-2)
    plan, states, steps = oa.plan(), {}, [0, 0, 0]
    g = torch.Generator().manual_seed(5)
    for it in range(7):
        idx, tgt = (torch.randint(0, 97, (2, 9), generator=g).cuda() for _ in range(2))
        for m, o in ((a, oa), (b, ob)):
            _loss(m, idx, tgt).backward()
            o.step()
        c.zero_grad(set_to_none=True)
        _loss(c, idx, tgt).backward()
        steps[it % 3] += 1
        _reference_step(c, plan, it % 3, states, steps, rule, rule.hyper())
        out = oa.host[(oa.active - 1) % 3]  # just swapped out
        assert out.device.type == "cpu" and out.is_pinned() and ob.host[(ob.active - 1) % 3].is_cuda
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        assert torch.allclose(pa, pc, rtol=1e-5, atol=1e-6), name


def test_saved_tensor_hooks_keep_every_gradient():
    """Under saved_tensors_hooks (the memory ledger's meter, AGoQ's packer) a step updates the same
    weights by the same amounts as without: the weights' gradient rows are found by the parameter."""
    from leantrain.runtime.ledger import SavedActivationMeter

    results = []
    for hooks in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 50))
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt = ChunkFT(model, "adamw", num_chunks=1, lr=1e-2)
        idx = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(1))
        with SavedActivationMeter(model.parameters()) if hooks else contextlib.nullcontext():
            loss = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
        loss.backward()
        opt.step()
        moved = {n: float((p.detach() - start[n]).abs().max()) for n, p in model.named_parameters()}
        assert all(v > 0 for v in moved.values()), moved
        results.append({n: p.detach().clone() for n, p in model.named_parameters()})
    for n in results[0]:
        torch.testing.assert_close(results[1][n], results[0][n], rtol=0, atol=0)

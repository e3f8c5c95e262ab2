import torch

from leantrain.config import ModelConfig
from leantrain.model import Llama, apply_rope, rope_tables

CFG = ModelConfig(vocab_size=97, dim=48, n_layers=2, n_heads=6, n_kv_heads=2, ffn_dim=64, max_seq_len=32)


def test_forward_shapes_and_loss():
    torch.manual_seed(0)
    m = Llama(CFG)
    x = torch.randint(0, 97, (3, 16))
    assert m(x).shape == (3, 16, 97)
    loss = m(x, x)
    assert loss.ndim == 0 and abs(loss.item() - torch.log(torch.tensor(97.0)).item()) < 0.5
    per = m(x, x, reduction="none")
    assert per.shape == (3,) and torch.allclose(per.mean(), loss, atol=1e-5)


def test_causal_future_tokens_do_not_change_past_logits():
    torch.manual_seed(0)
    m = Llama(CFG)
    x = torch.randint(0, 97, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 97
    assert torch.allclose(m(x)[0, :10], m(y)[0, :10], atol=1e-5)
    assert not torch.allclose(m(x)[0, 10:], m(y)[0, 10:], atol=1e-5)


def test_rope_preserves_norm_and_is_relative():
    cos, sin = rope_tables(8, 16, 10000.0)
    q = torch.randn(1, 1, 16, 8)
    assert torch.allclose(apply_rope(q, cos, sin).norm(dim=-1), q.norm(dim=-1), atol=1e-5)
    # <R(m) a, R(n) b> depends on m - n only
    a, b = torch.randn(8), torch.randn(8)
    seq_a = a.expand(1, 1, 16, 8)
    seq_b = b.expand(1, 1, 16, 8)
    ra, rb = apply_rope(seq_a, cos, sin)[0, 0], apply_rope(seq_b, cos, sin)[0, 0]
    assert torch.allclose(ra[5] @ rb[3], ra[9] @ rb[7], atol=1e-5)


def test_tied_embeddings_share_storage_and_gqa_params():
    m = Llama(ModelConfig(**{**CFG.__dict__, "tie_embeddings": True}))
    assert m.lm_head.weight is m.embed_tokens.weight
    assert m.layers[0].self_attn.qkv_proj.weight.shape == ((6 + 2 * 2) * 8, 48)  # q, then k and v at 2 heads
    m = Llama(ModelConfig(**{**CFG.__dict__, "fused_proj": False}))
    assert m.layers[0].self_attn.k_proj.weight.shape == (2 * 8, 48)


def test_backward_reaches_every_parameter():
    m = Llama(CFG)
    x = torch.randint(0, 97, (2, 8))
    m(x, x).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


def _loss_and_saved_bytes(models: dict) -> dict:
    """Each model's loss on one batch (backward run: the gradients) and the bytes it saved for backward."""
    from leantrain.runtime.ledger import SavedActivationMeter

    x = torch.randint(0, 97, (3, 16))
    out = {}
    for name, m in models.items():
        with SavedActivationMeter(m.parameters()) as meter:
            loss = m(x, x)
        loss.backward()
        out[name] = (loss.item(), meter.bytes)
    return out


def test_gqa_inside_sdpa_equals_repeated_kv_and_saves_less():
    """``sdpa_gqa`` (K/V handed to SDPA at n_kv_heads) gives the loss of repeating K/V to the query
    heads' count, gradients equal up to summation order, and saves fewer bytes for backward (the
    repeated K/V are what SDPA saved: (n_heads - n_kv_heads) / n_heads of their bytes go)."""
    torch.manual_seed(0)
    a = Llama(ModelConfig(**{**CFG.__dict__, "sdpa_gqa": True}))
    b = Llama(ModelConfig(**{**CFG.__dict__, "sdpa_gqa": False}))
    b.load_state_dict(a.state_dict())
    saved = _loss_and_saved_bytes({"gqa": a, "repeat": b})
    assert saved["gqa"][0] == saved["repeat"][0]
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), n
    # per layer: K and V at 6 heads (fp32, 3 x 16 tokens x head_dim 8) in the repeated model, 2 in the other
    kv = 2 * 3 * 16 * 8 * 4
    assert saved["repeat"][1] - saved["gqa"][1] == CFG.n_layers * kv * (6 - 2)


def test_chunked_loss_equals_one_piece_and_keeps_chunks_small():
    """The loss in chunks of ``loss_chunk`` tokens: the same per-token losses and gradients as one
    ``F.cross_entropy`` over the batch, bit for bit (row-wise math), ignored targets included;
    backward keeps one log-softmax per chunk, each a chunk's size."""
    torch.manual_seed(0)
    x = torch.randint(0, 97, (3, 16))
    tgt = x.clone()
    tgt[1] = -100  # a whole chunk ignored
    tgt[2, :5] = -100
    out = {}
    torch.manual_seed(1)
    state = Llama(CFG).state_dict()
    for chunk in (0, 16, 7):
        m = Llama(ModelConfig(**{**CFG.__dict__, "loss_chunk": chunk, "fused_loss": False}))
        m.load_state_dict(state)
        sizes = {}

        def pack(t, sizes=sizes):
            if t.grad_fn is not None and type(t.grad_fn).__name__.startswith("LogSoftmaxBackward"):
                sizes[t.data_ptr()] = tuple(t.shape)  # saved twice (log-softmax and NLL): once here
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = m(x, tgt)
        loss.backward()
        per = m(x, tgt, reduction="none")
        out[chunk] = (loss.detach(), per.detach(), [p.grad.clone() for p in m.parameters()], list(sizes.values()))
    ref = out[0]
    for chunk in (16, 7):
        got = out[chunk]
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), chunk
        for a, b in zip(got[2], ref[2]):
            assert torch.equal(a, b), chunk
        assert got[3] == [(chunk, 97)] * (48 // chunk) + ([(48 % chunk, 97)] if 48 % chunk else []), chunk
    assert ref[3] == [(48, 97)]  # the one-piece form: the batch's log-softmax at once


def test_fused_proj_equals_separate_and_checkpoints_load_either_way():
    """``fused_proj`` (q/k/v and gate/up as one linear each): the same loss as the separate linears
    given the same weights, the fused weights' gradients the separate ones' stacked (up to summation
    order), the same saved bytes (attention's v copied out of the q/k/v output, which a view would
    keep alive whole), and a checkpoint of either layout loads into the other unchanged."""
    torch.manual_seed(0)
    a = Llama(ModelConfig(**{**CFG.__dict__, "fused_proj": False}))
    b = Llama(ModelConfig(**{**CFG.__dict__, "fused_proj": True}))
    assert {n for n, _ in b.named_parameters()} >= {"layers.0.self_attn.qkv_proj.weight", "layers.1.mlp.gate_up_proj.weight"}
    assert not any("q_proj" in n or "gate_proj" in n for n, _ in b.named_parameters())
    b.load_state_dict(a.state_dict())
    saved = _loss_and_saved_bytes({"sep": a, "fused": b})
    assert abs(saved["sep"][0] - saved["fused"][0]) < 1e-6
    assert saved["fused"][1] == saved["sep"][1]
    for i in range(CFG.n_layers):
        at, bt = a.layers[i].self_attn, b.layers[i].self_attn
        g = torch.cat([at.q_proj.weight.grad, at.k_proj.weight.grad, at.v_proj.weight.grad])
        assert torch.allclose(bt.qkv_proj.weight.grad, g, rtol=1e-5, atol=1e-7)
        am, bm = a.layers[i].mlp, b.layers[i].mlp
        g = torch.cat([am.gate_proj.weight.grad, am.up_proj.weight.grad])
        assert torch.allclose(bm.gate_up_proj.weight.grad, g, rtol=1e-5, atol=1e-7)
    c = Llama(ModelConfig(**{**CFG.__dict__, "fused_proj": False}))
    c.load_state_dict(b.state_dict())  # fused -> separate: the original weights, bit for bit
    for (n, p), q in zip(a.state_dict().items(), c.state_dict().values()):
        assert torch.equal(p, q), n


def test_fused_proj_trains_with_forge_and_agoq():
    """FORGE holds 4 fused layers a block instead of 7 (q/k/v and gate/up as one each), AGoQ gives
    the fused linears their separate ones' roles, and both layouts learn a batch alike from the
    same weights: to summation order with FORGE alone, to AGoQ's rounding noise with it."""
    import leantrain as lt
    from leantrain.agoq.hooks import role_of_module

    assert role_of_module("self_attn.qkv_proj", torch.nn.Linear(2, 2)) == "qkv_in"
    assert role_of_module("mlp.gate_up_proj", torch.nn.Linear(2, 2)) == "mlp_in"
    x = torch.randint(0, 97, (4, 17), generator=torch.Generator().manual_seed(1))
    for agoq in (False, True):
        losses = {}
        for fused in (False, True):
            torch.manual_seed(0)
            ref = Llama(CFG)
            m = Llama(ModelConfig(**{**CFG.__dict__, "fused_proj": fused}))
            m.load_state_dict(ref.state_dict())
            opt = lt.forge.attach(m, lt.optim.AdamW(lr=1e-2))
            assert len(opt.layers) == CFG.n_layers * (4 if fused else 7) + 1
            if agoq:
                lt.agoq.apply(m, lt.agoq.Policy())
            out = []
            for _ in range(6):  # (one batch again: memorized)
                loss = m(x[:, :-1], x[:, 1:])
                loss.backward()
                opt.step()
                opt.zero_grad()
                out.append(loss.item())
            losses[fused] = out
        assert losses[True][-1] < losses[True][0] - 1.0
        assert abs(losses[True][0] - losses[False][0]) < 1e-5  # step 1: the same weights
        tol = 0.1 * losses[False][-1] if agoq else 1e-3
        assert abs(losses[True][-1] - losses[False][-1]) < tol, (agoq, losses)

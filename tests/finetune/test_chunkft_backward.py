"""ChunkFT stepping its working set inside backward (``in_backward``), bf16 state and bf16
weights with stochastic rounding: against ChunkFT's own step-time update."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from leantrain import config as C
from leantrain.finetune import ChunkFT
from leantrain.model import Llama


def _llama(tie: bool = False, ckpt: bool = False, seed: int = 0, offload: bool = False) -> Llama:
    cfg = C.build("tiny", overrides={"model.dim": "48", "model.n_layers": "2", "model.n_heads": "4",
                                     "model.n_kv_heads": "2", "model.ffn_dim": "80", "model.max_seq_len": "32", "data.seq_len": "32",
                                     "model.tie_embeddings": str(tie).lower(),
                                     "model.activation_checkpointing": str(ckpt).lower(),
                                     "model.activation_offload": str(offload).lower()})
    cfg.model.vocab_size = 97
    torch.manual_seed(seed)
    return Llama(cfg.model)


def _batches(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 97, (2, 12), generator=g), torch.randint(0, 97, (2, 12), generator=g)) for _ in range(n)]


def _loss(model, idx, tgt):
    return F.cross_entropy(model(idx).flatten(0, 1).float(), tgt.flatten())


def _train(model, opt, batches, accum: int = 1):
    for i in range(0, len(batches), accum):
        for j, (idx, tgt) in enumerate(batches[i:i + accum]):
            with opt.no_sync() if j < accum - 1 else torch.enable_grad():
                _loss(model, idx, tgt).backward()
        opt.step()


def _assert_close(a, b, rtol=1e-5, atol=1e-6):
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.allclose(pa.float(), pb.float(), rtol=rtol, atol=atol), name


@pytest.mark.parametrize("tie", [False, True])
def test_in_backward_equals_the_step_time_update(tie):
    m0 = _llama(tie)
    a, b = copy.deepcopy(m0), copy.deepcopy(m0)
    oa = ChunkFT(a, "adamw", num_chunks=3, lr=1e-2, in_backward=True)
    ob = ChunkFT(b, "adamw", num_chunks=3, lr=1e-2)
    batches = _batches(7)
    _train(a, oa, batches)
    _train(b, ob, batches)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name  # (the same products, the same rule: the same bits)
    assert oa.chunk_steps == ob.chunk_steps == [3, 2, 2]
    assert not torch.equal(a.layers[0].self_attn.qkv_proj.weight, m0.layers[0].self_attn.qkv_proj.weight)


def test_in_backward_row_blocks():
    # small row blocks: each piece is stepped block by block from its block's gradient rows (the
    # products' rounding may differ from the whole piece's: one step, compared closely)
    m0 = _llama()
    a, b = copy.deepcopy(m0), copy.deepcopy(m0)
    oa = ChunkFT(a, "adamw", num_chunks=1, lr=1e-2, in_backward=True, block_elems=256)
    ob = ChunkFT(b, "adamw", num_chunks=1, lr=1e-2)
    batches = _batches(1)
    _train(a, oa, batches)
    _train(b, ob, batches)
    _assert_close(a, b, rtol=0, atol=1e-6)


def test_no_gradient_rows_are_held_after_backward():
    m = _llama()
    opt = ChunkFT(m, "adamw", num_chunks=2, lr=1e-2, in_backward=True)
    idx, tgt = _batches(1)[0]
    _loss(m, idx, tgt).backward()
    assert all(g is None for _, g in opt.grads.values())
    assert opt.stepped and all(pc.param.dim() > 1 for pc in opt.chunks[0] if opt._key(pc) in opt.stepped)
    # what remains on the device beyond the weights: the state arena and the 1-D weights' .grad
    plain = sum(pc.param.grad.numel() * 4 for pc in opt.chunks[0] if pc.param.grad is not None)
    assert opt.device_state_bytes() == opt.arena.numel() * 4 + plain
    opt.step()
    assert opt.last["grad_norm"] > 0 and not opt.stepped


@pytest.mark.parametrize("offload", [False, True])
def test_accumulation_under_no_sync_and_activation_checkpointing(offload):
    m0 = _llama()
    a = copy.deepcopy(m0)
    c = _llama(ckpt=True, offload=offload)
    c.load_state_dict(m0.state_dict())
    b = copy.deepcopy(m0)
    oa = ChunkFT(a, "adamw", num_chunks=2, lr=1e-2, in_backward=True)
    oc = ChunkFT(c, "adamw", num_chunks=2, lr=1e-2, in_backward=True)
    ob = ChunkFT(b, "adamw", num_chunks=2, lr=1e-2)
    batches = _batches(6, seed=1)
    for model, opt in ((a, oa), (b, ob), (c, oc)):
        _train(model, opt, batches, accum=2)
    _assert_close(a, b)
    _assert_close(c, b)


def test_clipping_in_backward_uses_the_chunks_last_norm():
    m0 = _llama()
    a, b = copy.deepcopy(m0), copy.deepcopy(m0)
    oa = ChunkFT(a, "sgd", num_chunks=2, lr=0.1, max_norm=0.05, in_backward=True)
    ob = ChunkFT(b, "sgd", num_chunks=2, lr=0.1)
    batches = _batches(4, seed=2)
    norms = []
    for i, (idx, tgt) in enumerate(batches):
        _loss(a, idx, tgt).backward()
        oa.step()
        # the reference: chunk k's first step unclipped, its later ones scaled by its previous norm
        ob.max_norm = 0.05 if i >= 2 else 0.0
        if i >= 2:
            ob.param_groups[0]["lr"] = 0.1 * min(1.0, 0.05 / (norms[i - 2] + 1e-6))
        _loss(b, idx, tgt).backward()
        ob.max_norm = 0.0
        ob.step()
        norms.append(oa.last["grad_norm"])
        assert oa.last["grad_norm"] == pytest.approx(ob.last["grad_norm"], rel=1e-4)
    assert min(norms) > 0.05  # (every step was clipped after the first visit)
    _assert_close(a, b)


def test_bf16_state_and_weights_resume_bit_for_bit():
    m0 = _llama().to(torch.bfloat16)
    batches = _batches(6, seed=3)
    kw = dict(num_chunks=3, lr=1e-3, in_backward=True, state_dtype="bf16", seed=5)
    a = copy.deepcopy(m0)
    oa = ChunkFT(a, "adamw", **kw)
    _train(a, oa, batches)
    assert oa.arena.dtype == torch.bfloat16 and oa._block.dtype == torch.bfloat16
    b = copy.deepcopy(m0)
    ob = ChunkFT(b, "adamw", **kw)
    _train(b, ob, batches[:4])
    sd, weights = ob.state_dict(), copy.deepcopy(b.state_dict())
    c = _llama(seed=7).to(torch.bfloat16)
    c.load_state_dict(weights)
    oc = ChunkFT(c, "adamw", **kw)
    oc.load_state_dict(sd)
    _train(c, oc, batches[4:])
    for (name, pa), pc in zip(a.named_parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pc), name
    with pytest.raises(ValueError, match="state_dtype"):
        ChunkFT(_llama().to(torch.bfloat16), "adamw", num_chunks=3).load_state_dict(sd)


def test_stochastic_rounding_keeps_small_updates_of_bf16_weights():
    m0 = _llama().to(torch.bfloat16)
    idx, tgt = _batches(1, seed=4)[0]
    moved = {}
    for sr in (False, True):
        m = copy.deepcopy(m0)
        opt = ChunkFT(m, "sgd", num_chunks=1, lr=1e-4, in_backward=True, stochastic_rounding=sr)
        _loss(m, idx, tgt).backward()
        opt.step()
        w, w0 = m.layers[0].mlp.down_proj.weight, m0.layers[0].mlp.down_proj.weight
        moved[sr] = (w != w0).float().mean().item()
    assert moved[False] < 0.01 < moved[True]  # (nearest rounding loses updates this small)


def test_bad_state_dtype():
    with pytest.raises(ValueError, match="state_dtype"):
        ChunkFT(_llama(), "adamw", state_dtype="int8")

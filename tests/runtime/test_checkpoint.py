"""Activation checkpointing (model.activation_checkpointing): the same loss, gradients and FORGE
updates as without it, bit for bit on the CPU, with only the blocks' inputs saved across the step."""

import copy
import dataclasses
import json

import pytest
import torch

import leantrain as lt
from helpers import tiny_config
from leantrain.config import ConfigError, preset
from leantrain.model import Llama
from leantrain.ops._backend import HAS_TRITON, interpreting
from leantrain.train.trainer import Trainer


def _models(small=False, offload=False, device="cpu"):
    cfg = preset("tiny").model
    if small:  # (the Triton interpreter runs every kernel program in Python)
        cfg = dataclasses.replace(cfg, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=128,
                                  max_seq_len=64)
    torch.manual_seed(0)
    plain = Llama(cfg).to(device)
    ck = copy.deepcopy(plain)
    ck.cfg = dataclasses.replace(cfg, activation_checkpointing=True, activation_offload=offload)
    return cfg, plain, ck


def _batch(cfg, seed=0, b=2, t=64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab_size, (b, t), generator=g) for _ in range(2)]


def _saved_bytes(model, batch):
    """Bytes of the tensors saved for backward that reach a hook outside the model."""
    seen = []

    def pack(t):
        seen.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(*batch)
    return loss, sum(seen)


@pytest.mark.parametrize("offload", [False, True])
def test_same_loss_and_gradients_with_fewer_saved_bytes(offload):
    cfg, plain, ck = _models(offload=offload)
    batch = _batch(cfg)
    l0, b0 = _saved_bytes(plain, batch)
    l1, b1 = _saved_bytes(ck, batch)
    assert torch.equal(l0, l1)
    l0.backward()
    l1.backward()
    for (name, p), q in zip(plain.named_parameters(), ck.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert b1 < 0.5 * b0, (b1, b0)
    if offload:  # the blocks' inputs are held by the offload, not saved through autograd: only the head's saves
        _, _, ck_only = _models()
        assert b1 < _saved_bytes(ck_only, batch)[1] - (cfg.n_layers - 1) * batch[0].numel() * cfg.dim * 4
    with torch.no_grad():  # evaluation: no checkpoint, the same values
        assert torch.equal(plain(*batch), ck(*batch))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
def test_offload_on_cuda_same_gradients_and_nothing_held_across_the_step():
    """On a GPU the blocks' inputs go to pinned host memory: the same gradients as checkpointing
    without offload, and between forward and backward the device holds none of the blocks' inputs."""
    cfg, _, ck = _models(device="cuda")
    off = copy.deepcopy(ck)
    off.cfg = dataclasses.replace(ck.cfg, activation_offload=True)
    batch = [t.cuda() for t in _batch(cfg, b=8, t=256)]
    held = []
    for m in (ck, off):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        loss = m(*batch)
        torch.cuda.synchronize()
        torch.empty(1, device="cuda")  # (the allocator frees blocks whose side-stream copies have ended)
        held.append(torch.cuda.memory_allocated() - base)
        loss.backward()
    for (name, p), q in zip(ck.named_parameters(), off.parameters()):
        assert torch.equal(p.grad, q.grad), name
    inputs = (cfg.n_layers - 1) * batch[0].numel() * cfg.dim * 4  # (fp32: every block's input but the first's)
    assert held[1] < held[0] - 0.9 * inputs, (held, inputs)


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_forge_with_checkpointing_equals_forge(backend, offload):
    """Each block's recompute reads its weights before its own backward updates them: three FORGE
    steps with checkpointing (and with its inputs offloaded) give the weights and states of three
    without, bit for bit."""
    if backend == "triton" and not (HAS_TRITON and interpreting()):
        pytest.skip("the Triton interpreter")
    cfg, plain, ck = _models(small=True, offload=offload)
    opts = [lt.forge.attach(m, lt.optim.AdamW(lr=1e-3, weight_decay=0.1), backend=backend, clip="prev_global",
                            clip_value=1.0) for m in (plain, ck)]
    for s in range(3):
        batch = _batch(cfg, seed=s, t=16)
        for m, o in zip((plain, ck), opts):
            m(*batch).backward()
            o.step()
            o.zero_grad()
    for (name, p), q in zip(plain.named_parameters(), ck.parameters()):
        assert torch.equal(p, q), name
        for k, v in opts[0].state[p].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(opts[1].state[q][k])), (name, k)


def test_trainer_refuses_checkpointing_with_agoq(corpus, tmp_path):
    cfg = tiny_config(corpus, **{"model.activation_checkpointing": "true", "agoq.enabled": "true"})
    with pytest.raises(ConfigError, match="activation_checkpointing and agoq"):
        Trainer(cfg, tmp_path / "run")


def test_offload_needs_checkpointing_and_one_process(corpus, tmp_path):
    with pytest.raises(ConfigError, match="activation-checkpointing true"):
        tiny_config(corpus, **{"model.activation_offload": "true"})
    cfg = tiny_config(corpus, **{"model.activation_checkpointing": "true", "model.activation_offload": "true",
                                 "dist.mode": "fsdp"})
    with pytest.raises(ConfigError, match="activation_offload runs in one process"):
        Trainer(cfg, tmp_path / "run")


def test_trainer_with_checkpointing_follows_the_plain_run(corpus, tmp_path):
    curves = []
    for ck, off in (("false", "false"), ("true", "false"), ("true", "true")):
        cfg = tiny_config(corpus, **{"train.steps": "3", "train.eval_every": "0", "train.ckpt_every": "0",
                                     "model.activation_checkpointing": ck, "model.activation_offload": off,
                                     "forge.enabled": "true"})
        tr = Trainer(cfg, tmp_path / f"c{ck}{off}")
        tr.fit()
        curves.append([json.loads(x)["loss"] for x in
                       (tmp_path / f"c{ck}{off}" / "metrics.jsonl").read_text().splitlines()])
    assert curves[0] == curves[1] == curves[2]

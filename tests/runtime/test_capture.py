"""GraphedStep: a captured forward + backward gives the eager step's loss and gradients."""

import copy
import json

import pytest
import torch

from helpers import tiny_config
from leantrain.agoq import Policy, apply
from leantrain.config import ConfigError, preset
from leantrain.model import Llama
from leantrain.runtime.capture import GraphedStep
from leantrain.train.trainer import Trainer


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU error path")
def test_needs_cuda():
    m = torch.nn.Linear(4, 4)
    with pytest.raises(RuntimeError, match="CUDA"):
        GraphedStep(lambda x: m(x).sum(), m.parameters(), torch.zeros(2, 4))


def test_forge_on_torch_backend_is_refused_and_detach_releases_the_module():
    import leantrain as lt
    from leantrain.model.extension import owner_of

    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = lt.forge.attach(m, lt.optim.AdamW(lr=1e-3), backend="torch")
    assert owner_of(m[0]) == "FORGE" and owner_of(m[1]) is None
    with pytest.raises(ValueError, match="FORGE needs the Triton backend"):  # (checked before anything needs CUDA)
        GraphedStep(lambda x: m(x).sum(), m.parameters(), torch.zeros(2, 4), hooks=[opt.capture_hooks])
    lt.forge.detach(m)
    assert owner_of(m[0]) is None and "forward" not in m[0].__dict__


def _grads(m):
    return [p.grad.float().clone() for p in m.parameters()]


def _rel(a, b):
    return max(((x - y).norm() / y.norm().clamp_min(1e-30)).item() for x, y in zip(a, b))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("agoq", [False, True])
def test_graph_replay_equals_eager(agoq):
    """Replays on two new batches: each batch's loss and gradients equal an eager step's on it.
    AGoQ rounds to nearest here (its stochastic seeds are frozen at capture, eager ones are not):
    the captured save path must pack and unpack exactly what the eager one does."""
    cfg = preset("tiny").model
    torch.manual_seed(0)
    m = Llama(cfg).cuda().to(torch.bfloat16)
    if agoq:
        apply(m, Policy(stochastic=False))
    g = torch.Generator().manual_seed(0)
    batch = lambda: [torch.randint(0, cfg.vocab_size, (4, 128), generator=g).cuda() for _ in range(2)]
    step = GraphedStep(lambda i, t: m(i, t), m.parameters(), *batch())
    for _ in range(2):
        b = batch()
        got_loss = step(*b).float().item()
        got = _grads(m)
        for p in m.parameters():
            p.grad = None
        loss = m(*b)
        loss.backward()
        assert got_loss == pytest.approx(loss.float().item(), rel=1e-4)
        assert _rel(got, _grads(m)) < 2e-2
    if agoq:
        from leantrain.ops.multi import _CAPTURED_TABLES

        assert _CAPTURED_TABLES, "AGoQ's launch tables were not taken from page-locked memory in capture"
    with pytest.raises(ValueError, match="shape"):
        step(torch.zeros(2, 128, dtype=torch.long, device="cuda"), b[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_replays_round_with_new_noise():
    """AGoQ with stochastic rounding: two replays on one batch give the same loss and different
    gradients (each replay's salt changes the rounding keys), each within AGoQ's error bound of
    the unquantized gradient (tests/agoq/test_agoq_hooks.py: TOTAL_BOUND)."""
    cfg = preset("tiny").model
    torch.manual_seed(0)
    m = Llama(cfg).cuda().to(torch.bfloat16)
    plain = copy.deepcopy(m)
    apply(m, Policy())
    g = torch.Generator().manual_seed(0)
    b = [torch.randint(0, cfg.vocab_size, (4, 128), generator=g).cuda() for _ in range(2)]
    plain(*b).backward()
    ref = _grads(plain)
    step = GraphedStep(lambda i, t: m(i, t), m.parameters(), *b)
    l1, g1 = step(*b).item(), _grads(m)
    l2, g2 = step(*b).item(), _grads(m)
    assert l1 == l2
    assert any(not torch.equal(x, y) for x, y in zip(g1, g2))
    for got in (g1, g2):
        err = (sum(((x - y) ** 2).sum() for x, y in zip(got, ref)) / sum((y ** 2).sum() for y in ref)).sqrt()
        assert err.item() < 0.2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["fp32_weights", "bf16_sr_fp32_states", "bf16_sr_int8_states", "bf16_sr_ws"])
def test_graphed_forge_equals_eager_forge(case, monkeypatch):
    """FORGE captured in the graph (AdamW, clip by the estimated global norm, the learning rate
    changed before every step): replays, each followed by opt.step(), give the eager FORGE run's
    losses, weights and step counts. The graph's kernels are not the eager ones bit for bit (cuBLAS
    and SDPA choose under capture), so the bound is a tolerance: fp32 weights within 1e-3 of the
    largest weight (a replay with a stale lr, step or bias correction is off by more: the lr
    alternates 1e-3 / 3e-3); bf16 weights with stochastic rounding (same keys) within 1e-2.
    ``bf16_sr_ws``: every linear through the warp-specialized kernel (``ws_tokens``, no clipping, an
    sm_90 GPU), the captured launches reading the step's scalars from the device table."""
    import leantrain as lt
    from leantrain.forge import ws

    calls = []
    if case == "bf16_sr_ws":
        if not ws.available():
            pytest.skip("needs an sm_90 GPU and Gluon")
        real = ws.launch_ws
        monkeypatch.setattr(ws, "launch_ws", lambda *a, **kw: calls.append(kw.get("dyn") is not None) or real(*a, **kw))

    cfg = preset("tiny").model
    torch.manual_seed(0)
    ref_model = Llama(cfg).cuda()
    if case != "fp32_weights":
        ref_model = ref_model.to(torch.bfloat16)
    model = copy.deepcopy(ref_model)
    kw = dict(state_dtype="int8" if case.endswith("int8_states") else "fp32", clip="est_global", clip_value=1.0,
              seed=5)
    if case == "bf16_sr_ws":
        kw = dict(state_dtype="fp32", seed=5, ws_tokens=1 << 30)  # (bf16 states stay on the split path)
    rule = lambda: lt.optim.AdamW(lr=1e-3, eps=1e-3, weight_decay=0.1)  # noqa: E731
    ref, opt = lt.forge.attach(ref_model, rule(), **kw), lt.forge.attach(model, rule(), **kw)
    g = torch.Generator().manual_seed(0)
    data = [[torch.randint(0, cfg.vocab_size, (4, 128), generator=g).cuda() for _ in range(2)] for _ in range(5)]
    ref_losses, losses = [], []
    step = None
    for i, b in enumerate(data):
        for o in (ref, opt):
            o.param_groups[0]["lr"] = 1e-3 if i % 2 else 3e-3
        ref_loss = ref_model(*b)
        ref_loss.backward()
        ref_losses.append(ref_loss.detach().float())
        ref.step()
        ref.zero_grad(set_to_none=True)
        if i == 0:  # est_global: one eager step before the capture
            loss = model(*b)
            loss.backward()
        else:
            if step is None:
                step = GraphedStep(lambda x, y: model(x, y), model.parameters(), *b, hooks=[opt.capture_hooks])
            loss = step(*b)
        losses.append(loss.detach().float().clone())
        del loss  # (an eager step's autograd graph kept alive through the capture would invalidate it)
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert torch.stack(losses).tolist() == pytest.approx(torch.stack(ref_losses).tolist(), rel=1e-3)
    worst = max(((p.float() - q.float()).abs().max() / q.float().abs().max()).item()
                for p, q in zip(model.parameters(), ref_model.parameters()))
    assert worst < (1e-3 if case == "fp32_weights" else 1e-2), worst
    assert opt.state[model.layers[0].self_attn.o_proj.weight]["step"] == len(data)
    if case == "bf16_sr_ws":  # the captured launches read the table; the eager runs' do not
        assert any(calls) and not all(calls)
    with pytest.raises(RuntimeError, match="replayed twice"):
        step(*data[0])
        step(*data[0])


def test_trainer_says_what_cuda_graph_needs(corpus, tmp_path):
    cfg = tiny_config(corpus, **{"train.cuda_graph": "true", "train.device": "cpu", "forge.enabled": "true",
                                 "forge.backend": "torch"})
    with pytest.raises(ConfigError, match="cuda_graph needs FORGE on its Triton backend"):
        Trainer(cfg, tmp_path / "run")
    cfg = tiny_config(corpus, **{"train.cuda_graph": "true", "train.device": "cpu", "forge.enabled": "true"})
    with pytest.raises(ConfigError, match="cuda_graph needs a CUDA device"):
        Trainer(cfg, tmp_path / "run1")
    cfg = tiny_config(corpus, **{"train.cuda_graph": "true", "forge.enabled": "true", "train.on_nonfinite": "skip"})
    with pytest.raises(ConfigError, match="with FORGE needs train.on_nonfinite stop"):
        Trainer(cfg, tmp_path / "run2")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("extra", [{}, {"agoq.enabled": "true", "agoq.stochastic": "false"},
                                   {"forge.enabled": "true"},
                                   {"forge.enabled": "true", "forge.state_dtype": "int8", "agoq.enabled": "true",
                                    "agoq.stochastic": "false"}])
def test_trainer_cuda_graph_follows_the_eager_run(corpus, tmp_path, extra):
    """The trainer with train.cuda_graph: its loss curve equals the eager trainer's (step 1 runs
    eagerly, the graph is captured at step 2 and replayed from then on)."""
    curves = []
    for graph in ("false", "true"):
        cfg = tiny_config(corpus, **{"train.steps": "8", "train.eval_every": "0", "train.ckpt_every": "0",
                                     "train.device": "cuda", "train.cuda_graph": graph, **extra})
        out = tmp_path / f"g{graph}"
        tr = Trainer(cfg, out)
        tr.fit()
        assert (tr.graph is not None) == (graph == "true")
        curves.append([json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()])
    assert len(curves[1]) == 8
    assert curves[1] == pytest.approx(curves[0], rel=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_trainer_cuda_graph_with_eval_checkpoint_and_resume(corpus, tmp_path):
    """Evaluation and checkpoints between replays, then a resumed run (a new capture): the loss
    curve of the interrupted + resumed run follows the straight one."""
    extra = {"train.steps": "10", "train.eval_every": "3", "train.ckpt_every": "5", "train.device": "cuda",
             "train.cuda_graph": "true"}
    Trainer(tiny_config(corpus, **extra), tmp_path / "a").fit()
    Trainer(tiny_config(corpus, **extra), tmp_path / "b").fit(until=5)
    resumed = Trainer(tiny_config(corpus, **extra), tmp_path / "b", resume=True)
    assert resumed.step == 5
    resumed.fit()
    assert resumed.graph is not None
    rows = {d: [json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()] for d in "ab"}
    assert [r["step"] for r in rows["b"]] == list(range(1, 11))
    assert [r["step"] for r in rows["a"] if "val_loss" in r] == [3, 6, 9, 10]
    assert [r["loss"] for r in rows["b"]] == pytest.approx([r["loss"] for r in rows["a"]], rel=2e-3)

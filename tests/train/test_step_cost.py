"""What the trainer's step costs beyond the model's own work: no host-device synchronization on a
step that logs nothing, and no aten op beyond a bare PyTorch step's but the loss's detach.

Ops are counted by a ``TorchDispatchMode`` (every aten op below autograd, backward's included).
A host sync is an op that reads a tensor's value on the host (``.item()``, ``float(t)``,
``bool(t)``: ``aten::_local_scalar_dense``; ``torch.equal``, ``nonzero``, a copy to the CPU) or a
``Tensor.tolist`` (on a CPU tensor no aten op at all, so it is counted by its Python call)."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import tiny_config
from leantrain.train.trainer import Trainer

aten = torch.ops.aten
SYNC_OPS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.item.default, aten.equal.default,
            aten.nonzero.default, aten.masked_select.default}
LOG_EVERY, STEPS = 4, 10


class StepOps(TorchDispatchMode):
    """Aten ops and host syncs per step of ``trainer.fit``: a step's bucket runs from its
    ``train_step`` call to the next (the loop's bookkeeping after a step is in that step's)."""

    def __init__(self, trainer: Trainer, *, skip_optimizer: bool = False):
        super().__init__()
        self.ops: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        self.syncs: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        self.step = 0  # the 1-based step whose bucket is open (0: before the first)
        self.paused = False
        real_step = trainer.train_step

        def train_step(*a, **k):
            self.step = trainer.step + 1
            return real_step(*a, **k)

        trainer.train_step = train_step
        if skip_optimizer:
            trainer.opt.register_step_pre_hook(lambda *_: setattr(self, "paused", True))
            trainer.opt.register_step_post_hook(lambda *_: setattr(self, "paused", False))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused:
            self.ops[self.step][str(func)] += 1
            to_host = func is aten._to_copy.default and str(kwargs.get("device")) == "cpu" and any(
                isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in args)
            if func in SYNC_OPS or to_host:
                self.syncs[self.step][str(func)] += 1
        return func(*args, **kwargs)

    def count_tolist(self, monkeypatch) -> None:
        real = torch.Tensor.tolist

        def tolist(t):
            if not self.paused:
                self.syncs[self.step]["Tensor.tolist"] += 1
            return real(t)

        monkeypatch.setattr(torch.Tensor, "tolist", tolist)


def _fit_counted(corpus, tmp_path, monkeypatch, *, baseline: bool, **extra) -> tuple[Trainer, StepOps]:
    cfg = tiny_config(corpus, **{"train.steps": str(STEPS), "train.log_every": str(LOG_EVERY),
                                 "train.eval_every": "0", "train.ckpt_every": "0", **extra})
    tr = Trainer(cfg, tmp_path / "run", baseline=baseline)
    # torch's AdamW on the CPU (single-tensor path) reads each parameter's step counter, a CPU
    # tensor, with .item(); on CUDA the trainer's AdamW is fused=True, which reads none on the host
    counter = StepOps(tr, skip_optimizer=baseline)
    counter.count_tolist(monkeypatch)
    with counter:
        tr.fit()
    return tr, counter


def _between_logs() -> list[int]:
    """The steps whose bucket should read nothing on the host: not the first (the memory ledger's
    measured step), not the last (the final flush), and not one issued right after a log step
    (its ``add`` writes the rows up to the log step)."""
    return [s for s in range(2, STEPS) if (s - 1) % LOG_EVERY]


RECIPES = {"reference": (False, {}), "baseline": (True, {}),
           "forge_agoq": (False, {"forge.enabled": "true", "agoq.enabled": "true"})}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_no_host_sync_between_log_steps(corpus, tmp_path, monkeypatch, recipe):
    baseline, extra = RECIPES[recipe]
    _, counter = _fit_counted(corpus, tmp_path, monkeypatch, baseline=baseline, **extra)
    assert {s: dict(counter.syncs[s]) for s in _between_logs() if counter.syncs[s]} == {}
    # (the rows are read: once after each log step, and at the end)
    for step in [s for s in range(2, STEPS + 1) if (s - 1) % LOG_EVERY == 0] + [STEPS]:
        assert counter.syncs[step], f"step {step}: the rows were not read"


def test_every_step_between_log_steps_issues_the_same_ops(corpus, tmp_path, monkeypatch):
    _, counter = _fit_counted(corpus, tmp_path, monkeypatch, baseline=True)
    steps = _between_logs()
    assert all(counter.ops[s] == counter.ops[steps[0]] for s in steps[1:])


def test_the_trainer_step_adds_only_the_loss_detach_to_a_bare_torch_step(corpus, tmp_path):
    """``train_step`` under ``--baseline`` against forward, backward, clip, AdamW's step, zero_grad
    and the scheduler's step written out on the same trainer's objects: the one op more is the
    ``detach`` of the loss the row keeps."""
    cfg = tiny_config(corpus, **{"train.steps": "4", "train.eval_every": "0", "train.ckpt_every": "0"})
    tr = Trainer(cfg, tmp_path / "run", baseline=True)
    d = cfg.data

    def bare_step():
        x, y = tr.data.batch("train", d.seq_len, d.batch_size, seed=cfg.train.seed, step=tr.step, device=tr.device)
        loss = tr.model(x, y) / d.grad_accum
        loss.backward()
        torch.nn.utils.clip_grad_norm_(tr.model.parameters(), cfg.optim.grad_clip)
        tr.opt.step()
        tr.opt.zero_grad(set_to_none=True)
        tr.sched.step()

    counts = []
    for step in (tr.train_step, bare_step, tr.train_step, bare_step):  # (the first of each: warm-up)
        with StepOps(tr) as counter:
            step()
        counts.append(sum(counter.ops.values(), collections.Counter()))
    trainer_ops, bare_ops = counts[2], counts[3]
    assert cfg.optim.grad_clip > 0 and d.grad_accum == 1
    assert dict(trainer_ops - bare_ops) == {"aten.detach.default": 1} and not bare_ops - trainer_ops

"""Shared helpers of the FORGE tests: small models, a training loop, rule factories."""

from __future__ import annotations

import copy

import torch
from torch import nn

import leantrain as lt

RULES = {
    "sgd": lambda: lt.optim.SGD(lr=0.05, weight_decay=0.01),
    "sgd_mom": lambda: lt.optim.SGD(lr=0.05, momentum=0.9, weight_decay=0.01),
    "sgd_nesterov": lambda: lt.optim.SGD(lr=0.05, momentum=0.9, nesterov=True),
    "adamw": lambda: lt.optim.AdamW(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1),
    "lion": lambda: lt.optim.Lion(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1),
    "adams": lambda: lt.optim.AdamS(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.05),
}


class Net(nn.Module):
    """Two linears around a LayerNorm (a non-linear parameter stepped by opt.step())."""

    def __init__(self, k=33, h=65, n=17, bias=True):
        super().__init__()
        self.fc1 = nn.Linear(k, h, bias=bias)
        self.norm = nn.LayerNorm(h)
        self.fc2 = nn.Linear(h, n, bias=bias)

    def forward(self, x):
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


def batches(steps, shape=(2, 12, 33), seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(dtype) for _ in range(steps)]


def train(model, opt, data, loss_fn=None):
    for x in data:
        out = model(x)
        loss = loss_fn(out) if loss_fn else out.float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model


def pair(model):
    return model, copy.deepcopy(model)


def square_loss(model, x):
    return model(x).float().square().mean()


def assert_same_run(a_model, a_opt, b_model, b_opt):
    """Two runs' parameters and optimizer states are equal bit for bit."""
    for (name, p), q in zip(a_model.named_parameters(), b_model.parameters()):
        assert torch.equal(p, q), name
        sa, sb = a_opt.state[p], b_opt.state[q]
        assert sa.keys() == sb.keys(), name
        for k in sa:
            assert torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k])), (name, k)


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (the 'relative' error of the exactness statement)."""
    a, b = a.detach(), b.detach()
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))

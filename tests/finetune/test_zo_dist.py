"""MeZO and GRZO on 2 gloo ranks, each with half of the batch, give the single process's update
on the whole batch; the ranks stay identical and send only their losses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dist_utils import run_distributed
from leantrain import config as C
from leantrain.finetune import GRZO, MeZO
from leantrain.model import Llama
from leantrain.runtime.ledger import CommLedger

pytestmark = pytest.mark.distributed

BATCH, SEQ, VOCAB, STEPS = 8, 12, 64, 3


def _setup():
    cfg = C.build("tiny", overrides={"model.dim": "32", "model.n_layers": "1", "model.n_heads": "2",
                                     "model.n_kv_heads": "1", "model.ffn_dim": "64", "model.vocab_size": str(VOCAB)})
    torch.manual_seed(0)
    model = Llama(cfg.model)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    tgt = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return model, idx, tgt


def _train(method: str, rank: int, world: int):
    model, idx, tgt = _setup()
    part = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    x, y = idx[part], tgt[part]

    def per_example():
        logits = model(x)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(y.shape).mean(1)

    if method == "mezo":
        # (the mean in fp64: MeZO's g = (ℓ₊ - ℓ₋) / 2ε multiplies a loss's rounding by 500, and one mean of 8
        # fp32 numbers and two of 4 round differently)
        opt, closure = MeZO(model.parameters(), lr=1e-2, eps=1e-3, seed=4), lambda: per_example().double().mean()
    else:
        opt, closure = GRZO(model, lr=1e-3, sigma=1e-3, seed=4), per_example
    with CommLedger().capture() as ledger:
        for _ in range(STEPS):
            opt.step(closure)
    # (numpy: pickled by value, not through shared memory that a finished rank takes away)
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}, ledger.total, opt.last["loss"]


def _worker(rank, world, method):
    return _train(method, rank, world)


@pytest.mark.parametrize("method", ["mezo", "grzo"])
def test_two_ranks_equal_one_process_on_the_whole_batch(method):
    ref, sent, loss = _train(method, 0, 1)
    assert sent == 0
    res = run_distributed(_worker, 2, args=(method,))
    model0, _, _ = _setup()
    moved = max(float(abs(ref[n] - p.detach().numpy()).max()) for n, p in model0.named_parameters())
    assert moved > 1e-5  # the steps changed the weights
    for params, nbytes, rank_loss in res:
        for n, p in ref.items():
            torch.testing.assert_close(torch.from_numpy(params[n]), torch.from_numpy(p), rtol=0, atol=1e-6)
        assert abs(rank_loss - loss) < 1e-5  # every rank reports the global batch's loss
        # only the losses travel: MeZO 2 fp64 numbers a step (an all-reduce: 16 bytes sent on 2 ranks), GRZO
        # the loss count (8 bytes) and 2·B/2 fp32 losses a step
        per_step = 16 if method == "mezo" else 8 + 2 * (BATCH // 2) * 4
        assert nbytes == STEPS * per_step, nbytes
    for n in ref:
        assert (res[0][0][n] == res[1][0][n]).all()  # the ranks are identical, bit for bit

"""``--train.compile true``: each block through ``torch.compile`` (the ``aot_eager`` backend here: the
graphs dynamo captures, run without code generation). Every technique that runs compiled gives the
eager run's losses; the others refuse it with one sentence."""

import json

import pytest

from helpers import tiny_config
from leantrain.config import ConfigError
from leantrain.train.trainer import Trainer

RECIPES = {
    "reference": {},
    "forge": {"forge.enabled": "true"},
    "chunkft": {"finetune.method": "chunkft"},
    "mezo": {"finetune.method": "mezo"},
}
REFUSED = {
    "agoq": {"agoq.enabled": "true"},
    "forge+agoq": {"forge.enabled": "true", "agoq.enabled": "true"},
    "grzo": {"finetune.method": "grzo"},
}
STEPS = {"train.steps": "3", "train.eval_every": "0", "train.ckpt_every": "0"}


def _losses(corpus, out, recipe: dict, compiled: bool) -> list[float]:
    extra = {"train.compile": "true", "train.compile_backend": "aot_eager"} if compiled else {}
    Trainer(tiny_config(corpus, **STEPS, **recipe, **extra), out).fit()
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", list(RECIPES))
def test_compiled_blocks_train_as_eager(corpus, tmp_path, name):
    eager = _losses(corpus, tmp_path / "eager", RECIPES[name], False)
    compiled = _losses(corpus, tmp_path / "compiled", RECIPES[name], True)
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-6), (name, eager, compiled)


@pytest.mark.parametrize("name", list(REFUSED))
def test_techniques_that_cannot_run_compiled_refuse(corpus, tmp_path, name):
    with pytest.raises(ConfigError, match="train.compile"):
        _losses(corpus, tmp_path / "x", REFUSED[name], True)


def test_compile_and_cuda_graph_are_refused_together(corpus, tmp_path):
    cfg = tiny_config(corpus, **{"train.compile": "true", "train.cuda_graph": "true"})
    with pytest.raises(ConfigError, match="choose one"):
        Trainer(cfg, tmp_path / "x")


DIST_RECIPES = {
    "ddp-int8": {"comm.method": "int8"},
    "sharded-sdp4bit": {"dist.mode": "sharded", "comm.method": "sdp4bit"},
    "gift": {"comm.method": "gift"},
}


def _rank_losses(rank, world, corpus, out, compiled):
    import torch

    torch.set_num_threads(1)
    return {name: _losses(corpus, out / f"{name}-{compiled}", recipe, compiled) for name, recipe in DIST_RECIPES.items()}


@pytest.mark.distributed
def test_compiled_blocks_under_two_ranks(corpus, tmp_path):
    """DDP with a compressed all-reduce, the sharded optimizer with SDP4Bit, GIFT: the same losses
    compiled as eager (their work is on the gradients after each block's backward)."""
    from dist_utils import run_distributed

    eager, compiled = (run_distributed(_rank_losses, 2, args=(corpus, tmp_path, flag))[0] for flag in (False, True))
    for name in DIST_RECIPES:
        assert compiled[name] == pytest.approx(eager[name], rel=1e-5, abs=1e-6), name

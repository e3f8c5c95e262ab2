"""Fine-tuning tasks the project generates itself: small classification problems written as Python
(the embedded corpus's language), answered by one token among a few candidates.

- ``compare``: ``max(3, 7) == `` → ``7`` (candidates: the two digits).
- ``lookup``: ``d = {'a': 3, 'b': 7, 'c': 1}\\nd['b'] == `` → ``7`` (candidates: the three values).
- ``parity``: ``sum([1, 0, 1, 1]) % 2 == `` → ``1`` (candidates: ``0``, ``1``).

Answers are single digits after a space that ends the prompt: a byte-level BPE keeps each digit
one token of its own there, whatever its vocabulary.

An example is scored by the model's logits at its last prompt token, restricted to its
candidates' tokens: the loss is the cross-entropy over the candidates (one number per example,
what GRZO needs), the accuracy the share of examples whose right candidate scores highest.
Prompts of a batch are right-padded (the causal model never attends to the padding before the
scored position). Examples are a function of (task, seed, index): the train and eval sets use
different seeds.

As a run's data (``--finetune.task``, :func:`task_data`): each training example is its prompt's
tokens followed by the right candidate's token, the loss on that token only (over the whole
vocabulary), one example a row; evaluation scores held-out examples by the choice among their
candidates (:func:`accuracy`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

TASKS = ("compare", "lookup", "parity")
TRAIN_EXAMPLES = 16384  # a run's training pool of a task (drawn in a new order each epoch)


@dataclass
class Example:
    prompt: str
    candidates: list[str]
    label: int  # index into candidates


def _compare(rng: random.Random) -> Example:
    a, b = rng.sample(range(10), 2)
    return Example(f"max({a}, {b}) == ", [f"{a}", f"{b}"], 0 if a > b else 1)


def _lookup(rng: random.Random) -> Example:
    keys = rng.sample("abcdefgh", 3)
    vals = rng.sample(range(10), 3)
    q = rng.randrange(3)
    body = ", ".join(f"'{k}': {v}" for k, v in zip(keys, vals, strict=True))
    return Example(f"d = {{{body}}}\nd['{keys[q]}'] == ", [f"{v}" for v in vals], q)


def _parity(rng: random.Random) -> Example:
    bits = [rng.randrange(2) for _ in range(rng.randint(3, 6))]
    return Example(f"sum([{', '.join(map(str, bits))}]) % 2 == ", ["0", "1"], sum(bits) % 2)


_MAKERS = {"compare": _compare, "lookup": _lookup, "parity": _parity}


def examples(task: str, n: int, seed: int) -> list[Example]:
    """``n`` examples of ``task`` (one of ``TASKS``) drawn with ``seed``."""
    if task not in _MAKERS:
        raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    rng = random.Random(f"{task}:{seed}")
    return [_MAKERS[task](rng) for _ in range(n)]


@dataclass
class Batch:
    idx: Tensor  # [B, T] prompt tokens, right-padded
    last: Tensor  # [B] position of each prompt's last token
    cand: Tensor  # [B, C] candidate token ids
    label: Tensor  # [B]

    def to(self, device) -> Batch:
        return Batch(self.idx.to(device), self.last.to(device), self.cand.to(device), self.label.to(device))


def _pad_id(tok) -> int:
    return tok.eot_id if tok.eot_id is not None else 0


def _candidate_ids(exs: list[Example], tok) -> list[list[int]]:
    """Each example's candidates' first tokens (each distinct text encoded once)."""
    first: dict[str, int] = {}
    out = []
    for e in exs:
        ids = [first[c] if c in first else first.setdefault(c, tok.encode(c)[0]) for c in e.candidates]
        if len(set(ids)) != len(ids):
            raise ValueError(f"candidates {e.candidates!r} cannot be told apart by one token under this tokenizer")
        out.append(ids)
    return out


def encode(exs: list[Example], tok, pad_id: int) -> Batch:
    """Token ids of the prompts and of each candidate's first token (the candidates of an example
    must start with different tokens: a ValueError otherwise; the built-in digits always do)."""
    ids = tok.encode_batch([e.prompt for e in exs])
    cands = _candidate_ids(exs, tok)
    t = max(len(i) for i in ids)
    idx = torch.full((len(exs), t), pad_id, dtype=torch.long)
    for b, i in enumerate(ids):
        idx[b, : len(i)] = torch.tensor(i)
    return Batch(idx, torch.tensor([len(i) - 1 for i in ids]), torch.tensor(cands), torch.tensor([e.label for e in exs]))


def candidate_logits(model, batch: Batch) -> Tensor:
    """``[B, C]`` fp32 logits of each example's candidates at its last prompt token."""
    logits = model(batch.idx)  # [B, T, V]
    rows = logits[torch.arange(batch.idx.shape[0], device=logits.device), batch.last]  # [B, V]
    return rows.gather(1, batch.cand).float()


def losses(model, batch: Batch) -> Tensor:
    """Per-example cross-entropy over the candidates, ``[B]``."""
    return F.cross_entropy(candidate_logits(model, batch), batch.label, reduction="none")


@torch.no_grad()
def accuracy(model, batch: Batch, chunk: int = 64) -> tuple[float, float]:
    """(accuracy, mean loss) on ``batch``, ``chunk`` examples a forward."""
    right, total, n = 0, 0.0, batch.idx.shape[0]
    for i in range(0, n, chunk):
        part = Batch(batch.idx[i:i + chunk], batch.last[i:i + chunk], batch.cand[i:i + chunk], batch.label[i:i + chunk])
        logit = candidate_logits(model, part)
        right += int((logit.argmax(1) == part.label).sum())
        total += float(F.cross_entropy(logit, part.label, reduction="sum"))
    return right / n, total / n


def task_data(task: str, tok, *, n_train: int, seq_len: int, seed: int, grad_accum: int = 1):
    """``n_train`` examples of ``task`` as the rows of an :class:`leantrain.data.ExampleData`
    (no validation split: the run scores :func:`eval_batch`'s examples)."""
    from leantrain.config import ConfigError
    from leantrain.data.packing import ExampleData, pack_rows

    exs = examples(task, n_train, seed=seed)
    ids = tok.encode_batch([e.prompt for e in exs])
    longest = max(len(i) for i in ids)
    if longest > seq_len:
        raise ConfigError(f"the {task} task's prompts take up to {longest} tokens; raise data.seq_len "
                          f"(now {seq_len}) to at least that")
    cands = _candidate_ids(exs, tok)
    rows = [(i + [c[e.label]], [False] * len(i) + [True]) for i, c, e in zip(ids, cands, exs, strict=True)]
    packed = pack_rows(rows, seq_len, pack=False, pad_id=_pad_id(tok))
    return ExampleData(packed, packed, tok, tok.vocab_size, f"the generated {task} task", seq_len, False, grad_accum)


def eval_batch(task: str, tok, n: int, seed: int) -> Batch:
    """``n`` held-out examples of ``task`` (drawn with another seed than training's) as a :class:`Batch`."""
    return encode(examples(task, n, seed=1_000_003 + seed), tok, _pad_id(tok))


__all__ = ["TASKS", "Example", "Batch", "examples", "encode", "candidate_logits", "losses", "accuracy",
           "task_data", "eval_batch"]

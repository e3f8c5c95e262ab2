"""What a run scores at each evaluation, and how: ``evalset.score(model) -> {"loss", ...}``.

- :class:`SplitEval`: ``train.eval_batches`` batches of the data's validation split (the
  ``data.val_fraction`` held out), the mean loss;
- :class:`RowsEval`: every row of a held-out file (``data.eval_path``; a record file as training
  reads one, a ``DatasetDict`` directory through its validation or test split): text cut into windows of
  ``data.seq_len + 1`` tokens overlapping by one, or instruct / chat examples as training lays them
  out; the loss per predicted token, over the whole file;
- :class:`ChoiceEval`: multiple-choice lines ``{"prompt", "choices", "answer"}`` scored as
  lm-eval-harness scores them (each choice's summed log-probability after the prompt):
  ``accuracy``, ``accuracy_norm`` (per character of the choice) and ``loss`` (the right choice's
  negative log-likelihood, a mean over the examples);
- :class:`TaskEval`: a generated task's held-out examples (:mod:`leantrain.data.tasks`):
  ``accuracy`` among the candidates and their cross-entropy as ``loss``.

Under torchrun each rank scores its share (every ``world``-th item) and the sums are all-reduced:
every rank gets the whole set's figures.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from leantrain.config import Config, ConfigError
from leantrain.data import tasks
from leantrain.data.examples import ChatTemplate, encode_example, record_format_of, records
from leantrain.data.packing import Rows, pack_rows
from leantrain.data.records import EVAL_SPLITS, dataset_split
from leantrain.data.sources import user_source


def _all_sum(values: list[float], device, world: int) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(t)
    return t.tolist()


def text_rows(path: Path, tok, seq_len: int) -> Rows:
    """The documents' ids (each followed by the end-of-text id) in windows of ``seq_len + 1`` tokens
    that overlap by one: every token after the first is predicted once."""
    ids: list[int] = []
    for doc in user_source(path, log=lambda *a: None).documents():
        for piece_ids in tok.encode_batch(list(doc.pieces())):
            ids.extend(piece_ids)
        if tok.eot_id is not None:
            ids.append(tok.eot_id)
    windows = [(ids[s:s + seq_len + 1], [True] * len(ids[s:s + seq_len + 1])) for s in range(0, len(ids) - 1, seq_len)]
    return pack_rows([w for w in windows if len(w[0]) > 1], seq_len, pack=False, pad_id=0)


def example_rows(path: Path, fmt: str, tok, seq_len: int, *, mask_prompt: bool = True) -> Rows:
    """Instruct / chat examples of ``path``, one a row, the loss where training has it."""
    template = ChatTemplate.of(tok) if fmt == "chat" else None
    examples = []
    for i, rec in records(path, fmt):
        ids, train = encode_example(rec, fmt, tok, template, f"{path}:{i}")
        examples.append((ids, train if mask_prompt else [True] * len(train)))
    return pack_rows(examples, seq_len, pack=False, pad_id=0)


class SplitEval:
    def __init__(self, data, cfg: Config, *, rank: int, world: int, device):
        self.data, self.cfg, self.rank, self.world, self.device = data, cfg, rank, world, device

    def score(self, model) -> dict:
        c = self.cfg
        losses = []
        for i in range(c.train.eval_batches):
            x, y = self.data.batch("val", c.data.seq_len, c.data.batch_size, seed=c.train.seed, step=i,
                                   rank=self.rank, world=self.world, device=self.device)
            losses.append(model(x, y).float())
        v = torch.stack(losses).mean()
        if self.world > 1:
            dist.all_reduce(v, op=dist.ReduceOp.AVG)
        return {"loss": v.item()}


class RowsEval:
    def __init__(self, rows: Rows, batch_size: int, *, rank: int = 0, world: int = 1, device="cpu"):
        keep = [i for i in range(len(rows.tokens)) if i % world == rank]
        self.rows = Rows(rows.tokens[keep], rows.targets[keep], rows.documents[keep])
        self.batch_size, self.world, self.device = batch_size, world, device
        if len(rows.tokens) == 0:
            raise ConfigError("the evaluation data has no token to score")

    def score(self, model) -> dict:
        total, count = 0.0, 0
        for i in range(0, len(self.rows.tokens), self.batch_size):
            x = torch.from_numpy(self.rows.tokens[i:i + self.batch_size]).to(self.device)
            y = torch.from_numpy(self.rows.targets[i:i + self.batch_size]).to(self.device)
            n = int((y != -100).sum())
            if n:
                total += model(x, y).double().item() * n
                count += n
        total, count = _all_sum([total, count], self.device, self.world)
        if count == 0:
            raise ConfigError("the evaluation data has no token to score")
        return {"loss": total / count, "perplexity": math.exp(min(total / count, 700.0)), "tokens": int(count)}


def choice_loglikelihoods(model, tok, prompt: str, choices: list[str], device) -> list[float]:
    """Each choice's summed log-probability after ``prompt``: the tokens of ``prompt + choice``
    beyond those of ``prompt`` (no bos added; a prompt of no tokens is preceded by the end-of-text
    id), as lm-eval-harness scores a multiple-choice task."""
    context = tok.encode(prompt) or [tok.eot_id if tok.eot_id is not None else 0]
    limit = model.cfg.max_seq_len + 1
    seqs, starts = [], []
    for choice in choices:
        whole = tok.encode(prompt + choice) if tok.encode(prompt) else context + tok.encode(choice)
        cont = whole[len(context):] if whole[:len(context)] == context else tok.encode(choice)
        seq = (context + cont)[-limit:]
        seqs.append(seq)
        starts.append(len(seq) - len(cont))
    width = max(len(s) for s in seqs) - 1
    x = torch.zeros(len(seqs), width, dtype=torch.long)
    for r, s in enumerate(seqs):
        x[r, :len(s) - 1] = torch.tensor(s[:-1])
    logp = F.log_softmax(model(x.to(device)).float(), dim=-1)
    out = []
    for r, (s, start) in enumerate(zip(seqs, starts)):
        targets = torch.tensor(s[start:], device=device)
        out.append(logp[r, start - 1:len(s) - 1].gather(-1, targets[:, None]).sum().item())
    return out


class ChoiceEval:
    def __init__(self, path: Path, tok, *, rank: int = 0, world: int = 1, device="cpu"):
        self.items = [rec for i, (_, rec) in enumerate(records(path, "choice")) if i % world == rank]
        self.tok, self.world, self.device = tok, world, device

    def score(self, model) -> dict:
        right = right_norm = nll = 0.0
        for rec in self.items:
            choices = rec["choices"]
            answer = rec["answer"] if isinstance(rec["answer"], int) else choices.index(rec["answer"])
            ll = choice_loglikelihoods(model, self.tok, rec["prompt"], choices, self.device)
            right += max(range(len(ll)), key=lambda i: ll[i]) == answer
            right_norm += max(range(len(ll)), key=lambda i: ll[i] / max(len(choices[i]), 1)) == answer
            nll -= ll[answer]
        right, right_norm, nll, n = _all_sum([right, right_norm, nll, len(self.items)], self.device, self.world)
        return {"loss": nll / n, "accuracy": right / n, "accuracy_norm": right_norm / n, "examples": int(n)}


class TaskEval:
    def __init__(self, batch: tasks.Batch, *, rank: int = 0, world: int = 1, device="cpu"):
        keep = torch.arange(batch.idx.shape[0]) % world == rank
        self.batch = tasks.Batch(batch.idx[keep], batch.last[keep], batch.cand[keep], batch.label[keep]).to(device)
        self.world, self.device = world, device

    def score(self, model) -> dict:
        n = self.batch.idx.shape[0]
        acc, loss = tasks.accuracy(model, self.batch)
        right, total, n = _all_sum([acc * n, loss * n, n], self.device, self.world)
        return {"loss": total / n, "accuracy": right / n, "examples": int(n)}


def for_run(cfg: Config, data, *, rank: int, world: int, device):
    """The run's evaluation: the generated task's, ``data.eval_path``'s, or the validation split's."""
    if cfg.finetune.task != "none":
        batch = tasks.eval_batch(cfg.finetune.task, data.tokenizer, cfg.finetune.eval_examples, cfg.train.seed)
        return TaskEval(batch, rank=rank, world=world, device=device)
    if cfg.data.eval_path is None:
        return SplitEval(data, cfg, rank=rank, world=world, device=device)
    path = Path(cfg.data.eval_path).expanduser()
    if not path.is_file() and not path.is_dir():
        raise ConfigError(f"data.eval_path {cfg.data.eval_path} does not exist")
    tok = data.tokenizer
    if tok is None:
        raise ConfigError("data.eval_path needs a tokenizer; the training data is pre-tokenized .bin tokens "
                          "(pass --data.tokenizer)")
    path = dataset_split(path, EVAL_SPLITS)
    fmt = record_format_of(path)
    if fmt == "choice":
        return ChoiceEval(path, tok, rank=rank, world=world, device=device)
    if fmt in ("instruct", "chat"):
        rows = example_rows(path, fmt, tok, cfg.data.seq_len, mask_prompt=cfg.data.mask_prompt)
    else:
        rows = text_rows(path, tok, cfg.data.seq_len)
    return RowsEval(rows, cfg.data.batch_size, rank=rank, world=world, device=device)


__all__ = ["SplitEval", "RowsEval", "ChoiceEval", "TaskEval", "for_run", "text_rows", "example_rows",
           "choice_loglikelihoods"]

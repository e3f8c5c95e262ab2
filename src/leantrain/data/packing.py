"""Instruction / chat examples as training rows: packed (several examples a row, kept apart) or one a row.

An example of ``n`` tokens gives ``n - 1`` (input, target) pairs: token ``t`` predicts token
``t + 1``, whose target is -100 (no loss) unless ``t + 1`` is trained on
(:func:`leantrain.data.examples.encode_example`). Examples longer than ``seq_len + 1`` tokens are
cut to that (counted in a warning). Rows of ``seq_len`` pairs:

- packed (``data.pack``): examples in file order, each put in the current row while it fits,
  else in a new one; every position carries its example's index in the row (``document_ids``),
  with which the model attends only within an example and restarts positions at each
  (:class:`leantrain.model.llama.Packed`); the rest of a row is padding (targets -100, a document
  of its own);
- one example a row otherwise, padded at the end (a causal model's earlier positions do not see
  the padding, so no mask is needed).

Examples are split into train and validation by a stable hash of their line (JSONL) or row number
(``data.val_fraction``; a split left empty takes one example of the other; with ``data.eval_path`` set
nothing is held out). Batches are a pure function of (seed, step, micro-batch, rank), as
:class:`leantrain.data.TokenData`'s are: the rows in a random order per epoch (seeded by seed and
epoch), consecutive slices of it per batch.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from leantrain.config import ConfigError, DataConfig
from leantrain.data.examples import ChatTemplate, encode_example, records
from leantrain.model.llama import Packed


@dataclass
class Rows:
    """``seq_len``-wide rows: inputs, targets (-100: no loss) and document ids, int64 ``(N, seq_len)``."""

    tokens: np.ndarray
    targets: np.ndarray
    documents: np.ndarray


def pack_rows(examples: list[tuple[list[int], list[bool]]], seq_len: int, *, pack: bool, pad_id: int) -> Rows:
    """Rows of ``seq_len`` (input, target) pairs from (ids, trained-on) examples (module docstring)."""
    rows: list[tuple[list, list, list]] = []
    current = ([], [], [])
    for ids, train in examples:
        ids, train = ids[:seq_len + 1], train[:seq_len + 1]
        x = ids[:-1]
        y = [i if t else -100 for i, t in zip(ids[1:], train[1:])]
        if current[0] and (not pack or len(current[0]) + len(x) > seq_len):
            rows.append(current)
            current = ([], [], [])
        doc = current[2][-1] + 1 if current[2] else 0
        current[0].extend(x)
        current[1].extend(y)
        current[2].extend([doc] * len(x))
    if current[0]:
        rows.append(current)
    n = len(rows)
    tokens = np.full((n, seq_len), pad_id, dtype=np.int64)
    targets = np.full((n, seq_len), -100, dtype=np.int64)
    documents = np.empty((n, seq_len), dtype=np.int64)
    for r, (x, y, d) in enumerate(rows):
        tokens[r, :len(x)], targets[r, :len(y)], documents[r, :len(d)] = x, y, d
        documents[r, len(d):] = d[-1] + 1  # (the padding: a document of its own)
    return Rows(tokens, targets, documents)


@dataclass
class ExampleData:
    """Instruction / chat examples as rows of ``seq_len`` (``batch`` as :class:`leantrain.data.TokenData`'s)."""

    train: Rows
    val: Rows
    tokenizer: object
    vocab_size: int
    source: str
    seq_len: int
    packed: bool
    grad_accum: int = 1  # micro-batches a step (batches of consecutive steps follow each other in an epoch)

    def batch(self, split: str, seq_len: int, batch_size: int, *, seed: int, step: int, micro: int = 0,
              rank: int = 0, world: int = 1, device="cpu"):
        """(inputs, targets) of micro-batch ``micro`` of ``step`` for ``rank``; packed rows' inputs are
        :class:`leantrain.model.llama.Packed` (tokens and document ids)."""
        if seq_len != self.seq_len:
            raise ConfigError(f"these examples were packed for data.seq_len {self.seq_len}, not {seq_len}")
        rows = self.train if split == "train" else self.val
        first = ((step * self.grad_accum + micro) * world + rank) * batch_size
        index = np.array([self._row(seed, split, first + j, len(rows.tokens)) for j in range(batch_size)])
        x, y = torch.from_numpy(rows.tokens[index]), torch.from_numpy(rows.targets[index])
        docs = torch.from_numpy(rows.documents[index])
        if str(device) != "cpu":
            x, y, docs = (t.pin_memory().to(device, non_blocking=True) for t in (x, y, docs))
        return (Packed(x, docs) if self.packed else x), y

    def _row(self, seed: int, split: str, i: int, n: int) -> int:
        """The ``i``-th row drawn: row ``i mod n`` of the epoch ``i // n``'s random order."""
        epoch, k = divmod(i, n)
        key = (seed, split, epoch)
        if getattr(self, "_order_key", None) != key:
            g = torch.Generator().manual_seed((seed * 1_000_003 + epoch * 7919 + (split == "val")) % 2**63)
            self._order, self._order_key = torch.randperm(n, generator=g), key
        return int(self._order[k])


def _is_val(line: int, fraction: float) -> bool:
    return (zlib.crc32(f"line{line}".encode()) % 10_000) < fraction * 10_000


def load_examples(path: Path, fmt: str, cfg: DataConfig, tok, log) -> ExampleData:
    """The examples of an instruct / chat record file, tokenized with ``tok``, split and laid out in rows."""
    template = ChatTemplate.of(tok) if fmt == "chat" else None
    if template is not None and template.default:
        log("note: the tokenizer has no chat template; rendering chats with leantrain's default "
            "(<|im_start|>role ... <|im_end|>)")
    splits: dict[bool, list] = {False: [], True: []}
    cut = 0
    for i, rec in records(path, fmt):
        ids, train = encode_example(rec, fmt, tok, template, f"{path}:{i}")
        if not cfg.mask_prompt:
            train = [True] * len(train)
        cut += len(ids) > cfg.seq_len + 1
        if not any(train[1:cfg.seq_len + 1]):
            raise ConfigError(f"{path}:{i}: no trained-on token within the first data.seq_len + 1 = "
                              f"{cfg.seq_len + 1} tokens (the prompt fills them); raise --data.seq-len")
        splits[_is_val(i, cfg.val_fraction)].append((ids, train))
    total = len(splits[False]) + len(splits[True])
    held_out = cfg.val_fraction > 0  # (0: data.eval_path scores the run, every example trains)
    if total < 1 + held_out:
        raise ConfigError(f"data file {path} holds {total} example(s); training and validation need at least 2"
                          if held_out else f"data file {path} holds no example")
    if held_out and not splits[True]:
        splits[True].append(splits[False].pop())
    if not splits[False]:
        splits[False].append(splits[True].pop())
    if cut:
        log(f"warning: {cut} of {total} examples in {path} are longer than data.seq_len + 1 = {cfg.seq_len + 1} "
            "tokens and were cut")
    pad = getattr(tok, "pad_id", None)
    pad = pad if pad is not None else (tok.eot_id if tok.eot_id is not None else 0)
    rows = {name: pack_rows(splits[is_val], cfg.seq_len, pack=cfg.pack, pad_id=pad)
            for name, is_val in (("train", False), ("val", True))}
    data = ExampleData(rows["train"], rows["val"], tok, tok.vocab_size, f"{path} ({fmt})", cfg.seq_len, cfg.pack,
                       cfg.grad_accum)
    held = f"{len(splits[True])} held out" if held_out else f"none held out ({cfg.eval_path} scores the run)"
    log(f"{fmt} data: {len(splits[False])} training examples in {len(rows['train'].tokens)} rows of {cfg.seq_len}, "
        f"{held}")
    return data

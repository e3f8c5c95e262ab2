"""Streaming tokenization: text in bounded pieces, token ids appended to a file as they are encoded.

The byte-level pre-tokenizer never merges across a position where a space or a newline
follows a non-whitespace character (its rules: contractions, `` ?letters``, `` ?digits``,
`` ?other``, whitespace runs), so a text cut there encodes to the same ids, piece by piece,
as whole; ``safe_pieces`` cuts only there (a piece with no such position, e.g. a very long
line without spaces, is cut at its size). Memory is one batch of text (``BATCH_CHARS``)
and its encodings, independent of the corpus size.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

PIECE_CHARS = 256 * 1024  # characters of one piece handed to the tokenizer
BATCH_CHARS = 1024 * 1024  # characters encoded at once (the encodings take ~200 bytes a token)


def safe_cut(text: str, lo: int, hi: int) -> int:
    """The largest ``i`` in ``(lo, hi)`` where ``text[i]`` is a newline (else a space) after a
    non-whitespace character: a cut the pre-tokenizer also makes; ``hi`` when there is none."""
    for sep in ("\n", " "):
        end = hi
        while (i := text.rfind(sep, lo + 1, end)) > lo:
            if not text[i - 1].isspace():
                return i
            end = i
    return hi


def safe_pieces(text: str, size: int | None = None) -> Iterator[str]:
    """``text`` in pieces of at most ``size`` (default ``PIECE_CHARS``) characters, cut where the tokenizer cuts."""
    size = size or PIECE_CHARS
    start = 0
    while len(text) - start > size:
        cut = safe_cut(text, start + size // 2, start + size)
        yield text[start:cut]
        start = cut
    if start < len(text) or not text:
        yield text[start:]


def file_pieces(path: Path, size: int | None = None) -> Iterator[str]:
    """A UTF-8 text file (undecodable bytes replaced, newlines universal) in pieces, never read whole."""
    size = size or PIECE_CHARS
    with open(path, encoding="utf-8", errors="replace") as f:
        buf = ""
        while block := f.read(size):
            buf += block
            while len(buf) > size:
                cut = safe_cut(buf, size // 2, size)
                yield buf[:cut]
                buf = buf[cut:]
        yield buf


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 65535 else np.uint32


def open_tokens(path: Path, dtype) -> np.ndarray:
    """A token file memory-mapped; an empty one (a split nothing went to) as an empty array, which
    ``np.memmap`` cannot map."""
    return np.memmap(path, dtype=dtype, mode="r") if Path(path).stat().st_size else np.zeros(0, dtype=dtype)


class TokenWriter:
    """Documents' token ids, each followed by the end-of-text id (when the tokenizer has one),
    appended to ``path`` batch by batch.

    ``add(piece, doc_end)`` queues text; a batch of ``BATCH_CHARS`` is encoded and written at
    once. ``close()`` renames the file into place (it is written under a temporary name) and
    returns it memory-mapped.
    """

    def __init__(self, tokenizer, path: Path):
        self.tokenizer, self.path = tokenizer, Path(path)
        self.dtype = token_dtype(tokenizer.vocab_size)
        eot = tokenizer.eot_id
        self.separator = np.array([] if eot is None else [eot], dtype=self.dtype)
        self.tmp = self.path.with_suffix(f".{os.getpid()}.tmp")  # (ranks tokenizing at once: one file each)
        self.file = open(self.tmp, "wb")
        self.pending: list[tuple[str, bool]] = []
        self.pending_chars = 0
        self.tokens = 0

    def add(self, piece: str, doc_end: bool) -> None:
        self.pending.append((piece, doc_end))
        self.pending_chars += len(piece)
        if self.pending_chars >= BATCH_CHARS:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        parts = []
        for ids, (_, doc_end) in zip(self.tokenizer.encode_batch([p for p, _ in self.pending]), self.pending):
            parts.append(np.asarray(ids, dtype=self.dtype))
            if doc_end:
                parts.append(self.separator)
        arr = np.concatenate(parts)
        self.file.write(arr.tobytes())
        self.tokens += len(arr)
        self.pending, self.pending_chars = [], 0

    def close(self) -> np.ndarray:
        self.flush()
        self.file.close()
        os.replace(self.tmp, self.path)
        return open_tokens(self.path, self.dtype)

    def abort(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


def sampled(pieces: Iterable[str], total_chars: int, cap_chars: float) -> Iterator[str]:
    """Every piece when ``total_chars`` <= ``cap_chars``; else every k-th piece, spread over the whole corpus."""
    stride = max(1, -(-int(total_chars) // max(1, int(cap_chars))))
    for i, piece in enumerate(pieces):
        if i % stride == 0:
            yield piece

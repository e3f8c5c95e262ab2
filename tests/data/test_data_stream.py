"""Streaming tokenization: the same ids as tokenizing whole documents, with memory bounded by the piece size."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_data import cfg

from leantrain import data as D
from leantrain.data import stream

ROOT = Path(__file__).resolve().parents[2]
TRICKY = "x = 1\n\n\n    def f():\n  \treturn  'it''s'  \n\u00e9t\u00e9 42 000\r\nend" * 7 + "\n \n"
LONG_WORD = "nospace" * 50


def _text(corpus):
    return "\n".join(p.read_text() for p in sorted(corpus.iterdir())[:4]) + TRICKY


@pytest.mark.parametrize("size", [7, 64, 1000, 10**9])
def test_safe_pieces_encode_to_the_ids_of_the_whole_text(corpus, size):
    tok = D.load(cfg(corpus), log=lambda *_: None).tokenizer
    for text in (_text(corpus), LONG_WORD + _text(corpus) + LONG_WORD):
        pieces = list(stream.safe_pieces(text, size))
        assert "".join(pieces) == text
        assert all(len(p) <= size for p in pieces)
        ids = [i for p in pieces for i in tok.encode(p)]
        if size >= 2 * len(LONG_WORD):  # (a smaller piece may find no cut of the tokenizer in its window)
            assert ids == tok.encode(text)


def test_file_pieces_read_the_file_as_read_text(tmp_path, corpus):
    f = tmp_path / "a.txt"
    f.write_bytes(_text(corpus).encode() + b"\xff bad byte\r\n")
    pieces = list(stream.file_pieces(f, 100))
    assert "".join(pieces) == f.read_text(encoding="utf-8", errors="replace")
    assert max(len(p) for p in pieces) <= 100


def test_streamed_single_file_equals_whole_document_tokens(tmp_path, corpus, monkeypatch):
    """Small pieces and batches (many cuts, many writes): the train split is the ids of the text's first
    (1 - val_fraction) characters, then end-of-text; the validation split the rest, then end-of-text."""
    f = tmp_path / "one.txt"
    f.write_text(_text(corpus))
    text = f.read_text()  # (universal newlines: the file's \r\n read as \n)
    whole = D.load(cfg(f), log=lambda *_: None)
    cut = int(len(text) * 0.95)
    tok = whole.tokenizer
    assert list(whole.train) == tok.encode(text[:cut]) + [tok.eot_id]
    assert list(whole.val) == tok.encode(text[cut:]) + [tok.eot_id]
    monkeypatch.setattr(stream, "PIECE_CHARS", 300)
    monkeypatch.setattr(stream, "BATCH_CHARS", 1000)
    f2 = tmp_path / "two.txt"
    f2.write_text(text)
    small = D.load(cfg(f2), log=lambda *_: None)
    assert np.array_equal(small.train, whole.train) and np.array_equal(small.val, whole.val)


def test_directory_tokens_are_each_file_then_end_of_text(corpus):
    d = D.load(cfg(corpus), log=lambda *_: None)
    tok = d.tokenizer
    files = sorted(p for p in corpus.rglob("*") if p.suffix in D.TEXT_SUFFIXES)
    val = [p for p in files if D._is_val(p.name, 0.05)]
    expected = [i for p in files if p not in val for i in tok.encode(p.read_text()) + [tok.eot_id]]
    assert list(d.train) == expected


def test_tokenizer_sample_of_a_large_corpus(tmp_path, corpus):
    f = tmp_path / "big.txt"
    f.write_text(_text(corpus) * 3)
    lines = []
    d = D.load(cfg(f, tokenizer_sample_mb=0.1), log=lines.append)
    assert any("(a 0.1 MB sample of it)" in x for x in lines), lines
    assert d.vocab_size == 400 and len(d.train) > 0


@pytest.mark.slow
def test_peak_memory_of_a_20_mb_file_is_bounded():
    """Tokenizing 20 MB of text (tokenizer training included) stays under 512 MB RSS, most of it Python + torch:
    the tokenizer trains on a sample and the text is read as a stream, so the peak does not grow with the file."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_data.py"), "--mb", "20", "--print"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
                          timeout=900)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert record["file_bytes"] >= 20 * 2**20 and record["tokens"] > 2_000_000
    # (the process imports torch first: ~300 MB before any text; a loader that held the corpus would
    # need several GB for 20 MB of text, about 185 bytes a byte)
    assert record["peak_rss_bytes"] < 512 * 2**20, record

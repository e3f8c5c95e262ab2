import json

import numpy as np
import pytest
import torch

from leantrain import data as D
from leantrain.config import ConfigError, DataConfig


def cfg(path, **kw):
    """A DataConfig; fields DataConfig does not declare (yet) are set as attributes, as the loader reads them."""
    known = {k: v for k, v in kw.items() if k in DataConfig.__dataclass_fields__}
    out = DataConfig(path=str(path), tokenizer_vocab=400, **known)
    for k, v in kw.items():
        if k not in known:
            object.__setattr__(out, k, v)
    return out


def test_directory_corpus_splits_by_file_and_roundtrips_text(corpus):
    d = D.load(cfg(corpus), log=lambda *_: None)
    assert len(d.train) > 2 * len(d.val) > 0
    text = "def f(x):\n    return x + 1\n"
    assert d.tokenizer.decode(d.tokenizer.encode(text)) == text
    assert d.vocab_size == 400


def test_batches_are_deterministic_and_ranks_slice_the_global_batch(corpus):
    d = D.load(cfg(corpus), log=lambda *_: None)
    x1, y1 = d.batch("train", 16, 4, seed=3, step=7)
    x2, _ = d.batch("train", 16, 4, seed=3, step=7)
    assert torch.equal(x1, x2) and torch.equal(x1[:, 1:], y1[:, :-1])
    parts = [d.batch("train", 16, 2, seed=3, step=7, rank=r, world=2)[0] for r in range(2)]
    assert torch.equal(torch.cat(parts), x1)
    assert not torch.equal(d.batch("train", 16, 4, seed=3, step=8)[0], x1)


def test_jsonl_and_single_text_file(tmp_path, corpus):
    text = "\n".join(p.read_text() for p in sorted(corpus.iterdir())[:3])
    f = tmp_path / "a.txt"
    f.write_text(text)
    d = D.load(cfg(f), log=lambda *_: None)
    assert len(d.val) > 0 and len(d.train) > len(d.val)
    j = tmp_path / "a.jsonl"
    j.write_text("\n".join(json.dumps({"text": t}) for t in text.split("\n\n")))
    assert len(D.load(cfg(j), log=lambda *_: None).train) > 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"txt": "x"}\n')
    with pytest.raises(ConfigError, match="field 'text'"):
        D.load(cfg(bad))


def test_pretokenized_bin(tmp_path):
    ids = (np.arange(5000) % 300).astype(np.uint16)
    f = tmp_path / "tokens.bin"
    ids.tofile(f)
    (tmp_path / "tokens.bin.json").write_text('{"vocab_size": 300, "dtype": "uint16"}')
    d = D.load(cfg(f))
    assert d.vocab_size == 300 and d.tokenizer is None
    assert len(d.train) + len(d.val) == 5000
    x, y = d.batch("train", 8, 2, seed=0, step=0)
    assert torch.equal((x[:, 1:]), y[:, :-1])


def test_an_eval_file_leaves_the_whole_corpus_to_training(tmp_path, corpus):
    """``data.eval_path`` set: a directory of text files and a token file train on everything (no
    validation split; the cached empty split reloads)."""
    tok = D.load(cfg(corpus), log=lambda *_: None).tokenizer  # (one tokenizer: the same tokens a file)
    held = D.load(cfg(corpus), log=lambda *_: None, tokenizer=tok)
    for _ in range(2):  # (the second from the token cache)
        whole = D.load(cfg(corpus, eval_path=str(corpus)), log=lambda *_: None, tokenizer=tok)
        assert len(whole.val) == 0 and len(whole.train) == len(held.train) + len(held.val)
    one = tmp_path / "one.txt"  # (one document: no split by characters either)
    one.write_text("def f(x):\n    return x + 1\n" * 50)
    whole = D.load(cfg(one, eval_path=str(one)), log=lambda *_: None, tokenizer=tok)
    assert len(whole.val) == 0 and len(whole.train) > 0
    ids = (np.arange(5000) % 300).astype(np.uint16)
    ids.tofile(tmp_path / "t.bin")
    d = D.load(cfg(tmp_path / "t.bin", bin_vocab_size=300, eval_path=str(tmp_path)))
    assert len(d.train) == 5000 and len(d.val) == 0


def test_missing_and_empty_data_fail_clearly(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        D.load(cfg(tmp_path / "nope.txt"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("   \n")
    with pytest.raises(ConfigError, match="empty"):
        D.load(cfg(tmp_path / "empty"))


def test_too_short_split_fails_clearly(tmp_path):
    (np.arange(40) % 300).astype(np.uint16).tofile(tmp_path / "t.bin")
    d = D.load(cfg(tmp_path / "t.bin", bin_vocab_size=300))
    with pytest.raises(ConfigError, match="fewer than data.seq_len"):
        d.batch("val", 32, 1, seed=0, step=0)

"""Inputs that cannot be trained on: each refused with one sentence (a ConfigError) naming the file."""

import gzip
import json

import numpy as np
import pytest
from test_data import cfg

from leantrain import data as D
from leantrain.config import ConfigError


def _refused(path, match, **kw):
    with pytest.raises(ConfigError, match=match) as e:
        D.load(cfg(path, **kw), log=lambda *_: None)
    msg = str(e.value)
    assert "\n" not in msg and msg.count(". ") == 0, msg  # one sentence
    return msg


# ids name the case (the contents: a gzip stream carries its creation time, so ids made from it
# differ between the test workers' collections)
@pytest.mark.parametrize("name,content,what", [
    ("a.txt", b"hello\0world" * 10, "NUL bytes"),
    ("a.txt", "h\u00e9llo".encode("latin-1") * 10, "not UTF-8"),
    ("a.gz", gzip.compress(b"hello world", mtime=0), "gzip-compressed"),
    ("a.zip", b"PK\x03\x04" + b"x" * 100, "zip archive"),
    ("a.txt", b"PAR1" + b"\0" * 100, "Parquet"),
    ("a.png", b"\x89PNG\r\n\x1a\n" + b"\0" * 100, "PNG image"),
    ("a.pdf", b"%PDF-1.4\n" + b"x" * 100, "PDF"),
    ("a", b"\x7fELF\x02\x01" + b"\0" * 100, "ELF"),
    ("a.csv", b"text,label\nhello,1\n", "CSV table"),
    ("a.arrow", b"hello", "Arrow"),
], ids=lambda v: v if isinstance(v, str) else "content")
def test_binary_and_table_files_are_refused(tmp_path, name, content, what):
    f = tmp_path / name
    f.write_bytes(content)
    msg = _refused(f, what)
    assert str(f) in msg and ("not text" in msg or "not UTF-8 text" in msg)


def test_utf8_cut_at_the_sniff_boundary_is_still_text(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("é" * (D.sources.SNIFF_BYTES // 2 + 7) + " fin\n")  # a 2-byte character across 64 KiB
    assert D.sources.binary_kind(f) is None


def test_directory_skips_binary_files_with_one_warning(tmp_path, corpus):
    d = tmp_path / "mixed"
    d.mkdir()
    for p in sorted(corpus.iterdir())[:4]:
        (d / p.name).write_text(p.read_text())
    (d / "blob.txt").write_bytes(b"\0\1\2" * 100)
    (d / "image.md").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 50)
    lines = []
    data = D.load(cfg(d), log=lines.append)
    warnings = [x for x in lines if x.startswith("warning")]
    assert warnings == [f"warning: skipping 2 binary file(s) in {d} (blob.txt, image.md)"]
    assert len(data.train) > 0


def test_stray_bin_in_a_text_directory_is_refused(tmp_path, corpus):
    d = tmp_path / "mixed"
    d.mkdir()
    (d / "a.txt").write_text(sorted(corpus.iterdir())[0].read_text())
    np.arange(100, dtype=np.uint16).tofile(d / "stray.bin")
    msg = _refused(d, "text files and .bin token files")
    assert "stray.bin" in msg and str(d) in msg


def test_bin_without_metadata_is_refused(tmp_path):
    f = tmp_path / "t.bin"
    np.arange(1000, dtype=np.uint16).tofile(f)
    msg = _refused(f, "without its vocabulary size")
    assert "t.bin.json" in msg and "--data.bin-vocab-size" in msg


def test_bin_metadata_from_meta_json_or_flags(tmp_path):
    f = tmp_path / "t.bin"
    (np.arange(1000) % 70_000).astype(np.uint32).tofile(f)
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 70_000, "dtype": "uint32"}))
    d = D.load(cfg(f))
    assert d.vocab_size == 70_000 and d.train.dtype == np.uint32 and len(d.train) + len(d.val) == 1000
    (tmp_path / "meta.json").unlink()
    d = D.load(cfg(f, bin_vocab_size=70_000, bin_dtype="uint32"))
    assert d.vocab_size == 70_000
    _refused(f, "does not fit uint16", bin_vocab_size=70_000)


def test_bin_ids_beyond_the_vocabulary_are_refused(tmp_path):
    f = tmp_path / "t.bin"
    ids = np.arange(5000, dtype=np.uint16) % 300
    ids[4321] = 301
    ids.tofile(f)
    (tmp_path / "t.bin.json").write_text('{"vocab_size": 300}')
    msg = _refused(f, "holds the id 301, beyond its vocabulary of 300")
    assert str(f) in msg


def test_bin_of_the_wrong_size_or_a_compressed_bin_is_refused(tmp_path):
    f = tmp_path / "t.bin"
    f.write_bytes(b"\1\0" * 10 + b"\1")
    _refused(f, "not a whole number of uint16 ids", bin_vocab_size=10)
    f.write_bytes(gzip.compress(b"\1\0" * 100))
    _refused(f, "gzip-compressed, not token ids", bin_vocab_size=10)
    f.write_bytes(b"")
    _refused(f, "empty", bin_vocab_size=10)
    (tmp_path / "t.bin.json").write_text('{"vocab_size": 10, "dtype": "float32"}')
    f.write_bytes(b"\1\0" * 10)
    _refused(f, "dtype must be one of uint16, uint32")
    _refused(f, "data.bin_vocab_size 11 disagrees with vocab_size 10", bin_vocab_size=11, bin_dtype="uint16")


def test_missing_and_empty_files(tmp_path):
    msg = _refused(tmp_path / "nope.txt", "does not exist")
    assert "nope.txt" in msg
    (tmp_path / "empty.txt").write_text("")
    assert "empty.txt" in _refused(tmp_path / "empty.txt", "is empty")
    (tmp_path / "blank.txt").write_text("  \n\n ")
    _refused(tmp_path / "blank.txt", "is empty: no non-blank text")
    (tmp_path / "nothing").mkdir()
    _refused(tmp_path / "nothing", "empty: no text files")


@pytest.mark.parametrize("lines,match", [
    (['{"text": "a"}', '{"txt": "b"}'], r"b.jsonl:2: each JSONL line needs a string field 'text'"),
    (['{"text": "a"}', '', '{"text": 3}'], r"b.jsonl:3: each JSONL line needs a string field 'text'"),
    (['{"text": "a"}', '{"text": "b"'], r"b.jsonl:2: not valid JSON"),
    (['["text"]'], r"b.jsonl:1: each JSONL line needs"),
])
def test_jsonl_without_a_text_field_names_the_line(tmp_path, lines, match):
    f = tmp_path / "b.jsonl"
    f.write_text("\n".join(lines) + "\n")
    _refused(f, match)


def test_jsonl_with_invalid_utf8_names_the_line(tmp_path):
    f = tmp_path / "b.jsonl"
    f.write_bytes(b'{"text": "ok"}\n{"text": "\xe9t\xe9"}\n')
    _refused(f, r"b.jsonl is not UTF-8 text \(an invalid byte at offset 25\)")  # within the first 64 KiB
    f.write_bytes(b'{"text": "ok"}\n' * 5000 + b'{"text": "\xe9t\xe9"}\n')
    _refused(f, r"b.jsonl:5001: not UTF-8 text")

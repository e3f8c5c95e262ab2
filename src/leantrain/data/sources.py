"""What a data path holds: text documents streamed from disk, or a checked file of token ids.

Documents are text files, or the ``text`` field of each record of a record file (``.jsonl``,
``.json``, ``.parquet`` or a Hugging Face ``datasets`` directory: :mod:`leantrain.data.records`).
Every input that cannot be trained on is refused with a ``ConfigError`` of one sentence
naming the file and what to do: binary files (magic numbers, NUL bytes, invalid UTF-8
in the first 64 KiB), tables that are not record files (``.csv``, ``.tsv``, a lone ``.arrow``),
a ``.bin`` without its vocabulary size or with ids beyond it, a directory mixing text and
``.bin`` files, records that are not objects with a string ``text``.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from leantrain.config import ConfigError
from leantrain.data.records import is_dataset_dir, is_record_file, read_records
from leantrain.data.stream import file_pieces, safe_pieces

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".text")
SNIFF_BYTES = 64 * 1024
_FORMATS = ("a UTF-8 text file, a directory of them, a .jsonl, .json or .parquet file or a datasets directory of "
            "records with a 'text' field, or a .bin of token ids")
_MAGIC = {
    b"PK\x03\x04": "a zip archive", b"\x1f\x8b": "gzip-compressed", b"BZh": "bzip2-compressed",
    b"\xfd7zXZ\x00": "xz-compressed", b"\x28\xb5\x2f\xfd": "zstd-compressed", b"7z\xbc\xaf\x27\x1c": "a 7z archive",
    b"PAR1": "a Parquet file", b"ARROW1": "an Arrow file", b"\x93NUMPY": "a NumPy array",
    b"\x89PNG": "a PNG image", b"\xff\xd8\xff": "a JPEG image", b"GIF8": "a GIF image", b"%PDF": "a PDF document",
    b"\x7fELF": "an ELF executable",
}
_TABLE_SUFFIXES = {".csv": "a CSV table", ".tsv": "a TSV table", ".arrow": "an Arrow file", ".feather": "an Arrow file", ".npy": "a NumPy array",
                   ".npz": "a NumPy archive", ".safetensors": "a safetensors file", ".pt": "a PyTorch file"}
_BIN_DTYPES = ("uint16", "uint32")


def binary_kind(path: Path) -> str | None:
    """What a file is when it is not UTF-8 text (judged from its first 64 KiB), else None."""
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    for magic, what in _MAGIC.items():
        if head.startswith(magic):
            return what
    if b"\0" in head:
        return "binary (it holds NUL bytes)"
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError as e:
        return f"not UTF-8 text (an invalid byte at offset {e.start})"
    return None


def refuse_non_text(path: Path) -> None:
    """ConfigError when a file given as text is a table or binary."""
    what = _TABLE_SUFFIXES.get(path.suffix.lower()) or binary_kind(path)
    if what is None:
        return
    hint = ("decompress it first" if "compressed" in what or "archive" in what else
            "name it .parquet to read its rows as records" if "Parquet" in what else
            "give the directory Dataset.save_to_disk wrote (with dataset_info.json and state.json) or export its "
            "rows to a .jsonl, .json or .parquet file" if "Arrow" in what else
            "export its rows to a .jsonl, .json or .parquet file of records ({\"text\": ...}, {\"prompt\", "
            "\"completion\"} or {\"messages\"})" if "table" in what else f"give {_FORMATS}")
    not_text = "" if what.startswith("not UTF-8") else ", not text"
    raise ConfigError(f"data file {path} is {what}{not_text}: {hint}")


# ---------------------------------------------------------------- documents


@dataclass
class Doc:
    """One document: a text file streamed in pieces, or a text in memory (a record's ``text``)."""

    name: str
    path: Path | None = None
    text: str | None = None

    def pieces(self) -> Iterator[str]:
        return file_pieces(self.path) if self.path is not None else safe_pieces(self.text)

    def size(self) -> int:
        """Characters (in memory) or bytes (a file): what sampling and splitting estimate from."""
        return self.path.stat().st_size if self.path is not None else len(self.text)

    def blank(self) -> bool:
        return not any(p.strip() for p in self.pieces())

    def chars(self) -> int:
        return len(self.text) if self.path is None else sum(len(p) for p in self.pieces())


class Source:
    """The documents of a corpus, in order, iterable any number of times without holding the text."""

    def __init__(self, describe: str, docs: list[Doc] | None = None, records: Path | None = None):
        self.describe, self._docs, self._records = describe, docs, records

    def documents(self) -> Iterator[Doc]:
        if self._records is None:
            yield from self._docs
        else:
            yield from _record_docs(self._records)


def _record_docs(path: Path) -> Iterator[Doc]:
    """A document per record of a record file: its ``text``, named by its row (``line{row - 1}``)."""
    each = "each JSONL line" if path.suffix == ".jsonl" else "each record"
    for i, rec in read_records(path):
        if not isinstance(rec.get("text"), str):
            raise ConfigError(f"{path}:{i}: {each} needs a string field 'text'")
        yield Doc(f"line{i - 1}", text=rec["text"])


def user_source(path: Path, log) -> Source:
    """The documents of a user's text file, directory of text files, or record file of ``{"text"}``."""
    if is_dataset_dir(path):
        return Source(str(path), records=path)
    if path.is_dir():
        return _directory_source(path, log)
    if path.stat().st_size == 0:
        raise ConfigError(f"data file {path} is empty; give {_FORMATS}")
    if path.suffix.lower() != ".parquet":
        refuse_non_text(path)
    if is_record_file(path):
        return Source(str(path), records=path)
    return Source(str(path), [Doc(path.name, path=path)])


def _directory_source(path: Path, log) -> Source:
    files = sorted(p for p in path.rglob("*") if p.is_file())
    bins = [p for p in files if p.suffix == ".bin"]
    texts = [p for p in files if p.suffix in TEXT_SUFFIXES]
    if bins:
        names = ", ".join(p.relative_to(path).as_posix() for p in bins[:3]) + (", ..." if len(bins) > 3 else "")
        what = "text files and .bin token files" if texts else ".bin token files"
        raise ConfigError(f"data directory {path} holds {what} ({names}): a .bin is read as token ids only when "
                          "--data names that file; point --data at one .bin file or at a directory of text files")
    docs, skipped = [], []
    for p in texts:
        (skipped if binary_kind(p) else docs).append(p)
    if skipped:
        shown = ", ".join(p.relative_to(path).as_posix() for p in skipped[:3]) + (", ..." if len(skipped) > 3 else "")
        log(f"warning: skipping {len(skipped)} binary file(s) in {path} ({shown})")
    if not docs:
        raise ConfigError(f"the corpus {path} is empty: no text files ({', '.join(TEXT_SUFFIXES)}) found in it")
    return Source(str(path), [Doc(p.relative_to(path).as_posix(), path=p) for p in docs])


# ---------------------------------------------------------------- token files


def token_file(path: Path, cfg) -> tuple[np.ndarray, int]:
    """(the memory-mapped ids, the vocabulary size) of a checked ``.bin`` token file.

    The vocabulary size and dtype come from ``<name>.bin.json`` or ``meta.json`` beside it
    (``{"vocab_size": V, "dtype": "uint16"}``; dtype defaults to uint16) or from the config
    fields ``data.bin_vocab_size`` / ``data.bin_dtype``; every id is checked to be below V.
    """
    vocab, dtype = _bin_metadata(path, cfg)
    size = path.stat().st_size
    if size == 0:
        raise ConfigError(f"token file {path} is empty")
    what = binary_kind(path)
    if what is not None and not what.startswith(("binary", "not UTF-8")):
        raise ConfigError(f"token file {path} is {what}, not token ids: give a file of raw {dtype} ids")
    itemsize = np.dtype(dtype).itemsize
    if size % itemsize:
        raise ConfigError(f"token file {path} has {size} bytes, not a whole number of {dtype} ids: check its dtype")
    arr = np.memmap(path, dtype=dtype, mode="r")
    block = 16 * 2**20
    for start in range(0, len(arr), block):
        top = int(arr[start:start + block].max())
        if top >= vocab:
            raise ConfigError(f"token file {path} holds the id {top}, beyond its vocabulary of {vocab}: "
                              "the vocab_size or dtype in its metadata is wrong, or it is not a token file")
    return arr, vocab


def _bin_metadata(path: Path, cfg) -> tuple[int, str]:
    meta, meta_path = {}, None
    for candidate in (path.with_suffix(path.suffix + ".json"), path.parent / "meta.json"):
        if candidate.is_file():
            try:
                meta, meta_path = json.loads(candidate.read_text()), candidate
            except (OSError, ValueError) as e:
                raise ConfigError(f"metadata {candidate} of token file {path} cannot be read ({e})") from None
            break
    flag_vocab, flag_dtype = getattr(cfg, "bin_vocab_size", None), getattr(cfg, "bin_dtype", None)
    vocab = flag_vocab if flag_vocab is not None else meta.get("vocab_size")
    dtype = flag_dtype if flag_dtype is not None else meta.get("dtype", "uint16")
    if vocab is None:
        raise ConfigError(f"token file {path} comes without its vocabulary size: write {path.name}.json beside it "
                          "with {\"vocab_size\": V, \"dtype\": \"uint16\"} or pass --data.bin-vocab-size V")
    for key, flag, mine in (("vocab_size", flag_vocab, vocab), ("dtype", flag_dtype, dtype)):
        if flag is not None and key in meta and meta[key] != mine:
            raise ConfigError(f"data.bin_{key} {mine} disagrees with {key} "
                              f"{meta[key]} in {meta_path}")
    if not isinstance(vocab, int) or vocab < 1:
        raise ConfigError(f"token file {path}: vocab_size must be a positive integer, got {vocab!r}")
    if dtype not in _BIN_DTYPES:
        raise ConfigError(f"token file {path}: dtype must be one of {', '.join(_BIN_DTYPES)}, got {dtype!r}")
    if vocab > np.iinfo(dtype).max + 1:
        raise ConfigError(f"token file {path}: a vocabulary of {vocab} does not fit {dtype} ids; use uint32")
    return vocab, dtype

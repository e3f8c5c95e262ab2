"""Corpora, tokenizers and batches.

The embedded default corpus is the Python standard library's own source: the
``.py`` files of the running interpreter, present on every machine with
Python. Files are split into train and validation *by file* (a stable hash of
the relative path), a byte-level BPE tokenizer is trained on the training files
with the ``tokenizers`` library, and both splits are tokenized once into
memory-mapped ``.bin`` files under the user's cache directory
(``$XDG_CACHE_HOME/leantrain`` or ``~/.cache/leantrain``).

Users' own data: a text file, a directory of text files (``.txt``, ``.md``,
``.py``), a record file (``.jsonl``, ``.json``, ``.parquet`` or a Hugging Face ``datasets``
directory written by ``save_to_disk``: ``records``) of ``{"text": ...}`` records or of
instruction / chat examples (trained on their completions only and packed: ``examples``,
``packing``), or a pre-tokenized
``.bin`` file of uint16 or uint32 token ids with its vocabulary size (in
``<file>.bin.json`` or ``meta.json`` beside it, or ``data.bin_vocab_size``). Text
data gets its own cached tokenizer. Text is streamed: read, encoded and written in
pieces (``stream``), so memory does not grow with the corpus; the tokenizer is
trained on at most ``data.tokenizer_sample_mb`` of it, sampled over the whole
corpus. Inputs that cannot be trained on are refused with one sentence
(``sources``).

Batches are a pure function of (seed, step, micro-batch, rank): no sampler state
to save, so a resumed run draws exactly the batches an uninterrupted run would,
and ``N`` ranks with batch ``B`` see the same global batch as one rank with
batch ``N·B``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sysconfig
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from leantrain.config import ConfigError, DataConfig
from leantrain.data.examples import detect_format, example_texts
from leantrain.data.packing import ExampleData, load_examples
from leantrain.data.records import TRAIN_SPLITS, dataset_split, is_record_file, record_files
from leantrain.data.sources import TEXT_SUFFIXES, Doc, Source, token_file, user_source
from leantrain.data.stream import TokenWriter, open_tokens, sampled, token_dtype
from leantrain.data.tokenizer import Tokenizer

__all__ = ["TEXT_SUFFIXES", "ExampleData", "TokenData", "Tokenizer", "cache_dir", "load", "open_tokenizer",
           "stdlib_files"]
# (a corpus larger than this is sampled for the tokenizer's training; see DataConfig.tokenizer_sample_mb)
DEFAULT_TOKENIZER_SAMPLE_MB = 64.0


def cache_dir() -> Path:
    root = os.environ.get("LEANTRAIN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "leantrain"
    )
    p = Path(root)
    p.mkdir(parents=True, exist_ok=True)
    return p


# ---------------------------------------------------------------- sources


def stdlib_files(max_mb: float, root: Path | None = None) -> list[Path]:
    """The standard library's .py files (no site-packages), sorted, up to ``max_mb`` of text: the
    running Python's, or those of the standard library at ``root``."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else Path(root)
    files = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root).as_posix()
        if "site-packages" in rel or "dist-packages" in rel:
            continue
        files.append(f)
    # spread the cap over the whole tree: take files in a stable pseudo-random order
    files.sort(key=lambda f: zlib.crc32(f.relative_to(root).as_posix().encode()))
    out, total = [], 0
    for f in files:
        size = f.stat().st_size
        if total + size > max_mb * 2**20:
            continue
        out.append(f)
        total += size
    return sorted(out)


def _is_val(name: str, val_fraction: float) -> bool:
    return (zlib.crc32(name.encode()) % 10_000) < val_fraction * 10_000


# ---------------------------------------------------------------- token data


@dataclass
class TokenData:
    train: np.ndarray  # 1-D token ids (memory-mapped)
    val: np.ndarray
    tokenizer: Tokenizer | None
    vocab_size: int
    source: str

    def batch(self, split: str, seq_len: int, batch_size: int, *, seed: int, step: int, micro: int = 0,
              rank: int = 0, world: int = 1, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch ``micro`` of ``step`` for ``rank``: a slice of one global batch of ``world·batch_size``."""
        data = self.train if split == "train" else self.val
        hi = len(data) - seq_len - 1
        if hi <= 0:
            raise ConfigError(f"the {split} split has {len(data)} tokens, fewer than data.seq_len+1 = {seq_len + 1}; "
                              "use more data or a shorter data.seq_len")
        g = torch.Generator().manual_seed((seed * 1_000_003 + step * 1009 + micro * 17 + (split == "val")) % 2**63)
        starts = torch.randint(0, hi, (world * batch_size,), generator=g)[rank * batch_size:(rank + 1) * batch_size]
        idx = starts.numpy()[:, None] + np.arange(seq_len + 1)[None, :]
        chunk = torch.from_numpy(data[idx].astype(np.int64))
        x, y = chunk[:, :-1], chunk[:, 1:]
        if str(device) != "cpu":
            x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x, y



# ---------------------------------------------------------------- text corpora


@dataclass
class _Split:
    """How a corpus divides into train and validation: by document name, or one document by characters."""

    val_fraction: float
    single: Doc | None = None  # the only non-blank document: its first ``cut`` characters train
    cut: int = 0
    flipped: str | None = None  # the document moved to the split its name does not hash to (one split empty)
    train_size: int = 0  # characters or bytes of the training text (for sampling the tokenizer's)

    def is_val(self, name: str) -> bool:
        return _is_val(name, self.val_fraction) != (name == self.flipped)


def _plan(source: Source, val_fraction: float) -> _Split:
    """Split by file name (a stable hash); a split left empty takes the last document of the other
    (but for ``val_fraction`` 0: nothing held out); a corpus of one document is split by characters at
    its end."""
    count = n_val = 0
    last: dict[bool, str | None] = {False: None, True: None}
    sizes = {False: 0, True: 0}
    first = None
    for doc in source.documents():
        if doc.blank():
            continue
        in_val = _is_val(doc.name, val_fraction)
        count, n_val = count + 1, n_val + in_val
        last[in_val] = doc.name
        sizes[in_val] += doc.size()
        first = first or doc
    if count == 0:
        raise ConfigError(f"the corpus {source.describe} is empty: no non-blank text found")
    if val_fraction == 0:  # (nothing held out: the validation split stays empty)
        return _Split(val_fraction, train_size=sizes[False])
    if count == 1:
        cut = int(first.chars() * (1 - val_fraction))
        return _Split(val_fraction, single=first, cut=cut, train_size=cut)
    flipped = last[False] if n_val == 0 else last[True] if n_val == count else None
    return _Split(val_fraction, flipped=flipped, train_size=sizes[False] or sizes[True])


def _split_pieces(source: Source, split: _Split):
    """(split, text piece, whether a document ends after it) over the whole corpus, in order."""
    if split.single is not None:
        pos = 0
        for piece in split.single.pieces():
            if pos < split.cut:
                yield "train", piece[:split.cut - pos], False
            if pos + len(piece) > split.cut:
                yield "val", piece[max(0, split.cut - pos):], False
            pos += len(piece)
        yield "train", "", True
        yield "val", "", True
        return
    for doc in source.documents():
        if doc.blank():
            continue
        name = "val" if split.is_val(doc.name) else "train"
        for piece in doc.pieces():
            yield name, piece, False
        yield name, "", True


def _tokenize(source: Source, split: _Split, tok: Tokenizer, paths: dict) -> dict:
    writers = {name: TokenWriter(tok, path) for name, path in paths.items()}
    try:
        for name, piece, doc_end in _split_pieces(source, split):
            writers[name].add(piece, doc_end)
        return {name: w.close() for name, w in writers.items()}
    except BaseException:
        for w in writers.values():
            w.abort()
        raise


def tokenizer_key(tok) -> str:
    """A short hash of a tokenizer's vocabulary, merges and end-of-text id (for cache keys)."""
    text = tok.tokenizer.to_str()
    return hashlib.sha1(f"{text}\0{tok.eot_id}".encode()).hexdigest()[:12]


def _from_source(source: Source, cfg: DataConfig, key: str, log, tokenizer=None) -> TokenData:
    split = _plan(source, cfg.val_fraction)
    cdir = cache_dir()
    tok_path = cdir / f"tokenizer-{key}.json"
    if tokenizer is not None:
        tok = tokenizer
    elif tok_path.exists():
        tok = Tokenizer.load(tok_path)
    else:
        t0 = time.time()
        sample_mb = getattr(cfg, "tokenizer_sample_mb", DEFAULT_TOKENIZER_SAMPLE_MB)
        cap = sample_mb * 2**20
        note = f" (a {sample_mb:g} MB sample of it)" if split.train_size > cap else ""
        log(f"training a {cfg.tokenizer_vocab}-token BPE tokenizer on {source.describe}{note} ...")
        texts = (piece for name, piece, _ in _split_pieces(source, split) if name == "train" and piece)
        tok = Tokenizer.train(sampled(texts, split.train_size, cap), cfg.tokenizer_vocab, tok_path)
        log(f"tokenizer ready in {time.time() - t0:.1f}s ({tok_path})")
    paths = {name: cdir / f"tokens-{key}-{name}.bin" for name in ("train", "val")}
    if all(p.exists() for p in paths.values()):
        arrays = {name: open_tokens(p, token_dtype(tok.vocab_size)) for name, p in paths.items()}
    else:
        t0 = time.time()
        arrays = _tokenize(source, split, tok, paths)
        if time.time() - t0 > 5:
            log(f"tokenized {source.describe} in {time.time() - t0:.1f}s")
    return TokenData(arrays["train"], arrays["val"], tok, tok.vocab_size, source.describe)


def _load_bin(path: Path, cfg: DataConfig, tokenizer=None) -> TokenData:
    arr, vocab = token_file(path, cfg)
    cut = int(len(arr) * (1 - cfg.val_fraction))
    return TokenData(arr[:cut], arr[cut:], tokenizer, vocab, str(path))


def open_tokenizer(source: str):
    """The tokenizer of ``data.tokenizer``: a ``tokenizer.json`` file or a Hugging Face model directory."""
    from leantrain.model.hf import load_tokenizer

    path = Path(source).expanduser()
    tok = load_tokenizer(path) if path.exists() else None
    if tok is None:
        raise ConfigError(f"data.tokenizer {source}: neither a tokenizer.json file nor a directory holding one")
    return tok


def _file_stats(path: Path) -> list:
    """(name, mtime, size) of each file of ``path`` (a file, or every file under a directory): for cache keys."""
    return [(str(f), f.stat().st_mtime_ns, f.stat().st_size) for f in record_files(path)]


def _examples(path: Path, fmt: str, cfg: DataConfig, tokenizer, log) -> ExampleData:
    """Instruct / chat examples; without a tokenizer, a BPE trained on their text (cached)."""
    if tokenizer is None:
        key = hashlib.sha1(json.dumps([str(path.resolve()), _file_stats(path), fmt,
                                       cfg.tokenizer_vocab]).encode()).hexdigest()[:12]
        tok_path = cache_dir() / f"tokenizer-examples-{key}.json"
        if tok_path.exists():
            tokenizer = Tokenizer.load(tok_path)
        else:
            log(f"training a {cfg.tokenizer_vocab}-token BPE tokenizer on {path} ...")
            tokenizer = Tokenizer.train(example_texts(path, fmt), cfg.tokenizer_vocab, tok_path)
    return load_examples(path, fmt, cfg, tokenizer, log)


def load(cfg: DataConfig, log=print, tokenizer=None) -> TokenData | ExampleData:
    """Load (and on first use, tokenize and cache) the configured corpus; ``ConfigError`` for unusable input.

    The tokenizer: ``data.tokenizer`` when set, else ``tokenizer`` (a :class:`Tokenizer` or a
    :class:`leantrain.model.hf.HFTokenizer`: a model's own); text is encoded with it and no BPE is
    trained. Neither: a BPE of ``data.tokenizer_vocab`` tokens is trained on the corpus (and
    cached). Instruct / chat records (``data.format``) give :class:`ExampleData`; a ``DatasetDict``
    directory is read through its ``train`` split. With ``data.eval_path`` set nothing is held out of
    the training data (``data.val_fraction`` is not used: that file scores the run) and the
    validation split is empty."""
    if cfg.eval_path is not None:
        cfg = dataclasses.replace(cfg, val_fraction=0.0)
    if cfg.tokenizer:
        tokenizer = open_tokenizer(cfg.tokenizer)
    sample_mb = getattr(cfg, "tokenizer_sample_mb", DEFAULT_TOKENIZER_SAMPLE_MB)
    vocab_key = cfg.tokenizer_vocab if tokenizer is None else tokenizer_key(tokenizer)
    if cfg.path is None:
        files = stdlib_files(cfg.max_corpus_mb)
        if not files:
            raise ConfigError("the embedded corpus is empty: no standard-library .py files were found; pass --data PATH")
        root = Path(sysconfig.get_paths()["stdlib"])
        fields = [vocab_key, cfg.val_fraction, [(str(f.relative_to(root)), f.stat().st_size) for f in files]]
        if cfg.max_corpus_mb > sample_mb:
            fields.append(sample_mb)
        fingerprint = hashlib.sha1(json.dumps(fields).encode()).hexdigest()[:12]
        source = Source(f"the Python {sysconfig.get_python_version()} standard library",
                        [Doc(f.relative_to(root).as_posix(), path=f) for f in files])
        return _from_source(source, cfg, f"stdlib-{fingerprint}", log, tokenizer)
    path = Path(cfg.path).expanduser()
    if not path.exists():
        raise ConfigError(f"data path {str(path)!r} does not exist; give a text file, a directory, a record file "
                          "(.jsonl, .json, .parquet, a datasets directory) or a .bin token file")
    try:
        if path.suffix == ".bin" and path.is_file():
            return _load_bin(path, cfg, tokenizer)
        path = dataset_split(path, TRAIN_SPLITS)
        fmt = cfg.format
        if is_record_file(path) and fmt == "auto" and (path.is_dir() or path.stat().st_size):
            fmt = detect_format(path)
        if fmt == "choice":
            raise ConfigError(f"{path} holds multiple-choice records (prompt, choices, answer): score them with "
                              "leantrain eval; training takes text, instruct or chat records")
        if fmt in ("instruct", "chat"):
            if not is_record_file(path):
                raise ConfigError(f"data.format {fmt} reads a record file (.jsonl, .json, .parquet or a datasets "
                                  f"directory); {path} is not one")
            return _examples(path, fmt, cfg, tokenizer, log)
        source = user_source(path, log)
        fingerprint = hashlib.sha1(json.dumps(
            [str(path.resolve()), _file_stats(path), vocab_key, cfg.val_fraction, sample_mb]).encode()).hexdigest()[:12]
        return _from_source(source, cfg, f"user-{fingerprint}", log, tokenizer)
    except (PermissionError, IsADirectoryError, UnicodeDecodeError) as e:
        raise ConfigError(f"data {path} cannot be read ({e})") from None

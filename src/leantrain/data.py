"""Corpora, tokenizers and batches.

The embedded default corpus is the Python standard library's own source: the
``.py`` files of the running interpreter, present on every machine with
Python. Files are split into train and validation *by file* (a stable hash of
the relative path), a byte-level BPE tokenizer is trained on the training files
with the ``tokenizers`` library, and both splits are tokenized once into
memory-mapped ``.bin`` files under the user's cache directory
(``$XDG_CACHE_HOME/leantrain`` or ``~/.cache/leantrain``).

Users' own data: a text file, a directory of text files (``.txt``, ``.md``,
``.py``), a JSONL file (one ``{"text": ...}`` per line), or a pre-tokenized
``.bin`` file of uint16 (or uint32 when ``<file>.json`` says ``"dtype":
"uint32"``) token ids. Text data gets its own cached tokenizer.

Batches are a pure function of (seed, step, micro-batch, rank): no sampler state
to save, so a resumed run draws exactly the batches an uninterrupted run would,
and ``N`` ranks with batch ``B`` see the same global batch as one rank with
batch ``N·B``.
"""

from __future__ import annotations

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

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".text")


def cache_dir() -> Path:
    root = os.environ.get("LEANTRAIN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "leantrain"
    )
    p = Path(root)
    p.mkdir(parents=True, exist_ok=True)
    return p


# ---------------------------------------------------------------- sources


def stdlib_files(max_mb: float) -> list[Path]:
    """The standard library's .py files (no site-packages), sorted, up to ``max_mb`` of text."""
    root = Path(sysconfig.get_paths()["stdlib"])
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


def _read(f: Path) -> str:
    return f.read_text(encoding="utf-8", errors="replace")


def _text_documents(path: Path) -> list[tuple[str, str]]:
    """(name, text) pairs from a text file, a directory of text files, or a JSONL file."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        return [(p.relative_to(path).as_posix(), _read(p)) for p in files]
    if path.suffix == ".jsonl":
        docs = []
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{i + 1}: not valid JSON ({e.msg}); JSONL needs one object per line") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                raise ConfigError(f"{path}:{i + 1}: each JSONL line needs a string field 'text'")
            docs.append((f"line{i}", rec["text"]))
        return docs
    return [(path.name, _read(path))]


# ---------------------------------------------------------------- tokenizer


class Tokenizer:
    """A byte-level BPE tokenizer (``tokenizers`` library) with an end-of-text token."""

    EOT = "<|endoftext|>"

    def __init__(self, tok):
        self._tok = tok
        self.eot_id = tok.token_to_id(self.EOT)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts)]

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids))

    @classmethod
    def train(cls, texts, vocab_size: int, path: Path) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[cls.EOT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        out = cls(tok)
        out.save(path)
        return out

    def save(self, path: Path) -> None:
        """Write the tokenizer to ``path`` atomically (a temporary file, then a rename)."""
        tmp = Path(path).with_suffix(".tmp")
        self._tok.save(str(tmp))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        return cls(HFTokenizer.from_file(str(path)))


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


def _tokenize_to_bin(tok: Tokenizer, docs: list[str], path: Path) -> np.ndarray:
    ids: list[int] = []
    for start in range(0, len(docs), 256):
        for seq in tok.encode_batch(docs[start:start + 256]):
            ids.extend(seq)
            ids.append(tok.eot_id)
    dtype = np.uint16 if tok.vocab_size <= 65535 else np.uint32
    arr = np.asarray(ids, dtype=dtype)
    tmp = path.with_suffix(".tmp")
    arr.tofile(tmp)
    os.replace(tmp, path)
    return np.memmap(path, dtype=dtype, mode="r")


def _from_docs(docs: list[tuple[str, str]], cfg: DataConfig, key: str, source: str, log) -> TokenData:
    docs = [(n, t) for n, t in docs if t.strip()]
    if not docs:
        raise ConfigError(f"the corpus {source} is empty: no non-blank text found")
    if len(docs) == 1:  # one document: split by characters at the end
        n, t = docs[0]
        cut = int(len(t) * (1 - cfg.val_fraction))
        train_docs, val_docs = [t[:cut]], [t[cut:]]
    else:
        train_docs = [t for n, t in docs if not _is_val(n, cfg.val_fraction)]
        val_docs = [t for n, t in docs if _is_val(n, cfg.val_fraction)]
        if not val_docs:
            val_docs = [train_docs.pop()]
        if not train_docs:
            train_docs = [val_docs.pop()]
    cdir = cache_dir()
    tok_path = cdir / f"tokenizer-{key}.json"
    if tok_path.exists():
        tok = Tokenizer.load(tok_path)
    else:
        t0 = time.time()
        log(f"training a {cfg.tokenizer_vocab}-token BPE tokenizer on {source} ...")
        tok = Tokenizer.train(train_docs, cfg.tokenizer_vocab, tok_path)
        log(f"tokenizer ready in {time.time() - t0:.1f}s ({tok_path})")
    arrays = {}
    for split, split_docs in (("train", train_docs), ("val", val_docs)):
        p = cdir / f"tokens-{key}-{split}.bin"
        if p.exists():
            dtype = np.uint16 if tok.vocab_size <= 65535 else np.uint32
            arrays[split] = np.memmap(p, dtype=dtype, mode="r")
        else:
            arrays[split] = _tokenize_to_bin(tok, split_docs, p)
    return TokenData(arrays["train"], arrays["val"], tok, tok.vocab_size, source)


def _load_bin(path: Path, cfg: DataConfig) -> TokenData:
    meta_path = path.with_suffix(path.suffix + ".json")
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    dtype = np.dtype(meta.get("dtype", "uint16"))
    arr = np.memmap(path, dtype=dtype, mode="r")
    if len(arr) == 0:
        raise ConfigError(f"token file {path} is empty")
    vocab = int(meta.get("vocab_size", int(arr.max()) + 1))
    cut = int(len(arr) * (1 - cfg.val_fraction))
    return TokenData(arr[:cut], arr[cut:], None, vocab, str(path))


def load(cfg: DataConfig, log=print) -> TokenData:
    """Load (and on first use, tokenize and cache) the configured corpus."""
    if cfg.path is None:
        files = stdlib_files(cfg.max_corpus_mb)
        if not files:
            raise ConfigError("the embedded corpus is empty: no standard-library .py files were found; pass --data PATH")
        root = Path(sysconfig.get_paths()["stdlib"])
        fingerprint = hashlib.sha1(
            json.dumps([cfg.tokenizer_vocab, cfg.val_fraction, [(str(f.relative_to(root)), f.stat().st_size) for f in files]]).encode()
        ).hexdigest()[:12]
        docs = [(f.relative_to(root).as_posix(), _read(f)) for f in files]
        return _from_docs(docs, cfg, f"stdlib-{fingerprint}", f"the Python {sysconfig.get_python_version()} standard library", log)
    path = Path(cfg.path).expanduser()
    if not path.exists():
        raise ConfigError(f"data path {str(path)!r} does not exist; give a text file, a directory, a .jsonl or a .bin token file")
    if path.suffix == ".bin":
        return _load_bin(path, cfg)
    docs = _text_documents(path)
    st = path.stat()
    fingerprint = hashlib.sha1(
        json.dumps([str(path.resolve()), st.st_mtime_ns, st.st_size, len(docs), cfg.tokenizer_vocab, cfg.val_fraction]).encode()
    ).hexdigest()[:12]
    return _from_docs(docs, cfg, f"user-{fingerprint}", str(path), log)

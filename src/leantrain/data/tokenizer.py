"""The byte-level BPE tokenizer of text corpora (``tokenizers`` library) with an end-of-text token."""

from __future__ import annotations

import os
from pathlib import Path


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
        """The text's ids, without the special tokens a loaded tokenizer's post-processor may add."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text (without the offsets ``encode`` computes: the same ids, less memory)."""
        return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]

    @property
    def tokenizer(self):
        """The ``tokenizers.Tokenizer`` (as :class:`leantrain.model.hf.HFTokenizer` names it)."""
        return self._tok

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids))

    @classmethod
    def train(cls, texts, vocab_size: int, path: Path) -> Tokenizer:
        """Train on ``texts`` (an iterable of strings, consumed once) and save to ``path``.

        Texts split only where the byte-level pre-tokenizer splits (see ``stream.safe_pieces``)
        give the same word counts, hence the same tokenizer, as the whole documents.
        """
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
        tmp = Path(path).with_suffix(f".{os.getpid()}.tmp")  # (several ranks may save at once)
        self._tok.save(str(tmp))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        return cls(HFTokenizer.from_file(str(path)))

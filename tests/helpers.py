"""Small corpora and configs that keep trainer tests to seconds on 2 cores."""

from __future__ import annotations

import sysconfig
from pathlib import Path

from leantrain import config as C

TINY_OVERRIDES = {
    "model.dim": "48", "model.n_layers": "2", "model.n_heads": "4", "model.n_kv_heads": "2", "model.ffn_dim": "96",
    "model.max_seq_len": "64", "data.seq_len": "32", "data.batch_size": "4", "data.tokenizer_vocab": "400",
    "train.eval_every": "5", "train.eval_batches": "2", "train.ckpt_every": "5", "train.progress": "false",
    "train.sample_tokens": "0", "optim.warmup_steps": "2", "train.log_every": "1000",
}


def write_corpus(dir_: Path, kb: int = 120) -> Path:
    """A directory of real text: a few standard-library modules (train/val split by file)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = dir_ / "corpus"
    out.mkdir(parents=True, exist_ok=True)
    total = 0
    for name in ["textwrap.py", "fractions.py", "shlex.py", "colorsys.py", "heapq.py", "bisect.py", "string.py",
                 "glob.py", "fnmatch.py", "keyword.py", "numbers.py", "calendar.py", "difflib.py", "argparse.py"]:
        f = root / name
        if f.exists() and total < kb * 1024:
            (out / (name + ".txt")).write_text(f.read_text())
            total += f.stat().st_size
    return out


def tiny_config(corpus: Path, **extra) -> C.Config:
    return C.build("tiny", overrides={**TINY_OVERRIDES, "data.path": str(corpus), **extra})


class CharTok:
    """A character tokenizer (digits, letters, punctuation) standing in for a run's BPE in the
    fine-tuning tests: the generated tasks' prompts and answers, one token a character."""

    def __init__(self):
        self.chars = sorted(set("0123456789abcdefgh ()[]{},:='%\nmaxsud=+-"))
        self.eot_id = len(self.chars)

    def encode(self, s):
        return [self.chars.index(c) for c in s]

    def encode_batch(self, ss):
        return [self.encode(s) for s in ss]

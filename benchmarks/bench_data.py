"""Data loading benchmark: peak memory and time of tokenizing a large text file, streamed.

    PYTHONPATH=src python3 benchmarks/bench_data.py                       # 1 GB, writes results/data/<date>_cpu.json
    PYTHONPATH=src python3 benchmarks/bench_data.py --mb 20 --print       # 20 MB, prints the record only

Generates a text file of random words (a fixed vocabulary of 20 000 pseudo-words, lines of
4-20 words) in a temporary directory, then loads it in a fresh subprocess exactly as
``leantrain train --data FILE`` does: a 4096-token BPE tokenizer trained on (a sample of)
the text, both splits tokenized into the cache. Measured: the subprocess's peak RSS
(``getrusage(RUSAGE_CHILDREN).ru_maxrss``) and its wall time. Also measured: how fast
``hashlib`` hashes 100 MB with sha256 and with blake2b (the checkpoint manifest's choice).
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
BLOCK_BYTES = 4 * 2**20

_LOADER = """
import json, sys
from leantrain import data
from leantrain.config import DataConfig
d = data.load(DataConfig(path=sys.argv[1], tokenizer_vocab=4096), log=lambda *a: print(*a, file=sys.stderr))
print(json.dumps({"tokens": int(len(d.train) + len(d.val)), "vocab_size": d.vocab_size}))
"""


def write_corpus(path: Path, size_bytes: int, seed: int = 0) -> int:
    """Random words from a fixed pseudo-word vocabulary, about ``size_bytes`` of them; returns the bytes written."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab = np.array(["".join(rng.choice(letters, rng.integers(2, 11))) for _ in range(20_000)])
    written = 0
    with open(path, "w") as f:
        while written < size_bytes:
            words = vocab[rng.zipf(1.2, BLOCK_BYTES // 6) % len(vocab)]
            ends = np.cumsum(rng.integers(4, 21, len(words) // 4))
            lines = [" ".join(words[a:b]) for a, b in zip(np.r_[0, ends[:-1]], ends) if b <= len(words)]
            block = "\n".join(lines)[: size_bytes - written] + "\n"
            f.write(block)
            written += len(block)
    return written


def hash_speed(mb: int = 100) -> dict:
    """MB/s of hashlib's sha256 and blake2b over ``mb`` MB of random bytes, in 8 MB blocks."""
    data = os.urandom(mb * 2**20)
    out = {}
    for name in ("sha256", "blake2b"):
        t0 = time.perf_counter()
        h = hashlib.new(name)
        for i in range(0, len(data), 8 * 2**20):
            h.update(data[i:i + 8 * 2**20])
        out[name] = round(mb / (time.perf_counter() - t0), 1)
    return out


def measure(size_mb: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        size = write_corpus(corpus, int(size_mb * 2**20))
        env = {**os.environ, "PYTHONPATH": str(SRC), "LEANTRAIN_CACHE": str(Path(tmp) / "cache")}
        command = [sys.executable, "-c", _LOADER, str(corpus)]
        t0 = time.perf_counter()
        proc = subprocess.run(command, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        if proc.returncode:
            raise SystemExit(f"the loader failed:\n{proc.stderr}")
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # (kilobytes on Linux)
    return {"what": f"leantrain.data.load of a {size_mb:g} MB text file (random words), tokenizer_vocab 4096, "
                    "tokenizer trained and both splits tokenized in a fresh subprocess",
            "command": f"PYTHONPATH=src python3 benchmarks/bench_data.py --mb {size_mb:g}",
            "file_bytes": size, "peak_rss_bytes": peak, "seconds": round(seconds, 1),
            **json.loads(proc.stdout.strip().splitlines()[-1]), "log": proc.stderr.strip().splitlines()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=1024.0, help="size of the generated text file in MiB")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "data")
    ap.add_argument("--print", action="store_true", help="print the record only; write no file")
    args = ap.parse_args()
    record = measure(args.mb)
    if not args.print:
        record["hash_mb_per_s"] = hash_speed()
        record.update(date=dt.date.today().isoformat(), python=platform.python_version(), machine=platform.machine(),
                      cpus=os.cpu_count(), load_average=[round(x, 1) for x in os.getloadavg()])
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"{dt.date.today().isoformat()}_cpu.json"
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {path}")
    print(json.dumps(record))


if __name__ == "__main__":
    main()

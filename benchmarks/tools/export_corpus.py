"""The embedded corpus of the running Python, written out: the data of a run elsewhere made the same.

    PYTHONPATH=src python3 benchmarks/tools/export_corpus.py --out DIR [--max-mb MB]
    PYTHONPATH=src python3 benchmarks/tools/export_corpus.py --out corpus.tar.gz
    PYTHONPATH=src python3 benchmarks/tools/export_corpus.py --stdlib LIB/python3.12 --out DIR

The embedded corpus (no ``--data``) is the standard library of the Python that runs leantrain, so
two hosts with different Pythons train the presets on different text. This writes the files the
embedded corpus takes (``leantrain.data.stdlib_files``, ``--max-mb`` as ``data.max_corpus_mb``)
under their standard-library paths, as a directory or a ``.tar.gz``; with ``--stdlib``, those of
another Python's standard library (its ``lib/python3.X`` directory), that Python's embedded corpus.
``--data DIR`` then trains on that text on any host, split into train and validation files as the
embedded corpus is (by file name). A directory read through ``--data`` skips files that are not
UTF-8 text (a few test files), which the embedded corpus keeps.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import sysconfig
import tarfile
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))


def main(argv=None) -> int:
    from leantrain.config.tree import DataConfig
    from leantrain.data import stdlib_files

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="a directory, or a file ending in .tar.gz")
    default_mb = DataConfig().max_corpus_mb
    ap.add_argument("--max-mb", type=float, default=default_mb,
                    help=f"data.max_corpus_mb of the runs ({default_mb:g}: its default)")
    ap.add_argument("--stdlib", help="another Python's standard library directory (default: this Python's)")
    args = ap.parse_args(argv)
    root = Path(args.stdlib or sysconfig.get_paths()["stdlib"])
    files = stdlib_files(args.max_mb, root)
    if not files:
        raise SystemExit(f"no standard-library .py files under {root}")
    out = Path(args.out)
    if out.name.endswith(".tar.gz"):
        with tarfile.open(out, "w:gz") as tar:
            for f in files:
                tar.add(f, arcname=f.relative_to(root).as_posix())
    else:
        if out.exists() and any(out.iterdir()):
            raise SystemExit(f"{out} is not empty")
        for f in files:
            dst = out / f.relative_to(root)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dst)
    size = sum(f.stat().st_size for f in files) / 2**20
    print(f"{len(files)} files, {size:.1f} MiB of the standard library at {root.name} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

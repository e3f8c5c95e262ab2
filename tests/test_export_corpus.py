"""benchmarks/tools/export_corpus.py writes the embedded corpus's files under their standard-library
paths, so ``--data DIR`` on another host splits them into train and validation files as the embedded
corpus does (by file name)."""

import importlib.util
import sysconfig
import tarfile
from pathlib import Path

import pytest

from leantrain.data import stdlib_files

TOOL = Path(__file__).parent.parent / "benchmarks" / "tools" / "export_corpus.py"


def _tool():
    spec = importlib.util.spec_from_file_location("export_corpus", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_export_corpus_directory_and_tar(tmp_path):
    root = Path(sysconfig.get_paths()["stdlib"])
    want = {f.relative_to(root).as_posix(): f.read_bytes() for f in stdlib_files(0.3)}
    assert want
    tool = _tool()
    assert tool.main(["--out", str(tmp_path / "dir"), "--max-mb", "0.3"]) == 0
    got = {p.relative_to(tmp_path / "dir").as_posix(): p.read_bytes()
           for p in (tmp_path / "dir").rglob("*") if p.is_file()}
    assert got == want
    assert tool.main(["--out", str(tmp_path / "c.tar.gz"), "--max-mb", "0.3"]) == 0
    with tarfile.open(tmp_path / "c.tar.gz") as tar:
        assert sorted(m.name for m in tar.getmembers() if m.isfile()) == sorted(want)
    with pytest.raises(SystemExit, match="not empty"):
        tool.main(["--out", str(tmp_path / "dir"), "--max-mb", "0.3"])


def test_export_corpus_of_another_stdlib(tmp_path):
    lib = tmp_path / "python3.99"
    for name, text in [("a.py", "x = 1\n"), ("pkg/b.py", "y = 2\n"), ("site-packages/c.py", "z = 3\n"),
                       ("notes.txt", "not python\n")]:
        (lib / name).parent.mkdir(parents=True, exist_ok=True)
        (lib / name).write_text(text)
    assert _tool().main(["--stdlib", str(lib), "--out", str(tmp_path / "out")]) == 0
    got = sorted(p.relative_to(tmp_path / "out").as_posix() for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert got == ["a.py", "pkg/b.py"]

"""Record files: the same records as .jsonl, .json, .parquet and Hugging Face datasets directories
read alike, train alike, and name FILE:ROW when one is malformed."""

import json
import sys

import numpy as np
import pytest
from test_chat import _word_tokenizer

from leantrain import data as data_mod
from leantrain.config import ConfigError, DataConfig
from leantrain.data.examples import detect_format, record_format_of, records
from leantrain.data.records import EVAL_SPLITS, dataset_split, is_record_file, read_records

pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed (pip install -e '.[dev]')")
import pyarrow.parquet as pq  # noqa: E402

QUIET = dict(log=lambda *a: None)
FORMATS = ("jsonl", "array.json", "object.json", "parquet", "dataset", "dataset_dict")


def _rows(fmt: str, n: int = 12) -> list[dict]:
    rows = []
    for i in range(n):
        a, b = i % 7, (3 * i) % 5
        if fmt == "text":
            rows.append({"text": f"what is {a} + {b} ? {a + b} ."})
        elif fmt == "instruct":
            rows.append({"prompt": f"what is {a} + {b} ?", "completion": f"{a + b} !"})
        else:
            rows.append({"messages": [{"role": "user", "content": f"what is {a} + {b} ?"},
                                      {"role": "assistant", "content": f"{a + b} , thanks !"}]})
    return rows


def _write_dataset(directory, rows, shards=2):
    """A ``Dataset.save_to_disk`` directory as datasets writes it: Arrow stream shards, state.json
    (``json.dump(state, indent=2, sort_keys=True)``) and dataset_info.json (top-level keys sorted)."""
    directory.mkdir(parents=True)
    table = pa.Table.from_pylist(rows)
    features = {name: {"dtype": "string", "_type": "Value"} for name in table.column_names}
    schema = table.schema.with_metadata({"huggingface": json.dumps({"info": {"features": features}})})
    names, per = [], -(-len(rows) // shards)
    for k in range(shards):
        name = f"data-{k:05d}-of-{shards:05d}.arrow"
        with pa.OSFile(str(directory / name), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
            writer.write_table(table.slice(k * per, per).cast(schema))
        names.append(name)
    state = {"_data_files": [{"filename": n} for n in names], "_fingerprint": "0123456789abcdef",
             "_format_columns": None, "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False,
             "_split": None}
    (directory / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
    info = {"citation": "", "description": "", "features": features, "homepage": "", "license": ""}
    (directory / "dataset_info.json").write_text(json.dumps({k: info[k] for k in sorted(info)}, indent=2))
    return directory


def write_as(kind: str, tmp_path, rows):
    """``rows`` written as one record file of ``kind``; its path."""
    if kind == "jsonl":
        path = tmp_path / "r.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "array.json":
        path = tmp_path / "array.json"
        path.write_text(json.dumps(rows, indent=1))
    elif kind == "object.json":
        path = tmp_path / "object.json"
        path.write_text(json.dumps({"version": "1.0", "data": rows}))
    elif kind == "parquet":
        path = tmp_path / "r.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=5)
    elif kind == "dataset":
        path = _write_dataset(tmp_path / "ds", rows)
    else:
        path = tmp_path / "dd"
        _write_dataset(path / "train", rows)
        _write_dataset(path / "test", rows[:3], shards=1)
        (path / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    return path


@pytest.mark.parametrize("fmt", ["text", "instruct", "chat"])
def test_every_kind_of_record_file_reads_the_same_records(tmp_path, fmt):
    rows = _rows(fmt)
    for kind in FORMATS:
        path = write_as(kind, tmp_path, rows)
        assert is_record_file(path) and detect_format(path) == fmt == record_format_of(path), kind
        assert [rec for _, rec in records(path, fmt)] == rows, kind
        assert [i for i, _ in read_records(path)] == list(range(1, len(rows) + 1)), kind


def _training_rows(data):
    if isinstance(data, data_mod.TokenData):
        return [np.asarray(data.train).tolist(), np.asarray(data.val).tolist()]
    return [getattr(split, f).tolist() for split in (data.train, data.val)
            for f in ("tokens", "targets", "documents")]


@pytest.mark.parametrize("fmt", ["text", "instruct", "chat"])
def test_every_kind_of_record_file_trains_on_the_same_rows(tmp_path, fmt):
    tok = _word_tokenizer()
    rows = _rows(fmt)
    seen = {}
    for kind in FORMATS:
        path = write_as(kind, tmp_path, rows)
        data = data_mod.load(DataConfig(path=str(path), seq_len=16, val_fraction=0.25), tokenizer=tok, **QUIET)
        seen[kind] = _training_rows(data)
    assert all(seen[kind] == seen["jsonl"] for kind in FORMATS), fmt
    assert sum(len(r) for r in seen["jsonl"]) > 0


def _trained_tokens(data) -> int:
    """Tokens trained on over both splits: every token of a token corpus, the targets of examples."""
    if isinstance(data, data_mod.TokenData):
        return len(data.train) + len(data.val)
    return int((data.train.targets != -100).sum() + (data.val.targets != -100).sum())


@pytest.mark.parametrize("fmt", ["text", "instruct", "chat"])
def test_an_eval_file_leaves_every_record_to_training(tmp_path, fmt):
    """With ``data.eval_path`` set that file scores the run: nothing of ``data.path`` is held out (the
    validation split is empty, from the cache too), and training has every token the two splits had."""
    tok = _word_tokenizer()
    path = write_as("jsonl", tmp_path, _rows(fmt, 40))
    split = data_mod.load(DataConfig(path=str(path), seq_len=16, val_fraction=0.25), tokenizer=tok, **QUIET)
    assert len(split.val.tokens if fmt != "text" else split.val) > 0
    for _ in range(2):  # (the second from the token cache)
        whole = data_mod.load(DataConfig(path=str(path), seq_len=16, val_fraction=0.25, eval_path=str(path)),
                              tokenizer=tok, **QUIET)
        assert len(whole.val.tokens if fmt != "text" else whole.val) == 0
        assert _trained_tokens(whole) == _trained_tokens(split)
    (tmp_path / "one").mkdir()
    one = write_as("jsonl", tmp_path / "one", _rows(fmt, 1))  # (one example: enough once nothing is held out)
    if fmt != "text":
        with pytest.raises(ConfigError, match="at least 2"):
            data_mod.load(DataConfig(path=str(one), seq_len=16), tokenizer=tok, **QUIET)
    whole = data_mod.load(DataConfig(path=str(one), seq_len=16, eval_path=str(one)), tokenizer=tok, **QUIET)
    assert _trained_tokens(whole) > 0


def test_a_dataset_dict_trains_on_train_and_any_split_by_its_directory(tmp_path):
    path = write_as("dataset_dict", tmp_path, _rows("instruct"))
    assert len(list(read_records(path))) == 12 and len(list(read_records(path / "test"))) == 3
    assert dataset_split(path, EVAL_SPLITS) == path / "test"  # (evaluation: validation, else test)
    (path / "dataset_dict.json").write_text(json.dumps({"splits": ["test"]}))
    with pytest.raises(ConfigError, match=r"holds the splits test and no train split: give the directory"):
        data_mod.load(DataConfig(path=str(path), seq_len=16), tokenizer=_word_tokenizer(), **QUIET)


def _malformed(kind: str, tmp_path):
    rows = _rows("instruct", 4)
    rows[2] = {"prompt": "what is 2 + 3 ?"}
    return write_as(kind, tmp_path, rows)


@pytest.mark.parametrize("kind", FORMATS)
def test_a_malformed_row_names_the_file_and_the_row(tmp_path, kind):
    path = _malformed(kind, tmp_path)
    where = path / "train" if kind == "dataset_dict" else path
    with pytest.raises(ConfigError, match=rf"^{where}:3: an instruct line needs a string 'completion' \(missing\)"):
        data_mod.load(DataConfig(path=str(path), seq_len=16), tokenizer=_word_tokenizer(), **QUIET)


@pytest.mark.parametrize("kind", ["array.json", "dataset"])
def test_a_row_that_is_not_an_object_or_lacks_text_names_the_row(tmp_path, kind):
    if kind == "array.json":
        path = write_as(kind, tmp_path, [{"text": "a"}, ["text"]])
        with pytest.raises(ConfigError, match=rf"^{path}:2: each row needs an object, got a list"):
            data_mod.load(DataConfig(path=str(path)), tokenizer=_word_tokenizer(), **QUIET)
    else:
        path = write_as(kind, tmp_path, [{"text": "a"}, {"text": None}])
        with pytest.raises(ConfigError, match=rf"^{path}:2: each record needs a string field 'text'"):
            data_mod.load(DataConfig(path=str(path)), tokenizer=_word_tokenizer(), **QUIET)


def test_json_shapes_accepted_and_refused(tmp_path):
    lines = tmp_path / "lines.json"
    lines.write_text("".join(json.dumps(r) + "\n" for r in _rows("text", 3)))
    assert [rec for _, rec in read_records(lines)] == _rows("text", 3)  # (JSON Lines named .json)
    for doc, found in (({"train": [], "test": []}, "list fields 'train', 'test'"), ({"text": "a"}, "no list field"),
                       ("just a string", "JSON string"), (None, "JSON null")):
        (tmp_path / "bad.json").write_text(json.dumps(doc))
        with pytest.raises(ConfigError, match=rf"bad.json is a .*{found}; a .json data file holds a JSON array "
                                              "of objects, or an object with exactly one list of objects"):
            list(read_records(tmp_path / "bad.json"))
    (tmp_path / "broken.json").write_text('[\n{"text": "a"},\n{"text": }\n]')
    with pytest.raises(ConfigError, match=r"broken.json:3: not valid JSON"):
        list(read_records(tmp_path / "broken.json"))


def test_tables_and_lone_arrow_files_stay_refused(tmp_path):
    (tmp_path / "a.csv").write_text("text,label\nhello,1\n")
    with pytest.raises(ConfigError, match=r"a.csv is a CSV table, not text: export its rows to a .jsonl, .json or "
                                          r".parquet file"):
        data_mod.load(DataConfig(path=str(tmp_path / "a.csv")), **QUIET)
    ds = write_as("dataset", tmp_path, _rows("text"))
    lone = ds / "data-00000-of-00002.arrow"
    with pytest.raises(ConfigError, match=r"is an Arrow file, not text: give the directory Dataset.save_to_disk "
                                          r"wrote \(with dataset_info.json and state.json\)"):
        data_mod.load(DataConfig(path=str(lone)), **QUIET)
    (ds / "state.json").unlink()  # (a directory of .arrow files alone is no dataset: read as text, none found)
    assert not is_record_file(ds)
    with pytest.raises(ConfigError, match="no text files"):
        data_mod.load(DataConfig(path=str(ds)), **QUIET)


def test_a_broken_parquet_names_the_file(tmp_path):
    (tmp_path / "a.parquet").write_bytes(b"hello")
    with pytest.raises(ConfigError, match=r"a.parquet cannot be read as Parquet \(") as e:
        data_mod.load(DataConfig(path=str(tmp_path / "a.parquet")), **QUIET)
    assert ". " not in str(e.value)


def test_parquet_without_pyarrow_says_how_to_install_it(tmp_path, monkeypatch):
    path = write_as("parquet", tmp_path, _rows("text"))
    for name in [m for m in sys.modules if m == "pyarrow" or m.startswith("pyarrow.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(ConfigError, match=r"^reading .parquet needs pyarrow: pip install 'leantrain\[parquet\]'$"):
        data_mod.load(DataConfig(path=str(path)), **QUIET)


def test_cache_keys_follow_the_files_of_a_dataset_directory(tmp_path):
    tok = _word_tokenizer()
    path = write_as("dataset", tmp_path, _rows("text"))
    first = data_mod.load(DataConfig(path=str(path), val_fraction=0.25), tokenizer=tok, **QUIET)
    for kind in ("data-00000-of-00002.arrow", "data-00001-of-00002.arrow", "state.json", "dataset_info.json"):
        (path / kind).unlink()
    _write_dataset(tmp_path / "ds2", _rows("text")[:6], shards=1)
    for f in (tmp_path / "ds2").iterdir():
        f.rename(path / f.name)
    second = data_mod.load(DataConfig(path=str(path), val_fraction=0.25), tokenizer=tok, **QUIET)
    assert len(second.train) + len(second.val) < len(first.train) + len(first.val)

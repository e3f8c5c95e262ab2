"""Record files: the rows of a data file as JSON-like objects, whatever holds them.

:func:`read_records` yields ``(row, object)``, the row counted from 1, from:

- ``.jsonl``: one JSON object per line (blank lines skipped; the row is the line number);
- ``.json``: a JSON array of objects (row = index + 1), or an object with exactly one list-valued
  field, whatever its name (``{"data": [...]}``, ``{"train": [...]}``, ``{"examples": [...]}``; other
  fields such as ``"version"`` are ignored), whose items are the rows; a ``.json`` file of one
  object per line is read as JSONL (as Hugging Face's ``json`` loader reads it);
- ``.parquet``: the table's rows, streamed batch by batch with ``pyarrow``
  (``pip install 'leantrain[parquet]'``);
- a Hugging Face ``datasets`` directory written by ``Dataset.save_to_disk`` (``dataset_info.json``,
  ``state.json`` and ``data-*.arrow`` shards in Arrow IPC stream format, read in the order
  ``state.json``'s ``_data_files`` lists them; no ``datasets`` dependency), or one written by
  ``DatasetDict.save_to_disk`` (``dataset_dict.json`` and a directory per split): training reads
  its ``train`` split, evaluation its ``validation`` (else ``test``) split; to read another split,
  give that split's directory (``DIR/test``) itself.

A table's row (Parquet, Arrow) lacks the fields it holds nulls in (tables give every row every
column). A row that is not an object is a ``ConfigError`` naming ``FILE:ROW``, as JSONL's ``FILE:LINE``.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator
from pathlib import Path

from leantrain.config import ConfigError

RECORD_SUFFIXES = (".jsonl", ".json", ".parquet")
TRAIN_SPLITS = ("train",)
EVAL_SPLITS = ("validation", "valid", "val", "test")
PARQUET_BATCH_ROWS = 1024
_DATASET_FILES = ("dataset_info.json", "state.json")
_DATASET_DICT_FILE = "dataset_dict.json"
_JSON_SHAPES = "a JSON array of objects, or an object with exactly one list of objects such as {\"data\": [...]}"


def is_dataset_dir(path: Path) -> bool:
    """Whether ``path`` is a directory ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` wrote."""
    return path.is_dir() and (all((path / name).is_file() for name in _DATASET_FILES)
                              or (path / _DATASET_DICT_FILE).is_file())


def is_record_file(path: Path) -> bool:
    """Whether ``path`` is read as records: a ``.jsonl``, ``.json`` or ``.parquet`` file, or a datasets directory."""
    return (path.is_file() and path.suffix.lower() in RECORD_SUFFIXES) or is_dataset_dir(path)


def dataset_split(path: Path, splits: tuple[str, ...] = TRAIN_SPLITS) -> Path:
    """The directory of the first of ``splits`` a ``DatasetDict`` directory holds; any other path as is."""
    if not (path.is_dir() and (path / _DATASET_DICT_FILE).is_file()):
        return path
    try:
        names = json.loads((path / _DATASET_DICT_FILE).read_text())["splits"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path / _DATASET_DICT_FILE} cannot be read as a DatasetDict's split list ({e})") from None
    for name in splits:
        if name in names and is_dataset_dir(path / name):
            return path / name
    raise ConfigError(f"dataset directory {path} holds the splits {', '.join(map(str, names)) or 'none'} and no "
                      f"{' / '.join(splits)} split: give the directory of the split to read (such as {path}/NAME)")


def record_files(path: Path) -> list[Path]:
    """The files a record source reads (for cache keys): the file itself, or a dataset directory's files."""
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file())
    return [path]


def read_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) of each non-blank line; ``ConfigError`` for a line that is not a JSON object."""
    with open(path, "rb") as f:
        for i, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
            except UnicodeDecodeError:
                raise ConfigError(f"{path}:{i}: not UTF-8 text; JSONL needs one UTF-8 JSON object per line") from None
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{i}: not valid JSON ({e.msg}); JSONL needs one object per line") from None
            if not isinstance(rec, dict):
                raise ConfigError(f"{path}:{i}: each JSONL line needs a JSON object, got a {type(rec).__name__}")
            yield i, rec


def read_records(path: Path) -> Iterator[tuple[int, dict]]:
    """(row number from 1, object) of each row of a record file or datasets directory (module docstring)."""
    path = Path(path)
    if path.is_dir():
        if not is_dataset_dir(path):
            raise ConfigError(f"{path} is a directory without dataset_info.json and state.json (or "
                              "dataset_dict.json): give a directory Dataset.save_to_disk wrote")
        yield from _check_rows(path, _dataset_rows(dataset_split(path)))
        return
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        yield from read_jsonl(path)
    elif suffix == ".json":
        yield from _json_rows(path)
    elif suffix == ".parquet":
        yield from _check_rows(path, _parquet_rows(path))
    else:
        raise ConfigError(f"{path} is not a record file: give a .jsonl, .json or .parquet file or a datasets "
                          "directory (Dataset.save_to_disk)")


def _check_rows(path: Path, rows) -> Iterator[tuple[int, dict]]:
    for i, rec in enumerate(rows, 1):
        if not isinstance(rec, dict):
            raise ConfigError(f"{path}:{i}: each row needs an object, got a {type(rec).__name__}")
        yield i, rec


def _json_rows(path: Path) -> Iterator[tuple[int, dict]]:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except UnicodeDecodeError:
        raise ConfigError(f"data file {path} is not UTF-8 text; a .json file holds {_JSON_SHAPES}") from None
    except json.JSONDecodeError as e:
        if e.msg == "Extra data" and e.lineno > 1:  # (one object per line: JSON Lines in a .json file)
            yield from read_jsonl(path)
            return
        raise ConfigError(f"{path}:{e.lineno}: not valid JSON ({e.msg}); a .json file holds {_JSON_SHAPES}") from None
    if isinstance(doc, dict):
        lists = [key for key, value in doc.items() if isinstance(value, list)]
        if len(lists) != 1:
            found = f"list fields {', '.join(map(repr, lists))}" if lists else "no list field"
            raise ConfigError(f"{path} is a JSON object with {found}; a .json data file holds {_JSON_SHAPES}")
        doc = doc[lists[0]]
    elif not isinstance(doc, list):
        kind = {str: "string", bool: "boolean", int: "number", float: "number"}.get(type(doc), "null")
        raise ConfigError(f"{path} is a JSON {kind}; a .json data file holds {_JSON_SHAPES}")
    yield from _check_rows(path, doc)


def _pyarrow(module: str):
    """``pyarrow.<module>``, or the sentence that says how to install it."""
    try:
        return importlib.import_module(f"pyarrow.{module}")
    except ImportError:
        raise ConfigError("reading .parquet needs pyarrow: pip install 'leantrain[parquet]'") from None


def _first_sentence(error: Exception) -> str:
    return str(error).strip().split(". ")[0].rstrip(".")


def _present(row: dict) -> dict:
    """A table row without its null fields: a column a row has no value in is a field it lacks."""
    return {key: value for key, value in row.items() if value is not None}


def _parquet_rows(path: Path) -> Iterator[dict]:
    parquet = _pyarrow("parquet")
    try:
        table = parquet.ParquetFile(path)
    except (OSError, ValueError) as e:  # (pyarrow.ArrowInvalid is a ValueError)
        raise ConfigError(f"data file {path} cannot be read as Parquet ({_first_sentence(e)})") from None
    with table:
        for batch in table.iter_batches(batch_size=PARQUET_BATCH_ROWS):
            yield from map(_present, batch.to_pylist())


def _dataset_rows(path: Path) -> Iterator[dict]:
    """The rows of a ``Dataset.save_to_disk`` directory: its Arrow stream shards in ``state.json``'s order."""
    ipc = _pyarrow("ipc")
    try:
        shards = [path / entry["filename"] for entry in json.loads((path / "state.json").read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path / 'state.json'} does not list the dataset's data files ({e})") from None
    for shard in shards:
        if not shard.is_file():
            raise ConfigError(f"dataset directory {path} lacks {shard.name}, which its state.json lists")
        try:
            with open(shard, "rb") as f, ipc.open_stream(f) as reader:
                for batch in reader:
                    yield from map(_present, batch.to_pylist())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{shard} cannot be read as an Arrow stream ({_first_sentence(e)})") from None

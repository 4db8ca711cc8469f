"""Where training records come from: JSON / JSONL files (plain, .gz or .xz), Parquet files, a
directory written by `datasets.save_to_disk`, or a hub dataset id resolved through the local
Hugging Face cache. JSON and JSONL are read with the standard library; the other sources go
through the `datasets` package (the `data` extra), imported only when one is used."""

from __future__ import annotations

import gzip
import json
import lzma
import pathlib

from .records import DataError
from .verifier import hub_snapshot, looks_like_hub_id

# what a hub dataset download fetches: the data files and the card that names the splits
_DATASET_PATTERNS = ["*.json", "*.jsonl", "*.jsonl.gz", "*.parquet", "*.arrow", "README.md", "*.yaml"]


def _open_text(path: pathlib.Path):
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    if name.endswith(".xz"):
        return lzma.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _decompress_errors():
    return (EOFError, gzip.BadGzipFile, lzma.LZMAError)


def jsonl_objects(path: pathlib.Path, not_object: str):
    """(where, record) for each non-empty line of a JSONL file (.jsonl, .jsonl.gz, .jsonl.xz).
    Every problem is a DataError naming the file (and line): invalid JSON, a line that is not an
    object (`not_object` says what was expected), non-UTF-8 text, a truncated or corrupt archive."""
    try:
        with _open_text(path) as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}: "
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{where}invalid JSON ({e.msg} at column {e.colno})") from None
                except RecursionError:
                    raise DataError(f"{where}JSON nested too deeply") from None
                except ValueError as e:  # e.g. an integer of more than 4300 digits
                    raise DataError(f"{where}unreadable JSON value ({e})") from None
                if not isinstance(rec, dict):
                    raise DataError(f"{where}{not_object}")
                yield where, rec
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason}): expected a JSONL file") from None
    except _decompress_errors() as e:
        kind = "gzip" if path.name.lower().endswith(".gz") else "xz"
        raise DataError(f"{path}: corrupt or truncated {kind} file ({e})") from None


def _json_objects(path: pathlib.Path):
    """A .json file: an array of records (or {"data": [...]}); a file of one object per line
    is read as JSONL."""
    try:
        with _open_text(path) as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason}): expected a JSON file") from None
    except _decompress_errors() as e:
        raise DataError(f"{path}: corrupt or truncated archive ({e})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        yield from jsonl_objects(path, "each record must be a JSON object")
        return
    except RecursionError:
        raise DataError(f"{path}: JSON nested too deeply") from None
    except ValueError as e:  # e.g. an integer of more than 4300 digits
        raise DataError(f"{path}: unreadable JSON value ({e})") from None
    if isinstance(obj, dict) and isinstance(obj.get("data"), list):
        obj = obj["data"]
    if not isinstance(obj, list):
        raise DataError(f"{path}: expected a JSON array of records (or JSON lines)")
    for i, rec in enumerate(obj):
        if not isinstance(rec, dict):
            raise DataError(f"{path}: record {i} must be a JSON object, got {type(rec).__name__}")
        yield f"{path}: record {i}: ", rec


def _datasets():
    try:
        import datasets
    except ImportError:
        raise DataError(
            "this --data source (Parquet, a save_to_disk directory or a hub dataset) needs the `datasets` "
            "package: pip install 'peagle_ext[data]' (JSON / JSONL files need nothing)"
        ) from None
    return datasets


def _pick_split(ds, split: str | None, where: str):
    """A datasets.Dataset from a Dataset or DatasetDict: `split`, else "train", else the only one."""
    if not hasattr(ds, "keys"):
        return ds
    names = list(ds.keys())
    want = split or ("train" if "train" in names else (names[0] if len(names) == 1 else None))
    if want not in names:
        raise DataError(f"{where}: no split {want!r} (splits: {', '.join(names)}); pass --data-split")
    return ds[want]


def _dataset_records(ds, where: str):
    for i, rec in enumerate(ds):
        yield f"{where} row {i}: ", rec


def _is_saved_dataset(path: pathlib.Path) -> bool:
    return any((path / f).is_file() for f in ("dataset_dict.json", "state.json", "dataset_info.json"))


_JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.xz")
_JSON_SUFFIXES = (".json", ".json.gz", ".json.xz")


def check_source(source: str) -> None:
    """Raise now the DataError that iter_records(source) would raise before reading a record: a
    path that does not exist (and is no hub dataset id), a file of unknown format, a directory
    that datasets' save_to_disk did not write. Cheap (no file is read), so a trainer checks its
    data this way before it creates its output directory or loads the verifier."""
    path = pathlib.Path(source).expanduser()
    if path.is_file():
        if not path.name.lower().endswith(_JSONL_SUFFIXES + _JSON_SUFFIXES + (".parquet",)):
            raise DataError(
                f"data file {source}: unknown format (expected .jsonl[.gz|.xz], .json[.gz|.xz] or .parquet)"
            )
    elif path.is_dir():
        if not _is_saved_dataset(path):
            raise DataError(
                f"data path {source} is a directory but not one written by datasets' save_to_disk "
                "(no dataset_dict.json / state.json): pass a data file, such a directory or a hub dataset id"
            )
    elif not looks_like_hub_id(source):
        raise DataError(
            f"data {source!r} not found: pass a JSON / JSONL(.gz/.xz) / Parquet file, a save_to_disk "
            "directory, a hub dataset id (org/name) or 'sharegpt'"
        )


def iter_records(source: str, *, split: str | None = None):
    """(where, record dict) of one data source, in its order (see the module docstring).
    `split` picks a split of a DatasetDict or hub dataset (default "train")."""
    check_source(source)
    path = pathlib.Path(source).expanduser()
    name = path.name.lower()
    if path.is_file():
        if name.endswith(_JSONL_SUFFIXES):
            yield from jsonl_objects(path, "each line must be a JSON object with a 'messages' list")
        elif name.endswith(_JSON_SUFFIXES):
            yield from _json_objects(path)
        else:
            ds = _datasets().load_dataset("parquet", data_files=str(path), split="train")
            yield from _dataset_records(ds, str(path))
    elif path.is_dir():
        ds = _pick_split(_datasets().load_from_disk(str(path)), split, str(path))
        yield from _dataset_records(ds, str(path))
    else:  # a hub dataset id (check_source)
        snap = hub_snapshot(source, repo_type="dataset", patterns=_DATASET_PATTERNS)
        try:
            ds = _datasets().load_dataset(str(snap))
        except DataError:
            raise
        except Exception as e:
            raise DataError(f"hub dataset {source!r} ({snap}): cannot be read: {type(e).__name__}: {e}") from None
        yield from _dataset_records(_pick_split(ds, split, f"hub dataset {source!r}"), f"hub dataset {source!r}")

"""Step 1 of `rlhf_trl.data`: read a source (files, globs, shard directories, hub datasets) in Arrow batches."""

from __future__ import annotations

import codecs
import glob
import importlib
import json
import logging
import os
from contextlib import contextmanager

from .args import DataError

LOCAL_LOADERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst", ".lz4")  # read by `datasets` (.zst needs zstandard, .lz4 needs lz4)
BATCH_ROWS = 8192  # rows converted from Arrow to Python objects at a time
_OPENERS = {"": "builtins", ".gz": "gzip", ".bz2": "bz2", ".xz": "lzma"}  # modules with `open`; .zst / .lz4: none


def source_name(dataset_name) -> str:
    """A data source's name for messages: the path / id, or the comma-joined list of them."""
    return ", ".join(map(str, dataset_name)) if isinstance(dataset_name, (list, tuple)) else str(dataset_name)


def load_rows(dataset_name, split: str = "train", config: str | None = None) -> list[dict]:
    """A source (file, glob, directory, list, hub id) as row dicts. Raises `DataError`: it cannot be read."""
    return [row for batch in _arrow_batches(dataset_name, split, config)
            for row in (batch if batch.__class__ is list else batch.to_pylist())]


def _arrow_batches(dataset_name, split: str, config: str | None, batch_rows: int | None = None,
                   encoding: str = "utf-8"):
    """A source's rows as Arrow batches of plain columns (else row-dict lists), ``batch_rows`` each."""
    batch_rows = batch_rows or BATCH_ROWS
    with _quiet_datasets():
        ds = _open_dataset(dataset_name, split, config, encoding)
    if len(ds) == 0:
        raise DataError(source_name(dataset_name), "holds no rows")
    from datasets.features.features import require_decoding

    if getattr(ds, "_indices", None) is None and not any(require_decoding(f) for f in ds.features.values()):
        yield from ds.data.table.to_batches(max_chunksize=batch_rows)  # plain Arrow columns: fastest
        return
    for batch in ds.iter(batch_size=batch_rows):
        keys = list(batch)
        yield [dict(zip(keys, values)) for values in zip(*batch.values())]


@contextmanager
def _quiet_datasets():
    """No progress bars or error logs from `datasets` while reading: a bad file gets one `DataError` line instead."""
    import datasets

    log = datasets.utils.logging
    bars, level = log.is_progress_bar_enabled(), log.get_verbosity()
    log.disable_progress_bar()
    log.set_verbosity(logging.CRITICAL)
    try:
        yield
    finally:
        log.set_verbosity(level)
        if bars:
            log.enable_progress_bar()


def _split_ext(path: str) -> tuple[str, str]:
    """``('.jsonl', '.gz')`` for ``x.jsonl.gz``, ``('.csv', '')`` for ``x.csv``."""
    base, ext = os.path.splitext(path.lower())
    return (os.path.splitext(base)[1], ext) if ext in COMPRESSIONS else (ext, "")


def _local_files(dataset_name) -> list[str] | None:
    """A local source's data files (None: a hub id). Raises `DataError`: missing, empty, unsupported or mixed files."""
    names = list(dataset_name) if isinstance(dataset_name, (list, tuple)) else [dataset_name]
    if not names:
        raise DataError("dataset_name", "an empty list of files")
    ext, compression = _split_ext(first := str(names[0]))
    if len(names) == 1 and not (os.path.exists(first) or ext in LOCAL_LOADERS or compression
                                or any(c in first for c in "*?[") or first.startswith((".", "/", "~"))):
        return None  # a hub id
    kinds, files = "/".join(LOCAL_LOADERS) + ", optionally " + "/".join(COMPRESSIONS), []
    for name in names:
        name = os.path.expanduser(str(name))
        if any(c in name for c in "*?["):
            hits = sorted(f for f in glob.glob(name, recursive=True) if os.path.isfile(f))
            if not hits:
                raise DataError(name, "no file matches this pattern")
            files += hits
        elif os.path.isdir(name):
            hits = sorted(os.path.join(root, f) for root, dirs, fs in os.walk(name) for f in fs
                          if not f.startswith(".") and _split_ext(f)[0] in LOCAL_LOADERS
                          and not any(p.startswith(".") for p in os.path.relpath(root, name).split(os.sep) if p != "."))
            if not hits:
                raise DataError(name, f"directory holds no data file ({kinds})")
            files += hits
        elif os.path.isfile(name):
            files.append(name)
        else:
            raise DataError(name, "file not found")
    for f in files:
        ext, compression = _split_ext(f)
        if ext not in LOCAL_LOADERS:
            raise DataError(f, f"unsupported file type '{ext + compression or os.path.basename(f)}'; use {kinds}")
    loaders = sorted({LOCAL_LOADERS[_split_ext(f)[0]] for f in files})
    if len(loaders) > 1:
        raise DataError(source_name(dataset_name), f"mixes file types ({', '.join(loaders)}); one source, one type")
    return files


def _open_dataset(dataset_name, split: str, config: str | None, encoding: str = "utf-8"):
    """A source's `datasets.Dataset` (local json / csv in ``encoding``; ``[prompt, answer]`` lists as rows)."""
    import datasets

    files = _local_files(dataset_name)
    if files is not None:
        loader = LOCAL_LOADERS[_split_ext(files[0])[0]]
        kind = loader if len(files) == 1 else f"{loader} ({len(files)} files)"
        text = {"encoding": encoding} if loader in ("json", "csv") else {}
        try:
            ds = datasets.load_dataset(loader, data_files=files, split="train", **text)
            if text and codecs.lookup(encoding).name == "utf-8":
                try:
                    ds.data.table.validate(full=True)
                except Exception:  # pyarrow.lib.ArrowInvalid: a string column holds invalid UTF-8
                    for f in files:
                        _check_encoding(f, encoding)
            return _pairs_of_lists(ds, files) if loader == "json" and ds.column_names == ["text"] else ds
        except DataError:
            raise
        except Exception as exc:  # datasets wraps parser errors in several exception types
            if text:
                for f in files:
                    _check_encoding(f, encoding)
            if loader == "json":
                for f in files:  # name the file and the row where Python's own parser stops
                    _check_json_file(f, kind)
            raise DataError(source_name(dataset_name), f"cannot be read as {kind}: {_root_cause(exc)}") from None
    try:
        return datasets.load_dataset(dataset_name, config, split=split)
    except Exception as exc:
        cause = _root_cause(exc)
        flag = next((v for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
                     if os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")), None)
        if flag and any(w in f"{exc} {cause}".lower() for w in ("offline", "couldn't reach", "connection")):
            raise DataError(dataset_name, f"a hub dataset, not in the local cache, and {flag}=1 forbids downloading "
                                          f"it; unset {flag} once to download it, or pass a local file") from None
        where = f"config {config!r}, split {split!r}" if config else f"split {split!r}"
        raise DataError(dataset_name, f"cannot be loaded from the hub ({where}): {cause}") from None


def _pairs_of_lists(ds, files: list[str]):
    """A JSON array of ``[prompt, answer]`` lists as rows. Raises `DataError`: lists not of two strings."""
    import datasets
    import pyarrow as pa

    column = ds.data.table.column("text")
    if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
        return ds
    rows = column.to_pylist()
    for i, row in enumerate(rows):
        if row is None or len(row) != 2 or not all(isinstance(x, str) for x in row):
            raise DataError(source_name(files), f"holds a JSON array of lists; only [prompt, answer] lists of two "
                                                f"strings are read, this one holds {row!r:.60}", i)
    return datasets.Dataset.from_dict({"instruction": [r[0] for r in rows], "output": [r[1] for r in rows]})


def _check_encoding(path: str, encoding: str) -> None:
    """Raise `DataError` at the first byte of ``path`` not valid in ``encoding``: its line, offset and the fix."""
    if (module := _OPENERS.get(_split_ext(path)[1])) is None:
        return
    decoder, line, offset = codecs.getincrementaldecoder(encoding)(), 1, 0
    with importlib.import_module(module).open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as exc:
                line += chunk.count(b"\n", 0, exc.start)
                raise DataError(path, f"line {line}, byte {offset + exc.start}: not valid {encoding} ({exc.reason}); "
                                      "set dataset_encoding to the file's encoding (gbk, gb18030, big5, ...)") from None
            line += chunk.count(b"\n")
            offset += len(chunk)


def _check_json_file(path: str, kind: str) -> None:
    """Say where a JSON / JSON Lines file breaks. Raises `DataError`: file, row and problem, or no row."""
    if (module := _OPENERS.get(_split_ext(path)[1])) is None:
        return
    try:
        with importlib.import_module(module).open(path, "rt", encoding="utf-8-sig") as f:
            head = f.read(4096).lstrip()[:1]
            f.seek(0)
            if head == "[":
                try:
                    doc = json.load(f)
                except json.JSONDecodeError as exc:
                    raise DataError(path, f"cannot be read as {kind}: not valid JSON: {exc}") from None
                if doc == []:
                    raise DataError(path, "holds no rows (an empty JSON array)")
                return
            row = 0
            for line_number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    value = json.loads(line.rstrip("\r\n"))
                except json.JSONDecodeError as exc:
                    raise DataError(path, f"cannot be read as {kind}: line {line_number} is not valid JSON "
                                          f"({exc.msg} at column {exc.colno})", row) from None
                if not isinstance(value, dict):
                    raise DataError(path, f"cannot be read as {kind}: line {line_number} is a JSON "
                                          f"{type(value).__name__}, not an object", row)
                row += 1
            if row == 0:
                raise DataError(path, "holds no rows (the file is empty)")
    except (OSError, UnicodeDecodeError, EOFError):
        return


def _root_cause(exc: BaseException) -> str:
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    return " ".join(f"{type(exc).__name__}: {exc}".split())

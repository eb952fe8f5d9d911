"""Step 1 of `rlhf_trl.data`: read the recipe's sources (`sources`: files, globs, shard directories, hub datasets)
into rows, in Arrow batches."""

from __future__ import annotations

import codecs
import dataclasses
import difflib
import glob
import hashlib
import importlib
import json
import logging
import os
from collections import Counter
from contextlib import contextmanager

from .args import DataArguments
from .report import DataError

LOCAL_LOADERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst", ".lz4")  # read by `datasets` (.zst needs zstandard, .lz4 needs lz4)
BATCH_ROWS = 8192  # rows converted from Arrow to Python objects at a time
_OPENERS = {"": "builtins", ".gz": "gzip", ".bz2": "bz2", ".xz": "lzma", ".zst": "zstandard", ".lz4": "lz4.frame"}
UTF8_CACHE = "rlhf_trl_utf8"  # folder of the datasets cache holding UTF-8 copies of files in other encodings
DIALOGUE_KEY = "_dialogue"  # a row of a JSON array of lists: the list (`dialogue_row`)
SOURCE_KEYS = ("dataset_name", "dataset_config", "dataset_split", "dataset_format", "max_samples", "question_key",
               "input_key", "answer_key", "good_key", "bad_key", "history_key", "conversations_key", "messages_key",
               "prompt_turn", "human_marker", "assistant_marker", "dataset_encoding")


def sources(args: DataArguments) -> list[DataArguments]:
    """The recipe's data sources: ``dataset_name`` (if set) then each entry of ``datasets``, which inherits the
    recipe's other fields and sets its own `SOURCE_KEYS` (unset: the defaults; ``max_samples``, ``dataset_split``:
    the recipe's). Raises `ValueError`: no source, or an entry with an unknown key or without ``dataset_name``."""
    out = [args] if args.dataset_name else []
    for j, entry in enumerate(args.datasets or []):
        if not isinstance(entry, dict) or not entry.get("dataset_name"):
            raise ValueError(f"datasets[{j}] must be a mapping with a dataset_name, got {entry!r}")
        if unknown := sorted(set(entry) - set(SOURCE_KEYS)):
            close = {k: difflib.get_close_matches(k, SOURCE_KEYS, 1) for k in unknown}
            hint = "; ".join(f"did you mean {c[0]!r} for {k!r}?" for k, c in close.items() if c)
            raise ValueError(f"datasets[{j}] ({entry['dataset_name']}): unknown key(s) {unknown}; "
                             f"{hint or f'use {SOURCE_KEYS}'}")
        defaults = {k: f.default for k, f in DataArguments.__dataclass_fields__.items()
                    if k in SOURCE_KEYS and k not in ("max_samples", "dataset_split")}
        out.append(dataclasses.replace(args, datasets=[], **{**defaults, **entry}))
    if not out:
        raise ValueError("the recipe names no data: set dataset_name (a local file or a hub dataset id) or datasets")
    return out


def describe_sources(args: DataArguments) -> str:
    """The recipe's data files / dataset ids, comma-separated (for messages)."""
    names = [source_name(args.dataset_name)] if args.dataset_name else []
    names += [source_name(e.get("dataset_name")) for e in args.datasets or [] if isinstance(e, dict)]
    return ", ".join(names) or "<no dataset>"


def source_name(dataset_name) -> str:
    """A data source's name for messages: the path / id, or the comma-joined list of them."""
    return ", ".join(map(str, dataset_name)) if isinstance(dataset_name, (list, tuple)) else str(dataset_name)


def load_rows(dataset_name, split: str = "train", config: str | None = None) -> list[dict]:
    """A source (file, glob, directory, list, hub id) as row dicts. Raises `DataError`: it cannot be read."""
    return [row for batch in arrow_batches(dataset_name, split, config)
            for row in (batch if batch.__class__ is list else batch.to_pylist())]


def arrow_batches(dataset_name, split: str, config: str | None, encoding: str = "utf-8", shapes: dict | None = None):
    """A source's rows as Arrow batches of plain columns (else row-dict lists), `BATCH_ROWS` each. A JSON array of
    dialogue lists gives row-dict lists (`dialogue_row`), and ``shapes["dialogue_lengths"]``: each row's
    items (None: not a list). Raises `DataError`: the source cannot be read, or holds no rows."""
    with _quiet_datasets():
        ds = _open_dataset(dataset_name, split, config, encoding)
    if len(ds) == 0:
        raise DataError(source_name(dataset_name), "holds no rows")
    if ds.__class__ is list:  # dialogue lists: Python rows (their items may be of any JSON type)
        if shapes is not None:
            shapes["dialogue_lengths"] = [len(d) if isinstance(d := row[DIALOGUE_KEY], list) else None for row in ds]
        for k in range(0, len(ds), BATCH_ROWS):
            yield ds[k:k + BATCH_ROWS]
        return
    from datasets.features.features import require_decoding

    if getattr(ds, "_indices", None) is None and not any(require_decoding(f) for f in ds.features.values()):
        yield from ds.data.table.to_batches(max_chunksize=BATCH_ROWS)  # plain Arrow columns: fastest
        return
    for batch in ds.iter(batch_size=BATCH_ROWS):
        yield [dict(zip(batch, values)) for values in zip(*batch.values())]


def dialogue_counts(lengths: list, kind: str) -> dict:
    """``data_report.json``'s count of a source's dialogue lists (``lengths``: items per row read, None: not a list;
    bad rows included): rows, rows by length (items) and, for prompts, the answers dropped (an even list ends with
    one), for other stages the user turns dropped after the last answer (odd lists of 3 or more items)."""
    by_length = {str(n): count for n, count in sorted(Counter(n for n in lengths if n is not None).items())}
    out = {"rows": sum(by_length.values()), "by_length": by_length}
    if kind == "prompts":
        out["answers_dropped"] = sum(n % 2 == 0 for n in lengths if n)
    else:
        out["last_user_turns_dropped"] = sum(n % 2 == 1 and n >= 3 for n in lengths if n)
    return out


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
            empty = "no file matches this pattern"
        elif os.path.isdir(name):
            hits = sorted(os.path.join(root, f) for root, dirs, fs in os.walk(name) for f in fs
                          if not f.startswith(".") and _split_ext(f)[0] in LOCAL_LOADERS
                          and not any(p.startswith(".") for p in os.path.relpath(root, name).split(os.sep) if p != "."))
            empty = f"directory holds no data file ({kinds})"
        elif os.path.isfile(name):
            hits, empty = [name], ""
        else:
            raise DataError(name, "file not found")
        if not hits:
            raise DataError(name, empty)
        files += hits
    for f in files:
        ext, compression = _split_ext(f)
        if ext not in LOCAL_LOADERS:
            raise DataError(f, f"unsupported file type '{ext + compression or os.path.basename(f)}'; use {kinds}")
    loaders = sorted({LOCAL_LOADERS[_split_ext(f)[0]] for f in files})
    if len(loaders) > 1:
        raise DataError(source_name(dataset_name), f"mixes file types ({', '.join(loaders)}); one source, one type")
    return files


def _open_dataset(dataset_name, split: str, config: str | None, encoding: str = "utf-8"):
    """A source's `datasets.Dataset`, or for JSON arrays of dialogue lists a list of rows (`_dialogue_rows`). Local
    json / jsonl / csv files not in UTF-8 are read from UTF-8 copies (`_utf8_copy`). Raises `DataError`: unreadable."""
    import datasets

    files = _local_files(dataset_name)
    if files is None:
        return _open_hub(dataset_name, split, config)
    loader = LOCAL_LOADERS[_split_ext(files[0])[0]]
    kind = loader if len(files) == 1 else f"{loader} ({len(files)} files)"
    text = {"encoding": "utf-8"} if loader in ("json", "csv") else {}
    utf8 = not text or codecs.lookup(encoding).name == "utf-8"
    paths = files if utf8 else [_utf8_copy(f, encoding) for f in files]  # UTF-8: read as it is, no copy
    if loader == "json" and (head := _head(paths[0]))[:1] == "[" and head[1:].lstrip()[:1] == "[":  # dialogue lists
        return _dialogue_rows(paths, files)
    try:
        ds = datasets.load_dataset(loader, data_files=paths, split="train", **text)
    except Exception as exc:  # datasets wraps parser errors in several exception types
        if text and utf8:
            _check_utf8(files)
        if loader == "json":
            for path, f in zip(paths, files):  # name the file and the row where Python's own parser stops
                _check_json_file(path, kind, f)
        raise DataError(source_name(dataset_name), f"cannot be read as {kind}: {_root_cause(exc)}") from None
    if text and utf8:
        try:
            ds.data.table.validate(full=True)
        except Exception:  # pyarrow.lib.ArrowInvalid: a string column holds invalid UTF-8
            _check_utf8(files)
    return ds


def _open_hub(dataset_name: str, split: str, config: str | None):
    """A hub dataset's split. Raises `DataError`: not cached while offline, or not loadable."""
    import datasets

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


def _opener(path: str, name: str | None = None):
    """The ``open`` function reading ``path`` (decompressing it), or None: its decompressor is not installed (with
    ``name``: raise `DataError` naming file ``name`` and the package to install instead)."""
    try:
        return importlib.import_module(_OPENERS[_split_ext(path)[1]]).open
    except ImportError:
        if name is None:
            return None
        raise DataError(name, f"needs the {_OPENERS[_split_ext(path)[1]].split('.')[0]} package to be decompressed "
                              "(pip install it)") from None


def _utf8_copy(path: str, encoding: str) -> str:
    """A decompressed UTF-8 copy of ``path`` (text in ``encoding``) in the datasets cache, made once per file path,
    size, modification time and codec (an unchanged file reuses its copy, and `datasets` its Arrow cache).
    Raises `DataError`: a byte not valid in ``encoding`` (line, byte offset), a decompressor not installed."""
    import datasets.config

    stat, codec = os.stat(path), codecs.lookup(encoding).name
    key = hashlib.sha256(f"{os.path.realpath(path)}\0{stat.st_size}\0{stat.st_mtime_ns}\0{codec}".encode())
    name = os.path.basename(path)[: -len("".join(_split_ext(path)))] or "data"
    out = os.path.join(str(datasets.config.HF_DATASETS_CACHE), UTF8_CACHE,
                       f"{name}-{codec}-{key.hexdigest()[:16]}{_split_ext(path)[0]}")
    if os.path.exists(out):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = f"{out}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.writelines(_decoded(path, encoding))
        os.replace(tmp, out)  # atomic: a reader (another rank) never sees half a copy
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return out


def _head(path: str) -> str:
    """The first 4096 characters of a (UTF-8, maybe compressed) text file, left-stripped; '' if it cannot be read."""
    if (opener := _opener(path)) is None:
        return ""
    try:
        with opener(path, "rt", encoding="utf-8-sig", errors="replace") as f:
            return f.read(4096).lstrip()
    except (OSError, EOFError, ValueError):
        return ""


def _dialogue_rows(paths: list[str], files: list[str]) -> list[dict]:
    """Rows of JSON arrays of dialogue lists (``paths``: UTF-8 copies of ``files``, or the files): each row
    `dialogue_row` of its list, checked row by row when normalised. Raises `DataError`: a file not valid
    UTF-8 (line, byte offset), not JSON, not an array; no row."""
    rows: list[dict] = []
    for path, name in zip(paths, files):
        try:
            with _opener(path, name)(path, "rt", encoding="utf-8-sig") as f:
                doc = json.load(f)
        except UnicodeDecodeError:
            _check_utf8([name])
            raise DataError(name, "is not valid utf-8; set dataset_encoding to the file's encoding") from None
        except json.JSONDecodeError as exc:
            raise DataError(name, f"cannot be read as json: not valid JSON: {exc}") from None
        if not isinstance(doc, list):
            raise DataError(name, f"must be a JSON array of dialogue lists, got a JSON {type(doc).__name__}")
        rows += [dialogue_row(items) for items in doc]
    if not rows:
        raise DataError(source_name(files), "holds no rows (an empty JSON array)")
    return rows


def dialogue_row(items) -> dict:
    """A row of a JSON array of dialogue lists (MOSS-RLHF's prompt files; user, assistant, user, ... strings) as an
    alpaca row: ``{DIALOGUE_KEY: items, "output": its last answer}`` (the last item of an even list, the one before
    the last of an odd one; None if none or not a string). Step 2 (`.formats`) checks and splits the list."""
    answer = items[-1 - len(items) % 2] if isinstance(items, list) and len(items) >= 2 else None
    return {DIALOGUE_KEY: items, "output": answer if isinstance(answer, str) else None}


def _check_utf8(paths: list[str]) -> None:
    """Raise `DataError` at the first byte of the files ``paths`` not valid in UTF-8: its line, offset and the fix."""
    for path in paths:
        if _opener(path) is not None:
            for _ in _decoded(path, "utf-8"):
                pass


def _decoded(path: str, encoding: str):
    """``path``'s text (decompressed) in chunks of 1 MiB of bytes. Raises `DataError`: the first byte not valid in
    ``encoding``, with its line (1-based) and byte offset (0-based, in the decompressed bytes), and the fix; its
    decompressor is not installed."""
    decoder, line, offset = codecs.getincrementaldecoder(encoding)(), 1, 0
    with _opener(path, path)(path, "rb") as f:
        while True:
            try:
                chunk = f.read(1 << 20)
            except Exception as exc:  # a damaged compressed file: one line, not a traceback
                after = f" after byte {offset}" if offset else ""
                raise DataError(path, f"cannot be decompressed{after}: {_root_cause(exc)}") from None
            if not chunk:
                break
            pending = len(decoder.getstate()[0])  # bytes of a character cut at the last chunk's end
            try:
                text = decoder.decode(chunk)
            except UnicodeDecodeError as exc:  # exc.object: the pending bytes, then this chunk
                line += exc.object[: exc.start].decode(encoding, "replace").count("\n")
                raise DataError(path, f"line {line}, byte {offset - pending + exc.start}: not valid {encoding} "
                                      f"({exc.reason}); set dataset_encoding to the file's encoding (gbk, gb18030, "
                                      "big5, ...)") from None
            line += text.count("\n")
            offset += len(chunk)
            yield text
        try:
            yield decoder.decode(b"", final=True)
        except UnicodeDecodeError as exc:
            raise DataError(path, f"line {line}, byte {offset - len(exc.object) + exc.start}: not valid {encoding} "
                                  f"({exc.reason}: the file ends inside a character)") from None


def _check_json_file(path: str, kind: str, name: str) -> None:
    """Say where a JSON / JSON Lines file (UTF-8: ``path``, a copy of file ``name`` or the file) breaks. Raises
    `DataError`: file ``name``, row and problem, or no row."""
    if (opener := _opener(path)) is None:
        return
    try:
        with opener(path, "rt", encoding="utf-8-sig") as f:
            if _head(path)[:1] == "[":
                try:
                    doc = json.load(f)
                except json.JSONDecodeError as exc:
                    raise DataError(name, f"cannot be read as {kind}: not valid JSON: {exc}") from None
                if doc == []:
                    raise DataError(name, "holds no rows (an empty JSON array)")
                return
            row = 0
            for line_number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    value = json.loads(line.rstrip("\r\n"))
                except json.JSONDecodeError as exc:
                    raise DataError(name, f"cannot be read as {kind}: line {line_number} is not valid JSON "
                                          f"({exc.msg} at column {exc.colno})", row) from None
                if not isinstance(value, dict):
                    raise DataError(name, f"cannot be read as {kind}: line {line_number} is a JSON "
                                          f"{type(value).__name__}, not an object", row)
                row += 1
            if row == 0:
                raise DataError(name, "holds no rows (the file is empty)")
    except (OSError, UnicodeDecodeError, EOFError):
        return


def _root_cause(exc: BaseException) -> str:
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    return " ".join(f"{type(exc).__name__}: {exc}".split())

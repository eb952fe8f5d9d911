"""Atomic file operations: every file and directory the project publishes is written under a temporary name, synced
and renamed into place, so a crash leaves either the old or the new one, never half of one (`publish`,
`atomic_dir`, `save_pretrained_atomic`, `write_text`); JSON is written strict (`strict_json`). Each operation of a
checkpoint save passes through `file_op` inside `checkpoint_save`, where the tests count them and inject faults
(`HOOKS`; tests/fault_hooks/faults.py); in a run they do nothing but the operation."""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from contextlib import contextmanager, nullcontext
from types import SimpleNamespace

# Test hooks (tests/fault_hooks/faults.py installs them): ``file_op(kind, path, do)`` runs one file operation of a
# save, ``checkpoint_save()`` is the context manager of one save. In a run: the operation alone, no context.
HOOKS = SimpleNamespace(file_op=lambda kind, path, do: do(), checkpoint_save=nullcontext)


def file_op(kind: str, path: str, do):
    """Run the file operation ``do`` (``kind``: write, fsync, rename, remove, rotate, on ``path``); returns its
    result. Raises what it raises (and, under a test hook, an injected `OSError`)."""
    return HOOKS.file_op(kind, path, do)


def checkpoint_save():
    """Mark one checkpoint save (its file operations are what the tests count and interrupt)."""
    return HOOKS.checkpoint_save()


def fsync_path(path: str) -> None:
    """fsync one file or directory (a counted file operation). Raises `OSError`: refused (e.g. EIO) or injected."""
    def do():
        fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if os.path.isdir(path) else 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    file_op("fsync", path, do)


def publish(staged: str, final: str, aside: str | None = None) -> None:
    """fsync ``staged``, rename it to ``final``, fsync the parent: after a crash ``final`` is absent or complete (an old
    one waits at ``aside``, default ``final.old``). Raises `OSError`: a write, fsync or rename failed."""
    for folder, _dirs, files in sorted(os.walk(staged, topdown=False)):  # every file, then each directory bottom-up
        for name in sorted(files):
            fsync_path(os.path.join(folder, name))
        fsync_path(folder)
    old = None
    if os.path.exists(final):
        old = aside or final + ".old"
        file_op("rename", old, lambda: os.rename(final, old))
    try:
        file_op("rename", final, lambda: os.rename(staged, final))
    except BaseException:
        if old is not None:
            os.rename(old, final)  # the earlier one back in place
        raise
    try:
        fsync_path(os.path.dirname(os.path.abspath(final)))
    finally:
        if old is not None:
            file_op("remove", old, lambda: shutil.rmtree(old, ignore_errors=True))


class CheckpointWriteError(OSError):
    """Writing ``checkpoint-N`` failed, nothing published; one line naming the path and the newest good checkpoint."""

    def __init__(self, name: str, root: str, cause: OSError, newest: str | None = None):
        where = cause.filename or root
        kept = f"the newest complete checkpoint is {newest}" if newest else "no checkpoint yet"
        self.message = (f"cannot write {name} in '{root}': {cause.strerror or cause} ('{where}'); nothing of it was "
                        f"published, {kept}")
        super().__init__(cause.errno, self.message, where)

    def __str__(self) -> str:
        return self.message


@contextmanager
def atomic_dir(final_path: str):
    """Write a directory under a temporary name, published as ``final_path`` on success (`publish`)."""
    parent = os.path.dirname(os.path.abspath(final_path)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(final_path)}.tmp-", dir=parent)
    os.umask(umask := os.umask(0))  # reads the umask
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private (0700); the final directory gets the usual mode
    try:
        yield tmp
        publish(tmp, final_path, aside=tmp + ".old")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_pretrained_atomic(model, tokenizer, path: str, files: dict[str, str] | None = None,
                           tensors: dict[str, dict] | None = None) -> str:
    """Save a model (safetensors), its tokenizer, ``files`` (name -> text) and ``tensors`` (name -> safetensors
    dict, e.g. a value head) to ``path`` atomically (`atomic_dir`)."""
    from safetensors.torch import save_file

    with atomic_dir(path) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for name, text in (files or {}).items():
            write_text(os.path.join(tmp, name), text)
        for name, state in (tensors or {}).items():
            save_file(state, os.path.join(tmp, name))
    return path


def write_text(path: str, text: str) -> None:
    """Write a text file atomically (``path.tmp``, then rename), creating its directory."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def strict_json(value):
    """``value`` with every non-finite float (NaN, +-inf) replaced by None, so that the JSON written is strict (no
    ``NaN`` / ``Infinity`` tokens, which strict parsers refuse): ``null`` stands for a value that was not finite."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def write_json(path: str, data: dict) -> None:
    """Write strict JSON (`strict_json`) atomically (`write_text`)."""
    write_text(path, json.dumps(strict_json(data), ensure_ascii=False, indent=2, allow_nan=False))


def write_jsonl(path: str, rows) -> None:
    """Write one strict JSON object per line (`strict_json`) atomically (`write_text`)."""
    write_text(path, "".join(json.dumps(strict_json(row), ensure_ascii=False, allow_nan=False) + "\n" for row in rows))

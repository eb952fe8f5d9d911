"""Fault injection for checkpoint saves: test code. `install` plugs it into `rlhf_trl.atomic`'s hooks (the only
place a run's file operations pass through); the tests install it in their own process (conftest.py) and, through
``sitecustomize.py`` beside this file on ``PYTHONPATH``, in every process they start.
Nothing here is active unless an environment variable asks for it (the tests set them on subprocesses):
- ``RLHF_TRL_FAULT="<save>:<op>[:<action>]"``: in this process's ``<save>``-th checkpoint save (`checkpoint_save`),
  at its ``<op>``-th file operation (both 1-based), do ``<action>``: ``kill`` (default: SIGKILL before the operation),
  ``torn`` (a write: do it, cut the file to half its bytes, then SIGKILL; else as ``kill``) or ``enospc`` / ``erofs``
  (raise that ``OSError``, naming the path). Only rank 0 acts, unless ``RLHF_TRL_FAULT_RANK`` names another.
- ``RLHF_TRL_FAULT_LOG=<file>``: every file operation of every save of every process is appended as one line
  ``<rank> <save> <op> <kind> <path>`` (kinds: ``write``, ``fsync``, ``rename``, ``remove``, ``rotate``).
Counted: ``torch.save``, safetensors' ``serialize_file``, Python ``open()`` for writing, and the operations of
`fsync_path`, `publish` and `file_op`; native writes (``tokenizer.json``) are not, but are fsynced (counted)."""

from __future__ import annotations

import builtins
import errno
import os
import signal
from contextlib import contextmanager

FAULT_ENV = "RLHF_TRL_FAULT"
FAULT_LOG_ENV = "RLHF_TRL_FAULT_LOG"
FAULT_RANK_ENV = "RLHF_TRL_FAULT_RANK"
ACTIONS = ("kill", "torn", "enospc", "erofs")

_saves = 0  # checkpoint saves started by this process
_ops = 0  # file operations of the current save
_active = False


def reset() -> None:
    """Start counting checkpoint saves from zero again (for tests that run several stages in one process)."""
    global _saves, _ops
    _saves, _ops = 0, 0


def _rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0)


def _fault() -> tuple[int, int, str] | None:
    """The parsed ``RLHF_TRL_FAULT`` for this process, or None. Raises `ValueError`: a malformed value."""
    spec = os.environ.get(FAULT_ENV)
    if not spec or _rank() != int(os.environ.get(FAULT_RANK_ENV, "0")):
        return None
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not all(p.isdigit() and int(p) > 0 for p in parts[:2]) or (
            len(parts) == 3 and parts[2] not in ACTIONS):
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected <save>:<op>[:{'|'.join(ACTIONS)}]")
    return int(parts[0]), int(parts[1]), parts[2] if len(parts) == 3 else "kill"


def file_op(kind: str, path: str, do=None):
    """Count a save's file operation; returns ``do()``. Raises `OSError`: an injected ``enospc`` / ``erofs``."""
    global _ops
    if not _active:
        return do() if do is not None else None
    _ops += 1
    if log := os.environ.get(FAULT_LOG_ENV):
        with _real_open(log, "a", encoding="utf-8") as f:
            f.write(f"{_rank()} {_saves} {_ops} {kind} {path}\n")
    fault = _fault()
    if fault is None or fault[:2] != (_saves, _ops):
        return do() if do is not None else None
    action = fault[2]
    if action in ("enospc", "erofs"):
        code = errno.ENOSPC if action == "enospc" else errno.EROFS
        raise OSError(code, os.strerror(code), path)
    if action == "torn" and kind == "write" and do is not None:
        do()
        if os.path.isfile(path):
            with _real_open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)
    os.kill(os.getpid(), signal.SIGKILL)


_real_open = builtins.open


def _counting_open(file, mode="r", *args, **kwargs):
    if _active and isinstance(file, (str, os.PathLike)) and any(c in mode for c in "wax+"):
        return file_op("write", os.fspath(file), lambda: _real_open(file, mode, *args, **kwargs))
    return _real_open(file, mode, *args, **kwargs)


def install() -> None:
    """Count and inject through `rlhf_trl.atomic.HOOKS` (inert unless the environment asks, see above)."""
    from rlhf_trl import atomic

    atomic.HOOKS.file_op, atomic.HOOKS.checkpoint_save = file_op, checkpoint_save


@contextmanager
def checkpoint_save():
    """Mark one checkpoint save: inside, file operations are counted and faults injected (if the environment asks)."""
    global _saves, _ops, _active
    if not (os.environ.get(FAULT_ENV) or os.environ.get(FAULT_LOG_ENV)) or _active:
        yield
        return
    import safetensors.torch
    import torch

    real_save, real_serialize = torch.save, safetensors.torch.serialize_file

    def counting_save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)):
            return file_op("write", os.fspath(f), lambda: real_save(obj, f, *args, **kwargs))
        return real_save(obj, f, *args, **kwargs)

    def counting_serialize(tensors, filename, *args, **kwargs):
        return file_op("write", os.fspath(filename), lambda: real_serialize(tensors, filename, *args, **kwargs))

    _saves, _ops, _active = _saves + 1, 0, True
    torch.save, safetensors.torch.serialize_file, builtins.open = counting_save, counting_serialize, _counting_open
    try:
        yield
    finally:
        torch.save, safetensors.torch.serialize_file, builtins.open = real_save, real_serialize, _real_open
        _active = False

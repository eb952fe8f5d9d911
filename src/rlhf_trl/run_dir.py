"""One run owns its ``output_dir``: an exclusive lock taken before anything else (`RunLock`), and a preflight that
proves the directory takes a checkpoint before any model loads (`preflight`). Both leave no trace of a refused run.
SIGTERM / SIGINT (what SLURM and Kubernetes send before a kill; Ctrl-C) end a run after its current step with a
checkpoint (`catch_stop_signals`, `StoppedBySignal`).

The lock is ``fcntl.flock`` on ``output_dir/.rlhf-trl.lock`` (NFSv4 and Lustre with ``-o flock`` carry it across
hosts; the kernel releases it when its process dies, however it dies). The file holds the holder (host, pid, start
time) so a refused run can name it; a lock file found with a holder but no lock held was left by a killed run and is
taken over with a warning. `filelock` is not used: it keeps the lock file in place on release, and a refused or
failed run here must leave ``output_dir`` as it found it (the file is removed on release, and the inode is checked
after locking, so a run that opened the file just before it was removed retries on the new one)."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import signal
import socket
import threading
import time

logger = logging.getLogger(__name__)

LOCK_FILE = ".rlhf-trl.lock"
PROBE_PREFIX = ".tmp-preflight-"


class OutputDirError(OSError):
    """``output_dir`` cannot take this run's files (not creatable, read-only, no room): exit 4, one line."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


class RunBusyError(RuntimeError):
    """Another live run holds ``output_dir``'s lock: exit 2, one line naming the holder."""


def _describe(holder: dict | None) -> str:
    if not holder:
        return "another run (its holder is not recorded yet)"
    return f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"


def _read_holder(fd: int) -> dict | None:
    try:
        return json.loads(os.pread(fd, 4096, 0))  # empty (not written yet): a ValueError too
    except (OSError, ValueError):
        return None


class RunLock:
    """The exclusive lock of one run on ``output_dir`` (main process only). `acquire` refuses a live holder at once;
    `release` unlocks, removes the lock file and, if this run created ``output_dir`` and left it empty, the directory.
    Raises `RunBusyError` (busy), `OutputDirError` (``output_dir`` cannot be created or written)."""

    def __init__(self, output_dir: str):
        self.output_dir = os.path.abspath(output_dir)
        self.path = os.path.join(self.output_dir, LOCK_FILE)
        self.created: list[str] = []  # directories this run created, deepest last
        self.fd: int | None = None

    def acquire(self) -> RunLock:
        import fcntl

        missing, d = [], self.output_dir
        while not os.path.isdir(d) and os.path.dirname(d) != d:
            missing.append(d)
            d = os.path.dirname(d)
        try:
            for d in reversed(missing):
                with contextlib.suppress(FileExistsError):  # another process made it meanwhile: not this run's
                    os.mkdir(d)
                    self.created.append(d)
        except OSError as exc:
            self.release()
            raise OutputDirError(exc.errno, f"cannot create output_dir '{self.output_dir}': "
                                            f"{exc.strerror} ('{d}'); choose a writable output_dir") from None
        for _ in range(10):  # the file was replaced between open and lock: retry on the new one
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                self.release()
                raise OutputDirError(exc.errno, f"cannot write in output_dir '{self.output_dir}': {exc.strerror} "
                                                f"('{self.path}'); choose a writable output_dir") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                holder = _read_holder(fd)
                os.close(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
                    raise
                raise RunBusyError(f"output_dir '{self.output_dir}' is in use by {_describe(holder)}; wait for it "
                                   "to finish, or choose another output_dir") from None
            with contextlib.suppress(FileNotFoundError):  # the file was removed meanwhile: retry
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    break
            os.close(fd)
        else:
            raise RunBusyError(f"output_dir '{self.output_dir}': the lock file keeps changing; another run is "
                               "starting there, choose another output_dir")
        self.fd = fd
        if (stale := _read_holder(fd)) is not None:
            logger.warning("taking over the lock of %s in %s: that run ended without releasing it (killed?)",
                           _describe(stale), self.output_dir)
        os.ftruncate(fd, 0)
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        os.fsync(fd)
        return self

    def release(self) -> None:
        """Unlock and remove the lock file (first, so no run can lock a file about to vanish unnoticed: the inode
        check in `acquire`), then the directories this run created if they are empty."""
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.remove(self.path)
            os.close(self.fd)  # closing the last descriptor releases the flock
            self.fd = None
        for d in reversed(self.created):
            try:
                os.rmdir(d)
            except OSError:
                break  # the run wrote something: it stays
        self.created = []


def preflight(output_dir: str) -> None:
    """Prove ``output_dir`` takes a checkpoint before any model loads: create, write, fsync, rename and remove a probe
    file. Raises `OutputDirError` (exit 4): any of these refused (read-only mount, permissions, full disk)."""
    probe = os.path.join(output_dir, f"{PROBE_PREFIX}{os.getpid()}")
    step = "create"
    try:
        with open(probe, "wb", buffering=0) as f:  # unbuffered: each step is the system call it names
            step = "write"
            f.write(b"rlhf-trl preflight\n" * 64)
            step = "sync"
            os.fsync(f.fileno())
        step = "rename"
        os.rename(probe, probe + ".renamed")
        step = "remove"
        os.remove(probe + ".renamed")
    except OSError as exc:
        for p in (probe, probe + ".renamed"):
            with contextlib.suppress(OSError):
                os.remove(p)
        raise OutputDirError(exc.errno, f"output_dir '{output_dir}' refuses a file {step} ({exc.strerror}); nothing "
                                        "was loaded or written: choose a writable output_dir with free space") from None


def checkpoint_room(output_dir: str, model_path: str | None, full_training: bool) -> None:
    """Estimate whether one checkpoint fits on ``output_dir``'s disk: the weight files of ``model_path`` (bytes),
    x3 with full training (weights and two Adam moments), x1 with LoRA (the merged copy). Raises `OutputDirError`
    when the estimate exceeds the free space; warns when within 2x of it, or when the size cannot be told."""
    if not model_path or not os.path.isdir(model_path):
        logger.debug("preflight: no local model directory to size one checkpoint from; not estimated")
        return
    weights = sum(os.path.getsize(os.path.join(model_path, n)) for n in os.listdir(model_path)
                  if n.endswith((".safetensors", ".bin")) and os.path.isfile(os.path.join(model_path, n)))
    need, free, gb = weights * (3 if full_training else 1), shutil.disk_usage(output_dir).free, 1024 ** 3
    if need > free:
        raise OutputDirError(errno.ENOSPC, f"output_dir '{output_dir}': one checkpoint needs about {need / gb:.1f} GB "
                                           f"(estimated from '{model_path}'), {free / gb:.1f} GB are free; free space "
                                           "or choose another output_dir")
    if 2 * need > free:
        logger.warning("preflight: one checkpoint needs about %.1f GB and %.1f GB are free in %s: the run may fill "
                       "the disk (save_total_limit bounds how many are kept)", need / gb, free / gb, output_dir)


# -- signals: SIGTERM / SIGINT finish the step, write a checkpoint, stop ----------------------------------------------
REPEAT_WINDOW_S = 2.0  # a signal within this of the first is the same stop (a launcher relays the job's SIGTERM)
_stop: dict = {"signal": None, "at": 0.0, "training": False, "previous": {}}


class StoppedBySignal(Exception):
    """A run stopped by SIGTERM / SIGINT: at ``step`` with ``checkpoint`` written, or before training began (both
    None). Exit status ``128 + signal`` (143 / 130, as shells report a process killed by them)."""

    def __init__(self, signum: int, step: int | None = None, checkpoint: str | None = None, unit: str = "step"):
        self.signum, self.step, self.checkpoint, self.unit = signum, step, checkpoint, unit
        self.exit_code = 128 + signum
        where = (f"at {unit} {step}: {os.path.basename(checkpoint)} written" if checkpoint else
                 "before training began: nothing of this run was kept")
        super().__init__(f"stopped by {signal.Signals(signum).name} {where}")


def _on_signal(signum, frame) -> None:
    now = time.monotonic()
    if _stop["signal"] is not None:
        if now - _stop["at"] < REPEAT_WINDOW_S:
            return
        logger.warning("second %s: stopping at once (the last complete checkpoint stays)", signal.Signals(signum).name)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _stop.update(signal=signum, at=now)
    if not _stop["training"]:
        raise StoppedBySignal(signum)
    logger.warning("%s: finishing the current step, then writing a checkpoint and stopping (send it again to stop at "
                   "once)", signal.Signals(signum).name)


def catch_stop_signals() -> None:
    """Install the SIGTERM / SIGINT handlers of a run (main thread only; `release_stop_signals` puts back the earlier
    ones). Until training begins a signal raises `StoppedBySignal` at once (nothing is written yet); during training
    it asks the trainer (`StopOnSignal`) to stop after the current step with a checkpoint; a second one, more than
    `REPEAT_WINDOW_S` later, kills the process with that signal."""
    if threading.current_thread() is not threading.main_thread():
        return
    _stop.update(signal=None, at=0.0, training=False)
    for signum in (signal.SIGTERM, signal.SIGINT):
        _stop["previous"][signum] = signal.signal(signum, _on_signal)


def release_stop_signals() -> None:
    """Put back the handlers `catch_stop_signals` replaced (a later run in this process starts clean)."""
    for signum, handler in _stop["previous"].items():
        signal.signal(signum, handler)
    _stop.update(signal=None, training=False, previous={})


class StopOnSignal:
    """Trainer callback: after a step during which a stop signal came, save a checkpoint, then stop training.
    ``signum``: the signal that asked this run to stop, agreed by every process at each step's end (with several
    processes, the largest over all of them: one all-reduce of a scalar, so every process stops after the same step),
    or None."""

    signum: int | None = None

    def __getattr__(self, name):  # every other `transformers.TrainerCallback` event: nothing to do
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)

    def on_train_begin(self, args, state, control, **kwargs):
        _stop["training"] = True  # from now on a signal stops after the current step with a checkpoint

    def on_step_end(self, args, state, control, **kwargs):
        import torch
        from accelerate import PartialState

        signum, dist = _stop["signal"] or 0, torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([signum], device=PartialState().device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            signum = int(flag.item())
        self.signum = signum or None
        if self.signum is not None:
            control.should_save = True

    def on_save(self, args, state, control, **kwargs):  # after the save: the checkpoint holds the TrainerControl
        if self.signum is not None:  # state of an uninterrupted run, so its resume trains on
            control.should_training_stop = True

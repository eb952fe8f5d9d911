"""One run owns its ``output_dir`` (`rlhf_trl.run_dir`, taken by `checkpoints.start_run` before anything else): a
second run on a busy directory is refused at once in one line naming the holder (host, pid, start time), with
nothing of either run touched; a lock left by a killed run is taken over with a warning; an unwritable
``output_dir`` (a read-only bind mount where the tests run as root, else a path that cannot be created) stops with
exit 4 and one line before any model loads; a released lock and a refused run leave no trace."""

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import RECIPES, tree_hashes

from rlhf_trl.cli import main as cli_main
from rlhf_trl.run_dir import LOCK_FILE, OutputDirError, RunBusyError, RunLock, checkpoint_room, preflight

HOLD = textwrap.dedent("""
    import sys, time
    from rlhf_trl.run_dir import RunLock
    RunLock(sys.argv[1]).acquire()
    print("locked", flush=True)
    time.sleep(120)
""")


def hold_lock(path) -> subprocess.Popen:
    """Another process that takes ``path``'s run lock and keeps it (until killed)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def sft_argv(assets, out):
    return ["sft", "--config", f"{RECIPES}/sft.yaml", "--dataset_name", assets["sft"], "--model_name_or_path",
            assets["base_model"], "--output_dir", str(out), "--max_steps", "1", "--report_to", "none"]


def test_a_second_run_on_a_busy_output_dir_is_refused_at_once_naming_the_holder(assets, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoint-2").mkdir()
    (out / "checkpoint-2" / "model.safetensors").write_bytes(b"first run's")
    holder = hold_lock(out)
    try:
        before = tree_hashes(out)
        started = time.monotonic()
        with pytest.raises(SystemExit) as info:
            cli_main(sft_argv(assets, out))
        assert time.monotonic() - started < 30
        assert info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith(f"rlhf-trl sft: error: output_dir '{out}' is in use by pid {holder.pid} on "), err
        assert "started 20" in err and err.endswith("wait for it to finish, or choose another output_dir")
        assert tree_hashes(out) == before  # the first run's files and its lock untouched
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_left_by_a_killed_run_is_taken_over_with_a_warning(tmp_path, caplog):
    holder = hold_lock(tmp_path)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert (tmp_path / LOCK_FILE).exists()  # the killed run could not remove it
    with caplog.at_level(logging.WARNING, logger="rlhf_trl.run_dir"):
        lock = RunLock(str(tmp_path)).acquire()
    assert f"taking over the lock of pid {holder.pid} on " in caplog.text
    with pytest.raises(RunBusyError, match=f"in use by pid {os.getpid()} on "):
        RunLock(str(tmp_path)).acquire()  # a second lock in this very process is refused too (flock per open)
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_released_lock_leaves_no_trace_of_the_directories_it_made(tmp_path):
    lock = RunLock(str(tmp_path / "a" / "b")).acquire()
    assert (tmp_path / "a" / "b" / LOCK_FILE).exists()
    preflight(str(tmp_path / "a" / "b"))
    lock.release()
    assert os.listdir(tmp_path) == []
    RunLock(str(tmp_path / "c")).acquire().release()  # free again after release
    assert os.listdir(tmp_path) == []


@pytest.fixture
def unwritable(tmp_path):
    """A read-only bind mount of an empty directory (root only), else a path under a file (cannot be created)."""
    src, ro = tmp_path / "src", tmp_path / "ro"
    src.mkdir()
    ro.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(
        f"mount --bind {src} {ro} && mount -o remount,ro,bind {ro}", shell=True, capture_output=True).returncode == 0
    if mounted:
        yield ro / "out", "read-only"
        subprocess.run(["umount", str(ro)], check=False)
    else:
        (tmp_path / "file").write_text("x")
        yield tmp_path / "file" / "out", "cannot create"


def test_an_unwritable_output_dir_exits_4_in_one_line_before_any_model_loads(assets, unwritable, capsys,
                                                                           monkeypatch):
    out, kind = unwritable
    import rlhf_trl.models as models

    def no_loading(*a, **k):
        raise AssertionError("a model was loaded before the output_dir was proven writable")

    monkeypatch.setattr(models, "_load_model", no_loading)
    with pytest.raises(SystemExit) as info:
        cli_main(sft_argv(assets, out))
    assert info.value.code == 4
    err = capsys.readouterr().err.strip().splitlines()
    assert len([line for line in err if "error" in line]) == 1
    assert err[-1].startswith(f"rlhf-trl sft: error: cannot create output_dir '{out}'"), err[-1]
    assert "choose a writable output_dir" in err[-1]


def test_preflight_names_the_refused_step(tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(os, "rename", refuse)
    with pytest.raises(OutputDirError, match=r"refuses a file rename \(Read-only file system\)"):
        preflight(str(tmp_path))
    assert os.listdir(tmp_path) == []  # the probe is gone


def test_a_checkpoint_that_cannot_fit_is_refused_and_a_tight_one_warned(tmp_path, monkeypatch, caplog):
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"\0" * 1000)
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 ** 6, 0, 1500))
    with pytest.raises(OutputDirError, match="one checkpoint needs about"):
        checkpoint_room(str(tmp_path), str(model), full_training=True)  # 3 x 1000 bytes > 1500 free
    with caplog.at_level(logging.WARNING, logger="rlhf_trl.run_dir"):
        checkpoint_room(str(tmp_path), str(model), full_training=False)  # 1000 fits, but not twice over
    assert "the run may fill the disk" in caplog.text


def test_a_signal_before_training_stops_at_once_leaving_nothing(assets, tmp_path, capsys, monkeypatch):
    import rlhf_trl.models as models

    real = models._load_model

    def load_then_term(*a, **k):  # SIGTERM while the model loads: before any step
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)

    monkeypatch.setattr(models, "_load_model", load_then_term)
    before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as info:
        cli_main(sft_argv(assets, out))
    assert info.value.code == 143
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "rlhf-trl sft: stopped by SIGTERM before training began: nothing of this run was kept")
    assert not out.exists()  # its lock and the directory it made are gone
    assert signal.getsignal(signal.SIGTERM) == before  # the run's handlers are put back

"""A full disk or a read-only output_dir during a checkpoint save: the run stops with one line
naming the path (exit status 4), no half-written checkpoint-N is visible, no staging directory is left, the previous
checkpoint is byte-identical, and resuming from it finishes the run.

The failure is injected by `faults` (tests/fault_hooks) (``RLHF_TRL_FAULT=<save>:<op>:enospc|erofs``) at the first write, an
fsync of a file, the fsync of the checkpoint directory and the rename that publishes it: as root, a chmod'ed directory
would still be writable, and no test may fill the disk.
"""

import hashlib
import os
import re
import subprocess
import sys

import pytest
from conftest import RECIPES

import faults

from rlhf_trl import sft
from rlhf_trl.checkpoints import CheckpointWriteError, checkpoint_problem


def tree(root):
    out = {}
    for folder, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def sft_argv(assets, out, steps=3):
    return ["--config", f"{RECIPES}/sft.yaml", "--dataset_name", assets["sft"], "--model_name_or_path",
            assets["base_model"], "--output_dir", str(out), "--max_steps", str(steps), "--save_strategy", "steps",
            "--save_steps", "1", "--logging_steps", "1", "--per_device_train_batch_size", "8"]


@pytest.fixture(scope="module")
def save_ops(assets, tmp_path_factory):
    """The file operations of SFT's 2nd checkpoint save, from an uninterrupted run with RLHF_TRL_FAULT_LOG."""
    out = tmp_path_factory.mktemp("oplog")
    log = out / "ops.log"
    env = {**os.environ, faults.FAULT_LOG_ENV: str(log), "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "-m", "rlhf_trl", "sft", *sft_argv(assets, out / "run")], env=env,
                   check=True, capture_output=True)
    ops = [line.split(" ", 4) for line in log.read_text().splitlines()]
    return {"ops": [(int(op), kind, path) for _rank, save, op, kind, path in ops if save == "2"],
            "checkpoint-1": tree(out / "run" / "checkpoint-1")}


def pick(ops, kind, suffix=""):
    return next(op for op, k, path in ops if k == kind and path.rstrip("/").endswith(suffix))


@pytest.mark.slow  # an SFT run that records every file operation (~15 s)
def test_every_save_step_is_counted_and_fsynced_before_the_rename(save_ops):
    save_ops = save_ops["ops"]
    kinds = [k for _, k, _ in save_ops]
    rename = kinds.index("rename")
    published = save_ops[rename][2]  # the rename's target: .../checkpoint-2
    # writes into the checkpoint (the trainer also writes a model card next to it in the staging directory)
    written = {p for _, k, p in save_ops[:rename] if k == "write" and "/checkpoint-2/" in p}
    synced = {p for _, k, p in save_ops[:rename] if k == "fsync"}
    assert written and written <= synced  # every counted write is fsynced before the rename that publishes it
    assert published.endswith("/checkpoint-2") and len(written) >= 5
    assert kinds[rename + 1] == "fsync" and not save_ops[rename + 1][2].endswith("checkpoint-2")  # the parent dir
    assert kinds[-2:] == ["remove", "rotate"]


@pytest.mark.slow  # 8 SFT runs (~40 s); the quick subset keeps the test through main below
@pytest.mark.parametrize("action", ["enospc", "erofs"])
@pytest.mark.parametrize("where", ["first write", "fsync optimizer", "fsync dir", "rename"])
def test_write_failure_during_a_save_loses_nothing(assets, tmp_path, capsys, save_ops, monkeypatch, where, action):
    ops = save_ops["ops"]
    op = {"first write": ops[0][0], "fsync optimizer": pick(ops, "fsync", "optimizer.pt"),
          "fsync dir": pick(ops, "fsync", "checkpoint-2"), "rename": pick(ops, "rename")}[where]
    out = tmp_path / "run"
    monkeypatch.setenv(faults.FAULT_ENV, f"2:{op}:{action}")
    faults.reset()
    from rlhf_trl.cli_launch import run_stage

    with pytest.raises(SystemExit) as exit_info:
        run_stage("sft", sft_argv(assets, out))
    assert exit_info.value.code == 4
    stderr = capsys.readouterr().err
    err = re.findall(r"rlhf-trl sft: error: .*", stderr)  # one line (after the progress bars' last one)
    assert len(err) == 1 and "Traceback" not in stderr, stderr[-2000:]
    reason = "No space left on device" if action == "enospc" else "Read-only file system"
    assert err[0].startswith(f"rlhf-trl sft: error: cannot write checkpoint-2 in '{out}': {reason} ('")
    assert err[0].endswith("nothing of it was published, the newest complete checkpoint is checkpoint-1")
    assert sorted(os.listdir(out)) == ["checkpoint-1", "runs"]  # no checkpoint-2, no .tmp-checkpoint-2
    kept, clean = tree(out / "checkpoint-1"), dict(save_ops["checkpoint-1"])
    for run in (kept, clean):
        run.pop("training_args.bin")  # holds the output_dir
        run.pop("manifest.json")  # lists training_args.bin's size
    assert kept == clean  # the previous checkpoint is byte-identical to an undisturbed run's
    assert checkpoint_problem(str(out / "checkpoint-1")) is None  # and intact by its manifest

    monkeypatch.delenv(faults.FAULT_ENV)
    faults.reset()
    result = sft.main(sft_argv(assets, out) + ["--resume_from_checkpoint", "true"])
    assert result["metrics"]["global_step"] == 3


def test_the_error_is_a_checkpoint_write_error_through_main(assets, tmp_path, monkeypatch):
    monkeypatch.setenv(faults.FAULT_ENV, "1:1:enospc")
    faults.reset()
    with pytest.raises(CheckpointWriteError, match=r"^cannot write checkpoint-1 in .*nothing of it was published, "
                                                   r"no checkpoint yet$"):
        sft.main(sft_argv(assets, tmp_path / "run"))
    assert not [n for n in os.listdir(tmp_path / "run") if "checkpoint" in n]

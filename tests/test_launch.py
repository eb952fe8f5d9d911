"""``make <stage> ACCEL=... NPROC=...`` (`rlhf_trl.launch`): the recipe and the launch config are checked once,
before any worker starts, and a worker's error reaches the user once, as its one line, with its exit status and
without accelerate's ``ChildFailedError`` traceback: a misspelled key, ``ACCEL=fsdp`` on a machine without GPUs
and a missing data file under 2 processes each end in exactly one line on stderr."""

import os
import subprocess
import sys
import time

import pytest
from conftest import RECIPES, REPO

pytestmark = pytest.mark.slow

CONFIGS = REPO / "recipes" / "accelerate_configs"


def launch(accel: str, *argv: str) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("RLHF_TRL_DEBUG", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    started = time.monotonic()
    proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "rlhf-trl"), "launch", "--config_file",
                           str(CONFIGS / f"{accel}.yaml"), "--num_processes", "2", *argv], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=600)
    return proc, time.monotonic() - started


def error_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.strip()]


def test_a_misspelled_key_is_refused_before_any_worker_starts(tmp_path):
    recipe = tmp_path / "sft.yaml"
    recipe.write_text((REPO / "recipes/demo/sft.yaml").read_text() + "learnin_rate: 0.1\n")
    proc, _ = launch("multi_cpu", "sft", "--config", str(recipe), "--output_dir", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert error_lines(proc) == [f"rlhf-trl sft: error: {recipe}: unknown key(s) ['learnin_rate']; did you mean "
                                 "'learning_rate'?"], proc.stderr
    assert not (tmp_path / "out").exists()


def test_fsdp_without_gpus_is_refused_once_before_any_worker_starts(tmp_path):
    proc, _ = launch("fsdp", "sft", "--config", f"{RECIPES}/sft.yaml", "--output_dir", str(tmp_path / "out"))
    assert proc.returncode == 2
    lines = error_lines(proc)
    assert len(lines) == 1 and lines[0].startswith("rlhf-trl sft: error: ACCEL=fsdp: accelerate runs FSDP only on "
                                                   "GPUs"), proc.stderr
    assert "torch.distributed" not in proc.stderr


def test_an_error_inside_the_workers_reaches_the_user_once_with_its_exit_status(tmp_path, assets):
    proc, _ = launch("multi_cpu", "sft", "--config", f"{RECIPES}/sft.yaml", "--model_name_or_path",
                     assets["base_model"], "--dataset_name", str(tmp_path / "missing.jsonl"), "--output_dir",
                     str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in error_lines(proc) if " INFO " not in line]
    assert lines == [f"rlhf-trl sft: error: {tmp_path / 'missing.jsonl'}: file not found"], proc.stderr
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr

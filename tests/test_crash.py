"""kill -9 at a random step after the first checkpoint, then resume: the run completes with the right step count,
and no checkpoint-N directory is ever half-written (checkpoints are written under .tmp-* and renamed)."""

import os
import random
import signal
import subprocess
import sys
import time

import pytest
from conftest import RECIPES, import_ppo

from rlhf_trl import rm, sft

pytestmark = pytest.mark.slow  # real processes killed and resumed (minutes on 2 cores)

REQUIRED = {
    "sft": ["trainer_state.json", "model.safetensors", "optimizer.pt", "scheduler.pt"],
    "rm": ["trainer_state.json", "adapter_model.safetensors", "optimizer.pt", "scheduler.pt"],
    "ppo": ["trainer_state.json", "adapter_model.safetensors", "optimizer.pt", "data_state.pt",
            "value_model/model.safetensors", "merged/model.safetensors"],
}


def complete(stage, out):
    """Every visible checkpoint-N holds all its files."""
    ckpts = [d for d in os.listdir(out) if d.startswith("checkpoint-")]
    for d in ckpts:
        for f in REQUIRED[stage]:
            assert os.path.exists(os.path.join(out, d, f)), f"{d} lacks {f}"
    return ckpts


def kill_after_first_checkpoint(stage, argv, out, first, seed):
    proc = subprocess.Popen([sys.executable, "-m", "rlhf_trl", stage, *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.time() + 600
    while not os.path.isdir(os.path.join(out, f"checkpoint-{first}")):
        assert proc.poll() is None, f"{stage} ended (status {proc.returncode}) before its first checkpoint"
        assert time.time() < deadline
        if os.path.isdir(out):
            complete(stage, out)
        time.sleep(0.02)
    time.sleep(random.Random(seed).uniform(0.0, 1.5))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    return complete(stage, out)


@pytest.mark.parametrize("seed", [0])
def test_sft_survives_kill_9(assets, tmp_path, seed):
    out = str(tmp_path / "sft")
    argv = ["--config", f"{RECIPES}/sft.yaml", "--dataset_name", assets["sft"], "--model_name_or_path",
            assets["base_model"], "--output_dir", out, "--max_steps", "240", "--save_strategy", "steps",
            "--save_steps", "20", "--per_device_train_batch_size", "64", "--logging_steps", "20"]
    kill_after_first_checkpoint("sft", argv, out, 20, seed)
    result = sft.main(argv + ["--resume_from_checkpoint", "true"])
    assert result["metrics"]["global_step"] == 240
    assert not [d for d in os.listdir(out) if d.startswith(".tmp-")]


def test_rm_survives_kill_9(assets, sft_run, tmp_path):
    out = str(tmp_path / "rm")
    argv = ["--config", f"{RECIPES}/rm.yaml", "--dataset_name", assets["rm"], "--model_name_or_path",
            sft_run["merged"], "--output_dir", out, "--max_steps", "160", "--save_strategy", "steps",
            "--save_steps", "20", "--per_device_train_batch_size", "32", "--logging_steps", "20"]
    kill_after_first_checkpoint("rm", argv, out, 20, 1)
    result = rm.main(argv + ["--resume_from_checkpoint", "true"])
    assert result["metrics"]["global_step"] == 160


def test_ppo_survives_kill_9(assets, sft_run, rm_run, tmp_path):
    ppo = import_ppo()
    out = str(tmp_path / "ppo")
    argv = ["--config", f"{RECIPES}/ppo.yaml", "--dataset_name", assets["prompts"], "--sft_model_path",
            sft_run["merged"], "--reward_model_path", rm_run["merged"], "--output_dir", out,
            "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1", "--total_episodes", "96",
            "--save_steps", "1", "--log_samples_every", "0", "--logging_steps", "1"]
    ckpts = kill_after_first_checkpoint("ppo", argv, out, 2, 2)
    last = max(int(d.split("-")[1]) for d in ckpts)
    result = ppo.main(argv + ["--resume_from_checkpoint", "true"])
    assert result["metrics"]["global_step"] == 12 and result["metrics"]["episode"] == 96
    steps = [h["step"] for h in result["trainer"].state.log_history if "objective/kl" in h]
    assert steps[-(12 - last):] == list(range(last + 1, 13))

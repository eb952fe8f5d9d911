"""Damaged checkpoints through the stages: a truncated safetensors file, a missing optimizer file or an unreadable
state file in the newest ``checkpoint-N`` -> ``resume_from_checkpoint=true`` resumes from the newest intact one and
says so (one WARNING naming the damaged one and why), or, with every checkpoint damaged, fails with one line and
changes nothing on disk. It never starts over silently.

The stage tests train a tiny run with checkpoints 2 and 4 once per stage, then damage copies of it. The unit tests of
`checkpoint_problem`, `resolve_resume` and `set_aside_damaged` on hand-made checkpoints are in test_checkpoints.py."""

import json
import logging
import os
import shutil

import pytest
from conftest import RECIPES, import_ppo, make_checkpoint, reward_stand_in, tree_hashes, truncate
from test_errors import run_cli
from transformers import TrainerCallback

from rlhf_trl import rm, sft
from rlhf_trl.checkpoints import MANIFEST, checkpoint_problem


# ----------------------------------------------------------------------------------------------------------------
# the stages: train checkpoints 2 and 4, damage checkpoint-4, resume
# ----------------------------------------------------------------------------------------------------------------
class StepRecorder(TrainerCallback):
    """The global step after each optimizer step / PPO update this run made."""

    def __init__(self):
        self.steps = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


def stage_argv(stage, assets, out):
    """4 steps / updates, checkpoints 2 and 4; the base model stands in for the SFT model (`reward_stand_in`: its
    sequence-classifier copy for the reward model)."""
    common = ["--output_dir", str(out), "--report_to", "none", "--save_strategy", "steps", "--save_steps", "2",
              "--logging_steps", "1"]
    if stage == "sft":
        return ["--config", f"{RECIPES}/sft.yaml", "--dataset_name", assets["sft"], "--model_name_or_path",
                assets["base_model"], "--max_samples", "40", "--eval_split_size", "4", "--max_steps", "4",
                "--per_device_train_batch_size", "4", *common]
    if stage == "rm":
        return ["--config", f"{RECIPES}/rm.yaml", "--dataset_name", assets["rm"], "--model_name_or_path",
                assets["base_model"], "--max_samples", "20", "--eval_split_size", "4", "--max_steps", "4",
                "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4", *common]
    return ["--config", f"{RECIPES}/ppo.yaml", "--dataset_name", assets["prompts"], "--sft_model_path",
            assets["base_model"], "--reward_model_path", reward_stand_in(assets), "--max_samples", "48",
            "--eval_split_size", "8", "--per_device_eval_batch_size", "8", "--per_device_train_batch_size", "4",
            "--gradient_accumulation_steps", "1", "--total_episodes", "16", "--num_ppo_epochs", "1",
            "--response_length", "8", "--local_rollout_forward_batch_size", "4", "--log_samples_every", "0",
            *common]


def stage_main(stage):
    return (import_ppo() if stage == "ppo" else {"sft": sft, "rm": rm}[stage]).main


@pytest.fixture(scope="module")
def trained(assets, tmp_path_factory):
    """One finished 4-step run per stage (checkpoints 2 and 4), trained on first use."""
    runs = {}

    def get(stage):
        if stage not in runs:
            out = tmp_path_factory.mktemp(f"{stage}_damaged")
            result = stage_main(stage)(stage_argv(stage, assets, out))
            assert result["metrics"]["global_step"] == 4
            assert sorted(d for d in os.listdir(out) if d.startswith("checkpoint-")) == ["checkpoint-2", "checkpoint-4"]
            for step in (2, 4):
                assert os.path.isfile(os.path.join(out, f"checkpoint-{step}", MANIFEST))
                assert checkpoint_problem(os.path.join(out, f"checkpoint-{step}")) is None
            runs[stage] = str(out)
        return runs[stage]

    return get


def copy_run(trained, stage, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(trained(stage), out)
    return out


def remove(path):
    os.remove(path)


def garble(path):
    with open(path, "w") as f:
        f.write("{ this is not json")


# (stage, file in the newest checkpoint, damage, the reason's start); PPO's are marked slow: its 4-update run plus the
# first resume take ~20 s on 1 CPU thread, ~6 s per resume after that (SFT and RM: 1-6 s each)
DAMAGES = [
    ("sft", "model.safetensors", truncate, "model.safetensors is truncated ("),
    ("sft", "optimizer.pt", remove, "optimizer.pt is missing"),
    ("sft", "trainer_state.json", garble, "trainer_state.json cannot be read: "),
    ("rm", "adapter_model.safetensors", truncate, "adapter_model.safetensors is truncated ("),
    ("rm", "optimizer.pt", remove, "optimizer.pt is missing"),
    ("rm", "trainer_state.json", garble, "trainer_state.json cannot be read: "),
    ("ppo", "adapter_model.safetensors", truncate, "adapter_model.safetensors is truncated ("),
    ("ppo", "value_model/model.safetensors", truncate, "value_model/model.safetensors is truncated ("),
    ("ppo", "data_state.pt", remove, "data_state.pt is missing"),
    ("ppo", "optimizer.pt", remove, "optimizer.pt is missing"),
    ("ppo", "trainer_state.json", garble, "trainer_state.json cannot be read: "),
]


@pytest.mark.parametrize("stage, name, damage, reason", [
    pytest.param(*d, id=f"{d[0]}-{d[2].__name__}-{d[1].replace('/', '-')}",
                 marks=[pytest.mark.slow] if d[0] == "ppo" else []) for d in DAMAGES])
def test_resume_skips_a_damaged_newest_checkpoint(trained, assets, tmp_path, caplog, stage, name, damage, reason):
    out = copy_run(trained, stage, tmp_path)
    damage(str(out / "checkpoint-4" / name))
    steps = StepRecorder()
    with caplog.at_level(logging.WARNING, logger="rlhf_trl"):
        result = stage_main(stage)(stage_argv(stage, assets, out) + ["--resume_from_checkpoint", "true"],
                                   callbacks=[steps])
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("checkpoint-4 is damaged")]
    assert len(said) == 1 and said[0].startswith(f"checkpoint-4 is damaged ({reason}"), said
    assert said[0].endswith("; resuming from checkpoint-2")
    assert steps.steps == [3, 4]  # resumed after step 2: not started over
    assert result["metrics"]["global_step"] == 4
    assert json.load(open(out / "checkpoint-4" / "trainer_state.json"))["global_step"] == 4
    assert checkpoint_problem(str(out / "checkpoint-4")) is None  # written again, whole
    assert (out / "damaged-checkpoint-4").is_dir()  # the damaged one set aside, not deleted


def damage_every_checkpoint(out):
    truncate(str(out / "checkpoint-2" / "optimizer.pt"))
    os.remove(out / "checkpoint-4" / "optimizer.pt")


@pytest.mark.parametrize("stage", ["sft", "rm", pytest.param("ppo", marks=pytest.mark.slow)])
def test_every_checkpoint_damaged_fails_in_one_line_and_changes_nothing(trained, assets, tmp_path, capsys, stage):
    out = copy_run(trained, stage, tmp_path)
    damage_every_checkpoint(out)
    before = tree_hashes(out)
    argv = stage_argv(stage, assets, out)
    code, err = run_cli(stage, argv + ["--resume_from_checkpoint", "true"], capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0] == (f"rlhf-trl {stage}: error: resume_from_checkpoint=true: no intact checkpoint in '{out}' (newest "
                      "checkpoint-4: optimizer.pt is missing); start over with `overwrite_output_dir: true` and no "
                      "resume_from_checkpoint")
    assert tree_hashes(out) == before
    code, err = run_cli(stage, argv + ["--resume_from_checkpoint", str(out / "checkpoint-2")], capsys)
    assert code == 2 and len(err) == 1 and "checkpoint-2' is damaged (optimizer.pt is truncated (" in err[0], err
    assert tree_hashes(out) == before


def test_damaged_checkpoints_still_refuse_a_fresh_start(assets, tmp_path, capsys):
    """No resume, no overwrite_output_dir: damaged checkpoints of an unfinished run are in the way, as whole ones."""
    out = tmp_path / "out"
    make_checkpoint(out / "checkpoint-2")
    make_checkpoint(out / "checkpoint-4")
    damage_every_checkpoint(out)
    before = tree_hashes(out)
    argv = stage_argv("sft", assets, out) + ["--overwrite_output_dir", "false"]
    code, err = run_cli("sft", argv, capsys)
    assert code == 2 and len(err) == 1 and "checkpoints of an earlier, unfinished run (checkpoint-4)" in err[0], err
    assert tree_hashes(out) == before


def test_eval_reads_the_logs_of_the_newest_intact_checkpoint(tmp_path, caplog):
    from rlhf_trl.evaluate import read_stage_logs

    make_checkpoint(tmp_path / "checkpoint-2")
    newest = make_checkpoint(tmp_path / "checkpoint-4")
    with open(os.path.join(newest, "trainer_state.json"), "r+b") as f:
        f.write(b"{garbage")  # same size, no longer JSON
    with caplog.at_level(logging.WARNING):
        history, source = read_stage_logs(str(tmp_path))
    assert source == str(tmp_path / "checkpoint-2" / "trainer_state.json")
    assert history == [{"step": 1, "loss": 1.0}]
    assert "checkpoint-4 is damaged (trainer_state.json cannot be read" in caplog.text

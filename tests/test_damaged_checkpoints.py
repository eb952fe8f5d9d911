"""Damaged checkpoints (issue 15, item 3): a truncated safetensors file, a missing optimizer file or an unreadable
state file in the newest ``checkpoint-N`` -> ``resume_from_checkpoint=true`` resumes from the newest intact one and
says so (one WARNING naming the damaged one and why), or, with every checkpoint damaged, fails with one line and
changes nothing on disk. It never starts over silently.

Unit tests of `checkpoint_problem` run on hand-made files; the stage tests train a tiny run with checkpoints 2 and 4
once per stage, then damage copies of it."""

import json
import logging
import os
import shutil

import pytest
import torch
from conftest import RECIPES, import_ppo, reward_stand_in
from safetensors.torch import save_file
from test_errors import run_cli
from test_safe_overwrite import tree_hashes
from transformers import TrainerCallback

from rlhf_trl import rm, sft
from rlhf_trl.checkpoints import MANIFEST, checkpoint_problem, set_aside_damaged, write_manifest
from rlhf_trl.checkpoints import resolve_resume
from rlhf_trl.models import StageInputError


# ----------------------------------------------------------------------------------------------------------------
# checkpoint_problem on hand-made checkpoints
# ----------------------------------------------------------------------------------------------------------------
def make_checkpoint(path, manifest=True, value_model=False):
    """A small Trainer-like checkpoint: state, optimizer, scheduler, RNG, weights (and PPO's value_model/)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "trainer_state.json"), "w") as f:
        json.dump({"global_step": 2, "log_history": [{"step": 1, "loss": 1.0}]}, f)
    torch.save({"state": {0: {"exp_avg": torch.ones(64)}}}, os.path.join(path, "optimizer.pt"))
    torch.save({"last_epoch": 2}, os.path.join(path, "scheduler.pt"))
    torch.save({"cpu": torch.random.get_rng_state()}, os.path.join(path, "rng_state.pth"))
    save_file({"w": torch.randn(32, 32), "b": torch.zeros(32)}, os.path.join(path, "model.safetensors"))
    if value_model:
        os.makedirs(os.path.join(path, "value_model"))
        save_file({"score.weight": torch.randn(1, 32)}, os.path.join(path, "value_model", "model.safetensors"))
        with open(os.path.join(path, "value_model", "config.json"), "w") as f:
            json.dump({"model_type": "qwen2"}, f)
    if manifest:
        write_manifest(str(path))
    return str(path)


def truncate(path, keep=0.5):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(int(size * keep))
    return size


def test_manifest_lists_every_file_with_its_size(tmp_path):
    ckpt = make_checkpoint(tmp_path / "checkpoint-2", value_model=True)
    files = json.load(open(os.path.join(ckpt, MANIFEST)))["files"]
    assert set(files) == {"trainer_state.json", "optimizer.pt", "scheduler.pt", "rng_state.pth", "model.safetensors",
                          "value_model/model.safetensors", "value_model/config.json"}
    assert files["optimizer.pt"] == os.path.getsize(os.path.join(ckpt, "optimizer.pt"))
    assert checkpoint_problem(ckpt) is None


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "no-manifest"])
def test_intact_checkpoint_has_no_problem(tmp_path, manifest):
    assert checkpoint_problem(make_checkpoint(tmp_path / "checkpoint-2", manifest=manifest)) is None


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "no-manifest"])
def test_truncated_safetensors(tmp_path, manifest):
    ckpt = make_checkpoint(tmp_path / "c", manifest=manifest)
    full = truncate(os.path.join(ckpt, "model.safetensors"))
    assert checkpoint_problem(ckpt) == f"model.safetensors is truncated ({full // 2} of {full} bytes)"


def test_truncated_safetensors_inside_its_header(tmp_path):
    ckpt = make_checkpoint(tmp_path / "c", manifest=False)
    with open(os.path.join(ckpt, "model.safetensors"), "r+b") as f:
        f.truncate(20)
    assert checkpoint_problem(ckpt).startswith("model.safetensors is truncated (20 bytes")


def test_safetensors_with_bytes_added(tmp_path):
    ckpt = make_checkpoint(tmp_path / "c", manifest=False)
    path = os.path.join(ckpt, "model.safetensors")
    size = os.path.getsize(path)
    with open(path, "ab") as f:
        f.write(b"\0" * 10)
    assert checkpoint_problem(ckpt) == f"model.safetensors has {size + 10} bytes, its header describes {size}"


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "no-manifest"])
@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt", "trainer_state.json"])
def test_missing_file(tmp_path, manifest, name):
    ckpt = make_checkpoint(tmp_path / "c", manifest=manifest)
    os.remove(os.path.join(ckpt, name))
    assert checkpoint_problem(ckpt) == f"{name} is missing"


def test_missing_weights_without_manifest(tmp_path):
    ckpt = make_checkpoint(tmp_path / "c", manifest=False)
    os.remove(os.path.join(ckpt, "model.safetensors"))
    assert checkpoint_problem(ckpt).startswith("model weights are missing")


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "no-manifest"])
@pytest.mark.parametrize("garbage", [b"not json {", b"\xff\xfe\x00garbage", b""], ids=["text", "binary", "empty"])
def test_unreadable_state_file(tmp_path, manifest, garbage):
    ckpt = make_checkpoint(tmp_path / "c", manifest=manifest)
    with open(os.path.join(ckpt, "trainer_state.json"), "wb") as f:
        f.write(garbage)
    assert checkpoint_problem(ckpt).startswith("trainer_state.json cannot be read: ")


def test_truncated_torch_file(tmp_path):
    ckpt = make_checkpoint(tmp_path / "c", manifest=True)
    full = truncate(os.path.join(ckpt, "optimizer.pt"))
    assert checkpoint_problem(ckpt) == f"optimizer.pt is truncated ({full // 2} of {full} bytes)"
    os.remove(os.path.join(ckpt, MANIFEST))  # an older run's checkpoint: the zip archive is incomplete
    assert checkpoint_problem(ckpt).startswith("optimizer.pt cannot be read: incomplete zip archive")


def test_torch_file_overwritten(tmp_path):
    ckpt = make_checkpoint(tmp_path / "c", manifest=False)
    with open(os.path.join(ckpt, "rng_state.pth"), "wb") as f:
        f.write(b"nonsense")
    assert checkpoint_problem(ckpt) == "rng_state.pth cannot be read: not a torch file (no zip archive)"
    open(os.path.join(ckpt, "rng_state.pth"), "wb").close()
    assert checkpoint_problem(ckpt) == "rng_state.pth is empty"


def test_same_size_garbage_in_a_torch_file(tmp_path):
    ckpt = make_checkpoint(tmp_path / "c", manifest=True)
    path = os.path.join(ckpt, "optimizer.pt")
    size = os.path.getsize(path)
    with open(path, "wb") as f:
        f.write(b"x" * size)
    assert checkpoint_problem(ckpt).startswith("optimizer.pt cannot be read")


def test_file_grown_after_the_manifest(tmp_path):
    ckpt = make_checkpoint(tmp_path / "c", manifest=True)
    path = os.path.join(ckpt, "scheduler.pt")
    size = os.path.getsize(path)
    with open(path, "ab") as f:
        f.write(b"\0")
    assert checkpoint_problem(ckpt) == f"scheduler.pt has {size + 1} bytes, {MANIFEST} lists {size}"


def test_nested_files_are_checked(tmp_path):
    """PPO's value_model/ (and merged/): listed in the manifest and checked like the top-level files."""
    ckpt = make_checkpoint(tmp_path / "c", value_model=True)
    full = truncate(os.path.join(ckpt, "value_model", "model.safetensors"))
    assert checkpoint_problem(ckpt) == f"value_model/model.safetensors is truncated ({full // 2} of {full} bytes)"
    os.remove(os.path.join(ckpt, "value_model", "model.safetensors"))
    assert checkpoint_problem(ckpt) == "value_model/model.safetensors is missing"


def test_unreadable_manifest(tmp_path):
    ckpt = make_checkpoint(tmp_path / "c")
    with open(os.path.join(ckpt, MANIFEST), "w") as f:
        f.write('{"files": ')
    assert checkpoint_problem(ckpt).startswith(f"{MANIFEST} cannot be read: ")
    with open(os.path.join(ckpt, MANIFEST), "w") as f:
        f.write('{"files": ["optimizer.pt"]}')
    assert checkpoint_problem(ckpt).startswith(f"{MANIFEST} cannot be read: ")


def test_sharded_weights_index_names_a_missing_shard(tmp_path):
    ckpt = make_checkpoint(tmp_path / "c", manifest=False)
    os.rename(os.path.join(ckpt, "model.safetensors"), os.path.join(ckpt, "model-00001-of-00002.safetensors"))
    with open(os.path.join(ckpt, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"w": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}, f)
    assert checkpoint_problem(ckpt) == ("model-00002-of-00002.safetensors is missing (listed in "
                                        "model.safetensors.index.json)")


def test_deepspeed_checkpoint_without_manifest(tmp_path):
    """DeepSpeed keeps optimizer (and, under ZeRO-3, weights) in global_step*/, not optimizer.pt / model files."""
    ckpt = make_checkpoint(tmp_path / "c", manifest=False)
    for name in ("optimizer.pt", "scheduler.pt", "model.safetensors"):
        os.remove(os.path.join(ckpt, name))
    os.makedirs(os.path.join(ckpt, "global_step2"))
    states = os.path.join(ckpt, "global_step2", "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    torch.save({"optimizer_state_dict": {}}, states)
    assert checkpoint_problem(ckpt) is None
    truncate(states)
    assert checkpoint_problem(ckpt).startswith("global_step2/zero_pp_rank_0_mp_rank_00_optim_states.pt cannot be read")


# ----------------------------------------------------------------------------------------------------------------
# resolve_resume and set_aside_damaged on hand-made checkpoints
# ----------------------------------------------------------------------------------------------------------------
def test_resume_true_takes_the_newest_intact_checkpoint_and_says_so(tmp_path, caplog):
    for step in (10, 20, 30, 40):
        make_checkpoint(tmp_path / f"checkpoint-{step}")
    os.remove(tmp_path / "checkpoint-40" / "optimizer.pt")
    (tmp_path / "checkpoint-30" / "trainer_state.json").write_text("garbage")
    with caplog.at_level(logging.WARNING, logger="rlhf_trl"):
        assert resolve_resume("true", str(tmp_path)) == str(tmp_path / "checkpoint-20")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings[0] == "checkpoint-40 is damaged (optimizer.pt is missing); resuming from checkpoint-20"
    assert warnings[1].startswith("checkpoint-30 is damaged (trainer_state.json cannot be read: ")
    assert warnings[1].endswith("); resuming from checkpoint-20") and len(warnings) == 2
    caplog.clear()
    make_checkpoint(tmp_path / "checkpoint-50")
    with caplog.at_level(logging.WARNING, logger="rlhf_trl"):  # the newest is intact: no warning
        assert resolve_resume("last", str(tmp_path)) == str(tmp_path / "checkpoint-50")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_resume_true_with_every_checkpoint_damaged_fails_in_one_line(tmp_path):
    for step in (2, 4):
        make_checkpoint(tmp_path / f"checkpoint-{step}")
    truncate(str(tmp_path / "checkpoint-2" / "model.safetensors"))
    os.remove(tmp_path / "checkpoint-4" / "optimizer.pt")
    before = tree_hashes(tmp_path)
    with pytest.raises(StageInputError) as exc:
        resolve_resume("true", str(tmp_path))
    assert str(exc.value).startswith(f"resume_from_checkpoint=true: no intact checkpoint in '{tmp_path}' (newest "
                                     "checkpoint-4: optimizer.pt is missing)")
    assert "\n" not in str(exc.value)
    assert tree_hashes(tmp_path) == before


def test_resume_from_a_damaged_path_fails_naming_it(tmp_path):
    ckpt = make_checkpoint(tmp_path / "checkpoint-4")
    truncate(os.path.join(ckpt, "model.safetensors"))
    with pytest.raises(StageInputError, match=r"checkpoint '.*checkpoint-4' is damaged \(model.safetensors is "
                                              r"truncated \(\d+ of \d+ bytes\)\)"):
        resolve_resume(ckpt, str(tmp_path))


def test_set_aside_moves_only_newer_damaged_checkpoints(tmp_path, caplog):
    for step in (1, 2, 3, 4):
        make_checkpoint(tmp_path / f"checkpoint-{step}")
    os.remove(tmp_path / "checkpoint-1" / "optimizer.pt")  # older than the resume point: left alone
    os.remove(tmp_path / "checkpoint-4" / "optimizer.pt")
    with caplog.at_level(logging.WARNING, logger="rlhf_trl"):
        moved = set_aside_damaged(str(tmp_path), str(tmp_path / "checkpoint-2"))
    assert moved == [str(tmp_path / "damaged-checkpoint-4")]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1", "checkpoint-2", "checkpoint-3", "damaged-checkpoint-4"]
    assert "moved the damaged checkpoint-4 (optimizer.pt is missing) aside to damaged-checkpoint-4" in caplog.text


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

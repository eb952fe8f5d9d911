"""Bad input over a finished run changes nothing: with `overwrite_output_dir: true`, a broken data row, a missing
model and a bad recipe value leave every file of the earlier run byte-identical (the earlier run's checkpoints, logs
and reports are set aside only once the new run has read its data and loaded its models, `checkpoints.begin_writing`,
and put back if it fails before its first checkpoint)."""

import os
import shutil

import pytest
from conftest import RECIPES, import_ppo, tree_hashes
from transformers import TrainerCallback

from rlhf_trl import rm, sft
from rlhf_trl.config import RecipeError
from rlhf_trl.data import DataError
from rlhf_trl.models import StageInputError


@pytest.fixture
def broken_file(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"instruction": "你觉得咖啡怎么样？", "output": "咖啡很棒。"}\n{"instruction": broken\n',
                    encoding="utf-8")
    return str(path)


def stage_argv(stage, assets, sft_run, rm_run, out, data=None, **paths):
    data = data or {"sft": assets["sft"], "rm": assets["rm"], "ppo": assets["prompts"]}[stage]
    argv = ["--config", f"{RECIPES}/{stage}.yaml", "--dataset_name", data, "--output_dir", str(out),
            "--overwrite_output_dir", "true"]
    if stage == "sft":
        argv += ["--model_name_or_path", paths.get("model", assets["base_model"])]
    elif stage == "rm":
        argv += ["--model_name_or_path", paths.get("model", sft_run["merged"])]
    else:
        argv += ["--sft_model_path", paths.get("model", sft_run["merged"]), "--reward_model_path", rm_run["merged"]]
    return argv


@pytest.mark.parametrize("stage", ["sft", "rm", "ppo"])
def test_bad_input_over_a_finished_run_leaves_it_byte_identical(stage, assets, sft_run, rm_run, tmp_path, broken_file,
                                                                 request):
    finished = request.getfixturevalue(f"{stage}_run")["output_dir"]  # ppo_run only for stage ppo
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    if stage == "ppo":
        assert any(n.startswith("checkpoint-") for n in os.listdir(out))  # checkpoints at stake too
    before = tree_hashes(out)
    main = (import_ppo() if stage == "ppo" else {"sft": sft, "rm": rm}[stage]).main

    with pytest.raises(DataError, match=r"broken.jsonl, row 1: cannot be read as json: line 2 is not valid JSON"):
        main(stage_argv(stage, assets, sft_run, rm_run, out, data=broken_file))
    assert tree_hashes(out) == before
    with pytest.raises(StageInputError, match="not found at '/nonexistent/model'"):  # a missing model
        main(stage_argv(stage, assets, sft_run, rm_run, out, model="/nonexistent/model"))
    assert tree_hashes(out) == before
    with pytest.raises(RecipeError, match="learning_rate"):  # a bad recipe value
        main(stage_argv(stage, assets, sft_run, rm_run, out) + ["--learning_rate", "fast"])
    assert tree_hashes(out) == before


class FailAt(TrainerCallback):
    """Raises at the end of update ``step`` (a failure once training has started)."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise RuntimeError(f"failed at step {self.step}")


@pytest.mark.parametrize("stage", ["sft", "rm"])
def test_failure_after_training_started_puts_the_earlier_run_back(stage, assets, sft_run, rm_run, tmp_path, request):
    """overwrite_output_dir: a run that fails once training has started (before its first checkpoint) leaves the
    earlier run byte-identical and nothing of its own; one that fails after its first checkpoint keeps that checkpoint
    (resumable) and the earlier run is gone (swapped at the first checkpoint)."""
    out = tmp_path / "run"
    shutil.copytree(request.getfixturevalue(f"{stage}_run")["output_dir"], out)
    before = tree_hashes(out)
    main = {"sft": sft, "rm": rm}[stage].main
    argv = stage_argv(stage, assets, sft_run, rm_run, out) + ["--max_steps", "3", "--save_strategy", "steps",
                                                              "--save_steps", "2", "--report_to", "tensorboard"]
    with pytest.raises(RuntimeError, match="failed at step 1"):
        main(argv, callbacks=[FailAt(1)])
    assert tree_hashes(out) == before
    with pytest.raises(RuntimeError, match="failed at step 3"):
        main(argv, callbacks=[FailAt(3)])
    assert sorted(os.listdir(out)) == ["checkpoint-2", "runs"]

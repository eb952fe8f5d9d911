"""What a run leaves is honest: every JSON file a run writes is strict JSON (no ``NaN`` / ``Infinity``: ``null``
stands for a value that was not finite), checkpoint disk use is bounded by default (the newest 3 kept), every
successful command ends with one line naming its outputs, and ``rlhf-trl --version`` names the versions a bug report
needs. (Proportions' intervals inside [0, 1], Wilson: test_scoring.py.)"""

import json
import os

import pytest
from conftest import RECIPES, reward_stand_in

from rlhf_trl.cli import main as cli_main
from rlhf_trl.atomic import strict_json, write_json


def _refuse(token):
    raise ValueError(f"not strict JSON: {token}")


def strict_files(root) -> list[str]:
    """Parse every .json / .jsonl file under ``root`` with a strict parser; returns their relative paths."""
    seen = []
    for folder, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(".json"):
                with open(path, encoding="utf-8") as f:
                    json.loads(f.read(), parse_constant=_refuse)
            elif name.endswith(".jsonl"):
                with open(path, encoding="utf-8") as f:
                    for line in f:
                        json.loads(line, parse_constant=_refuse)
            else:
                continue
            seen.append(os.path.relpath(path, root))
    return seen


@pytest.fixture(scope="module")
def ppo_run(assets, tmp_path_factory):
    """5 PPO updates of one mini-batch of one micro-batch (TRL 1.12 logged ``val/ratio_var`` NaN there), a
    checkpoint and a sample table every update, no ``save_total_limit`` in the recipe: the default applies."""
    out = tmp_path_factory.mktemp("honest") / "ppo"
    argv = ["ppo", "--config", f"{RECIPES}/ppo.yaml", "--dataset_name", assets["prompts"], "--sft_model_path",
            assets["base_model"], "--reward_model_path", reward_stand_in(assets), "--output_dir", str(out),
            "--max_samples", "28", "--eval_split_size", "8", "--per_device_eval_batch_size", "4",
            "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1", "--total_episodes", "20",
            "--num_ppo_epochs", "1", "--num_mini_batches", "1", "--response_length", "6",
            "--local_rollout_forward_batch_size", "4", "--save_steps", "1", "--logging_steps", "1",
            "--log_samples_every", "1", "--report_to", "none"]
    return out, argv


def test_every_json_file_of_a_ppo_run_is_strict(ppo_run, capsys):
    out, argv = ppo_run
    assert cli_main(argv) == 0
    stdout = capsys.readouterr().out.strip().splitlines()
    assert stdout[-1].startswith(f"rlhf-trl ppo: done; outputs in {out}: "), stdout[-1]
    assert "merged/" in stdout[-1] and "metrics.json" in stdout[-1]
    seen = strict_files(out)
    assert {"metrics.json", "log_history.json", "samples.jsonl", "data_report.json",
            "checkpoint-5/trainer_state.json"} <= set(seen), seen
    history = json.loads((out / "log_history.json").read_text())
    assert all(h["val/ratio_var"] == 0.0 for h in history if "val/ratio_var" in h)  # one value: no spread


def test_checkpoints_are_bounded_by_default(ppo_run):
    """(The exact-resume tests run under the same default: resume reads the newest checkpoint.)"""
    out, argv = ppo_run
    kept = sorted(int(n.split("-")[1]) for n in os.listdir(out) if n.startswith("checkpoint-"))
    assert kept == [3, 4, 5]  # save_total_limit: 3 unless the recipe sets it; 1 and 2 deleted


def test_strict_json_replaces_non_finite_values_with_null(tmp_path):
    data = {"a": float("nan"), "b": [1.0, float("inf"), {"c": -float("inf")}], "d": 2}
    assert strict_json(data) == {"a": None, "b": [1.0, None, {"c": None}], "d": 2}
    write_json(str(tmp_path / "x.json"), data)
    assert json.loads((tmp_path / "x.json").read_text(), parse_constant=_refuse)["a"] is None


def test_version_names_the_libraries(capsys):
    assert cli_main(["--version"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("rlhf-trl ") and all(f"{n} " in line for n in ("trl", "transformers", "torch", "python"))


def test_a_length_error_suggests_only_what_is_not_set(tokenizer):
    from rlhf_trl.data import DataError, Template, pair_features

    pairs = [{"question": "天气", "history": [], "chosen": "好" * 40, "rejected": "坏" * 40}]
    with pytest.raises(DataError, match=r"\(raise max_length or set length_policy: truncate_prompt\)$"):
        pair_features(pairs, tokenizer, Template(), max_length=8)
    with pytest.raises(DataError) as info:
        pair_features(pairs, tokenizer, Template(), max_length=8, length_policy="truncate_prompt")
    assert "set length_policy" not in str(info.value)
    assert str(info.value).endswith("(raise max_length: with length_policy: truncate_prompt the responses alone "
                                    "exceed it)")


def test_every_json_file_of_an_sft_run_is_strict(assets, tmp_path, capsys):
    out = tmp_path / "sft"
    assert cli_main(["sft", "--config", f"{RECIPES}/sft.yaml", "--dataset_name", assets["sft"], "--model_name_or_path",
                     assets["base_model"], "--output_dir", str(out), "--max_samples", "24", "--max_steps", "2",
                     "--save_strategy", "steps", "--save_steps", "1", "--logging_steps", "1", "--report_to", "none"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith(f"rlhf-trl sft: done; outputs in {out}: ")
    seen = strict_files(out)
    assert {"metrics.json", "log_history.json", "data_report.json", "checkpoint-2/trainer_state.json",
            "checkpoint-2/loop_state.json", "merged/config.json"} <= set(seen), seen


def test_a_stop_message_says_how_to_go_on():
    from rlhf_trl.cli_launch import resume_hint
    from rlhf_trl.run_dir import StoppedBySignal

    stop = StoppedBySignal(15, 3, "/runs/sft/checkpoint-3")
    assert str(stop) == "stopped by SIGTERM at step 3: checkpoint-3 written" and stop.exit_code == 143
    assert resume_hint("sft", ["--config", "r.yaml"], stop) == (
        "; resume with `make sft RECIPE=r.yaml resume_from_checkpoint=true` (or --resume_from_checkpoint true)")
    assert resume_hint("demo", [], stop) == "; `make demo` starts it over"
    assert resume_hint("ppo", ["--config", "r.yaml", "--output_dir", "/x y"], stop) == (
        "; resume with `rlhf-trl ppo --config r.yaml --output_dir '/x y' --resume_from_checkpoint true`")
    early = StoppedBySignal(2)
    assert str(early) == "stopped by SIGINT before training began: nothing of this run was kept"
    assert early.exit_code == 130 and resume_hint("sft", [], early) == ""

"""Malformed input to every command (sft, rm, ppo, eval, merge): exit status 2, one clear line naming the file (and
row and field for data) or the recipe key, no traceback, nothing written and nothing deleted. Each case runs the
CLI entry point (`rlhf_trl.cli.main`) in-process; `test_every_command_in_a_real_process` runs one per command
through ``python -m rlhf_trl``."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import CHATML, RECIPES, reward_stand_in, tree_hashes, with_chat_template, write_jsonl

from rlhf_trl.cli import main as cli_main
from rlhf_trl.cli import run_stage


def run_cli(stage, argv, capsys):
    """Run the CLI entry point (``rlhf-trl <stage> ...``); return the exit status and the lines it printed about the
    failure (no traceback, no argparse usage text)."""
    with pytest.raises(SystemExit) as exc:
        cli_main([stage, *argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err and "usage:" not in err, err
    return exc.value.code, [line for line in err.splitlines() if line.startswith("rlhf-trl")]


def expect_one_line(stage, argv, capsys, fragments) -> str:
    """Exit status 2 and exactly one ``rlhf-trl <stage>: error: ...`` line holding every fragment; returns it."""
    code, err = run_cli(stage, argv, capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith(f"rlhf-trl {stage}: error: "), (code, err)
    for fragment in fragments:
        assert fragment in err[0], (fragment, err[0])
    return err[0]


def sft_argv(assets, out, data, *extra):
    return ["--config", f"{RECIPES}/sft.yaml", "--dataset_name", str(data), "--model_name_or_path",
            assets["base_model"], "--output_dir", str(out), *extra]


def rm_argv(assets, out, data, *extra):
    return ["--config", f"{RECIPES}/rm.yaml", "--dataset_name", str(data), "--model_name_or_path",
            assets["base_model"], "--output_dir", str(out), "--dataset_format", "auto", *extra]


GOOD = {"instruction": "你觉得咖啡怎么样？", "input": "", "output": "咖啡很棒，我很喜欢。"}

# (name, stage, rows or raw text, file suffix, extra args, expected: fragments of the one error line (a list), or the
# exact line after "rlhf-trl <stage>: error: " (a string; "{data}": the data file))
DATA_CASES = [
    ("broken_json_line", "sft", '{"instruction": "q", "output": "a"}\n{"instruction": "q", "output": \n', "jsonl", [],
     "{data}, row 1: cannot be read as json: line 2 is not valid JSON (Expecting value at column 32)"),
    ("broken_json_file", "sft", '[{"instruction": "q", "output": "a"},', "json", [],
     "{data}: cannot be read as json: not valid JSON: Expecting value: line 1 column 38 (char 37)"),
    ("missing_mapped_column", "sft", [GOOD, GOOD], "jsonl", ["--answer_key", "reply"],
     ["row 0", "field 'reply'", "missing column"]),
    ("null_field", "sft", [GOOD, {**GOOD, "output": None}], "jsonl", [], ["row 1", "field 'output'", "null"]),
    ("whitespace_field", "sft", [GOOD, {**GOOD, "instruction": "  \n "}], "jsonl", [],
     ["row 1", "field 'instruction'", "empty"]),
    ("non_string_field", "sft", [GOOD, {**GOOD, "output": 42}], "jsonl", [], ["row 1", "field 'output'", "string"]),
    ("non_string_question", "sft", [GOOD, {**GOOD, "instruction": ["a"]}], "jsonl", [],
     ["row 1", "field 'instruction'", "string"]),
    ("mixed_formats", "sft", [GOOD, {"instruction": "q", "output": ["a", "b"]}], "jsonl", ["--dataset_format", "auto"],
     ["row 1", "mixed formats"]),
    ("empty_file", "sft", "", "jsonl", [], "{data}: holds no rows (the file is empty)"),
    ("empty_json_list", "sft", "[]", "json", [], "{data}: holds no rows (an empty JSON array)"),
    ("unsupported_extension", "sft", "hello", "txt", [],
     "{data}: unsupported file type '.txt'; use .json/.jsonl/.csv/.parquet, optionally .gz/.bz2/.xz/.zst/.lz4"),
    ("sharegpt_ends_with_user", "sft", [{"conversations": [{"from": "human", "value": "q"}]}], "jsonl",
     ["--dataset_format", "sharegpt"],
     ["row 0", "field 'conversations'", "assistant"]),
    ("sharegpt_turn_without_value", "sft",
     [{"conversations": [{"from": "human"}, {"from": "gpt", "value": "a"}]}], "jsonl", ["--dataset_format", "sharegpt"],
     ["row 0", "field 'conversations'", "message 0"]),
    ("bad_history", "sft", [{**GOOD, "history": "not a list"}], "jsonl", [], ["row 0", "field 'history'"]),
    ("every_prompt_too_long", "sft", [{**GOOD, "instruction": "很长" * 200}] * 3, "jsonl", ["--max_length", "32"],
     ["no row is left", "max_length=32"]),
    ("chosen_equals_rejected", "rm", [{"prompt": "q", "chosen": "same", "rejected": "same"}] * 3, "jsonl", [],
     ["row 0", "identical"]),
    ("ranked_with_one_answer", "rm", [{"instruction": "q", "output": ["only"]}] * 3, "jsonl",
     ["--dataset_format", "ranked"], ["row 0", "field 'output'", "at least 2 answers"]),
    ("ranked_not_a_list", "rm", [{"instruction": "q", "output": "a"}] * 3, "jsonl", ["--dataset_format", "ranked"],
     ["row 0", "field 'output'", "list"]),
    ("pairs_missing_rejected", "rm", [{"prompt": "q", "chosen": "a", "rejected": "b"}, {"prompt": "q", "chosen": "a"}],
     "jsonl", ["--dataset_format", "pairwise"], ["row 1", "field 'rejected'", "null"]),  # datasets fills it with null
    ("every_pair_too_long", "rm", [{"prompt": "q", "chosen": "好" * 300, "rejected": "坏" * 300}] * 12, "jsonl",
     ["--max_length", "32"], ["no pair is left", "max_length=32"]),
    ("prompt_only_rows_for_rm", "rm", [{"instruction": "q"}] * 4, "jsonl", [], ["no preference pairs"]),
]


@pytest.mark.parametrize("name, stage, rows, suffix, extra, expected", DATA_CASES, ids=[c[0] for c in DATA_CASES])
def test_bad_data(assets, tmp_path, capsys, name, stage, rows, suffix, extra, expected):
    data = tmp_path / f"bad.{suffix}"
    if isinstance(rows, str):
        data.write_text(rows, encoding="utf-8")
    else:
        write_jsonl(data, rows)
    out = tmp_path / "out"
    argv = (sft_argv if stage == "sft" else rm_argv)(assets, out, data, *extra)
    code, err = run_cli(stage, argv, capsys)
    assert code == 2
    if isinstance(expected, str):
        assert err == [f"rlhf-trl {stage}: error: " + expected.replace("{data}", str(data))]
    else:
        assert len(err) == 1 and err[0].startswith(f"rlhf-trl {stage}: error: "), err
        for fragment in expected:
            assert fragment in err[0], (fragment, err[0])
    assert not out.exists()


def write_recipe(tmp_path, text):
    path = tmp_path / "recipe.yaml"
    path.write_text(text, encoding="utf-8")
    return str(path)


# (name, recipe text, extra args, expected: fragments of the one error line (a list), or the exact line after
# "rlhf-trl <stage>: error: " (a string; "{recipe}": the recipe file))
RECIPE_CASES = [
    ("unknown_key", "dataset_name: x.jsonl\nlearning_rte: 0.1\n", [], ["recipe.yaml", "unknown key", "learning_rte"]),
    ("wrong_value_type", "learning_rate: fast\n", [],
     "{recipe}: argument --learning_rate/--learning-rate: invalid float value: 'fast'"),
    ("not_a_mapping", "- a\n- b\n", [], "{recipe}: a recipe must be a YAML mapping of key: value"),
    ("invalid_yaml", "a: [1, 2\n", [],
     "{recipe}: not valid YAML: while parsing a flow sequence in \"{recipe}\", line 1, column 4 expected ',' or ']', "
     "but got '<stream end>' in \"{recipe}\", line 2, column 1"),
    ("missing_dataset", "seed: 3\n", [], ["names no data"]),
    ("bad_format_value", "dataset_format: xml\n", [], ["dataset_format"]),
    ("bad_ranked_pairs", "ranked_pairs: some\n", [], ["ranked_pairs"]),
    ("bad_length_policy", "length_policy: squeeze\n", [], ["length_policy"]),
    ("bad_template", "prompt_template: 'Q: {q}'\n", [], ["prompt_template", "{question}"]),
]


@pytest.mark.parametrize("name, text, extra, expected", RECIPE_CASES, ids=[c[0] for c in RECIPE_CASES])
def test_bad_recipe(assets, tmp_path, capsys, name, text, extra, expected):
    out = tmp_path / "out"
    base = {"dataset_name": assets["rm"], "model_name_or_path": assets["base_model"], "output_dir": str(out),
            "use_cpu": True, "report_to": "none"}
    override = {k.split(":")[0] for k in text.splitlines() if ":" in k}
    head = "".join(f"{k}: {json.dumps(v)}\n" for k, v in base.items() if k not in override)
    if name == "missing_dataset":
        head = head.replace(f"dataset_name: {json.dumps(assets['rm'])}\n", "")
    if name in ("not_a_mapping", "invalid_yaml"):
        head = ""
    stage = "rm" if name == "bad_length_policy" or name == "bad_ranked_pairs" else "sft"
    recipe = write_recipe(tmp_path, head + text)
    code, err = run_cli(stage, ["--config", recipe, *extra], capsys)
    assert code == 2 and len(err) == 1
    line = err[0]
    if isinstance(expected, str):
        assert line == f"rlhf-trl {stage}: error: " + expected.replace("{recipe}", recipe)
    else:
        assert line.startswith(f"rlhf-trl {stage}: error: ")
        for fragment in expected:
            assert fragment in line, (fragment, line)
    assert not out.exists()


def test_missing_recipe_file(tmp_path, capsys):
    code, err = run_cli("sft", ["--config", str(tmp_path / "nope.yaml")], capsys)
    assert code == 2 and err == [f"rlhf-trl sft: error: recipe not found: {tmp_path / 'nope.yaml'}"]


def test_model_directory_without_weights(assets, tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    code, err = run_cli("sft", sft_argv(assets, tmp_path / "out", assets["sft"], "--model_name_or_path", str(model)),
                        capsys)
    assert code == 2 and "holds no weights" in err[0] and str(model) in err[0]
    assert not (tmp_path / "out").exists()


def test_pickle_only_weights_need_an_explicit_flag(assets, tmp_path, capsys):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(assets["base_model"], model)
    os.rename(model / "model.safetensors", model / "pytorch_model.bin")
    code, err = run_cli("sft", sft_argv(assets, tmp_path / "out", assets["sft"], "--model_name_or_path", str(model)),
                        capsys)
    assert code == 2 and "pickle" in err[0] and "allow_pickle_weights" in err[0]


def test_tokenizer_without_eos(assets, tmp_path, capsys):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(assets["base_model"], model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["eos_token"] = None
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    code, err = run_cli("sft", sft_argv(assets, tmp_path / "out", assets["sft"], "--model_name_or_path", str(model)),
                        capsys)
    assert code == 2 and "no EOS token" in err[0] and str(model) in err[0]


def test_previous_stage_output_missing(assets, tmp_path, capsys):
    argv = ["--config", f"{RECIPES}/ppo.yaml", "--dataset_name", assets["prompts"], "--sft_model_path",
            str(tmp_path / "sft" / "merged"), "--output_dir", str(tmp_path / "out")]
    code, err = run_cli("ppo", argv, capsys)
    assert code == 2 and "SFT model not found" in err[0] and "make sft RECIPE=" in err[0]


def test_finished_run_is_not_overwritten(assets, tmp_path, capsys):
    out = tmp_path / "out"
    (out / "merged").mkdir(parents=True)
    (out / "run_config.yaml").write_text("x: 1\n")
    code, err = run_cli("sft", sft_argv(assets, out, assets["sft"], "--overwrite_output_dir", "false"), capsys)
    assert code == 2 and "already holds a finished run" in err[0] and "overwrite_output_dir" in err[0]
    assert sorted(os.listdir(out)) == ["merged", "run_config.yaml"]


def test_resume_without_checkpoint(assets, tmp_path, capsys):
    code, err = run_cli("sft", sft_argv(assets, tmp_path / "out", assets["sft"], "--resume_from_checkpoint", "true"),
                        capsys)
    assert code == 2 and "holds no checkpoint" in err[0]


@pytest.mark.slow  # needs finished runs of the stages or a real process
def test_too_few_eval_prompts(assets, tmp_path, capsys, sft_run, rm_run):
    argv = ["--config", f"{RECIPES}/ppo.yaml", "--dataset_name", assets["prompts"], "--sft_model_path",
            sft_run["merged"], "--reward_model_path", rm_run["merged"], "--output_dir", str(tmp_path / "out"),
            "--eval_split_size", "2"]
    code, err = run_cli("ppo", argv, capsys)
    assert code == 2 and "eval prompts" in err[0] and "per_device_eval_batch_size" in err[0]


@pytest.mark.slow  # needs finished runs of the stages or a real process
def test_bad_reward_baseline(assets, tmp_path, capsys, sft_run, rm_run):
    argv = ["--config", f"{RECIPES}/ppo.yaml", "--dataset_name", assets["prompts"], "--sft_model_path",
            sft_run["merged"], "--reward_model_path", rm_run["merged"], "--output_dir", str(tmp_path / "out"),
            "--reward_baseline", "high"]
    code, err = run_cli("ppo", argv, capsys)
    assert code == 2 and "reward_baseline must be a number or 'auto'" in err[0]


@pytest.mark.slow  # needs finished runs of the stages or a real process
def test_the_real_command_prints_no_traceback(assets, tmp_path):
    """The same through a real process: exit status 2, one line on stderr."""
    data = write_jsonl(tmp_path / "bad.jsonl", [GOOD, {**GOOD, "output": None}])
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf_trl", "sft", *sft_argv(assets, tmp_path / "out", data)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if "rlhf-trl sft" in line]
    assert lines == [f"rlhf-trl sft: error: {data}, row 1, field 'output': is null or missing in this row; fix the "
                     "row, or set on_bad_row: skip to skip such rows"]
    assert proc.stderr.splitlines()[-1] == lines[0]  # the last line
    assert "Traceback" not in proc.stderr


def test_bad_accelerate_config_name():
    root = os.path.join(os.path.dirname(__file__), "..")
    proc = subprocess.run(["make", "-s", "-C", root, "check-accel", "ACCEL=ddpp"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    assert "ACCEL=ddpp: no recipes/accelerate_configs/ddpp.yaml (choose one of: ddp fsdp multi_cpu single_process" in proc.stderr


@pytest.mark.parametrize("extra, fragment", [
    (["--value_use_peft", "false"], "share_reward_value_base: true needs value_use_peft: true"),
    (["--value_use_peft", "true", "--value_model_path", "SFT"], "remove value_model_path"),
], ids=["without-value-lora", "with-value-model-path"])
@pytest.mark.slow  # needs finished runs of the stages or a real process
def test_shared_reward_value_base_needs_a_lora_value_model_on_the_rm(assets, tmp_path, capsys, sft_run, rm_run,
                                                                     extra, fragment):
    extra = [sft_run["merged"] if e == "SFT" else e for e in extra]
    argv = ["--config", f"{RECIPES}/ppo.yaml", "--dataset_name", assets["prompts"], "--sft_model_path",
            sft_run["merged"], "--reward_model_path", rm_run["merged"], "--output_dir", str(tmp_path / "out"),
            "--share_reward_value_base", "true", *extra]
    code, err = run_cli("ppo", argv, capsys)
    assert code == 2 and fragment in err[0], err
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_unfinished_run_checkpoints_refuse_a_fresh_start(assets, tmp_path, capsys):
    out = tmp_path / "out"
    (out / "checkpoint-3").mkdir(parents=True)
    code, err = run_cli("sft", sft_argv(assets, out, assets["sft"], "--overwrite_output_dir", "false"), capsys)
    assert code == 2 and "checkpoints of an earlier, unfinished run (checkpoint-3)" in err[0]
    assert "resume_from_checkpoint=true" in err[0] and "overwrite_output_dir" in err[0]
    assert sorted(os.listdir(out)) == ["checkpoint-3"]


def test_fresh_run_over_an_old_one_removes_its_checkpoints_and_logs(assets, tmp_path):
    """overwrite_output_dir: the earlier run's checkpoints, TensorBoard files and reports go, so that
    resume_from_checkpoint=true and the report only ever see the new run."""
    from rlhf_trl import sft

    out = tmp_path / "out"
    common = ["--max_samples", "40", "--eval_split_size", "4", "--save_strategy", "steps", "--report_to",
              "tensorboard", "--overwrite_output_dir", "true"]
    sft.main(sft_argv(assets, out, assets["sft"], *common, "--max_steps", "4", "--save_steps", "2"))
    assert {"checkpoint-2", "checkpoint-4", "runs"} <= set(os.listdir(out))
    (out / "report.md").write_text("old report\n")
    (out / "runs" / "old-marker").write_text("")
    sft.main(sft_argv(assets, out, assets["sft"], *common, "--max_steps", "1", "--save_steps", "1"))
    assert sorted(p for p in os.listdir(out) if p.startswith("checkpoint")) == ["checkpoint-1"]
    assert not (out / "report.md").exists()
    assert not (out / "runs" / "old-marker").exists()  # only this run's event files


def test_command_line_typo_is_blamed_on_the_command_line(assets, tmp_path, capsys):
    code, err = run_cli("sft", sft_argv(assets, tmp_path / "out", assets["sft"], "--learnig_rate", "3"), capsys)
    assert code == 2 and err[0] == ("rlhf-trl sft: error: command line: unknown argument(s) ['--learnig_rate', '3']; "
                                    "did you mean '--learning_rate'?")
    assert not (tmp_path / "out").exists()


def test_stage_help_names_the_command_and_the_recipe_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        run_stage("ppo", ["--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    assert out.startswith("usage: rlhf-trl ppo --config RECIPE.yaml") and "--share_reward_value_base" in out


# ------------------------------------------------------------------------------------------------------------------
# PPO prompt files. Models are only checked (files and kinds) before the prompts are read, so the tiny base model
# stands in for the SFT model and its sequence-classifier copy for the reward model: no case needs a trained model.
# ------------------------------------------------------------------------------------------------------------------
def ppo_argv(assets, out, data, *extra, model=None):
    return ["--config", f"{RECIPES}/ppo.yaml", "--dataset_name", str(data), "--sft_model_path",
            model or assets["base_model"], "--reward_model_path", reward_stand_in(assets), "--output_dir", str(out),
            *extra]


Q = {"instruction": "你觉得咖啡怎么样？"}
AUTO = ["--dataset_format", "auto"]

# (name, rows or raw text (None: no file), extra args, fragments after "rlhf-trl ppo: error: <data file>")
PPO_DATA_CASES = [
    ("broken_json_line", '{"instruction": "q"}\n\n{"instruction": \n', [],
     [", row 1: cannot be read as json: line 3 is not valid JSON (Expecting value at column 17)"]),
    ("line_not_an_object", '{"instruction": "q"}\n["q"]\n', [],
     [", row 1: cannot be read as json: line 2 is a JSON list, not an object"]),
    ("missing_prompt_column", [{"text": "q"}] * 2, [],
     [", row 0, field 'instruction': missing column; set question_key to one of ['text']"]),
    ("null_prompt", [Q, {"topic": "咖啡"}], [], [", row 1, field 'instruction': is null or missing in this row"]),
    ("empty_prompt", [Q, {"instruction": ""}], [], [", row 1, field 'instruction': is empty"]),
    ("prompt_not_a_string", [Q, {"instruction": 42}], [], [", row 1, field 'instruction': must be a string, got int"]),
    ("prompt_is_an_object", [Q, {"instruction": {"text": "q"}}], [],
     [", row 1, field 'instruction': must be a string, got dict"]),
    ("input_not_a_string", [Q, {**Q, "input": 3}], [], [", row 1, field 'input': must be a string, got int"]),
    ("empty_file", "", [], [": holds no rows (the file is empty)"]),
    ("file_not_found", None, [], [": file not found"]),
    ("prompt_turn_out_of_range", [{"instruction": ["q1", "q2"]}], ["--prompt_turn", "5"],
     [", row 0, field 'instruction': prompt_turn=5 is out of range for 2 turns"]),
    ("empty_turn", [{"instruction": ["q1", " "]}], ["--prompt_turn", "1"],
     [", row 0, field 'instruction': holds an empty turn"]),
    ("messages_unknown_role", [{"messages": [{"role": "bot", "content": "hi"}, {"role": "user", "content": "q"}]}],
     AUTO, [", row 0, field 'messages': message 0 has role 'bot'; use system, user, assistant or tool"]),
    ("messages_without_user_turn",
     [{"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]}], AUTO,
     [", row 0, field 'messages': needs a user turn"]),
    ("messages_system_not_first", [{"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "s"},
                                                 {"role": "user", "content": "q2"}]}], AUTO,
     [", row 0, field 'messages': message 1 (system) is only allowed as the first message"]),
    ("sharegpt_without_user_turn", [{"conversations": [{"from": "gpt", "value": "a"}]}], AUTO,
     [", row 0, field 'conversations': needs a user turn"]),
    ("bad_history", [{**Q, "history": "not a list"}], [],
     [", row 0, field 'history': must be a list of [question, answer] string pairs"]),
]


@pytest.mark.parametrize("name, rows, extra, fragments", PPO_DATA_CASES, ids=[c[0] for c in PPO_DATA_CASES])
def test_bad_ppo_prompts(assets, tmp_path, capsys, name, rows, extra, fragments):
    data = tmp_path / "bad.jsonl"
    if isinstance(rows, str):
        data.write_text(rows, encoding="utf-8")
    elif rows is not None:
        write_jsonl(data, rows)
    out = tmp_path / "out"
    before = tree_hashes(tmp_path)
    expect_one_line("ppo", ppo_argv(assets, out, data, *extra), capsys,
                    [f"rlhf-trl ppo: error: {data}{fragments[0]}", *fragments[1:]])
    assert not out.exists() and tree_hashes(tmp_path) == before  # nothing written, nothing deleted


# ------------------------------------------------------------------------------------------------------------------
# PPO recipe values and reward functions, over a finished PPO run with overwrite_output_dir: true (the earlier run
# must stay byte-identical: these fail before anything of it goes)
# ------------------------------------------------------------------------------------------------------------------
GT = "rlhf_trl.demo_task:ground_truth_reward"

PPO_RECIPE_CASES = [
    ("reward_funcs_module_missing", ["--reward_funcs", "no_such_module_xyz:score"],
     ["reward_funcs[0] 'no_such_module_xyz:score': cannot import module 'no_such_module_xyz': "
      "ModuleNotFoundError: No module named 'no_such_module_xyz'"]),
    ("reward_funcs_function_missing", ["--reward_funcs", "rlhf_trl.demo_task:no_such_function"],
     ["reward_funcs[0] 'rlhf_trl.demo_task:no_such_function': module 'rlhf_trl.demo_task' has no attribute "
      "'no_such_function'"]),
    ("reward_funcs_not_callable", ["--reward_funcs", "rlhf_trl.demo_task:TOPICS"],
     ["reward_funcs[0] 'rlhf_trl.demo_task:TOPICS': 'TOPICS' is a list, not callable"]),
    ("reward_funcs_bad_entry", ["--reward_funcs", "rlhf_trl.demo_task.ground_truth_reward"],
     ["reward_funcs[0]: 'rlhf_trl.demo_task.ground_truth_reward' is not 'package.module:function' or "
      "'path/to/file.py:function'"]),
    ("reward_funcs_file_missing", ["--reward_funcs", "{tmp}/missing_rewards.py:score"],
     ["reward_funcs[0] '{tmp}/missing_rewards.py:score': file not found: {tmp}/missing_rewards.py"]),
    ("reward_funcs_file_fails_to_import", ["--reward_funcs", "{tmp}/broken_rewards.py:score"],
     ["reward_funcs[0] '{tmp}/broken_rewards.py:score': cannot import file {tmp}/broken_rewards.py: "
      "RuntimeError: needs a GPU"]),
    ("reward_funcs_without_completions", ["--reward_funcs", "{tmp}/rewards.py:no_completions"],
     ["reward_funcs[0] '{tmp}/rewards.py:no_completions': takes no 'completions' argument"]),
    ("reward_weights_count", ["--reward_funcs", GT, "--reward_weights", "1.0", "2.0"],
     ["reward_weights: 2 weight(s) for 1 reward_funcs (one per function, in order)"]),
    ("reward_weights_not_finite", ["--reward_funcs", GT, "--reward_weights", "nan"],
     [f"reward_weights[0]: nan (for '{GT}') is not finite"]),
    ("reward_weights_not_a_number", ["--reward_funcs", GT, "--reward_weights", "heavy"],
     ["command line: argument --reward_weights/--reward-weights: invalid float value: 'heavy'"]),
    ("reward_weights_without_funcs", ["--reward_weights", "0.5"], ["reward_weights: 1 weight(s) but no reward_funcs"]),
    ("reward_funcs_without_value_model", ["--reward_model_path", "", "--reward_funcs", GT],
     ["value_model_path: without a reward model the value model needs its own initialization"]),
    ("num_mini_batches_not_dividing", ["--num_mini_batches", "3"],
     ["per_device_train_batch_size x gradient_accumulation_steps (rollouts per process and update) / "
      "num_mini_batches: 32 is not a multiple of 3"]),
    ("kl_target_negative", ["--kl_target", "-1"], ["kl_target and kl_horizon must be positive, got -1.0 and 10000"]),
    ("max_prompt_length_zero", ["--max_prompt_length", "0"], ["max_prompt_length must be >= 1"]),
    ("removed_cpu_key", ["--tensor_cache", "true"],
     ["command line: unknown argument(s) ['--tensor_cache', 'true']; check the spelling against --help"]),
    ("bad_dataset_format", ["--dataset_format", "xml"], ["dataset_format must be one of", "got 'xml'"]),
]


@pytest.fixture
def finished_ppo(ppo_run, tmp_path):
    """A copy of a finished PPO run (checkpoints, logs, merged models)."""
    out = tmp_path / "ppo"
    shutil.copytree(ppo_run["output_dir"], out)
    assert any(n.startswith("checkpoint-") for n in os.listdir(out)) and (out / "merged").is_dir()
    return out


@pytest.mark.slow  # needs finished runs of the stages or a real process
@pytest.mark.parametrize("name, extra, fragments", PPO_RECIPE_CASES, ids=[c[0] for c in PPO_RECIPE_CASES])
def test_bad_ppo_recipe_over_a_finished_run(assets, finished_ppo, tmp_path, capsys, name, extra, fragments):
    (tmp_path / "broken_rewards.py").write_text("raise RuntimeError('needs a GPU')\n")
    (tmp_path / "rewards.py").write_text("def no_completions(prompts):\n    return [0.0] * len(prompts)\n")
    extra = [e.replace("{tmp}", str(tmp_path)) for e in extra]
    before = tree_hashes(tmp_path)
    expect_one_line("ppo", ppo_argv(assets, finished_ppo, assets["prompts"], "--overwrite_output_dir", "true", *extra),
                    capsys, [f.replace("{tmp}", str(tmp_path)) for f in fragments])
    assert tree_hashes(tmp_path) == before  # the earlier run (and everything else) byte-identical


# ------------------------------------------------------------------------------------------------------------------
# chat templates
# ------------------------------------------------------------------------------------------------------------------
NO_SPECIAL_END = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant: {% endif %}")
SYNTAX_ERROR = "{% for m in messages %}{{ m['content'] }"
NO_SYSTEM = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
             + CHATML)

# (name, stage, template or None (the tokenizer has none), eos_list, extra args, fragments; "{model}": its dir)
CHAT_CASES = [
    ("ppo_tokenizer_without_template", "ppo", None, False, ["--chat_template", "true"],
     ["chat_template: true, but the tokenizer at '{model}' has no chat template; set chat_template: false"]),
    ("rm_turn_ends_without_special_token", "rm", NO_SPECIAL_END, False, ["--chat_template", "true"],
     ["the chat template of '{model}' ends an assistant turn with '\\n', which holds no special token"]),
    ("sft_template_syntax_error", "sft", SYNTAX_ERROR, False, ["--chat_template", "true"],
     ["the chat template of '{model}' fails on a user turn and an assistant turn: TemplateSyntaxError: ",
      "fix its chat_template or set chat_template: false"]),
    ("ppo_template_raises_on_a_system_turn", "ppo", NO_SYSTEM, True,
     ["--chat_template", "true", "--system_prompt", "简短回答。"],
     ["the chat template of '{model}' fails on the prompt '", "TemplateError: System role not supported"]),
    ("ppo_end_of_turn_is_no_eos", "ppo", CHATML, False, ["--chat_template", "true"],
     ["the chat template of '{model}' ends assistant turns with '<|im_end|>'",
      "nor in eos_token_id of {model}/generation_config.json"]),
    ("sft_chat_template_with_a_text_template", "sft", CHATML, True,
     ["--chat_template", "true", "--prompt_template", "Q: {question}\nA: "],
     ["chat_template: true renders turns with the tokenizer's chat template; remove prompt_template"]),
    ("ppo_system_prompt_without_chat_template", "ppo", None, False, ["--system_prompt", "简短回答。"],
     ["system_prompt needs chat_template: true"]),
]


@pytest.mark.parametrize("name, stage, template, eos_list, extra, fragments", CHAT_CASES,
                         ids=[c[0] for c in CHAT_CASES])
def test_bad_chat_template(assets, tmp_path, capsys, name, stage, template, eos_list, extra, fragments):
    model = assets["base_model"]
    if template is not None:
        model = with_chat_template(assets["base_model"], tmp_path / "model", eos_list, template)
    out = tmp_path / "out"
    if stage == "ppo":
        argv = ppo_argv(assets, out, assets["prompts"], *extra, model=model)
    else:
        argv = (sft_argv if stage == "sft" else rm_argv)(assets, out, assets[stage], "--model_name_or_path", model,
                                                         *extra)
    before = tree_hashes(tmp_path)
    expect_one_line(stage, argv, capsys, [f.replace("{model}", model) for f in fragments])
    assert not out.exists() and tree_hashes(tmp_path) == before


# ------------------------------------------------------------------------------------------------------------------
# rlhf-trl eval: over a finished PPO run, which must stay byte-identical
# ------------------------------------------------------------------------------------------------------------------
def eval_argv(assets, sft_run, rm_run, out, *extra):
    return ["--config", f"{RECIPES}/ppo.yaml", "--dataset_name", assets["prompts"], "--sft_model_path",
            sft_run["merged"], "--reward_model_path", rm_run["merged"], "--output_dir", str(out), *extra]


# (name, extra args, fragments; "{tmp}": the test's directory)
EVAL_CASES = [
    ("missing_ppo_run", ["--output_dir", "{tmp}/no_run"],
     ["PPO policy not found at '{tmp}/no_run/merged'; run `make ppo RECIPE=" + f"{RECIPES}/ppo.yaml` first"]),
    ("missing_sft_model", ["--sft_model_path", "{tmp}/sft/merged"],
     ["SFT model not found at '{tmp}/sft/merged'; run `make sft RECIPE=" + f"{RECIPES}/sft.yaml` first"]),
    ("missing_reward_model", ["--reward_model_path", "{tmp}/rm/merged"],
     ["reward model not found at '{tmp}/rm/merged'; run `make rm RECIPE=" + f"{RECIPES}/rm.yaml` first"]),
    ("num_prompts_not_a_number", ["--num_prompts", "many"],
     ["command line: argument --num_prompts: invalid int value: 'many'"]),
    ("num_prompts_zero", ["--num_prompts", "0"], ["num_prompts must be >= 1 (or unset: every held-out prompt), got 0"]),
    ("num_prompts_negative", ["--num_prompts", "-3"], ["num_prompts must be >= 1", "got -3"]),
    ("samples_per_prompt_zero", ["--samples_per_prompt", "0"], ["samples_per_prompt must be >= 1, got 0"]),
    ("bad_prompt_file", ["--dataset_name", "{tmp}/prompts.jsonl"],
     ["{tmp}/prompts.jsonl, row 1, field 'instruction': is null or missing in this row"]),
    ("prompt_file_missing", ["--dataset_name", "{tmp}/nope.jsonl"], ["{tmp}/nope.jsonl: file not found"]),
    ("recipe_not_found", ["--config", "{tmp}/nope.yaml"], ["recipe not found: {tmp}/nope.yaml"]),
    ("unknown_argument", ["--num_promts", "3"],
     ["command line: unknown argument(s) ['--num_promts', '3']; check the spelling against --help"]),
    ("bad_recipe_value", ["--temperature", "warm"], ["command line: argument --temperature: invalid float value"]),
]


@pytest.mark.slow  # needs finished runs of the stages or a real process
@pytest.mark.parametrize("name, extra, fragments", EVAL_CASES, ids=[c[0] for c in EVAL_CASES])
def test_bad_eval_input(assets, sft_run, rm_run, finished_ppo, tmp_path, capsys, name, extra, fragments):
    write_jsonl(tmp_path / "prompts.jsonl", [Q, {"topic": "咖啡"}])
    def fill(text):
        return text.replace("{tmp}", str(tmp_path))

    before = tree_hashes(tmp_path)
    expect_one_line("eval", eval_argv(assets, sft_run, rm_run, finished_ppo, *map(fill, extra)), capsys,
                    [fill(f) for f in fragments])
    assert tree_hashes(tmp_path) == before  # no eval.json / report.md in the run, nothing else created


# ------------------------------------------------------------------------------------------------------------------
# rlhf-trl merge: a copy of the RM stage's LoRA adapter, its base a copy of the tiny base model
# ------------------------------------------------------------------------------------------------------------------
def edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del data[key]
    path.write_text(json.dumps(data))


# (name, extra args after --adapter, setup(adapter, base, tmp), fragments; "{adapter}", "{base}", "{tmp}" filled in)
MERGE_CASES = [
    ("adapter_missing", ["--adapter", "{tmp}/none", "--output", "{tmp}/out"], None,
     ["--adapter: no LoRA adapter at '{tmp}/none' (directory not found)"]),
    ("not_an_adapter", ["--adapter", "{base}", "--output", "{tmp}/out"], None,
     ["--adapter: '{base}' is a model directory, not a LoRA adapter (no adapter_config.json)"]),
    ("adapter_weights_missing", ["--output", "{tmp}/out"], lambda a, b, t: os.remove(a / "adapter_model.safetensors"),
     ["--adapter: '{adapter}' holds no adapter weights (adapter_model.safetensors or adapter_model.bin)"]),
    ("adapter_config_not_json", ["--output", "{tmp}/out"],
     lambda a, b, t: (a / "adapter_config.json").write_text("{\"r\": 16,"),
     ["{adapter}/adapter_config.json: not valid JSON: "]),
    ("unsupported_task_type", ["--output", "{tmp}/out"],
     lambda a, b, t: edit_json(a / "adapter_config.json", task_type="TOKEN_CLS"),
     ["{adapter}: adapter task_type 'TOKEN_CLS' is not supported; expected one of ['CAUSAL_LM', 'SEQ_CLS']"]),
    ("not_lora", ["--output", "{tmp}/out"], lambda a, b, t: edit_json(a / "adapter_config.json", peft_type="IA3"),
     ["{adapter}: peft_type 'IA3' is not a LoRA adapter"]),
    ("no_base_named", ["--output", "{tmp}/out"],
     lambda a, b, t: edit_json(a / "adapter_config.json", base_model_name_or_path=None),
     ["{adapter}/adapter_config.json names no base_model_name_or_path; pass --base DIR"]),
    ("base_in_config_missing", ["--output", "{tmp}/out"],
     lambda a, b, t: edit_json(a / "adapter_config.json", base_model_name_or_path=str(t / "gone")),
     ["base model (base_model_name_or_path of {adapter}/adapter_config.json) not found at '{tmp}/gone'"]),
    ("base_option_missing", ["--output", "{tmp}/out", "--base", "{tmp}/gone"], None,
     ["base model (--base) not found at '{tmp}/gone'"]),
    ("output_is_the_adapter", ["--output", "{adapter}"], None,
     ["--output '{adapter}' is the adapter directory '{adapter}'; merging replaces --output"]),
    ("output_holds_the_adapter", ["--output", "{tmp}"], None,
     ["--output '{tmp}' holds the adapter directory '{adapter}'"]),
    ("output_is_the_base", ["--output", "{base}"], None,
     ["--output '{base}' is the base model directory '{base}'"]),
    ("output_holds_other_files", ["--output", "{tmp}/notes"],
     lambda a, b, t: (t / "notes").mkdir() or (t / "notes" / "todo.txt").write_text("keep me\n"),
     ["--output '{tmp}/notes' holds files and no model (config.json); merging replaces --output"]),
    ("output_missing", [], None, ["command line: the following arguments are required: --output"]),
    ("bad_dtype", ["--output", "{tmp}/out", "--dtype", "float8"],
     None, ["command line: argument --dtype: invalid choice: 'float8'"]),
]


@pytest.mark.slow  # needs finished runs of the stages or a real process
@pytest.mark.parametrize("name, extra, setup, fragments", MERGE_CASES, ids=[c[0] for c in MERGE_CASES])
def test_bad_merge_input(assets, rm_run, tmp_path, capsys, name, extra, setup, fragments):
    adapter, base = tmp_path / "adapter", tmp_path / "base"
    shutil.copytree(os.path.join(rm_run["output_dir"], "adapter"), adapter)
    shutil.copytree(assets["base_model"], base)
    edit_json(adapter / "adapter_config.json", base_model_name_or_path=str(base))
    if setup is not None:
        setup(adapter, base, tmp_path)
    sub = {"{adapter}": str(adapter), "{base}": str(base), "{tmp}": str(tmp_path)}

    def fill(text):
        for key, value in sub.items():
            text = text.replace(key, value)
        return text

    argv = [fill(a) for a in extra]
    if "--adapter" not in argv:
        argv = ["--adapter", str(adapter), *argv]
    before = tree_hashes(tmp_path)
    expect_one_line("merge", argv, capsys, [fill(f) for f in fragments])
    assert tree_hashes(tmp_path) == before  # no output, and the adapter and base untouched


def tiny_adapter(base: str, path) -> str:
    """A LoRA adapter (CAUSAL_LM, a non-zero update) on the tiny base model ``base``, saved to ``path``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(
        task_type="CAUSAL_LM", r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model.save_pretrained(str(path))
    return str(path)


def earlier_merge(base: str, path):
    """An earlier merged model at ``path`` (a model directory, so `check_output` accepts it) with a file of its own."""
    shutil.copytree(base, path)
    (path / "earlier.txt").write_text("a file of the earlier merge only\n")


def merge_counted(adapter: str, out, monkeypatch, fault=None, log=None):
    """`merge_adapter` with `faults` (tests/fault_hooks) counting its file operations as one save: ``fault`` is ``"<op>:<action>"``
    (RLHF_TRL_FAULT of save 1), ``log`` the RLHF_TRL_FAULT_LOG file."""
    import faults
    from rlhf_trl.merge import merge_adapter

    with monkeypatch.context() as m:
        for name, value in ((faults.FAULT_ENV, fault and f"1:{fault}"), (faults.FAULT_LOG_ENV, log)):
            if value:
                m.setenv(name, str(value))
            else:
                m.delenv(name, raising=False)
        faults.reset()
        try:
            with faults.checkpoint_save():
                merge_adapter(adapter, str(out))
        finally:
            faults.reset()


def merge_ops(assets, adapter, tmp_path, monkeypatch) -> list[tuple[int, str, str]]:
    """``(op, kind, path)`` of every counted file operation of a merge over an earlier merged model (a scratch one)."""
    scratch, log = tmp_path / "scratch", tmp_path / "scratch-ops.log"
    earlier_merge(assets["base_model"], scratch / "merged")
    merge_counted(adapter, scratch / "merged", monkeypatch, log=log)
    ops = [line.split(" ", 4) for line in log.read_text().splitlines()]
    shutil.rmtree(scratch)
    log.unlink()
    return [(int(op), kind, path) for _rank, _save, op, kind, path in ops]


def test_merge_replaces_an_earlier_merged_model_only_once_the_new_one_is_complete(assets, tmp_path, monkeypatch):
    """The refusals above leave the ordinary re-run alone: an --output holding an earlier merged model is accepted,
    as is a new directory, and the earlier model is replaced atomically. A write that fails anywhere in the new model
    (ENOSPC injected by `faults` (tests/fault_hooks) at each file write of the merge: config, weights, tokenizer) fails the merge
    with that error and leaves the earlier model byte-identical and no staging directory behind; the merge that then
    succeeds replaces the earlier model whole (the same files and bytes as a merge into a new directory)."""
    import errno

    adapter = tiny_adapter(assets["base_model"], tmp_path / "adapter")
    new = tmp_path / "new"
    merge_counted(adapter, new, monkeypatch)  # a new directory
    complete = tree_hashes(new)
    assert {"config.json", "model.safetensors", "tokenizer_config.json", "README.md"} <= set(os.listdir(new))

    ops = merge_ops(assets, adapter, tmp_path, monkeypatch)
    kinds = [kind for _op, kind, _path in ops]
    publishing = kinds.index("fsync")  # publishing the new model starts here (`atomic.publish`)
    writes = ops[:publishing]
    assert {kind for _op, kind, _path in writes} == {"write"}
    assert {"config.json", "model.safetensors", "tokenizer_config.json",
            "README.md.tmp"} <= {os.path.basename(p) for *_, p in writes}

    out = tmp_path / "merged"
    earlier_merge(assets["base_model"], out)
    before = tree_hashes(tmp_path)  # the earlier model, its parent's listing (no staging directory) and the rest
    for op, _kind, path in writes:
        with pytest.raises(OSError) as exc:
            merge_counted(adapter, out, monkeypatch, fault=f"{op}:enospc")
        assert exc.value.errno == errno.ENOSPC and os.path.basename(exc.value.filename) == os.path.basename(path)
        assert exc.value.filename.startswith(str(tmp_path / ".merged.tmp-")), exc.value  # written while staged
        assert tree_hashes(tmp_path) == before, f"a failed write of {os.path.basename(path)} (op {op})"

    merge_counted(adapter, out, monkeypatch)
    assert tree_hashes(out) == complete  # replaced whole: the earlier model's own file is gone
    assert sorted(os.listdir(tmp_path)) == ["adapter", "merged", "new"]  # no staging, no set-aside copy


def test_merge_failing_while_publishing_keeps_the_earlier_merged_model(assets, tmp_path, monkeypatch):
    """The same for the rest of the merge: a failure (ENOSPC) at an fsync of the new model, the rename that sets the
    earlier model aside, the rename that publishes the new one, or the write of its README.md (written inside the
    staged directory) leaves the earlier model byte-identical at --output and nothing else behind."""
    adapter = tiny_adapter(assets["base_model"], tmp_path / "adapter")
    ops = merge_ops(assets, adapter, tmp_path, monkeypatch)
    kinds = [kind for _op, kind, _path in ops]
    first_fsync = kinds.index("fsync")
    publishing = next(i for i, (_op, kind, path) in enumerate(ops) if kind == "rename" and path.endswith("/merged"))
    points = ops[first_fsync:publishing + 1] + [o for o in ops if o[2].endswith("/README.md.tmp")]
    assert {"fsync", "rename", "write"} <= {kind for _op, kind, _path in points} and len(points) >= 4
    out = tmp_path / "merged"
    earlier_merge(assets["base_model"], out)
    before = tree_hashes(tmp_path)
    failed = []
    for op, kind, path in points:
        with pytest.raises(OSError):
            merge_counted(adapter, out, monkeypatch, fault=f"{op}:enospc")
        if tree_hashes(tmp_path) != before:
            held = sorted(os.listdir(out)) if out.exists() else "nothing"
            failed.append(f"{kind} {os.path.basename(path)}: left {sorted(os.listdir(tmp_path))}, merged/ holds {held}")
        for name in os.listdir(tmp_path):  # put the earlier model back for the next point
            if name.startswith(".merged"):
                shutil.rmtree(tmp_path / name)
        shutil.rmtree(out, ignore_errors=True)
        earlier_merge(assets["base_model"], out)
    assert not failed, "\n".join(failed)


# ------------------------------------------------------------------------------------------------------------------
# one case per command through a real process
# ------------------------------------------------------------------------------------------------------------------
def real_process_case(command, assets, tmp_path):
    """(argv after the command, the expected error line) of a cheap bad input to ``command``."""
    if command == "rm":
        data = tmp_path / "pairs.jsonl"
        data.write_text('{"prompt": "q", "chosen": "a", "rejected": "b"}\n{"prompt": "q", "chosen": \n')
        return (rm_argv(assets, tmp_path / "out", data),
                f"rlhf-trl rm: error: {data}, row 1: cannot be read as json: line 2 is not valid JSON (Expecting value "
                "at column 27)")
    if command == "ppo":
        return (ppo_argv(assets, tmp_path / "out", assets["prompts"], "--reward_funcs", "no_such_module_xyz:score"),
                "rlhf-trl ppo: error: reward_funcs[0] 'no_such_module_xyz:score': cannot import module "
                "'no_such_module_xyz': ModuleNotFoundError: No module named 'no_such_module_xyz'")
    if command == "eval":
        model = assets["base_model"]
        return (["--config", f"{RECIPES}/ppo.yaml", "--dataset_name", assets["prompts"], "--sft_model_path", model,
                 "--reward_model_path", reward_stand_in(assets), "--output_dir", str(tmp_path / "out")],
                f"rlhf-trl eval: error: PPO policy not found at '{tmp_path / 'out' / 'merged'}'; run `make ppo "
                f"RECIPE={RECIPES}/ppo.yaml` first")
    adapter = tmp_path / "adapter"  # merge: an adapter asked to be its own output
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({
        "task_type": "CAUSAL_LM", "peft_type": "LORA", "base_model_name_or_path": assets["base_model"]}))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    return (["--adapter", str(adapter), "--output", str(adapter)],
            f"rlhf-trl merge: error: --output '{adapter}' is the adapter directory '{adapter}'; merging replaces "
            "--output, so choose a new directory")


@pytest.mark.slow  # needs finished runs of the stages or a real process
@pytest.mark.parametrize("command", ["rm", "ppo", "eval", "merge"])
def test_every_command_in_a_real_process(assets, tmp_path, command):
    argv, expected = real_process_case(command, assets, tmp_path)
    before = tree_hashes(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "rlhf_trl", command, *argv], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "usage:" not in proc.stderr
    assert [line for line in proc.stderr.splitlines() if line.startswith("rlhf-trl")] == [expected], proc.stderr[-2000:]
    assert tree_hashes(tmp_path) == before


REMOVED_PPO_KEYS = ["onednn_decoding", "rollout_sampler", "fused_lora", "fused_kernels", "malloc_mmap_threshold",
                    "tensor_cache", "tensor_cache_headroom_mb"]


@pytest.mark.parametrize("key", REMOVED_PPO_KEYS)
def test_a_recipe_with_a_removed_cpu_key_fails_with_one_line(tmp_path, key):
    """The engine's CPU-only memory and speed measures are gone: an old recipe that still sets one of their keys stops at parsing
    with the usual unknown-key line, before anything is read or written."""
    from rlhf_trl.config import RecipeError, parse_recipe
    from rlhf_trl.ppo import recipe_types

    recipe = tmp_path / "ppo.yaml"
    recipe.write_text(open(f"{RECIPES}/ppo.yaml", encoding="utf-8").read() + f"{key}: 1\n", encoding="utf-8")
    with pytest.raises(RecipeError) as err:
        parse_recipe(recipe_types(), ["--config", str(recipe)], "ppo")
    assert str(err.value).startswith(f"{recipe}: unknown key(s) ['{key}']; ")  # a close key suggested, or --help


def test_commands_without_a_recipe_say_so_in_one_line(tmp_path, capsys):
    """No --config: a value the stage refuses names the missing recipe; eval without one names the unset model."""
    expect_one_line("ppo", ["--output_dir", str(tmp_path / "p"), "--use_cpu", "true", "--ptx_coef", "0.5"], capsys,
                    ["command line: ptx_coef is set without ptx_dataset",
                     "(no recipe was given: pass --config recipes/<run>/<stage>.yaml)"])
    expect_one_line("eval", ["--output_dir", str(tmp_path / "e"), "--use_cpu", "true"], capsys,
                    ["SFT model: no path is set; name it in the recipe (--config RECIPE.yaml) or with --key DIR"])


def test_recipe_keys_are_read_as_written(assets, tmp_path, capsys):
    """A misspelled override is not an abbreviation of a key; `--config=PATH` is a recipe; an infinite rate, a
    number for a number field (no "quote it"), and PPO's unread model_name_or_path are one line each."""
    base = sft_argv(assets, tmp_path / "s", assets["sft"])
    expect_one_line("sft", base + ["--learning_rat", "0.1"], capsys,
                    ["command line: unknown argument(s) ['--learning_rat', '0.1']", "did you mean '--learning_rate'?"])
    expect_one_line("sft", [f"--config={RECIPES}/sft.yaml", *base[2:], "--learning_rate", "inf"], capsys,
                    ["command line: learning_rate must be a finite number, got inf"])
    recipe = tmp_path / "sft.yaml"
    recipe.write_text(open(f"{RECIPES}/sft.yaml", encoding="utf-8").read() + "\nmax_steps: 2.5\n")
    line = expect_one_line("sft", ["--config", str(recipe), *base[2:]], capsys, ["max_steps must be an integer"])
    assert "quote it" not in line
    expect_one_line("ppo", ["--config", f"{RECIPES}/ppo.yaml", "--model_name_or_path", assets["base_model"],
                            "--output_dir", str(tmp_path / "p")], capsys,
                    ["model_name_or_path (", ") is not read by ppo: the policy starts from sft_model_path"])


def test_a_checkpoint_resumes_with_its_own_stage_only(assets, sft_run, tmp_path, capsys):
    """An unfinished SFT run's checkpoint is not resumed by DPO pointed at the same output_dir (it would load SFT's
    optimizer and step count into a DPO run): one line naming both stages, the checkpoint left as it is."""
    from conftest import crash_after

    from rlhf_trl import sft

    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        sft.main(sft_argv(assets, out, assets["sft"], "--max_steps", "2", "--save_strategy", "steps", "--save_steps",
                          "1"), callbacks=[crash_after(1)])
    before = sorted(os.listdir(out / "checkpoint-1"))
    expect_one_line("dpo", ["--config", f"{RECIPES}/dpo.yaml", "--dataset_name", assets["rm"], "--model_name_or_path",
                            sft_run["merged"], "--output_dir", str(out), "--resume_from_checkpoint", "true"], capsys,
                    [f"{out / 'checkpoint-1'} is a checkpoint of another stage (SFTConfig, not DPOConfig); resume it "
                     "with that stage, or choose another output_dir for this one"])
    assert sorted(os.listdir(out / "checkpoint-1")) == before


"""Malformed input: a non-zero exit, one clear line naming the file (and row and field for data), no traceback,
and no output directory left behind. Each case runs the CLI's stage entry point in-process."""

import json
import os
import subprocess
import sys

import pytest
from conftest import RECIPES, write_jsonl

from rlhf_trl.cli import run_stage


def run_cli(stage, argv, capsys):
    """Run the CLI entry point; return the exit status and the lines it printed about the failure."""
    with pytest.raises(SystemExit) as exc:
        run_stage(stage, argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return exc.value.code, [line for line in err.splitlines() if line.startswith("rlhf-trl")]


def sft_argv(assets, out, data, *extra):
    return ["--config", f"{RECIPES}/sft.yaml", "--dataset_name", str(data), "--model_name_or_path",
            assets["base_model"], "--output_dir", str(out), *extra]


def rm_argv(assets, out, data, *extra):
    return ["--config", f"{RECIPES}/rm.yaml", "--dataset_name", str(data), "--model_name_or_path",
            assets["base_model"], "--output_dir", str(out), "--dataset_format", "auto", *extra]


GOOD = {"instruction": "你觉得咖啡怎么样？", "input": "", "output": "咖啡很棒，我很喜欢。"}

# (name, stage, rows or raw text, file suffix, extra args, expected fragments of the one error line)
DATA_CASES = [
    ("broken_json_line", "sft", '{"instruction": "q", "output": "a"}\n{"instruction": "q", "output": \n', "jsonl", [],
     ["bad.jsonl", "cannot be read"]),
    ("broken_json_file", "sft", '[{"instruction": "q", "output": "a"},', "json", [], ["bad.json", "cannot be read"]),
    ("missing_mapped_column", "sft", [GOOD, GOOD], "jsonl", ["--answer_key", "reply"],
     ["row 0", "field 'reply'", "missing column"]),
    ("null_field", "sft", [GOOD, {**GOOD, "output": None}], "jsonl", [], ["row 1", "field 'output'", "null"]),
    ("empty_field", "sft", [GOOD, {**GOOD, "output": ""}], "jsonl", [], ["row 1", "field 'output'", "empty"]),
    ("whitespace_field", "sft", [GOOD, {**GOOD, "instruction": "  \n "}], "jsonl", [],
     ["row 1", "field 'instruction'", "empty"]),
    ("non_string_field", "sft", [GOOD, {**GOOD, "output": 42}], "jsonl", [], ["row 1", "field 'output'", "string"]),
    ("non_string_question", "sft", [GOOD, {**GOOD, "instruction": ["a"]}], "jsonl", [],
     ["row 1", "field 'instruction'", "string"]),
    ("mixed_formats", "sft", [GOOD, {"instruction": "q", "output": ["a", "b"]}], "jsonl", ["--dataset_format", "auto"],
     ["row 1", "mixed formats"]),
    ("empty_file", "sft", "", "jsonl", [], ["bad.jsonl"]),
    ("empty_json_list", "sft", "[]", "json", [], ["bad.json"]),
    ("unsupported_extension", "sft", "hello", "txt", [], ["bad.txt", "unsupported file type"]),
    ("sharegpt_ends_with_user", "sft", [{"conversations": [{"from": "human", "value": "q"}]}], "jsonl",
     ["--dataset_format", "sharegpt"],
     ["row 0", "field 'conversations'", "assistant"]),
    ("sharegpt_turn_without_value", "sft",
     [{"conversations": [{"from": "human"}, {"from": "gpt", "value": "a"}]}], "jsonl", ["--dataset_format", "sharegpt"],
     ["row 0", "field 'conversations'", "turn 0"]),
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


@pytest.mark.parametrize("name, stage, rows, suffix, extra, fragments", DATA_CASES, ids=[c[0] for c in DATA_CASES])
def test_bad_data(assets, tmp_path, capsys, name, stage, rows, suffix, extra, fragments):
    data = tmp_path / f"bad.{suffix}"
    if isinstance(rows, str):
        data.write_text(rows, encoding="utf-8")
    else:
        write_jsonl(data, rows)
    out = tmp_path / "out"
    argv = (sft_argv if stage == "sft" else rm_argv)(assets, out, data, *extra)
    code, err = run_cli(stage, argv, capsys)
    assert code == 2
    assert len(err) == 1 and err[0].startswith(f"rlhf-trl {stage}: error: "), err
    for fragment in fragments:
        assert fragment in err[0], (fragment, err[0])
    assert not out.exists()


def write_recipe(tmp_path, text):
    path = tmp_path / "recipe.yaml"
    path.write_text(text, encoding="utf-8")
    return str(path)


RECIPE_CASES = [
    ("unknown_key", "dataset_name: x.jsonl\nlearning_rte: 0.1\n", [], ["recipe.yaml", "unknown key", "learning_rte"]),
    ("wrong_value_type", "learning_rate: fast\n", [], ["recipe.yaml"]),
    ("not_a_mapping", "- a\n- b\n", [], ["recipe.yaml", "mapping"]),
    ("invalid_yaml", "a: [1, 2\n", [], ["recipe.yaml", "YAML"]),
    ("missing_dataset", "seed: 3\n", [], ["names no data"]),
    ("bad_format_value", "dataset_format: xml\n", [], ["dataset_format"]),
    ("bad_ranked_pairs", "ranked_pairs: some\n", [], ["ranked_pairs"]),
    ("bad_length_policy", "length_policy: squeeze\n", [], ["length_policy"]),
    ("bad_template", "prompt_template: 'Q: {q}'\n", [], ["prompt_template", "{question}"]),
]


@pytest.mark.parametrize("name, text, extra, fragments", RECIPE_CASES, ids=[c[0] for c in RECIPE_CASES])
def test_bad_recipe(assets, tmp_path, capsys, name, text, extra, fragments):
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
    code, err = run_cli(stage, ["--config", write_recipe(tmp_path, head + text), *extra], capsys)
    assert code == 2 and len(err) == 1
    line = err[0]
    assert line.startswith(f"rlhf-trl {stage}: error: ")
    for fragment in fragments:
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


def test_too_few_eval_prompts(assets, tmp_path, capsys, sft_run, rm_run):
    argv = ["--config", f"{RECIPES}/ppo.yaml", "--dataset_name", assets["prompts"], "--sft_model_path",
            sft_run["merged"], "--reward_model_path", rm_run["merged"], "--output_dir", str(tmp_path / "out"),
            "--eval_split_size", "2"]
    code, err = run_cli("ppo", argv, capsys)
    assert code == 2 and "eval prompts" in err[0] and "per_device_eval_batch_size" in err[0]


def test_bad_reward_baseline(assets, tmp_path, capsys, sft_run, rm_run):
    argv = ["--config", f"{RECIPES}/ppo.yaml", "--dataset_name", assets["prompts"], "--sft_model_path",
            sft_run["merged"], "--reward_model_path", rm_run["merged"], "--output_dir", str(tmp_path / "out"),
            "--reward_baseline", "high"]
    code, err = run_cli("ppo", argv, capsys)
    assert code == 2 and "reward_baseline must be a number or 'auto'" in err[0]


def test_the_real_command_prints_no_traceback(assets, tmp_path):
    """The same through a real process: exit status 2, one line on stderr."""
    data = write_jsonl(tmp_path / "bad.jsonl", [GOOD, {**GOOD, "output": None}])
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf_trl", "sft", *sft_argv(assets, tmp_path / "out", data)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if "rlhf-trl sft" in line]
    assert lines == [f"rlhf-trl sft: error: {data}, row 1, field 'output': is null or missing in this row"]
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
                                    "check the spelling against --help")
    assert not (tmp_path / "out").exists()


def test_stage_help_names_the_command_and_the_recipe_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        run_stage("ppo", ["--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    assert out.startswith("usage: rlhf-trl ppo --config RECIPE.yaml") and "--share_reward_value_base" in out

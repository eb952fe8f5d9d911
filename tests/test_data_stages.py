"""The new data shapes through the real stages (tiny demo model): SFT on OpenAI ``messages`` rows, RM on
Human/Assistant implicit-prompt pairs and PPO on list-of-turns prompts, all compressed and in chat-template mode; the
one-line CLI errors; the recipe keys in ``--help``."""

import gzip
import json
import os

import pytest
from conftest import CHATML, RECIPES, with_chat_template

from rlhf_trl import demo_task
from rlhf_trl.cli import run_stage

def write_gz(path, rows):
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return str(path)


def run_cli_error(stage, argv, capsys):
    with pytest.raises(SystemExit) as exc:
        run_stage(stage, argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return exc.value.code, [line for line in err.splitlines() if line.startswith("rlhf-trl")]


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat_data")
    sft = [{"messages": [{"role": "system", "content": "简短回答。"},
                         {"role": "user", "content": r["instruction"]},
                         {"role": "assistant", "content": r["output"]}]} for r in demo_task.sft_rows(200, seed=1)]
    pairs = []
    for r in demo_task.pair_rows(120, seed=2):
        prompt = f"\n\nHuman: {r['prompt']}\n\nAssistant:"
        pairs.append({"chosen": f"{prompt} {r['chosen']}", "rejected": f"{prompt} {r['rejected']}"})
    prompts = [{"prompt": [r["instruction"], "再说一遍。"]}
               for r in demo_task.prompt_rows(demo_task.TRAIN_TOPICS, seed=3)]
    return {"sft": write_gz(d / "sft.jsonl.gz", sft), "rm": write_gz(d / "hh.jsonl.gz", pairs),
            "prompts": write_gz(d / "prompts.jsonl.gz", prompts[:64])}


def test_chat_template_whose_end_of_turn_is_no_eos_fails_in_one_line(assets, chat_files, tmp_path, capsys):
    model = with_chat_template(assets["base_model"], tmp_path / "model", eos_list=False)
    argv = ["--config", f"{RECIPES}/sft.yaml", "--dataset_name", chat_files["sft"], "--dataset_format", "auto",
            "--chat_template", "true", "--model_name_or_path", model, "--output_dir", str(tmp_path / "out")]
    code, lines = run_cli_error("sft", argv, capsys)
    assert code == 2 and len(lines) == 1
    assert lines[0].startswith(f"rlhf-trl sft: error: the chat template of '{model}' ends assistant turns with "
                               "'<|im_end|>' (id ")
    assert f"nor in eos_token_id of {model}/generation_config.json" in lines[0]


@pytest.mark.slow  # all three stages (~8 s)
def test_chat_mode_through_sft_rm_and_ppo(assets, chat_files, tmp_path):
    from transformers import AutoTokenizer

    from rlhf_trl import ppo, rm, sft

    model = with_chat_template(assets["base_model"], tmp_path / "model", eos_list=True)
    tok = AutoTokenizer.from_pretrained(model)
    im_start, im_end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    sft_out = sft.main([
        "--config", f"{RECIPES}/sft.yaml", "--dataset_name", chat_files["sft"], "--dataset_format", "auto",
        "--chat_template", "true", "--model_name_or_path", model, "--output_dir", str(tmp_path / "sft"),
        "--max_steps", "4", "--logging_steps", "2",
    ])
    assert AutoTokenizer.from_pretrained(sft_out["merged"]).chat_template == CHATML  # saved with the SFT model
    rm_out = rm.main([
        "--config", f"{RECIPES}/rm.yaml", "--dataset_name", chat_files["rm"], "--dataset_format", "auto",
        "--chat_template", "true", "--system_prompt", "简短回答。", "--model_name_or_path", sft_out["merged"],
        "--output_dir", str(tmp_path / "rm"), "--max_steps", "4", "--max_length", "96",
    ])
    with open(os.path.join(rm_out["output_dir"], "eval_pairs.jsonl")) as f:
        pairs = [json.loads(line) for line in f]
    assert pairs and all(p["chosen_ids"][-1] == im_end and p["rejected_ids"][-1] == im_end for p in pairs)
    first = pairs[0]
    prompt = first["chosen_ids"][: first["prompt_length"]]
    assert prompt[0] == im_start and tok.decode(prompt).startswith("<|im_start|>system\n简短回答。<|im_end|>\n"
                                                                   "<|im_start|>user\n")
    assert tok.decode(prompt).endswith("<|im_end|>\n<|im_start|>assistant\n")
    ppo_out = ppo.main([
        "--config", f"{RECIPES}/ppo.yaml", "--dataset_name", chat_files["prompts"], "--dataset_format", "auto",
        "--chat_template", "true", "--sft_model_path", sft_out["merged"], "--reward_model_path", rm_out["merged"],
        "--output_dir", str(tmp_path / "ppo"), "--total_episodes", "32", "--logging_steps", "1",
        "--log_samples_every", "1", "--max_prompt_length", "64",
    ])
    rows = [json.loads(x) for x in (tmp_path / "ppo" / "samples.jsonl").read_text(encoding="utf-8").splitlines()]
    assert rows and all("再说一遍" not in r["query"] for r in rows)  # PPO prompts take the first turn
    assert ppo_out["output_dir"] == str(tmp_path / "ppo")


def test_implicit_pairs_without_a_shared_marker_fail_in_one_line(assets, tmp_path, capsys):
    good = {"chosen": "\n\nHuman: q\n\nAssistant: a", "rejected": "\n\nHuman: q\n\nAssistant: b"}
    data = write_gz(tmp_path / "bad.jsonl.gz", [good, {"chosen": "User: q Bot: a", "rejected": "User: q Bot: b"}])
    argv = ["--config", f"{RECIPES}/rm.yaml", "--dataset_name", data, "--dataset_format", "auto",
            "--model_name_or_path", assets["base_model"], "--output_dir", str(tmp_path / "out")]
    code, lines = run_cli_error("rm", argv, capsys)
    assert code == 2
    assert lines == [f"rlhf-trl rm: error: {data}, row 1, field 'chosen/rejected': chosen and rejected share no prefix "
                     "ending in the assistant marker '\\n\\nAssistant:' (set human_marker / assistant_marker); fix the "
                     "row, or set on_bad_row: skip to skip such rows"]
    assert not os.path.exists(tmp_path / "out" / "merged")


def test_offline_hub_dataset_fails_in_one_line(assets, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    argv = ["--config", f"{RECIPES}/sft.yaml", "--dataset_name", "Anthropic/hh-rlhf", "--dataset_format", "auto",
            "--model_name_or_path", assets["base_model"], "--output_dir", str(tmp_path / "out")]
    code, lines = run_cli_error("sft", argv, capsys)
    assert code == 2 and len(lines) == 1 and "HF_HUB_OFFLINE=1 forbids downloading it" in lines[0]


def test_recipe_yaml_takes_a_list_of_files(assets, chat_files, tmp_path):
    from rlhf_trl.config import parse_recipe
    from rlhf_trl.data import DataArguments, read_records

    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"dataset_name: [{chat_files['prompts']}, {chat_files['prompts']}]\nprompt_turn: 1\n"
                      "chat_template: true\nsystem_prompt: hi\n")
    args = parse_recipe((DataArguments,), ["--config", str(recipe)]).data
    assert args.dataset_name == [chat_files["prompts"]] * 2 and args.chat_template and args.system_prompt == "hi"
    records = read_records(args, "prompts")
    assert len(records) == 128 and {r["question"] for r in records} == {"再说一遍。"}


def test_help_lists_the_data_keys(capsys):
    with pytest.raises(SystemExit):
        run_stage("sft", ["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for key in ("--chat_template", "--system_prompt", "--human_marker", "--assistant_marker", "--messages_key",
                "--prompt_turn", "--dataset_config", "--length_policy"):
        assert key in out, key
    assert "Render prompts with the tokenizer's chat template" in out
    assert "a directory of shards, a YAML list of these, or a hub dataset id" in out

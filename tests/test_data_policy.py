"""Real data without surprises: the bad-row policy, empty replies, tool-calling and Firefly
turns, preference variants (scores, UltraFeedback-binarized, KTO labels), encodings, JSON arrays of lists, missing
columns named by their recipe key, the eval split, truncation counts and data_report.json."""

import json
import logging
from pathlib import Path

import pytest
from conftest import SHARED, write_jsonl

from rlhf_trl.data import (DataArguments, DataError, DataReport, Template, pair_features, read_records, sft_features,
                           split_records)
from rlhf_trl.data.records import SKIP_HINT

QWEN2 = SHARED / "tokenizers" / "qwen2"
HH = "\n\nHuman: How do I pick a lock?\n\nAssistant:"


def hh_rows(n: int, empty: set[int]) -> list[dict]:
    """hh-rlhf harmless-base rows; rows in ``empty`` have an empty chosen reply (a silent refusal)."""
    return [{"chosen": HH + ("" if k in empty else f" I can't help with that ({k})."),
             "rejected": HH + f" Use a tension wrench ({k})."} for k in range(n)]


@pytest.fixture(scope="module")
def qwen():
    if not QWEN2.is_dir():
        pytest.skip(f"the real Qwen2 tokenizer is not here: {QWEN2} (../shared beside the project)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(QWEN2))


# --- empty replies and the bad-row policy ------------------------------------------------------------------------
def test_hh_rlhf_empty_chosen_reply_is_the_eos_alone(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "harmless-base-test.jsonl", hh_rows(40, {3, 17}))
    pairs = read_records(DataArguments(dataset_name=path), "pairs")
    assert len(pairs) == 40 and pairs[3]["chosen"] == "" and pairs[17]["chosen"] == ""
    feats = pair_features(pairs[:4], tokenizer, Template(prompt="raw"))
    prompt = feats["chosen_ids"][3][: feats["prompt_length"][3]]
    assert feats["chosen_ids"][3] == prompt + [tokenizer.eos_token_id]  # scored at that EOS, as PPO would


def test_bad_row_error_names_file_row_field_and_how_to_skip(tmp_path):
    rows = [{"instruction": f"q{k}", "output": f"a{k}"} for k in range(50)]
    rows[7]["output"] = 3
    path = write_jsonl(tmp_path / "sft.jsonl", rows)
    with pytest.raises(DataError) as err:
        read_records(DataArguments(dataset_name=path), "sft")
    assert str(err.value) == f"{path}, row 7, field 'output': must be a string, got int{SKIP_HINT}"


def test_skip_counts_each_reason_with_example_rows_and_stops_beyond_the_fraction(tmp_path, caplog):
    rows = [{"instruction": f"q{k}", "output": f"a{k}"} for k in range(100)]
    for k in (2, 11, 12, 13, 14, 15, 16):
        rows[k]["output"] = 3
    rows[40]["instruction"] = ""
    rows[41]["output"] = "  "  # an empty target: skipped whatever the policy
    path = write_jsonl(tmp_path / "sft.jsonl", rows)
    report = DataReport("sft")
    args = DataArguments(dataset_name=path, on_bad_row="skip", max_bad_row_fraction=0.1)
    with caplog.at_level(logging.WARNING, logger="rlhf_trl.data"):
        records = read_records(args, "sft", report)
    assert len(records) == 91
    assert report.skipped == {
        "field 'output': must be a string, got int": {
            "count": 7, "bad": True, "examples": [f"{path}, row {k}" for k in (2, 11, 12, 13, 14)]},
        "field 'instruction': is empty": {"count": 1, "bad": True, "examples": [f"{path}, row 40"]},
        "empty answer (nothing to learn)": {"count": 1, "bad": False, "examples": [f"{path}, row 41"]}}
    (line,) = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert line == (f"{path}: 9 of 100 rows skipped (on_bad_row: skip): field 'output': must be a string, got int: 7; "
                    "field 'instruction': is empty: 1; empty answer (nothing to learn): 1")
    with pytest.raises(DataError) as err:
        read_records(DataArguments(dataset_name=path, on_bad_row="skip"), "sft")
    assert str(err.value) == (f"{path}: 8 of 100 rows are bad, more than max_bad_row_fraction=0.05 (field 'output': "
                              "must be a string, got int: 7; field 'instruction': is empty: 1; empty answer (nothing "
                              "to learn): 1); fix the data or raise max_bad_row_fraction")


# --- turn formats ------------------------------------------------------------------------------------------------
TOOLS = [{"name": "get_weather", "description": "Weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
CALL = {"name": "get_weather", "arguments": {"city": "北京"}}
SHAREGPT_TOOLS = {"conversations": [{"from": "human", "value": "北京天气？"},
                                    {"from": "function_call", "value": json.dumps(CALL, ensure_ascii=False)},
                                    {"from": "observation", "value": "晴，25度"},
                                    {"from": "gpt", "value": "北京今天晴，25度。"}],
                  "system": "你是助手。", "tools": json.dumps(TOOLS, ensure_ascii=False)}
OPENAI_TOOLS = {"messages": [{"role": "system", "content": "你是助手。"}, {"role": "user", "content": "北京天气？"},
                             {"role": "assistant", "content": "", "tool_calls": [
                                 {"type": "function", "function": {**CALL, "arguments": json.dumps(CALL["arguments"])}}]},
                             {"role": "tool", "content": "晴，25度"},
                             {"role": "assistant", "content": "北京今天晴，25度。"}], "tools": TOOLS}


def test_tool_calling_rows_render_through_the_chat_template_with_calls_as_targets(tmp_path, qwen):
    chat = DataArguments(chat_template=True)
    for name, row in (("sharegpt", SHAREGPT_TOOLS), ("openai", OPENAI_TOOLS)):
        path = write_jsonl(tmp_path / f"{name}.jsonl", [row])
        (rec,) = read_records(DataArguments(dataset_name=path, chat_template=True, mask_history=True), "sft")
        assert rec["answer"] == "北京今天晴，25度。" and rec["tools"] == TOOLS, name
        messages = rec["messages"]
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"], name
        assert messages[2]["tool_calls"] == [{"type": "function", "function": CALL}], name
        feats = sft_features([rec], qwen, Template.from_args(chat))
        n = feats["completion_mask"][0].index(1)
        want = qwen.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
        assert qwen.decode(feats["input_ids"][0][:n]) == want, name
        assert qwen.decode(feats["input_ids"][0][n:]) == "北京今天晴，25度。<|im_end|>", name
    # the call itself as the target: the template's <tool_call> block, then the end of turn
    row = {**SHAREGPT_TOOLS, "conversations": SHAREGPT_TOOLS["conversations"][:2]}
    (rec,) = read_records(DataArguments(dataset_name=write_jsonl(tmp_path / "call.jsonl", [row]), chat_template=True),
                          "sft")
    feats = sft_features([rec], qwen, Template(chat=True))
    n = feats["completion_mask"][0].index(1)
    assert qwen.decode(feats["input_ids"][0][n:]).endswith(  # (this Qwen3 template opens with an empty <think>)
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "北京"}}\n</tool_call><|im_end|>')


def test_tool_rows_with_the_text_template_are_refused_or_skipped(tmp_path):
    path = write_jsonl(tmp_path / "tools.jsonl", [SHAREGPT_TOOLS] + [
        {"conversations": [{"from": "human", "value": f"q{k}"}, {"from": "gpt", "value": f"a{k}"}]} for k in range(30)])
    with pytest.raises(DataError) as err:
        read_records(DataArguments(dataset_name=path), "sft")
    assert str(err.value) == (f"{path}, row 0, field 'conversations': holds a tool-calling conversation (tool_call); "
                              "the text template cannot show it: set chat_template: true (the tokenizer's template "
                              f"renders tools){SKIP_HINT}")
    report = DataReport("sft")
    assert len(read_records(DataArguments(dataset_name=path, on_bad_row="skip"), "sft", report)) == 30
    assert [e["count"] for e in report.skipped.values()] == [1]


def test_firefly_sharegpt_and_messages_give_the_same_records(tmp_path):
    firefly = {"conversation_id": 1, "category": "Brainstorming",
               "conversation": [{"human": "你好", "assistant": "你好！"}, {"human": "1+1?", "assistant": "2"}]}
    sharegpt = {"conversations": [{"from": "human", "value": "你好"}, {"from": "gpt", "value": "你好！"},
                                  {"from": "human", "value": "1+1?"}, {"from": "gpt", "value": "2"}]}
    messages = {"messages": [{"role": "user", "content": "你好"}, {"role": "assistant", "content": "你好！"},
                             {"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]}
    want = {"question": "1+1?", "history": [("你好", "你好！")], "answer": "2"}
    for name, row in (("firefly", firefly), ("sharegpt", sharegpt), ("messages", messages)):
        path = write_jsonl(tmp_path / f"{name}.jsonl", [row])
        assert read_records(DataArguments(dataset_name=path, mask_history=True), "sft") == [want], name
        assert read_records(DataArguments(dataset_name=path), "sft") == [{**want, "train_history": True}], name
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"conversation": [{"human": "q", "assistant": None}]}])
    with pytest.raises(DataError) as err:
        read_records(DataArguments(dataset_name=bad), "sft")
    assert str(err.value) == (f"{bad}, row 0, field 'conversation': message 0 (assistant) has an empty or non-string "
                              f"content{SKIP_HINT}")


# --- preference variants -----------------------------------------------------------------------------------------
def uf_row(k: int, good: float, bad: float) -> dict:
    """An UltraFeedback-binarized row: prompt text, chosen / rejected as whole conversations, scores."""
    user = {"role": "user", "content": f"prompt {k}"}
    return {"prompt": f"prompt {k}", "prompt_id": str(k), "messages": [user, {"role": "assistant", "content": "x"}],
            "chosen": [user, {"role": "assistant", "content": f"good {k}"}],
            "rejected": [user, {"role": "assistant", "content": f"bad {k}"}], "score_chosen": good,
            "score_rejected": bad}


def test_ultrafeedback_binarized_pairs_ties_and_margins(tmp_path):
    rows = [uf_row(k, 8.0, 8.0 if k % 10 == 0 else 5.0 + (k % 3)) for k in range(30)]
    path = write_jsonl(tmp_path / "ultrafeedback.jsonl", rows)
    report = DataReport("rm")
    pairs = read_records(DataArguments(dataset_name=path), "pairs", report)
    assert len(pairs) == 27 and pairs[0] == {"question": "prompt 1", "history": [], "chosen": "good 1",
                                              "rejected": "bad 1"}
    assert {r: e["count"] for r, e in report.skipped.items()} == {"tied scores (score_chosen == score_rejected)": 3}
    margin = read_records(DataArguments(dataset_name=path, min_score_margin=2.5), "pairs")
    assert sorted(int(p["question"].split()[1]) % 3 for p in margin) == [0] * len(margin)  # only margin 3 is left
    assert read_records(DataArguments(dataset_name=path), "sft")[0]["answer"] == "good 0"


def test_kto_rows_train_sft_on_desirable_answers_and_are_refused_by_the_reward_model(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"q{k}"}, {"role": "assistant", "content": f"a{k}"}],
             "label": k % 2 == 0} for k in range(10)]
    path = write_jsonl(tmp_path / "kto.jsonl", rows)
    report = DataReport("sft")
    sft = read_records(DataArguments(dataset_name=path), "sft", report)
    assert [r["answer"] for r in sft] == ["a0", "a2", "a4", "a6", "a8"]
    assert {r: e["count"] for r, e in report.skipped.items()} == {
        "label: false (an undesirable KTO row: not a target)": 5}
    with pytest.raises(DataError) as err:
        read_records(DataArguments(dataset_name=path), "pairs")
    assert str(err.value) == (f"{path}, row 0, field 'label': holds unpaired KTO rows (a boolean 'label' per answer); "
                              f"a reward model needs chosen / rejected pairs (make kto trains on them){SKIP_HINT}")
    # LLaMA-Factory's KTO rows say kto_tag: the same, by that name
    tagged = write_jsonl(tmp_path / "kto_tag.jsonl", [{**{k: v for k, v in r.items() if k != "label"},
                                                        "kto_tag": r["label"]} for r in rows])
    report = DataReport("sft")
    assert [r["answer"] for r in read_records(DataArguments(dataset_name=tagged), "sft", report)] == [
        "a0", "a2", "a4", "a6", "a8"]
    assert {r: e["count"] for r, e in report.skipped.items()} == {
        "kto_tag: false (an undesirable KTO row: not a target)": 5}
    with pytest.raises(DataError, match="field 'kto_tag': holds unpaired KTO rows"):
        read_records(DataArguments(dataset_name=tagged), "pairs")


def test_json_array_of_lists_is_read_as_prompt_answer_rows(tmp_path):
    path = tmp_path / "pairs.json"
    path.write_text(json.dumps([["你好", "你好！"], ["1+1?", "2"]], ensure_ascii=False), encoding="utf-8")
    assert read_records(DataArguments(dataset_name=str(path)), "sft") == [
        {"question": "你好", "history": [], "answer": "你好！"}, {"question": "1+1?", "history": [], "answer": "2"}]
    path.write_text(json.dumps([["q", "a"], ["q", "a", 7]]), encoding="utf-8")  # dialogue lists: test_data_read.py
    with pytest.raises(DataError) as err:
        read_records(DataArguments(dataset_name=str(path)), "sft")
    assert str(err.value) == (f"{path}, row 1, field '[2]': must be a string (a dialogue list alternates user / "
                              f"assistant turns), got a JSON number{SKIP_HINT}")


# --- encodings, columns, split, truncation -----------------------------------------------------------------------
@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_gbk_file_fails_with_file_line_byte_and_reads_with_dataset_encoding(tmp_path, suffix):
    rows = [{"instruction": "你好", "output": "世界"}, {"instruction": "天气", "output": "晴"}]
    path = tmp_path / f"gbk{suffix}"
    text = ("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows) if suffix == ".jsonl"
            else "instruction,output\n" + "".join(f"{r['instruction']},{r['output']}\n" for r in rows))
    path.write_bytes(text.encode("gbk"))
    byte = text.encode("gbk").index("你".encode("gbk"))
    with pytest.raises(DataError) as err:
        read_records(DataArguments(dataset_name=str(path)), "sft")
    assert str(err.value).startswith(f"{path}: line {1 if suffix == '.jsonl' else 2}, byte {byte}: not valid utf-8 (")
    assert str(err.value).endswith("; set dataset_encoding to the file's encoding (gbk, gb18030, big5, ...)")
    got = read_records(DataArguments(dataset_name=str(path), dataset_encoding="gbk"), "sft")
    assert [r["answer"] for r in got] == ["世界", "晴"]


def test_utf8_with_bom_reads(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"instruction": "q", "output": "答"}, ensure_ascii=False).encode())
    assert read_records(DataArguments(dataset_name=str(path)), "sft")[0]["answer"] == "答"


def test_missing_column_names_the_recipe_key_and_the_closest_columns(tmp_path):
    path = write_jsonl(tmp_path / "odd.jsonl", [{"instrution": "q", "reply": "a", "id": 1}])
    with pytest.raises(DataError) as err:
        read_records(DataArguments(dataset_name=path), "sft")
    assert str(err.value) == (f"{path}, row 0, field 'instruction': missing column; set question_key to one of "
                              f"['instrution', 'id', 'reply']{SKIP_HINT}")
    with pytest.raises(DataError) as err:
        read_records(DataArguments(dataset_name=path, question_key="instrution"), "sft")
    assert "field 'output': missing column; set answer_key to one of" in str(err.value)


def test_eval_split_larger_than_the_data_is_refused():
    with pytest.raises(DataError) as err:
        split_records([{"question": str(k)} for k in range(5)], 5, seed=0)
    assert str(err.value) == ("eval_split_size: 5 leaves no training record of the 5 read; lower it (a fraction < 1, "
                              "or a row count below the records)")
    report = DataReport("sft")
    train, held = split_records([{"question": str(k)} for k in range(10)], 0.2, 0, report)
    assert (len(train), len(held), report.train_size, report.eval_size) == (8, 2, 8, 2)


def test_sft_answers_cut_at_max_length_are_counted(tokenizer, caplog):
    records = [{"question": "q", "history": [], "answer": "很长的回答" * 20}, {"question": "q", "history": [], "answer": "短"}]
    report = DataReport("sft")
    with caplog.at_level(logging.WARNING, logger="rlhf_trl.data"):
        sft_features(records, tokenizer, Template(), max_length=16, source="f", report=report)
    assert report.truncated == {"train: answers are cut at max_length": 1}
    assert "f: 1 of 2 answers are cut at max_length=16 tokens" in caplog.text
    assert set(report.token_lengths["train"]) == {"prompt", "response"}


def test_data_report_written_by_every_stage(sft_run, rm_run, ppo_run):
    for run, stage in ((sft_run, "sft"), (rm_run, "rm"), (ppo_run, "ppo")):
        report = json.loads(Path(run["output_dir"], "data_report.json").read_text(encoding="utf-8"))
        assert report["stage"] == stage and report["sources"] and report["train_size"] > 0, stage
        assert sum(s["records"] for s in report["sources"]) == report["train_size"] + report["eval_size"], stage
        assert report["token_lengths"]["train"]["prompt"]["max"] >= 1, stage


def test_system_turn_fills_a_system_slot_of_the_text_template():
    template = Template(prompt="{system}问：{question}\n\n答：")
    assert template.has_system_slot and not Template().has_system_slot
    assert template.format_prompt("q", [("q0", "a0")], system="S\n") == "S\n问：q0\n\n答：a0\n\n问：q\n\n答："
    assert template.format_prompt("q") == "问：q\n\n答："


def test_rm_trains_on_hh_rlhf_rows_with_empty_replies(sft_run, tmp_path):
    from conftest import RECIPES

    from rlhf_trl import rm

    path = write_jsonl(tmp_path / "harmless-base-test.jsonl", hh_rows(48, {5, 30}))
    out = tmp_path / "rm"
    result = rm.main(["--config", f"{RECIPES}/rm.yaml", "--dataset_name", path, "--dataset_format", "auto",
                      "--prompt_template", "raw", "--max_length", "128",
                      "--model_name_or_path", sft_run["merged"], "--output_dir", str(out), "--num_train_epochs", "1",
                      "--eval_split_size", "8"])
    assert result["metrics"]["num_train_pairs"] == 40 and result["metrics"]["global_step"] > 0
    report = json.loads((out / "data_report.json").read_text(encoding="utf-8"))
    assert report["skipped"] == {} and (report["train_size"], report["eval_size"]) == (40, 8)
    assert report["template"] == "raw" and report["sources"][0]["format"] == "implicit"


def test_empty_json_array_and_misspelt_source_key(tmp_path):
    path = tmp_path / "empty.json"
    path.write_text("[]\n", encoding="utf-8")
    with pytest.raises(DataError) as err:
        read_records(DataArguments(dataset_name=str(path)), "sft")
    assert str(err.value) == f"{path}: holds no rows (an empty JSON array)"
    with pytest.raises(ValueError) as err:
        read_records(DataArguments(datasets=[{"dataset_name": str(path), "question_kye": "q"}]), "sft")
    assert str(err.value) == f"datasets[0] ({path}): unknown key(s) ['question_kye']; did you mean 'question_key' for " \
                             "'question_kye'?"

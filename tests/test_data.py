"""The shared data formatter: template strings, column mapping, readers, ranked -> pairs, token construction."""

import json

import pandas as pd
import pytest
from conftest import write_jsonl

from rlhf_trl.data import (
    DataArguments,
    DataError,
    Template,
    encode_prompt,
    encode_response,
    pair_features,
    pair_records,
    prompt_features,
    prompt_records,
    read_records,
    sft_features,
    sft_records,
    split_records,
)


def test_template_exact_strings():
    t = Template()
    assert t.format_prompt("今天天气如何？") == "问：今天天气如何？\n\n答："
    assert t.format_completion("晴天。") == "晴天。"
    history = [("你好", "你好！")]
    assert t.format_prompt("再见", history) == "问：你好\n\n答：你好！\n\n问：再见\n\n答："


def test_template_is_configurable_and_validated():
    t = Template(prompt="Human: {question}\nAssistant: ", completion="{answer}")
    assert t.format_prompt("hi") == "Human: hi\nAssistant: "
    with pytest.raises(ValueError, match="question"):
        Template(prompt="no placeholder")
    with pytest.raises(ValueError, match="answer"):
        Template(completion="no placeholder")


def test_template_does_not_interpret_braces_in_text():
    assert Template().format_prompt("f(x) = {x}") == "问：f(x) = {x}\n\n答："


def test_tokens_prompt_then_response_then_eos(tokenizer):
    t = Template()
    p = encode_prompt(tokenizer, t, "你觉得咖啡怎么样？")
    r = encode_response(tokenizer, t, "咖啡很棒，我很喜欢。")
    assert tokenizer.decode(p) == "问：你觉得咖啡怎么样？\n\n答："
    assert r[-1] == tokenizer.eos_token_id and tokenizer.eos_token_id not in r[:-1]
    assert tokenizer.decode(r[:-1]) == "咖啡很棒，我很喜欢。"
    feats = sft_features([{"question": "你觉得咖啡怎么样？", "answer": "咖啡很棒，我很喜欢。"}], tokenizer, t)
    assert feats["input_ids"][0] == p + r
    assert feats["completion_mask"][0] == [0] * len(p) + [1] * len(r)
    pairs = pair_features(
        [{"question": "你觉得咖啡怎么样？", "chosen": "咖啡很棒，我很喜欢。", "rejected": "咖啡太差了，我很讨厌。"}],
        tokenizer, t,
    )
    assert pairs["chosen_ids"][0] == p + r
    assert pairs["rejected_ids"][0] == p + encode_response(tokenizer, t, "咖啡太差了，我很讨厌。")
    assert prompt_features([{"question": "你觉得咖啡怎么样？"}], tokenizer, t, 256)["input_ids"][0] == p
    assert tokenizer.pad_token_id != tokenizer.eos_token_id


def test_prompt_features_keep_the_right_end(tokenizer):
    ids = prompt_features([{"question": "很长的问题" * 20}], tokenizer, Template(), max_prompt_length=5)["input_ids"][0]
    full = encode_prompt(tokenizer, Template(), "很长的问题" * 20)
    assert ids == full[-5:]


def test_alpaca_with_input_and_history():
    rows = [{"instruction": "翻译", "input": "hello", "output": "你好", "history": [["在吗", "在"]]}]
    (rec,) = sft_records(rows, DataArguments(mask_history=True), "f.json")
    assert rec == {"question": "翻译\nhello", "history": [("在吗", "在")], "answer": "你好"}
    # by default (mask_history: false) the history's answers are targets too (tests/test_turns.py)
    assert sft_records(rows, DataArguments(), "f.json") == [{**rec, "train_history": True}]


def test_column_mapping():
    rows = [{"q": "问题一", "good": "好答案", "bad": "坏答案"}]
    args = DataArguments(question_key="q", good_key="good", bad_key="bad", dataset_format="pairwise")
    assert pair_records(rows, args, "f.jsonl") == [
        {"question": "问题一", "history": [], "chosen": "好答案", "rejected": "坏答案"}
    ]
    sft_args = DataArguments(question_key="q", answer_key="good", dataset_format="alpaca")
    assert sft_records(rows, sft_args, "f.jsonl")[0]["answer"] == "好答案"


@pytest.mark.parametrize("n", [2, 3, 5])
def test_ranked_to_pairs_counts(n):
    rows = [{"instruction": "q", "output": [f"a{i}" for i in range(n)]}] * 2
    all_pairs = pair_records(rows, DataArguments(ranked_pairs="all"), "f")
    adjacent = pair_records(rows, DataArguments(ranked_pairs="adjacent"), "f")
    assert len(all_pairs) == 2 * n * (n - 1) // 2
    assert len(adjacent) == 2 * (n - 1)
    # best first: every pair prefers the earlier answer
    assert all(int(p["chosen"][1:]) < int(p["rejected"][1:]) for p in all_pairs)
    assert [(p["chosen"], p["rejected"]) for p in adjacent[: n - 1]] == [(f"a{i}", f"a{i+1}") for i in range(n - 1)]


def test_sharegpt_sft_pairs_and_prompts():
    conv = [
        {"from": "human", "value": "第一问"}, {"from": "gpt", "value": "第一答"},
        {"from": "human", "value": "第二问"}, {"from": "gpt", "value": "第二答"},
    ]
    (rec,) = sft_records([{"conversations": conv}], DataArguments(mask_history=True), "f")
    assert rec == {"question": "第二问", "history": [("第一问", "第一答")], "answer": "第二答"}
    assert sft_records([{"conversations": conv}], DataArguments(), "f") == [{**rec, "train_history": True}]
    pair_row = {"conversations": conv[:3], "chosen": {"from": "gpt", "value": "好"}, "rejected": "坏"}
    (pair,) = pair_records([pair_row], DataArguments(), "f")
    assert pair == {"question": "第二问", "history": [("第一问", "第一答")], "chosen": "好", "rejected": "坏"}
    (prompt,) = prompt_records([{"conversations": conv}], DataArguments(), "f")
    assert prompt == {"question": "第二问", "history": [("第一问", "第一答")]}


@pytest.mark.parametrize("ext", ["json", "jsonl", "csv", "parquet"])
def test_local_file_types(tmp_path, ext):
    rows = [{"instruction": f"问题{i}", "input": "", "output": f"答案{i}"} for i in range(4)]
    path = tmp_path / f"data.{ext}"
    if ext == "json":
        path.write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")
    elif ext == "jsonl":
        write_jsonl(path, rows)
    elif ext == "csv":
        pd.DataFrame(rows).to_csv(path, index=False)
    else:
        pd.DataFrame(rows).to_parquet(path)
    recs = read_records(DataArguments(dataset_name=str(path)), "sft")
    assert [r["answer"] for r in recs] == [f"答案{i}" for i in range(4)]


@pytest.mark.parametrize(
    "row, field, message",
    [
        ({"instruction": "q", "output": None}, "output", "null"),
        ({"instruction": "q", "output": 3}, "output", "must be a string"),
        ({"instruction": "", "output": "a"}, "instruction", "empty"),
    ],
)
def test_bad_fields_name_file_row_and_field(tmp_path, row, field, message):
    good = {"instruction": "q", "output": "a"}
    path = write_jsonl(tmp_path / "bad.jsonl", [good, row])
    with pytest.raises(DataError) as err:
        read_records(DataArguments(dataset_name=path, dataset_format="alpaca"), "sft")
    text = str(err.value)
    assert path in text and "row 1" in text and f"'{field}'" in text and message in text


def test_missing_mapped_column(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(DataError, match=r"row 0, field 'reply'.*missing column"):
        read_records(DataArguments(dataset_name=path, answer_key="reply", dataset_format="alpaca"), "sft")


def test_pair_errors(tmp_path):
    with pytest.raises(DataError, match="identical"):
        pair_records([{"prompt": "q", "chosen": "same", "rejected": "same"}], DataArguments(), "f")
    with pytest.raises(DataError, match="at least 2 answers"):
        pair_records([{"instruction": "q", "output": ["only one"]}], DataArguments(), "f")


def test_broken_json_line_names_the_file(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"instruction": "q", "output": "a"}\n{"instruction": "q", "output": \n', encoding="utf-8")
    with pytest.raises(DataError) as err:
        read_records(DataArguments(dataset_name=str(path)), "sft")
    assert str(err.value) == (f"{path}, row 1: cannot be read as json: line 2 is not valid JSON (Expecting value at "
                              "column 32)")


def test_missing_file_and_mixed_formats(tmp_path):
    with pytest.raises(DataError) as err:
        read_records(DataArguments(dataset_name=str(tmp_path / "nope.jsonl")), "sft")
    assert str(err.value) == f"{tmp_path / 'nope.jsonl'}: file not found"
    mixed = [{"instruction": "q", "output": "a"}, {"instruction": "q", "output": ["a", "b"]}]
    with pytest.raises(DataError, match="row 1.*mixed formats"):
        sft_records(mixed, DataArguments(), "f")


def test_length_policy(tokenizer):
    rec = {"question": "很长的问题" * 10, "chosen": "好", "rejected": "坏坏坏"}
    t = Template()
    full = pair_features([rec], tokenizer, t)
    max_len = len(full["rejected_ids"][0]) - 3
    truncated = pair_features([rec], tokenizer, t, max_length=max_len, length_policy="truncate_prompt")
    assert len(truncated["rejected_ids"][0]) == max_len
    assert truncated["rejected_ids"][0][-len(encode_response(tokenizer, t, "坏坏坏")):] == encode_response(tokenizer, t, "坏坏坏")
    kept = pair_features([rec, {**rec, "question": "短"}], tokenizer, t, max_length=max_len, length_policy="drop")
    assert len(kept["chosen_ids"]) == 1
    with pytest.raises(DataError, match="no pair is left"):
        pair_features([rec], tokenizer, t, max_length=max_len, length_policy="drop", source="x.jsonl")


def test_split_is_deterministic_and_disjoint():
    recs = [{"question": str(i)} for i in range(100)]
    train, held = split_records(recs, 0.1, seed=0)
    assert len(held) == 10 and len(train) == 90
    assert split_records(recs, 0.1, seed=0) == (train, held)
    assert not {r["question"] for r in train} & {r["question"] for r in held}
    assert len(split_records(recs, 16, seed=0)[1]) == 16


def test_several_sources_each_with_its_own_mapping(tmp_path):
    ranked = write_jsonl(tmp_path / "ranked.jsonl", [{"instruction": "q1", "output": ["a", "b", "c"]}])
    conv = write_jsonl(tmp_path / "conv.jsonl", [
        {"conversations": [{"from": "human", "value": "q2"}], "good": "好", "bad": "坏"},
    ])
    args = DataArguments(
        dataset_name=ranked,
        datasets=[{"dataset_name": conv, "dataset_format": "sharegpt", "good_key": "good", "bad_key": "bad"}],
    )
    pairs = read_records(args, "pairs")
    assert len(pairs) == 3 + 1
    assert pairs[-1] == {"question": "q2", "history": [], "chosen": "好", "rejected": "坏"}
    with pytest.raises(ValueError, match=r"datasets\[0\].*unknown key"):
        read_records(DataArguments(datasets=[{"dataset_name": conv, "god_key": "x"}]), "pairs")

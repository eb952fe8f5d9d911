"""Data as users have it: conversational rows (OpenAI / TRL), implicit-prompt pairs, chat templates, compressed and
multi-file inputs, list-of-turns prompts, and the real files in ../shared."""

import bz2
import gzip
import json
import logging
import lzma
import shutil
from pathlib import Path

import pytest
from conftest import SHARED, write_jsonl

from rlhf_trl.data.records import SKIP_HINT

from rlhf_trl.data import (
    DataArguments,
    DataError,
    Template,
    chat_end_of_turn_id,
    encode_prompt,
    encode_response,
    pair_features,
    pair_records,
    prompt_features,
    prompt_records,
    read_records,
    sft_features,
    sft_records,
    split_transcript,
)

QWEN2 = SHARED / "tokenizers" / "qwen2"
DATA = SHARED / "data"
IM_END = 151645  # <|im_end|>: the Qwen2 tokenizer's EOS and its chat template's end of turn

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]
HH_PROMPT = "\n\nHuman: Hi\n\nAssistant: Hey there.\n\nHuman: What is 2+2?\n\nAssistant:"
HH = {"chosen": HH_PROMPT + " It is 4.", "rejected": HH_PROMPT + " It is 5."}


def write_gz(path, rows):
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return str(path)


def one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text.replace("\\n", "")
    return text


@pytest.fixture(scope="module")
def qwen():
    if not QWEN2.is_dir():
        pytest.skip(f"the real Qwen2 tokenizer is not here: {QWEN2} (../shared beside the project)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(QWEN2))


def need_shared(path):
    if not path.exists():
        pytest.skip(f"real data not here: {path} (../shared beside the project)")
    return str(path)


# ---------------------------------------------------------------------------------------------------------------
# 1. conversational rows
# ---------------------------------------------------------------------------------------------------------------
def test_messages_rows_in_every_stage(tmp_path):
    path = write_gz(tmp_path / "chat.jsonl.gz", [{"messages": MESSAGES}])
    args = DataArguments(dataset_name=path)
    assert read_records(args, "sft") == [{"question": "2+2?", "history": [("Hi", "Hello!")], "answer": "4",
                                          "system": "Be brief.", "train_history": True}]  # every turn a target
    assert read_records(DataArguments(dataset_name=path, mask_history=True), "sft") == [
        {"question": "2+2?", "history": [("Hi", "Hello!")], "answer": "4", "system": "Be brief."}]
    assert read_records(args, "prompts") == [{"question": "2+2?", "history": [("Hi", "Hello!")], "system": "Be brief."}]
    with_pair = write_gz(tmp_path / "pairs.jsonl.gz", [{"messages": MESSAGES[:4], "chosen": "4", "rejected": "5"}])
    assert read_records(DataArguments(dataset_name=with_pair), "pairs") == [
        {"question": "2+2?", "history": [("Hi", "Hello!")], "chosen": "4", "rejected": "5", "system": "Be brief."}]
    with pytest.raises(DataError) as err:
        read_records(args, "pairs")
    assert one_line(err) == f"{path}: format 'messages' holds no preference pairs (add chosen / rejected columns)"


def test_trl_preference_and_prompt_completion_shapes(tmp_path):
    user = [{"role": "user", "content": "Sky colour?"}]
    explicit = {"prompt": user, "chosen": [{"role": "assistant", "content": "Blue."}],
                "rejected": [{"role": "assistant", "content": "Green."}]}
    implicit = {"chosen": user + explicit["chosen"], "rejected": user + explicit["rejected"]}
    text = {"prompt": "Sky colour?", "chosen": "Blue.", "rejected": "Green."}
    want = {"question": "Sky colour?", "history": [], "chosen": "Blue.", "rejected": "Green."}
    for name, row in (("explicit", explicit), ("implicit", implicit), ("text", text)):
        path = write_gz(tmp_path / f"{name}.jsonl.gz", [row])
        args = DataArguments(dataset_name=path)
        assert read_records(args, "pairs") == [want], name
        assert read_records(args, "sft") == [{"question": "Sky colour?", "history": [], "answer": "Blue."}], name
        extra = {"columns": {"chosen": "Blue.", "rejected": "Green."}} if name == "text" else {}  # scalar answers
        assert read_records(args, "prompts") == [{"question": "Sky colour?", "history": [], **extra}], name
    completion_rows = [{"prompt": user, "completion": [{"role": "assistant", "content": "Blue."}]},
                       {"prompt": "The sky is", "completion": " blue."}]
    assert sft_records(completion_rows[:1], DataArguments(), "f") == [
        {"question": "Sky colour?", "history": [], "answer": "Blue."}]
    assert sft_records(completion_rows[1:], DataArguments(), "f") == [
        {"question": "The sky is", "history": [], "answer": " blue."}]
    assert prompt_records(completion_rows[:1], DataArguments(), "f") == [{"question": "Sky colour?", "history": []}]


def test_system_turns_kept_by_chat_templates_dropped_with_a_count_by_the_text_template(tokenizer, caplog):
    records = sft_records([{"messages": MESSAGES}, {"messages": MESSAGES[1:]}], DataArguments(), "f")
    with caplog.at_level(logging.WARNING, logger="rlhf_trl.data"):
        feats = sft_features(records, tokenizer, Template(), source="chat.jsonl")
    assert "chat.jsonl: 1 of 2 rows have a system turn; the text template has no {system} slot: dropped" in caplog.text
    assert feats["input_ids"][0] == feats["input_ids"][1]  # the 问/答 rendering ignores it


BAD_ROWS = [
    ("messages", {"messages": [{"role": "user", "content": "q"}]}, "sft",
     "row 0, field 'messages': needs a user turn followed by an assistant turn"),
    ("messages", {"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "x"}]}, "sft",
     "row 0, field 'messages': holds a tool-calling conversation (tool); the text template cannot show it: set "
     "chat_template: true (the tokenizer's template renders tools)"),
    ("messages", {"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": "a"}]}, "sft",
     "row 0, field 'messages': message 0 (user) has an empty or non-string content"),
    ("messages", {"messages": [{"role": "user", "content": "q"}, {"role": "user", "content": "r"},
                               {"role": "assistant", "content": "a"}]}, "sft",
     "row 0, field 'messages': message 1 (user) must be assistant (turns alternate user / assistant)"),
    ("preference", {"prompt": [{"role": "user", "content": "q"}],
                    "chosen": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}],
                    "rejected": [{"role": "assistant", "content": "c"}]}, "pairs",
     "row 0, field 'chosen': must be one assistant message, got 2 message(s) (assistant, user); if chosen / rejected "
     "hold whole conversations, set dataset_format: implicit"),
    ("preference", {"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                    "rejected": [{"role": "user", "content": "other"}, {"role": "assistant", "content": "b"}]},
     "pairs", "row 0, field 'chosen/rejected': chosen and rejected share no leading messages ending with a user turn"),
    ("implicit", {"chosen": "no markers here", "rejected": "none here either"}, "pairs",
     "row 0, field 'chosen/rejected': chosen and rejected share no prefix ending in the assistant marker "
     "'\\n\\nAssistant:' (set human_marker / assistant_marker)"),
    ("implicit", {"chosen": "text", "rejected": [{"role": "user", "content": "q"}]}, "pairs",
     "row 0, field 'chosen/rejected': chosen and rejected must both be transcripts (strings) or both message lists"),
    ("turns", {"prompt": ["first", "second"], "completion": "a"}, "sft",
     "row 0, field 'prompt': must be a string for SFT rows, got a list of 2 user turn(s) without answers (only PPO "
     "prompts read such lists: prompt_turn)"),
    ("turns", {"prompt": ["first", "second"], "chosen": "a", "rejected": "b"}, "pairs",
     "row 0, field 'prompt': must be a string for RM rows, got a list of 2 user turn(s) without answers (only PPO "
     "prompts read such lists: prompt_turn)"),
]


@pytest.mark.parametrize("shape, row, kind, message", BAD_ROWS, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD_ROWS)])
def test_bad_rows_in_new_shapes_name_file_row_and_field(tmp_path, shape, row, kind, message):
    path = write_jsonl(tmp_path / f"{shape}.jsonl", [row])
    with pytest.raises(DataError) as err:
        read_records(DataArguments(dataset_name=path), kind)
    assert one_line(err) == f"{path}, {message}{SKIP_HINT}"


# ---------------------------------------------------------------------------------------------------------------
# 2. implicit-prompt text pairs, markers, raw template
# ---------------------------------------------------------------------------------------------------------------
def test_implicit_text_pairs_share_their_prompt_through_the_last_assistant_marker(tmp_path):
    path = write_gz(tmp_path / "hh.jsonl.gz", [HH])
    (rec,) = read_records(DataArguments(dataset_name=path), "pairs")
    assert rec["text"] == rec["question"] == HH_PROMPT
    assert (rec["chosen"], rec["rejected"]) == (" It is 4.", " It is 5.")
    (sft,) = read_records(DataArguments(dataset_name=path), "sft")
    assert sft["answer"] == " It is 4." and sft["text"] == HH_PROMPT
    (prompt,) = read_records(DataArguments(dataset_name=path), "prompts")
    assert prompt["text"] == HH_PROMPT
    # an answer that itself holds the marker: the prompt is still the *shared* prefix
    tricky = {"chosen": HH_PROMPT + " Sure.\n\nAssistant: more", "rejected": HH_PROMPT + " No."}
    (rec,) = pair_records([tricky], DataArguments(), "f")
    assert rec["text"] == HH_PROMPT and rec["chosen"] == " Sure.\n\nAssistant: more"
    assert split_transcript(HH_PROMPT) == (None, [("Hi", "Hey there.")], "What is 2+2?")


def test_implicit_markers_are_configurable():
    row = {"chosen": "USER: hi\nBOT: yes", "rejected": "USER: hi\nBOT: no"}
    args = DataArguments(human_marker="USER:", assistant_marker="\nBOT:")
    (rec,) = pair_records([row], args, "f")
    assert (rec["text"], rec["chosen"], rec["rejected"]) == ("USER: hi\nBOT:", " yes", " no")
    assert split_transcript(rec["text"], "USER:", "\nBOT:") == (None, [], "hi")


def test_text_carrying_its_own_turns_is_not_wrapped_in_the_template(tokenizer):
    (rec,) = pair_records([HH], DataArguments(), "f")
    for template in (Template(), Template(prompt="raw")):
        feats = pair_features([rec], tokenizer, template)
        prompt = tokenizer(HH_PROMPT, add_special_tokens=False)["input_ids"]
        answer = tokenizer(" It is 4.", add_special_tokens=False)["input_ids"]
        assert feats["chosen_ids"][0] == prompt + answer + [tokenizer.eos_token_id]
        assert prompt_features([rec], tokenizer, template, 512)["input_ids"][0] == prompt
    raw = Template(prompt="raw")
    assert raw.format_prompt("Q: hi\nA:") == "Q: hi\nA:" and raw.format_completion(" yes") == " yes"
    assert encode_prompt(tokenizer, raw, "问题") == tokenizer("问题", add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------------------------------------------------------
# 3. chat templates
# ---------------------------------------------------------------------------------------------------------------
def apply(tok, messages):
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_chat_template_ids_rm_equals_ppo_on_the_real_qwen2_tokenizer(qwen):
    assert chat_end_of_turn_id(qwen) == IM_END
    template = Template(chat=True, system_prompt="You are helpful.")
    records = pair_records([{"messages": MESSAGES[1:4], "chosen": "It is 4.", "rejected": "It is 5."}],
                           DataArguments(), "f")
    feats = pair_features(records, qwen, template)
    (prompt,) = prompt_features(records, qwen, template, 1024)["input_ids"]
    want_prompt = apply(qwen, [{"role": "system", "content": "You are helpful."}, *MESSAGES[1:4]])
    assert prompt == want_prompt
    assert qwen.decode(prompt) == ("<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                                   "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
                                   "<|im_start|>assistant\n")
    for key in ("chosen", "rejected"):
        answer = qwen(records[0][key], add_special_tokens=False)["input_ids"]
        assert feats[f"{key}_ids"][0] == prompt + answer + [IM_END]  # RM ids == PPO prompt + response + EOS
    assert feats["prompt_length"] == [len(prompt)]
    sft = sft_features(sft_records([{"messages": MESSAGES}], DataArguments(mask_history=True), "f"), qwen, template)
    sft_prompt = apply(qwen, MESSAGES[:4])  # the row's own system turn wins over system_prompt
    assert sft["input_ids"][0] == sft_prompt + qwen("4", add_special_tokens=False)["input_ids"] + [IM_END]
    assert sft["completion_mask"][0] == [0] * len(sft_prompt) + [1, 1]


def test_chat_template_renders_implicit_transcripts_as_turns(qwen):
    (rec,) = pair_records([HH], DataArguments(), "f")
    feats = pair_features([rec], qwen, Template(chat=True))
    prompt = apply(qwen, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hey there."},
                          {"role": "user", "content": "What is 2+2?"}])
    assert feats["chosen_ids"][0] == prompt + qwen("It is 4.", add_special_tokens=False)["input_ids"] + [IM_END]
    assert prompt_features([rec], qwen, Template(chat=True), 1024)["input_ids"][0] == prompt


def test_chat_mode_errors(tokenizer, qwen, tmp_path):
    rec = {"question": "q", "history": [], "answer": "a"}
    with pytest.raises(ValueError) as err:
        sft_features([rec], tokenizer, Template(chat=True))
    assert one_line(err) == (f"chat_template: true, but the tokenizer at '{tokenizer.name_or_path}' has no chat "
                             "template; set chat_template: false (text templates) or use a tokenizer that has one")
    with pytest.raises(ValueError, match="system_prompt needs chat_template: true"):
        Template(system_prompt="x")
    with pytest.raises(ValueError, match="remove prompt_template / completion_template"):
        Template(prompt="Q: {question}", chat=True)
    # a template whose end-of-turn token is not the tokenizer's EOS: fails unless generation_config lists it
    from transformers import AutoTokenizer

    tok_dir = tmp_path / "qwen_eos_endoftext"
    shutil.copytree(QWEN2, tok_dir)
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    config.update(eos_token="<|endoftext|>", pad_token="<|vision_pad|>")
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    with pytest.raises(ValueError) as err:
        prompt_features([rec], tok, Template(chat=True), 64)
    assert one_line(err) == (
        f"the chat template of '{tok_dir}' ends assistant turns with '<|im_end|>' (id {IM_END}), which is neither the "
        f"tokenizer's EOS '<|endoftext|>' nor in eos_token_id of {tok_dir}/generation_config.json (EOS ids [151643]); "
        f"add {IM_END} there")
    (tok_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [IM_END, 151643]}))
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    assert encode_response(tok, Template(chat=True), "a")[-1] == IM_END


# ---------------------------------------------------------------------------------------------------------------
# 4. inputs: compression, lists, globs, directories, hub
# ---------------------------------------------------------------------------------------------------------------
ROWS = [{"instruction": f"问题{i}", "output": f"答案{i}"} for i in range(6)]


@pytest.mark.parametrize("name, opener", [("d.jsonl.gz", gzip.open), ("d.jsonl.bz2", bz2.open),
                                          ("d.jsonl.xz", lzma.open), ("d.json.gz", gzip.open)])
def test_compressed_files(tmp_path, name, opener):
    path = tmp_path / name
    with opener(path, "wt", encoding="utf-8") as f:
        if ".jsonl" in name:
            f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in ROWS))
        else:
            json.dump(ROWS, f, ensure_ascii=False)
    assert [r["answer"] for r in read_records(DataArguments(dataset_name=str(path)), "sft")] == [
        r["output"] for r in ROWS]


def test_lists_globs_and_directories_of_shards(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    write_gz(shards / "part-00000.jsonl.gz", ROWS[:3])
    write_jsonl(shards / "part-00001.jsonl", ROWS[3:])
    (shards / "README.md").write_text("not data")
    want = [r["output"] for r in ROWS]
    for name in (str(shards), str(shards / "part-*.jsonl*"),
                 [str(shards / "part-00000.jsonl.gz"), str(shards / "part-00001.jsonl")]):
        assert [r["answer"] for r in read_records(DataArguments(dataset_name=name), "sft")] == want, name
    args = DataArguments(dataset_name=[str(shards / "part-00000.jsonl.gz"), str(shards / "part-00001.jsonl")],
                         max_samples=4)
    assert len(read_records(args, "sft")) == 4
    with pytest.raises(DataError) as err:
        read_records(DataArguments(dataset_name=str(tmp_path / "nothing-*.jsonl")), "sft")
    assert one_line(err) == f"{tmp_path}/nothing-*.jsonl: no file matches this pattern"
    (shards / "extra.csv").write_text("instruction,output\nq,a\n")
    with pytest.raises(DataError) as err:
        read_records(DataArguments(dataset_name=str(shards)), "sft")
    assert one_line(err) == f"{shards}: mixes file types (csv, json); one source, one type"


def test_hub_dataset_is_read_with_its_config_and_split(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split))
        return datasets.Dataset.from_list([{"question": "What is 2+2?", "answer": "4"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    args = DataArguments(dataset_name="openai/gsm8k", dataset_config="main", dataset_split="test")
    assert read_records(args, "sft") == [{"question": "What is 2+2?", "history": [], "answer": "4"}]
    assert calls == [("openai/gsm8k", "main", "test")]


def test_offline_hub_id_fails_in_one_line_naming_hf_hub_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError) as err:
        read_records(DataArguments(dataset_name="no-such-org/no-such-dataset", dataset_config="main",
                                   dataset_split="test"), "prompts")
    assert one_line(err) == ("no-such-org/no-such-dataset: a hub dataset, not in the local cache, and HF_HUB_OFFLINE=1 "
                             "forbids downloading it; unset HF_HUB_OFFLINE once to download it, or pass a local file")


def _fast_message_rows(monkeypatch):
    """Count the rows `read_records` converts through `message_records` (the rest take the plain per-row path)."""
    from rlhf_trl.data import read, records

    seen = {"fast": 0, "plain": 0}
    convert = records.message_records

    def counting(*args):
        out = convert(*args)
        seen["fast"] += sum(r is not None for r in out)
        seen["plain"] += sum(r is None for r in out)
        return out

    monkeypatch.setattr(records, "message_records", counting)
    monkeypatch.setattr(read, "BATCH_ROWS", 4)  # several Arrow batches: row numbers run on across them
    return seen


def _plain(path: str, kind: str, **kw):
    """The plain per-row conversion: the rows as Python dicts (`load_rows`), then the record functions."""
    from rlhf_trl.data import load_rows

    convert = {"sft": sft_records, "prompts": prompt_records, "pairs": pair_records}[kind]
    return convert(load_rows(path), DataArguments(dataset_name=path, **kw), path)


def test_messages_fast_conversion_gives_the_plain_records(tmp_path, monkeypatch):
    seen = _fast_message_rows(monkeypatch)
    long = [{"role": ("user", "assistant")[k % 2], "content": f"turn {k}"} for k in range(70)]
    rows = [{"messages": MESSAGES, "id": 0, "meta": {"source": "x"}},
            {"messages": MESSAGES[1:3], "id": 1, "meta": {"source": "y"}},
            {"messages": [{"role": "human", "content": "嗨"}, {"role": "gpt", "content": " 你好\n"},
                          {"role": "user", "content": "trailing user turn"}], "id": 2, "meta": {"source": None}},
            {"messages": long, "id": 3, "meta": {"source": "z"}},
            {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                          {"role": "assistant", "content": "\u3000a"}], "id": 4, "meta": {"source": "v"}}] * 3
    rows = [{**r, "messages": [dict(m, name="n") for m in r["messages"]]} for r in rows]  # a key more: still fast
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    for kind in ("sft", "prompts"):
        got, want = read_records(DataArguments(dataset_name=path), kind), _plain(path, kind)
        assert got == want and len(got) == len(rows)
        assert [list(r) for r in got] == [list(r) for r in want]  # the same keys in the same order
    assert seen == {"fast": 2 * len(rows), "plain": 0}
    assert read_records(DataArguments(dataset_name=path), "prompts")[3]["columns"] == {"id": 3}  # scalar extras only
    assert read_records(DataArguments(dataset_name=path, max_samples=5), "sft") == _plain(path, "sft")[:5]
    # messages of mixed shapes ({from, value} among {role, content}; a key in some messages only): `datasets` reads
    # the column as JSON and the plain path converts it
    for odd in ({"from": "human", "value": "q"}, {"role": "user", "content": "q", "weight": 1}):
        path = write_jsonl(tmp_path / "mixed.jsonl", rows[:5] + [{**rows[0], "messages": [odd, A]}] + rows[:3])
        assert read_records(DataArguments(dataset_name=path), "sft") == _plain(path, "sft")


U, A = {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}
ROLE_NONE = "message 0 has role None; use system, user, assistant or tool (sharegpt: human, gpt, function_call, observation)"
BAD_MESSAGES = [  # the bad messages of row 9, its error, and whether `datasets` hands the column over as Arrow lists
    ([{"role": "user", "content": None}, A], "message 0 (user) has an empty or non-string content", True),
    ([{"role": None, "content": "x"}, A], ROLE_NONE, True),
    ([U, {"role": "tool", "content": "x"}, A], "holds a tool-calling conversation (tool); the text template cannot "
     "show it: set chat_template: true (the tokenizer's template renders tools)", True),
    ([None, A], "message 0 must be a {role, content} object, got NoneType", True),
    (None, "is null or missing in this row", True),
    ([], "must be a non-empty list of {role, content} messages, got list", True),
    ([U, {"role": "system", "content": "s"}, A],
     "message 1 (system) is only allowed as the first message (turns alternate user / assistant)", True),
    ([U], "needs a user turn followed by an assistant turn", True),
    ([{"role": "user"}, A], "message 0 (user) has an empty or non-string content", False),
    ([{"content": "x"}, A], ROLE_NONE, False),
]


@pytest.mark.parametrize("messages, message, arrow", BAD_MESSAGES, ids=[str(b[0]) for b in BAD_MESSAGES])
def test_messages_fast_conversion_keeps_the_plain_errors(tmp_path, monkeypatch, messages, message, arrow):
    seen = _fast_message_rows(monkeypatch)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": MESSAGES}] * 9 + [{"messages": messages}]
                       + [{"messages": MESSAGES}] * 3)
    with pytest.raises(DataError) as err:
        read_records(DataArguments(dataset_name=path), "sft")
    assert one_line(err) == f"{path}, row 9, field 'messages': {message}{SKIP_HINT}"
    with pytest.raises(DataError) as plain:
        _plain(path, "sft")
    assert str(plain.value) == str(err.value)
    assert seen == ({"fast": 11, "plain": 1} if arrow else {"fast": 0, "plain": 0})


# ---------------------------------------------------------------------------------------------------------------
# 5-7. list-of-turns prompts, the doubled question, SFT truncate_prompt
# ---------------------------------------------------------------------------------------------------------------
def test_list_of_turns_prompts(tmp_path):
    path = write_gz(tmp_path / "mt.jsonl.gz", [{"prompt": ["Write a poem.", "Now make it shorter."]},
                                               {"prompt": ["Only one turn."]}])
    assert read_records(DataArguments(dataset_name=path), "prompts") == [
        {"question": "Write a poem.", "history": []}, {"question": "Only one turn.", "history": []}]
    assert read_records(DataArguments(dataset_name=path, prompt_turn=-1), "prompts")[0]["question"] == (
        "Now make it shorter.")
    with pytest.raises(DataError) as err:
        read_records(DataArguments(dataset_name=path, prompt_turn=2), "prompts")
    assert one_line(err) == f"{path}, row 0, field 'prompt': prompt_turn=2 is out of range for 2 turns{SKIP_HINT}"


def test_question_column_called_input_is_read_once(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"input": "What is 2+2?", "answer": "4"}])
    args = DataArguments(dataset_name=path, question_key="input", dataset_format="prompt")
    assert read_records(args, "prompts") == [{"question": "What is 2+2?", "history": [], "columns": {"answer": "4"}}]
    args = DataArguments(dataset_name=path, question_key="input")
    assert read_records(args, "sft") == [{"question": "What is 2+2?", "history": [], "answer": "4"}]


def test_sft_truncate_prompt_keeps_the_newest_turns(tokenizer, caplog):
    t = Template()
    history = [("很早的问题" * 6, "很早的回答" * 6)]
    rec = {"question": "最新的问题", "history": history, "answer": "好的回答"}
    p = encode_prompt(tokenizer, t, rec["question"], history)
    c = encode_response(tokenizer, t, rec["answer"])
    max_len = len(p) - 2  # the prompt alone fills max_length
    with caplog.at_level(logging.WARNING, logger="rlhf_trl.data"):
        with pytest.raises(DataError, match="no row is left"):
            sft_features([rec], tokenizer, t, max_length=max_len)
        feats = sft_features([rec], tokenizer, t, max_length=max_len, length_policy="truncate_prompt", source="s")
    keep = max_len - len(c)
    assert feats["input_ids"][0] == p[-keep:] + c and len(feats["input_ids"][0]) == max_len
    assert feats["completion_mask"][0] == [0] * keep + [1] * len(c)
    assert tokenizer.decode(p[-keep:]).endswith("问：最新的问题\n\n答：")
    assert "s: 1 of 1 prompts truncated from the left to fit max_length" in caplog.text
    # a response that leaves no room: max_prompt_length prompt tokens kept, the trainer cuts the response's end
    feats = sft_features([rec], tokenizer, t, max_length=len(c), length_policy="truncate_prompt", max_prompt_length=3)
    assert feats["input_ids"][0] == p[-3:] + c
    with pytest.raises(ValueError, match="length_policy must be"):
        sft_features([rec], tokenizer, t, length_policy="cut")


# ---------------------------------------------------------------------------------------------------------------
# real files in ../shared/data (read there, never copied into the project)
# ---------------------------------------------------------------------------------------------------------------
def test_real_cmath_prompts_with_question_column_input():
    path = need_shared(DATA / "zh" / "cmath_dev.jsonl")
    records = read_records(DataArguments(dataset_name=path, question_key="input", dataset_format="prompt"), "prompts")
    rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]
    assert len(records) == len(rows) == 600
    assert [r["question"] for r in records] == [row["input"] for row in rows]  # once, not twice


def test_real_gsm8k_compressed_with_a_glob(tmp_path):
    path = need_shared(DATA / "en" / "gsm8k_test.jsonl")
    with open(path, "rb") as src, gzip.open(tmp_path / "gsm8k-00000.jsonl.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    records = read_records(DataArguments(dataset_name=str(tmp_path / "gsm8k-*.jsonl.gz")), "sft")
    assert len(records) == 1319 and records[0]["answer"].rstrip().split("#### ")[-1].isdigit()


def test_real_dpo_rows_in_every_new_shape_read_like_the_original(tmp_path, qwen):
    path = need_shared(DATA / "en" / "dpo_en_demo.json")
    original = read_records(DataArguments(dataset_name=path), "pairs")
    rows = json.loads(Path(path).read_text(encoding="utf-8"))
    role = {"human": "user", "gpt": "assistant", "system": "system"}  # 80 rows open with a system turn

    def messages(turns):
        return [{"role": role[t["from"]], "content": t["value"]} for t in turns]

    trl_rows = [{"prompt": messages(r["conversations"]),
                 "chosen": [{"role": "assistant", "content": r["chosen"]["value"]}],
                 "rejected": [{"role": "assistant", "content": r["rejected"]["value"]}]} for r in rows]
    implicit_rows = [{"chosen": t["prompt"] + t["chosen"], "rejected": t["prompt"] + t["rejected"]} for t in trl_rows]
    openai_rows = [{"messages": t["prompt"], "chosen": t["chosen"][0]["content"],
                    "rejected": t["rejected"][0]["content"]} for t in trl_rows]
    for name, shaped in (("trl", trl_rows), ("implicit", implicit_rows), ("openai", openai_rows)):
        got = read_records(DataArguments(dataset_name=write_gz(tmp_path / f"{name}.jsonl.gz", shaped)), "pairs")
        assert sum("system" in g for g in got) == 80, name  # kept, as the sharegpt reader keeps them
        assert got == original, name
    # Human/Assistant transcripts of the single-turn rows: pairs, and chat-template ids that PPO rebuilds exactly
    single = [r for r in rows if len(r["conversations"]) == 1]
    hh = [{"chosen": f"\n\nHuman: {r['conversations'][0]['value']}\n\nAssistant: {r['chosen']['value']}",
           "rejected": f"\n\nHuman: {r['conversations'][0]['value']}\n\nAssistant: {r['rejected']['value']}"}
          for r in single]
    pairs = read_records(DataArguments(dataset_name=write_gz(tmp_path / "hh.jsonl.gz", hh)), "pairs")
    assert len(pairs) == len(single) == 114
    assert [p["chosen"] for p in pairs] == [" " + r["chosen"]["value"] for r in single]
    template = Template(chat=True)
    feats = pair_features(pairs[:20], qwen, template)
    prompts = prompt_features(pairs[:20], qwen, template, 100_000)["input_ids"]
    for k, (p, r) in enumerate(zip(prompts, single[:20])):
        assert p == apply(qwen, [{"role": "user", "content": r["conversations"][0]["value"].strip()}])
        answer = qwen(r["chosen"]["value"].strip(), add_special_tokens=False, split_special_tokens=True)["input_ids"]
        assert feats["chosen_ids"][k] == p + answer + [IM_END]


def test_real_sharegpt_sft_as_openai_messages(tmp_path):
    path = need_shared(DATA / "zh" / "medical_sft_1k.jsonl")
    original = read_records(DataArguments(dataset_name=path), "sft")
    rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]
    role = {"human": "user", "gpt": "assistant"}
    shaped = [{"messages": [{"role": role[t["from"]], "content": t["value"]} for t in r["conversations"]]}
              for r in rows]
    got = read_records(DataArguments(dataset_name=write_gz(tmp_path / "medical.jsonl.gz", shaped)), "sft")
    assert got == original and len(got) == 1000

"""Every assistant turn of a conversation is an SFT target: masks token by token against the tokenizer's
own assistant mask (TRL's training copy of the Qwen2.5 chat template, with {% generation %} tags) and against the
问/答 text template; tool calls trained, tool results never; long conversations cut at a turn boundary, not dropped;
``mask_history: true`` gives the last-turn-only output of before."""

import json
import logging

import pytest
from conftest import SHARED, write_jsonl

from rlhf_trl.data import (DataArguments, DataError, DataReport, Template, encode_prompt, encode_response,
                           pair_records, prompt_records, read_records, sft_features, sft_records)

QWEN2 = SHARED / "tokenizers" / "qwen2"
IM_END, NL, ASSISTANT = 151645, 198, 77091  # "<|im_end|>", "\n", "assistant" in the Qwen2 vocabulary

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "content": "6, of course."}]
SHAREGPT = {"system": "Be brief.", "conversations": [{"from": {"user": "human", "assistant": "gpt"}[m["role"]],
                                                      "value": m["content"]} for m in MESSAGES[1:]]}
FIREFLY = {"conversation_id": 7, "category": "Math", "system": "Be brief.", "conversation": [
    {"human": MESSAGES[k]["content"], "assistant": MESSAGES[k + 1]["content"]} for k in (1, 3, 5)]}

TOOLS = [{"name": "get_weather", "description": "Weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
CALL = {"name": "get_weather", "arguments": {"city": "北京"}}
CALL_2 = {"name": "get_weather", "arguments": {"city": "上海"}}
TOOL_ROW = {"conversations": [{"from": "human", "value": "北京天气？"},
                              {"from": "function_call", "value": json.dumps(CALL, ensure_ascii=False)},
                              {"from": "observation", "value": "晴，25度"},
                              {"from": "gpt", "value": "北京今天晴，25度。"},
                              {"from": "human", "value": "上海呢？"},
                              {"from": "function_call", "value": json.dumps(CALL_2, ensure_ascii=False)},
                              {"from": "observation", "value": "小雨，20度"},
                              {"from": "gpt", "value": "上海今天小雨，20度。"}],
            "system": "你是助手。", "tools": json.dumps(TOOLS, ensure_ascii=False)}
OPENAI_TOOL_ROW = {"tools": TOOLS, "messages": [  # the same dialogue as OpenAI messages (arguments as JSON text)
    {"role": "system", "content": "你是助手。"}, *[
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            **json.loads(t["value"]), "arguments": json.dumps(json.loads(t["value"])["arguments"])}}]}
        if t["from"] == "function_call" else
        {"role": {"human": "user", "gpt": "assistant", "observation": "tool"}[t["from"]], "content": t["value"]}
        for t in TOOL_ROW["conversations"]]]}


@pytest.fixture(scope="module")
def qwen25():
    """The real Qwen2 tokenizer with the real Qwen2.5 chat template (TRL ships both it and its training copy)."""
    if not QWEN2.is_dir():
        pytest.skip(f"the real Qwen2 tokenizer is not here: {QWEN2} (../shared beside the project)")
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen2_5_chat_template

    tok = AutoTokenizer.from_pretrained(str(QWEN2))
    tok.chat_template = qwen2_5_chat_template
    return tok


def reference(tok, messages: list[dict], tools=None) -> tuple[list[int], list[int]]:
    """``(input_ids, mask)`` the tokenizer itself gives the whole conversation: rendered at once with TRL's training
    copy of the template (`get_training_chat_template`: the Qwen2.5 template with {% generation %} tags round each
    assistant message) and ``return_assistant_tokens_mask=True``. Its spans open right after ``<|im_start|>assistant``
    and close after ``<|im_end|>\\n``; ours run from after the generation prompt ``<|im_start|>assistant\\n`` (where
    PPO starts sampling) through ``<|im_end|>`` (where sampling stops): the two template newlines of each span are
    not targets, and the rendering's last ``\\n`` (after the final ``<|im_end|>``) is not in our ids."""
    from trl.chat_template_utils import get_training_chat_template

    out = tok.apply_chat_template(messages, tools=tools, chat_template=get_training_chat_template(tok), tokenize=True,
                                  return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    assert ids[-2:] == [IM_END, NL] and mask[-1] == 1
    want = [int(m and not (t == NL and ids[k - 1] in (ASSISTANT, IM_END))) for k, (t, m) in enumerate(zip(ids, mask))]
    return ids[:-1], want[:-1]


def spans(tok, ids: list[int], mask: list[int]) -> list[str]:
    """The decoded runs of masked (target) tokens, in order."""
    out, run = [], []
    for t, m in zip(ids + [0], mask + [0]):
        if m:
            run.append(t)
        elif run:
            out.append(tok.decode(run))
            run = []
    return out


def one(records, tok, template, **kwargs) -> tuple[list[int], list[int]]:
    feats = sft_features(records, tok, template, **kwargs)
    assert len(feats["input_ids"]) == 1
    return feats["input_ids"][0], feats["completion_mask"][0]


# --- the chat template: every assistant turn, token by token -----------------------------------------------------
def test_chat_masks_equal_the_tokenizers_assistant_mask_on_the_qwen25_template(qwen25):
    ids, mask = reference(qwen25, MESSAGES)
    for name, row in (("messages", {"messages": MESSAGES}), ("sharegpt", SHAREGPT), ("firefly", FIREFLY)):
        (rec,) = sft_records([row], DataArguments(chat_template=True), "f")
        assert rec["train_history"] is True, name
        assert one([rec], qwen25, Template(chat=True)) == (ids, mask), name
    assert spans(qwen25, ids, mask) == ["Hello!<|im_end|>", "4<|im_end|>", "6, of course.<|im_end|>"]
    # no system turn: the template's default one, in the reference and in ours alike
    (rec,) = sft_records([{"messages": MESSAGES[1:]}], DataArguments(chat_template=True), "f")
    assert one([rec], qwen25, Template(chat=True)) == reference(qwen25, MESSAGES[1:])


def test_tool_calls_are_targets_and_tool_results_never(qwen25):
    messages = None
    for name, row in (("sharegpt", TOOL_ROW), ("openai", OPENAI_TOOL_ROW)):
        (rec,) = sft_records([row], DataArguments(chat_template=True), "f")
        messages = rec["messages"] + [{"role": "assistant", "content": rec["answer"]}]
        report = DataReport("sft")
        ids, mask = one([rec], qwen25, Template(chat=True), report=report)
        assert (ids, mask) == reference(qwen25, messages, TOOLS), name
        assert report.turns == {"train": {"conversations": 1, "assistant_turns_trained": 4, "tool_calls_trained": 2,
                                          "turns_cut": 0}}, name
    got = spans(qwen25, ids, mask)
    assert got == ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "北京"}}\n</tool_call><|im_end|>',
                   "北京今天晴，25度。<|im_end|>",
                   '<tool_call>\n{"name": "get_weather", "arguments": {"city": "上海"}}\n</tool_call><|im_end|>',
                   "上海今天小雨，20度。<|im_end|>"]
    assert not any("tool_response" in s or "晴，25度\n" in s or "小雨，20度\n" in s for s in got)  # results: prompt
    # a conversation ending with a call: the earlier call, reply and the last call trained
    row = {**TOOL_ROW, "conversations": TOOL_ROW["conversations"][:6]}
    (rec,) = sft_records([row], DataArguments(chat_template=True), "f")
    ids, mask = one([rec], qwen25, Template(chat=True))
    assert (ids, mask) == reference(qwen25, rec["messages"] + [rec["target"]], TOOLS)
    assert len(spans(qwen25, ids, mask)) == 3 and spans(qwen25, ids, mask)[2].startswith("<tool_call>")


def test_a_template_rendering_history_otherwise_is_refused_in_one_line(qwen25):
    import copy

    tok = copy.deepcopy(qwen25)  # a generation prompt the template does not repeat for earlier turns (Qwen3-like)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think></think>{% endif %}")
    (rec,) = sft_records([{"messages": MESSAGES}], DataArguments(chat_template=True), "f")
    with pytest.raises(ValueError) as err:
        sft_features([rec], tok, Template(chat=True))
    assert str(err.value) == (f"the chat template of '{tok.name_or_path}' renders the earlier turns of the "
                              "conversation ending 'And 3+3?' differently as the conversation grows, so its assistant "
                              "turns cannot be trained one by one; set mask_history: true (train the last turn only)")
    (rec,) = sft_records([{"messages": MESSAGES}], DataArguments(chat_template=True, mask_history=True), "f")
    assert sum(one([rec], tok, Template(chat=True))[1]) == len(tok("6, of course.")["input_ids"]) + 1


# --- the text templates: hand-written renderings -----------------------------------------------------------------
@pytest.mark.parametrize("template, pieces", [
    (Template(), ["问：Hi\n\n答：", "Hello!", "<E>", "\n\n问：2+2?\n\n答：", "4", "<E>",
                  "\n\n问：And 3+3?\n\n答：", "6, of course.", "<E>"]),
    (Template(prompt="{system}Q: {question}\nA:", completion=" {answer}"),
     ["Be brief.Q: Hi\nA:", " Hello!", "<E>", "\n\nQ: 2+2?\nA:", " 4", "<E>", "\n\nQ: And 3+3?\nA:", " 6, of course.",
      "<E>"]),
    (Template(prompt="raw"), ["Hi", "Hello!", "<E>", "2+2?", "4", "<E>", "And 3+3?", "6, of course.", "<E>"]),
])
def test_text_template_renders_history_as_before_with_every_answer_a_target(qwen25, template, pieces):
    """Prompt pieces tokenized on their own, each answer (as the completion template renders it) then the EOS:
    the mask is 1 on exactly the answers and their EOS. Joined, the text is `Template.format_prompt`'s rendering of
    the history, the EOS after each answer."""
    from rlhf_trl.data.tokenize import encode_text

    (rec,) = sft_records([SHAREGPT], DataArguments(), "f")
    ids, mask = one([rec], qwen25, template)
    want_ids, want_mask = [], []
    for k, piece in enumerate(pieces):
        part = [IM_END] if piece == "<E>" else encode_text(qwen25, piece)
        want_ids += part
        want_mask += [int(k % 3 != 0)] * len(part)
    assert (ids, mask) == (want_ids, want_mask)
    history = template.format_prompt("And 3+3?", [("Hi", "Hello!"), ("2+2?", "4")], system="Be brief.")
    assert qwen25.decode(ids).replace("<|im_end|>", "") == history + template.format_completion("6, of course.")


def test_mask_history_true_restores_the_last_turn_only_output(qwen25):
    rows = [SHAREGPT, FIREFLY, {"messages": MESSAGES},
            {"instruction": "And 3+3?", "output": "6, of course.", "history": [["Hi", "Hello!"], ["2+2?", "4"]]}]
    history = [("Hi", "Hello!"), ("2+2?", "4")]
    for chat in (False, True):
        template = Template(chat=chat)
        records = [r for row in rows for r in sft_records([row], DataArguments(mask_history=True, chat_template=chat),
                                                          "f")]  # one call a row: one format a file
        assert all("train_history" not in r for r in records)
        system = "Be brief." if chat else None
        prompt = encode_prompt(qwen25, template, "And 3+3?", history, system)
        answer = encode_response(qwen25, template, "6, of course.")
        feats = sft_features(records, qwen25, template)
        n = 3 if chat else 4  # the alpaca row has no system turn (the text template drops it anyway)
        assert feats["input_ids"][:n] == [prompt + answer] * n
        assert feats["completion_mask"][:n] == [[0] * len(prompt) + [1] * len(answer)] * n
        every = sft_features(sft_records(rows[3:], DataArguments(chat_template=chat), "f"), qwen25, template)
        assert every["input_ids"][0][-len(answer):] == answer and sum(every["completion_mask"][0]) > len(answer)
    # a single-turn row is the same either way
    single = {"instruction": "Hi", "output": "Hello!"}
    assert sft_records([single], DataArguments(), "f") == sft_records([single], DataArguments(mask_history=True), "f")


def test_empty_history_reply_is_rendered_but_not_a_target(qwen25):
    row = {"conversation": [{"human": "Hi", "assistant": ""}, {"human": "2+2?", "assistant": "4"}]}
    (rec,) = sft_records([row], DataArguments(), "f")
    report = DataReport("sft")
    ids, mask = one([rec], qwen25, Template(), report=report)
    assert qwen25.decode(ids) == "问：Hi\n\n答：<|im_end|>\n\n问：2+2?\n\n答：4<|im_end|>"
    assert spans(qwen25, ids, mask) == ["4<|im_end|>"]
    assert report.turns["train"]["assistant_turns_trained"] == 1


# --- records of the other stages keep their meaning --------------------------------------------------------------
def test_pairs_prompts_kto_and_prompt_completion_rows_keep_the_history_as_prompt(tmp_path):
    pair_row = {"conversations": SHAREGPT["conversations"][:-1], "chosen": "6.", "rejected": "7."}
    assert all("train_history" not in r for r in pair_records([pair_row], DataArguments(), "f"))
    assert all("train_history" not in r for r in prompt_records([SHAREGPT], DataArguments(), "f"))
    kto = {**SHAREGPT, "label": True}  # an unpaired label judges the last answer: its history stays the prompt
    (rec,) = sft_records([kto], DataArguments(), "f")
    assert "train_history" not in rec and rec["history"]
    trl_row = {"prompt": MESSAGES[1:4], "completion": [MESSAGES[4]]}  # TRL prompt-completion: the prompt is a prompt
    (rec,) = sft_records([trl_row], DataArguments(), "f")
    assert "train_history" not in rec and rec["history"] == [("Hi", "Hello!")]
    # the Arrow fast path of messages files marks records as the row-by-row path does
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": MESSAGES}, {"messages": MESSAGES[:3]}])
    assert read_records(DataArguments(dataset_name=path), "sft") == sft_records(
        [{"messages": MESSAGES}, {"messages": MESSAGES[:3]}], DataArguments(), "f")
    assert [r.get("train_history") for r in read_records(DataArguments(dataset_name=path), "sft")] == [True, None]


# --- long conversations: cut at a turn boundary, counted ---------------------------------------------------------
def long_firefly(n: int, turns: int = 5) -> list[dict]:
    """Firefly rows of ``turns`` long exchanges (~35 prompt tokens, ~80 reply tokens each: ~575 tokens a row)."""
    return [{"conversation_id": k, "category": "Brainstorming", "conversation": [
        {"human": f"第{k}段第{t}问：" + "请详细说明这个问题的历史背景、主要原因以及可能的影响。" * 2,
         "assistant": f"第{t}答：" + "这个问题的形成有很多方面的原因，需要从经济、社会和文化等角度分别分析。" * 4}
        for t in range(turns)]} for k in range(n)]


def test_firefly_with_five_long_turns_trains_at_max_length_256(tmp_path, qwen25, caplog):
    path = write_jsonl(tmp_path / "firefly.jsonl", long_firefly(6))
    old = read_records(DataArguments(dataset_name=path, mask_history=True), "sft")
    with pytest.raises(DataError, match="no row is left: every prompt fills max_length=256 tokens"):
        sft_features(old, qwen25, Template(), max_length=256, source="firefly.jsonl")
    records = read_records(DataArguments(dataset_name=path), "sft")
    report = DataReport("sft")
    with caplog.at_level(logging.WARNING, logger="rlhf_trl.data"):
        feats = sft_features(records, qwen25, Template(), max_length=256, source="firefly.jsonl", report=report)
    full = sft_features(records, qwen25, Template())  # no limit: all five turns
    assert len(feats["input_ids"]) == 6 and report.dropped == {}
    for ids, mask, all_ids, all_mask in zip(*feats.values(), *full.values()):
        assert ids == all_ids[: len(ids)] and mask == all_mask[: len(mask)]  # a prefix: the turns that fit
        assert mask[-1] == 1 and (len(ids) <= 256 or ids[:256].count(IM_END) >= 1)  # ends in a reply
        kept = spans(qwen25, ids, mask)
        assert 1 <= len(kept) < 5 and all(s.startswith(f"第{t}答：") for t, s in enumerate(kept))
    trained = sum(len(spans(qwen25, ids, mask)) for ids, mask in zip(*feats.values()))
    assert report.turns == {"train": {"conversations": 6, "assistant_turns_trained": trained, "tool_calls_trained": 0,
                                      "turns_cut": 30 - trained + report.truncated.get(
                                          "train: answers are cut at max_length", 0)}}
    assert report.truncated["train: conversations cut after the last turn that fits max_length"] == 6
    assert "firefly.jsonl: 6 of 6 conversations cut after the last turn that fits max_length=256 tokens" in caplog.text
    assert "6 conversations" in report.summary()
    # only a first prompt that fills max_length drops a row (counted); truncate_prompt cuts it from the left instead
    report = DataReport("sft")
    with pytest.raises(DataError, match="no row is left"):
        sft_features(records, qwen25, Template(), max_length=30, report=report, source="s")
    assert report.dropped == {"train: rows dropped: the prompt alone fills max_length": 6}
    report = DataReport("sft")
    feats = sft_features(records, qwen25, Template(), max_length=30, length_policy="truncate_prompt", report=report)
    assert all(m[0] == 0 and spans(qwen25, i, m) and len(spans(qwen25, i, m)) == 1 for i, m in zip(*feats.values()))
    assert report.turns["train"]["turns_cut"] == 30  # each row: its first reply cut, the four later turns left out


@pytest.mark.slow
def test_sft_stage_trains_a_long_firefly_file_with_every_turn(tmp_path, assets):
    from conftest import RECIPES

    from rlhf_trl import sft

    path = write_jsonl(tmp_path / "firefly.jsonl", long_firefly(12))
    argv = ["--config", f"{RECIPES}/sft.yaml", "--dataset_name", path, "--dataset_format", "auto",
            "--model_name_or_path", assets["base_model"], "--output_dir", str(tmp_path / "sft"),
            "--max_length", "256", "--max_steps", "2", "--eval_split_size", "2"]
    with pytest.raises(DataError, match="no row is left: every prompt fills max_length=256 tokens"):
        sft.main(argv + ["--mask_history", "true"])  # the last turn only: its four-turn prompt fills max_length
    result = sft.main(argv)
    assert result["metrics"]["num_train_rows"] == 10 and result["metrics"]["global_step"] == 2
    report = json.loads((tmp_path / "sft" / "data_report.json").read_text(encoding="utf-8"))
    assert report["dropped"] == {} and report["turns"]["eval"]["conversations"] == 2
    train = report["turns"]["train"]
    assert train["conversations"] == 10 and train["assistant_turns_trained"] >= 10
    assert train["assistant_turns_trained"] + train["turns_cut"] >= 50  # 5 turns a row: trained, cut or left out


def test_real_multi_turn_rows_match_the_tokenizers_assistant_mask(qwen25):
    path = SHARED / "data" / "zh" / "oaast_sft_zh.json"
    if not path.exists():
        pytest.skip(f"real data not here: {path} (../shared beside the project)")
    records = [r for r in read_records(DataArguments(dataset_name=str(path), chat_template=True), "sft")
               if r.get("train_history")][:24]
    assert len(records) == 24  # alpaca rows whose history column holds earlier turns
    feats = sft_features(records, qwen25, Template(chat=True))
    for rec, ids, mask in zip(records, *feats.values()):
        messages = [{"role": role, "content": text} for q, a in rec["history"]
                    for role, text in (("user", q), ("assistant", a))]
        messages += [{"role": "user", "content": rec["question"]}, {"role": "assistant", "content": rec["answer"]}]
        assert (ids, mask) == reference(qwen25, messages), rec["question"][:30]

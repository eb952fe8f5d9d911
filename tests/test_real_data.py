"""The readers, the shared tokenization and the three stages on real data from ../shared (see ../shared/data/SOURCES.md).

Skipped as a whole when ../shared is absent. The stage tests run the recipes/zh-oasst recipes through each stage's
``main(argv)`` with overrides that make them small (a few steps on a random-init tiny Qwen2 that uses the real Qwen2
tokenizer), so the module takes about a minute on 2 CPU cores.
"""

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
SHARED = (Path(__file__).parents[1] / ".." / "shared").resolve()
ZH = SHARED / "data" / "zh"
QWEN2 = SHARED / "tokenizers" / "qwen2"
if not (ZH.is_dir() and QWEN2.is_dir()):
    pytest.skip(
        f"../shared is absent: {SHARED} must hold data/zh/ and tokenizers/qwen2/ (see ../shared/data/SOURCES.md)",
        allow_module_level=True,
    )

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from rlhf_trl.data import (  # noqa: E402
    DataArguments,
    Template,
    encode_prompt,
    encode_response,
    pair_features,
    prompt_features,
    read_records,
)
from rlhf_trl.models import load_tokenizer  # noqa: E402

RECIPES = ROOT / "recipes" / "zh-oasst"
OAAST_SFT = str(ZH / "oaast_sft_zh.json")
OAAST_RM = str(ZH / "oaast_rm_zh.json")
DPO_500 = str(ZH / "reward_dpo_zh_500.jsonl")
DPO_DEMO = str(ZH / "dpo_zh_demo.json")
MEDICAL = str(ZH / "medical_sft_1k.jsonl")
DPO_EN = SHARED / "data" / "en" / "dpo_en_demo.json"


def raw_rows(path) -> list[dict]:
    path = str(path)
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()] if path.endswith(".jsonl") else json.load(f)


@pytest.fixture(scope="module")
def qwen_tok():
    return load_tokenizer(str(QWEN2))


# ----------------------------------------------------------------------------------------------------------------
# readers on the real files
# ----------------------------------------------------------------------------------------------------------------
def test_ranked_oasst_pair_counts():
    """Ranked lists (best first): all ordered pairs, or adjacent pairs, of each list's distinct answers.

    The real file holds 6 lists in which one answer appears twice verbatim (e.g. row 144 is [A, A]); a repeated
    answer counts once, at its best rank, so n below is the number of distinct answers per list.
    """
    rows = raw_rows(OAAST_RM)
    distinct = [len(dict.fromkeys(r["output"])) for r in rows]
    raw = [len(r["output"]) for r in rows]
    assert sum(d != n for d, n in zip(distinct, raw)) == 6  # upstream duplicates, documented here
    assert distinct[144] == 1  # [A, A]: no preference, no pair

    pairs_all = read_records(DataArguments(dataset_name=OAAST_RM, dataset_format="ranked", ranked_pairs="all"), "pairs")
    assert len(pairs_all) == sum(n * (n - 1) // 2 for n in distinct) == 1798
    assert sum(n * (n - 1) // 2 for n in raw) == 1809  # what the count would be with duplicates kept
    adjacent = read_records(
        DataArguments(dataset_name=OAAST_RM, dataset_format="ranked", ranked_pairs="adjacent"), "pairs"
    )
    assert len(adjacent) == sum(n - 1 for n in distinct) == 1212
    assert all(p["chosen"] != p["rejected"] for p in pairs_all)

    # best-first order: row 0's first pair is (answer 0 > answer 1), with the row's question and history
    r0 = rows[0]
    assert pairs_all[0]["chosen"] == r0["output"][0] and pairs_all[0]["rejected"] == r0["output"][1]
    assert pairs_all[0]["question"] == r0["instruction"]
    # auto-detection sees a list in 'output' and picks the ranked format too
    assert len(read_records(DataArguments(dataset_name=OAAST_RM), "pairs")) == 1798


def test_ranked_oasst_keeps_history():
    rows = raw_rows(OAAST_RM)
    prompts = read_records(DataArguments(dataset_name=OAAST_RM, dataset_format="prompt"), "prompts")
    assert len(prompts) == len(rows) == 775
    multi = [i for i, r in enumerate(rows) if r["history"]]
    assert len(multi) > 300
    for i in multi:
        assert prompts[i]["history"] == [tuple(t) for t in rows[i]["history"]]
        assert prompts[i]["question"] == rows[i]["instruction"]


@pytest.mark.parametrize("path", [DPO_500, DPO_DEMO], ids=["reward_dpo_zh_500", "dpo_zh_demo"])
def test_sharegpt_preference_files_read_into_pairs(path):
    """conversations [{from, value}] + chosen/rejected (plain strings in one file, {from, value} objects in the other).

    Both zh files are single-turn: every conversation is [human] or [system, human]; the system turn is not part of
    the 问/答 template and is dropped, so these rows have no history.
    """
    rows = raw_rows(path)
    pairs = read_records(DataArguments(dataset_name=path), "pairs")
    assert len(pairs) == len(rows)
    shapes = {tuple(t["from"] for t in r["conversations"]) for r in rows}
    assert shapes == {("human",), ("system", "human")}
    for row, pair in zip(rows, pairs):
        value = lambda x: x["value"] if isinstance(x, dict) else x  # noqa: E731
        assert pair["chosen"] == value(row["chosen"]) and pair["rejected"] == value(row["rejected"])
        assert pair["question"] == row["conversations"][-1]["value"]
        assert pair["history"] == []
    if path == DPO_DEMO:
        assert isinstance(rows[0]["chosen"], dict) and set(rows[0]["chosen"]) == {"from", "value"}
    else:
        assert isinstance(rows[0]["chosen"], str)


@pytest.mark.skipif(not DPO_EN.is_file(), reason="../shared/data/en/dpo_en_demo.json is absent")
def test_sharegpt_multi_turn_keeps_earlier_turns_in_history():
    """The zh sharegpt files have no multi-turn rows; the en demo (same format) does: earlier turns become history."""
    rows = raw_rows(DPO_EN)
    pairs = read_records(DataArguments(dataset_name=str(DPO_EN)), "pairs")
    multi = [i for i, r in enumerate(rows) if len(r["conversations"]) > 2]
    assert len(multi) > 100
    for i in multi:
        turns = [t["value"] for t in rows[i]["conversations"]]
        assert [t["from"] for t in rows[i]["conversations"]][0::2] == ["human"] * ((len(turns) + 1) // 2)
        assert pairs[i]["history"] == [(turns[k], turns[k + 1]) for k in range(0, len(turns) - 1, 2)]
        assert pairs[i]["question"] == turns[-1]


def test_medical_sharegpt_reads_into_sft_records():
    rows = raw_rows(MEDICAL)
    records = read_records(DataArguments(dataset_name=MEDICAL), "sft")
    assert len(records) == len(rows) == 1000
    assert {tuple(t["from"] for t in r["conversations"]) for r in rows} == {("human", "gpt")}  # all single-turn
    for row, rec in zip(rows, records):
        assert rec["question"] == row["conversations"][0]["value"]
        assert rec["answer"] == row["conversations"][1]["value"]
        assert rec["history"] == []


def test_alpaca_oasst_sft_keeps_history():
    rows = raw_rows(OAAST_SFT)
    records = read_records(DataArguments(dataset_name=OAAST_SFT), "sft")
    assert len(records) == len(rows) == 689
    multi = [i for i, r in enumerate(rows) if r["history"]]
    assert len(multi) == 390
    for row, rec in zip(rows, records):
        assert rec["answer"] == row["output"]
        assert rec["history"] == [tuple(t) for t in row["history"]]
        expected_q = row["instruction"] + (f"\n{row['input']}" if row["input"].strip() else "")
        assert rec["question"] == expected_q


# ----------------------------------------------------------------------------------------------------------------
# token ids: the RM trains on exactly the ids PPO scores
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.slow  # tokenizes every real pair (~15 s)
@pytest.mark.parametrize(
    "path,fmt", [(OAAST_RM, "ranked"), (DPO_500, "auto")], ids=["oaast_rm_zh", "reward_dpo_zh_500"]
)
def test_pair_ids_equal_the_ppo_construction(qwen_tok, path, fmt):
    """chosen_ids == PPO's prompt ids + the response's ids + EOS, on every real pair; and the joined-string pitfall.

    PPO feeds ``prompt_features`` ids to the policy and scores ``prompt ids + generated ids`` (cut after EOS), so
    a policy that generated exactly the chosen answer would be scored on the ids the RM was trained on.
    """
    tok, template = qwen_tok, Template()
    eos = tok.eos_token_id
    records = read_records(DataArguments(dataset_name=path, dataset_format=fmt), "pairs")
    feats = pair_features(records, tok, template)
    ppo_prompts = prompt_features(records, tok, template, max_prompt_length=10**9)["input_ids"]
    assert len(feats["chosen_ids"]) == len(records)

    differ = []
    for i, rec in enumerate(records):
        chosen, rejected = feats["chosen_ids"][i], feats["rejected_ids"][i]
        generated = tok(template.format_completion(rec["chosen"]), add_special_tokens=False)["input_ids"] + [eos]
        assert chosen == ppo_prompts[i] + generated
        assert chosen == encode_prompt(tok, template, rec["question"], rec["history"]) + encode_response(
            tok, template, rec["chosen"]
        )
        assert feats["prompt_length"][i] == len(ppo_prompts[i])
        assert rejected[: len(ppo_prompts[i])] == ppo_prompts[i]
        assert chosen[-1] == eos and rejected[-1] == eos
        assert eos not in chosen[:-1]  # no EOS inside the text: the reward is read at the final one
        # the ids spell the text exactly (byte-level BPE is lossless)
        text = template.format_prompt(rec["question"], rec["history"]) + template.format_completion(rec["chosen"])
        assert tok.decode(chosen[:-1]) == text
        naive = tok(text, add_special_tokens=False)["input_ids"] + [eos]
        if naive != chosen:
            differ.append(i)
            assert tok.decode(naive[:-1]) == text  # same text, different token boundary

    # Boundary behaviour on real rows: tokenizing the joined string merges '：' (the end of 问：...答：) with an
    # answer that starts with some punctuation, e.g. '：' + '"' -> one token '："'. Answers that start with a CJK
    # character tokenize the same either way. So the naive ids differ on a minority of real rows, and PPO (which
    # concatenates ids) could never produce them.
    assert 0 < len(differ) < len(records) // 10
    i = differ[0]
    p_len = feats["prompt_length"][i]
    naive = tok(
        template.format_prompt(records[i]["question"], records[i]["history"])
        + template.format_completion(records[i]["chosen"]),
        add_special_tokens=False,
    )["input_ids"]
    boundary = tok.decode(naive[p_len - 1 : p_len])
    assert boundary.startswith("：") and len(boundary) > 1, boundary


def test_truncated_pairs_keep_the_prompt_tail_like_ppo(qwen_tok):
    """length_policy=truncate_prompt cuts the prompt from the left, as PPO's max_prompt_length does."""
    tok, template = qwen_tok, Template()
    records = read_records(DataArguments(dataset_name=OAAST_RM, dataset_format="ranked", max_samples=200), "pairs")
    feats = pair_features(records, tok, template, max_length=256, length_policy="truncate_prompt")
    full = pair_features(records, tok, template)
    by_chosen = {tuple(c[p:]): (c, p) for c, p in zip(full["chosen_ids"], full["prompt_length"])}
    truncated = 0
    for c, p in zip(feats["chosen_ids"], feats["prompt_length"]):
        assert len(c) <= 256
        whole, whole_p = by_chosen[tuple(c[p:])]
        if p < whole_p:
            truncated += 1
            assert c[:p] == whole[:whole_p][-p:]
    assert truncated > 0


# ----------------------------------------------------------------------------------------------------------------
# the three stages on real data through the zh-oasst recipes (small overrides)
# ----------------------------------------------------------------------------------------------------------------
def weights(model_dir) -> dict:
    return load_file(os.path.join(model_dir, "model.safetensors"))


def differs(a: dict, b: dict, keys=None) -> bool:
    keys = keys or sorted(set(a) & set(b))
    assert keys
    return any(not torch.equal(a[k], b[k]) for k in keys)


@pytest.fixture(scope="module")
def base_model(tmp_path_factory, qwen_tok):
    from rlhf_trl.tiny import build_tiny_qwen2

    out = str(tmp_path_factory.mktemp("zh_base") / "base_model")
    build_tiny_qwen2(qwen_tok, out)
    return out


@pytest.fixture(scope="module")
def sft_run(base_model, tmp_path_factory):
    from rlhf_trl import sft

    return sft.main([
        "--config", str(RECIPES / "sft.yaml"), "--dataset_name", OAAST_SFT,
        "--model_name_or_path", base_model, "--output_dir", str(tmp_path_factory.mktemp("zh_sft")),
        "--max_samples", "64", "--max_steps", "5", "--max_length", "128", "--eval_split_size", "8",
        "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1", "--logging_steps", "1",
    ])


@pytest.fixture(scope="module")
def rm_run(sft_run, tmp_path_factory):
    from rlhf_trl import rm

    return rm.main([
        "--config", str(RECIPES / "rm.yaml"), "--dataset_name", OAAST_RM,
        "--model_name_or_path", sft_run["merged"], "--output_dir", str(tmp_path_factory.mktemp("zh_rm")),
        "--max_samples", "64", "--max_steps", "5", "--eval_split_size", "24", "--logging_steps", "1",
    ])


@pytest.fixture(scope="module")
def ppo_run(sft_run, rm_run, tmp_path_factory):
    from conftest import import_ppo

    ppo = import_ppo()
    return ppo.main([
        "--config", str(RECIPES / "ppo.yaml"), "--dataset_name", OAAST_RM,
        "--sft_model_path", sft_run["merged"], "--reward_model_path", rm_run["merged"],
        "--output_dir", str(tmp_path_factory.mktemp("zh_ppo")),
        "--max_samples", "64", "--eval_split_size", "4", "--per_device_eval_batch_size", "4",
        "--total_episodes", "8", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
        "--local_rollout_forward_batch_size", "4", "--response_length", "16", "--max_prompt_length", "64",
        "--log_samples_every", "10", "--logging_steps", "1",
    ])


@pytest.mark.slow  # trains on the real data (~1 min for the module)
def test_sft_on_real_data_changes_the_weights(base_model, sft_run):
    assert differs(weights(base_model), weights(sft_run["merged"]))
    m = sft_run["metrics"]
    # 64 rows -> 56 train + 8 eval, less the rows whose prompt alone fills max_length=128 tokens (no answer left)
    assert 0 < m["num_train_rows"] <= 56 and 0 < m["num_eval_rows"] <= 8
    assert m["eval_loss"] == m["eval_loss"]  # not NaN: every eval row kept answer tokens within max_length


@pytest.mark.slow  # trains on the real data (~1 min for the module)
def test_rm_on_real_data_writes_eval_metrics(rm_run):
    with open(os.path.join(rm_run["output_dir"], "eval_metrics.json"), encoding="utf-8") as f:
        metrics = json.load(f)
    assert {"accuracy", "margin", "length_baseline_accuracy", "num_pairs"} <= set(metrics)
    assert metrics["num_pairs"] > 0
    assert 0.0 <= metrics["accuracy"] <= 1.0
    assert "score.weight" in weights(rm_run["merged"])


@pytest.mark.slow  # trains on the real data (~1 min for the module)
def test_ppo_on_real_data_trains_policy_and_value_model(sft_run, rm_run, ppo_run):
    from transformers import AutoModelForSequenceClassification

    assert ppo_run["metrics"]["global_step"] == 2
    assert differs(weights(sft_run["merged"]), weights(ppo_run["merged"]))
    value_dir = ppo_run["value_model"]
    assert os.path.isdir(value_dir) and value_dir == os.path.join(ppo_run["output_dir"], "value_model")
    value = AutoModelForSequenceClassification.from_pretrained(value_dir, num_labels=1)
    assert value.config.num_labels == 1
    assert differs(weights(rm_run["merged"]), weights(value_dir))  # the value model is trained, the RM is not
    with open(os.path.join(ppo_run["output_dir"], "samples.jsonl"), encoding="utf-8") as f:
        samples = [json.loads(line) for line in f]
    assert samples and all("答：" in s["query"] for s in samples)


@pytest.mark.slow  # trains on the real data (~1 min for the module)
def test_merge_and_eval_on_the_real_data_recipe(sft_run, rm_run, ppo_run, tmp_path):
    """`rlhf-trl merge` and `rlhf-trl eval` on the zh-oasst runs: merged models reload; the report is complete."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from rlhf_trl import evaluate, merge

    policy_dir, rm_dir = tmp_path / "policy", tmp_path / "rm"
    merge.main(["--adapter", os.path.join(ppo_run["output_dir"], "adapter"), "--output", str(policy_dir)])
    merge.main(["--adapter", os.path.join(rm_run["output_dir"], "adapter"), "--output", str(rm_dir)])
    policy = AutoModelForCausalLM.from_pretrained(str(policy_dir))
    assert not differs(weights(ppo_run["merged"]), weights(str(policy_dir)))  # = the merged policy PPO saved
    assert AutoModelForSequenceClassification.from_pretrained(str(rm_dir)).config.num_labels == 1
    assert policy.config.vocab_size >= 151643  # the real Qwen2 tokenizer's vocabulary

    result = evaluate.main([
        "--config", str(RECIPES / "ppo.yaml"), "--dataset_name", OAAST_RM,
        "--sft_model_path", sft_run["merged"], "--reward_model_path", rm_run["merged"],
        "--output_dir", ppo_run["output_dir"], "--max_samples", "64", "--eval_split_size", "4",
        "--response_length", "16", "--max_prompt_length", "64", "--samples_per_prompt", "2",
    ])
    saved = json.load(open(os.path.join(ppo_run["output_dir"], "eval.json"), encoding="utf-8"))
    for key in evaluate.FIGURES + evaluate.RM_FIGURES:
        assert saved[key] == saved[key] and key in result, key  # present and not NaN
    assert saved["num_samples"] == 8 and saved["rm_num_pairs"] > 0
    report = open(result["report"], encoding="utf-8").read()
    assert "## Samples" in report and "rm_accuracy" in report
    rows = [json.loads(line) for line in open(result["samples"], encoding="utf-8")]
    assert any(any("\u4e00" <= ch <= "\u9fff" for ch in r["question"]) for r in rows)  # Chinese prompts
    for png in result["plots"].values():
        assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"

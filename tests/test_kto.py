"""KTO's data (`rlhf-trl kto`, `rlhf_trl.kto`): what `trl.KTOTrainer` is fed.

- unpaired rows read in LLaMA-Factory's KTO format (sharegpt ``conversations`` / ``messages`` + a boolean
  ``kto_tag``) and in TRL's (``prompt`` / ``completion`` / ``label``, text or message lists): one labelled example per
  row, tokenized as every stage tokenizes (prompt ids + answer ids + EOS);
- a pairwise file gives two examples per pair, the chosen answer desirable and the rejected one undesirable, over the
  very ids the reward model trains on; ranked lists give two per pair of ``ranked_pairs``;
- the KL completions are TRL's: each block of ``per_device_train_batch_size`` rows rotated by one;
- a file with one kind of label, or rows without a label or a pair, stop in one line before anything is written;
  ``data_report.json`` counts desirable / undesirable examples per split.
(A short KTO run on the demo: tests/test_stage3.py; exact resume: tests/test_exact_resume.py; ZeRO-3: test_zero.py.)
"""

import json
import os
from types import SimpleNamespace

import pytest

from conftest import REPO

RECIPE = os.path.join(REPO, "recipes", "demo", "kto.yaml")
QUESTION, GOOD, BAD = "你觉得咖啡怎么样？", "咖啡非常好，我很喜欢。", "咖啡很糟糕，我很讨厌。"


def write_jsonl(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return str(path)


def read(path, **kw):
    from rlhf_trl.data import DataArguments, read_records

    return read_records(DataArguments(dataset_name=path, **kw), "unpaired")


def expected_ids(tokenizer, answer: str) -> tuple[list[int], list[int]]:
    from rlhf_trl.data import Template, encode_prompt, encode_response

    return encode_prompt(tokenizer, Template(), QUESTION), encode_response(tokenizer, Template(), answer)


LLAMA_FACTORY = [  # LLaMA-Factory's KTO rows: a conversation and a boolean kto_tag
    {"messages": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": GOOD}], "kto_tag": True},
    {"messages": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": BAD}], "kto_tag": False}]
SHAREGPT = [{"conversations": [{"from": "human", "value": QUESTION}, {"from": "gpt", "value": a}], "kto_tag": t}
            for a, t in ((GOOD, True), (BAD, False))]
TRL_TEXT = [{"prompt": QUESTION, "completion": a, "label": t} for a, t in ((GOOD, True), (BAD, False))]
TRL_MESSAGES = [{"prompt": [{"role": "user", "content": QUESTION}], "completion": [{"role": "assistant", "content": a}],
                 "label": t} for a, t in ((GOOD, True), (BAD, False))]


@pytest.mark.parametrize("rows", [LLAMA_FACTORY, SHAREGPT, TRL_TEXT, TRL_MESSAGES],
                         ids=["llama-factory-messages", "llama-factory-sharegpt", "trl-text", "trl-messages"])
def test_unpaired_rows_read_as_labelled_examples(rows, tmp_path, tokenizer):
    from rlhf_trl.data import Template, unpaired_features

    records = read(write_jsonl(tmp_path / "kto.jsonl", rows * 3))
    assert [(r["question"], r["answer"], r["label"]) for r in records] == [(QUESTION, GOOD, True),
                                                                           (QUESTION, BAD, False)] * 3
    feats = unpaired_features(records, tokenizer, Template(), 64)
    for answer, label, p, c, lab in zip([GOOD, BAD] * 3, [True, False] * 3, feats["prompt_ids"],
                                        feats["completion_ids"], feats["label"]):
        assert (p, c) == expected_ids(tokenizer, answer) and lab is label
        assert c[-1] == tokenizer.eos_token_id


def test_pairs_give_two_examples_each_over_the_reward_models_ids(tmp_path, tokenizer, assets):
    """A pairwise row -> (prompt, chosen, True), (prompt, rejected, False): the ids `pair_features` gives the RM."""
    from rlhf_trl.data import DataArguments, Template, pair_features, read_records, unpaired_features

    rows = [{"prompt": QUESTION, "chosen": GOOD, "rejected": BAD}, {"prompt": "你喜欢地铁吗？", "chosen": "地铁很棒。",
                                                                    "rejected": ""}]
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    records = read(path)
    assert [(r["answer"], r["label"]) for r in records] == [(GOOD, True), (BAD, False), ("地铁很棒。", True), ("", False)]
    kto = unpaired_features(records, tokenizer, Template(), 64)
    rm = pair_features(read_records(DataArguments(dataset_name=path), "pairs"), tokenizer, Template(), 64)
    for k, (c, r, n) in enumerate(zip(rm["chosen_ids"], rm["rejected_ids"], rm["prompt_length"])):
        assert kto["prompt_ids"][2 * k] + kto["completion_ids"][2 * k] == c
        assert kto["prompt_ids"][2 * k + 1] + kto["completion_ids"][2 * k + 1] == r
        assert len(kto["prompt_ids"][2 * k]) == n
    assert kto["completion_ids"][3] == [tokenizer.eos_token_id]  # an empty rejected answer: the EOS alone
    # ranked lists: two examples per pair of ranked_pairs (the demo's lists of 3: 3 pairs, or 2 adjacent)
    ranked = read(assets["rm"], dataset_format="ranked", max_samples=4)
    assert len(ranked) == 4 * 3 * 2 and sum(r["label"] for r in ranked) == 4 * 3
    assert len(read(assets["rm"], dataset_format="ranked", max_samples=4, ranked_pairs="adjacent")) == 4 * 2 * 2


def test_kl_completions_are_trls_rotation():
    """`kto_dataset` rotates completions by one within blocks of the batch size, as TRL's `_prepare_dataset` does
    (``datasets.map(batched=True, batch_size=per_device_train_batch_size)``); no KL term: no column."""
    from rlhf_trl.kto import kto_dataset

    feats = {"prompt_ids": [[k] for k in range(7)], "completion_ids": [[10 + k] for k in range(7)],
             "label": [k % 2 == 0 for k in range(7)]}
    ds = kto_dataset(feats, 3)

    def trl_rotation(examples):  # trl.trainer.kto_trainer.KTOTrainer._prepare_dataset's add_kl_completion_ids
        examples["KL_completion_ids"] = [examples["completion_ids"][-1]] + examples["completion_ids"][:-1]
        return examples

    from datasets import Dataset

    trl = Dataset.from_dict(feats).map(trl_rotation, batched=True, batch_size=3)
    assert ds["KL_completion_ids"] == trl["KL_completion_ids"] == [[12], [10], [11], [15], [13], [14], [16]]
    assert ds["label"] == feats["label"] and "KL_completion_ids" not in kto_dataset(feats, None).column_names


def run_kto(tmp_path, capsys, monkeypatch, path, model):
    from rlhf_trl.cli_launch import run_stage

    monkeypatch.delenv("RLHF_TRL_DEBUG", raising=False)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        run_stage("kto", ["--config", RECIPE, "--dataset_name", path, "--model_name_or_path", model,
                          "--output_dir", str(out), "--eval_split_size", "0", "--dataset_format", "auto"])
    assert exit_info.value.code == 2 and not out.exists()
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_one_label_file_is_refused_in_one_line(tmp_path, assets, capsys, monkeypatch):
    path = write_jsonl(tmp_path / "good_only.jsonl", [TRL_TEXT[0]] * 4)
    assert run_kto(tmp_path, capsys, monkeypatch, path, assets["base_model"]) == (
        f"rlhf-trl kto: error: {path}: holds only desirable (label true) examples (4); KTO needs both desirable and "
        "undesirable answers: add undesirable ones (desirable answers alone: make sft)")


def test_unlabelled_and_badly_labelled_rows_are_one_line(tmp_path, assets, capsys, monkeypatch):
    path = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": QUESTION, "completion": GOOD}] * 2)
    assert run_kto(tmp_path, capsys, monkeypatch, path, assets["base_model"]) == (
        f"rlhf-trl kto: error: {path}, row 0, field 'label': holds neither a boolean 'label' (TRL's unpaired rows) or "
        "'kto_tag' (LLaMA-Factory's KTO rows) nor a chosen / rejected pair: KTO needs each answer marked desirable or "
        "undesirable; fix the row, or set on_bad_row: skip to skip such rows")
    path = write_jsonl(tmp_path / "ints.jsonl", [{**TRL_TEXT[0], "label": 1}, {**TRL_TEXT[1], "label": 0}])
    err = run_kto(tmp_path, capsys, monkeypatch, path, assets["base_model"])
    assert err.startswith(f"rlhf-trl kto: error: {path}, row 0, field 'label': must be true (a desirable answer) or "
                          "false (an undesirable one), got 1")


def test_data_report_counts_labels(tmp_path, tokenizer):
    from rlhf_trl.data import DataArguments
    from rlhf_trl.kto import UnpairedReport, _datasets

    path = write_jsonl(tmp_path / "kto.jsonl", TRL_TEXT * 5 + [TRL_TEXT[0]] * 2)  # 7 desirable, 5 undesirable
    report = UnpairedReport("kto")
    args = SimpleNamespace(seed=0, per_device_train_batch_size=4, loss_type="kto", max_length=64)
    train, held_out = _datasets(DataArguments(dataset_name=path, eval_split_size=4), args, tokenizer, report)
    assert len(train) == 8 and len(held_out) == 4 and "KL_completion_ids" in train.column_names
    assert sum(c["desirable"] for c in report.labels.values()) == 7
    assert sum(c["undesirable"] for c in report.labels.values()) == 5
    assert report.labels["train"]["desirable"] == sum(train["label"])
    assert "train: " in report.summary() and "desirable" in report.summary()

"""`rlhf-trl merge` and `rlhf-trl eval` on the tiny demo runs: merged models equal their adapters, and every eval
figure is recomputed here from the saved samples."""

import json
import os

import pytest
import torch

from rlhf_trl import demo_task, evaluate, merge
from rlhf_trl.data import DataArguments, Template, pair_features, read_records, split_records
from rlhf_trl.models import StageInputError
from rlhf_trl.scoring import score_sequences

RECIPES = os.path.join(os.path.dirname(__file__), "..", "recipes", "demo")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_merge_reward_adapter_scores_like_the_adapter(rm_run, sft_run, tokenizer, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    adapter = os.path.join(rm_run["output_dir"], "adapter")
    out = tmp_path / "rm_merged"
    merge.main(["--adapter", adapter, "--output", str(out)])  # base from adapter_config.json
    assert {"config.json", "model.safetensors", "tokenizer_config.json", "README.md"} <= set(os.listdir(out))
    card = (out / "README.md").read_text(encoding="utf-8")
    assert "SEQ_CLS" in card and sft_run["merged"] in card

    merged, info = AutoModelForSequenceClassification.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and merged.config.num_labels == 1
    base = AutoModelForSequenceClassification.from_pretrained(sft_run["merged"], num_labels=1)
    base.config.pad_token_id = tokenizer.pad_token_id
    with_adapter = PeftModel.from_pretrained(base, adapter).eval()
    feats = pair_features([
        {"question": "你觉得滑雪怎么样？", "chosen": "滑雪很棒，我很喜欢。", "rejected": "滑雪太差了，劝大家别试。"},
        {"question": "书店好不好？", "chosen": "书店真不错，推荐给大家。", "rejected": "书店还行，一般般。"},
    ], tokenizer, Template())
    seqs = feats["chosen_ids"] + feats["rejected_ids"]
    expected = score_sequences(with_adapter.get_base_model(), seqs, tokenizer.pad_token_id)
    got = score_sequences(merged, seqs, tokenizer.pad_token_id)
    assert torch.allclose(got, expected, atol=1e-5), (got, expected)
    assert float((got[:2] - got[2:]).min()) > 0  # the trained score head came along: chosen beats rejected


def test_merge_policy_adapter_gives_the_adapter_logits(ppo_run, sft_run, tokenizer, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = os.path.join(ppo_run["output_dir"], "adapter")
    out = tmp_path / "policy_merged"
    merge.main(["--adapter", adapter, "--output", str(out), "--base", sft_run["merged"]])
    assert "CAUSAL_LM" in (out / "README.md").read_text(encoding="utf-8")
    merged = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(sft_run["merged"]), adapter).eval()
    ids = torch.tensor([tokenizer("问：你觉得滑雪怎么样？\n\n答：滑雪很棒，我很喜欢。")["input_ids"]])
    with torch.no_grad():
        a, b = merged(input_ids=ids).logits, with_adapter(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(sft_run["merged"])(input_ids=ids).logits
    assert torch.allclose(a, b, atol=1e-4), float((a - b).abs().max())
    assert not torch.allclose(a, plain, atol=1e-3)  # the adapter was actually merged in


def test_merge_rejects_a_directory_without_adapter(tmp_path):
    from rlhf_trl.models import StageInputError

    with pytest.raises(StageInputError, match="no LoRA adapter"):
        merge.main(["--adapter", str(tmp_path), "--output", str(tmp_path / "o")])


@pytest.fixture(scope="module")
def eval_run(assets, sft_run, rm_run, ppo_run):
    result = evaluate.main([
        "--config", f"{RECIPES}/ppo.yaml", "--dataset_name", assets["prompts"],
        "--sft_model_path", sft_run["merged"], "--reward_model_path", rm_run["merged"],
        "--output_dir", ppo_run["output_dir"], "--num_prompts", "6", "--samples_per_prompt", "3", "--demo",
    ])
    rows = [json.loads(line) for line in open(os.path.join(ppo_run["output_dir"], "eval_samples.jsonl"),
                                              encoding="utf-8")]
    saved = json.load(open(os.path.join(ppo_run["output_dir"], "eval.json"), encoding="utf-8"))
    return result, rows, saved


def test_eval_figures_recomputed_from_samples(eval_run, assets, tokenizer):
    result, rows, saved = eval_run
    assert len(rows) == 18 and saved["num_prompts"] == 6 and saved["samples_per_prompt"] == 3
    # the held-out prompts are PPO's eval split
    data = DataArguments(dataset_name=assets["prompts"], dataset_format="prompt", eval_split_size=16)
    _, held_out = split_records(read_records(data, "prompts"), 16, 42)
    assert [r["question"] for r in rows[::3]] == [h["question"] for h in held_out[:6]]

    n = len(rows)
    eos = tokenizer.eos_token_id
    expected = {}
    for name in ("sft", "ppo"):
        for r in rows:
            ids = r[name]["response_ids"]
            assert 0 < len(ids) <= 16
            assert r[name]["eos"] == (ids[-1] == eos) and ids.count(eos) <= 1
        expected[f"{name}_reward"] = sum(r[name]["reward"] for r in rows) / n
        expected[f"{name}_mean_length"] = sum(len(r[name]["response_ids"]) - r[name]["eos"] for r in rows) / n
        expected[f"{name}_eos_rate"] = sum(r[name]["eos"] for r in rows) / n
        expected[f"{name}_score"] = sum(r[name]["score"] for r in rows) / n
        expected[f"{name}_on_topic_rate"] = sum(r[name]["on_topic"] for r in rows) / n
        for r in rows:  # the ground truth of each sample: its question and its decoded response
            assert r[name]["score"] == demo_task.score_response(r["question"], r[name]["text"])
            assert r[name]["on_topic"] == demo_task.on_topic(r["question"], r[name]["text"])
    wins = [(r["ppo"]["reward"] > r["sft"]["reward"]) + 0.5 * (r["ppo"]["reward"] == r["sft"]["reward"]) for r in rows]
    expected["win_rate"] = sum(wins) / n
    ratios = [a - b for r in rows for a, b in zip(r["ppo"]["logprobs_ppo"], r["ppo"]["logprobs_sft"])]
    assert len(ratios) == sum(len(r["ppo"]["response_ids"]) for r in rows)
    expected["kl_per_token"] = sum(ratios) / len(ratios)
    for key, value in expected.items():
        assert saved[key] == pytest.approx(value, abs=1e-9), key
        assert result[key] == pytest.approx(value, abs=1e-9), key
    assert 0 <= saved["win_rate"] <= 1 and saved["ppo_mean_length"] > 0


def test_eval_reward_and_kl_recomputed_with_the_models(eval_run, sft_run, rm_run, ppo_run, tokenizer):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    _, rows, _ = eval_run
    row = max(rows, key=lambda r: len(r["ppo"]["response_ids"]))
    rm = AutoModelForSequenceClassification.from_pretrained(rm_run["merged"])
    seqs = [row["prompt_ids"] + row["sft"]["response_ids"], row["prompt_ids"] + row["ppo"]["response_ids"]]
    scores = score_sequences(rm, seqs, tokenizer.pad_token_id)
    assert float(scores[0]) == pytest.approx(row["sft"]["reward"], abs=1e-4)
    assert float(scores[1]) == pytest.approx(row["ppo"]["reward"], abs=1e-4)
    assert row["sft"]["text"] == tokenizer.decode(row["sft"]["response_ids"], skip_special_tokens=True)

    # per-token log-probs, one fresh unpadded forward pass per model, temperature 1
    ids = torch.tensor([row["prompt_ids"] + row["ppo"]["response_ids"]])
    n_prompt, n_resp = len(row["prompt_ids"]), len(row["ppo"]["response_ids"])
    targets = ids[0, n_prompt:]
    fresh = {}
    for name, path in (("ppo", os.path.join(ppo_run["output_dir"], "merged")), ("sft", sft_run["merged"])):
        with torch.no_grad():
            logits = AutoModelForCausalLM.from_pretrained(path)(input_ids=ids).logits[0]
        logp = torch.log_softmax(logits[n_prompt - 1 : n_prompt - 1 + n_resp], -1)
        fresh[name] = logp[torch.arange(n_resp), targets]
    assert torch.allclose(fresh["ppo"], torch.tensor(row["ppo"]["logprobs_ppo"]), atol=1e-4)
    assert torch.allclose(fresh["sft"], torch.tensor(row["ppo"]["logprobs_sft"]), atol=1e-4)


def test_eval_rm_accuracy_recomputed_on_the_rm_held_out_pairs(eval_run, rm_run, tokenizer):
    from transformers import AutoModelForSequenceClassification

    _, _, saved = eval_run
    pairs_file = os.path.join(rm_run["output_dir"], "eval_pairs.jsonl")
    assert saved["rm_pairs"] == pairs_file
    pairs = [json.loads(line) for line in open(pairs_file, encoding="utf-8")]
    rm = AutoModelForSequenceClassification.from_pretrained(rm_run["merged"]).eval()

    def score(ids):  # one unpadded sequence at a time: the logit at its last token
        with torch.no_grad():
            return float(rm(input_ids=torch.tensor([ids])).logits[0, 0])

    margins = [score(p["chosen_ids"]) - score(p["rejected_ids"]) for p in pairs]
    longer = [(len(p["chosen_ids"]) > len(p["rejected_ids"])) + 0.5 * (len(p["chosen_ids"]) == len(p["rejected_ids"]))
              for p in pairs]
    assert saved["rm_num_pairs"] == len(pairs) > 0
    assert saved["rm_accuracy"] == pytest.approx(sum(m > 0 for m in margins) / len(pairs), abs=1e-6)
    assert saved["rm_margin"] == pytest.approx(sum(margins) / len(pairs), abs=1e-4)
    assert saved["rm_length_baseline_accuracy"] == pytest.approx(sum(longer) / len(pairs), abs=1e-6)  # float32 means
    # the same pairs and numbers the RM stage reported when it finished
    stage = json.load(open(os.path.join(rm_run["output_dir"], "eval_metrics.json"), encoding="utf-8"))
    assert saved["rm_accuracy"] == pytest.approx(stage["accuracy"]) and stage["num_pairs"] == len(pairs)
    assert saved["rm_accuracy"] > 0.6  # the trained RM beats chance on pairs it never saw


def test_eval_report_and_plots(eval_run, ppo_run, sft_run, rm_run):
    result, rows, saved = eval_run
    report = open(result["report"], encoding="utf-8").read()
    assert result["report"] == os.path.join(ppo_run["output_dir"], "report.md")
    for key in evaluate.FIGURES + evaluate.RM_FIGURES + evaluate.DEMO_FIGURES:
        assert f"| `{key}` |" in report
    assert report.count(f"| {rows[0]['question']} |") >= 1
    assert set(result["plots"]) == {"sft", "rm", "ppo"}
    for run in (sft_run, rm_run):  # whole curves from each stage's log_history.json
        history = json.load(open(os.path.join(run["output_dir"], "log_history.json")))["log_history"]
        assert sum("loss" in h for h in history) > 1
        assert f"From `{os.path.join(run['output_dir'], 'log_history.json')}`" in report
    for stage, png in result["plots"].items():
        assert png.endswith(f"{stage}_curves.png")
        blob = open(png, "rb").read()
        assert blob.startswith(PNG_MAGIC) and len(blob) > 1000
        assert f"report/{stage}_curves.png" in report
    assert saved["plots"] == result["plots"]


def test_stage_without_logs_is_reported(tmp_path):
    assert evaluate.read_stage_logs(str(tmp_path)) == ([], None)
    assert evaluate.plot_curves([], evaluate.PPO_CURVES, str(tmp_path / "x.png"), "x") == []
    assert not (tmp_path / "x.png").exists()
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-10").mkdir()
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text(json.dumps({"log_history": [{"step": 1, "loss": 1}]}))
    logs = [{"step": 1, "objective/kl": 0.1}, {"step": 2, "objective/kl": 0.2}]
    (tmp_path / "checkpoint-10" / "trainer_state.json").write_text(json.dumps({"log_history": logs}))
    assert evaluate.read_stage_logs(str(tmp_path)) == (logs, str(tmp_path / "checkpoint-10" / "trainer_state.json"))
    assert evaluate.plot_curves(logs, evaluate.PPO_CURVES, str(tmp_path / "x.png"), "x") == ["objective/kl"]
    assert (tmp_path / "x.png").read_bytes().startswith(PNG_MAGIC)


def test_quality_lines_read_the_figures_honestly():
    from rlhf_trl.evaluate import figures as eval_figures
    from rlhf_trl.evaluate import quality_lines

    def row(sft, ppo):
        return {name: {"reward": r, "objective": r - 1.0, "response_ids": [1, 2], "eos": True, "logprobs_ppo": [0.1],
                       "logprobs_sft": [0.0]} for name, r in (("sft", sft), ("ppo", ppo))}

    rows = [row(0.0, d) for d in (0.4, 0.5, 0.6)]  # differences: mean 0.5, standard error 0.0577
    figures = {**eval_figures(rows), "rm_accuracy": 0.6, "rm_length_baseline_accuracy": 0.7, "rm_num_pairs": 10,
               "rm_length_gap_ci": [-0.3, 0.1], "sft_loss_before": 2.0, "sft_loss_after": 1.5, "sft_loss_diff": -0.5,
               "sft_loss_ci": [-0.7, -0.3], "sft_loss_rows": 9}
    lines = quality_lines(figures, rows)
    assert lines[2] == ("- SFT: held-out completion loss 2.000 -> 1.500 nats per token (9 rows, difference -0.500, 95% "
                        "CI [-0.700, -0.300]: lower: SFT fitted held-out rows.)")
    assert lines[3] == ("- Reward model: accuracy 0.600 on 10 held-out pairs vs 0.700 for the length-only baseline (gap "
                        "-0.100, 95% CI [-0.300, +0.100]: not above the baseline: it may have learned little beyond "
                        "length.)")
    assert lines[4] == ("- PPO vs SFT, optimised reward: -0.500 vs -1.000 (difference +0.500 over 3 paired samples, 95% "
                        "CI [+0.387, +0.613]: PPO higher.)")
    assert lines[5].startswith("- PPO vs SFT, raw RM score: 0.500 vs 0.000 (difference +0.500")
    assert lines[6] == ("- Cost: 0.1000 nats per token of log-prob gap to the SFT policy; EOS rate 1.00 (SFT) -> 1.00 "
                        "(PPO); mean length 1.0 -> 1.0 tokens.")
    noisy = [row(0.0, d) for d in (-1.0, 1.2)]
    assert quality_lines(eval_figures(noisy), noisy)[2].endswith("not told apart from 0 at this size)")


def test_eval_refuses_a_causal_lm_as_reward_model(assets, sft_run, tmp_path):
    with pytest.raises(StageInputError) as err:
        evaluate.main(["--config", f"{RECIPES}/ppo.yaml", "--dataset_name", assets["prompts"],
                       "--sft_model_path", sft_run["merged"], "--reward_model_path", sft_run["merged"],
                       "--output_dir", str(tmp_path)])
    assert str(err.value).startswith(f"reward_model_path '{sft_run['merged']}' is a Qwen2ForCausalLM, not a "
                                     "sequence-classification model: a reward model needs a trained score head")
    assert os.listdir(tmp_path) == []

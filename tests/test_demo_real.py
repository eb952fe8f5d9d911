"""`make demo-real` and `make math-real` on real weights: the relevance pairs its RM learns, the second scorer, the
summary's intervals and targets, and smoke runs of both (sized for 2 CPU cores; figures belong to benchmarks)."""

import json
import os
import sys

import pytest
from conftest import REPO, SHARED

sys.path.insert(0, str(REPO / "benchmarks"))
import demo_real  # noqa: E402
from demo_real import question_overlap, relevance_pairs  # noqa: E402

RANKED = SHARED / "data" / "zh" / "oaast_rm_zh.json"
needs_shared = pytest.mark.skipif(not RANKED.is_file(), reason="../shared/data absent")


@needs_shared
def test_relevance_pairs_are_real_answers_matched_in_length(tmp_path):
    """Every chosen answer is its question's best human answer, every rejected one another question's best answer;
    the counts add up to the file's rows; either side is the longer about as often (the length baseline near 0.5)."""
    counts = relevance_pairs(str(RANKED), str(tmp_path / "pairs.jsonl"))
    rows = json.load(open(RANKED, encoding="utf-8"))
    pairs = [json.loads(line) for line in open(tmp_path / "pairs.jsonl", encoding="utf-8")]
    assert counts["pairs"] == len(pairs) > 200
    assert counts["rows"] == len(rows) == sum(v for k, v in counts.items() if k.startswith("skipped")) + len(pairs)
    best = {}  # a question asked in several rows: its first row's best answer
    for r in rows:
        if not r.get("history"):
            best.setdefault("\n".join(x for x in (r["instruction"], r.get("input") or "") if x), r["output"][0])
    bests = set(best.values())
    for p in pairs:
        assert best[p["question"]] == p["chosen"] != p["rejected"] and p["rejected"] in bests
        assert len(p["chosen"]) <= demo_real.MAX_ANSWER_CHARS
    lengths = [(len(p["chosen"]), len(p["rejected"])) for p in pairs]
    longer = sum((c > r) + 0.5 * (c == r) for c, r in lengths)
    assert 0.4 < longer / len(pairs) < 0.6


def test_complete_sentence_reads_the_last_character():
    texts = ["好的。", "是的！ ", "Yes.", "因为", "1. 第一", "他说：“走吧。”"]
    assert demo_real.complete_sentence([], texts) == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]


def test_question_overlap_counts_the_questions_bigrams():
    q = ["怎样学习 Python 编程？"]  # units 怎 样 学 习 python 编 程: 6 bigrams, 4 of them in the answer
    assert question_overlap([], ["学习python编程要多练习"], q) == [pytest.approx(4 / 6)]
    assert question_overlap([], ["今天天气很好"], q) == [0.0] and question_overlap([], ["x"], ["?"]) == [0.0]


SFT_LOSS = {"sft_loss_before": 2.1, "sft_loss_after": 1.2, "sft_loss_diff": -0.9, "sft_loss_ci": [-1.1, -0.7],
            "sft_loss_rows": 2}


def _evaluation(objective_ci, gap_ci, kl):
    return {"rm_accuracy": 0.8, "rm_accuracy_ci": [0.7, 0.9], "rm_length_baseline_accuracy": 0.5, "rm_length_gap": 0.3,
            "rm_length_gap_ci": gap_ci, "rm_num_pairs": 64, "sft_objective": -1.0, "ppo_objective": -0.5,
            "objective_diff": 0.5, "objective_ci": objective_ci, "reward_diff": 0.2, "reward_ci": [-0.1, 0.5],
            "kl_per_token": kl, "win_rate": 0.6, "sft_eos_rate": 0.2, "ppo_eos_rate": 0.5, "sft_mean_length": 40.0,
            "ppo_mean_length": 30.0, **SFT_LOSS}


def test_targets_follow_the_intervals():
    rows = [{"question": "学习编程", "sft": {"text": "学习"}, "ppo": {"text": "学习编程。"}},
            {"question": "学习编程", "sft": {"text": "编程"}, "ppo": {"text": "学习编程吧"}}]
    good = demo_real.quality(_evaluation([0.1, 0.9], [0.1, 0.5], 0.05), rows)
    assert good["targets_met"] and good["sft"]["diff"] == pytest.approx(-0.9) and good["sft"]["rows"] == 2
    overlap, complete = good["ppo"]["second_scorers"]["question_overlap"], good["ppo"]["second_scorers"][
        "complete_sentence"]
    assert overlap["sft"] == pytest.approx(1 / 3) and overlap["ppo"] == 1.0 and overlap["diff"] == pytest.approx(2 / 3)
    assert (complete["sft"], complete["ppo"], complete["diff"], complete["ci95"]) == (0.0, 0.5, 0.5, pytest.approx(
        [0.5 - 1.96 * 0.5, 0.5 + 1.96 * 0.5]))
    for evaluation, failed in ((_evaluation([-0.1, 0.9], [0.1, 0.5], 0.05), "ppo_objective_up"),
                               (_evaluation([0.1, 0.9], [-0.1, 0.5], 0.05), "rm_above_length_baseline"),
                               (_evaluation([0.1, 0.9], [0.1, 0.5], 0.0), "ppo_kl_in_budget"),
                               (_evaluation([0.1, 0.9], [0.1, 0.5], demo_real.KL_BUDGET), "ppo_kl_in_budget")):
        out = demo_real.quality(evaluation, rows)
        assert not out["targets_met"] and [k for k, v in out["targets"].items() if not v] == [failed]
    no_sft = {k: v for k, v in _evaluation([0.1, 0.9], [0.1, 0.5], 0.05).items() if not k.startswith("sft_loss")}
    assert not demo_real.quality(no_sft, rows)["targets"]["sft_loss_down"]
    worse = {**_evaluation([0.1, 0.9], [0.1, 0.5], 0.05), "sft_loss_ci": [-0.2, 0.1]}
    assert not demo_real.quality(worse, rows)["targets"]["sft_loss_down"]


@pytest.mark.slow
@needs_shared
def test_demo_real_smoke(real_model, module_tmp):
    """The whole run, each stage cut to one step / update and 4 held-out prompts: summary.json carries every effect
    with its interval, the targets, the pair counts and the seconds; the SFT step changed the held-out losses."""
    out = module_tmp("demo_real")
    smoke = {"sft": ["--max_steps", "1", "--warmup_steps", "0", "--eval_split_size", "4", "--report_to", "none"],
             "rm": ["--max_steps", "1", "--eval_split_size", "8", "--report_to", "none"],
             "ppo": ["--total_episodes", "4", "--eval_split_size", "4", "--response_length", "8",
                     "--report_to", "none"]}
    summary = demo_real.run(real_model, str(REPO / "recipes" / "qwen2.5-0.5b-cpu"), str(out), 4, smoke)
    assert json.load(open(out / "summary.json", encoding="utf-8")) == json.loads(json.dumps(summary))
    assert set(summary["stage_seconds"]) == {"pairs", "sft", "rm", "ppo", "eval"}
    assert summary["rm_pairs_file"]["pairs"] > 200 and summary["rm"]["num_pairs"] >= 6
    sft = summary["sft"]
    assert sft["rows"] >= 2 and sft["loss_after"] != sft["loss_before"] and len(sft["ci95"]) == 2
    ppo = summary["ppo"]
    assert ppo["prompts"] == 4 and ppo["kl_per_token"] != 0 and len(ppo["objective"]["ci95"]) == 2  # it moved
    assert set(summary["targets"]) == {"sft_loss_down", "rm_above_length_baseline", "ppo_objective_up",
                                       "ppo_kl_in_budget"}
    assert summary["targets_met"] == all(summary["targets"].values())
    assert os.path.isfile(summary["report"]) and len(summary["examples"]) == 3


@pytest.mark.slow
@pytest.mark.skipif(not (SHARED / "data" / "zh" / "cmath_dev.jsonl").is_file(), reason="../shared/data absent")
def test_math_recipe_smoke(real_model, module_tmp):
    """`make math-real` cut to one GRPO step and 4 held-out problems: compare reports accuracy (the rule reward's
    mean), its paired interval and the per-completion values, with no reward model."""
    from rlhf_trl import compare, grpo

    math = REPO / "recipes" / "qwen2.5-0.5b-cpu-math"
    out = module_tmp("math")
    grpo.main(["--config", str(math / "grpo.yaml"), "--model_name_or_path", real_model, "--output_dir",
               str(out / "grpo"), "--max_steps", "1", "--max_completion_length", "8", "--report_to", "none"])
    result = compare.main(["--config", str(math / "eval.yaml"), "--sft_model_path", real_model, "--num_prompts", "4",
                           "--samples_per_prompt", "1", "--response_length", "16", "--output_dir", str(out / "cmp"),
                           "--policies", f"base={real_model}", f"grpo={out / 'grpo'}"])
    rows = [json.loads(line) for line in open(out / "cmp" / "compare_samples.jsonl", encoding="utf-8")]
    assert result["reward_model_path"] is None and len(rows) == 4
    for name in ("base", "grpo"):
        values = [r[name]["functions"]["correct"] for r in rows]
        assert set(values) <= {0.0, 1.0} and [r[name]["reward"] for r in rows] == values
        assert result["methods"][name]["reward"] == pytest.approx(sum(values) / 4)
    assert len(result["methods"]["grpo"]["reward_ci"]) == 2

"""`rlhf_trl.math_rewards.correct`: the last number of a completion against CMATH's ``golden`` / GSM8K's ``answer``,
exact fractions; called as PPO / GRPO call reward functions (the prompt file's columns, one value per completion)."""

import json
from fractions import Fraction

import pytest
from conftest import SHARED

from rlhf_trl.math_rewards import correct, final_number, gold_number
from rlhf_trl.rewards import load_reward_functions, reward_columns


@pytest.mark.parametrize("text,value", [
    ("答：她还剩9页没有看。", Fraction(9)), ("先算 3+4=7，再算 7×2=14", Fraction(14)), ("约 2.860 米", Fraction("2.86")),
    ("答案是 5/8", Fraction(5, 8)), ("He pays $1,024 in total.", Fraction(1024)), ("温度是 -3 度", Fraction(-3)),
    ("没有数字", None), ("", None)])
def test_final_number(text, value):
    assert final_number(text) == value


def test_gold_answers_of_both_files():
    assert gold_number(golden="68") == 68 and gold_number(golden="2/6") == Fraction(1, 3)
    assert gold_number(golden="12%") == 12  # CMATH writes some answers as percentages; completions write "12%" too
    assert gold_number(answer="She makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18") == 18
    assert gold_number(answer="no marker 18") is None and gold_number() is None


def test_correct_per_completion_with_either_column():
    completions = ["答：68下", "答：67下", "1/3", "0.5", "18 dollars, then 20"]
    golden = ["68", "68", "2/6", "1/2", None]
    answer = [None, None, None, None, "... #### 20"]
    assert correct(completions, golden=golden, answer=answer) == [1.0, 0.0, 1.0, 1.0, 1.0]


def test_a_row_without_a_gold_answer_is_one_line():
    with pytest.raises(ValueError, match=r"^correct: row 1 of the batch has no numeric gold answer \(golden='abc'"):
        correct(["1", "2"], golden=["1", "abc"])


@pytest.mark.skipif(not (SHARED / "data" / "zh" / "cmath_dev.jsonl").is_file(), reason="../shared/data absent")
def test_cmath_rows_reach_the_reward_as_ppo_passes_them():
    """The real CMATH prompt rows through the data layer: ``golden`` arrives as the per-completion column; the gold
    answer itself scores 1, a wrong one 0, on every row; every golden parses."""
    from rlhf_trl.data import DataArguments, read_records

    path = SHARED / "data" / "zh" / "cmath_dev.jsonl"
    records = read_records(DataArguments(dataset_name=str(path), dataset_format="prompt", question_key="input"),
                           "prompts")
    rows = [json.loads(line) for line in open(path, encoding="utf-8")]
    columns = reward_columns(records)
    assert columns["golden"] == [r["golden"] for r in rows] and columns["question"] == [r["input"] for r in rows]
    functions = load_reward_functions(["rlhf_trl.math_rewards:correct"])
    prompts = [r["input"] for r in rows]
    right, values = functions.compute(prompts, [f"答案是{g}" for g in columns["golden"]], 0, **columns)
    wrong, _ = functions.compute(prompts, [f"答案是{g}1" for g in columns["golden"]], 0, **columns)
    assert right.tolist() == [1.0] * len(rows) and wrong.tolist() == [0.0] * len(rows)
    assert list(values) == ["correct"]

"""`rlhf-trl compare` on the tiny random-init base model: the base model as ``sft`` and again as a stage output dir
(``twin``: its merged/ a copy, with a metrics.json) must tie with itself; a perturbed copy must not. Every figure is
recomputed here from compare_samples.jsonl."""

import json
import os
import shutil

import pytest
from conftest import RECIPES, reward_stand_in, tree_hashes
from test_errors import run_cli

from rlhf_trl import compare
from rlhf_trl.config import RecipeError
from rlhf_trl.evaluate import _cell
from rlhf_trl.models import StageInputError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def recipe_in(tmp, assets) -> str:
    """The demo PPO recipe with its output_dir under ``tmp`` (compare writes beside it by default)."""
    with open(f"{RECIPES}/ppo.yaml", encoding="utf-8") as f:
        text = f.read().replace("output_dir: outputs/demo/ppo", f"output_dir: {tmp}/run/ppo")
    path = os.path.join(tmp, "ppo.yaml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


@pytest.fixture(scope="module")
def dirs(assets, tmp_path_factory):
    """The PPO recipe, the reward model and three policy dirs: the base model, a stage dir holding a copy of it with
    a metrics.json, and a stage dir holding a perturbed copy (no metrics.json)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = tmp_path_factory.mktemp("compare")
    twin = tmp / "twin"
    shutil.copytree(assets["base_model"], twin / "merged")
    (twin / "metrics.json").write_text(json.dumps({"train_runtime": 12.5, "peak_memory_mb": 321.0, "loss": 1.0}))
    model = AutoModelForCausalLM.from_pretrained(assets["base_model"])
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(tmp / "other" / "merged")
    AutoTokenizer.from_pretrained(assets["base_model"]).save_pretrained(tmp / "other" / "merged")
    return {"tmp": tmp, "recipe": recipe_in(str(tmp), assets), "rm": reward_stand_in(assets),
            "sft": assets["base_model"], "twin": str(twin), "other": str(tmp / "other")}


def argv(assets, dirs, *policies, extra=()):
    return ["--config", dirs["recipe"], "--dataset_name", assets["prompts"], "--reward_model_path", dirs["rm"],
            "--num_prompts", "3", "--samples_per_prompt", "2", "--policies", *policies, *extra]


@pytest.fixture(scope="module")
def run(assets, dirs):
    # sft named second: it is the reference all the same
    result = compare.main(argv(assets, dirs, f"twin={dirs['twin']}", f"sft={dirs['sft']}",
                               f"other={dirs['other']}", extra=["--demo"]))
    out = result["output_dir"]
    rows = [json.loads(line) for line in open(os.path.join(out, "compare_samples.jsonl"), encoding="utf-8")]
    return result, rows, json.load(open(os.path.join(out, "compare.json"), encoding="utf-8"))


def test_files_reference_and_default_output_dir(run, dirs):
    result, rows, saved = run
    out = str(dirs["tmp"] / "run" / "compare")  # beside the recipe's output_dir
    assert result["output_dir"] == out and saved["reference"] == "sft" == result["reference"]
    assert list(saved["methods"]) == ["sft", "twin", "other"]
    assert saved["policies"]["twin"] == {"model": os.path.join(dirs["twin"], "merged"), "stage_dir": dirs["twin"]}
    assert saved["policies"]["sft"] == {"model": dirs["sft"], "stage_dir": None}
    assert len(rows) == 6 and saved["num_prompts"] == 3 and saved["samples_per_prompt"] == 2
    assert open(saved["plot"], "rb").read().startswith(PNG_MAGIC)
    assert saved["plot"] == os.path.join(out, "compare", "reward_vs_kl.png")
    md = open(os.path.join(out, "compare.md"), encoding="utf-8").read()
    assert "![reward vs KL](compare/reward_vs_kl.png)" in md and saved["verdict"] in md
    assert "mean of (method - sft) +- 1.96 x its standard error" in md
    for name in ("sft (reference)", "twin", "other"):
        assert f"| {name} | " in md
    cells = [f"{_cell(rows[0][n]['text'])} ({rows[0][n]['reward']:.2f})" for n in ("sft", "twin", "other")]
    assert f"| {_cell(rows[0]['question'])} | {' | '.join(cells)} |" in md  # side by side, the reference first
    assert result["metrics"]["twin_kl_per_token"] == 0.0 and "other_score" in result["metrics"]


def test_identical_policies_tie(run):
    _, rows, saved = run
    twin, sft = saved["methods"]["twin"], saved["methods"]["sft"]
    assert all(r["twin"]["response_ids"] == r["sft"]["response_ids"] for r in rows)  # same prompts, same seed
    assert twin["kl_per_token"] == 0.0 and twin["win_rate"] == 0.5 and twin["reward"] == pytest.approx(sft["reward"])
    assert twin["num_kl_tokens"] == sum(len(r["twin"]["response_ids"]) for r in rows) > 0
    for key in ("reward", "score"):
        low, high = twin[f"{key}_ci"]
        assert low <= 0 <= high and twin[f"{key}_diff"] == pytest.approx(0, abs=1e-6)
    assert (twin["train_seconds"], twin["peak_memory_mb"]) == (12.5, 321.0)
    assert sft["train_seconds"] is None and saved["methods"]["other"]["peak_memory_mb"] is None


def test_figures_recomputed_from_samples(run):
    _, rows, saved = run
    m, n = saved["methods"]["other"], len(rows)
    diffs = [r["other"]["reward"] - r["sft"]["reward"] for r in rows]
    mean = sum(diffs) / n
    se = (sum((d - mean) ** 2 for d in diffs) / (n - 1) / n) ** 0.5
    assert m["reward_diff"] == pytest.approx(mean) and m["reward_ci"] == pytest.approx([mean - 1.96 * se,
                                                                                         mean + 1.96 * se])
    wins = [(r["other"]["reward"] > r["sft"]["reward"]) + 0.5 * (r["other"]["reward"] == r["sft"]["reward"])
            for r in rows]
    assert m["win_rate"] == pytest.approx(sum(wins) / n)
    kl = [a - b for r in rows for a, b in zip(r["other"]["logprobs_other"], r["other"]["logprobs_sft"])]
    assert len(kl) == sum(len(r["other"]["response_ids"]) for r in rows) and m["kl_per_token"] == pytest.approx(
        sum(kl) / len(kl)) and m["kl_per_token"] > 0
    assert m["mean_length"] == pytest.approx(sum(len(r["other"]["response_ids"]) - r["other"]["eos"] for r in rows) / n)
    assert m["score"] == pytest.approx(sum(r["other"]["score"] for r in rows) / n)
    assert "logprobs_sft" not in rows[0]["sft"]  # the reference's own KL is 0 by definition


def test_first_policy_is_the_reference_without_sft(dirs):
    policies = compare.parse_policies([f"b={dirs['twin']}", f"a={dirs['sft']}"])
    assert list(policies) == ["b", "a"] and policies["b"] == (os.path.join(dirs["twin"], "merged"), dirs["twin"])
    assert list(compare.parse_policies([f"x={dirs['sft']}", f"sft={dirs['twin']}"])) == ["sft", "x"]


def test_verdict_names_the_winner_and_its_kl():
    methods = {"sft": {"reward": 0.1, "kl_per_token": 0.0},
               "dpo": {"reward": 0.5, "reward_diff": 0.4, "reward_ci": [0.2, 0.6], "kl_per_token": 0.0312}}
    assert compare.verdict(methods, "sft", False) == (
        "dpo scored highest on mean RM reward: 0.500 vs 0.100 for sft (difference +0.400, 95% CI [+0.200, +0.600], "
        "which excludes 0), at a KL of 0.0312 nats per token to sft.")
    methods["grpo"] = {"reward": 0.45, "reward_diff": 0.35, "reward_ci": [0.1, 0.6], "kl_per_token": 0.05}
    assert compare.verdict(methods, "sft", False).endswith(
        "to sft. grpo (0.450) lies within that interval: not told apart at this sample size.")
    del methods["grpo"]
    methods["dpo"]["reward_ci"] = [-0.1, 0.9]
    assert "95% CI [-0.100, +0.900], which includes 0: not clearly better at this sample size)" in compare.verdict(
        methods, "sft", False)
    methods["dpo"].update(reward=0.0)
    assert compare.verdict(methods, "sft", False) == "No method beat the reference sft on mean RM reward (sft: 0.100)."


@pytest.mark.parametrize("policies, line", [
    (["sft={sft}"], "--policies: 1 given; compare needs at least 2, e.g. --policies sft=outputs/demo/sft "
                    "dpo=outputs/demo/dpo"),
    (["sft={sft}", "{twin}"], "--policies: '{twin}' is not NAME=DIR (NAME: a letter, then letters, digits, _ . -; not "
                              "prompt_index, sample_index, question, prompt_ids), e.g. dpo=outputs/demo/dpo"),
    (["sft={sft}", "question={twin}"], "--policies: 'question={twin}' is not NAME=DIR (NAME: a letter, then letters, "
                                       "digits, _ . -; not prompt_index, sample_index, question, prompt_ids), e.g. "
                                       "dpo=outputs/demo/dpo"),
    (["sft={sft}", "sft={twin}"], "--policies: the name 'sft' is given twice; give each policy its own name"),
    (["sft={sft}", "dpo={tmp}/no_dpo"], "--policies dpo={tmp}/no_dpo: no directory '{tmp}/no_dpo'; give a stage's "
                                        "output_dir (holding merged/) or a model directory"),
    (["sft={sft}", "dpo={tmp}"], "--policies dpo model at '{tmp}' has no config.json (incomplete or not a model "
                                 "directory)"),
], ids=["one_policy", "not_name_dir", "reserved_name", "duplicate", "missing_dir", "not_a_model"])
def test_bad_policies_one_line(assets, dirs, tmp_path, capsys, policies, line):
    fill = {"sft": dirs["sft"], "twin": dirs["twin"], "tmp": str(tmp_path)}
    before = tree_hashes(dirs["tmp"])
    code, err = run_cli("compare", argv(assets, dirs, *(p.format(**fill) for p in policies)), capsys)
    assert code == 2 and err == [f"rlhf-trl compare: error: {line.format(**fill)}"]
    assert tree_hashes(dirs["tmp"]) == before and os.listdir(tmp_path) == []  # nothing written


def test_errors_are_their_types(dirs):
    with pytest.raises(RecipeError):
        compare.parse_policies([f"sft={dirs['sft']}"])
    with pytest.raises(StageInputError):
        compare.parse_policies([f"sft={dirs['sft']}", "dpo=/nonexistent/dpo"])


def test_reward_functions_alone_score_every_sample(assets, dirs):
    """No reward model, a rule reward (the demo's ground truth as a reward function): each sample's ``reward`` and
    ``objective`` are the function's value, less missing_eos_penalty without EOS for ``objective``; ``fn_<name>``
    and its paired interval are recomputed from the rows."""
    from rlhf_trl.demo_task import score_response
    from rlhf_trl.evaluate import paired_ci

    out = str(dirs["tmp"] / "fn_only")
    result = compare.main(["--config", dirs["recipe"], "--dataset_name", assets["prompts"], "--reward_model_path",
                           "", "--reward_funcs", "rlhf_trl.demo_task:ground_truth_reward", "--missing_eos_penalty",
                           "0.5", "--num_prompts", "3", "--samples_per_prompt", "2", "--output_dir", out,
                           "--policies", f"sft={dirs['sft']}", f"other={dirs['other']}"])
    rows = [json.loads(line) for line in open(os.path.join(out, "compare_samples.jsonl"), encoding="utf-8")]
    assert result["reward_model_path"] is None and len(rows) == 6
    assert result["reward_name"] == "reward (ground_truth_reward)"  # not an RM's score: the report says so
    assert result["verdict"].startswith(("other scored highest on mean reward (ground_truth_reward): ",
                                         "No method beat the reference sft on mean reward (ground_truth_reward)"))
    report = open(result["report"], encoding="utf-8").read()
    assert "Rewards: the reward functions' weighted sum." in report and "| reward (ground_truth_reward) |" in report
    assert "RM reward" not in report
    for r in rows:
        for name in ("sft", "other"):
            m = r[name]
            value = score_response(r["question"], m["text"])
            assert m["functions"] == {"ground_truth_reward": pytest.approx(value)}
            assert m["reward"] == pytest.approx(value)
            assert m["objective"] == pytest.approx(value - (0.0 if m["eos"] else 0.5))
    other = result["methods"]["other"]
    diff, ci = paired_ci([r["other"]["functions"]["ground_truth_reward"] for r in rows],
                         [r["sft"]["functions"]["ground_truth_reward"] for r in rows])
    assert other["fn_ground_truth_reward_diff"] == pytest.approx(diff) and other["fn_ground_truth_reward_ci"] == ci
    assert other["reward_diff"] == pytest.approx(diff)
    assert result["methods"]["sft"]["fn_ground_truth_reward_ci"] == [0.0, 0.0]

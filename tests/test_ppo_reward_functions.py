"""PPO with reward functions (``reward_funcs``): alone (no reward model) and added to the reward model's score."""

import json

import pytest

from conftest import RECIPES

GROUND_TRUTH = "rlhf_trl.demo_task:ground_truth_reward"


def _ppo_args(assets, sft_run, out, *extra):
    return ["--config", f"{RECIPES}/ppo.yaml", "--dataset_name", assets["prompts"],
            "--sft_model_path", sft_run["merged"], "--output_dir", str(out), "--save_strategy", "no",
            "--log_samples_every", "0", "--logging_steps", "1", *extra]


def _ground_truth(model_dir, assets) -> float:
    from rlhf_trl import demo_task
    from rlhf_trl.demo import sample_responses

    questions = [json.loads(line)["instruction"] for line in open(assets["heldout_prompts"], encoding="utf-8")]
    responses = sample_responses(model_dir, questions, samples_per_prompt=2, max_new_tokens=16, temperature=0.7,
                                 seed=1234)
    asked = [q for q in questions for _ in range(2)]
    return sum(demo_task.score_response(q, r) for q, r in zip(asked, responses)) / len(responses)


@pytest.mark.slow
def test_function_reward_alone_lifts_the_ground_truth(assets, sft_run, rm_run, tmp_path):
    """No reward model: PPO against the demo's ground-truth scorer as a reward function raises the ground-truth
    score of held-out samples by the demo's target margin (0.25), as PPO against the reward model does."""
    from rlhf_trl import demo, ppo

    res = ppo.main(_ppo_args(assets, sft_run, tmp_path, "--reward_model_path", "", "--value_model_path",
                             rm_run["merged"], "--reward_funcs", GROUND_TRUTH, "--total_episodes", "1280"))
    logs = [h for h in res["trainer"].state.log_history if "objective/scores" in h]
    assert len(logs) == 40 and res["trainer"].reward_model is None
    assert all("objective/reward_fn/ground_truth_reward" in h for h in logs)
    sft_score, ppo_score = _ground_truth(sft_run["merged"], assets), _ground_truth(res["merged"], assets)
    assert ppo_score >= sft_score + demo.TARGETS["ppo_minus_sft"], (sft_score, ppo_score)


def test_function_reward_adds_to_the_reward_model(assets, sft_run, rm_run, tmp_path):
    """With a reward model too, each function's mean is logged and the score is RM score + weight x function."""
    from rlhf_trl import ppo

    res = ppo.main(_ppo_args(assets, sft_run, tmp_path, "--reward_model_path", rm_run["merged"],
                             "--reward_funcs", GROUND_TRUTH, "--reward_weights", "0.5", "--total_episodes", "32",
                             "--missing_eos_penalty", "0"))
    trainer = res["trainer"]
    log = [h for h in trainer.state.log_history if "objective/scores" in h][0]
    assert -1.0 <= log["objective/reward_fn/ground_truth_reward"] <= 1.0
    assert trainer.reward_functions.weights == [0.5] and trainer.reward_model is not None


def test_reward_function_errors_stop_the_run_with_one_line(assets, sft_run, rm_run, tmp_path, capsys):
    """A function returning the wrong number of values stops PPO at update 1: exit 2, one line naming it."""
    from rlhf_trl.cli_launch import run_stage

    bad = tmp_path / "bad_rewards.py"
    bad.write_text("def short(prompts, completions, **kw):\n    return [0.0] * (len(completions) - 1)\n")
    with pytest.raises(SystemExit) as exit_info:
        run_stage("ppo", _ppo_args(assets, sft_run, tmp_path / "out", "--reward_model_path", rm_run["merged"],
                                   "--reward_funcs", f"{bad}:short", "--total_episodes", "32"))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # the last line, after the progress bar's
    assert err.endswith(f"rlhf-trl ppo: error: reward function {bad}:short at update 1: returned 31 values for 32 "
                        "completions"), err


def test_no_reward_at_all_is_one_line(assets, sft_run, tmp_path, capsys):
    from rlhf_trl.cli_launch import run_stage

    with pytest.raises(SystemExit) as exit_info:
        run_stage("ppo", _ppo_args(assets, sft_run, tmp_path, "--reward_model_path", ""))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == ("rlhf-trl ppo: error: reward_model_path: PPO needs a reward model, "
                                               "reward functions (reward_funcs) or both")
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_eval_of_a_run_without_reward_model_scores_with_the_functions(assets, sft_run, rm_run, tmp_path):
    """`rlhf-trl eval` of a PPO run against reward functions alone (no reward model): every sample's reward is the
    functions' weighted sum, and eval.json names no reward model and no RM pairs."""
    from rlhf_trl import demo_task, evaluate, ppo

    args = _ppo_args(assets, sft_run, tmp_path, "--reward_model_path", "", "--reward_funcs", GROUND_TRUTH)
    ppo.main(args + ["--value_model_path", rm_run["merged"], "--total_episodes", "8"])
    result = evaluate.main(args + ["--num_prompts", "3", "--samples_per_prompt", "1"])
    rows = [json.loads(line) for line in open(result["samples"], encoding="utf-8")]
    assert len(rows) == 3 and result["reward_model_path"] is None and result["rm_pairs"] is None
    for row in rows:
        for name in ("sft", "ppo"):
            truth = demo_task.score_response(row["question"], row[name]["text"])
            assert row[name]["reward"] == pytest.approx(truth) == row[name]["functions"]["ground_truth_reward"]
    assert json.load(open(tmp_path / "eval.json", encoding="utf-8"))["reward_model_path"] is None
    report = open(result["report"], encoding="utf-8").read()  # says what scored the samples, and no RM figure
    assert "no reward model." in report and "No reward model: the reward functions score the samples." in report
    assert "PPO vs SFT, reward functions' sum:" in report and "RM score" not in report

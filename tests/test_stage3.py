"""Stage 3 beyond PPO: DPO, GRPO, RLOO and KTO (TRL's trainers) on the demo, as the project runs them.

- DPO trains on the very token ids the reward model trains on (`pair_features`), not on TRL's own tokenization;
- GRPO / RLOO rewards equal PPO's: the reward model's score read at the EOS over the same ids (queries left-padded
  in a PPO batch or not), minus the baseline and the missing-EOS penalty; reward functions get the columns their
  signature names, weighted as in PPO;
- short runs change the policy and write loadable ``merged/`` models (KTO: and open a held-out margin between
  desirable and undesirable answers; its data: tests/test_kto.py); bad input stops in one line before anything
  is written. (Exact resume after a kill: tests/test_exact_resume.py; ``make demo-compare``'s targets: CI.)
"""

import json
import os

import pytest
import torch

from conftest import REPO

RECIPES = os.path.join(REPO, "recipes", "demo")


@pytest.fixture(scope="module")
def models(assets, tmp_path_factory):
    """A quick SFT model and reward model of the demo (1 pass over a few rows): ``(sft_merged, rm_merged)``."""
    from rlhf_trl import rm, sft

    out = tmp_path_factory.mktemp("stage3_models")
    common = ["--num_train_epochs", "1", "--report_to", "none", "--save_strategy", "no"]
    s = sft.main(["--config", f"{RECIPES}/sft.yaml", "--dataset_name", assets["sft"], "--model_name_or_path",
                  assets["base_model"], "--max_samples", "200", "--output_dir", str(out / "sft"), *common])
    r = rm.main(["--config", f"{RECIPES}/rm.yaml", "--dataset_name", assets["rm"], "--model_name_or_path",
                 s["merged"], "--max_samples", "40", "--output_dir", str(out / "rm"), *common])
    return s["merged"], r["merged"]


def weights(path: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def changed(before: str, after: str) -> int:
    """How many weight tensors of ``after`` differ from ``before``."""
    a, b = weights(before), weights(after)
    return sum(not torch.equal(a[k], b[k]) for k in b if k in a)


def test_dpo_rows_are_the_reward_models_ids(assets, tokenizer):
    from rlhf_trl.data import DataArguments, Template, pair_features, read_records
    from rlhf_trl.dpo import dpo_dataset

    records = read_records(DataArguments(dataset_name=assets["rm"], dataset_format="ranked", max_samples=5), "pairs")
    feats = pair_features(records, tokenizer, Template(), 64)
    rows = dpo_dataset(feats)
    assert len(rows) == len(feats["chosen_ids"]) > 0
    for row, c, r, n in zip(rows, feats["chosen_ids"], feats["rejected_ids"], feats["prompt_length"]):
        assert row["prompt_ids"] + row["chosen_ids"] == c and row["prompt_ids"] + row["rejected_ids"] == r
        assert len(row["prompt_ids"]) == n and row["chosen_ids"][-1] == tokenizer.eos_token_id


def test_group_rewards_are_ppos_rewards(models, tokenizer):
    """`RewardModelReward` on (query ids, completion ids) == the PPO engine's reward of the same rollout: left-padded
    queries, responses cut after their EOS (`truncate_at_eos`), `sequence_scores` at the last real token, minus the
    baseline and ``missing_eos_penalty`` where no EOS was sampled."""
    from rlhf_trl.grpo import RewardModelReward
    from rlhf_trl.models import load_sequence_classifier
    from rlhf_trl.scoring import eos_mask, pad_left, pad_right, sequence_scores, truncate_at_eos

    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    rm = load_sequence_classifier(models[1]).eval()
    g = torch.Generator().manual_seed(0)
    queries = [torch.randint(5, 300, (n,), generator=g).tolist() for n in (3, 7, 5, 4)]
    sampled = [[11, 12, eos, 40, 41], [13, eos, pad, pad, pad], [14, 15, 16, 17, 18], [eos, 9, 9, 9, 9]]
    completions = [s[:s.index(eos) + 1] if eos in s else s for s in sampled]  # what TRL passes: cut after the EOS
    ours = RewardModelReward(rm, pad, [eos], penalty=1.5, batch_size=2, baseline=0.25)(
        prompts=[""] * 4, completions=[""] * 4, completion_ids=completions, query_ids=queries)

    query = pad_left(queries, pad)
    post = truncate_at_eos(pad_right(sampled, pad), [eos], pad)
    with torch.no_grad():
        scores = sequence_scores(rm, torch.cat((query, post), 1), pad, query.shape[1])
    scores = scores - 0.25 - 1.5 * (~eos_mask(post, [eos]).any(1)).float()
    assert ours == pytest.approx(scores.tolist(), abs=1e-5)
    unpenalised = RewardModelReward(rm, pad, [eos], None, 4, baseline=0.25)(prompts=[""] * 4, completions=[""] * 4,
                                                             completion_ids=completions, query_ids=queries)
    assert [a - b for a, b in zip(unpenalised, ours)] == pytest.approx([0, 0, 1.5, 0], abs=1e-5)  # no EOS: 3rd


def test_reward_functions_get_the_columns_they_name():
    from rlhf_trl.grpo import as_trl_reward
    from rlhf_trl.rewards import RewardFunctions

    def exact(prompts, completions, golden):
        return [float(c.strip() == g) for c, g in zip(completions, golden)]

    fns = RewardFunctions([exact], [2.0], ["tests:exact"])
    reward = as_trl_reward(fns, 0, ["golden", "question"])
    out = reward(prompts=["p", "p"], completions=["4", "5"], completion_ids=[[1], [2]], golden=["4", "4"],
                 question=["q", "q"], trainer_state=None, log_extra=None, log_metric=None)
    assert out == [1.0, 0.0] and reward.__name__ == "exact"  # unweighted: TRL applies reward_weights


def test_dpo_trains_the_policy(models, assets, tmp_path):
    from rlhf_trl import dpo

    out = dpo.main(["--config", f"{RECIPES}/dpo.yaml", "--dataset_name", assets["rm"], "--model_name_or_path",
                    models[0], "--max_samples", "30", "--eval_split_size", "8", "--max_steps", "4",
                    "--output_dir", str(tmp_path / "dpo"), "--report_to", "none"])
    m = out["metrics"]
    assert m["global_step"] == 4 and m["num_eval_pairs"] > 0 and 0 <= m["eval_rewards/accuracies"] <= 1
    assert m["peak_memory_mb"] > 0 and m["train_runtime"] > 0
    assert changed(models[0], out["merged"]) > 0
    assert json.load(open(tmp_path / "dpo" / "data_report.json"))["stage"] == "dpo"


def test_kto_trains_the_policy_and_separates_desirable_from_undesirable(models, assets, tmp_path):
    """A short KTO run (the demo's ranked lists, unpaired) changes the policy and opens a margin on held-out examples:
    ``eval_rewards/margins`` = beta x (mean log-ratio policy / reference of desirable answers - that of undesirable
    ones) is exactly 0 before training (the policy is the reference) and positive after."""
    from rlhf_trl import kto

    out = kto.main(["--config", f"{RECIPES}/kto.yaml", "--dataset_name", assets["rm"], "--model_name_or_path",
                    models[0], "--max_samples", "120", "--eval_split_size", "64", "--max_steps", "40",
                    "--output_dir", str(tmp_path / "kto"), "--report_to", "none"])  # ~10 s; 10 steps: no margin yet
    m = out["metrics"]
    assert m["global_step"] == 40 and m["num_train_examples"] == 120 * 3 * 2 - 64 and m["num_eval_examples"] == 64
    assert m["eval_rewards/margins"] > 0.3 and m["eval_rewards/chosen"] > m["eval_rewards/rejected"]  # measured ~1.0
    assert m["num_train_desirable"] + m["num_eval_desirable"] == 120 * 3
    assert changed(models[0], out["merged"]) > 0
    report = json.load(open(tmp_path / "kto" / "data_report.json"))
    assert report["stage"] == "kto" and report["labels"]["train"]["desirable"] == m["num_train_desirable"]


@pytest.mark.parametrize("method", ["grpo", "rloo"])
def test_group_methods_train_the_policy_on_the_reward_model(method, models, assets, tmp_path):
    from rlhf_trl import grpo

    out = grpo.main(["--config", f"{RECIPES}/{method}.yaml", "--dataset_name", assets["prompts"],
                     "--model_name_or_path", models[0], "--reward_model_path", models[1], "--max_samples", "24",
                     "--per_device_train_batch_size", "8", "--num_generations", "4", "--max_steps", "3",
                     "--max_completion_length", "8", "--output_dir", str(tmp_path / method), "--report_to", "none"],
                    method=method)
    m = out["metrics"]
    assert m["global_step"] == 3 and m["num_train_prompts"] == 24 - 16
    assert changed(models[0], out["merged"]) > 0
    logged = [h for h in json.load(open(tmp_path / method / "log_history.json"))["log_history"]
              if "rewards/reward_model/mean" in h]
    assert logged and all(abs(h["rewards/reward_model/mean"]) < 50 for h in logged)


def test_group_method_without_a_reward_is_one_line(models, assets, tmp_path, capsys, monkeypatch):
    from rlhf_trl.cli_launch import run_stage

    monkeypatch.delenv("RLHF_TRL_DEBUG", raising=False)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        run_stage("grpo", ["--config", f"{RECIPES}/grpo.yaml", "--dataset_name", assets["prompts"],
                           "--model_name_or_path", models[0], "--reward_model_path", "", "--output_dir", str(out)])
    assert exit_info.value.code == 2 and not out.exists()
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "rlhf-trl grpo: error: grpo: no reward: set reward_model_path (the RM stage's merged/) and/or reward_funcs")


def test_group_method_refuses_a_causal_lm_as_reward_model(models, assets, tmp_path, capsys, monkeypatch):
    from rlhf_trl.cli_launch import run_stage

    monkeypatch.delenv("RLHF_TRL_DEBUG", raising=False)
    out = tmp_path / "out"
    with pytest.raises(SystemExit):
        run_stage("rloo", ["--config", f"{RECIPES}/rloo.yaml", "--dataset_name", assets["prompts"],
                           "--model_name_or_path", models[0], "--reward_model_path", models[0],
                           "--output_dir", str(out)])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("rlhf-trl rloo: error: ") and models[0] in err and not out.exists()

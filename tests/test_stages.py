"""One tiny run of each stage on the demo assets; each asserts that something was learned, not just that it ran."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import import_ppo, ppo_argv
from safetensors.torch import load_file

from rlhf_trl import rm, sft
from rlhf_trl.config import RecipeError, parse_recipe
from rlhf_trl.scoring import wilson_ci
from rlhf_trl.models import StageInputError

RECIPES = os.path.join(os.path.dirname(__file__), "..", "recipes", "demo")


def weights(path):
    return load_file(os.path.join(path, "model.safetensors"))


def changed(a, b, atol=1e-6):
    """Names of tensors present in both state dicts whose values differ."""
    return [k for k in a if k in b and a[k].shape == b[k].shape and not torch.allclose(a[k], b[k], atol=atol)]


def test_sft_learns_and_saves_a_merged_model(assets, sft_run):
    base, tuned = weights(assets["base_model"]), weights(sft_run["merged"])
    assert len(changed(base, tuned)) == len(base)  # full fine-tune: every tensor moved
    m = sft_run["metrics"]
    assert m["eval_loss"] < 1.5  # random init starts at ln(600) ~ 6.4 nats per token
    # the same held-out rows scored before and after training, one completion loss per row (demo-real's paired CI)
    before, after = m["eval_row_losses_before"], m["eval_row_losses"]
    assert len(before) == len(after) == m["num_eval_rows"] > 1
    assert all(b > 4.0 for b in before) and all(a < b - 2.0 for a, b in zip(after, before))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(sft_run["merged"])
    assert model.config.pad_token_id != model.config.eos_token_id
    cfg = json.load(open(os.path.join(sft_run["merged"], "tokenizer_config.json")))
    assert cfg["pad_token"] != cfg["eos_token"]


def test_sft_loss_covers_completion_only(assets, tokenizer):
    """The prompt tokens carry label -100: the SFT loss is on the answer (and EOS) only."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer
    from transformers import AutoModelForCausalLM

    from rlhf_trl.data import Template, encode_prompt, sft_features

    feats = sft_features([{"question": "你觉得咖啡怎么样？", "answer": "咖啡很棒，我很喜欢。"}], tokenizer, Template())
    args = SFTConfig(output_dir="/tmp/unused", completion_only_loss=True, report_to="none", use_cpu=True,
                     pad_token=tokenizer.pad_token)
    trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(assets["base_model"]), args=args,
                         train_dataset=Dataset.from_dict(feats), processing_class=tokenizer)
    labels = trainer.train_dataset[0]["labels"]
    n_prompt = len(encode_prompt(tokenizer, Template(), "你觉得咖啡怎么样？"))
    assert labels[:n_prompt] == [-100] * n_prompt
    assert labels[n_prompt:] == feats["input_ids"][0][n_prompt:]


def test_rm_beats_chance_and_writes_eval_metrics(rm_run):
    path = os.path.join(rm_run["output_dir"], "eval_metrics.json")
    metrics = json.load(open(path))
    assert set(metrics) == {"accuracy", "margin", "length_baseline_accuracy", "num_pairs", "accuracy_ci", "length_gap",
                            "length_gap_ci"}
    assert metrics["num_pairs"] > 20
    # the intervals: accuracy's a Wilson interval (inside [0, 1], around the accuracy); the paired gap's centred on its
    # mean, 1.96 standard errors wide (normal approximation over the pairs)
    assert metrics["length_gap"] == pytest.approx(metrics["accuracy"] - metrics["length_baseline_accuracy"])
    low, high = metrics["accuracy_ci"]
    assert 0.0 <= low <= metrics["accuracy"] <= high <= 1.0
    assert [low, high] == pytest.approx(wilson_ci(round(metrics["accuracy"] * metrics["num_pairs"]), metrics["num_pairs"]))
    low, high = metrics["length_gap_ci"]
    assert low <= metrics["length_gap"] <= high and (low + high) / 2 == pytest.approx(metrics["length_gap"])
    # the demo RM data mixes on-topic criticism (learnt) and praise of another topic (learnt poorly) as rejected
    assert metrics["accuracy"] > 0.7 and metrics["margin"] > 0
    assert os.path.isfile(os.path.join(rm_run["output_dir"], "adapter", "adapter_model.safetensors"))


def test_rm_merged_reloads_with_its_trained_score_head(rm_run, tokenizer):
    from transformers import AutoModelForSequenceClassification

    model, info = AutoModelForSequenceClassification.from_pretrained(rm_run["merged"], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.num_labels == 1 and model.config.pad_token_id == tokenizer.pad_token_id
    assert float(model.score.weight.abs().sum()) > 0


def test_ppo_changes_the_policy_and_saves_the_value_model(sft_run, rm_run, ppo_run):
    out = ppo_run["output_dir"]
    assert changed(weights(sft_run["merged"]), weights(ppo_run["merged"]))
    assert os.path.isfile(os.path.join(out, "adapter", "adapter_model.safetensors"))
    value = weights(ppo_run["value_model"])
    assert "score.weight" in value
    assert changed(weights(rm_run["merged"]), value)  # the critic was trained
    for step in (3, 6):
        ckpt = os.path.join(out, f"checkpoint-{step}")
        assert os.path.isfile(os.path.join(ckpt, "adapter_model.safetensors"))
        assert os.path.isfile(os.path.join(ckpt, "value_model", "model.safetensors"))
    assert ppo_run["metrics"]["global_step"] == 6


def test_ppo_logs_sample_tables(ppo_run):
    rows = [json.loads(line) for line in open(os.path.join(ppo_run["output_dir"], "samples.jsonl"), encoding="utf-8")]
    assert rows and {"step", "query", "response", "score", "reward"} <= set(rows[0])
    assert rows[0]["query"].startswith("问：") and rows[0]["query"].endswith("答：")


def test_reward_baseline_is_subtracted_where_the_score_is_assembled(assets, sft_run, rm_run, tmp_path):
    """The same rollouts (same seed) with reward_baseline 0 and 1.5: every score 1.5 lower, the reward model frozen
    and unchanged (the baseline lives in `PPOEngine.rollout`, not in the model)."""
    from rlhf_trl.ppo_engine import PPOEngine

    ppo, seen = import_ppo(), {}
    rollout = PPOEngine.rollout

    def spy(self, queries, rows, update):
        ro = rollout(self, queries, rows, update)
        seen.setdefault(self.reward_baseline, ro.scores.clone())
        return ro

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(PPOEngine, "rollout", spy)
        for baseline in ("0.0", "1.5"):
            res = ppo.main(ppo_argv(assets, sft_run, rm_run, tmp_path / baseline, "--total_episodes", "32",
                                    "--reward_baseline", baseline, "--save_strategy", "no", "--log_samples_every", "0"))
    assert torch.allclose(seen[1.5], seen[0.0] - 1.5, atol=1e-5)
    rm = res["trainer"].reward_model
    assert not any(p.requires_grad for p in rm.parameters()) and not rm.training and type(rm.score) is torch.nn.Linear


def test_missing_previous_stage_names_the_stage_to_run(assets, tmp_path):
    with pytest.raises(StageInputError, match=r"SFT model not found.*make sft RECIPE=.*recipes/demo/sft.yaml"):
        rm.main(["--config", f"{RECIPES}/rm.yaml", "--dataset_name", assets["rm"],
                 "--model_name_or_path", str(tmp_path / "missing"), "--output_dir", str(tmp_path / "o")])
    ppo = import_ppo()
    with pytest.raises(StageInputError, match=r"reward model not found.*make rm"):
        ppo.main(["--config", f"{RECIPES}/ppo.yaml", "--dataset_name", assets["prompts"],
                  "--sft_model_path", assets["base_model"], "--reward_model_path", str(tmp_path / "no_rm"),
                  "--output_dir", str(tmp_path / "o")])


@pytest.mark.slow  # a subprocess importing the whole stack (~12 s)
def test_cli_reports_a_missing_stage_in_one_line(assets, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf_trl", "rm", "--config", f"{RECIPES}/rm.yaml",
         "--model_name_or_path", str(tmp_path / "missing"), "--output_dir", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "rlhf-trl rm: error: SFT model not found" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_unknown_recipe_key_fails_loudly(tmp_path):
    from trl import ModelConfig, SFTConfig

    from rlhf_trl.data import DataArguments

    recipe = tmp_path / "r.yaml"
    recipe.write_text("dataset_name: x.jsonl\nlearning_rte: 0.1\noutput_dir: o\n")
    with pytest.raises(RecipeError, match=r"r.yaml: unknown key\(s\) \['learning_rte'\]"):
        parse_recipe((DataArguments, SFTConfig, ModelConfig), ["--config", str(recipe)])


def test_cli_overrides_beat_the_recipe():
    recipe = parse_recipe(sft.recipe_types(), ["--config", f"{RECIPES}/sft.yaml", "--learning_rate", "0.5"])
    assert recipe.training.learning_rate == 0.5 and recipe.data.dataset_format == "alpaca"
    assert recipe.path.endswith("sft.yaml") and recipe.script is None


# ----------------------------------------------------------------------------------------------------------------
# logging: TensorBoard event files by default
# ----------------------------------------------------------------------------------------------------------------
def _scalars(output_dir):
    import glob

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = glob.glob(os.path.join(output_dir, "runs", "*", "events.out.tfevents.*"))
    assert files, f"no TensorBoard event file under {output_dir}/runs"
    tags = set()
    for f in files:
        acc = EventAccumulator(f)
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    return tags


def test_sft_and_rm_write_tensorboard_event_files(sft_run, rm_run):
    assert "train/loss" in _scalars(sft_run["output_dir"])
    assert "train/loss" in _scalars(rm_run["output_dir"])


def test_ppo_writes_tensorboard_event_files(ppo_run):
    tags = _scalars(ppo_run["output_dir"])
    assert {"train/objective/scores", "train/objective/kl"} <= tags, sorted(tags)


def test_report_to_defaults_to_tensorboard_and_stays_overridable(tmp_path):
    from rlhf_trl import sft
    from rlhf_trl.config import parse_recipe

    recipe = tmp_path / "sft.yaml"
    recipe.write_text("dataset_name: x.jsonl\noutput_dir: out\nuse_cpu: true\n")
    assert parse_recipe(sft.recipe_types(), ["--config", str(recipe)]).training.report_to == ["tensorboard"]
    assert parse_recipe(sft.recipe_types(), ["--config", str(recipe), "--report_to", "none"]).training.report_to in (
        [], ["none"], "none")
    recipe.write_text("dataset_name: x.jsonl\noutput_dir: out\nuse_cpu: true\nreport_to: none\n")
    assert parse_recipe(sft.recipe_types(), ["--config", str(recipe)]).training.report_to in ([], ["none"], "none")

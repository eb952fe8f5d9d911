"""Real weights end to end: a stock Qwen2.5 Instruct directory through SFT -> RM -> PPO -> merge -> eval.

The model is Qwen2.5-Coder-0.5B-Instruct as `../shared/models/fetch_qwen2.5-0.5b.sh` builds it (real 151,936-token
tokenizer, chat template, the upstream generation_config with top_k / top_p / repetition_penalty and the EOS list
[<|im_end|>, <|endoftext|>], whose second id is also the tokenizer's pad token). Each stage is a smoke run sized for
2 CPU cores (fp32: SFT ~6 s per step of 2 x 128 tokens); the assertions are about behaviour: held-out loss goes down,
token ids agree between stages, the EOS list is honoured, merged models reproduce the adapters.
Skipped when ../shared is absent or the registry is unreachable (the fetch script's exit 3).
"""

import json
import os
import shutil

import pytest
import torch

from conftest import REPO, SHARED

pytestmark = pytest.mark.slow

RECIPES = REPO / "recipes" / "qwen2.5-0.5b-cpu"
# the human-ranked pairs themselves (the recipe's own file is the relevance pairs `make demo-real` builds first)
OAAST_PAIRS = ["--dataset_name", str(SHARED / "data" / "zh" / "oaast_rm_zh.json"), "--dataset_format", "ranked",
               "--ranked_pairs", "adjacent"]
IM_END, ENDOFTEXT = 151645, 151643  # the EOS list of the stock generation_config


def heldout_rows(dataset, kind, n, eval_split_size, **data_fields):
    """The first ``n`` rows of a stage's eval split (the rows it never trains on); ``data_fields``: the recipe's
    other data keys."""
    from rlhf_trl.data import DataArguments, read_records, split_records

    records = read_records(DataArguments(dataset_name=str(dataset), **data_fields), kind)
    return split_records(records, eval_split_size, 42)[1][:n]


@pytest.fixture(scope="module")
def real_sft(real_model, module_tmp):
    from rlhf_trl import sft

    out = module_tmp("real_sft")
    return sft.main(["--config", str(RECIPES / "sft.yaml"), "--model_name_or_path", real_model,
                     "--output_dir", str(out), "--max_steps", "6", "--max_length", "128",
                     "--gradient_accumulation_steps", "1", "--learning_rate", "5e-4", "--eval_split_size", "4",
                     "--report_to", "none"])


@pytest.fixture(scope="module")
def real_rm(real_sft, module_tmp):
    from rlhf_trl import rm

    out = module_tmp("real_rm")
    return rm.main(["--config", str(RECIPES / "rm.yaml"), "--model_name_or_path", real_sft["merged"], *OAAST_PAIRS,
                    "--output_dir", str(out), "--max_steps", "3", "--max_length", "192",
                    "--gradient_accumulation_steps", "1", "--eval_split_size", "8", "--report_to", "none"])


@pytest.fixture(scope="module")
def real_ppo(real_model, real_rm, module_tmp):
    """2 PPO updates whose policy is the stock directory itself: its sampling settings and EOS list, no reset flag."""
    from rlhf_trl import ppo

    out = module_tmp("real_ppo")
    return ppo.main(["--config", str(RECIPES / "ppo.yaml"), "--sft_model_path", real_model,
                     "--reward_model_path", real_rm["merged"], "--output_dir", str(out),
                     "--total_episodes", "4", "--per_device_train_batch_size", "2", "--response_length", "12",
                     "--eval_split_size", "4", "--per_device_eval_batch_size", "2", "--log_samples_every", "0",
                     "--reward_baseline", "0.0", "--report_to", "none"])


def test_stock_tokenizer_pads_with_a_token_that_is_no_eos(real_model):
    from rlhf_trl.models import eos_token_ids, load_tokenizer

    tok = load_tokenizer(real_model)
    assert tok.eos_token_id == IM_END and eos_token_ids(tok, real_model) == [IM_END, ENDOFTEXT]
    assert tok.pad_token_id not in (IM_END, ENDOFTEXT) and tok.pad_token == "<|vision_pad|>"


def test_sft_lowers_heldout_loss_on_real_rows(real_model, real_sft):
    """Held-out rows (never trained on): completion loss of the merged SFT model < that of the stock model, row by
    row as the stage itself measured them before and after training (``eval_row_losses_before`` / ``eval_row_losses``,
    the adapter unmerged then)."""
    from transformers import AutoModelForCausalLM

    from rlhf_trl.data import Template, sft_features
    from rlhf_trl.models import load_tokenizer
    from rlhf_trl.sft import completion_losses

    tok = load_tokenizer(real_model)
    rows = heldout_rows(SHARED / "data" / "zh" / "oaast_sft_zh.json", "sft", 3, 4)
    feats = [dict(zip(("input_ids", "completion_mask"), f)) for f in zip(*sft_features(
        rows, tok, Template(), max_length=128).values())]
    before = completion_losses(AutoModelForCausalLM.from_pretrained(real_model, dtype=torch.float32), feats, 128)
    after = completion_losses(AutoModelForCausalLM.from_pretrained(real_sft["merged"], dtype=torch.float32), feats, 128)
    assert sum(after) / len(after) < sum(before) / len(before) - 0.05, (before, after)
    metrics = real_sft["metrics"]
    assert before == pytest.approx(metrics["eval_row_losses_before"][:len(before)], rel=1e-3)
    assert after == pytest.approx(metrics["eval_row_losses"][:len(after)], rel=1e-3)
    # the merged model keeps the stock generation settings and EOS list (deployable as downloaded)
    gen = json.load(open(os.path.join(real_sft["merged"], "generation_config.json")))
    assert gen["eos_token_id"] == [IM_END, ENDOFTEXT]
    assert (gen["top_k"], gen["top_p"], gen["repetition_penalty"]) == (20, 0.8, 1.1)


def test_rm_pairs_are_the_ids_ppo_scores(real_rm):
    """Every held-out RM pair: the ids PPO builds (left-padded query batch + response + EOS, as rollouts do) equal
    the RM stage's ids, and TRL's get_reward (what PPO calls) reads the same score, at the response's EOS."""
    from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding
    from conftest import engine_reward as get_reward

    from rlhf_trl.data import Template, encode_response, prompt_features
    from rlhf_trl.models import load_tokenizer
    from rlhf_trl.scoring import score_sequences

    out = real_rm["output_dir"]
    metrics = json.load(open(os.path.join(out, "eval_metrics.json")))
    assert {"accuracy", "length_baseline_accuracy", "margin", "num_pairs"} <= set(metrics)
    pairs = [json.loads(line) for line in open(os.path.join(out, "eval_pairs.jsonl"))]
    assert len(pairs) == metrics["num_pairs"] > 0
    tok = load_tokenizer(real_rm["merged"], padding_side="left")
    # the stage's held-out records (pairs too long for max_length were dropped there): find each by its response
    records = heldout_rows(SHARED / "data" / "zh" / "oaast_rm_zh.json", "pairs", 8, 8, dataset_format="ranked",
                           ranked_pairs="adjacent")
    by_response = {tuple(encode_response(tok, Template(), r["chosen"])): r for r in records}
    model = AutoModelForSequenceClassification.from_pretrained(real_rm["merged"], dtype=torch.float32).eval()
    collate = DataCollatorWithPadding(tok)
    for k, pair in enumerate(pairs):
        n = pair["prompt_length"]
        rec = by_response[tuple(pair["chosen_ids"][n:])]
        query = prompt_features([rec], tok, Template(), max_prompt_length=n)["input_ids"][0]  # PPO's prompt ids
        for side in ("chosen", "rejected"):
            response = encode_response(tok, Template(), rec[side])
            assert query + response == pair[f"{side}_ids"]
            assert response[-1] == tok.eos_token_id
            if k >= 2:  # scoring costs 0.5B forwards: the first two pairs are scored as PPO scores them
                continue
            batch = collate([{"input_ids": query}, {"input_ids": [tok.pad_token_id] * 3 + query}])["input_ids"]
            resp = torch.full((2, len(response) + 4), tok.pad_token_id)
            resp[:, : len(response)] = torch.tensor(response)
            full = torch.cat((batch, resp), 1)
            _, score, last = get_reward(model, full, tok.pad_token_id, batch.shape[1])
            assert int(last[0]) == int(last[1]) == batch.shape[1] + len(response) - 1  # the response's EOS
            assert int(full[0, last[0]]) == tok.eos_token_id
            direct = score_sequences(model, [pair[f"{side}_ids"]], tok.pad_token_id)
            torch.testing.assert_close(score.float().cpu(), direct.expand(2), rtol=1e-4, atol=1e-4)


def test_ppo_runs_from_the_stock_directory(real_model, real_ppo, caplog):
    """No reset flag: the stock sampling settings are overridden for rollouts (one log line) and kept in merged/;
    rollouts stop at either EOS id; the EOS rate over both ids is logged."""
    trainer = real_ppo["trainer"]
    assert trainer.state.global_step == 2
    assert trainer.eos_token_ids == [IM_END, ENDOFTEXT]
    gen = trainer.accelerator.unwrap_model(trainer.model).policy.generation_config
    assert gen.eos_token_id == [IM_END, ENDOFTEXT] and gen.top_k == 0 and gen.repetition_penalty == 1.0
    logs = [h for h in trainer.state.log_history if "val/eos_rate" in h]
    assert len(logs) == 2 and all(0.0 <= h["val/eos_rate"] <= 1.0 for h in logs)
    stock = json.load(open(os.path.join(real_model, "generation_config.json")))
    merged = json.load(open(os.path.join(real_ppo["merged"], "generation_config.json")))
    for key in ("top_k", "top_p", "repetition_penalty", "temperature", "do_sample"):
        assert merged[key] == stock[key], key
    assert merged["eos_token_id"] == [IM_END, ENDOFTEXT]


def test_merged_models_reload_and_match_the_adapters(real_model, real_rm, real_ppo, tmp_path):
    """`rlhf-trl merge` of the PPO policy adapter and the RM adapter: plain transformers reloads give the adapter
    models' logits / scores."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from rlhf_trl import merge
    from rlhf_trl.models import load_tokenizer

    tok = load_tokenizer(real_model)
    ids = torch.tensor([tok("问：你好吗？\n\n答：我很好。", add_special_tokens=False)["input_ids"] + [IM_END]])

    merge.main(["--adapter", os.path.join(real_ppo["output_dir"], "adapter"), "--output", str(tmp_path / "policy"),
                "--dtype", "float32"])
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "policy", dtype=torch.float32).eval()
    with torch.no_grad():
        merged_logits = plain(input_ids=ids).logits
    del plain
    base = AutoModelForCausalLM.from_pretrained(real_model, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, os.path.join(real_ppo["output_dir"], "adapter")).eval()
    with torch.no_grad():
        adapter_logits = adapted(input_ids=ids).logits
    del adapted, base
    torch.testing.assert_close(merged_logits, adapter_logits, rtol=1e-3, atol=2e-3)
    shutil.rmtree(tmp_path / "policy")  # 2.4 GB: disk for the RM's merge below

    merge.main(["--adapter", os.path.join(real_rm["output_dir"], "adapter"), "--output", str(tmp_path / "rm"),
                "--dtype", "float32"])
    rm_plain = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm", dtype=torch.float32).eval()
    rm_stage = AutoModelForSequenceClassification.from_pretrained(real_rm["merged"], dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(rm_plain(input_ids=ids).logits, rm_stage(input_ids=ids).logits,
                                   rtol=1e-3, atol=1e-3)


def test_eval_writes_report_for_the_real_run(real_model, real_rm, real_ppo):
    from rlhf_trl import evaluate

    out = real_ppo["output_dir"]
    result = evaluate.main(["--config", str(RECIPES / "ppo.yaml"), "--output_dir", out,
                            "--sft_model_path", real_model, "--reward_model_path", real_rm["merged"],
                            "--eval_split_size", "4", "--num_prompts", "2", "--samples_per_prompt", "1",
                            "--response_length", "12"])
    figures = json.load(open(os.path.join(out, "eval.json")))
    for key in ("sft_reward", "ppo_reward", "kl_per_token", "sft_eos_rate", "ppo_eos_rate", "rm_accuracy",
                "rm_length_baseline_accuracy"):
        assert isinstance(figures[key], float), key
    report = open(result["report"], encoding="utf-8").read()
    assert "rm_accuracy" in report and "ppo_reward" in report
    pngs = os.listdir(os.path.join(out, "report"))
    assert any(p.endswith(".png") for p in pngs), pngs



# -- stage 3 beyond PPO on real weights: the CPU recipes, cut to smoke size ----------------------------------------

def test_dpo_on_real_pairs(real_sft, module_tmp):
    """DPO (LoRA; the reference is the adapter-disabled SFT model) on the RM stage's human-ranked pairs: the adapter
    trains, the merged policy reloads as a plain causal LM, held-out implicit-reward accuracy is reported."""
    from safetensors.torch import load_file

    from rlhf_trl import dpo

    out = module_tmp("real_dpo")
    result = dpo.main(["--config", str(RECIPES / "dpo.yaml"), "--model_name_or_path", real_sft["merged"],
                       "--output_dir", str(out), "--max_steps", "2", "--max_length", "160",
                       "--gradient_accumulation_steps", "1", "--per_device_train_batch_size", "1",
                       "--per_device_eval_batch_size", "2", "--eval_split_size", "4", "--report_to", "none"])
    m = result["metrics"]
    assert m["global_step"] == 2 and m["num_eval_pairs"] >= 1 and 0 <= m["eval_rewards/accuracies"] <= 1
    lora = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert any(float(v.abs().max()) > 0 for k, v in lora.items() if "lora_B" in k)  # B starts at 0: it trained
    assert json.load(open(out / "merged" / "config.json"))["architectures"] == ["Qwen2ForCausalLM"]


@pytest.mark.parametrize("method", ["grpo", "rloo"])
def test_group_methods_on_real_prompts(method, real_sft, real_rm, module_tmp):
    """GRPO / RLOO (LoRA) against the real reward model on the real prompts, 2 completions per prompt: the reward
    model's rewards are logged, the adapter and merged policy are written."""
    from rlhf_trl import grpo

    out = module_tmp(f"real_{method}")
    grpo.main(["--config", str(RECIPES / f"{method}.yaml"), "--model_name_or_path", real_sft["merged"],
               "--reward_model_path", real_rm["merged"], "--output_dir", str(out), "--max_steps", "1",
               "--per_device_train_batch_size", "2", "--num_generations", "2", "--max_completion_length", "8",
               "--eval_split_size", "4", "--report_to", "none"], method=method)
    logged = [h for h in json.load(open(out / "log_history.json"))["log_history"] if "rewards/reward_model/mean" in h]
    assert len(logged) == 1 and abs(logged[0]["rewards/reward_model/mean"]) < 100
    assert os.path.isfile(out / "merged" / "model.safetensors") and os.path.isdir(out / "adapter")


def real_ppo_argv(real_model, real_rm, out, *extra):
    """One PPO update (2 x 2 episodes) of the stock directory against the smoke RM, without a value adapter."""
    return ["--config", str(RECIPES / "ppo.yaml"), "--sft_model_path", real_model, "--reward_model_path",
            real_rm["merged"], "--output_dir", str(out), "--total_episodes", "4", "--per_device_train_batch_size",
            "2", "--response_length", "12", "--eval_split_size", "4", "--per_device_eval_batch_size", "2",
            "--log_samples_every", "0", "--reward_baseline", "0.0", "--report_to", "none", "--save_strategy", "no",
            "--value_use_peft", "false", "--share_reward_value_base", "false", *extra]


def test_value_head_on_the_real_policy(real_model, real_rm, module_tmp):
    """``value_head: true`` on real weights: no value model is loaded; the head (896 inputs) moved from zero and is
    saved beside the adapter and the merged policy."""
    from safetensors.torch import load_file

    from rlhf_trl import ppo

    res = ppo.main(real_ppo_argv(real_model, real_rm, module_tmp("real_ppo_value_head"), "--value_head", "true"))
    assert res["value_model"] is None
    for folder in ("adapter", "merged"):
        head = load_file(os.path.join(res["output_dir"], folder, "value_head.safetensors"))
        assert head["v_head.summary.weight"].shape == (1, 896) and head["v_head.summary.weight"].abs().sum() > 0
    log = [h for h in res["trainer"].state.log_history if "loss/value_avg" in h][-1]
    assert torch.isfinite(torch.tensor(log["loss/value_avg"]))


def test_ptx_on_the_real_policy(real_model, real_rm, module_tmp):
    """PPO-ptx on real weights and real SFT rows: the ptx loss (nats per answer token) is logged and in the range of
    a pretrained model's SFT loss; every ptx row is counted in data_report.json."""
    from rlhf_trl import ppo

    data = SHARED / "data" / "zh" / "oaast_sft_zh.json"
    res = ppo.main(real_ppo_argv(real_model, real_rm, module_tmp("real_ppo_ptx"), "--ptx_dataset", str(data),
                                 "--ptx_coef", "0.05", "--ptx_max_length", "128"))
    log = [h for h in res["trainer"].state.log_history if "loss/ptx_avg" in h][-1]
    assert 0.1 < log["loss/ptx_avg"] < 8.0, log
    report = json.load(open(os.path.join(res["output_dir"], "data_report.json")))
    assert "ptx" in json.dumps(report)

"""PPO around TRL's trainer: exact resume, saved critic, precision, reward baseline, KL control, divergence, samples."""

import json
import os
from contextlib import nullcontext

import pytest
import torch
from conftest import RECIPES
from safetensors.torch import load_file
from transformers import TrainerCallback

from rlhf_trl import ppo, ppo_engine
from rlhf_trl.ppo import AdaptiveKLController, TrainingDivergedError, rollout_generation_config


def ppo_argv(assets, sft_run, rm_run, out, *extra):
    return [
        "--config", f"{RECIPES}/ppo.yaml", "--dataset_name", assets["prompts"],
        "--sft_model_path", sft_run["merged"], "--reward_model_path", rm_run["merged"], "--output_dir", str(out),
        "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1", "--logging_steps", "1",
        "--log_samples_every", "0", *extra,
    ]


class Crash(TrainerCallback):
    """Simulates a killed run: raises right after checkpoint `at` has been written."""

    def __init__(self, at):
        self.at = at

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            raise KeyboardInterrupt(f"crash after checkpoint {self.at}")


@pytest.mark.slow  # two PPO runs (~15 s)
def test_resume_continues_exactly(assets, sft_run, rm_run, tmp_path):
    """N updates straight == N/2 updates, crash, resume, N/2 more (policy and value weights bit for bit)."""
    common = ["--total_episodes", "32", "--save_steps", "2", "--kl_target", "0.5", "--kl_horizon", "40"]
    straight = ppo.main(ppo_argv(assets, sft_run, rm_run, tmp_path / "a", *common))
    with pytest.raises(KeyboardInterrupt):
        ppo.main(ppo_argv(assets, sft_run, rm_run, tmp_path / "b", *common), callbacks=[Crash(2)])
    assert sorted(os.listdir(tmp_path / "b")) == ["checkpoint-2", "runs"]  # no staging leftovers
    resumed = ppo.main(ppo_argv(assets, sft_run, rm_run, tmp_path / "b", *common, "--resume_from_checkpoint", "true"))

    for name in ("merged", "value_model"):
        a = load_file(os.path.join(straight[name], "model.safetensors"))
        b = load_file(os.path.join(resumed[name], "model.safetensors"))
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (name, k)
    steps = [h["step"] for h in resumed["trainer"].state.log_history if "objective/kl" in h]
    assert steps == [1, 2, 3, 4]  # the step counter continues after the restored history
    assert resumed["metrics"]["episode"] == straight["metrics"]["episode"] == 32
    assert resumed["metrics"]["kl_coef_final"] == straight["metrics"]["kl_coef_final"]


def test_every_checkpoint_holds_policy_value_and_recipe(assets, sft_run, rm_run, tmp_path):
    res = ppo.main(ppo_argv(assets, sft_run, rm_run, tmp_path, "--total_episodes", "16", "--save_steps", "1"))
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    for step in (1, 2):
        ckpt = tmp_path / f"checkpoint-{step}"
        for f in ("adapter_model.safetensors", "run_config.yaml", "optimizer.pt", "data_state.pt",
                  "merged/model.safetensors", "value_model/model.safetensors"):
            assert (ckpt / f).exists(), f
        AutoModelForCausalLM.from_pretrained(ckpt / "merged")
        _, info = AutoModelForSequenceClassification.from_pretrained(ckpt / "value_model", output_loading_info=True)
        assert not info["missing_keys"]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp")]
    assert res["metrics"]["global_step"] == 2


def test_bf16_gradient_checkpointing_and_value_lora_are_honoured(assets, sft_run, rm_run, tmp_path):
    res = ppo.main(ppo_argv(
        assets, sft_run, rm_run, tmp_path, "--total_episodes", "8", "--bf16", "true",
        "--gradient_checkpointing", "true", "--value_use_peft", "true", "--value_lora_r", "4",
        "--save_strategy", "no",
    ))
    trainer = res["trainer"]
    wrapper = trainer.accelerator.unwrap_model(trainer.model)
    assert next(wrapper.policy.parameters()).dtype == torch.bfloat16
    assert wrapper.policy.is_gradient_checkpointing
    value_base = wrapper.value_model.get_base_model()
    assert value_base.is_gradient_checkpointing
    trainable = {n for n, p in wrapper.value_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or "score" in n for n in trainable)  # the critic's base is frozen
    assert not trainer.reward_model.training
    assert not any(p.requires_grad for p in trainer.reward_model.parameters())
    from transformers import AutoModelForSequenceClassification

    AutoModelForSequenceClassification.from_pretrained(res["value_model"])  # merged critic reloads


def test_auto_reward_baseline_is_the_mean_sft_score(assets, sft_run, rm_run, tmp_path):
    res = ppo.main(ppo_argv(assets, sft_run, rm_run, tmp_path, "--total_episodes", "8", "--reward_baseline", "auto",
                            "--reward_baseline_batches", "2", "--save_steps", "1"))
    baseline = res["metrics"]["reward_baseline"]
    # recompute independently: sample 2 batches of 8 prompts from the SFT policy, score with the RM, average
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    trainer = res["trainer"]
    policy = AutoModelForCausalLM.from_pretrained(sft_run["merged"])
    rm = AutoModelForSequenceClassification.from_pretrained(rm_run["merged"]).eval()
    again = ppo.calibrate_reward_baseline(policy, rm, trainer.processing_class, trainer.train_dataset, trainer.args, 2)
    assert baseline == pytest.approx(again, abs=1e-5)
    assert abs(baseline) > 0.01
    saved = json.load(open(tmp_path / "checkpoint-1" / "reward_baseline.json"))
    assert saved["reward_baseline"] == pytest.approx(baseline)
    assert float(open(tmp_path / "run_config.yaml").read().split("reward_baseline: '")[1].split("'")[0]) == \
        pytest.approx(baseline)


def test_adaptive_kl_controller_moves_the_coefficient_the_right_way():
    c = AdaptiveKLController(0.1, target=2.0, horizon=100)
    up = c.update(current_kl=10.0, n_steps=10)
    assert up == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))  # error clipped at +0.2
    down = c.update(current_kl=1.0, n_steps=10)
    assert down < up and down == pytest.approx(up * (1 - 0.2 * 10 / 100))
    same = c.update(current_kl=2.0, n_steps=10)
    assert same == pytest.approx(down)


def test_kl_coefficient_is_logged_and_adapted(assets, sft_run, rm_run, tmp_path):
    res = ppo.main(ppo_argv(assets, sft_run, rm_run, tmp_path, "--total_episodes", "24", "--kl_coef", "0.05",
                            "--kl_target", "1000", "--kl_horizon", "10", "--save_strategy", "no"))
    coefs = [h["objective/kl_coef"] for h in res["trainer"].state.log_history if "objective/kl_coef" in h]
    assert len(coefs) == 3 and coefs[0] == pytest.approx(0.05)
    assert coefs[2] < coefs[1] < coefs[0]  # KL far below target: the coefficient shrinks


def test_stock_generation_settings_are_overridden_for_rollouts_and_returned(sft_run, caplog):
    """A stock generation_config (top_k / top_p / repetition_penalty) runs: PPO samples with temperature only,
    logs one line naming what it overrides, and hands back the stock config for the saved models."""
    import logging

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(sft_run["merged"])
    model.generation_config.repetition_penalty = 1.1
    model.generation_config.top_k = 20
    with caplog.at_level(logging.INFO, logger="rlhf_trl.ppo"):
        stock = rollout_generation_config(model, sft_run["merged"], [0, 2], pad_token_id=3, temperature=0.7)
    lines = [r.getMessage() for r in caplog.records if "overriding" in r.getMessage()]
    assert len(lines) == 1 and "'repetition_penalty': 1.1" in lines[0] and "'top_k': 20" in lines[0]
    assert stock.repetition_penalty == 1.1 and stock.top_k == 20
    used, _ = model._prepare_generation_config(None)  # what generate() will sample with
    assert (used.repetition_penalty, used.top_k, used.top_p, used.temperature) == (1.0, 0, 1.0, 0.7)
    assert used.eos_token_id == [0, 2] and used.pad_token_id == 3


class PoisonValueHead(TrainerCallback):
    """Makes the value head NaN right after checkpoint `at` is written, as a blown-up update would."""

    def __init__(self, at):
        self.at = at

    def on_save(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.at:
            with torch.no_grad():
                model.value_model.score.weight.fill_(float("nan"))


@pytest.mark.slow  # two PPO runs (~5 s)
def test_non_finite_values_stop_the_run_and_keep_the_last_good_checkpoint(assets, sft_run, rm_run, tmp_path):
    with pytest.raises(TrainingDivergedError, match=r"non-finite .*loss/value_avg.* at update 3.*checkpoint-2"):
        ppo.main(ppo_argv(assets, sft_run, rm_run, tmp_path, "--total_episodes", "40", "--save_steps", "1"),
                 callbacks=[PoisonValueHead(2)])
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("checkpoint")) == ["checkpoint-1", "checkpoint-2"]
    value = load_file(tmp_path / "checkpoint-2" / "value_model" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in value.values())


@pytest.mark.slow  # PPO runs (~3 s)
def test_one_statistic_per_update_is_not_divergence(assets, sft_run, rm_run, tmp_path):
    """One micro-batch, one mini-batch, one PPO epoch: TRL logs the variance of one ratio (NaN); the run goes on."""
    res = ppo.main(ppo_argv(assets, sft_run, rm_run, tmp_path, "--total_episodes", "16", "--num_ppo_epochs", "1",
                            "--save_strategy", "no"))
    logs = [h for h in res["trainer"].state.log_history if "objective/kl" in h]
    assert res["metrics"]["global_step"] == 2 and len(logs) == 2
    assert all(h["val/ratio_var"] != h["val/ratio_var"] for h in logs)  # NaN, as TRL computes it
    assert all(torch.isfinite(torch.tensor(h["loss/value_avg"])) for h in logs)


@pytest.mark.slow  # PPO runs of several updates (~6 s)
def test_sample_tables_every_n_updates(assets, sft_run, rm_run, tmp_path):
    ppo.main(ppo_argv(assets, sft_run, rm_run, tmp_path, "--total_episodes", "32", "--reward_baseline", "0.5",
                      "--save_strategy", "no", "--log_samples_every", "2"))
    rows = [json.loads(x) for x in open(tmp_path / "samples.jsonl", encoding="utf-8")]
    assert sorted({r["step"] for r in rows}) == [1, 3]  # TRL samples after updates 1, 1+2, ...
    assert all(r["reward"] == pytest.approx(r["score"] - 0.5) for r in rows)
    assert {"query", "response", "score", "reward"} <= set(rows[0])


def test_negative_kl_is_warned_about(ppo_run, caplog):
    import logging

    trainer = ppo_run["trainer"]
    with caplog.at_level(logging.WARNING, logger="rlhf_trl.ppo"):
        trainer.log({"objective/kl": -0.25, "objective/scores": 1.0})
    assert "mean KL to the reference is negative (-0.2500)" in caplog.text


def test_missing_eos_penalty_sees_only_the_completion(tokenizer, assets):
    """Prompts never hold an EOS id (data text is tokenized with special tokens split), so TRL's check for EOS in
    the response decides the penalty alone: a prompt that mentions "<|endoftext|>" cannot satisfy it."""
    from rlhf_trl.data import Template, prompt_features

    ids = prompt_features([{"question": "写出<|endoftext|>这个词"}], tokenizer, Template(), 64)["input_ids"][0]
    assert tokenizer.eos_token_id not in ids


def test_shared_reward_value_base_holds_one_copy_and_keeps_the_reward_frozen(assets, sft_run, rm_run, tmp_path,
                                                                            monkeypatch, tokenizer):
    """share_reward_value_base: the reward model is the value model's base with the adapter off: no weights of its
    own, the same scores as the reward model loaded fresh at every update, while the value head and adapter train."""
    from transformers import AutoModelForSequenceClassification

    from conftest import engine_reward as get_reward

    from rlhf_trl.scoring import pad_right, score_sequences

    fresh_rm = AutoModelForSequenceClassification.from_pretrained(rm_run["merged"]).eval()
    seqs = [tokenizer("问：你觉得滑雪怎么样？\n\n答：滑雪很棒，我很喜欢。")["input_ids"] + [tokenizer.eos_token_id],
            tokenizer("问：书店好不好？\n\n答：书店太差了。")["input_ids"] + [tokenizer.eos_token_id]]
    expected = score_sequences(fresh_rm, seqs, tokenizer.pad_token_id)
    seen = {}
    original_train = ppo.RLHFPPOTrainer.train

    def spy_train(self, *args, **kwargs):
        seen["trainer"] = self
        return original_train(self, *args, **kwargs)

    class Check(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            trainer = seen["trainer"]
            rm = trainer.reward_model
            assert isinstance(rm, ppo.SharedBaseRewardModel)
            got = score_sequences(rm, seqs, tokenizer.pad_token_id)
            seen.setdefault("reward_gaps", []).append(float((got - expected).abs().max()))
            value = trainer.accelerator.unwrap_model(trainer.model).value_model
            with torch.no_grad():  # the value model as TRL reads it
                ids = pad_right(seqs, tokenizer.pad_token_id)
                seen.setdefault("values", []).append(get_reward(value, ids, tokenizer.pad_token_id, 1)[1])

    monkeypatch.setattr(ppo.RLHFPPOTrainer, "train", spy_train)
    res = ppo.main(ppo_argv(assets, sft_run, rm_run, tmp_path, "--total_episodes", "24", "--value_use_peft", "true",
                            "--share_reward_value_base", "true", "--save_strategy", "no"), callbacks=[Check()])
    trainer = seen["trainer"]
    assert res["metrics"]["global_step"] == 3 and len(seen["reward_gaps"]) == 3
    assert max(seen["reward_gaps"]) < 1e-5  # the reward model stayed the reward model while the value model trained
    assert not torch.allclose(seen["values"][0], seen["values"][-1])  # ... and the value model did train

    # one copy of the reward/value weights: every reward-model tensor is a tensor of the value model (or its head)
    wrapper = trainer.accelerator.unwrap_model(trainer.model)
    value_ptrs = {p.data_ptr() for p in wrapper.value_model.parameters()}
    backbone = trainer.reward_model if trainer.reward_model is not None else None
    assert backbone is None  # after the final in-place merge the shared reward model is released
    base_bytes = sum(p.numel() * p.element_size() for p in fresh_rm.parameters())
    owned = sum(p.numel() * p.element_size() for p in wrapper.value_model.parameters())
    assert owned < 1.1 * base_bytes  # the value model = the RM's weights + a small adapter and head
    assert value_ptrs

    from safetensors.torch import load_file as load

    value = load(os.path.join(res["value_model"], "model.safetensors"))
    rm = load(os.path.join(rm_run["merged"], "model.safetensors"))
    assert any(not torch.equal(value[k], rm[k]) for k in rm)  # the saved value model is the trained one
    assert torch.equal(load(os.path.join(rm_run["merged"], "model.safetensors"))["score.weight"], rm["score.weight"])


def test_rollouts_use_the_kv_cache_under_gradient_checkpointing(assets, sft_run, rm_run, tmp_path):
    """TRL generates rollouts in train mode; with gradient checkpointing on, generation must still use the KV cache
    (transformers >= 5 keeps it under no_grad): each new token is one single-token forward pass, while the training
    passes still run with gradients."""
    seen = []

    class Hook(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            policy = model.policy.get_base_model()
            seen.append(policy.is_gradient_checkpointing)
            policy.model.embed_tokens.register_forward_hook(
                lambda module, inputs, output: seen.append((tuple(inputs[0].shape), torch.is_grad_enabled()))
            )

    ppo.main(ppo_argv(assets, sft_run, rm_run, tmp_path, "--total_episodes", "8", "--gradient_checkpointing", "true",
                      "--response_length", "12", "--save_strategy", "no"), callbacks=[Hook()])
    assert seen[0] is True
    calls = seen[1:]
    single_token = [shape for shape, grad in calls if shape[1] == 1 and not grad]
    growing = sorted({shape[1] for shape, grad in calls if shape[1] > 1 and not grad})
    assert len(single_token) >= 3  # incremental decoding: one position per new token after the prompt
    assert len(growing) <= 3, growing  # prompt (prefill) and full sequences (scoring), not one length per new token
    assert any(grad for _, grad in calls)  # the training forward passes still ran with gradients


@pytest.mark.slow  # two PPO runs (~3 s)
def test_resume_with_another_total_is_refused(assets, sft_run, rm_run, tmp_path):
    """The checkpoint's learning-rate schedule and data order belong to its run's length: a changed total_episodes
    would resume with a wrong schedule (a learning rate of 0), so it is refused, naming both lengths."""
    with pytest.raises(KeyboardInterrupt):
        ppo.main(ppo_argv(assets, sft_run, rm_run, tmp_path, "--total_episodes", "24", "--save_steps", "1"),
                 callbacks=[Crash(1)])
    with pytest.raises(ValueError, match=r"checkpoint-1 belongs to a run of 3 updates; this recipe makes 6"):
        ppo.main(ppo_argv(assets, sft_run, rm_run, tmp_path, "--total_episodes", "48", "--resume_from_checkpoint",
                          "true"))


@pytest.mark.slow  # PPO runs of several updates (~8 s)
def test_logging_steps_is_honoured_and_the_last_update_logged(assets, sft_run, rm_run, tmp_path):
    res = ppo.main(ppo_argv(assets, sft_run, rm_run, tmp_path, "--total_episodes", "40", "--logging_steps", "2",
                            "--save_strategy", "no"))
    logged = [h["step"] for h in res["trainer"].state.log_history if "objective/kl" in h]
    assert logged == [2, 4, 5]
    assert res["metrics"]["global_step"] == 5 and "objective/scores" in res["metrics"]


@pytest.mark.slow  # two PPO runs (~10 s)
def test_single_value_forward_gives_the_same_update_with_one_value_forward_less(assets, sft_run, rm_run, tmp_path):
    """1 PPO epoch of 1 mini-batch: the value model's training forward also gives the rollout's values
    (`PPOEngine.value_step`). Against the separate no-grad forward (TRL 1.12's order, ``single_value_forward:
    false``): the same losses, statistics and weights to fp32 rounding, and one value forward per micro-batch (with
    gradient) instead of a rollout forward too."""
    class Hook(TrainerCallback):
        def __init__(self):
            self.calls = []  # (rows, with gradient) of each value forward

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            model.value_model.score.register_forward_hook(  # the score head sees every value forward
                lambda module, inputs, output: self.calls.append((len(inputs[0]), torch.is_grad_enabled())))

    runs = {}
    for flag in ("true", "false"):
        hook = Hook()
        res = ppo.main(ppo_argv(assets, sft_run, rm_run, tmp_path / flag, "--total_episodes", "16",
                                "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
                                "--local_rollout_forward_batch_size", "8", "--num_ppo_epochs", "1",
                                "--single_value_forward", flag, "--save_strategy", "no"), callbacks=[hook])
        runs[flag] = (res, hook.calls)
    (fused, fused_calls), (separate, separate_calls) = runs["true"], runs["false"]
    assert fused["trainer"].single_value_forward and not separate["trainer"].single_value_forward
    assert fused_calls == [(4, True)] * 4  # 2 updates x 2 micro-batches, each forward with gradient
    assert separate_calls == [(8, False), (4, True), (4, True)] * 2  # + the rollout's no-grad forward per update
    logs = [[h for h in r["trainer"].state.log_history if "loss/value_avg" in h] for r in (fused, separate)]
    assert len(logs[0]) == len(logs[1]) == 2
    for a, b in zip(*logs):
        for key in ("loss/value_avg", "loss/policy_avg", "objective/scores", "objective/kl", "val/ratio",
                    "policy/approxkl_avg", "policy/entropy_avg"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
        assert a["val/clipfrac_avg"] == b["val/clipfrac_avg"] == 0
    for name in ("merged", "value_model"):
        a = load_file(os.path.join(fused[name], "model.safetensors"))
        b = load_file(os.path.join(separate[name], "model.safetensors"))
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6,
                                       msg=lambda m, name=name, k=k: f"{name} {k}: {m}")


def test_the_inverse_cdf_sampler_draws_every_rollout_token(assets, sft_run, rm_run, tmp_path, monkeypatch):
    """`rollout_sampler: inverse_cdf`: each decoding step of the rollout draws its 8 tokens through
    `ppo_math.inverse_cdf_sample` (not `torch.multinomial`'s exponential draws), and the drawn tokens are the
    rollout's responses; an unknown sampler stops the run before anything is written."""
    import rlhf_trl.ppo_math as pm

    drawn = []
    real = pm.inverse_cdf_sample
    monkeypatch.setattr(pm, "inverse_cdf_sample", lambda probs, u: drawn.append(real(probs, u)) or drawn[-1])
    responses = []
    real_generate = ppo_engine.generate_rollouts

    def generate_rollouts(policy, queries, *args, **kwargs):
        out = real_generate(policy, queries, *args, **kwargs)
        responses.append((out[0][:, queries.shape[1]:], args[0]))  # the responses, the pad id
        return out

    monkeypatch.setattr(ppo_engine, "generate_rollouts", generate_rollouts)
    ppo.main(ppo_argv(assets, sft_run, rm_run, tmp_path, "--total_episodes", "8", "--response_length", "12",
                      "--save_strategy", "no", "--rollout_sampler", "inverse_cdf"))
    assert len(responses) == 1 and len(drawn) >= 1 and all(d.shape == (8,) for d in drawn)
    steps = torch.stack(drawn, 1)  # [8, steps]: each step's draws, in order
    sampled, pad = responses[0][0][:, :steps.shape[1]], responses[0][1]
    real_tokens = sampled != pad  # after its EOS a row gets padding, not its draws
    assert real_tokens[:, 0].all() and torch.equal(sampled[real_tokens], steps[real_tokens])
    with pytest.raises(ValueError, match=r"argument --rollout_sampler/--rollout-sampler: invalid choice: 'gumbel' "
                                         r"\(choose from 'multinomial', 'inverse_cdf'\)$"):
        ppo.main(ppo_argv(assets, sft_run, rm_run, tmp_path / "bad", "--rollout_sampler", "gumbel"))
    assert not (tmp_path / "bad").exists()
    recipe = ppo_engine.PPOConfig(output_dir=str(tmp_path / "bad"), use_cpu=True, bf16=False)
    recipe.rollout_sampler = "gumbel"  # a recipe's value that no command-line parser checked
    with pytest.raises(ValueError, match=r"^rollout_sampler must be 'multinomial' or 'inverse_cdf', got 'gumbel'$"):
        ppo_engine.check_config(recipe)



def _tiny_value_model(seed=0):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0)
    return Qwen2ForSequenceClassification(config).float()


def test_the_value_models_embedding_gradient_adds_only_the_looked_up_rows():
    """`rows_only_embedding_gradient`: two micro-batches' backward passes give the embedding the same dense gradient
    as the default lookup (to fp32 rounding), without a zero-filled [vocab, hidden] tensor per backward; the other
    parameters' gradients are bit for bit the default's; on exit the lookup is dense again."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(1, 300, (4, 12), generator=torch.Generator().manual_seed(1))
    grads, kernels = {}, {}
    for mode in ("dense", "rows"):
        model = _tiny_value_model()
        context = ppo_engine.rows_only_embedding_gradient(model) if mode == "rows" else nullcontext()
        with context, profile(activities=[ProfilerActivity.CPU]) as prof:
            for rows in (ids[:2], ids[2:]):  # micro-batches sharing tokens
                model(input_ids=rows).logits.square().sum().backward()
        kernels[mode] = {e.key: e.count for e in prof.key_averages()}
        grads[mode] = {k: p.grad for k, p in model.named_parameters()}
        assert not model.get_input_embeddings().sparse and not any(g.is_sparse for g in grads[mode].values())
    name = "model.embed_tokens.weight"
    torch.testing.assert_close(grads["rows"][name], grads["dense"][name], rtol=1e-6, atol=1e-7)
    assert all(torch.equal(grads["rows"][k], grads["dense"][k]) for k in grads["dense"] if k != name)
    assert kernels["dense"].get("aten::embedding_dense_backward") == 2
    assert "aten::embedding_dense_backward" not in kernels["rows"]


def test_linear_weight_gradients_go_straight_into_the_kept_gradient_tensors():
    """`weight_gradients_in_place`: over two micro-batches the linears' weight and bias gradients are autograd's (the
    first micro-batch's bit for bit, the sum to fp32 rounding), written into the ``.grad`` tensors already there (stale
    values overwritten, the same memory), the second micro-batch's weight products adding into them; the other
    parameters go through autograd as before; a handled linear that no backward reached has its kept gradient zeroed;
    on exit the forwards are their own again; under autocast a linear stops with one line."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(1, 300, (4, 12), generator=torch.Generator().manual_seed(1))
    grads, counts = {}, {}
    for mode in ("autograd", "in_place"):
        model = _tiny_value_model()
        if mode == "in_place":  # kept tensors holding last update's numbers
            for p in model.parameters():
                p.grad = torch.full_like(p, 7.0)
        pointers = {k: p.grad.data_ptr() for k, p in model.named_parameters() if p.grad is not None}
        context = ppo_engine.weight_gradients_in_place(model) if mode == "in_place" else nullcontext([])
        with context as handled, profile(activities=[ProfilerActivity.CPU]) as prof:
            names = {k for k, p in model.named_parameters() if any(p is h for h in handled)}
            for p in model.parameters():
                if mode == "in_place" and not any(p is h for h in handled):
                    p.grad.zero_()  # what value_step does for the parameters autograd accumulates
            first = None
            for rows in (ids[:2], ids[2:]):
                model(input_ids=rows).logits.square().sum().backward()
                first = first or {k: p.grad.clone() for k, p in model.named_parameters()}
        counts[mode] = {e.key: e.count for e in prof.key_averages()}
        grads[mode] = (first, {k: p.grad for k, p in model.named_parameters()}, names)
        assert all(p.grad.data_ptr() == pointers[k] for k, p in model.named_parameters() if k in pointers)
        assert all("forward" not in vars(m) for m in model.modules())
    (first_a, last_a, _), (first_i, last_i, names) = grads["autograd"], grads["in_place"]
    linears = {k for k in last_a if k.endswith(("proj.weight", "proj.bias")) or k == "score.weight"}
    assert names == linears and len(linears) == 2 * 7 + 3 * 2 + 1  # 7 projections, q/k/v biases, per layer; score
    for k in last_a:
        assert torch.equal(first_i[k], first_a[k]), k
        torch.testing.assert_close(last_i[k], last_a[k], rtol=1e-6, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}")
    # the second micro-batch: each weight's gradient product adds into .grad (addmm_), no separate product + sum
    weights = sum(k.endswith("weight") for k in linears)
    assert counts["in_place"].get("aten::addmm_", 0) - counts["autograd"].get("aten::addmm_", 0) == weights
    assert counts["autograd"]["aten::mm"] - counts["in_place"]["aten::mm"] == weights

    spare = torch.nn.Linear(3, 2)
    spare.weight.grad, spare.bias.grad = torch.ones(2, 3), torch.ones(2)
    with ppo_engine.weight_gradients_in_place(spare) as handled:
        assert len(handled) == 2 and handled[0] is spare.weight
    assert not spare.weight.grad.any() and not spare.bias.grad.any()
    with pytest.raises(RuntimeError, match=r"^weight_gradients_in_place: a linear ran under autocast$"), \
            ppo_engine.weight_gradients_in_place(spare), torch.autocast("cpu", dtype=torch.bfloat16):
        spare(torch.ones(1, 3))


def test_lora_wrapped_and_frozen_linears_keep_autograds_gradients():
    """`weight_gradients_in_place` takes only a plain linear's trained fp32 weight: a LoRA-wrapped projection's frozen
    base is left alone (its adapters, plain linears, are taken), as is a frozen linear."""
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(_tiny_value_model(), LoraConfig(r=4, target_modules=["q_proj"], task_type="SEQ_CLS"))
    with ppo_engine.weight_gradients_in_place(lora) as handled:
        taken = {k for k, p in lora.named_parameters() if any(p is h for h in handled)}
        lora(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    assert taken and all(".lora_A." in k or ".lora_B." in k or ".score." in k for k in taken), taken
    assert all(p.grad is not None for k, p in lora.named_parameters() if p.requires_grad)
    frozen = torch.nn.Linear(3, 2).requires_grad_(False)
    with ppo_engine.weight_gradients_in_place(frozen) as handled:
        assert handled == [] and "forward" not in vars(frozen)


def test_offloaded_weights_come_back_bit_for_bit_in_parallel_reads(tmp_path, monkeypatch):
    """`OffloadedWeights.read` reads its parameters in ``torch.get_num_threads()`` groups, one thread each: every
    parameter (fp32 and bf16, a tied one once) comes back bit for bit, also when the threads outnumber the parameters
    and when one thread reads all; a file that no longer holds a parameter's bytes stops with one line naming it."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 64, bias=False),
                                 torch.nn.Linear(64, 8).to(torch.bfloat16))
    module[1].weight = torch.nn.Parameter(module[0].weight.detach().t().contiguous())
    module.tied = torch.nn.Linear(64, 8, bias=False)
    module.tied.weight = module[2].weight  # stored once
    kept = {k: v.clone() for k, v in module.state_dict().items()}
    offloaded = ppo_engine.OffloadedWeights(module, str(tmp_path / "rm.safetensors"))
    assert all(p.numel() == 0 for p in module.parameters())
    for threads in (2, 8, 1):
        monkeypatch.setattr(torch, "get_num_threads", lambda threads=threads: threads)
        with offloaded.loaded():
            state = module.state_dict()
            assert state.keys() == kept.keys() and all(torch.equal(state[k], kept[k]) for k in kept)
            assert module.tied.weight is module[2].weight
        assert all(p.numel() == 0 for p in module.parameters())
    with open(tmp_path / "rm.safetensors", "r+b") as f:  # the file loses its last bytes underneath
        f.truncate(os.path.getsize(tmp_path / "rm.safetensors") - 4)
    last = max(offloaded.params, key=lambda n: data_end(tmp_path / "rm.safetensors", n))
    with pytest.raises(RuntimeError, match=rf"^offload_reward_model: {tmp_path / 'rm.safetensors'}: {last} does not "
                                           rf"hold \[.*\] torch\.\w+ values$"):
        offloaded.read()


def data_end(path, name):
    """Where tensor ``name``'s bytes end in safetensors file ``path``."""
    import json
    import struct

    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size))[name]["data_offsets"][1]


def test_a_frozen_or_lora_wrapped_embedding_is_left_as_it_is():
    from peft import LoraConfig, get_peft_model

    frozen = _tiny_value_model()
    frozen.get_input_embeddings().weight.requires_grad_(False)
    lora = get_peft_model(_tiny_value_model(), LoraConfig(r=4, target_modules=["q_proj"], task_type="SEQ_CLS"))
    for model in (frozen, lora):
        with ppo_engine.rows_only_embedding_gradient(model):
            assert not model.get_input_embeddings().sparse
            model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
        assert model.get_input_embeddings().weight.grad is None


def _demo_rollout_setup(assets, response_length: int):
    """The demo's tokenizer, its base model as an eval-mode policy, and the rollout's sampling config (no EOS stop,
    ``response_length`` new tokens)."""
    from transformers import AutoModelForCausalLM

    from rlhf_trl.models import load_tokenizer

    tok = load_tokenizer(assets["tokenizer"])
    policy = AutoModelForCausalLM.from_pretrained(assets["base_model"]).eval()
    config = ppo_engine.sampling_config(
        ppo_engine.PPOConfig(output_dir="unused", response_length=response_length, bf16=False), None, tok.pad_token_id)
    return tok, policy, config


def test_rollouts_skip_the_no_op_min_p_filter_with_the_same_tokens(assets, monkeypatch):
    """`sampling_generation_config` sets min_p 0.0 (a checkpoint's min_p must not leak in), which still builds
    transformers' MinPLogitsWarper (a softmax and a top-k per decoding step, removing nothing): `generate_rollouts`
    unsets it when the model has no min_p of its own. Same tokens and log-probs, bit for bit; a model whose
    generation config has a min_p keeps the 0.0 (its min_p is not filled in)."""
    from transformers.generation import logits_process

    tok, policy, config = _demo_rollout_setup(assets, response_length=8)
    queries = torch.randint(3, 200, (4, 6), generator=torch.Generator().manual_seed(0))
    assert config.min_p == 0.0
    built = []
    real = logits_process.MinPLogitsWarper.__init__
    monkeypatch.setattr(logits_process.MinPLogitsWarper, "__init__",
                        lambda self, min_p, **kw: built.append(min_p) or real(self, min_p, **kw))
    torch.manual_seed(1)
    skipped = ppo_engine.generate_rollouts(policy, queries, tok.pad_token_id, config, 4)
    assert built == [] and config.min_p == 0.0  # the caller's config is not changed
    torch.manual_seed(1)
    mask = queries != tok.pad_token_id
    with torch.no_grad():  # what the rollout did before: the config as given, the no-op filter built
        out = policy.generate(input_ids=queries.masked_fill(~mask, 0), attention_mask=mask, generation_config=config,
                              return_dict_in_generate=True, output_scores=True)
    assert built == [0.0]
    assert torch.equal(skipped[0], out.sequences)
    logprobs = torch.stack([ppo_engine.pm.selective_log_softmax(s[:, None], out.sequences[:, 6 + t, None])[:, 0]
                            for t, s in enumerate(out.scores)], 1)
    assert torch.equal(skipped[1], logprobs)
    policy.generation_config.min_p = 0.05
    ppo_engine.generate_rollouts(policy, queries, tok.pad_token_id, config, 4)
    assert built == [0.0, 0.0]  # the model's own min_p would otherwise come in: the 0.0 stays
    # what a PPO run does: `rollout_generation_config` gives the policy PPO's sampling config first (a stock min_p
    # logged and overridden); its rollouts then build no MinP filter either
    stock = rollout_generation_config(policy, "demo", [], tok.pad_token_id, 1.0)
    assert stock.min_p == 0.05 and policy.generation_config.min_p is None
    torch.manual_seed(1)
    again = ppo_engine.generate_rollouts(policy, queries, tok.pad_token_id, config, 4)
    assert built == [0.0, 0.0] and torch.equal(again[0], skipped[0]) and torch.equal(again[1], skipped[1])


def test_rollout_log_probs_take_one_log_softmax_per_decoding_step(assets, monkeypatch):
    """`generate_rollouts` turns each decoding step's sampling logits ``[rows, vocab]`` into the sampled tokens'
    log-probs with one logsumexp over all rows of the step, not one per row and step (selective_log_softmax's
    per-row loop): the same values (bit for bit at the demo's vocabulary; log_softmax + gather to 1e-6), and
    ``rows x steps`` logsumexp calls become ``steps``."""
    tok, policy, config = _demo_rollout_setup(assets, response_length=7)
    queries = torch.randint(3, 200, (6, 5), generator=torch.Generator().manual_seed(0))
    calls = []
    real_lse = torch.logsumexp
    monkeypatch.setattr(torch, "logsumexp", lambda x, *a, **kw: calls.append(tuple(x.shape)) or real_lse(x, *a, **kw))
    torch.manual_seed(3)
    query_responses, logprobs = ppo_engine.generate_rollouts(policy, queries, tok.pad_token_id, config, 3)
    assert calls == [(3, policy.config.vocab_size)] * 14  # 2 generate calls of 3 rows x 7 steps: one per step
    monkeypatch.setattr(torch, "logsumexp", real_lse)
    torch.manual_seed(3)
    mask = queries != tok.pad_token_id
    expected = []
    with torch.no_grad():
        for i in (0, 3):
            out = policy.generate(input_ids=queries[i:i + 3].masked_fill(~mask[i:i + 3], 0),
                                  attention_mask=mask[i:i + 3], generation_config=config, return_dict_in_generate=True,
                                  output_scores=True)
            assert torch.equal(out.sequences, query_responses[i:i + 3])
            ids = out.sequences[:, 5:]
            per_row = torch.stack([ppo_engine.pm.selective_log_softmax(s[:, None], ids[:, t, None])[:, 0]
                                   for t, s in enumerate(out.scores)], 1)
            full = torch.log_softmax(torch.stack(out.scores, 1), -1).gather(-1, ids[..., None])[..., 0]
            torch.testing.assert_close(per_row, full, rtol=0, atol=1e-6)
            expected.append(per_row)
    assert torch.equal(logprobs, torch.cat(expected))

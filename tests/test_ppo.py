"""The PPO stage (`rlhf_trl.ppo`, `rlhf_trl.ppo_trainer`) end to end: exact resume, saved critic, precision, reward
baseline, KL control, divergence, samples. The engine's own tests (rollouts, `single_value_forward`, memory measures)
are in test_ppo_engine.py."""

import json
import os

import pytest
import torch
from conftest import crash_after, ppo_argv
from safetensors.torch import load_file
from transformers import TrainerCallback

from rlhf_trl import ppo, ppo_engine
from rlhf_trl.ppo import AdaptiveKLController, TrainingDivergedError, rollout_generation_config


@pytest.mark.slow  # two PPO runs (~15 s)
def test_resume_continues_exactly(assets, sft_run, rm_run, tmp_path):
    """N updates straight == N/2 updates, crash, resume, N/2 more (policy and value weights bit for bit)."""
    common = ["--total_episodes", "32", "--save_steps", "2", "--kl_target", "0.5", "--kl_horizon", "40"]
    straight = ppo.main(ppo_argv(assets, sft_run, rm_run, tmp_path / "a", *common))
    with pytest.raises(KeyboardInterrupt):
        ppo.main(ppo_argv(assets, sft_run, rm_run, tmp_path / "b", *common), callbacks=[crash_after(2)])
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


def test_a_stop_in_the_last_update_resumes_into_the_final_outputs(assets, sft_run, rm_run, tmp_path, caplog):
    """SIGTERM during the last update: its checkpoint is written and the run stops without its final outputs; the
    resume it names then runs no update and writes them (merged/, value_model/, metrics.json). total_episodes 12 at 8
    per update: 2 whole updates (16 episodes), said in the log."""
    import signal

    from rlhf_trl.run_dir import StoppedBySignal

    class TermAtLast(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == state.max_steps:
                os.kill(os.getpid(), signal.SIGTERM)

    argv = ppo_argv(assets, sft_run, rm_run, tmp_path, "--total_episodes", "12", "--save_steps", "1")
    with caplog.at_level("INFO", logger="rlhf_trl"), pytest.raises(StoppedBySignal, match="at update 2"):
        ppo.main(argv, callbacks=[TermAtLast()])
    assert "total_episodes 12: 2 updates of 8 episodes (whole updates: 16 episodes)" in caplog.text
    assert not os.path.exists(tmp_path / "merged") and os.path.isdir(tmp_path / "checkpoint-2")
    resumed = ppo.main(argv + ["--resume_from_checkpoint", "true"])
    assert os.path.isdir(resumed["merged"]) and os.path.isdir(resumed["value_model"])
    assert resumed["metrics"]["episode"] == 16
    assert [h["step"] for h in resumed["trainer"].state.log_history if "objective/kl" in h] == [1, 2]


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
    """One micro-batch, one mini-batch, one PPO epoch: the variance of one ratio is logged as 0 (TRL 1.12 logged NaN, which
    strict JSON cannot hold); the run goes on."""
    res = ppo.main(ppo_argv(assets, sft_run, rm_run, tmp_path, "--total_episodes", "16", "--num_ppo_epochs", "1",
                            "--save_strategy", "no"))
    logs = [h for h in res["trainer"].state.log_history if "objective/kl" in h]
    assert res["metrics"]["global_step"] == 2 and len(logs) == 2
    assert all(h["val/ratio_var"] == 0.0 for h in logs)  # one value has no spread (TRL 1.12: NaN)
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
        ppo_engine.check_finite(trainer, {"objective/kl": -0.25, "objective/scores": 1.0})
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
                 callbacks=[crash_after(1)])
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


def test_offloaded_weights_come_back_bit_for_bit(tmp_path):
    """`OffloadedWeights` writes the parameters once (a tied one once) and releases them; inside ``loaded()`` every
    parameter (fp32 and bf16) is back bit for bit and the tie holds; after it they are empty again; ``restore``
    brings them back for good and deletes the file."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 64, bias=False),
                                 torch.nn.Linear(64, 8).to(torch.bfloat16))
    module.tied = torch.nn.Linear(64, 8, bias=False)
    module.tied.weight = module[2].weight  # stored once
    kept = {k: v.clone() for k, v in module.state_dict().items()}
    path = tmp_path / "rm.safetensors"
    offloaded = ppo_engine.OffloadedWeights(module, str(path))
    assert all(p.numel() == 0 for p in module.parameters())
    for _ in range(2):
        with offloaded.loaded():
            state = module.state_dict()
            assert state.keys() == kept.keys() and all(torch.equal(state[k], kept[k]) for k in kept)
            assert module.tied.weight is module[2].weight
        assert all(p.numel() == 0 for p in module.parameters())
    offloaded.restore()
    assert all(torch.equal(module.state_dict()[k], kept[k]) for k in kept) and not path.exists()

"""`rlhf_trl.ppo_engine.PPOEngine`, the PPO engine, on its own terms: its rollouts are samples of the policy (tokens
and log-probs equal ``model.generate(..., output_scores=True)`` re-scored); ``single_value_forward`` gives the same
update with one value forward less; and its memory measures change no number: policy and value losses
back-propagated one after the other (one model's activations alive at a time) and the reward model's weights kept
on disk between rollouts (``offload_reward_model``) give bit-identical weights and logs to TRL's single joint
backward with the reward model in memory. The PPO stage end to end is in test_ppo.py; the engine against TRL 1.12's
numbers in test_ppo_oracle.py."""

import glob
import os

import pytest
import torch
from conftest import RECIPES, demo_rollout_setup, import_ppo, ppo_argv
from safetensors.torch import load_file
from transformers import TrainerCallback

from rlhf_trl import ppo, ppo_engine

COMMON = ["--total_episodes", "16", "--save_strategy", "no", "--num_ppo_epochs", "2", "--num_mini_batches", "2"]
TIMING = ("eps",)


# -- rollouts and the value forward ---------------------------------------------------------------------------------
def test_the_engines_rollouts_are_samples_of_the_policy(assets, monkeypatch):
    """The engine's own rollout (`PPOEngine.rollout`: left-padded prompts, stop at EOS, sampled log-probs) draws the
    tokens that ``model.generate(..., output_scores=True)`` draws for the same seed and settings, its log-probs are
    that call's scores re-scored (log_softmax, gathered), and they equal the policy's own log-probs of those tokens
    at the rollout temperature (`scoring.response_logprobs`, teacher-forced): the rollouts are samples of the policy
    the KL and the policy gradient assume. The recorded oracle replays TRL's tokens, so it cannot see this path."""
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification

    from rlhf_trl.scoring import response_logprobs, truncate_at_eos

    tok, policy, _ = demo_rollout_setup(assets, response_length=9)
    reward_model = AutoModelForSequenceClassification.from_pretrained(assets["base_model"], num_labels=1).eval()
    reward_model.config.pad_token_id = tok.pad_token_id
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]
    queries = torch.tensor([[tok.pad_token_id] * (5 - len(p)) + p for p in prompts])
    args = ppo_engine.PPOConfig(output_dir="unused", response_length=9, temperature=0.7, stop_token="eos",
                                per_device_train_batch_size=3, bf16=False, use_cpu=True, report_to=[],
                                local_rollout_forward_batch_size=2)
    engine = ppo_engine.PPOEngine(args, tok, policy, None, reward_model,
                                  Dataset.from_dict({"input_ids": prompts}), value_model=reward_model)
    torch.manual_seed(11)
    ro = engine.rollout(queries, None, update=1)
    config = ppo_engine.sampling_config(args, engine.eos_token_ids, tok.pad_token_id)
    torch.manual_seed(11)
    mask = queries != tok.pad_token_id
    expected_tokens, expected_logprobs = [], []
    with torch.no_grad():
        for i in (0, 2):  # the rollout's generate calls: local_rollout_forward_batch_size rows each
            out = policy.generate(input_ids=queries[i:i + 2].masked_fill(~mask[i:i + 2], 0),
                                  attention_mask=mask[i:i + 2], generation_config=config,
                                  return_dict_in_generate=True, output_scores=True)
            ids = out.sequences[:, 5:]
            expected_tokens += [row for row in ids]
            lp = torch.log_softmax(torch.stack(out.scores, 1), -1).gather(-1, ids[..., None])[..., 0]
            expected_logprobs += [row for row in lp]
    for row, (tokens, logprobs) in enumerate(zip(expected_tokens, expected_logprobs)):
        n = len(tokens)
        assert torch.equal(ro.responses[row, :n], tokens)
        torch.testing.assert_close(ro.logprobs[row, :n], logprobs, rtol=0, atol=1e-5)
    post = truncate_at_eos(ro.responses, engine.eos_token_ids, tok.pad_token_id)
    real = post != tok.pad_token_id
    with torch.no_grad():
        forced = response_logprobs(policy, ro.query_responses, 5, tok.pad_token_id, args.temperature + 1e-7)
    torch.testing.assert_close(forced[real], ro.logprobs[real], rtol=0, atol=1e-4)
    assert ro.ended.tolist() == [bool(r.any()) for r in torch.isin(post, torch.tensor(engine.eos_token_ids))]


@pytest.mark.slow  # two PPO runs (~10 s)
def test_single_value_forward_gives_the_same_update_with_one_value_forward_less(assets, sft_run, rm_run, tmp_path):
    """1 PPO epoch of 1 mini-batch: the value model's training forward also gives the rollout's values
    (`ppo_engine.value_step`). Against the separate no-grad forward (TRL 1.12's order, ``single_value_forward:
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


# -- the memory measures change no number ---------------------------------------------------------------------------
def weights(run):
    return {name: load_file(os.path.join(run[name], "model.safetensors")) for name in ("merged", "value_model")}


def assert_same_run(a, b):
    wa, wb = weights(a), weights(b)
    for name in wa:
        assert wa[name].keys() == wb[name].keys()
        for k in wa[name]:
            assert torch.equal(wa[name][k], wb[name][k]), (name, k)
    logs = [[{k: v for k, v in h.items() if k not in TIMING} for h in r["trainer"].state.log_history] for r in (a, b)]
    assert logs[0] == logs[1]


@pytest.fixture(scope="module")
def default_run(assets, sft_run, rm_run, tmp_path_factory):
    return import_ppo().main(ppo_argv(assets, sft_run, rm_run, tmp_path_factory.mktemp("ppo_default"), *COMMON))


@pytest.mark.slow  # whole runs of the PPO stage
def test_split_backward_equals_the_joint_backward(assets, sft_run, rm_run, tmp_path, default_run, monkeypatch):
    assert default_run["trainer"].split_backward  # one process: the split path is the default
    init = ppo_engine.PPOEngine.__init__

    def joint(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.split_backward = False  # TRL's pg_loss + vf_coef * vf_loss through one backward

    monkeypatch.setattr(ppo_engine.PPOEngine, "__init__", joint)
    run = import_ppo().main(ppo_argv(assets, sft_run, rm_run, tmp_path, *COMMON))
    assert not run["trainer"].split_backward
    assert_same_run(default_run, run)


class SeesOffloadedRewardModel(TrainerCallback):
    """Records, after each update, how many reward-model weights are in memory and which offload files exist."""

    def __init__(self):
        self.trainer, self.seen = None, []

    def on_step_end(self, args, state, control, **kwargs):
        numel = sum(p.numel() for p in self.trainer.reward_model.parameters())
        self.seen.append((numel, sorted(os.path.basename(p) for p in glob.glob(f"{args.output_dir}/.tmp-offload-*"))))


@pytest.mark.slow  # whole runs of the PPO stage
def test_offloaded_reward_model_changes_nothing(assets, sft_run, rm_run, tmp_path, default_run, monkeypatch):
    seen = SeesOffloadedRewardModel()
    init = ppo_engine.PPOEngine.__init__

    def remember(self, *args, **kwargs):
        init(self, *args, **kwargs)
        seen.trainer = self

    monkeypatch.setattr(ppo_engine.PPOEngine, "__init__", remember)
    run = import_ppo().main(ppo_argv(assets, sft_run, rm_run, tmp_path, *COMMON, "--offload_reward_model", "true",
                                     "--num_sample_generations", "2"), callbacks=[seen])
    assert seen.seen == [(0, [".tmp-offload-reward-model-0.safetensors"])] * 2  # on disk between uses
    assert not glob.glob(f"{tmp_path}/.tmp-offload-*")  # removed at the end
    assert sum(p.numel() for p in run["trainer"].reward_model.parameters()) > 0  # an ordinary module again
    assert_same_run(default_run, run)


@pytest.mark.slow  # whole runs of the PPO stage
def test_offload_is_refused_for_a_reward_model_shared_with_the_value_model(assets, sft_run, rm_run, tmp_path):
    with pytest.raises(ValueError, match=r"^offload_reward_model: the reward model shares weights with the value "
                                         r"model \(share_reward_value_base\); set `offload_reward_model: false`$"):
        import_ppo().main(ppo_argv(assets, sft_run, rm_run, tmp_path, *COMMON, "--offload_reward_model", "true",
                                   "--value_use_peft", "true", "--share_reward_value_base", "true"))
    assert not glob.glob(f"{tmp_path}/.tmp-offload-*")


@pytest.mark.parametrize("epochs, mini_batches", [(1, 1), (2, 2)])
def test_every_update_takes_epochs_x_mini_batches_optimizer_steps(epochs, mini_batches, assets, sft_run, rm_run,
                                                                   tmp_path):
    """16 training prompts, 2 x 4 per update: every second update ends a pass over them, where TRL 1.12 stepped the
    optimizer once per micro-batch (1, 4, 1, 4, ... optimizer steps). Every update takes ``num_ppo_epochs x
    num_mini_batches`` steps (counted by torch's global optimizer step hook between updates)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    count, per_update = [0], []

    class PerUpdate(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            per_update.append(count[0])
            count[0] = 0

    handle = register_optimizer_step_post_hook(lambda *a: count.__setitem__(0, count[0] + 1))
    try:
        ppo.main(["--config", f"{RECIPES}/ppo.yaml", "--dataset_name", assets["prompts"], "--sft_model_path",
                  sft_run["merged"], "--reward_model_path", rm_run["merged"], "--output_dir", str(tmp_path),
                  "--max_samples", "32", "--eval_split_size", "16", "--per_device_train_batch_size", "2",
                  "--gradient_accumulation_steps", "4", "--num_ppo_epochs", str(epochs), "--num_mini_batches",
                  str(mini_batches), "--single_value_forward", "false", "--total_episodes", "48",
                  "--save_strategy", "no", "--log_samples_every", "0"], callbacks=[PerUpdate()])
    finally:
        handle.remove()
    assert per_update == [epochs * mini_batches] * 6

"""The PPO oracle: ten updates of `rlhf_trl.ppo_engine.PPOEngine` against TRL 1.12's ``PPOTrainer``.

    PYTHONPATH=src python tests/ppo_oracle.py [--out tests/fixtures/ppo_oracle.pt]   # needs trl==1.12.0

Both trainers get the same tiny Qwen2 policy (LoRA), reward model and value model (initial weights fixed by a seed),
the same prompts, collator and settings, and run ten updates. Recorded per update: the sampled ``query_responses``
``[batch, seq_len]`` (token ids), the reward model's raw scores ``[batch]`` (reward units), the whitened advantages
``[batch, response_len]``, and TRL's logged statistics (KL, rewards, losses, clip fractions, ratio, entropy); at the
end the policy's LoRA weights and the value model's weights.

Without ``--out`` the script runs both trainers and prints the largest relative differences. With ``--out`` it writes
TRL's trajectory and the initial weights to a small ``.pt`` file; tests/test_ppo_oracle.py compares the engine
against it when trl 1.12 is no longer installed (the engine then replays TRL's recorded rollouts, so the comparison
does not depend on the sampler's random numbers) and against TRL itself while it is. Under another trl the script
stops and says so. It is test infrastructure, not a benchmark: run it from the repository root in a venv with
``trl==1.12.0`` (e.g. ``.venv-trl112``, which ``make bench-real`` builds).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
from types import SimpleNamespace

import torch

UPDATES = 10
# float64: both trainers' rounding falls far below the comparison's 1e-5, so a difference above it is a difference in
# the algorithm (in float32 the two drift apart by ~1e-5 over ten updates through rounding alone)
DTYPE = torch.float64
PAD, EOS, VOCAB = 0, 1, 48
STATS = ("objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
         "objective/scores", "policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg", "loss/value_avg",
         "val/clipfrac_avg", "policy/entropy_avg", "val/ratio")
SETTINGS = dict(
    per_device_train_batch_size=4, gradient_accumulation_steps=2, num_mini_batches=2, num_ppo_epochs=2,
    total_episodes=8 * UPDATES, response_length=6, local_rollout_forward_batch_size=4, temperature=0.9,
    learning_rate=5e-3, kl_coef=0.05, missing_eos_penalty=1.0, stop_token="eos", vf_coef=0.1, cliprange=0.2,
    cliprange_value=0.2, gamma=1.0, lam=0.95, seed=7, num_sample_generations=0, per_device_eval_batch_size=2,
    save_strategy="no", report_to="none", logging_steps=1, gradient_checkpointing=False, bf16=False, use_cpu=True,
    lr_scheduler_type="linear", disable_tqdm=True,
)


class Collator:
    """Left-pads ``input_ids`` with `PAD` (what ``DataCollatorWithPadding`` does for a left-padding tokenizer)."""

    def __call__(self, rows):
        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), width), PAD, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r["input_ids"]):] = torch.tensor(r["input_ids"])
        return {"input_ids": ids}


def initial_weights(seed: int = 0) -> dict:
    """Initial state dicts of the policy and the reward model (the value model starts as the reward model)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    cfg = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD, eos_token_id=EOS,
               bos_token_id=EOS, tie_word_embeddings=False)
    torch.manual_seed(seed)
    policy = Qwen2ForCausalLM(Qwen2Config(**cfg))
    reward = Qwen2ForSequenceClassification(Qwen2Config(**cfg, num_labels=1))
    with torch.no_grad():  # make EOS a likely token, so responses end and the penalty path is exercised
        policy.lm_head.weight[EOS] *= 4
    return {"config": cfg, "policy": policy.state_dict(), "reward": reward.state_dict()}


def prompts(seed: int = 0, n: int = 24) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def build(init: dict):
    """Fresh models from ``init``: (LoRA policy, reward model, value model, train / eval datasets, tokenizer stand-in)."""
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    from transformers import set_seed

    set_seed(SETTINGS["seed"])  # python, numpy (mini-batch shuffles) and torch RNGs: the same start for both trainers
    policy = Qwen2ForCausalLM(Qwen2Config(**init["config"]))
    policy.load_state_dict(init["policy"])
    policy.generation_config = GenerationConfig(eos_token_id=EOS, pad_token_id=PAD)
    torch.manual_seed(1)
    policy = get_peft_model(policy, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights="gaussian",
                                               target_modules=["q_proj", "v_proj", "lm_head"]))
    reward = Qwen2ForSequenceClassification(Qwen2Config(**init["config"], num_labels=1))
    reward.load_state_dict(init["reward"])
    policy, reward = policy.to(DTYPE), reward.to(DTYPE)
    value = copy.deepcopy(reward)
    rows = prompts()
    train = Dataset.from_dict({"input_ids": rows[:20]})
    evals = Dataset.from_dict({"input_ids": rows[20:]})
    tok = SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS)
    return policy, reward, value, train, evals, tok


def _record(trajectory: dict, key: str, value: torch.Tensor) -> None:
    trajectory.setdefault(key, []).append(value.detach().float().cpu().clone())


def _finish(trajectory: dict, log_history: list, policy, value) -> dict:
    trajectory["stats"] = [{k: h[k] for k in STATS} for h in log_history if "objective/kl" in h]
    trajectory["policy_lora"] = {k: v.detach().clone() for k, v in policy.state_dict().items() if "lora_" in k}
    trajectory["value"] = {k: v.detach().clone() for k, v in value.state_dict().items()}
    return trajectory


def with_one_step_per_mini_batch(accelerator, args) -> None:
    """The engine's fix, applied to TRL 1.12's accelerator: accumulate over a mini-batch's micro-batches only, and no
    sync at the end of the prompt data loader (TRL 1.12 accumulated ``gradient_accumulation_steps`` micro-batches,
    across mini-batches, and stepped once per micro-batch in the update that ended a pass over the prompts)."""
    local_mini = args.per_device_train_batch_size * args.gradient_accumulation_steps // args.num_mini_batches
    accelerator.gradient_accumulation_steps = -(-local_mini // args.per_device_train_batch_size)
    accelerator.gradient_state.plugin_kwargs["sync_with_dataloader"] = False


def run_trl(init: dict, workdir: str) -> dict:
    """Ten updates of TRL 1.12's PPOTrainer; its trajectory (see the module docstring)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import trl.experimental.ppo.ppo_trainer as trl_ppo
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    policy, reward, value, train, evals, tok = build(init)
    args = PPOConfig(output_dir=workdir, **SETTINGS)
    trajectory: dict = {}
    originals = (trl_ppo.batch_generation, trl_ppo.get_reward, trl_ppo.masked_whiten)

    def batch_generation(*a, **k):
        out = originals[0](*a, **k)
        trajectory.setdefault("query_responses", []).append(out[0].clone())
        trajectory.setdefault("rng_after_rollout", []).append(torch.get_rng_state())  # later shuffles draw from it
        trajectory.setdefault("scores", []).append(torch.zeros(0))
        return out

    def get_reward(model, *a, **k):  # called per rollout-forward chunk: the update's scores are concatenated
        out = originals[1](model, *a, **k)
        if model is reward:
            trajectory["scores"][-1] = torch.cat((trajectory["scores"][-1], out[1].detach().float().cpu()))
        return out

    def masked_whiten(values, mask, shift_mean=True):
        out = originals[2](values, mask, shift_mean)
        _record(trajectory, "advantages", out.masked_fill(~mask, 0))
        return out

    trl_ppo.batch_generation, trl_ppo.get_reward, trl_ppo.masked_whiten = batch_generation, get_reward, masked_whiten
    try:
        trainer = PPOTrainer(args=args, processing_class=tok, model=policy, ref_model=None, reward_model=reward,
                             train_dataset=train, value_model=value, data_collator=Collator(), eval_dataset=evals)
        with_one_step_per_mini_batch(trainer.accelerator, args)
        trainer.train()
    finally:
        trl_ppo.batch_generation, trl_ppo.get_reward, trl_ppo.masked_whiten = originals
    return _finish(trajectory, trainer.state.log_history, policy, value)


def run_engine(init: dict, workdir: str, replay: dict | None = None) -> dict:
    """Ten updates of the project's engine; with ``replay`` (a recorded trajectory) the rollouts are its
    ``query_responses`` instead of fresh samples (their log-probs then come from a forward pass of the policy), and
    the torch RNG is set to the state recorded after each rollout (the data loader's next shuffle draws from it)."""
    from rlhf_trl import ppo_engine
    from rlhf_trl.ppo_engine import PPOConfig, PPOEngine

    policy, reward, value, train, evals, tok = build(init)
    args = PPOConfig(output_dir=workdir, **SETTINGS)
    engine = PPOEngine(args=args, processing_class=tok, model=policy, ref_model=None, reward_model=reward,
                       train_dataset=train, value_model=value, data_collator=Collator(), eval_dataset=evals)
    trajectory: dict = {}
    rollout, advantages = engine.rollout, engine.advantages

    def recorded_rollout(queries, rows, update):
        ro = rollout(queries, rows, update)
        trajectory.setdefault("query_responses", []).append(ro.query_responses.clone())
        raw = ro.scores + args.missing_eos_penalty * (~ro.ended).float()
        _record(trajectory, "scores", raw)
        return ro

    def recorded_advantages(ro):
        adv = advantages(ro)
        _record(trajectory, "advantages", adv["advantages"])
        return adv

    engine.rollout, engine.advantages = recorded_rollout, recorded_advantages
    original_generate = ppo_engine.generate_rollouts
    if replay is not None:
        queue = list(zip(replay["query_responses"], replay["rng_after_rollout"]))

        def replayed(policy_model, queries, pad_token_id, generation_config, batch):
            qr, rng = queue.pop(0)
            qr = qr.to(queries.device)
            torch.set_rng_state(rng)
            assert torch.equal(qr[:, :queries.shape[1]], queries), "replayed rollouts belong to other prompts"
            with torch.no_grad():
                lp = ppo_engine.response_logprobs(policy_model, qr, queries.shape[1], pad_token_id,
                                                  args.temperature + 1e-7)  # the engine's (TRL 1.12's) divisor
            return qr, lp

        ppo_engine.generate_rollouts = replayed
    try:
        engine.train()
    finally:
        ppo_engine.generate_rollouts = original_generate
    return _finish(trajectory, engine.state.log_history, engine.unwrapped.policy, engine.unwrapped.value_model)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max|a - b| / max(max|b|, 1e-6)`` over all entries (0 for equal tensors; ``inf`` for other shapes)."""
    if a.shape != b.shape:
        return float("inf")
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / max(float(b.abs().max()), 1e-6)) if a.numel() else 0.0


def compare(engine: dict, reference: dict) -> dict:
    """Largest relative difference per quantity: ``{"tokens_equal": bool, "scores": x, ..., "final_value": x}``."""
    out = {"tokens_equal": all(torch.equal(a, b) for a, b in zip(engine["query_responses"],
                                                                 reference["query_responses"]))
           and len(engine["query_responses"]) == len(reference["query_responses"]) == UPDATES}
    for key in ("scores", "advantages"):  # each update's tensor against its own scale
        out[key] = max(relative_error(a, b) for a, b in zip(engine[key], reference[key]))
    for key in STATS:  # each statistic's ten values against their scale over the run
        out[key] = relative_error(torch.tensor([a[key] for a in engine["stats"]]),
                                  torch.tensor([b[key] for b in reference["stats"]]))
    out["updates"] = min(len(engine["stats"]), len(reference["stats"]))
    out["final_policy_lora"] = max(relative_error(engine["policy_lora"][k], v)
                                   for k, v in reference["policy_lora"].items())
    out["final_value"] = max(relative_error(engine["value"][k], v) for k, v in reference["value"].items())
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write TRL's trajectory (and the initial weights) here, e.g. "
                                  "tests/fixtures/ppo_oracle.pt")
    args = ap.parse_args(argv)
    import trl

    if trl.__version__ != "1.12.0":
        raise SystemExit(f"ppo_oracle: needs trl==1.12.0 (the last release with PPOTrainer); found {trl.__version__}. "
                         "Build a venv with `pip install trl==1.12.0 -e .` and run this script there.")
    torch.set_num_threads(1)
    init = initial_weights()
    with tempfile.TemporaryDirectory() as tmp:
        reference = run_trl(init, os.path.join(tmp, "trl"))
        ours = run_engine(init, os.path.join(tmp, "engine"))
    result = compare(ours, reference)
    result["first_update"] = {"trl": reference["stats"][0], "engine": ours["stats"][0]}
    if args.out:
        torch.save({"init": init, "trajectory": reference, "settings": SETTINGS, "trl": trl.__version__,
                    "torch": torch.__version__}, args.out)
        result["written"] = args.out
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)

"""Stage 3: PPO against the reward model with a KL penalty to a frozen reference (TRL 1.12's PPOTrainer).

Run: ``rlhf-trl ppo --config recipes/demo/ppo.yaml`` (or ``python -m rlhf_trl.ppo``, ``make ppo RECIPE=...``).

This is the only module that imports ``trl.experimental.ppo`` (PPOTrainer was removed in TRL 1.13).

Models:
  - policy: the merged SFT model (``sft_model_path``) plus a LoRA adapter (``use_peft: true``); the reference is the
    same model with the adapter disabled, so no second copy of the weights is held;
  - reward model: the merged RM (``reward_model_path``), frozen, in eval mode, its score shifted by
    ``reward_baseline`` (score - baseline);
  - value model: initialized from the reward model (``value_model_path`` overrides), trained with the policy.

Outputs under ``output_dir``: ``checkpoint-*/`` (policy adapter, optimizer, scheduler, RNG, trainer state and
``value_model/``), ``adapter/``, ``merged/`` (plain causal LM + tokenizer), ``value_model/``, ``samples.jsonl``
(query / response / score / reward tables logged every ``num_sample_generations``-th of training),
``run_config.yaml`` and ``metrics.json``.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

import torch
from datasets import Dataset
from transformers import TrainerCallback

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # pinned to trl 1.12.0 on purpose: see pyproject.toml
from trl.experimental.ppo import PPOConfig, PPOTrainer  # noqa: E402  (the one import of TRL's PPO)

from .config import parse_recipe, save_recipe, sibling_recipe
from .data import DataArguments, Template, describe_sources, prompt_features, read_records, split_records
from .models import (
    load_causal_lm,
    load_sequence_classifier,
    load_tokenizer,
    merge_and_save,
    require_model_dir,
    save_pretrained_atomic,
    torch_dtype,
    write_json,
)

logger = logging.getLogger(__name__)


@dataclass
class PPOScriptArguments:
    """PPO fields that TRL's PPOConfig lacks."""

    reward_baseline: float = field(
        default=0.0,
        metadata={"help": "Subtracted from every reward-model score before PPO sees it (reward units)."},
    )
    value_model_path: str | None = field(
        default=None, metadata={"help": "Value model initialization (default: the reward model)."}
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Run model code shipped in the model directories (e.g. Baichuan)."}
    )


class BaselineShiftedScore(torch.nn.Module):
    """Wraps a reward model's ``score`` head so that it returns ``score(hidden) - baseline``.

    PPOTrainer reads rewards as ``reward_model.score(hidden_states)`` at the last non-pad token
    (``trl.experimental.utils.get_reward``); replacing the head is how the baseline reaches it.
    Input ``[batch, seq_len, hidden]``, output ``[batch, seq_len, 1]``.
    """

    def __init__(self, score: torch.nn.Module, baseline: float):
        super().__init__()
        self.inner = score
        self.register_buffer("baseline", torch.tensor(float(baseline)), persistent=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.inner(hidden_states) - self.baseline.to(hidden_states.dtype)


def apply_reward_baseline(reward_model, baseline: float):
    """Freeze ``reward_model``, put it in eval mode and shift its score head by ``-baseline``. Returns the model."""
    reward_model.eval()
    reward_model.requires_grad_(False)
    if isinstance(reward_model.score, BaselineShiftedScore):
        reward_model.score = reward_model.score.inner
    if baseline:
        reward_model.score = BaselineShiftedScore(reward_model.score, baseline)
    return reward_model


class SaveValueModelCallback(TrainerCallback):
    """Writes the value model into each checkpoint (``checkpoint-N/value_model``); PPOTrainer saves the policy only."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer

    def on_save(self, args, state, control, model=None, **kwargs):
        if not state.is_world_process_zero or model is None:
            return
        ckpt = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if os.path.isdir(ckpt):
            save_pretrained_atomic(model.value_model, None, os.path.join(ckpt, "value_model"))


class RLHFPPOTrainer(PPOTrainer):
    """TRL's PPOTrainer with sample tables that go to the logs and to ``samples.jsonl`` (not only to rich/wandb)."""

    reward_baseline: float = 0.0

    def generate_completions(self, sampling: bool = False):
        """Sample one eval batch (near-greedy, as TRL does), score it and log query / response / score / reward."""
        from transformers import GenerationConfig

        from trl.experimental.ppo.ppo_trainer import batch_generation, truncate_response
        from trl.experimental.utils import get_reward

        if self.eval_dataset is None:
            return
        tok = self.processing_class
        gen_config = GenerationConfig(
            max_new_tokens=self.args.response_length, temperature=0.01 + 1e-7, top_k=0, top_p=1.0, do_sample=True
        )
        policy = self.accelerator.unwrap_model(self.model).policy
        rows = []
        for batch in self.eval_dataloader:
            query = batch["input_ids"]
            with torch.no_grad():
                context_length = query.shape[1]
                query_response, _ = batch_generation(policy, query, query.shape[0], tok.pad_token_id, gen_config)
                response = query_response[:, context_length:]
                if self.stop_token_id is not None:
                    response = truncate_response(self.stop_token_id, tok.pad_token_id, response)
                _, reward, _ = get_reward(
                    self.reward_model, torch.cat((query, response), 1), tok.pad_token_id, context_length
                )
            for q, r, s in zip(
                tok.batch_decode(query, skip_special_tokens=True),
                tok.batch_decode(response, skip_special_tokens=True),
                reward.float().cpu().tolist(),
            ):
                rows.append(
                    {"step": self.state.global_step, "query": q, "response": r,
                     "score": s + self.reward_baseline, "reward": s}
                )
            if sampling:
                break
        if not self.accelerator.is_main_process or not rows:
            return
        lines = [f"samples at update {self.state.global_step} (score = RM score, reward = score - baseline):"]
        for row in rows[:4]:
            lines.append(f"  {row['query']!r} -> {row['response']!r}  score={row['score']:.3f} reward={row['reward']:.3f}")
        logger.info("\n".join(lines))
        os.makedirs(self.args.output_dir, exist_ok=True)
        with open(os.path.join(self.args.output_dir, "samples.jsonl"), "a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")


def recipe_types() -> tuple:
    """The dataclasses a PPO recipe fills: data fields, `PPOScriptArguments`, TRL's `PPOConfig` and `ModelConfig`."""
    from trl import ModelConfig

    return (DataArguments, PPOScriptArguments, PPOConfig, ModelConfig)


def main(argv: list[str] | None = None) -> dict:
    """Parse a recipe and run PPO. Returns ``{"output_dir", "merged", "value_model", "metrics"}``; see `run`."""
    data_args, ppo_args, training_args, model_args, recipe = parse_recipe(recipe_types(), argv)
    return run(
        data_args, ppo_args, training_args, model_args,
        sft_hint=sibling_recipe(recipe, "sft"), rm_hint=sibling_recipe(recipe, "rm"),
    )


def run(data_args, ppo_args: PPOScriptArguments, training_args, model_args, sft_hint=None, rm_hint=None) -> dict:
    """Train the policy with PPO on the prompts of ``data_args.dataset_name``.

    Raises:
        StageInputError: the SFT or reward model is missing (the hint names the stage to run first).
        DataError: bad rows; ValueError: fewer eval prompts than ``per_device_eval_batch_size``.
    """
    from peft import PeftModel
    from trl import get_peft_config

    # inputs
    sft_path = require_model_dir(training_args.sft_model_path, "SFT model", sft_hint)
    rm_path = require_model_dir(training_args.reward_model_path, "reward model", rm_hint)
    value_path = require_model_dir(ppo_args.value_model_path or rm_path, "value model", rm_hint)

    # data
    template = Template.from_args(data_args)
    records = read_records(data_args, "prompts")
    train_records, eval_records = split_records(records, data_args.eval_split_size, training_args.seed)
    if len(eval_records) < training_args.per_device_eval_batch_size:
        raise ValueError(
            f"{describe_sources(data_args)}: {len(eval_records)} eval prompts, fewer than per_device_eval_batch_size="
            f"{training_args.per_device_eval_batch_size}; raise eval_split_size"
        )

    # tokenizer and models (prompts left-padded; pad distinct from EOS)
    remote = ppo_args.trust_remote_code
    tokenizer = load_tokenizer(sft_path, padding_side="left", trust_remote_code=remote)
    train_ds = Dataset.from_dict(prompt_features(train_records, tokenizer, template, data_args.max_prompt_length))
    eval_ds = Dataset.from_dict(prompt_features(eval_records, tokenizer, template, data_args.max_prompt_length))
    dtype = torch_dtype(model_args.dtype)
    policy = load_causal_lm(sft_path, dtype, remote)
    reward_model = load_sequence_classifier(rm_path, dtype, remote)
    value_model = load_sequence_classifier(value_path, dtype, remote)
    for name, m in (("policy", policy), ("reward model", reward_model), ("value model", value_model)):
        if m.config.vocab_size < len(tokenizer):
            raise ValueError(f"{name} vocabulary ({m.config.vocab_size}) is smaller than the tokenizer's ({len(tokenizer)})")
        m.config.pad_token_id = tokenizer.pad_token_id
    policy.generation_config.pad_token_id = tokenizer.pad_token_id
    apply_reward_baseline(reward_model, ppo_args.reward_baseline)

    # trainer
    trainer = RLHFPPOTrainer(
        args=training_args,
        processing_class=tokenizer,
        model=policy,
        ref_model=None,  # with LoRA: the policy with its adapter disabled
        reward_model=reward_model,
        value_model=value_model,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        peft_config=get_peft_config(model_args),
        callbacks=[SaveValueModelCallback(tokenizer)],
    )
    trainer.reward_baseline = ppo_args.reward_baseline

    # train
    trainer.train()

    # save: adapter, merged policy, value model, run config
    out = training_args.output_dir
    save_recipe(out, data_args, ppo_args, training_args, model_args)
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    if isinstance(unwrapped.policy, PeftModel):
        unwrapped.policy.save_pretrained(os.path.join(out, "adapter"))
    merged = os.path.join(out, "merged")
    merge_and_save(unwrapped.policy, tokenizer, merged)
    value_dir = save_pretrained_atomic(unwrapped.value_model, tokenizer, os.path.join(out, "value_model"))

    # evaluate: the last logged training statistics
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    metrics = {"global_step": trainer.state.global_step, "episode": trainer.state.episode}
    if logs:
        metrics.update({k: v for k, v in logs[-1].items() if isinstance(v, (int, float))})
        metrics["first_scores"] = logs[0]["objective/scores"]
    write_json(os.path.join(out, "metrics.json"), metrics)
    logger.info("PPO done: merged policy at %s, value model at %s", merged, value_dir)
    return {"output_dir": out, "merged": merged, "value_model": value_dir, "metrics": metrics}


if __name__ == "__main__":
    from .cli import run_stage

    run_stage("ppo")

"""Stage 3 without a value model: GRPO (`trl.GRPOTrainer`) or RLOO (`trl.RLOOTrainer`) against the PPO stage's rewards.
Run: ``rlhf-trl grpo --config recipes/demo/grpo.yaml`` / ``rlhf-trl rloo --config ...`` (``make grpo``). Each prompt is
sampled ``num_generations`` times; a completion's advantage is its reward minus its group's mean (GRPO: Shao et al.
2024, "DeepSeekMath", arXiv:2402.03300) or the other completions' mean (RLOO: Ahmadian et al. 2024, arXiv:2402.14740),
as TRL computes them; no critic. Rewards as PPO's: the reward model's score at the EOS of the same token ids
(`rlhf_trl.reward_models.score_responses`; of another tokenizer: the text re-encoded) minus ``reward_baseline`` (it
cancels in the advantages: logged rewards only), minus ``missing_eos_penalty`` without EOS, plus ``reward_funcs`` x
``reward_weights`` (the reward model's weight is 1). Reference: the frozen SFT policy (LoRA: the adapter disabled;
``beta`` 0: none). Outputs as DPO's: ``checkpoint-*/``, ``adapter/`` (LoRA), ``merged/``, ``metrics.json``,
``log_history.json``, ``run_config.yaml``, ``data_report.json``."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from datasets import Dataset

from . import cli_launch
from .checkpoints import keeps_earlier_run, loading_on_one_process
from .config import Recipe, RunArguments, sibling_recipe
from .data import DataArguments, DataReport, Template, describe_sources, prompt_features
from .models import eos_token_ids, load_sequence_classifier, require_model_dir, torch_dtype
from .reward_models import RewardTokens, require_reward_model, reward_tokens, score_responses
from .rewards import RewardFunctions, load_reward_functions, reward_columns
from .stage_setup import Stage


@dataclass
class GroupRewardArguments:
    """The reward fields of a grpo / rloo recipe (TRL's configs own ``reward_weights``: one per ``reward_funcs``)."""

    reward_model_path: str | None = field(default=None, metadata={
        "help": "The RM stage's merged/ model; None: reward_funcs alone."})
    reward_baseline: float = field(default=0.0, metadata={
        "help": "Subtracted from every reward-model score (reward units), as in PPO."})
    missing_eos_penalty: float | None = field(default=None, metadata={
        "help": "Subtracted from the reward of completions without EOS (reward units), as in PPO."})
    reward_funcs: list[str] | None = field(default=None, metadata={
        "help": "Reward functions 'package.module:function' or 'file.py:function', as in PPO; weighted by "
                "reward_weights and added to the reward model's score."})


def main(argv: list[str] | None = None, callbacks: list | None = None, method: str = "grpo") -> dict:
    """``rlhf-trl grpo`` (``method`` ``grpo``) or ``rlhf-trl rloo`` (``rloo``): `cli_launch.run_recipe`."""
    return cli_launch.run_recipe(method, argv, callbacks)


def recipe_types(method: str = "grpo") -> tuple:
    """The dataclasses a grpo / rloo recipe fills (`cli_launch.recipe_types`)."""
    return cli_launch.recipe_types(method)


class RewardModelReward:
    """TRL reward function ``f(prompts, completions, completion_ids, query_ids, **columns) -> list[float]``: the
    reward model's score of ``query_ids + completion_ids`` ``[batch]`` (reward units, at the EOS when sampled) minus the
    baseline, minus ``missing_eos_penalty`` where no id of ``eos_ids`` ends it (``reward_model`` None: the penalty).
    ``tokens`` (`rlhf_trl.reward_models.RewardTokens`): a reward model of another tokenizer reads the column
    ``reward_query_ids`` (its prompt ids) and the completions re-encoded (`score_responses`, PPO's path)."""

    def __init__(self, reward_model, pad_token_id: int, eos_ids: list[int], penalty: float | None, batch_size: int,
                 tokens: RewardTokens | None = None, baseline: float = 0.0):
        self.reward_model, self.pad, self.eos, self.penalty = reward_model, pad_token_id, set(eos_ids), penalty
        self.batch_size, self.tokens, self.baseline = batch_size, tokens, baseline
        self.__name__ = "reward_model" if reward_model is not None else "missing_eos_penalty"

    def __call__(self, prompts, completions, completion_ids, query_ids, reward_query_ids=None,
                 **columns) -> list[float]:
        n, ended = len(completion_ids), [bool(c) and c[-1] in self.eos for c in completion_ids]
        if self.tokens is not None and reward_query_ids is None:
            raise ValueError("a reward model of another tokenizer needs the prompt rows' reward_query_ids column")
        scores = (score_responses(self.reward_model, query_ids if self.tokens is None else reward_query_ids,
                                  completion_ids, ended, self.pad, self.tokens, self.batch_size) - self.baseline
                  if self.reward_model is not None else torch.zeros(n))
        if self.penalty:
            scores = scores - self.penalty * (~torch.tensor(ended, dtype=torch.bool)).float()
        return scores.tolist()


def as_trl_reward(functions: RewardFunctions, k: int, columns: list[str]):
    """The ``k``-th project reward function as TRL calls reward functions (every dataset column, ``trainer_state`` ...
    as keywords): it receives ``prompts``, ``completions`` and the data columns its signature names (as in PPO)."""
    single = RewardFunctions([functions.functions[k]], None, [functions.specs[k]])

    def reward(prompts, completions, **kwargs):
        return single.compute(prompts, completions, getattr(kwargs.get("trainer_state"), "global_step", 0),
                              **{c: kwargs[c] for c in columns if c in kwargs})[0].tolist()

    reward.__name__ = functions.names[k]
    return reward


def prompt_dataset(records: list[dict], tokenizer, template: Template, data_args: DataArguments, report: DataReport,
                   split: str, tokens: RewardTokens | None = None) -> Dataset:
    """Prompt rows for TRL: ``prompt`` (the text of the prompt ids, so that TRL's tokenizer gives back the ids PPO
    samples from), ``query_ids`` (those ids, `prompt_features`), with ``tokens`` ``reward_query_ids`` (the reward
    model's own prompt ids, `RewardTokens.add_prompts`) and the reward-function columns (`reward_columns`)."""
    ids = prompt_features(records, tokenizer, template, data_args.max_prompt_length,
                          f"{describe_sources(data_args)} ({split} split)", report, split)["input_ids"]
    if tokens is not None:
        tokens.add_prompts(split, records)
    extra = {"reward_query_ids": tokens.prompts[split]} if tokens is not None else {}
    return Dataset.from_dict({"prompt": tokenizer.batch_decode(ids), "query_ids": ids, **extra,
                              **reward_columns(records)})


@keeps_earlier_run
def run(configs: Recipe, callbacks: list | None = None) -> dict:
    """Optimise the SFT policy ``model_name_or_path`` on the recipe's prompts, GRPO (RLOO for TRL's `RLOOConfig`:
    ``rlhf-trl rloo``): ``{"output_dir", "merged", "metrics"}``. Raises `StageInputError`: the SFT or reward model
    missing, or the reward model no trained classifier; `DataError`: bad prompt rows (file, row and field named);
    `ValueError`: no reward (neither ``reward_model_path`` nor ``reward_funcs``), reward functions or weights that
    cannot load (`rlhf_trl.rewards.load_reward_functions`), quantization settings that cannot run."""
    from trl import GRPOTrainer, RLOOConfig, RLOOTrainer

    data_args, reward_args, training_args = configs.data, configs.script, configs.training
    method = "rloo" if isinstance(training_args, RLOOConfig) else "grpo"

    # inputs: models, reward functions
    def reward_inputs(run_args: RunArguments) -> tuple:  # (reward model path or None, reward functions or None)
        rm_path, hint = reward_args.reward_model_path, sibling_recipe(configs.path, "rm")
        if rm_path:
            rm_path = require_model_dir(rm_path, "reward model", hint, run_args.allow_pickle_weights)
            require_reward_model(rm_path, hint)
        functions = load_reward_functions(reward_args.reward_funcs, training_args.reward_weights)
        if not rm_path and functions is None:
            raise ValueError(f"{method}: no reward: set reward_model_path (the RM stage's merged/) and/or reward_funcs")
        return rm_path, functions

    stage = Stage(configs, "SFT model", "sft", reward_inputs)
    rm_path, functions = stage.checked

    # data
    report = DataReport(method)
    template, splits = stage.records("prompts", report)
    tokenizer = stage.tokenizer(padding_side="left")
    tokens = reward_tokens(rm_path, tokenizer, template, training_args.trust_remote_code)  # None: the same tokenizer
    train_ds, eval_ds = (prompt_dataset(rows, tokenizer, template, data_args, report, split, tokens) if rows else None
                         for split, rows in splits.items())

    # policy and rewards (reward model first, weight 1; then the functions with their weights)
    model, eos = stage.model(tokenizer), eos_token_ids(tokenizer, stage.model_path)
    reward_model = None
    if rm_path:
        with loading_on_one_process():  # under ZeRO-3 each process holds the whole frozen RM (it scores alone)
            reward_model = load_sequence_classifier(rm_path, torch_dtype(configs.model.dtype),
                                                    training_args.trust_remote_code,
                                                    stage.run_args.allow_pickle_weights)
        reward_model = reward_model.to(training_args.device).eval().requires_grad_(False)
        if tokens is not None:
            reward_model.config.pad_token_id = tokens.pad_token_id
    rewards = [] if reward_model is None and not reward_args.missing_eos_penalty else [RewardModelReward(
        reward_model, tokenizer.pad_token_id, eos, reward_args.missing_eos_penalty,
        training_args.per_device_train_batch_size, tokens, reward_args.reward_baseline)]
    training_args.reward_weights = [1.0] * len(rewards) + (functions.weights if functions is not None else [])
    if functions is not None:
        columns = [c for c in train_ds.column_names if c not in ("prompt", "query_ids", "reward_query_ids")]
        rewards += [as_trl_reward(functions, k, columns) for k in range(len(functions))]

    # trainer, train, save
    trainer = stage.trainer(GRPOTrainer if method == "grpo" else RLOOTrainer, model, tokenizer, train_ds, eval_ds,
                            callbacks, reward_funcs=rewards)
    metrics = stage.train(trainer, "prompts", train_ds, eval_ds, evaluate=False)
    return stage.save(trainer, tokenizer, metrics, report, done=f"{method.upper()} done: merged policy at %s")


if __name__ == "__main__":
    cli_launch.run_stage("grpo")

"""Stage 2: reward model on pairwise preferences with `trl.RewardTrainer` (optional LoRA, ``task_type=SEQ_CLS``). Run:
``rlhf-trl rm --config recipes/demo/rm.yaml`` (or ``make rm RECIPE=...``). The SFT model as a one-label
``AutoModelForSequenceClassification``, scored at the last real token (the EOS) of `rlhf_trl.data.pair_features`
pairs, as PPO scores rollouts. Outputs under ``output_dir``: ``checkpoint-*/``, ``adapter/`` (LoRA, with the score
head), ``merged/`` (classifier + tokenizer: PPO's input), ``eval_metrics.json`` (`evaluate_pairs` on the eval split),
``eval_pairs.jsonl`` (those pairs as token ids; read by ``rlhf-trl eval``)."""

from __future__ import annotations

import logging
import os

from datasets import Dataset

from .atomic import write_json, write_jsonl
from .checkpoints import begin_writing, keeps_earlier_run, save_stage_outputs, start_run, with_atomic_checkpoints
from .config import RunArguments, parse_recipe, sibling_recipe
from .data import DataArguments, DataReport, Template, describe_sources, pair_features, read_records, split_records
from .loop_state import with_loop_state
from .models import (
    fp32_adapters_for_fp32_compute,
    load_sequence_classifier,
    load_tokenizer,
    recipe_quantization_config,
    require_model_dir,
    resize_for_tokenizer,
    torch_dtype,
)
from .scoring import pairwise_metrics, score_sequences

logger = logging.getLogger(__name__)


def recipe_types() -> tuple:
    """The dataclasses a rm recipe fills: data fields, TRL's `RewardConfig`, TRL's `ModelConfig`."""
    from trl import ModelConfig, RewardConfig

    return (DataArguments, RewardConfig, ModelConfig, RunArguments)


def main(argv: list[str] | None = None, callbacks: list | None = None) -> dict:
    """Parse a recipe and train the reward model. Returns ``{"output_dir", "merged", "metrics"}``; see `run`."""
    data_args, training_args, model_args, run_args, recipe = parse_recipe(recipe_types(), argv, "rm")
    return run(data_args, training_args, model_args, produced_by=sibling_recipe(recipe, "sft"), run_args=run_args,
               callbacks=callbacks)


@keeps_earlier_run
def run(data_args: DataArguments, training_args, model_args, produced_by: str | None = None,
        run_args: RunArguments | None = None, callbacks: list | None = None) -> dict:
    """Train a reward model on ``data_args.dataset_name`` from ``model_args.model_name_or_path``. Raises
    `StageInputError`: no SFT model (``produced_by`` names the command to run first); `DataError`: bad rows, or no pair
    left; `ValueError`: ``load_in_4bit`` / ``load_in_8bit`` unusable (`rlhf_trl.models.recipe_quantization_config`)."""
    from trl import RewardTrainer, get_peft_config

    # inputs
    run_args, resume = start_run(training_args, run_args, model_args.model_name_or_path, not model_args.use_peft)
    pickle_ok = run_args.allow_pickle_weights
    model_path = require_model_dir(model_args.model_name_or_path or "", "SFT model", produced_by, pickle_ok)
    quantization = recipe_quantization_config(model_args, use_cpu=training_args.use_cpu)  # QLoRA: load_in_4bit

    # data
    template, report = Template.from_args(data_args), DataReport("rm")
    records = read_records(data_args, "pairs", report)
    train_records, eval_records = split_records(records, data_args.eval_split_size, training_args.seed, report)

    # tokenizer and model
    tokenizer = load_tokenizer(model_path, pad_token=training_args.pad_token, padding_side="right",
                               trust_remote_code=training_args.trust_remote_code)
    training_args.pad_token = tokenizer.pad_token

    def features(rows, split):  # tokenized pairs (`pair_features`)
        return pair_features(rows, tokenizer, template, training_args.max_length, data_args.length_policy,
                             source=f"{describe_sources(data_args)} ({split} split)", report=report, split=split)

    train_ds = Dataset.from_dict(features(train_records, "train"))
    eval_feats = features(eval_records, "eval") if eval_records else None
    eval_ds = Dataset.from_dict(eval_feats) if eval_feats else None
    if eval_ds is None:  # no eval rows: evaluation off
        training_args.eval_strategy = "no"
    # quantized: TRL's RewardTrainer does the QLoRA preparation itself (no prepare_model_for_kbit_training)
    model = load_sequence_classifier(model_path, torch_dtype(model_args.dtype), training_args.trust_remote_code,
                                     pickle_ok, quantization_config=quantization)
    logger.info("reward model: the SFT model with a new score head (reported MISSING above), trained in this stage")
    resize_for_tokenizer(model, tokenizer)
    if (peft_config := get_peft_config(model_args)) is not None:
        peft_config.task_type = "SEQ_CLS"  # makes peft train and save the score head with the adapter

    # trainer, train (inputs proven: only now does anything of an earlier run go)
    begin_writing(training_args, run_args, resume)
    trainer = with_loop_state(with_atomic_checkpoints(RewardTrainer))(
        model=model, args=training_args, train_dataset=train_ds.remove_columns("prompt_length"),
        eval_dataset=eval_ds.remove_columns("prompt_length") if eval_ds is not None else None,
        processing_class=tokenizer, peft_config=peft_config, callbacks=callbacks)
    fp32_adapters_for_fp32_compute(trainer.model, quantization)  # QLoRA with fp32 compute (CPU): TRL made them bf16
    train_result = trainer.train(resume_from_checkpoint=resume)

    # save (every process); the main process writes and evaluates the merged model on the held-out pairs
    metrics = dict(train_result.metrics, global_step=trainer.state.global_step, num_train_pairs=len(train_ds),
                   num_eval_pairs=len(eval_ds) if eval_ds is not None else 0)

    def evaluate(reward_model) -> dict:  # eval_metrics.json; eval_pairs.jsonl: the pairs `rlhf-trl eval` re-scores
        eval_metrics, out = evaluate_pairs(reward_model, eval_feats, tokenizer.pad_token_id), training_args.output_dir
        write_json(os.path.join(out, "eval_metrics.json"), eval_metrics)
        write_jsonl(os.path.join(out, "eval_pairs.jsonl"), ({"chosen_ids": c, "rejected_ids": r, "prompt_length": n}
                    for c, r, n in zip(eval_feats["chosen_ids"], eval_feats["rejected_ids"],
                                       eval_feats["prompt_length"])))
        logger.info("RM eval: accuracy %.3f (length baseline %.3f), margin %.3f on %d pairs", eval_metrics["accuracy"],
                    eval_metrics["length_baseline_accuracy"], eval_metrics["margin"], eval_metrics["num_pairs"])
        return {f"eval_{k}": v for k, v in eval_metrics.items()}

    return save_stage_outputs(trainer, tokenizer, model_path, "sequence_classifier", metrics, report,
                              (data_args, training_args, model_args, run_args), evaluate if eval_feats else None)


def evaluate_pairs(model, feats: dict, pad_token_id: int, batch_size: int = 16) -> dict:
    """`pairwise_metrics` of ``feats``' pairs (response lengths: tokens after ``prompt_length``, EOS included)."""
    keys = ("chosen_ids", "rejected_ids")
    chosen, rejected = (score_sequences(model, feats[k], pad_token_id, batch_size) for k in keys)
    c_len, r_len = ([len(s) - p for s, p in zip(feats[k], feats["prompt_length"])] for k in keys)
    return pairwise_metrics(chosen, rejected, c_len, r_len)


if __name__ == "__main__":
    from .cli_launch import run_stage

    run_stage("rm")

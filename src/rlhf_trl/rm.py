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

from . import cli_launch
from .atomic import write_json, write_jsonl
from .checkpoints import keeps_earlier_run
from .config import Recipe
from .data import DataReport, pair_features
from .models import load_sequence_classifier
from .scoring import pairwise_metrics, score_sequences
from .stage_setup import Stage

logger = logging.getLogger(__name__)
main, recipe_types = cli_launch.entry_points("rm")  # main(argv, callbacks): parse, then `run`


@keeps_earlier_run
def run(configs: Recipe, callbacks: list | None = None) -> dict:
    """Train a reward model on the recipe's pairs from ``model_name_or_path``: ``{"output_dir", "merged", "metrics"}``.
    Raises `StageInputError`: no SFT model (named with the sft recipe to run first); `DataError`: bad rows, or no pair
    left; `ValueError`: ``load_in_4bit`` / ``load_in_8bit`` unusable (`rlhf_trl.models.recipe_quantization_config`)."""
    from trl import RewardTrainer

    data_args, training_args = configs.data, configs.training

    # inputs
    stage = Stage(configs, "SFT model", "sft")

    # data
    report = DataReport("rm")
    template, splits = stage.records("pairs", report)

    # tokenizer and model
    tokenizer = stage.tokenizer()
    train_feats, eval_feats = (pair_features(  # tokenized pairs (`pair_features`); the trainer's rows: without lengths
        rows, tokenizer, template, training_args.max_length, data_args.length_policy, source=stage.source(split),
        report=report, split=split) if rows else None for split, rows in splits.items())
    train_ds, eval_ds = (Dataset.from_dict(f).remove_columns("prompt_length") if f else None
                         for f in (train_feats, eval_feats))
    # quantized: TRL's RewardTrainer does the QLoRA preparation itself (no prepare_model_for_kbit_training)
    model = stage.model(tokenizer, load_sequence_classifier)
    logger.info("reward model: the SFT model with a new score head (reported MISSING above), trained in this stage")

    # trainer (LoRA task SEQ_CLS: peft trains and saves the score head with the adapter), train; save (every
    # process): the main process writes and evaluates the merged model on held-out pairs
    trainer = stage.trainer(RewardTrainer, model, tokenizer, train_ds, eval_ds, callbacks, peft_task="SEQ_CLS")
    metrics = stage.train(trainer, "pairs", train_ds, eval_ds, evaluate=False)

    def evaluate(reward_model) -> dict:  # eval_metrics.json; eval_pairs.jsonl: the pairs `rlhf-trl eval` re-scores
        eval_metrics, out = evaluate_pairs(reward_model, eval_feats, tokenizer.pad_token_id), training_args.output_dir
        write_json(os.path.join(out, "eval_metrics.json"), eval_metrics)
        write_jsonl(os.path.join(out, "eval_pairs.jsonl"), Dataset.from_dict(eval_feats))
        logger.info("RM eval: accuracy %.3f (length baseline %.3f), margin %.3f on %d pairs", eval_metrics["accuracy"],
                    eval_metrics["length_baseline_accuracy"], eval_metrics["margin"], eval_metrics["num_pairs"])
        return {f"eval_{k}": v for k, v in eval_metrics.items()}

    return stage.save(trainer, tokenizer, metrics, report, kind="sequence_classifier",
                      evaluate=evaluate if eval_feats else None)


def evaluate_pairs(model, feats: dict, pad_token_id: int, batch_size: int = 16) -> dict:
    """`pairwise_metrics` of ``feats``' pairs (response lengths: tokens after ``prompt_length``, EOS included)."""
    keys = ("chosen_ids", "rejected_ids")
    chosen, rejected = (score_sequences(model, feats[k], pad_token_id, batch_size) for k in keys)
    c_len, r_len = ([len(s) - p for s, p in zip(feats[k], feats["prompt_length"])] for k in keys)
    return pairwise_metrics(chosen, rejected, c_len, r_len)


if __name__ == "__main__":
    cli_launch.run_stage("rm")

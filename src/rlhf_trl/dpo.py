"""Stage 3, without a reward model: DPO on the preference pairs with `trl.DPOTrainer` (optional LoRA / QLoRA). Run:
``rlhf-trl dpo --config recipes/demo/dpo.yaml`` (or ``make dpo RECIPE=...``). Pairs of every shape the RM stage reads,
tokenized alike (`rlhf_trl.data.pair_features`: the reward model's ids). Loss: Rafailov et al. 2023 ("Direct Preference
Optimization", arXiv:2305.18290) as `trl.DPOTrainer` computes it (``beta``, ``loss_type``); reference: the frozen SFT
model (LoRA: the adapter-disabled policy; full weights: TRL's copy). Outputs under ``output_dir``: ``checkpoint-*/``,
``adapter/`` (LoRA), ``merged/`` (causal LM + tokenizer, for `rlhf_trl.compare`), ``metrics.json`` (held-out
``eval_rewards/accuracies``), ``log_history.json``, ``run_config.yaml``, ``data_report.json``."""

from __future__ import annotations

from datasets import Dataset

from . import cli_launch
from .checkpoints import keeps_earlier_run
from .config import Recipe
from .data import DataReport, pair_features
from .stage_setup import Stage, tokenized_trainer

main, recipe_types = cli_launch.entry_points("dpo")  # main(argv, callbacks): parse, then `run`


def dpo_dataset(feats: dict) -> Dataset:
    """`pair_features` output as the ``prompt_ids`` / ``chosen_ids`` / ``rejected_ids`` rows `trl.DPOTrainer` reads."""
    pairs = zip(feats["chosen_ids"], feats["rejected_ids"], feats["prompt_length"])
    return Dataset.from_list([{"prompt_ids": c[:n], "chosen_ids": c[n:], "rejected_ids": r[n:]} for c, r, n in pairs])


@keeps_earlier_run
def run(configs: Recipe, callbacks: list | None = None) -> dict:
    """Optimise the SFT model ``model_name_or_path`` on the recipe's pairs: ``{"output_dir", "merged", "metrics"}``.
    Raises `StageInputError`: no SFT model (named with the sft recipe to run first); `DataError`: bad rows, or no pair
    left; `ValueError`: quantization that cannot run (`rlhf_trl.models.recipe_quantization_config`)."""
    from trl import DPOTrainer

    # inputs
    stage = Stage(configs, "SFT model", "sft")

    # data: the RM stage's pairs, tokenized the same way
    report = DataReport("dpo")
    template, splits = stage.records("pairs", report)
    tokenizer = stage.tokenizer()
    train_ds, eval_ds = (dpo_dataset(pair_features(  # tokenized pairs (`pair_features`) as DPO rows
        rows, tokenizer, template, configs.training.max_length, configs.data.length_policy, stage.source(split), report,
        split)) if rows else None for split, rows in splits.items())

    # policy (the reference: the adapter-disabled policy with LoRA, else TRL's frozen copy)
    model = stage.model(tokenizer)

    # trainer, train; evaluate (held-out preference accuracy and margins of the implicit reward), save
    trainer = stage.trainer(tokenized_trainer(DPOTrainer), model, tokenizer, train_ds, eval_ds, callbacks)
    metrics = stage.train(trainer, "pairs", train_ds, eval_ds)
    return stage.save(trainer, tokenizer, metrics, report, done="DPO done: merged policy at %s")


if __name__ == "__main__":
    cli_launch.run_stage("dpo")

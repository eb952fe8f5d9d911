"""Stage 3, without a reward model: DPO on the preference pairs with `trl.DPOTrainer` (optional LoRA / QLoRA). Run:
``rlhf-trl dpo --config recipes/demo/dpo.yaml`` (or ``make dpo RECIPE=...``). Pairs of every shape the RM stage reads,
tokenized alike (`rlhf_trl.data.pair_features`: the reward model's ids). Loss: Rafailov et al. 2023 ("Direct Preference
Optimization", arXiv:2305.18290) as `trl.DPOTrainer` computes it (``beta``, ``loss_type``); reference: the frozen SFT
model (LoRA: the adapter-disabled policy; full weights: TRL's copy). Outputs under ``output_dir``: ``checkpoint-*/``,
``adapter/`` (LoRA), ``merged/`` (causal LM + tokenizer, for `rlhf_trl.compare`), ``metrics.json`` (held-out
``eval_rewards/accuracies``), ``log_history.json``, ``run_config.yaml``, ``data_report.json``."""

from __future__ import annotations

import logging

from datasets import Dataset

from .checkpoints import begin_writing, keeps_earlier_run, save_stage_outputs, start_run, with_atomic_checkpoints
from .config import RunArguments, parse_recipe, sibling_recipe
from .data import DataArguments, DataReport, Template, describe_sources, pair_features, read_records, split_records
from .loop_state import with_loop_state
from .models import (
    fp32_adapters_for_fp32_compute,
    load_causal_lm,
    load_tokenizer,
    recipe_quantization_config,
    require_model_dir,
    resize_for_tokenizer,
    torch_dtype,
)

logger = logging.getLogger(__name__)


def recipe_types() -> tuple:
    """The dataclasses a dpo recipe fills: data fields, TRL's `DPOConfig`, TRL's `ModelConfig`."""
    from trl import DPOConfig, ModelConfig

    return (DataArguments, DPOConfig, ModelConfig, RunArguments)


def main(argv: list[str] | None = None, callbacks: list | None = None) -> dict:
    """Parse a recipe and run DPO. Returns ``{"output_dir", "merged", "metrics"}``; see `run`."""
    data_args, training_args, model_args, run_args, recipe = parse_recipe(recipe_types(), argv, "dpo")
    return run(data_args, training_args, model_args, run_args, produced_by=sibling_recipe(recipe, "sft"),
               callbacks=callbacks)


def dpo_dataset(feats: dict) -> Dataset:
    """`pair_features` output as the ``prompt_ids`` / ``chosen_ids`` / ``rejected_ids`` rows `trl.DPOTrainer` reads."""
    return Dataset.from_dict({"prompt_ids": [c[:n] for c, n in zip(feats["chosen_ids"], feats["prompt_length"])],
                              "chosen_ids": [c[n:] for c, n in zip(feats["chosen_ids"], feats["prompt_length"])],
                              "rejected_ids": [r[n:] for r, n in zip(feats["rejected_ids"], feats["prompt_length"])]})


def _trainer_class():
    """`trl.DPOTrainer` fed token ids: its text preparation is skipped for datasets that already hold ``prompt_ids``."""
    from trl import DPOTrainer

    class TokenizedDPOTrainer(DPOTrainer):
        def _prepare_dataset(self, dataset, *args, **kw):
            return dataset if "prompt_ids" in dataset.column_names else super()._prepare_dataset(dataset, *args, **kw)

    return TokenizedDPOTrainer


@keeps_earlier_run
def run(data_args: DataArguments, training_args, model_args, run_args: RunArguments | None = None,
        produced_by: str | None = None, callbacks: list | None = None) -> dict:
    """Optimise the SFT model ``model_args.model_name_or_path`` on the pairs of ``data_args.dataset_name``. Raises
    `StageInputError`: no SFT model (``produced_by`` names the command to run first); `DataError`: bad rows, or no pair
    left; `ValueError`: quantization that cannot run (`rlhf_trl.models.recipe_quantization_config`)."""
    from trl import get_peft_config

    # inputs
    run_args, resume = start_run(training_args, run_args, model_args.model_name_or_path, not model_args.use_peft)
    pickle_ok = run_args.allow_pickle_weights
    model_path = require_model_dir(model_args.model_name_or_path or "", "SFT model", produced_by, pickle_ok)
    quantization = recipe_quantization_config(model_args, use_cpu=training_args.use_cpu)

    # data: the RM stage's pairs, tokenized the same way
    template, report = Template.from_args(data_args), DataReport("dpo")
    records = read_records(data_args, "pairs", report)
    train_records, eval_records = split_records(records, data_args.eval_split_size, training_args.seed, report)
    tokenizer = load_tokenizer(model_path, pad_token=training_args.pad_token, padding_side="right",
                               trust_remote_code=training_args.trust_remote_code)
    training_args.pad_token = tokenizer.pad_token

    def features(rows, split):  # tokenized pairs (`pair_features`) as DPO rows
        return dpo_dataset(pair_features(rows, tokenizer, template, training_args.max_length, data_args.length_policy,
                                         f"{describe_sources(data_args)} ({split} split)", report, split))

    train_ds, eval_ds = features(train_records, "train"), features(eval_records, "eval") if eval_records else None
    if eval_ds is None:
        training_args.eval_strategy = "no"

    # policy (the reference: the adapter-disabled policy with LoRA, else TRL's frozen copy)
    model = load_causal_lm(model_path, torch_dtype(model_args.dtype), training_args.trust_remote_code, pickle_ok,
                           quantization_config=quantization)
    resize_for_tokenizer(model, tokenizer)

    # trainer, train (inputs proven: only now does anything of an earlier run go)
    begin_writing(training_args, run_args, resume)
    trainer = with_loop_state(with_atomic_checkpoints(_trainer_class()))(
        model=model, args=training_args, train_dataset=train_ds, eval_dataset=eval_ds, processing_class=tokenizer,
        peft_config=get_peft_config(model_args), callbacks=callbacks)
    fp32_adapters_for_fp32_compute(trainer.model, quantization)
    train_result = trainer.train(resume_from_checkpoint=resume)

    # evaluate (held-out preference accuracy and margins of the implicit reward), save
    metrics = dict(train_result.metrics, global_step=trainer.state.global_step, num_train_pairs=len(train_ds),
                   num_eval_pairs=len(eval_ds) if eval_ds is not None else 0)
    if eval_ds is not None:
        metrics.update(trainer.evaluate())
    result = save_stage_outputs(trainer, tokenizer, model_path, "causal_lm", metrics, report,
                                (data_args, training_args, model_args, run_args))
    if trainer.is_world_process_zero():
        logger.info("DPO done: merged policy at %s", result["merged"])
    return result


if __name__ == "__main__":
    from .cli_launch import run_stage

    run_stage("dpo")

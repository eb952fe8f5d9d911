"""The setup the TRL-backed stages (`rlhf_trl.sft`, `rm`, `dpo`, `kto`, `grpo` / rloo) share, in the order they run
it: `Stage` (run directory, model, quantization), `Stage.records`, `Stage.tokenizer`, `Stage.model`,
`Stage.trainer` (inputs proven: only now does anything of an earlier run go), `Stage.train`, `Stage.save`."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

from .checkpoints import begin_writing, save_stage_outputs, start_run, with_atomic_checkpoints
from .config import Recipe, RunArguments, sibling_recipe
from .data import DataReport, Template, describe_sources, read_records, split_records
from .loop_state import with_loop_state
from .models import (fp32_adapters_for_fp32_compute, load_causal_lm, load_tokenizer, recipe_quantization_config,
                     require_model_dir, resize_for_tokenizer, torch_dtype)

logger = logging.getLogger(__name__)


class Stage:
    """One TRL-backed stage run of a `config.Recipe` (``data_args``, ``training_args``, ``model_args``), opened by its
    checks in this order: `start_run` (``run_args``: the recipe's or the defaults, ``resume``: the checkpoint to resume
    from or None), ``model_args.model_name_or_path`` (``model_path``: ``what``, made by the stage ``produced_by``,
    whose recipe the error names), the stage's own ``checks(run_args)`` (what they return in ``checked``), the
    quantization settings (``quantization``: a `BitsAndBytesConfig` or None). Raises what `start_run` and ``checks``
    raise; `StageInputError`: no model; `ValueError`: ``load_in_4bit`` / ``load_in_8bit`` unusable
    (`rlhf_trl.models.recipe_quantization_config`)."""

    def __init__(self, recipe: Recipe, what: str, produced_by: str | None = None,
                 checks: Callable[[RunArguments], Any] | None = None):
        self.data_args, self.training_args, self.model_args = recipe.data, recipe.training, recipe.model
        model = self.model_args.model_name_or_path
        self.run_args, self.resume = start_run(self.training_args, recipe.run, model, not self.model_args.use_peft)
        self.recipe = dataclasses.replace(recipe, run=self.run_args)  # as run_config.yaml records it
        hint = sibling_recipe(recipe.path, produced_by) if produced_by else None
        self.model_path = require_model_dir(model, what, hint, self.run_args.allow_pickle_weights)
        self.checked = checks(self.run_args) if checks is not None else None
        self.quantization = recipe_quantization_config(self.model_args, use_cpu=self.training_args.use_cpu)

    def source(self, split: str) -> str:
        """The data sources and ``split``, as `DataError` messages name them."""
        return f"{describe_sources(self.data_args)} ({split} split)"

    def records(self, kind: str, report: DataReport) -> tuple:
        """``(template, {"train": train records, "eval": eval records})``: the ``kind`` records (`read_records`) split
        by `split_records` (counts in ``report``). Raises `DataError`: bad rows, nothing left."""
        template, records = Template.from_args(self.data_args), read_records(self.data_args, kind, report)
        return template, dict(zip(("train", "eval"), split_records(records, self.data_args.eval_split_size,
                                                                   self.training_args.seed, report)))

    def tokenizer(self, padding_side: str = "right"):
        """`load_tokenizer` of ``model_path``, with the recipe's ``pad_token`` where its config has one (which then
        holds the pad token chosen). Raises `StageInputError`: no tokenizer; `ValueError`: no EOS, or an EOS pad."""
        args = self.training_args
        tokenizer = load_tokenizer(self.model_path, pad_token=getattr(args, "pad_token", None),
                                   padding_side=padding_side, trust_remote_code=args.trust_remote_code)
        if hasattr(args, "pad_token"):
            args.pad_token = tokenizer.pad_token
        return tokenizer

    def model(self, tokenizer, loader: Callable = load_causal_lm):
        """``model_path`` by ``loader`` (`load_causal_lm` / `load_sequence_classifier`) in the recipe's dtype and
        quantization, resized for ``tokenizer`` (`resize_for_tokenizer`)."""
        model = loader(self.model_path, torch_dtype(self.model_args.dtype), self.training_args.trust_remote_code,
                       self.run_args.allow_pickle_weights, quantization_config=self.quantization)
        resize_for_tokenizer(model, tokenizer)
        return model

    def trainer(self, trainer_cls, model, tokenizer, train_ds, eval_ds, callbacks, peft_task: str | None = None,
                **kwargs):
        """``trainer_cls`` with loop state and atomic checkpoints, after `begin_writing` (evaluation off without
        ``eval_ds``), and the recipe's LoRA (`trl.get_peft_config`; ``peft_task``: its ``task_type``); with QLoRA
        computing in fp32 (CPU) its adapters cast back to fp32 (TRL made them bf16)."""
        from trl import get_peft_config

        if (peft_config := get_peft_config(self.model_args)) is not None and peft_task:
            peft_config.task_type = peft_task
        if eval_ds is None:
            self.training_args.eval_strategy = "no"
        begin_writing(self.training_args, self.run_args, self.resume)
        trainer = with_loop_state(with_atomic_checkpoints(trainer_cls))(
            model=model, args=self.training_args, train_dataset=train_ds, eval_dataset=eval_ds,
            processing_class=tokenizer, peft_config=peft_config, callbacks=callbacks, **kwargs)
        fp32_adapters_for_fp32_compute(trainer.model, self.quantization)
        return trainer

    def train(self, trainer, noun: str, train_ds, eval_ds, evaluate: bool = True, **extra) -> dict:
        """``trainer.train`` from ``resume``; returns its metrics with ``global_step``, ``num_train_<noun>`` /
        ``num_eval_<noun>`` (rows), ``extra`` and (``evaluate`` and ``eval_ds``) ``trainer.evaluate()``'s."""
        metrics = dict(trainer.train(resume_from_checkpoint=self.resume).metrics, global_step=trainer.state.global_step,
                       **{f"num_train_{noun}": len(train_ds), f"num_eval_{noun}": len(eval_ds or ())}, **extra)
        if evaluate and eval_ds is not None:
            metrics.update(trainer.evaluate())
        return metrics

    def save(self, trainer, tokenizer, metrics: dict, report: DataReport, kind: str = "causal_lm",
             evaluate: Callable | None = None, done: str | None = None) -> dict:
        """`save_stage_outputs` (the recipe's dataclasses as ``run_config.yaml``); the main process logs ``done`` %
        the merged directory. Returns ``{"output_dir", "merged", "metrics"}``."""
        result = save_stage_outputs(trainer, tokenizer, self.model_path, kind, metrics, report, self.recipe, evaluate)
        if done and trainer.is_world_process_zero():
            logger.info(done, result["merged"])
        return result


def tokenized_trainer(trainer_cls):
    """``trainer_cls`` (`trl.DPOTrainer`, `trl.KTOTrainer`) fed token ids, as ``Tokenized<name>``: its text preparation
    is skipped for datasets that already hold ``prompt_ids``."""
    class Tokenized(trainer_cls):
        def _prepare_dataset(self, dataset, *args, **kw):
            return dataset if "prompt_ids" in dataset.column_names else super()._prepare_dataset(dataset, *args, **kw)

    Tokenized.__name__ = Tokenized.__qualname__ = f"Tokenized{trainer_cls.__name__}"
    return Tokenized

"""Stage 1: supervised fine-tuning with `trl.SFTTrainer` (completion-only loss, optional LoRA). Run: ``rlhf-trl sft
--config recipes/demo/sft.yaml`` (or ``python -m rlhf_trl.sft``, ``make sft RECIPE=...``).

Outputs under ``output_dir``: ``checkpoint-*/`` (resumable), ``adapter/`` (LoRA only), ``merged/`` (a plain causal
LM with its tokenizer: the input of the RM and PPO stages), ``run_config.yaml`` and ``metrics.json``."""

from __future__ import annotations

import logging

import torch
from datasets import Dataset
from transformers.integrations import is_deepspeed_zero3_enabled

from . import cli_launch
from .checkpoints import keeps_earlier_run
from .config import Recipe
from .data import DataReport, sft_features
from .stage_setup import Stage

logger = logging.getLogger(__name__)
main, recipe_types = cli_launch.entry_points("sft")  # main(argv, callbacks): parse, then `run`


@keeps_earlier_run
def run(configs: Recipe, callbacks: list | None = None) -> dict:
    """Fine-tune ``model_name_or_path`` on the recipe's data (prompt tokens masked from the loss); ``callbacks``: extra
    `transformers.TrainerCallback` objects; returns ``{"output_dir", "merged", "metrics"}``. Raises `StageInputError`:
    no base model or tokenizer; `DataError`: bad rows (file, row and field named); `ValueError`: ``load_in_4bit`` /
    ``load_in_8bit`` unusable (`rlhf_trl.models.recipe_quantization_config`)."""
    data_args, training_args = configs.data, configs.training

    # inputs
    stage = Stage(configs, "base model")

    # data
    report = DataReport("sft")
    template, splits = stage.records("sft", report)

    # tokenizer and model
    tokenizer = stage.tokenizer()
    train_ds, eval_ds = (Dataset.from_dict(sft_features(  # tokenized (`sft_features`)
        rows, tokenizer, template, training_args.max_length, stage.source(split), data_args.length_policy,
        data_args.max_prompt_length, report, split)) if rows else None for split, rows in splits.items())
    if training_args.completion_only_loss is None:  # the loss is on completion tokens only unless the recipe says
        training_args.completion_only_loss = True
    # quantized: TRL's SFTTrainer does the QLoRA preparation itself (no prepare_model_for_kbit_training)
    model = stage.model(tokenizer)

    # trainer, train
    trainer = stage.trainer(_trainer_class(model, stage.model_path), model, tokenizer, train_ds, eval_ds, callbacks)
    # per-row held-out losses before / after (paired); not under ZeRO-3, whose weights are partitioned until train().
    # A resumed run measures "before" too: train() loads the checkpoint later, so these are the start weights' losses
    rows_loss = eval_ds is not None and not is_deepspeed_zero3_enabled()
    before = completion_losses(trainer.model, eval_ds, training_args.max_length) if rows_loss else None
    # evaluate (held-out loss on completion tokens), before the adapter is merged away
    metrics = stage.train(trainer, "rows", train_ds, eval_ds)
    if rows_loss:
        metrics.update(eval_row_losses_before=before, eval_row_losses=completion_losses(
            trainer.model, eval_ds, training_args.max_length))

    # save (under `accelerate launch`: every process calls save_model, only the main process writes)
    return stage.save(trainer, tokenizer, metrics, report, done="SFT done: merged model at %s")


@torch.no_grad()
def completion_losses(model, dataset, max_length: int | None = None) -> list[float]:
    """``[num_rows]`` mean NLL (nats per token) of each row's completion tokens (``completion_mask``, EOS included)
    under ``model``, rows cut to ``max_length`` tokens as the trainer cuts them; one forward per row (eval mode, then
    the mode it had). For a paired before / after comparison of the same held-out rows."""
    was_training, device = model.training, next(model.parameters()).device
    model.eval()
    out = []
    for row in dataset:
        ids = torch.tensor(row["input_ids"][:max_length], device=device)
        mask = torch.tensor(row["completion_mask"][:max_length], device=device)[1:].bool()
        logits = model(input_ids=ids[None]).logits[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits, ids[1:], reduction="none")
        out.append(float(nll[mask].mean()) if mask.any() else float("nan"))
    model.train(was_training)
    return out


def _trainer_class(model, model_path: str):
    """`trl.SFTTrainer`, or with `OwnHeadLossMixin` (``loss_type`` 'nll': TRL's `SFTConfig` makes chunked_nll 'nll';
    or 'dft') for non-Linear heads."""
    from trl import SFTTrainer

    if isinstance(head := model.get_output_embeddings(), torch.nn.Linear):
        return SFTTrainer
    logger.warning("%s: output head %s is not nn.Linear; the SFT loss runs the model's own head (loss_type 'nll' "
                   "or 'dft' from its logits)", model_path, type(head).__name__)
    return type(SFTTrainer.__name__, (OwnHeadLossMixin, SFTTrainer), {})


class OwnHeadLossMixin:
    """SFT loss from the logits of the model's own forward, for output heads that are not ``nn.Linear``: TRL's
    SFTTrainer multiplies hidden states by ``lm_head.weight`` itself (TRL 1.12-1.14 ``chunked_nll``, >= 1.15 always),
    wrong for Baichuan2's ``NormHead``. As TRL's: the NLL (``dft``: weighted by the detached token probability) summed
    over label tokens (``!= -100``, shifted by one) / ``num_items_in_batch`` (else this batch's count), and TRL's
    ``entropy``, ``mean_token_accuracy`` and ``num_tokens`` metrics."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if self.model.training else "eval"
        outputs = model(**{k: v for k, v in inputs.items() if k != "labels"}, use_cache=False)
        log_probs = torch.log_softmax(outputs.logits[:, :-1, :].float(), dim=-1)
        target = inputs["labels"][:, 1:]
        mask = target != -100
        token_log_probs = log_probs.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask
        dft = self.args.loss_type == "dft"  # https://huggingface.co/papers/2508.05629
        per_token = -token_log_probs * token_log_probs.exp().detach() if dft else -token_log_probs
        count = mask.sum() if num_items_in_batch is None else num_items_in_batch
        loss = per_token.sum() / torch.as_tensor(count, device=per_token.device).clamp(min=1)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())  # DDP averages the gradients

        with torch.no_grad():
            gather = self.accelerator.gather_for_metrics
            n = gather(mask.sum()).sum()
            for key, total in (("entropy", (-(log_probs.exp() * log_probs).sum(-1) * mask).sum()),
                               ("mean_token_accuracy", ((log_probs.argmax(-1) == target) & mask).sum())):
                self._metrics[mode][key].append((gather(total).sum() / n).item() if n > 0 else 0.0)
            if mode == "train" and "attention_mask" in inputs:
                self._total_train_tokens += gather(inputs["attention_mask"].sum()).sum().item()
            self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
        return (loss, outputs) if return_outputs else loss


if __name__ == "__main__":
    cli_launch.run_stage("sft")

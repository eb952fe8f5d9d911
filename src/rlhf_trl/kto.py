"""Stage 3 on unpaired labels, without a reward model: KTO with `trl.KTOTrainer` (optional LoRA / QLoRA). Run:
``rlhf-trl kto --config recipes/demo/kto.yaml`` (or ``make kto RECIPE=...``). Loss: Ethayarajh et al. 2024 ("KTO: Model
Alignment as Prospect Theoretic Optimization", arXiv:2402.01306) as `trl.KTOTrainer` computes it (``beta``,
``desirable_weight``, ``undesirable_weight``, ``loss_type``): each answer's implicit reward ``beta x (log p_policy -
log p_reference)`` of its tokens, pushed above (desirable) or below (undesirable) a reference point, the batch's KL
estimated on mismatched (prompt, answer) pairs. Reference: the frozen SFT model (LoRA: the adapter-disabled policy;
full weights: TRL's copy).

Data (`rlhf_trl.data`, kind ``"unpaired"``): rows with a boolean ``label`` (TRL's ``prompt`` / ``completion`` /
``label``, text or message lists) or ``kto_tag`` (LLaMA-Factory's sharegpt / messages KTO rows), one example each; or
preference rows of every shape the RM stage reads, two examples per pair (chosen desirable, rejected undesirable, as
TRL's ``unpair_preference_dataset``). Token ids ``prompt ids + answer ids + EOS`` (`unpaired_features`: the ids the
reward model and PPO see), fed to TRL as ``prompt_ids`` / ``completion_ids``. Outputs under ``output_dir``:
``checkpoint-*/``, ``adapter/`` (LoRA), ``merged/`` (causal LM + tokenizer), ``metrics.json`` (held-out
``eval_rewards/margins``, ...), ``log_history.json``, ``run_config.yaml``, ``data_report.json`` (with ``labels``: the
desirable / undesirable counts per split)."""

from __future__ import annotations

from dataclasses import dataclass, field

from datasets import Dataset

from . import cli_launch
from .checkpoints import keeps_earlier_run
from .config import Recipe
from .data import (DataArguments, DataError, DataReport, Template, describe_sources, read_records, split_records,
                   unpaired_features)
from .stage_setup import Stage, tokenized_trainer

main, recipe_types = cli_launch.entry_points("kto")  # main(argv, callbacks): parse, then `run`


@dataclass
class UnpairedReport(DataReport):
    """`DataReport` with ``labels``: per split, ``{"desirable": n, "undesirable": m}`` examples (after length drops)."""

    labels: dict = field(default_factory=dict)

    def summary(self) -> str:
        return "; ".join([super().summary(), *(f"{split}: {c['desirable']} desirable / {c['undesirable']} undesirable"
                                               for split, c in self.labels.items())])


def require_both_labels(labels: list[bool], where: str) -> None:
    """Raise `DataError` (one line naming ``where``) unless ``labels`` hold both True and False. TRL's `KTOTrainer`
    would train on one kind alone, only warning about ``desirable_weight`` / ``undesirable_weight``."""
    n = sum(labels)
    if n in (0, len(labels)):
        kind, other = ("desirable (label true)", "undesirable") if n else ("undesirable (label false)", "desirable")
        raise DataError(where, f"holds only {kind} examples ({len(labels)}); KTO needs both desirable and undesirable "
                               f"answers: add {other} ones (desirable answers alone: make sft)")


def kto_dataset(feats: dict, kl_batch_size: int | None) -> Dataset:
    """`unpaired_features` output as `trl.KTOTrainer` rows: ``prompt_ids`` ``[prompt_len]``, ``completion_ids``
    ``[response_len + 1]``, ``label``, and (``kl_batch_size`` set: losses with a KL term) ``KL_completion_ids``: within
    each block of ``kl_batch_size`` consecutive rows (TRL's ``per_device_train_batch_size``) the completions rotated by
    one, ``(x_1, y_n), (x_2, y_1), ...``: the mismatched pairs TRL's own preparation builds for the KL estimate."""
    cols = {k: feats[k] for k in ("prompt_ids", "completion_ids", "label")}
    if kl_batch_size:
        c = feats["completion_ids"]
        blocks = (c[s:s + kl_batch_size] for s in range(0, len(c), kl_batch_size))
        cols["KL_completion_ids"] = [y for b in blocks for y in b[-1:] + b[:-1]]
    return Dataset.from_dict(cols)


def _datasets(data_args: DataArguments, training_args, tokenizer, report: UnpairedReport) -> tuple:
    """``(train, eval or None)`` `kto_dataset` rows of the recipe's data, label counts in ``report``. Raises
    `DataError`: bad rows, one label only (in the data, or in the train split), nothing left."""
    template, where = Template.from_args(data_args), describe_sources(data_args)
    records = read_records(data_args, "unpaired", report)
    require_both_labels([r["label"] for r in records], where)
    train_records, eval_records = split_records(records, data_args.eval_split_size, training_args.seed, report)
    kl = training_args.per_device_train_batch_size if training_args.loss_type != "apo_zero_unpaired" else None

    def dataset(rows, split):
        feats = unpaired_features(rows, tokenizer, template, training_args.max_length, data_args.length_policy,
                                  f"{where} ({split} split)", report, split)
        n = sum(feats["label"])
        report.labels[split] = {"desirable": n, "undesirable": len(feats["label"]) - n}
        if split == "train":
            require_both_labels(feats["label"], f"{where} (train split)")
        return kto_dataset(feats, kl)

    return dataset(train_records, "train"), dataset(eval_records, "eval") if eval_records else None


@keeps_earlier_run
def run(configs: Recipe, callbacks: list | None = None) -> dict:
    """Optimise the SFT model ``model_name_or_path`` on the recipe's labelled answers: ``{"output_dir", "merged",
    "metrics"}``. Raises `StageInputError`: no SFT model (named with the sft recipe to run first); `DataError`: bad
    rows, one label only, no example left; `ValueError`: quantization that cannot run, or TRL's checks (KL losses need
    ``per_device_train_batch_size`` > 1 and ``train_sampling_strategy: sequential``)."""
    from trl import KTOTrainer

    # inputs
    stage = Stage(configs, "SFT model", "sft")

    # data: labelled answers (pairs unpaired), tokenized as the RM / PPO read them
    report = UnpairedReport("kto")
    tokenizer = stage.tokenizer()
    train_ds, eval_ds = _datasets(configs.data, configs.training, tokenizer, report)

    # policy (the reference: the adapter-disabled policy with LoRA, else TRL's frozen copy)
    model = stage.model(tokenizer)

    # trainer, train; evaluate (held-out implicit rewards of desirable / undesirable answers and their margin), save
    trainer = stage.trainer(tokenized_trainer(KTOTrainer), model, tokenizer, train_ds, eval_ds,  # KL rows: kto_dataset
                            callbacks)
    metrics = stage.train(trainer, "examples", train_ds, eval_ds, **{
        f"num_{split}_{kind}": n for split, c in report.labels.items() for kind, n in c.items()})
    return stage.save(trainer, tokenizer, metrics, report, done="KTO done: merged policy at %s")


if __name__ == "__main__":
    cli_launch.run_stage("kto")

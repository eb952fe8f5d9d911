"""Stage 3: PPO against the reward model (and/or reward functions) with a KL penalty to a frozen reference. Run:
``rlhf-trl ppo --config recipes/demo/ppo.yaml`` (``make ppo RECIPE=...``; resume: ``resume_from_checkpoint=true`` or
``=path/to/checkpoint-N``). The loop: `rlhf_trl.ppo_engine` in `rlhf_trl.ppo_trainer.RLHFPPOTrainer`, with TRL 1.12's
PPOConfig keys (`rlhf_trl.ppo_config`). Policy: the merged SFT model (``sft_model_path``) + a LoRA adapter
(``use_peft``; reference: the adapter disabled); frozen reward model (``reward_model_path``; of another tokenizer:
it scores the re-encoded text, `rlhf_trl.reward_models.RewardTokens`) minus ``reward_baseline``; value model from the
reward model (another tokenizer: the SFT policy; or ``value_model_path``), in full or through its own adapter
(``value_use_peft``), optionally on the reward model's weights (``share_reward_value_base``); ``reward_funcs``
(`rlhf_trl.rewards`) add to the score or are all of it. Outputs under ``output_dir``: ``checkpoint-N/``,
``adapter/``, ``merged/``, ``value_model/``, ``samples.jsonl``, ``run_config.yaml``, ``metrics.json``,
``log_history.json``."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import time

import torch
from accelerate.utils import broadcast_object_list
from datasets import Dataset
from peft import LoraConfig, PeftModel, get_peft_model
from transformers.integrations import is_deepspeed_zero3_enabled

from . import cli_launch
from .atomic import save_pretrained_atomic, write_json
from .checkpoints import begin_writing, distributed_state, keeps_earlier_run, start_run
from .config import Recipe, RunArguments, save_recipe, sibling_recipe
from .data import (DataArguments, DataReport, Template, describe_sources, prompt_features, read_records, sft_features,
                   split_records)
from .models import (BIASING_GENERATION_KEYS, eos_token_ids, load_causal_lm, load_sequence_classifier, load_tokenizer,
                     merge_and_save, peak_memory_mb, recipe_quantization_config, require_model_dir,
                     sampling_generation_config, torch_dtype)
from .ppo_config import PPOConfig, PPOScriptArguments
from .ppo_engine import TrainingDivergedError  # noqa: F401 (importable from the stage)
from .policy_value import VALUE_HEAD_FILE, ValueHead
from .ppo_math import AdaptiveKLController  # noqa: F401 (importable from the stage)
from .ppo_trainer import PtxBatches, RLHFPPOTrainer, deployable_generation_config
from .reward_models import (RewardTokens, SharedBaseRewardModel, calibrate_reward_baseline,
                            require_reward_model, reward_tokens)
from .rewards import load_reward_functions, reward_columns
from .scoring import preserved_rng  # noqa: F401 (importable from the stage)

logger = logging.getLogger(__name__)
main, recipe_types = cli_launch.entry_points("ppo")  # main(argv, callbacks): parse, then `run`


@keeps_earlier_run
def run(configs: Recipe, callbacks: list | None = None) -> dict:
    """Train the policy with PPO on the recipe's prompts; returns ``{"output_dir", "merged", "value_model", "metrics",
    "trainer"}`` (``share_reward_value_base``: the trainer's ``reward_model`` is None, merged into the value model).
    Raises, before anything is written: `StageInputError`: the SFT or reward model missing (the hint names the stage
    to run) or no trained classifier; `DataError`: bad rows; `ValueError`: too few eval prompts for a batch per
    process, settings that cannot run (`check_inputs`, `load_models`); then `TrainingDivergedError`: a NaN / inf."""
    data_args, ppo_args, training_args, model_args = configs.data, configs.script, configs.training, configs.model
    sft_hint, rm_hint = sibling_recipe(configs.path, "sft"), sibling_recipe(configs.path, "rm")
    if (name := model_args.model_name_or_path) and name != training_args.sft_model_path:  # a GRPO recipe's key
        raise ValueError(f"model_name_or_path ({name}) is not read by ppo: the policy starts from sft_model_path; "
                         "set sft_model_path to it and remove model_name_or_path")
    # inputs: model directories, reward functions
    run_args, resume = start_run(training_args, configs.run, training_args.sft_model_path, not model_args.use_peft)
    configs = dataclasses.replace(configs, run=run_args)  # as run_config.yaml records it
    dist = distributed_state(training_args)  # under `accelerate launch`: this process's place in the group
    paths, reward_functions = check_inputs(ppo_args, training_args, run_args, sft_hint, rm_hint)

    # data
    report = DataReport("ppo")
    records = read_records(data_args, "prompts", report)
    train_records, eval_records = split_records(records, data_args.eval_split_size, training_args.seed, report)
    if len(eval_records) < training_args.per_device_eval_batch_size * dist.num_processes:  # one batch per process
        raise ValueError(
            f"{describe_sources(data_args)}: {len(eval_records)} eval prompts, fewer than per_device_eval_batch_size="
            f"{training_args.per_device_eval_batch_size} x {dist.num_processes} processes; raise eval_split_size")

    # tokenizer and models (prompts left-padded; pad distinct from EOS)
    tokenizer = load_tokenizer(paths["sft"], padding_side="left", trust_remote_code=ppo_args.trust_remote_code)
    template, source = Template.from_args(data_args), describe_sources(data_args)
    train_ds, eval_ds = (Dataset.from_dict(prompt_features(rows, tokenizer, template, data_args.max_prompt_length,
                                                           f"{source} ({split} split)", report, split))
                         for rows, split in ((train_records, "train"), (eval_records, "eval")))
    tokens = other_tokenizer(paths, ppo_args, tokenizer, template, {"train": train_records, "eval": eval_records})
    ptx = ptx_features(data_args, ppo_args, tokenizer, report) if ppo_args.ptx_dataset else None
    if reward_functions is not None or tokens is not None:  # rows index the records (reward functions' columns)
        train_ds = train_ds.add_column("row", list(range(len(train_ds))))
    if tokens is not None:  # the RM's prompt ids of the sample tables' prompts
        eval_ds = eval_ds.add_column("row", list(range(len(eval_ds))))
    policy, reward_model, value_model, eos_ids, stock_config = load_models(
        paths, tokenizer, ppo_args, training_args, model_args, run_args.allow_pickle_weights, tokens)
    baseline = reward_baseline(resume, ppo_args, training_args, dist, policy, reward_model, tokenizer, train_ds,
                               eos_ids, tokens)

    # trainer (inputs proven: only now does anything of an earlier run go)
    begin_writing(training_args, run_args, resume)
    out = training_args.output_dir
    if not resume and dist.is_main_process and os.path.exists(os.path.join(out, "samples.jsonl")):
        os.remove(os.path.join(out, "samples.jsonl"))
    policy = with_policy_adapter(policy, model_args, training_args)
    trainer = RLHFPPOTrainer(
        args=training_args, processing_class=tokenizer, model=policy,
        ref_model=None,  # with LoRA: the policy with its adapter disabled; else a frozen copy
        reward_model=reward_model, value_model=ValueHead(policy) if ppo_args.value_head else value_model,
        train_dataset=train_ds, eval_dataset=eval_ds, reward_tokens=tokens, ptx_coef=ppo_args.ptx_coef,
        ptx_batches=ptx and PtxBatches(ptx, training_args.per_device_train_batch_size, tokenizer.pad_token_id,
                                       training_args.seed + 7919 * dist.process_index),
        callbacks=callbacks, script_args=ppo_args, eos_token_ids=eos_ids, stock_generation_config=stock_config,
        recipe_configs=configs, reward_functions=reward_functions,
        # rows -> {column: [value per row]} of the train records, for the reward functions' keyword columns
        reward_columns=(lambda rows: reward_columns([train_records[i] for i in rows])) if reward_functions else None)
    trainer.reward_baseline, start = baseline, time.perf_counter()
    trainer.train(resume_from_checkpoint=resume)
    trainer.train_runtime = time.perf_counter() - start  # seconds, into metrics.json

    return save_outputs(trainer, tokenizer, stock_config, configs, report)


def check_inputs(ppo_args: PPOScriptArguments, training_args: PPOConfig, run_args: RunArguments, sft_hint, rm_hint):
    """Checked model dirs ``{"sft", "rm" (or None), "value"}``, reward functions (or None); sets ``stop_token: eos``
    when no stop is set. Raises as `run`."""
    pickle_ok = run_args.allow_pickle_weights
    if not training_args.sft_model_path:
        raise ValueError("sft_model_path: set it to the SFT stage's merged model directory (e.g. "
                         "outputs/<run>/sft/merged)")
    sft_path = require_model_dir(training_args.sft_model_path, "SFT model", sft_hint, pickle_ok)
    reward_functions = None
    if ppo_args.reward_funcs or ppo_args.reward_weights:  # weights alone are an error, not ignored
        reward_functions = load_reward_functions(ppo_args.reward_funcs, ppo_args.reward_weights)
    elif not training_args.reward_model_path:
        raise ValueError("reward_model_path: PPO needs a reward model, reward functions (reward_funcs) or both")
    rm_path = None
    if training_args.reward_model_path:
        rm_path = require_model_dir(training_args.reward_model_path, "reward model", rm_hint, pickle_ok)
        require_reward_model(rm_path, rm_hint)  # a causal LM or an untrained score head: one line, nothing read yet
    if not (ppo_args.value_model_path or rm_path or ppo_args.value_head):
        raise ValueError("value_model_path: without a reward model the value model needs its own initialization "
                         "(a sequence classifier, or a causal LM directory: its score head starts at random)")
    value_path = None if ppo_args.value_head else require_model_dir(ppo_args.value_model_path or rm_path,
                                                                    "value model", rm_hint, pickle_ok)
    if rm_path is None and (ppo_args.share_reward_value_base or ppo_args.reward_baseline_value() is None):
        raise ValueError("share_reward_value_base / reward_baseline auto need a reward model (reward_model_path)")
    if ppo_args.reward_baseline_value() is None and is_deepspeed_zero3_enabled():
        raise ValueError("reward_baseline: 'auto' cannot run under DeepSpeed ZeRO-3 (one process would sample from "
                         "weights sharded over all of them); set a number, e.g. the reward_baseline in metrics.json "
                         "of a run with auto under ACCEL=zero2 / ddp")
    if ppo_args.share_reward_value_base:
        if os.path.normpath(value_path) != os.path.normpath(rm_path):
            raise ValueError("share_reward_value_base: true starts the value model from the reward model; remove "
                             f"value_model_path ({ppo_args.value_model_path})")
        if training_args.deepspeed or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
            raise ValueError("share_reward_value_base: true is not supported under DeepSpeed (it shards the reward "
                             "and value models separately); set it to false")
        if training_args.offload_reward_model:
            raise ValueError("offload_reward_model: the reward model shares weights with the value model "
                             "(share_reward_value_base); set `offload_reward_model: false`")
    if training_args.stop_token is None and training_args.stop_token_id is None:
        training_args.stop_token = "eos"  # responses end at EOS; the reward is read there
    return {"sft": sft_path, "rm": rm_path, "value": value_path}, reward_functions


def ptx_features(data_args: DataArguments, ppo_args: PPOScriptArguments, tokenizer, report: DataReport) -> dict:
    """PPO-ptx's SFT rows of ``ptx_dataset`` (split ``ptx_split``, all rows; the recipe's template unless
    ``ptx_prompt_template`` / ``ptx_completion_template``), tokenized as the sft stage does (`sft_features`, at most
    ``ptx_max_length`` tokens, right-padded later; counts in ``report`` as split ``ptx``). Raises `DataError`."""
    args = dataclasses.replace(
        DataArguments(), dataset_name=ppo_args.ptx_dataset, dataset_split=ppo_args.ptx_split,
        prompt_template=ppo_args.ptx_prompt_template or data_args.prompt_template,
        completion_template=ppo_args.ptx_completion_template or data_args.completion_template,
        chat_template=data_args.chat_template, system_prompt=data_args.system_prompt,
        dataset_encoding=data_args.dataset_encoding, on_bad_row=data_args.on_bad_row)
    features = sft_features(read_records(args, "sft", report), tokenizer, Template.from_args(args),
                            ppo_args.ptx_max_length, f"{describe_sources(args)} (ptx)", args.length_policy,
                            args.max_prompt_length, report, "ptx")
    logger.info("ptx: %d SFT rows of %s mixed into PPO (ptx_coef %s)", len(features["input_ids"]),
                ppo_args.ptx_dataset, ppo_args.ptx_coef)
    return features


def other_tokenizer(paths: dict, ppo_args: PPOScriptArguments, tokenizer, template: Template,
                    records: dict[str, list[dict]]) -> RewardTokens | None:
    """`RewardTokens` (with the RM's prompt ids of ``records``, split -> prompt records) when the reward model has
    another tokenizer than the policy (`reward_tokens`), else None; then the value model starts from the SFT policy
    (``paths["value"]``, a new score head). Raises `ValueError`: ``share_reward_value_base`` or ``value_model_path``
    on that reward model (its weights read another vocabulary); the RM's template cannot render the prompts."""
    tokens = reward_tokens(paths["rm"], tokenizer, template, ppo_args.trust_remote_code)
    if tokens is None:
        return None
    if ppo_args.share_reward_value_base:
        raise ValueError(f"share_reward_value_base: true, but the reward model {paths['rm']} has another tokenizer "
                         "than the policy (the value model reads the policy's ids); set share_reward_value_base: false")
    if ppo_args.value_model_path and os.path.normpath(paths["value"]) == os.path.normpath(paths["rm"]):
        raise ValueError(f"value_model_path: {ppo_args.value_model_path} is the reward model, whose tokenizer is not "
                         "the policy's; remove value_model_path (the value model then starts from the SFT policy)")
    if not (ppo_args.value_model_path or ppo_args.value_head):
        paths["value"] = paths["sft"]
        logger.info("value model: the SFT policy %s with a new score head (the reward model %s has another "
                    "tokenizer; set value_model_path to start it elsewhere)", paths["sft"], paths["rm"])
    for split, rows in records.items():
        tokens.add_prompts(split, rows)
    return tokens


def load_models(paths: dict, tokenizer, ppo_args: PPOScriptArguments, training_args: PPOConfig, model_args,
                pickle_ok: bool, tokens: RewardTokens | None = None):
    """Policy (no adapter yet), reward model (None, or `SharedBaseRewardModel`), value model (``value_use_peft``: own
    LoRA; ``value_head``: None, the head is made on the policy with its adapter), EOS ids, the policy's stock
    generation config; ``tokens``: the reward model reads its own tokenizer's ids (`RewardTokens`). Raises
    `ValueError`: quantization; a vocabulary smaller than its tokenizer's."""
    remote = ppo_args.trust_remote_code
    dtype = torch.bfloat16 if training_args.bf16 else torch_dtype(model_args.dtype)  # TRL ignores bf16
    # load_in_4bit quantizes all three models; policy and value model are then trained through LoRA only
    if (model_args.load_in_4bit or model_args.load_in_8bit) and ppo_args.save_merged_checkpoints:
        raise ValueError("load_in_4bit / load_in_8bit: set save_merged_checkpoints: false (merging an adapter into "
                         "quantized weights rounds the update away; merged/ is still written, unquantized, at the end)")
    quant = recipe_quantization_config(model_args, {"use_peft": model_args.use_peft,
                                                    "value_use_peft": ppo_args.value_use_peft}, training_args.use_cpu)
    policy = load_causal_lm(paths["sft"], dtype, remote, pickle_ok, quantization_config=quant)
    reward_model = paths["rm"] and load_sequence_classifier(paths["rm"], dtype, remote, pickle_ok,
                                                            quantization_config=quant).eval().requires_grad_(False)
    value_model = reward_model if ppo_args.share_reward_value_base else None if ppo_args.value_head else \
        load_sequence_classifier(paths["value"], dtype, remote, pickle_ok, quantization_config=quant)
    for name, m in (("policy", policy), ("reward model", reward_model), ("value model", value_model)):
        if m is None:
            continue
        tok = tokens.tokenizer if tokens is not None and m is reward_model else tokenizer
        if m.config.vocab_size < len(tok):
            raise ValueError(f"{name} vocabulary ({m.config.vocab_size}) is smaller than its tokenizer's ({len(tok)}, "
                             f"{getattr(tok, 'name_or_path', '')}): use the {name} saved with that tokenizer")
        m.config.pad_token_id = tok.pad_token_id
    eos_ids = eos_token_ids(tokenizer, paths["sft"])  # e.g. Qwen2.5-Instruct: [<|im_end|>, <|endoftext|>]
    stock = rollout_generation_config(policy, paths["sft"], eos_ids, tokenizer.pad_token_id, training_args.temperature)
    if ppo_args.value_use_peft:
        value_model = get_peft_model(value_model, LoraConfig(
            task_type="SEQ_CLS", r=ppo_args.value_lora_r, lora_alpha=ppo_args.value_lora_alpha,
            lora_dropout=ppo_args.value_lora_dropout, target_modules=ppo_args.value_lora_target_modules))
        if ppo_args.share_reward_value_base:  # one copy of the weights: the reward is the base with the adapter off
            reward_model = SharedBaseRewardModel(value_model)
    if training_args.gradient_checkpointing:  # TRL ignores it
        kwargs = training_args.gradient_checkpointing_kwargs or {"use_reentrant": False}
        for m in (policy, value_model) if value_model is not None else (policy,):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            m.config.use_cache = False
    return policy, reward_model, value_model, eos_ids, stock


def reward_baseline(resume, ppo_args, training_args, dist, policy, reward_model, tokenizer, train_ds, eos_ids,
                    tokens: RewardTokens | None = None) -> float:
    """The baseline (reward units) the rollouts subtract from every RM score (`PPOEngine.rollout`): the resumed
    checkpoint's, the recipe's, or 'auto' (`calibrate_reward_baseline` on the main process, sent to every process;
    ``tokens``: `RewardTokens`)."""
    baseline = ppo_args.reward_baseline_value()  # None: auto
    if resume:
        saved = os.path.join(resume, "reward_baseline.json")
        baseline = json.load(open(saved))["reward_baseline"] if os.path.exists(saved) else 0.0
    elif baseline is None:  # auto
        baseline = None if not dist.is_main_process else calibrate_reward_baseline(
            policy, reward_model, tokenizer, train_ds, training_args, ppo_args.reward_baseline_batches, eos_ids, tokens)
        if dist.num_processes > 1:
            baseline = broadcast_object_list([baseline], from_process=0)[0]
    ppo_args.reward_baseline = str(baseline)
    return baseline


def rollout_generation_config(model, source: str, eos_ids: list[int], pad_token_id: int, temperature: float):
    """Set PPO's generation config on ``model`` (``temperature`` alone, stop at ``eos_ids``: else log-probs and KL are
    biased); return the stock one (saved with the merged policy), logging ``source``'s settings overridden."""
    stock = copy.deepcopy(model.generation_config)
    found = {k: getattr(stock, k, None) for k, ok in BIASING_GENERATION_KEYS.items()
             if getattr(stock, k, None) not in ok}
    if getattr(stock, "temperature", None) not in (None, 1.0, temperature):
        found["temperature"] = stock.temperature
    model.generation_config = sampling_generation_config(temperature, None, eos_ids, pad_token_id,
                                                         bos_token_id=getattr(stock, "bos_token_id", None))
    if found:
        logger.info("rollouts sample with temperature=%s only, stopping at EOS ids %s; overriding %s of "
                    "%s/generation_config.json (kept in the saved models)", temperature, list(eos_ids), found, source)
    return stock


def with_policy_adapter(policy, model_args, training_args):
    """The policy with the recipe's LoRA adapter (``use_peft``; the reference is then the policy with its adapter
    disabled: no second copy), or as it is. QLoRA in bf16: norms in fp32, embeddings / head in bf16 (as TRL 1.12)."""
    from trl import get_peft_config

    peft_config = get_peft_config(model_args)
    if peft_config is None:
        return policy
    policy = get_peft_model(policy, peft_config)
    if training_args.bf16 and getattr(policy, "is_loaded_in_4bit", False):
        for name, module in policy.named_modules():
            if isinstance(module, torch.nn.LayerNorm) or "norm" in name:
                module.to(torch.float32)
            elif any(x in name for x in ("lm_head", "embed_tokens")) and getattr(module, "weight", None) is not None \
                    and module.weight.dtype == torch.float32:
                module.to(torch.bfloat16)
    return policy


def save_outputs(trainer, tokenizer, stock_config, configs: Recipe, report: DataReport | None = None) -> dict:
    """Write the module docstring's outputs (main process; the others wait); returns `run`'s result."""
    out, ppo_args = trainer.args.output_dir, configs.script
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    metrics = {"global_step": trainer.state.global_step, "episode": trainer.state.episode,
               "reward_baseline": trainer.reward_baseline, "kl_coef_final": trainer.kl_coef,
               "train_runtime": getattr(trainer, "train_runtime", None), "peak_memory_mb": peak_memory_mb()}
    if logs:
        metrics.update({k: v for k, v in logs[-1].items() if isinstance(v, (int, float))})
        metrics["first_scores"] = logs[0]["objective/scores"]
    value_head = isinstance(trainer.unwrapped.value_model, ValueHead)  # saved beside the policy's weights / adapter
    result = {"output_dir": out, "merged": os.path.join(out, "merged"), "metrics": metrics, "trainer": trainer,
              "value_model": None if value_head else os.path.join(out, "value_model")}
    if not trainer.accelerator.is_main_process:
        trainer.accelerator.wait_for_everyone()
        return result
    save_recipe(out, configs)
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    head = {VALUE_HEAD_FILE: unwrapped.value_model.head_state()} if value_head else None
    if isinstance(unwrapped.policy, PeftModel):
        save_pretrained_atomic(unwrapped.policy, None, os.path.join(out, "adapter"), tensors=head)
    with deployable_generation_config(unwrapped.policy, stock_config):
        merge_and_save(unwrapped.policy, tokenizer, result["merged"], tensors=head)
    if value_head:
        result["value_head"] = os.path.join(result["merged"], VALUE_HEAD_FILE)
    else:  # a peft value model is merged in place: training is over
        merge_and_save(unwrapped.value_model, tokenizer, result["value_model"])
        if ppo_args.share_reward_value_base:
            trainer.reward_model = None  # its weights now hold the merged value model
    write_json(os.path.join(out, "metrics.json"), metrics)
    write_json(os.path.join(out, "log_history.json"), {"log_history": trainer.state.log_history})  # curves
    if report is not None:
        report.write(out)
    logger.info("PPO done: merged policy at %s, value %s", result["merged"], result.get("value_head") or
                f"model at {result['value_model']}")
    trainer.accelerator.wait_for_everyone()
    return result


if __name__ == "__main__":
    cli_launch.run_stage("ppo")

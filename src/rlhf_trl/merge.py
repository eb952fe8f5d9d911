"""Merge a LoRA adapter into its base: ``rlhf-trl merge --adapter DIR --output DIR [--base DIR]``. The result: a plain
`transformers` model directory (safetensors, written atomically) with the adapter's (else the base's) tokenizer and a
``README.md``: ``AutoModelForCausalLM`` (``CAUSAL_LM``) or ``AutoModelForSequenceClassification`` (``SEQ_CLS``)."""

from __future__ import annotations

import argparse
import json
import logging
import os

from safetensors.torch import load_file

from .atomic import save_pretrained_atomic
from .cli_launch import run_stage
from .config import RecipeError, one_line_arguments
from .models import (StageInputError, load_causal_lm, load_sequence_classifier, load_tokenizer, require_model_dir,
                     resize_for_tokenizer, torch_dtype)
from .policy_value import VALUE_HEAD_FILE

logger = logging.getLogger(__name__)

TASK_KINDS = {"CAUSAL_LM": "AutoModelForCausalLM", "SEQ_CLS": "AutoModelForSequenceClassification"}  # -> Auto class
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


def read_adapter_config(adapter_dir: str) -> dict:
    """``adapter_config.json`` as a dict. Raises `StageInputError`: no adapter; `ValueError`: not a JSON object."""
    if not os.path.isdir(adapter_dir):
        raise StageInputError(f"--adapter: no LoRA adapter at '{adapter_dir}' (directory not found)")
    if not os.path.isfile(path := os.path.join(adapter_dir, "adapter_config.json")):
        if os.path.isfile(os.path.join(adapter_dir, "config.json")):
            raise StageInputError(f"--adapter: '{adapter_dir}' is a model directory, not a LoRA adapter (no "
                                  "adapter_config.json)")
        raise StageInputError(f"--adapter: no LoRA adapter at '{adapter_dir}' (adapter_config.json not found)")
    if not any(os.path.isfile(os.path.join(adapter_dir, name)) for name in ADAPTER_WEIGHTS):
        raise StageInputError(f"--adapter: '{adapter_dir}' holds no adapter weights ({' or '.join(ADAPTER_WEIGHTS)})")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: must be a JSON object, got {type(config).__name__}")
    return config


def check_output(output_dir: str, adapter_dir: str, base: str) -> None:
    """Refuse an ``--output`` whose replacement deletes inputs or other files (`RecipeError`, one line)."""
    out = os.path.realpath(output_dir)
    for what, path in (("adapter", adapter_dir), ("base model", base)):
        real = os.path.realpath(path)
        if os.path.isdir(path) and (real == out or real.startswith(out.rstrip(os.sep) + os.sep)):  # not a hub id
            raise RecipeError(f"--output '{output_dir}' {'is' if real == out else 'holds'} the {what} directory "
                              f"'{path}'; merging replaces --output, so choose a new directory")
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise RecipeError(f"--output '{output_dir}' is a file; choose a new directory")
    if os.path.isdir(output_dir) and os.listdir(output_dir) and not os.path.isfile(
            os.path.join(output_dir, "config.json")):
        raise RecipeError(f"--output '{output_dir}' holds files and no model (config.json); merging replaces --output, "
                          "so choose a new or empty directory")


def merge_adapter(adapter_dir: str, output_dir: str, base: str | None = None, dtype=None,
                  trust_remote_code: bool = False, allow_pickle: bool = False):
    """Merge the LoRA adapter in ``adapter_dir`` into its base and save a plain model (with tokenizer and ``README.md``)
    to ``output_dir``: a new or empty directory, or an earlier merged model (replaced atomically). ``base``: default the
    adapter's ``base_model_name_or_path`` (as given, else relative to ``adapter_dir``). Returns the merged model (eval
    mode). All checks run before anything is loaded or written: `StageInputError` (no adapter or base), `RecipeError`
    (`check_output`), `ValueError` (bad JSON, a task type other than CAUSAL_LM / SEQ_CLS, not LoRA, no base)."""
    from peft import PeftModel

    config = read_adapter_config(adapter_dir)
    task_type = str(config.get("task_type") or "")
    if task_type not in TASK_KINDS:
        raise ValueError(f"{adapter_dir}: adapter task_type {task_type!r} is not supported; expected one of "
                         f"{sorted(TASK_KINDS)}")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{adapter_dir}: peft_type {config.get('peft_type')!r} is not a LoRA adapter")
    source = "--base" if base else f"base_model_name_or_path of {adapter_dir}/adapter_config.json"
    if not base:
        base = config.get("base_model_name_or_path")
        if not base:
            raise ValueError(f"{adapter_dir}/adapter_config.json names no base_model_name_or_path; pass --base DIR")
        if not os.path.isabs(base) and not os.path.exists(base) and os.path.exists(os.path.join(adapter_dir, base)):
            base = os.path.join(adapter_dir, base)
    base_path = require_model_dir(base, f"base model ({source})", None, allow_pickle)
    check_output(output_dir, adapter_dir, base_path)
    has_tokenizer = any(os.path.isfile(os.path.join(adapter_dir, f)) for f in TOKENIZER_FILES)
    tokenizer_src = adapter_dir if has_tokenizer else base_path
    tokenizer = load_tokenizer(tokenizer_src, trust_remote_code=trust_remote_code)
    loader = load_causal_lm if task_type == "CAUSAL_LM" else load_sequence_classifier
    model = loader(base_path, dtype, trust_remote_code, allow_pickle)
    if task_type != "CAUSAL_LM":
        logger.info("the base's new score head (reported MISSING above when the base is a causal LM) is replaced by "
                    "the adapter's trained one")
    resize_for_tokenizer(model, tokenizer)
    merged = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload().eval()
    card = model_card(adapter_dir, base_path, task_type, tokenizer_src, config)
    head = os.path.join(adapter_dir, VALUE_HEAD_FILE)  # a PPO value_head: true run's head goes with its policy
    tensors = {VALUE_HEAD_FILE: load_file(head)} if os.path.isfile(head) else None
    save_pretrained_atomic(merged, tokenizer, output_dir, files={"README.md": card}, tensors=tensors)
    logger.info("merged %s (%s) into %s -> %s", adapter_dir, task_type, base_path, output_dir)
    return merged


def model_card(adapter_dir: str, base_path: str, task_type: str, tokenizer_src: str, config: dict) -> str:
    """The text of the merged model's ``README.md``: base model, task type, adapter and how it was made."""
    return (f"# Merged model (rlhf_trl)\n\n- base model: `{base_path}`\n"
            f"- task type: `{task_type}` — load with `transformers.{TASK_KINDS[task_type]}.from_pretrained(<this dir>)`"
            + (" (num_labels=1, trained `score` head included)\n" if task_type == "SEQ_CLS" else "\n")
            + f"- LoRA adapter merged in: `{os.path.abspath(adapter_dir)}` (r={config.get('r')}, "
            f"lora_alpha={config.get('lora_alpha')}, target_modules={config.get('target_modules')}, "
            f"modules_to_save={config.get('modules_to_save')})\n"
            f"- tokenizer from: `{tokenizer_src}`\n"
            f"- made by: `rlhf-trl merge --adapter {adapter_dir} --output <this dir>` (peft `merge_and_unload`)\n")


def main(argv: list[str] | None = None) -> dict:
    """``rlhf-trl merge --adapter DIR --output DIR [--base DIR] [--dtype D]`` (raises as `merge_adapter`)."""
    p = one_line_arguments(argparse.ArgumentParser(prog="rlhf-trl merge", description=__doc__,
                                                   formatter_class=argparse.RawTextHelpFormatter))
    p.add_argument("--adapter", required=True, help="peft LoRA adapter directory")
    p.add_argument("--output", required=True, help="directory for the merged model")
    p.add_argument("--base", default=None, help="base model (default: the adapter's base_model_name_or_path)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16", "auto"],
                   help="dtype of the base as loaded (default: the base's)")
    p.add_argument("--trust_remote_code", action="store_true", help="run model code of the base (Baichuan)")
    p.add_argument("--allow_pickle_weights", action="store_true", help="load *.bin weights when no safetensors")
    args = p.parse_args(argv)
    merge_adapter(args.adapter, args.output, args.base, torch_dtype(args.dtype), args.trust_remote_code,
                  args.allow_pickle_weights)
    return {"output_dir": args.output, "merged": args.output}


if __name__ == "__main__":
    run_stage("merge")

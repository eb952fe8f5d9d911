"""Tokenizer, model loading and checkpoint plumbing shared by the stages."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager

import torch

logger = logging.getLogger(__name__)

# Tried in order when a tokenizer has no pad token, or its pad token is EOS (Qwen base: both "<|endoftext|>").
PAD_CANDIDATES = ("<|endoftext|>", "<|pad|>", "<pad>", "<|vision_pad|>", "<unk>")


class StageInputError(FileNotFoundError):
    """A stage's input (model, tokenizer, previous stage's output) is missing. The message names what to run."""


def require_model_dir(path: str, what: str, produced_by: str | None = None, allow_pickle: bool = False) -> str:
    """Check that ``path`` is a local model directory with a config and weights, or looks like a hub id.

    Args:
        path: local directory or hub id (``org/name``).
        what: human name of the input, e.g. "SFT model".
        produced_by: the command that produces it (e.g. ``make sft RECIPE=recipes/demo/sft.yaml``).

    Raises:
        StageInputError: the path is local (or clearly meant as a local path) but missing or incomplete, or it
            holds only pickle weights and ``allow_pickle`` is False.
    """
    looks_local = path.startswith((".", "/", "~")) or os.path.exists(path) or path.count("/") != 1
    if not looks_local:
        return path  # hub id, resolved by from_pretrained
    hint = f"; run `{produced_by}` first" if produced_by else ""
    if not os.path.isdir(path):
        raise StageInputError(f"{what} not found at '{path}'{hint}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise StageInputError(f"{what} at '{path}' has no config.json (incomplete or not a model directory){hint}")
    files = os.listdir(path)
    if not any(f.endswith(".safetensors") or f == "model.safetensors.index.json" for f in files):
        if any(f.endswith((".bin", ".pt", ".pth", ".ckpt")) for f in files) and not allow_pickle:
            raise StageInputError(
                f"{what} at '{path}' has only pickle weights (*.bin), which can run code when loaded; convert them to "
                "safetensors, or set `allow_pickle_weights: true` in the recipe if you trust the files"
            )
        if not any(f.endswith((".bin", ".pt", ".pth", ".ckpt")) for f in files):
            raise StageInputError(f"{what} at '{path}' holds no weights (*.safetensors){hint}")
    return path


def load_tokenizer(path: str, pad_token: str | None = None, padding_side: str = "right", trust_remote_code=False):
    """Load a tokenizer and make its pad token distinct from EOS.

    TRL's PPOTrainer masks pad tokens out of every forward pass and reads rewards at the last non-pad token, so a
    pad token equal to EOS would hide the EOS that ends each response. When ``pad_token`` is not given and the
    tokenizer's pad is missing or equals EOS, the first of `PAD_CANDIDATES` found in the vocabulary (other than EOS)
    is used; if none exists, ``<|pad|>`` is added (the model's embeddings must then be resized:
    `resize_for_tokenizer`).

    Raises:
        StageInputError: the tokenizer cannot be found.
        ValueError: the tokenizer has no EOS token, or ``pad_token`` equals EOS.
    """
    from transformers import AutoTokenizer

    if os.path.isdir(path):
        _check_remote_code(path, trust_remote_code)
    try:
        if trust_remote_code and is_baichuan(path):
            from .baichuan import load_tokenizer as load_baichuan_tokenizer

            tok = load_baichuan_tokenizer(path)
        else:
            tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise StageInputError(f"cannot load a tokenizer from '{path}': {exc}") from None
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer at '{path}' has no EOS token; set eos_token in its tokenizer_config.json")
    if pad_token is not None:
        if pad_token == tok.eos_token:
            raise ValueError(f"pad_token {pad_token!r} equals the EOS token; PPO needs them distinct")
        if pad_token not in tok.get_vocab():
            tok.add_special_tokens({"pad_token": pad_token})
        tok.pad_token = pad_token
    elif tok.pad_token_id is None or tok.pad_token_id == tok.eos_token_id:
        vocab = tok.get_vocab()
        choice = next((c for c in PAD_CANDIDATES if c in vocab and vocab[c] != tok.eos_token_id), None)
        if choice is None:
            choice = "<|pad|>"
            tok.add_special_tokens({"pad_token": choice})
        logger.info("pad token set to %r (EOS is %r)", choice, tok.eos_token)
        tok.pad_token = choice
    tok.padding_side = padding_side
    return tok


def model_type(path: str, trust_remote_code: bool = False) -> str | None:
    """``config.model_type`` of a local model directory or hub id (None if it has no readable config)."""
    local = os.path.join(path, "config.json")
    if os.path.isfile(local):
        with open(local, encoding="utf-8") as f:
            return json.load(f).get("model_type")
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).model_type
    except (OSError, ValueError):
        return None


def is_baichuan(path: str) -> bool:
    """True for Baichuan / Baichuan2 remote-code checkpoints (``model_type`` starting with ``baichuan``)."""
    return (model_type(path) or "").lower().startswith("baichuan")


def _check_remote_code(path: str, trust_remote_code: bool) -> None:
    if is_baichuan(path) and not trust_remote_code:
        raise ValueError(
            f"'{path}' is a Baichuan remote-code model: set `trust_remote_code: true` in the recipe to run its code"
        )
    if trust_remote_code:
        logger.warning("trust_remote_code: the Python code in '%s' will run in this process", path)


def _load_model(kind: str, path: str, dtype, trust_remote_code: bool, allow_pickle: bool):
    """Load a causal LM (``kind='causal_lm'``) or a one-label sequence classifier (``'sequence_classifier'``)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    _check_remote_code(path, trust_remote_code)
    if trust_remote_code and is_baichuan(path):
        from . import baichuan

        return getattr(baichuan, f"load_{kind}")(path, dtype=dtype)
    auto, extra = (AutoModelForCausalLM, {}) if kind == "causal_lm" else (AutoModelForSequenceClassification,
                                                                         {"num_labels": 1})
    return auto.from_pretrained(
        path, dtype=dtype, trust_remote_code=trust_remote_code, use_safetensors=None if allow_pickle else True, **extra
    )


def load_causal_lm(path: str, dtype=None, trust_remote_code: bool = False, allow_pickle: bool = False):
    """A causal LM (policy / SFT model); Baichuan remote-code models go through `rlhf_trl.baichuan`.

    Weights load from safetensors only unless ``allow_pickle``.

    Raises:
        ValueError: a remote-code model without ``trust_remote_code``.
    """
    return _load_model("causal_lm", path, dtype, trust_remote_code, allow_pickle)


def load_sequence_classifier(path: str, dtype=None, trust_remote_code: bool = False, allow_pickle: bool = False):
    """A ``num_labels=1`` sequence classifier (reward / value model) with a last-token ``score`` head.

    Baichuan remote-code models get `rlhf_trl.baichuan.BaichuanForSequenceClassification`. Weights load from
    safetensors only unless ``allow_pickle``.

    Raises:
        ValueError: a remote-code model without ``trust_remote_code``.
    """
    return _load_model("sequence_classifier", path, dtype, trust_remote_code, allow_pickle)


def resize_for_tokenizer(model, tokenizer) -> None:
    """Grow the embeddings if the tokenizer gained tokens, and record pad / EOS ids on config and generation config."""
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.pad_token_id = tokenizer.pad_token_id
        gen.eos_token_id = tokenizer.eos_token_id


def resolve_resume(value, output_dir: str) -> str | None:
    """Turn a recipe's ``resume_from_checkpoint`` into a checkpoint directory (or None to start fresh).

    ``true`` / ``last`` picks the newest complete ``checkpoint-N`` in ``output_dir``; a path must exist.

    Raises:
        StageInputError: ``true`` with no checkpoint in ``output_dir``, or a path that does not exist.
    """
    if value is None or str(value).strip().lower() in ("", "false", "no", "0", "none"):
        return None
    if str(value).strip().lower() in ("true", "yes", "1", "last"):
        from transformers.trainer_utils import get_last_checkpoint

        last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
        if last is None:
            raise StageInputError(f"resume_from_checkpoint=true, but '{output_dir}' holds no checkpoint-N directory")
        return last
    if not os.path.isdir(str(value)):
        raise StageInputError(f"resume_from_checkpoint: checkpoint '{value}' not found")
    return str(value)


def torch_dtype(name: str | None):
    """Map a recipe dtype string ('float32', 'bfloat16', 'auto', None) to what from_pretrained takes."""
    if name in (None, "auto"):
        return name
    return getattr(torch, name)


@contextmanager
def atomic_dir(final_path: str):
    """Write a directory under a temporary name next to ``final_path`` and rename it into place on success.

    A crash leaves no half-written ``final_path``; an existing ``final_path`` is replaced only after the new one
    is complete.
    """
    parent = os.path.dirname(os.path.abspath(final_path)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(final_path)}.tmp-", dir=parent)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.exists(final_path):
        old = tmp + ".old"
        os.rename(final_path, old)
        os.rename(tmp, final_path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final_path)


def save_pretrained_atomic(model, tokenizer, path: str, extra: dict | None = None) -> str:
    """Save a model (safetensors) and tokenizer to ``path`` atomically; ``extra`` maps file names to JSON data."""
    with atomic_dir(path) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for name, data in (extra or {}).items():
            with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                json.dump(data, f, ensure_ascii=False, indent=2)
    return path


def merge_and_save(model, tokenizer, path: str):
    """Merge LoRA adapters into the base weights (if ``model`` is a `peft.PeftModel`) and save the plain model.

    For a sequence-classification reward model trained with ``task_type=SEQ_CLS`` the trained ``score`` head
    (a ``modules_to_save`` copy) is part of the merged model. The adapter is merged in place: use the returned
    plain model afterwards, not ``model``.

    Returns:
        The merged plain `transformers` model.
    """
    from peft import PeftModel

    merged = model.merge_and_unload() if isinstance(model, PeftModel) else model
    save_pretrained_atomic(merged, tokenizer, path)
    return merged


def write_json(path: str, data: dict) -> None:
    """Write JSON atomically (temporary file, then rename)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, indent=2)
    os.replace(tmp, path)

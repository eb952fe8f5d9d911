"""Tokenizer, model loading and checkpoint plumbing shared by the stages."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager

import torch

logger = logging.getLogger(__name__)

# Tried in order when a tokenizer has no pad token, or its pad token is one of the EOS ids (Qwen base: both
# "<|endoftext|>"; Qwen Instruct: pad "<|endoftext|>", which its generation_config lists as a second EOS).
PAD_CANDIDATES = ("<|endoftext|>", "<|pad|>", "<pad>", "<|vision_pad|>", "<unk>")


# Generation settings that change the sampling distribution away from softmax(logits / temperature): with them the
# rollout log-probs are not the policy's, and the KL estimate and the policy gradient are biased.
BIASING_GENERATION_KEYS = {
    "min_new_tokens": (None, 0), "min_length": (None, 0), "no_repeat_ngram_size": (None, 0),
    "repetition_penalty": (None, 1.0), "encoder_repetition_penalty": (None, 1.0), "top_k": (None, 0),
    "top_p": (None, 1.0), "typical_p": (None, 1.0), "min_p": (None, 0.0), "epsilon_cutoff": (None, 0.0),
    "eta_cutoff": (None, 0.0), "bad_words_ids": (None,), "suppress_tokens": (None,),
    "begin_suppress_tokens": (None,), "sequence_bias": (None,), "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,), "exponential_decay_length_penalty": (None,), "num_beams": (None, 1),
}


def sampling_generation_config(temperature: float, max_new_tokens: int | None, eos_token_ids: list[int],
                               pad_token_id: int, **extra):
    """A ``GenerationConfig`` that samples from ``softmax(logits / temperature)`` and nothing else.

    Every setting of `BIASING_GENERATION_KEYS` is set to its neutral value explicitly: ``generate`` fills the
    settings a passed config leaves unset from ``model.generation_config``, so a stock checkpoint's top_k / top_p /
    repetition_penalty would otherwise leak in. Stops at any of ``eos_token_ids``; ``max_new_tokens`` in tokens.
    Used by PPO rollouts, `rlhf_trl.evaluate` and the demo, so that all of them sample the same distribution.
    """
    from transformers import GenerationConfig

    # min_length is left unset: min_new_tokens=0 takes precedence over it (and setting both makes generate warn)
    neutral = {k: ok[-1] for k, ok in BIASING_GENERATION_KEYS.items() if ok[-1] is not None and k != "min_length"}
    neutral.update(do_sample=True, temperature=temperature, eos_token_id=list(eos_token_ids), pad_token_id=pad_token_id)
    if max_new_tokens is not None:
        neutral["max_new_tokens"] = max_new_tokens
    return GenerationConfig(**neutral, **extra)


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


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def eos_token_ids(tokenizer, model_dir: str | None = None) -> list[int]:
    """Every token id that ends a response: the tokenizer's EOS first, then the EOS ids of the model directory's
    ``generation_config.json`` (a list in Qwen2.5-Instruct: ``[<|im_end|>, <|endoftext|>]``) and ``config.json``.

    Rollouts stop at any of them, the missing-EOS penalty and EOS rates count any of them, and the reward model's
    score is read at whichever one ends the response. Ids equal to the tokenizer's pad token are left out (the pad
    token is chosen distinct from all of them by `load_tokenizer`). Returns a list without repeats.
    """
    pad = tokenizer.pad_token_id
    ids = _all_eos_ids(tokenizer, model_dir)
    return [i for i in ids if i == ids[0] or i != pad]


def _all_eos_ids(tokenizer, model_dir: str | None) -> list[int]:
    ids = [int(tokenizer.eos_token_id)]
    if model_dir and os.path.isdir(model_dir):
        for name in ("generation_config.json", "config.json"):
            path = os.path.join(model_dir, name)
            if os.path.isfile(path):
                with open(path, encoding="utf-8") as f:
                    ids += _as_id_list(json.load(f).get("eos_token_id"))
    out = []
    for i in ids:
        if i not in out and 0 <= i < len(tokenizer):
            out.append(i)
    return out


def load_tokenizer(path: str, pad_token: str | None = None, padding_side: str = "right", trust_remote_code=False):
    """Load a tokenizer and make its pad token distinct from every EOS id.

    TRL's PPOTrainer masks pad tokens out of every forward pass and reads rewards at the last non-pad token, so a
    pad token equal to an EOS id would hide the EOS that ends a response. The EOS ids are the tokenizer's EOS and
    those of ``path``'s ``generation_config.json`` (`eos_token_ids`): stock Qwen2.5-Instruct pads with
    ``<|endoftext|>``, which its generation_config lists as a second EOS. When ``pad_token`` is not given and the
    tokenizer's pad is missing or one of the EOS ids, the first of `PAD_CANDIDATES` found in the vocabulary (other
    than an EOS id) is used; if none exists, ``<|pad|>`` is added (the model's embeddings must then be resized:
    `resize_for_tokenizer`).

    Raises:
        StageInputError: the tokenizer cannot be found.
        ValueError: the tokenizer has no EOS token, or ``pad_token`` is one of the EOS ids.
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
    pad_id = tok.pad_token_id
    eos = _all_eos_ids(tok, path if os.path.isdir(path) else None)
    vocab = tok.get_vocab()
    if pad_token is not None:
        if vocab.get(pad_token) in eos:
            raise ValueError(f"pad_token {pad_token!r} is an EOS token (EOS ids {eos}); PPO needs them distinct")
        if pad_token not in vocab:
            tok.add_special_tokens({"pad_token": pad_token})
        tok.pad_token = pad_token
    elif pad_id is None or pad_id in eos:
        choice = next((c for c in PAD_CANDIDATES if c in vocab and vocab[c] not in eos), None)
        if choice is None:
            choice = "<|pad|>"
            tok.add_special_tokens({"pad_token": choice})
        logger.info("pad token set to %r (EOS ids %s)", choice, eos)
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


def _has_bitsandbytes() -> bool:
    return importlib.util.find_spec("bitsandbytes") is not None


def _quantization_key(quantization_config) -> str:
    """The recipe key that asked for ``quantization_config``: ``load_in_4bit`` or ``load_in_8bit``."""
    return "load_in_8bit" if getattr(quantization_config, "load_in_8bit", False) else "load_in_4bit"


def require_kbit_support(key: str = "load_in_4bit", use_cpu: bool = False) -> None:
    """Check that bitsandbytes and a CUDA GPU are there for a ``key: true`` (``load_in_4bit`` / ``load_in_8bit``) run.

    Raises:
        ValueError: bitsandbytes is not installed, or no CUDA GPU is available (or ``use_cpu`` is set); the message
            names ``key``, everything that is missing and the fix.
    """
    missing = []
    if not _has_bitsandbytes():
        missing.append("the bitsandbytes package (install it: pip install -e '.[qlora]')")
    if use_cpu:
        missing.append("a CUDA GPU (the recipe sets use_cpu: true)")
    elif not torch.cuda.is_available():
        missing.append("a CUDA GPU (torch.cuda.is_available() is False)")
    if missing:
        raise ValueError(
            f"{key}: true needs bitsandbytes and a CUDA GPU; missing here: {'; '.join(missing)}. Run it on a CUDA "
            f"machine with the qlora extra, or set {key}: false (the bf16 LoRA recipes need neither)"
        )


def recipe_quantization_config(model_args, lora: dict[str, bool] | None = None, use_cpu: bool = False):
    """The bitsandbytes config a recipe asks for (TRL's ``ModelConfig``: ``load_in_4bit`` / ``load_in_8bit``,
    ``bnb_4bit_quant_type``, ``use_bnb_nested_quant``, ``bnb_4bit_quant_storage``; the 4-bit compute dtype is
    ``dtype``), built by `trl.get_quantization_config`; None when the recipe quantizes nothing.

    Quantized weights cannot be trained, only LoRA adapters on them (QLoRA), so every switch in ``lora`` (recipe key
    -> value; default ``{"use_peft": model_args.use_peft}``; PPO adds ``value_use_peft``) must be on.

    Raises:
        ValueError: a ``lora`` switch is off; ``load_in_4bit`` with ``dtype: auto``; bitsandbytes or a CUDA GPU is
            missing (`require_kbit_support`). Each message names the recipe key and the fix.
    """
    from trl import get_quantization_config

    if not (model_args.load_in_4bit or model_args.load_in_8bit):
        return None
    key = "load_in_4bit" if model_args.load_in_4bit else "load_in_8bit"
    bits = "4-bit" if model_args.load_in_4bit else "8-bit"
    for switch, on in (lora if lora is not None else {"use_peft": model_args.use_peft}).items():
        if not on:
            what = "the value model is trained too, and " if switch.startswith("value_") else ""
            raise ValueError(
                f"{key}: true needs {switch}: true: {what}{bits} quantized weights cannot be trained, only LoRA "
                f"adapters on them (QLoRA); set {switch}: true, or {key}: false"
            )
    if model_args.load_in_4bit and model_args.dtype == "auto":
        raise ValueError("load_in_4bit: true needs an explicit dtype (bfloat16, float16 or float32): it is the 4-bit "
                         "compute dtype; 'auto' is not one")
    require_kbit_support(key, use_cpu)
    return get_quantization_config(model_args)


def kbit_device_map() -> dict:
    """``{"": local process index}``: each process loads its quantized model whole onto its own GPU (bitsandbytes
    weights are quantized as they load; DDP runs one model copy per GPU)."""
    from accelerate import PartialState

    return {"": PartialState().local_process_index}


def is_quantized(model) -> bool:
    """True for a bitsandbytes 4-bit / 8-bit model, or a peft model on one."""
    base = getattr(model, "get_base_model", lambda: model)()
    return bool(getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False))


def _load_model(kind: str, path: str, dtype, trust_remote_code: bool, allow_pickle: bool, quantization_config=None):
    """Load a causal LM (``kind='causal_lm'``) or a one-label sequence classifier (``'sequence_classifier'``).

    With ``quantization_config`` (a ``BitsAndBytesConfig``) the model is quantized as it loads, onto this process's
    GPU (`kbit_device_map`).
    """
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    _check_remote_code(path, trust_remote_code)
    quant = {}
    if quantization_config is not None:
        require_kbit_support(_quantization_key(quantization_config))
        quant = {"quantization_config": quantization_config, "device_map": kbit_device_map()}
    if trust_remote_code and is_baichuan(path):
        from . import baichuan

        return getattr(baichuan, f"load_{kind}")(path, dtype=dtype, **quant)
    auto, extra = (AutoModelForCausalLM, {}) if kind == "causal_lm" else (AutoModelForSequenceClassification,
                                                                         {"num_labels": 1})
    return auto.from_pretrained(
        path, dtype=dtype, trust_remote_code=trust_remote_code, use_safetensors=None if allow_pickle else True,
        **extra, **quant,
    )


def load_causal_lm(path: str, dtype=None, trust_remote_code: bool = False, allow_pickle: bool = False,
                   quantization_config=None):
    """A causal LM (policy / SFT model); Baichuan remote-code models go through `rlhf_trl.baichuan`.

    Weights load from safetensors only unless ``allow_pickle``. ``quantization_config`` (a ``BitsAndBytesConfig``,
    see `recipe_quantization_config`) quantizes the model as it loads, onto this process's GPU.

    Raises:
        ValueError: a remote-code model without ``trust_remote_code``; ``quantization_config`` without bitsandbytes
            or a CUDA GPU.
    """
    return _load_model("causal_lm", path, dtype, trust_remote_code, allow_pickle, quantization_config)


def load_sequence_classifier(path: str, dtype=None, trust_remote_code: bool = False, allow_pickle: bool = False,
                             quantization_config=None):
    """A ``num_labels=1`` sequence classifier (reward / value model) with a last-token ``score`` head.

    Baichuan remote-code models get `rlhf_trl.baichuan.BaichuanForSequenceClassification`. Weights load from
    safetensors only unless ``allow_pickle``. ``quantization_config`` quantizes the model as it loads (the ``score``
    head, the last module, stays unquantized), onto this process's GPU.

    Raises:
        ValueError: a remote-code model without ``trust_remote_code``; ``quantization_config`` without bitsandbytes
            or a CUDA GPU.
    """
    return _load_model("sequence_classifier", path, dtype, trust_remote_code, allow_pickle, quantization_config)


def resize_for_tokenizer(model, tokenizer) -> None:
    """Grow the embeddings if the tokenizer gained tokens, and record pad / EOS ids on config and generation config.

    The generation config keeps the model's own settings (sampling, and an EOS list such as Qwen2.5-Instruct's
    ``[<|im_end|>, <|endoftext|>]``) so that a saved model deploys as the stock one does; the tokenizer's EOS is
    put first in its EOS list and its pad id becomes the tokenizer's (distinct from every EOS id).
    """
    embeddings = model.get_input_embeddings()
    # num_embeddings: under DeepSpeed ZeRO-3 ``weight`` is this rank's (possibly empty) partition
    rows = getattr(embeddings, "num_embeddings", None) or embeddings.weight.shape[0]
    if len(tokenizer) > rows:
        model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        eos = [tokenizer.eos_token_id] + [i for i in _as_id_list(gen.eos_token_id)
                                          if i not in (tokenizer.eos_token_id, tokenizer.pad_token_id)]
        gen.pad_token_id = tokenizer.pad_token_id
        gen.eos_token_id = eos[0] if len(eos) == 1 else eos


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
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private (0700); the final directory gets the usual mode
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

    A LoRA adapter on a bitsandbytes-quantized base (QLoRA) is not merged into the quantized weights (that would
    round the update away and save a 4-bit model): the base is loaded again unquantized, on the CPU, in the dtype of
    the quantized model's unquantized parts (bf16 in the QLoRA recipes), the adapter is merged into it and that model
    is saved. ``model`` is then returned unchanged (quantized, adapter active: what was trained, on the GPU).

    Returns:
        The merged plain `transformers` model, or ``model`` itself for a quantized base.
    """
    from peft import PeftModel

    if isinstance(model, PeftModel) and is_quantized(model):
        _merge_quantized(model, tokenizer, path)
        return model
    merged = model.merge_and_unload() if isinstance(model, PeftModel) else model
    save_pretrained_atomic(merged, tokenizer, path)
    return merged


def _merge_quantized(model, tokenizer, path: str) -> None:
    """Save ``model``'s adapter, merge it into the unquantized base (CPU) and save that plain model to ``path``."""
    from peft import PeftModel

    config = model.peft_config[model.active_adapter]
    kind = "sequence_classifier" if config.task_type == "SEQ_CLS" else "causal_lm"
    base_path = config.base_model_name_or_path
    dtype = model.get_input_embeddings().weight.dtype  # embeddings are never quantized: the load dtype
    logger.info("QLoRA: merging the adapter into an unquantized %s copy of '%s' (CPU)", dtype, base_path)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        # the stage already loaded (and checked) this base; trust_remote_code only where it is a Baichuan directory
        base = _load_model(kind, base_path, dtype, is_baichuan(base_path), allow_pickle=True)
        resize_for_tokenizer(base, tokenizer)
        merged = PeftModel.from_pretrained(base, tmp).merge_and_unload()
    save_pretrained_atomic(merged, tokenizer, path)


def write_json(path: str, data: dict) -> None:
    """Write JSON atomically (temporary file, then rename)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, indent=2)
    os.replace(tmp, path)


def write_jsonl(path: str, rows) -> None:
    """Write one JSON object per line atomically (temporary file, then rename)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)

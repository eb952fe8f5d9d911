"""Tokenizer, model loading and checkpoint plumbing shared by the stages."""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

import torch

from .atomic import save_pretrained_atomic

logger = logging.getLogger(__name__)

# tried in order for a missing pad token or one that is an EOS id (Qwen Instruct: pad "<|endoftext|>", a second EOS)
PAD_CANDIDATES = ("<|endoftext|>", "<|pad|>", "<pad>", "<|vision_pad|>", "<unk>")

# settings that sample away from softmax(logits / temperature): rollout log-probs, KL and the gradient are then biased
BIASING_GENERATION_KEYS = {
    "min_new_tokens": (None, 0), "min_length": (None, 0), "no_repeat_ngram_size": (None, 0),
    "repetition_penalty": (None, 1.0), "encoder_repetition_penalty": (None, 1.0), "top_k": (None, 0),
    "top_p": (None, 1.0), "typical_p": (None, 1.0), "min_p": (None, 0.0), "epsilon_cutoff": (None, 0.0),
    "eta_cutoff": (None, 0.0), "bad_words_ids": (None,), "suppress_tokens": (None,),
    "begin_suppress_tokens": (None,), "sequence_bias": (None,), "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,), "exponential_decay_length_penalty": (None,), "num_beams": (None, 1)}


def sampling_generation_config(temperature: float, max_new_tokens: int | None, eos_token_ids: list[int],
                               pad_token_id: int, **extra):
    """A ``GenerationConfig`` sampling ``softmax(logits / temperature)`` alone (`BIASING_GENERATION_KEYS` neutral)."""
    from transformers import GenerationConfig

    # min_length is left unset: min_new_tokens=0 takes precedence over it (and setting both makes generate warn)
    neutral = {k: ok[-1] for k, ok in BIASING_GENERATION_KEYS.items() if ok[-1] is not None and k != "min_length"}
    neutral.update(do_sample=True, temperature=temperature, eos_token_id=list(eos_token_ids), pad_token_id=pad_token_id)
    return GenerationConfig(**neutral, max_new_tokens=max_new_tokens, **extra)  # None: the default


class StageInputError(FileNotFoundError):
    """A stage's input (model, tokenizer, previous stage's output) is missing. The message names what to run."""


def require_model_dir(path: str, what: str, produced_by: str | None = None, allow_pickle: bool = False) -> str:
    """``path``: a model directory or hub id. Raises `StageInputError`: unset, missing, incomplete, pickle-only."""
    if not path:
        raise StageInputError(f"{what}: no path is set; name it in the recipe (--config RECIPE.yaml) or with --key DIR")
    if not (path.startswith((".", "/", "~")) or os.path.exists(path) or path.count("/") != 1):
        return path  # hub id, resolved by from_pretrained
    hint = f"; run `{produced_by}` first" if produced_by else ""
    if not os.path.isdir(path):
        raise StageInputError(f"{what} not found at '{path}'{hint}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise StageInputError(f"{what} at '{path}' has no config.json (incomplete or not a model directory){hint}")
    files = os.listdir(path)
    if not any(f.endswith(".safetensors") or f == "model.safetensors.index.json" for f in files):
        if not any(f.endswith((".bin", ".pt", ".pth", ".ckpt")) for f in files):
            raise StageInputError(f"{what} at '{path}' holds no weights (*.safetensors){hint}")
        if not allow_pickle:
            raise StageInputError(f"{what} at '{path}' has only pickle weights (*.bin), which can run code when "
                                  "loaded; convert them to safetensors, or set `allow_pickle_weights: true` in the "
                                  "recipe if you trust the files")
    return path


def _as_id_list(value) -> list[int]:
    return [] if value is None else [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def eos_token_ids(tokenizer, model_dir: str | None = None) -> list[int]:
    """Response-ending token ids: the tokenizer's EOS, then ``model_dir``'s config EOS ids, less the pad id."""
    pad, ids = tokenizer.pad_token_id, _all_eos_ids(tokenizer, model_dir)
    return [i for i in ids if i == ids[0] or i != pad]


def _all_eos_ids(tokenizer, model_dir: str | None) -> list[int]:
    ids = [int(tokenizer.eos_token_id)]
    for name in ("generation_config.json", "config.json") if model_dir else ():  # a model directory's files
        if os.path.isfile(path := os.path.join(model_dir, name)):
            ids += _as_id_list(json.loads(Path(path).read_text(encoding="utf-8")).get("eos_token_id"))
    return list(dict.fromkeys(i for i in ids if 0 <= i < len(tokenizer)))  # in order, without repeats


def load_tokenizer(path: str, pad_token: str | None = None, padding_side: str = "right", trust_remote_code=False):
    """Load a tokenizer whose pad token is no EOS id (`eos_token_ids`): ``pad_token`` if given, else a missing or EOS
    pad becomes the first of `PAD_CANDIDATES` in the vocabulary or an added ``<|pad|>`` (then `resize_for_tokenizer`).
    Raises `StageInputError`: no tokenizer found; `ValueError`: no EOS token, or ``pad_token`` is an EOS id."""
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
    pad_id, eos, vocab = tok.pad_token_id, _all_eos_ids(tok, path), tok.get_vocab()
    if pad_token is not None and vocab.get(pad_token) in eos:
        raise ValueError(f"pad_token {pad_token!r} is an EOS token (EOS ids {eos}); PPO needs them distinct")
    if pad_token is None and (pad_id is None or pad_id in eos):
        pad_token = next((c for c in PAD_CANDIDATES if c in vocab and vocab[c] not in eos), "<|pad|>")
        logger.info("pad token set to %r (EOS ids %s)", pad_token, eos)
    if pad_token is not None:
        if pad_token not in vocab or vocab[pad_token] in eos:  # an EOS id: only the "<|pad|>" fallback
            tok.add_special_tokens({"pad_token": pad_token})
        tok.pad_token = pad_token
    tok.padding_side = padding_side
    return tok


def is_baichuan(path: str) -> bool:
    """True for Baichuan / Baichuan2 remote-code checkpoints (``model_type`` starting with ``baichuan``): the
    ``config.model_type`` of a local model directory or hub id (none if it has no readable config)."""
    if os.path.isfile(local := os.path.join(path, "config.json")):
        kind = json.loads(Path(local).read_text(encoding="utf-8")).get("model_type")
    else:
        from transformers import AutoConfig

        try:
            kind = AutoConfig.from_pretrained(path).model_type
        except (OSError, ValueError):
            kind = None
    return (kind or "").lower().startswith("baichuan")


def _check_remote_code(path: str, trust_remote_code: bool) -> None:
    if is_baichuan(path) and not trust_remote_code:
        raise ValueError(f"'{path}' is a Baichuan remote-code model: set `trust_remote_code: true` in the recipe to "
                         "run its code")
    if trust_remote_code:
        logger.warning("trust_remote_code: the Python code in '%s' will run in this process", path)


def _has_bitsandbytes() -> bool:
    return importlib.util.find_spec("bitsandbytes") is not None


@functools.lru_cache(maxsize=1)
def _bnb_cpu_4bit_problem() -> str | None:
    """None if bitsandbytes' CPU NF4 round trip of a 64 x 64 N(0, 1) tensor stays within 1.0, else why not."""
    try:
        import bitsandbytes
        from bitsandbytes.functional import dequantize_4bit, quantize_4bit

        x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
        packed, state = quantize_4bit(x, blocksize=64, quant_type="nf4")
        err = float((dequantize_4bit(packed, state).float() - x).abs().max())
        if packed.device.type != "cpu" or not err < 1.0:  # also catches NaN
            return f"bitsandbytes {bitsandbytes.__version__} CPU round trip is wrong (max error {err:.3g})"
    except Exception as exc:  # noqa: BLE001 - any failure means "not usable here"; the reason goes into the message
        version = getattr(sys.modules.get("bitsandbytes"), "__version__", "?")
        first = (str(exc).strip().splitlines() or [""])[0][:160]
        return f"bitsandbytes {version} cannot quantize on the CPU: {type(exc).__name__}: {first}"
    return None


def require_kbit_support(key: str = "load_in_4bit", use_cpu: bool = False) -> None:
    """Check that ``key: true`` can quantize here. Raises `ValueError`: one line naming ``key``, what lacks, the fix."""
    if not _has_bitsandbytes():
        raise ValueError(f"{key}: true needs the bitsandbytes package, which is not installed here; install it "
                         f"(pip install -e '.[qlora]'), or set {key}: false")
    if not use_cpu and torch.cuda.is_available():
        return  # CUDA: unchanged, bitsandbytes' CUDA kernels
    where = "the recipe sets use_cpu: true" if use_cpu else "torch.cuda.is_available() is False"
    if key == "load_in_8bit":
        raise ValueError(f"load_in_8bit: true needs a CUDA GPU ({where}); on the CPU only load_in_4bit runs: set "
                         "load_in_4bit: true instead, run on a CUDA machine, or set load_in_8bit: false")
    if (problem := _bnb_cpu_4bit_problem()) is not None:
        raise ValueError(f"load_in_4bit: true on the CPU ({where}) needs a working bitsandbytes CPU backend; "
                         f"{problem}; upgrade it (pip install -U 'bitsandbytes>=0.50'), run on a CUDA machine, or set "
                         "load_in_4bit: false")


def recipe_quantization_config(model_args, lora: dict[str, bool] | None = None, use_cpu: bool = False):
    """The bitsandbytes config of a recipe's ``ModelConfig`` (`trl.get_quantization_config`; compute dtype ``dtype``) or
    None; every ``lora`` switch (recipe key -> value; default ``{"use_peft": model_args.use_peft}``) must be on. Raises
    `ValueError` (key and fix): a switch off, ``load_in_4bit`` with ``dtype: auto``, see `require_kbit_support`."""
    from trl import get_quantization_config

    if not (model_args.load_in_4bit or model_args.load_in_8bit):
        return None
    key, bits = ("load_in_4bit", "4-bit") if model_args.load_in_4bit else ("load_in_8bit", "8-bit")
    for switch, on in (lora if lora is not None else {"use_peft": model_args.use_peft}).items():
        if not on:
            what = "the value model is trained too, and " if switch.startswith("value_") else ""
            raise ValueError(f"{key}: true needs {switch}: true: {what}{bits} quantized weights cannot be trained, "
                             f"only LoRA adapters on them (QLoRA); set {switch}: true, or {key}: false")
    if model_args.load_in_4bit and model_args.dtype == "auto":
        raise ValueError("load_in_4bit: true needs an explicit dtype (bfloat16, float16 or float32): it is the 4-bit "
                         "compute dtype; 'auto' is not one")
    require_kbit_support(key, use_cpu)
    return get_quantization_config(model_args)


def kbit_device_map() -> dict:
    """Where this process loads a quantized model whole: ``{"": local process index}`` (its GPU), or ``{"": "cpu"}``."""
    from accelerate import PartialState

    return {"": "cpu" if (state := PartialState()).device.type == "cpu" else state.local_process_index}


def fp32_adapters_for_fp32_compute(model, quantization_config) -> int:
    """Cast a QLoRA model's trainable parameters to fp32 if it computes in fp32 (TRL made them bf16); returns count."""
    if quantization_config is None or getattr(quantization_config, "bnb_4bit_compute_dtype", None) != torch.float32:
        return 0
    cast = [p for p in model.parameters() if p.requires_grad and p.dtype != torch.float32]
    for param in cast:
        param.data = param.data.to(torch.float32)
    return len(cast)


def is_quantized(model) -> bool:
    """True for a bitsandbytes 4-bit / 8-bit model, or a peft model on one."""
    base = getattr(model, "get_base_model", lambda: model)()
    return bool(getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False))


def _load_model(kind: str, path: str, dtype, trust_remote_code: bool, allow_pickle: bool, quantization_config=None):
    """Load a causal LM (``kind='causal_lm'``) or a one-label sequence classifier (``'sequence_classifier'``)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    _check_remote_code(path, trust_remote_code)
    quant = {}
    if quantization_config is not None:
        device_map = kbit_device_map()
        key = "load_in_8bit" if getattr(quantization_config, "load_in_8bit", False) else "load_in_4bit"
        require_kbit_support(key, use_cpu=device_map[""] == "cpu")
        quant = {"quantization_config": quantization_config, "device_map": device_map}
    if trust_remote_code and is_baichuan(path):
        from . import baichuan

        model = getattr(baichuan, f"load_{kind}")(path, dtype=dtype, **quant)
    else:
        auto, extra = (AutoModelForCausalLM, {}) if kind == "causal_lm" else (AutoModelForSequenceClassification,
                                                                             {"num_labels": 1})
        model = auto.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code,
                                     use_safetensors=None if allow_pickle else True, **extra, **quant)
    if quant and quant["device_map"][""] == "cpu":
        # On AVX512-BF16 CPUs bitsandbytes repacks a Linear4bit weight for a fused kernel the first time it runs in
        # eval mode without gradients (a rollout), and a later training forward then fails: keep the standard layout
        for module in model.modules():
            if getattr(module, "support_avx512bf16_for_cpu", False):
                module.support_avx512bf16_for_cpu = False
    return model


def load_causal_lm(path: str, dtype=None, trust_remote_code: bool = False, allow_pickle: bool = False,
                   quantization_config=None):
    """A causal LM, safetensors unless ``allow_pickle``. Raises `ValueError`: remote code, no ``trust_remote_code``;
    `StageInputError`: ``path`` holds a sequence classifier (a reward or value model), whose LM head would be random."""
    config = os.path.join(path, "config.json")
    kinds = json.loads(Path(config).read_text(encoding="utf-8")).get("architectures") if os.path.isfile(config) else 0
    if kinds and all(k.endswith("ForSequenceClassification") for k in kinds):
        raise StageInputError(f"'{path}' is a {kinds[0]} (a reward or value model), not a causal LM; give a policy "
                              "(a stage's merged/, or a base model)")
    return _load_model("causal_lm", path, dtype, trust_remote_code, allow_pickle, quantization_config)


def load_sequence_classifier(path: str, dtype=None, trust_remote_code: bool = False, allow_pickle: bool = False,
                             quantization_config=None):
    """A ``num_labels=1`` classifier (reward / value model; ``score`` head unquantized), loaded as `load_causal_lm`."""
    return _load_model("sequence_classifier", path, dtype, trust_remote_code, allow_pickle, quantization_config)


def resize_for_tokenizer(model, tokenizer) -> None:
    """Grow the embeddings for added tokens; set pad / EOS ids on config and generation config (other EOS ids kept)."""
    embeddings = model.get_input_embeddings()
    # num_embeddings: under DeepSpeed ZeRO-3 ``weight`` is this rank's (possibly empty) partition
    if len(tokenizer) > (getattr(embeddings, "num_embeddings", None) or embeddings.weight.shape[0]):
        model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id, model.config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    if (gen := getattr(model, "generation_config", None)) is not None:
        eos = [tokenizer.eos_token_id] + [i for i in _as_id_list(gen.eos_token_id)
                                          if i not in (tokenizer.eos_token_id, tokenizer.pad_token_id)]
        gen.pad_token_id, gen.eos_token_id = tokenizer.pad_token_id, eos[0] if len(eos) == 1 else eos


def torch_dtype(name: str | None):
    """Map a recipe dtype string ('float32', 'bfloat16', 'auto', None) to what from_pretrained takes."""
    return name if name in (None, "auto") else getattr(torch, name)


def merge_and_save(model, tokenizer, path: str, tensors: dict[str, dict] | None = None):
    """Merge LoRA adapters (SEQ_CLS: with ``score``) into the base and save the plain model (with ``tensors``,
    `save_pretrained_atomic`). Returns it (merged in place), or a QLoRA ``model`` itself (its adapter merged into the
    base reloaded unquantized on CPU)."""
    from peft import PeftModel

    if not (isinstance(model, PeftModel) and is_quantized(model)):
        merged = model.merge_and_unload() if isinstance(model, PeftModel) else model
        save_pretrained_atomic(merged, tokenizer, path, tensors=tensors)
        return merged
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
    save_pretrained_atomic(merged, tokenizer, path, tensors=tensors)
    return model


def peak_memory_mb() -> float:
    """This process's peak memory (MiB): CUDA's peak allocated bytes if in use, else peak RSS (``getrusage``)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024



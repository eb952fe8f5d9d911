"""Baichuan / Baichuan2 remote-code models made usable by TRL on transformers 5 (SFT, reward model, PPO), used by
`rlhf_trl.models` for ``trust_remote_code: true`` and ``model_type: baichuan``. The tokenizer loads its sentencepiece
model before the remote ``__init__`` reads it (`load_tokenizer`). ``position_ids`` (and other keywords the remote
forwards do not name) are dropped: positions come from the cache length, and rotary (7B) / ALiBi (13B) depend only on
token distance with pads masked, so left padding is harmless. `load_causal_lm` adds `transformers.GenerationMixin`
(driving the remote legacy tuple KV cache); `BaichuanForSequenceClassification` serves TRL's reward and value models.
Saving copies the remote ``*.py`` files and keeps ``auto_map`` / ``model_type``. LoRA targets: ``W_pack`` (fused
q/k/v), ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj`` (``SEQ_CLS`` also trains and saves ``score``)."""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import json
import logging
import os
import shutil
from pathlib import Path

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.dynamic_module_utils import get_class_from_dynamic_module
from transformers.modeling_outputs import SequenceClassifierOutputWithPast

logger = logging.getLogger(__name__)

CONFIG_REF = "configuration_baichuan.BaichuanConfig"
CAUSAL_LM_REF = "modeling_baichuan.BaichuanForCausalLM"
TOKENIZER_REF = "tokenization_baichuan.BaichuanTokenizer"
CLASSIFIER_ARCH = "BaichuanForSequenceClassification"

# keywords TRL / peft / transformers pass that the remote forwards lack: dropped silently (as private ``_*`` ones are)
_SILENTLY_DROPPED = frozenset({"position_ids", "cache_position", "logits_to_keep", "num_items_in_batch"})
_WARNED: set[tuple[str, str]] = set()  # (owner, keyword) of the dropped keywords already logged: once each


def _remote_class(path: str, key: str, default: str, config_file: str = "config.json"):
    """Import ``module.Class`` from the remote-code files in the local directory ``path``: ``auto_map[key]`` of
    ``path``'s config file as ``module.Class`` (Baichuan-7B v1 says ``BaiChuan...``), else ``default``."""
    try:
        ref = (json.loads(Path(path, config_file).read_text(encoding="utf-8")).get("auto_map") or {}).get(key)
    except (OSError, ValueError):
        ref = None
    if isinstance(ref, (list, tuple)):  # AutoTokenizer: [slow, fast]
        ref = next((r for r in ref if r), None)
    ref = ref.split("--")[-1] if isinstance(ref, str) and ref else default  # "org/repo--mod.Class" -> "mod.Class"
    if not os.path.isfile(os.path.join(path, (module := ref.split(".")[0]) + ".py")):
        raise FileNotFoundError(f"'{path}' has no {module}.py (Baichuan remote code)")
    return get_class_from_dynamic_module(ref, path)


def _new_instance(factory, args):
    """Unpickling helper: an empty instance of ``factory(*args)`` (a class built at runtime by this module)."""
    cls = factory(*args)
    return cls.__new__(cls)


def _pickled_as(factory, *args):
    """A ``__reduce__`` that unpickles an instance of ``factory(*args)`` through `_new_instance`, then its state."""
    return lambda self: (_new_instance, (factory, args), self.__getstate__())


def _code_files(directory: str) -> list[str]:
    """The top-level remote-code ``*.py`` files of a model directory or a dynamic-module cache directory."""
    return sorted(str(f) for f in Path(directory).glob("*.py") if f.name != "__init__.py") if directory else []


def _copy_code(sources: list[str], save_directory: str) -> None:
    for src in sources:
        if not os.path.exists(dst := os.path.join(save_directory, os.path.basename(src))):
            shutil.copyfile(src, dst)


def _update_json(path: str, update) -> None:
    """Apply ``update(data)`` to the JSON file ``path`` in place (nothing when it does not exist)."""
    if not os.path.isfile(path):
        return
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    update(data)
    Path(path).write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def _named_parameters(forward) -> frozenset:
    """Names of the parameters of ``forward`` that can be passed by keyword (not ``**kwargs``)."""
    params = inspect.signature(forward).parameters.values()
    return frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def _legacy_past(past, cache):
    """The legacy tuple cache out of ``past_key_values`` / ``cache`` (transformers 5's name); None when empty."""
    past = past if past is not None else cache
    if isinstance(past, Cache) and past.get_seq_length() > 0:
        raise ValueError("Baichuan remote code reads a legacy tuple KV cache, not a transformers Cache object; "
                         "generate with rlhf_trl.baichuan.load_causal_lm models (they manage the tuple cache)")
    return None if isinstance(past, Cache) or (isinstance(past, (tuple, list)) and len(past) == 0) else past


def _filter_kwargs(owner: str, named: frozenset, kwargs: dict) -> dict:
    """Keep the keywords the remote forward names; drop the others (logged once unless they are expected ones). The KV
    cache (``past_key_values`` / ``cache``) is passed on as ``past_key_values`` in its legacy form (`_legacy_past`)."""
    if (past := _legacy_past(kwargs.pop("past_key_values", None), kwargs.pop("cache", None))) is not None:
        kwargs["past_key_values"] = past
    for key, value in kwargs.items():
        if key in named or key in _SILENTLY_DROPPED or key.startswith("_") or value is None or (owner, key) in _WARNED:
            continue
        _WARNED.add((owner, key))
        logger.warning("%s: keyword %r is not an argument of the Baichuan remote forward; ignored", owner, key)
    return {key: value for key, value in kwargs.items() if key in named}


@functools.lru_cache(maxsize=None)
def _tolerant_backbone_class(backbone_cls: type) -> type:
    """The remote ``BaichuanModel`` subclassed (same name) to drop ``position_ids`` and friends that TRL passes it."""
    named = _named_parameters(backbone_cls.forward)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
        kwargs["return_dict"] = True if kwargs.get("return_dict") is None else kwargs["return_dict"]
        kwargs = _filter_kwargs(backbone_cls.__name__, named, kwargs)
        return backbone_cls.forward(self, input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    return type(backbone_cls.__name__, (backbone_cls,), {
        "forward": forward, "__reduce__": _pickled_as(_tolerant_backbone_class, backbone_cls),
        "_rlhf_trl_remote": backbone_cls, "__module__": backbone_cls.__module__})


@functools.lru_cache(maxsize=None)
def _fixed_tokenizer_class(remote_cls: type) -> type:
    """The remote ``BaichuanTokenizer`` subclassed to load its sentencepiece model before the remote ``__init__``."""

    def __init__(self, vocab_file, *args, sp_model_kwargs=None, **kwargs):
        import sentencepiece as spm

        self.vocab_file, self.sp_model_kwargs = vocab_file, {} if sp_model_kwargs is None else sp_model_kwargs
        self.sp_model = spm.SentencePieceProcessor(model_file=vocab_file, **self.sp_model_kwargs)
        remote_cls.__init__(self, vocab_file, *args, sp_model_kwargs=sp_model_kwargs, **kwargs)

    def save_pretrained(self, save_directory, *args, **kwargs):
        files = remote_cls.save_pretrained(self, save_directory, *args, **kwargs)
        _copy_code([inspect.getfile(remote_cls)], save_directory)

        def update(data):
            module = os.path.splitext(os.path.basename(inspect.getfile(remote_cls)))[0]
            data.setdefault("auto_map", {})["AutoTokenizer"] = [f"{module}.{remote_cls.__name__}", None]
            data["tokenizer_class"] = remote_cls.__name__
            # transformers 5 leaves these out; the remote defaults (add_bos_token=True) would then differ on reload
            data.update({k: v for k in ("add_bos_token", "add_eos_token")
                         if isinstance(v := getattr(self, k, None), bool)})

        _update_json(os.path.join(save_directory, "tokenizer_config.json"), update)
        return files

    return type(remote_cls.__name__, (remote_cls,), {
        "__init__": __init__, "save_pretrained": save_pretrained,
        "__reduce__": _pickled_as(_fixed_tokenizer_class, remote_cls), "__module__": remote_cls.__module__})


def load_tokenizer(path: str):
    """The remote ``BaichuanTokenizer`` of ``path``. Raises `ValueError`: no EOS; `OSError`: no remote code / model."""
    remote = _remote_class(path, "AutoTokenizer", TOKENIZER_REF, "tokenizer_config.json")
    if not os.path.isfile(os.path.join(path, "tokenizer.model")):
        raise OSError(f"'{path}' has no tokenizer.model (Baichuan sentencepiece model)")
    tok = _fixed_tokenizer_class(remote).from_pretrained(path)
    if tok.eos_token_id is None or tok.eos_token_id == tok.unk_token_id:
        if "</s>" not in tok.get_vocab():
            raise ValueError(f"Baichuan tokenizer at '{path}' has no EOS token")
        tok.eos_token = "</s>"
    return tok


class _KeepsRemoteCode:
    """Loading records where the remote code came from; saving copies it (and ``auto_map``) next to the weights."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        loaded = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        path = pretrained_model_name_or_path
        if isinstance(path, (str, os.PathLike)) and os.path.isdir(path):  # its *.py files are saved with the model
            (loaded[0] if isinstance(loaded, tuple) else loaded)._baichuan_code_dir = os.path.abspath(path)
        return loaded

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Then copy the remote ``*.py`` next to the weights; keep ``auto_map`` / ``model_type`` in ``config.json``."""
        result = super().save_pretrained(save_directory, *args, **kwargs)
        if not (files := _code_files(getattr(self, "_baichuan_code_dir", None))):
            # the remote backbone's module (our tolerant subclass keeps its __module__) holds the model classes
            dirs = {os.path.dirname(inspect.getfile(c)) for c in (type(self.config), type(self.model))}
            files = [f for d in sorted(dirs) for f in _code_files(d)]
        _copy_code(files, save_directory)
        auto_map = dict(getattr(self.config, "auto_map", None) or {})
        auto_map.setdefault("AutoConfig", CONFIG_REF)
        auto_map.setdefault("AutoModelForCausalLM", CAUSAL_LM_REF)
        _update_json(os.path.join(save_directory, "config.json"),
                     lambda data: data.update(auto_map=auto_map, model_type=self.config.model_type))
        return result


class _BaichuanCausalLMAdapter(_KeepsRemoteCode):
    """Mixed in before the remote ``BaichuanForCausalLM`` (and `GenerationMixin` after it) by `_causal_lm_class`."""

    accepts_loss_kwargs = False  # the remote loss is a mean over tokens: let Trainer scale for accumulation
    _rlhf_trl_remote_named: frozenset = frozenset()  # the keywords the remote BaichuanForCausalLM's forward names

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.model.__class__ = _tolerant_backbone_class(type(self.model))

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the remote code keeps a tuple cache; generate must not hand it a DynamicCache

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, **kwargs):
        """The remote forward, minus ``position_ids`` (relative position encodings: see the module docstring)."""
        kwargs = _filter_kwargs("BaichuanForCausalLM", self._rlhf_trl_remote_named,
                                kwargs | {"past_key_values": past_key_values})
        for key in ("output_attentions", "output_hidden_states", "return_dict"):
            if key in kwargs and kwargs[key] is None:
                del kwargs[key]  # keep the remote defaults (False / False / True)
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, cache=None, attention_mask=None,
                                      inputs_embeds=None, is_first_iteration=False, **kwargs):
        """Feed only the tokens the legacy tuple cache has not seen (all of them on the first step)."""
        if (past := _legacy_past(kwargs.pop("past_key_values", None), cache)) is not None:
            input_ids = input_ids[:, past[0][0].shape[2]:]
        use_embeds = inputs_embeds is not None and past is None
        out = {"inputs_embeds": inputs_embeds} if use_embeds else {"input_ids": input_ids}
        out.update(past_key_values=past, attention_mask=attention_mask, use_cache=kwargs.get("use_cache", True))
        return out | {k: kwargs[k] for k in ("output_attentions", "output_hidden_states") if kwargs.get(k) is not None}

    def _get_resized_lm_head(self, old_lm_head, new_num_tokens=None, transposed=False, mean_resizing=True):
        """Resize Baichuan2's ``NormHead`` (no ``nn.Linear``) in a copy, new rows the mean of the old ones."""
        if isinstance(old_lm_head, nn.Linear) or new_num_tokens is None:
            return super()._get_resized_lm_head(old_lm_head, new_num_tokens, transposed, mean_resizing)
        old = old_lm_head.weight
        if new_num_tokens == old.shape[0]:
            return old_lm_head
        with torch.no_grad():  # the old rows (cut when shrinking), then the new ones
            mean = old.mean(dim=0, keepdim=True).expand(max(new_num_tokens - old.shape[0], 0), -1)
            new = torch.cat((old[:new_num_tokens], mean))
        head = copy.deepcopy(old_lm_head)
        head.weight = nn.Parameter(new, requires_grad=old.requires_grad)
        return head

    def _reorder_cache(self, past_key_values, beam_idx):
        return tuple(tuple(s.index_select(0, beam_idx.to(s.device)) for s in layer) for layer in past_key_values)


@functools.lru_cache(maxsize=None)
def _causal_lm_class(remote_cls: type) -> type:
    return type(remote_cls.__name__, (_BaichuanCausalLMAdapter, remote_cls, GenerationMixin), {
        "_rlhf_trl_remote_named": _named_parameters(remote_cls.forward),
        "__reduce__": _pickled_as(_causal_lm_class, remote_cls), "__module__": remote_cls.__module__})


def load_causal_lm(path: str, dtype=None, **kwargs):
    """The Baichuan causal LM of ``path``, subclassed (same name) to take ``position_ids``, generate, save its code: the
    TRL-ready subclass of the remote ``BaichuanForCausalLM`` in ``path``."""
    remote = _remote_class(path, "AutoModelForCausalLM", CAUSAL_LM_REF)
    return _causal_lm_class(remote).from_pretrained(path, dtype=dtype, **kwargs)


class BaichuanForSequenceClassification(_KeepsRemoteCode, PreTrainedModel):
    """Baichuan backbone + ``score`` = Linear(hidden, 1, bias=False) at each row's last non-pad token."""

    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    accepts_loss_kwargs = False
    _no_split_modules = ["DecoderLayer"]
    _keys_to_ignore_on_load_unexpected = [r"^lm_head\.", r"decoder\.version"]
    _backbone_class: type | None = None

    def __init__(self, config):
        config.num_labels = 1
        super().__init__(config)
        self.model = _tolerant_backbone_class(self._backbone_class or _backbone_class_next_to(config))(config)
        self.score = nn.Linear(config.hidden_size, 1, bias=False)
        self.post_init()

    def _init_weights(self, module):
        self.model._init_weights(module)  # the remote code's own initialization (normal(0, initializer_range))

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                use_cache=None, output_attentions=None, output_hidden_states=None, return_dict=None, **kwargs):
        """``logits [batch, 1]`` at each row's last non-pad token; with ``labels [batch]`` an MSE ``loss``; no cache."""
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                             use_cache=False, output_attentions=bool(output_attentions),
                             output_hidden_states=bool(output_hidden_states), return_dict=True)
        hidden = outputs.last_hidden_state
        logits, batch = self.score(hidden), hidden.shape[0]  # logits: [batch, seq_len, 1]
        last = self.last_token_index(input_ids, hidden.shape[1], hidden.device, batch)
        pooled = logits[torch.arange(batch, device=hidden.device), last]  # [batch, 1]
        loss = None if labels is None else nn.functional.mse_loss(pooled.squeeze(-1).float(),
                                                                   labels.to(pooled.device).float().view(-1))
        if return_dict is False:
            out = (pooled,) + ((outputs.hidden_states,) if output_hidden_states else ())
            return ((loss,) + out) if loss is not None else out
        return SequenceClassifierOutputWithPast(loss=loss, logits=pooled, hidden_states=outputs.hidden_states,
                                                attentions=outputs.attentions)

    def last_token_index(self, input_ids, seq_len: int, device, batch: int) -> torch.Tensor:
        """Index of each row's last non-pad token (``[batch]``); right or left padding."""
        pad = self.config.pad_token_id
        if input_ids is None or pad is None:
            return torch.full((batch,), seq_len - 1, dtype=torch.long, device=device)
        return (torch.arange(seq_len, device=device) * (input_ids != pad).to(device)).argmax(dim=-1)


def _backbone_class_of(causal_cls: type, config) -> type:
    """The remote backbone class (``BaichuanModel``; 7B v1: ``Model``) of a remote causal LM class, built (adapted) on
    the meta device."""
    with torch.device("meta"):
        skeleton = _causal_lm_class(causal_cls)(copy.deepcopy(config))
    return type(skeleton.model)._rlhf_trl_remote  # the remote class, not the tolerant subclass the adapter made it


def _backbone_class_next_to(config) -> type:
    """Backbone class of a loaded model's remote ``config``. Raises `TypeError`: no remote model code next to it."""
    ref = (getattr(config, "auto_map", None) or {}).get("AutoModelForCausalLM", CAUSAL_LM_REF).split("--")[-1]
    module_name, cls_name = ref.rsplit(".", 1)
    package = type(config).__module__.rsplit(".", 1)[0]
    try:
        causal_cls = getattr(importlib.import_module(f"{package}.{module_name}"), cls_name)
    except (ImportError, AttributeError):
        raise TypeError("BaichuanForSequenceClassification(config) needs the remote Baichuan model code next to the "
                        "config's module: use rlhf_trl.baichuan.classifier_class(path)(config) or "
                        "load_sequence_classifier(path)") from None
    return _backbone_class_of(causal_cls, config)


@functools.lru_cache(maxsize=None)
def _classifier_class(config_cls: type, backbone_cls: type) -> type:
    return type(CLASSIFIER_ARCH, (BaichuanForSequenceClassification,), {
        "config_class": config_cls, "_backbone_class": backbone_cls, "__module__": __name__,
        "__reduce__": _pickled_as(_classifier_class, config_cls, backbone_cls)})  # the base class pickles as itself


def classifier_class(path: str) -> type:
    """`BaichuanForSequenceClassification` bound to the remote config and backbone classes of ``path``."""
    config_cls = _remote_class(path, "AutoConfig", CONFIG_REF)
    causal_cls = _remote_class(path, "AutoModelForCausalLM", CAUSAL_LM_REF)
    return _classifier_class(config_cls, _backbone_class_of(causal_cls, config_cls.from_pretrained(path)))


def load_sequence_classifier(path: str, dtype=None, **kwargs):
    """A `BaichuanForSequenceClassification` of ``path``. Raises `ValueError`: weights but ``score.weight`` missing."""
    cls = classifier_class(path)
    model, info = cls.from_pretrained(path, dtype=dtype, num_labels=1, output_loading_info=True, **kwargs)
    missing = set(info.get("missing_keys") or ())
    if missing - {"score.weight"}:
        raise ValueError(f"Baichuan classifier at '{path}': weights missing: {sorted(missing)}")
    if "score.weight" in missing:
        logger.info("Baichuan classifier from the causal LM at '%s': score head newly initialized", path)
    return model

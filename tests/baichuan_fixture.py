"""A tiny Baichuan2-style remote-code checkpoint for the tests, written into a directory like a hub download.

``write_tiny_baichuan(dir)`` writes:

- ``configuration_baichuan.py``, ``modeling_baichuan.py``, ``tokenization_baichuan.py``: copied from
  ``tests/fixtures/baichuan/``; they mirror the real Baichuan2-7B remote code (module names, forward signatures
  without ``position_ids``, no ``GenerationMixin``, legacy tuple KV cache, and the tokenizer's init-order bug);
- ``config.json`` (``model_type: baichuan``, ``architectures: [BaichuanForCausalLM]``, ``auto_map``),
  ``generation_config.json``, ``tokenizer_config.json`` (``auto_map`` to the remote tokenizer, pad ``<unk>``),
  ``special_tokens_map.json``;
- ``tokenizer.model``: a byte-fallback sentencepiece BPE model trained here on generated Chinese / English lines
  (unk 0, bos 1, eos 2, like Baichuan's);
- ``model.safetensors``: random-init weights of the fixture's own ``BaichuanForCausalLM``.
"""

from __future__ import annotations

import json
import os
import random
import shutil

FIXTURE_CODE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "baichuan")
CODE_FILES = ("configuration_baichuan.py", "modeling_baichuan.py", "tokenization_baichuan.py")

TOPICS_ZH = ["咖啡", "茶", "海边", "山", "电影", "音乐", "火锅", "烤鸭", "花园", "图书馆", "地铁", "雨天"]
TOPICS_EN = ["coffee", "tea", "the beach", "mountains", "movies", "music", "hot pot", "gardens", "the library"]
GOOD_ZH = ["很棒，我很喜欢。", "非常好，推荐给大家。", "让人开心。"]
BAD_ZH = ["很糟糕，我很讨厌。", "太差了，再也不想碰了。", "让人难过。"]


def corpus(n: int = 600, seed: int = 0) -> list[str]:
    """Generated Chinese / English lines in the project's prompt template, for the sentencepiece model."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        if rng.random() < 0.7:
            t = rng.choice(TOPICS_ZH)
            q = rng.choice([f"你觉得{t}怎么样？", f"你喜欢{t}吗？", f"请评价一下{t}。", f"说说你对{t}的看法。"])
            a = t + rng.choice(GOOD_ZH + BAD_ZH)
            lines.append(f"问：{q}\n\n答：{a}")
        else:
            t = rng.choice(TOPICS_EN)
            q = rng.choice([f"What do you think of {t}?", f"Do you like {t}?", f"Tell me about {t}."])
            a = rng.choice([f"I really like {t}.", f"{t} is great fun.", f"I do not enjoy {t} at all."])
            lines.append(f"问：{q}\n\n答：{a}")
    return lines


def train_sentencepiece(path_prefix: str, vocab_size: int = 400, seed: int = 0) -> str:
    """Train a byte-fallback BPE sentencepiece model (unk 0, bos 1, eos 2, no pad piece); returns the .model path."""
    import sentencepiece as spm

    text = path_prefix + ".txt"
    with open(text, "w", encoding="utf-8") as f:
        for line in corpus(seed=seed):
            f.write(line.replace("\n", " ") + "\n")
    spm.SentencePieceTrainer.train(
        input=text,
        model_prefix=path_prefix,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        split_digits=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        hard_vocab_limit=False,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        num_threads=1,
        minloglevel=2,
    )
    os.remove(text)
    return path_prefix + ".model"


def write_tiny_baichuan(
    path: str,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    vocab_size: int = 400,
    seed: int = 0,
) -> str:
    """Write a tiny random-init Baichuan2-style remote-code checkpoint into ``path`` (created); returns ``path``."""
    import torch
    from safetensors.torch import save_file
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    os.makedirs(path, exist_ok=True)
    for name in CODE_FILES:
        shutil.copyfile(os.path.join(FIXTURE_CODE, name), os.path.join(path, name))

    sp_prefix = os.path.join(path, "tokenizer")
    train_sentencepiece(sp_prefix, vocab_size=vocab_size, seed=seed)
    os.remove(sp_prefix + ".vocab")
    import sentencepiece as spm

    n_pieces = spm.SentencePieceProcessor(model_file=sp_prefix + ".model").get_piece_size()

    config = {
        "architectures": ["BaichuanForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_baichuan.BaichuanConfig",
            "AutoModelForCausalLM": "modeling_baichuan.BaichuanForCausalLM",
        },
        "model_type": "baichuan",
        "vocab_size": n_pieces,
        "hidden_size": hidden_size,
        "intermediate_size": hidden_size * 2,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": 256,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "use_cache": True,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "z_loss_weight": 0,
        "torch_dtype": "float32",
    }
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(path, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "max_new_tokens": 64}, f, indent=2)
    tok_config = {
        "auto_map": {"AutoTokenizer": ["tokenization_baichuan.BaichuanTokenizer", None]},
        "tokenizer_class": "BaichuanTokenizer",
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False, "normalized": True,
                      "rstrip": False, "single_word": False},
        "eos_token": {"__type": "AddedToken", "content": "</s>", "lstrip": False, "normalized": True,
                      "rstrip": False, "single_word": False},
        "pad_token": {"__type": "AddedToken", "content": "<unk>", "lstrip": False, "normalized": True,
                      "rstrip": False, "single_word": False},
        "unk_token": {"__type": "AddedToken", "content": "<unk>", "lstrip": False, "normalized": True,
                      "rstrip": False, "single_word": False},
        "clean_up_tokenization_spaces": False,
        "model_max_length": 256,
        "sp_model_kwargs": {},
        "use_fast": False,
    }
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tok_config, f, indent=2)
    with open(os.path.join(path, "special_tokens_map.json"), "w", encoding="utf-8") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<unk>", "unk_token": "<unk>"}, f, indent=2)

    config_cls = get_class_from_dynamic_module("configuration_baichuan.BaichuanConfig", path)
    model_cls = get_class_from_dynamic_module("modeling_baichuan.BaichuanForCausalLM", path)
    torch.manual_seed(seed)
    model = model_cls(config_cls.from_pretrained(path))
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path

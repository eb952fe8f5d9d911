"""Small random-init models for the demo, tests and offline runs: ``rlhf-trl init-model --tokenizer DIR --output DIR
[--hidden_size 64 --num_layers 2]`` saves a Qwen2 causal LM with the tokenizer's vocabulary, and the tokenizer."""

from __future__ import annotations

import argparse
import logging
import os

from .atomic import save_pretrained_atomic
from .models import load_tokenizer

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]


def train_bpe_tokenizer(texts: list[str], output_dir: str, vocab_size: int = 1000):
    """Train and save a byte-level BPE tokenizer on ``texts`` (EOS ``<|endoftext|>``, pad ``<|pad|>``); returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>",
                            additional_special_tokens=["<|im_start|>", "<|im_end|>"],
                            clean_up_tokenization_spaces=False).save_pretrained(output_dir)
    return load_tokenizer(output_dir)


def build_tiny_qwen2(tokenizer, output_dir: str, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                     intermediate_size: int | None = None, max_position_embeddings: int = 512, seed: int = 0,
                     **config_overrides):
    """A random-init `Qwen2ForCausalLM` sized to ``tokenizer``, saved with it. Raises `ValueError`: too few tokens."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    fields = dict(vocab_size=len(tokenizer), hidden_size=hidden_size,
                  intermediate_size=intermediate_size or 4 * hidden_size, num_hidden_layers=num_layers,
                  num_attention_heads=num_heads, num_key_value_heads=max(1, num_heads // 2),
                  max_position_embeddings=max_position_embeddings, tie_word_embeddings=True, bos_token_id=None,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id) | config_overrides
    if fields["vocab_size"] < len(tokenizer):
        raise ValueError(f"vocab_size {fields['vocab_size']} is smaller than the tokenizer's {len(tokenizer)}")
    model = Qwen2ForCausalLM(Qwen2Config(**fields))
    model.generation_config.update(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    save_pretrained_atomic(model, tokenizer, output_dir)
    logger.info("built %s (%.2fM parameters) at %s", type(model).__name__, model.num_parameters() / 1e6, output_dir)
    return model


def main(argv: list[str] | None = None) -> dict:
    """``rlhf-trl init-model``: a random-init Qwen2 with the vocabulary of an existing tokenizer directory."""
    p = argparse.ArgumentParser(prog="rlhf-trl init-model", description=__doc__)
    p.add_argument("--tokenizer", required=True, help="tokenizer directory (e.g. ../shared/tokenizers/qwen2)")
    p.add_argument("--output", required=True, help="where to save the model and tokenizer")
    for name, default in (("hidden_size", 64), ("num_layers", 2), ("num_heads", 4), ("seed", 0)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--force", action="store_true", help="rebuild even if --output already holds a model")
    args = p.parse_args(argv)
    if os.path.isfile(os.path.join(args.output, "config.json")) and not args.force:
        logger.info("%s already holds a model; keeping it (--force to rebuild)", args.output)
        return {"output_dir": args.output}
    tokenizer = load_tokenizer(args.tokenizer)
    model = build_tiny_qwen2(tokenizer, args.output, args.hidden_size, args.num_layers, args.num_heads, seed=args.seed)
    return {"output_dir": args.output, "metrics": {"parameters": model.num_parameters()}}

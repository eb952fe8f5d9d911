"""EOS lists (Qwen2.5-Instruct: [<|im_end|>, <|endoftext|>], the second also the stock pad token) in every stage.
The cut at the first EOS of any id (`scoring.truncate_at_eos`, `scoring.sample`) is in test_scoring.py."""

import contextlib
import json
import os
import shutil

import pytest
import torch

from conftest import RECIPES, SHARED

from rlhf_trl.models import eos_token_ids, load_tokenizer, resize_for_tokenizer, sampling_generation_config


@pytest.fixture
def instruct_dir(tmp_path):
    """The real Qwen2 tokenizer with a stock Instruct generation_config.json beside it (no weights needed)."""
    src = SHARED / "tokenizers" / "qwen2"
    if not src.is_dir():
        pytest.skip(f"needs the real Qwen2 tokenizer at {src} (../shared beside the project)")
    shutil.copytree(src, tmp_path / "m")
    json.dump({"bos_token_id": 151643, "pad_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
               "repetition_penalty": 1.1, "temperature": 0.7, "top_p": 0.8, "top_k": 20},
              open(tmp_path / "m" / "generation_config.json", "w"))
    return str(tmp_path / "m")


def test_pad_token_differs_from_every_eos_id(instruct_dir):
    tok = load_tokenizer(instruct_dir)
    assert tok.eos_token == "<|im_end|>" and eos_token_ids(tok, instruct_dir) == [151645, 151643]
    assert tok.pad_token_id not in (151645, 151643)
    with pytest.raises(ValueError, match=r"pad_token '<\|endoftext\|>' is an EOS token \(EOS ids \[151645, 151643\]\)"):
        load_tokenizer(instruct_dir, pad_token="<|endoftext|>")


def test_resize_keeps_the_stock_generation_settings_and_eos_list(instruct_dir):
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tok = load_tokenizer(instruct_dir)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    model.generation_config = GenerationConfig.from_pretrained(instruct_dir)
    resize_for_tokenizer(model, tok)
    gen = model.generation_config
    assert gen.eos_token_id == [151645, 151643] and gen.pad_token_id == tok.pad_token_id
    assert (gen.top_k, gen.top_p, gen.repetition_penalty, gen.temperature) == (20, 0.8, 1.1, 0.7)


def test_sampling_config_ignores_the_models_own_settings(instruct_dir):
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=151936, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    model.generation_config = GenerationConfig.from_pretrained(instruct_dir)
    used, _ = model._prepare_generation_config(sampling_generation_config(0.9, 12, [151645, 151643], 151654))
    assert (used.repetition_penalty, used.top_k, used.top_p, used.temperature) == (1.0, 0, 1.0, 0.9)
    assert used.eos_token_id == [151645, 151643] and used.max_new_tokens == 12


@pytest.fixture(scope="module")
def listed_sft(sft_run, tmp_path_factory):
    """The demo SFT model with a stock-style generation_config: sampling settings and a second EOS id."""
    path = tmp_path_factory.mktemp("listed") / "sft"
    shutil.copytree(sft_run["merged"], path)
    gen = json.load(open(path / "generation_config.json"))
    second = 5  # an ordinary token of the demo vocabulary acts as a second EOS
    gen.update(eos_token_id=[gen["eos_token_id"], second], top_k=20, top_p=0.8, repetition_penalty=1.1)
    json.dump(gen, open(path / "generation_config.json", "w"))
    return str(path), second


def test_ppo_honours_the_eos_list(assets, rm_run, listed_sft, tmp_path, monkeypatch):
    """PPO from a directory with an EOS list and sampling settings: runs without a flag, stops at either id, and
    the missing-EOS penalty falls only on responses without any EOS id; merged/ keeps the stock config."""
    from rlhf_trl import ppo, ppo_engine, scoring

    sft_dir, second = listed_sft
    res = ppo.main(["--config", f"{RECIPES}/ppo.yaml", "--dataset_name", assets["prompts"],
                    "--sft_model_path", sft_dir, "--reward_model_path", rm_run["merged"],
                    "--output_dir", str(tmp_path), "--total_episodes", "16", "--per_device_train_batch_size", "8",
                    "--gradient_accumulation_steps", "1", "--log_samples_every", "0", "--logging_steps", "1",
                    "--missing_eos_penalty", "1.0", "--save_strategy", "no"])
    trainer = res["trainer"]
    eos = trainer.processing_class.eos_token_id
    assert trainer.eos_token_ids == [eos, second]
    assert [h["val/eos_rate"] for h in trainer.state.log_history if "val/eos_rate" in h]
    merged = json.load(open(os.path.join(res["merged"], "generation_config.json")))
    assert merged["eos_token_id"] == [eos, second] and merged["top_k"] == 20 and merged["repetition_penalty"] == 1.1

    # one rollout with known responses: cut after either id; the penalty only where no EOS id ends the response
    # (TRL 1.12 would also have penalised the row ending with the second id: a deliberate difference)
    pad = trainer.processing_class.pad_token_id
    query = torch.tensor([[11, 12, 13]] * 3)
    response = torch.tensor([[20, eos, 30], [20, second, 30], [20, 21, 22]])
    qr = torch.cat((query, response), 1)
    monkeypatch.setattr(ppo_engine, "generate_rollouts", lambda *a, **k: (qr, torch.zeros(3, 3)))
    base = trainer.unwrapped.policy.get_base_model()  # the run merged its adapter when saving: the base is the policy
    monkeypatch.setattr(trainer, "reference", lambda: contextlib.nullcontext(base))
    ro = trainer.rollout(query, None, update=1)
    cut = torch.tensor([[20, eos, pad], [20, second, pad], [20, 21, 22]])
    assert ro.ended.tolist() == [True, True, False] and ro.sequence_lengths.tolist() == [1, 1, 2]
    plain = scoring.sequence_scores(trainer.reward_model, torch.cat((query, cut), 1), pad, 3)
    torch.testing.assert_close(ro.scores, plain - torch.tensor([0.0, 0.0, 1.0]))

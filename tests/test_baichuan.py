"""Baichuan / Baichuan2 remote-code models through rlhf_trl: tokenizer, policy, reward / value model, LoRA, RM and PPO.

Everything runs on a tiny checkpoint written by `baichuan_fixture.write_tiny_baichuan`, whose remote code mirrors the
real Baichuan2 files including what breaks on transformers 5 (no ``position_ids``, no ``GenerationMixin``, legacy
tuple KV cache, tokenizer init-order bug).
"""

import json
import os
import random
import shutil

import pytest
import torch
from baichuan_fixture import TOPICS_ZH, write_tiny_baichuan
from conftest import write_jsonl
from safetensors.torch import load_file

from rlhf_trl import atomic, baichuan, models
from rlhf_trl.config import Recipe
from rlhf_trl.data import Template, encode_prompt, encode_response, pair_features
from rlhf_trl.scoring import pad_right, score_sequences


PAIRS = [
    {"question": "你喜欢海边吗？", "chosen": "海边很棒，我很喜欢。", "rejected": "海边很糟糕，我很讨厌。"},
    {"question": "说说你对咖啡的看法。", "chosen": "咖啡非常好，推荐给大家。", "rejected": "咖啡太差了。"},
    {"question": "Do you like tea?", "chosen": "I really like tea.", "rejected": "No."},
]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def bc_dir(tmp_path_factory):
    return write_tiny_baichuan(str(tmp_path_factory.mktemp("baichuan") / "Baichuan2-tiny"))


@pytest.fixture(scope="module")
def bc_tok(bc_dir):
    return models.load_tokenizer(bc_dir, trust_remote_code=True)


def weights(path):
    return load_file(os.path.join(path, "model.safetensors"))


# ----------------------------------------------------------------------------------------------------------------
# the fixture reproduces the transformers 5 obstacles
# ----------------------------------------------------------------------------------------------------------------
def test_fixture_reproduces_the_remote_code_obstacles(bc_dir):
    from transformers import AutoTokenizer
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    config = json.load(open(os.path.join(bc_dir, "config.json")))
    assert config["model_type"] == "baichuan" and config["architectures"] == ["BaichuanForCausalLM"]
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_baichuan.BaichuanForCausalLM"
    with pytest.raises((TypeError, AttributeError)):  # super().__init__ before sp_model is loaded
        AutoTokenizer.from_pretrained(bc_dir, trust_remote_code=True)
    remote = get_class_from_dynamic_module("modeling_baichuan.BaichuanForCausalLM", bc_dir)
    assert not hasattr(remote, "generate")
    model = remote.from_pretrained(bc_dir)
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(TypeError, match="position_ids"):
        model(input_ids=ids, position_ids=torch.arange(3)[None])
    with pytest.raises(TypeError, match="position_ids"):
        model.model(input_ids=ids, position_ids=torch.arange(3)[None])


# ----------------------------------------------------------------------------------------------------------------
# tokenizer
# ----------------------------------------------------------------------------------------------------------------
def test_tokenizer_loads_with_pad_distinct_from_eos(bc_dir, bc_tok, tmp_path):
    tok = bc_tok
    assert not tok.is_fast and type(tok).__name__ == "BaichuanTokenizer"
    assert (tok.eos_token, tok.eos_token_id) == ("</s>", 2)
    assert tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id
    assert len(tok) == json.load(open(os.path.join(bc_dir, "config.json")))["vocab_size"]  # nothing added
    text = "问：你喜欢咖啡吗？\n\n答：咖啡很棒，我很喜欢。"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text and tok.eos_token_id not in ids

    # saved with the model code: reloads from the saved directory alone
    out = tmp_path / "saved"
    out.mkdir()
    shutil.copyfile(os.path.join(bc_dir, "config.json"), out / "config.json")
    tok.save_pretrained(str(out))
    assert (out / "tokenization_baichuan.py").is_file() and (out / "tokenizer.model").is_file()
    saved_cfg = json.load(open(out / "tokenizer_config.json"))
    assert saved_cfg["auto_map"]["AutoTokenizer"][0] == "tokenization_baichuan.BaichuanTokenizer"
    again = models.load_tokenizer(str(out), trust_remote_code=True)
    assert again(text, add_special_tokens=False)["input_ids"] == ids and again.pad_token == tok.pad_token
    assert again(text)["input_ids"] == tok(text)["input_ids"] == ids  # Baichuan2 adds no BOS, before or after


def test_tokenizer_without_pad_gets_one_that_is_not_eos(bc_dir, tmp_path):
    """A Baichuan tokenizer_config without pad_token: models.load_tokenizer picks <unk> (in the vocab), not EOS."""
    d = tmp_path / "nopad"
    shutil.copytree(bc_dir, d)
    cfg = json.load(open(d / "tokenizer_config.json"))
    cfg.pop("pad_token")
    json.dump(cfg, open(d / "tokenizer_config.json", "w"))
    (d / "special_tokens_map.json").unlink()
    tok = models.load_tokenizer(str(d), trust_remote_code=True)
    assert tok.pad_token == "<unk>" and tok.pad_token_id == 0 != tok.eos_token_id


def test_a_pad_token_added_by_the_recipe_resizes_both_models(bc_dir):
    """pad_token not in the sentencepiece vocab: the slow tokenizer adds it, the models (NormHead too) grow by one."""
    tok = models.load_tokenizer(bc_dir, pad_token="<|pad|>", trust_remote_code=True)
    n = json.load(open(os.path.join(bc_dir, "config.json")))["vocab_size"]
    assert (tok.pad_token_id, len(tok)) == (n, n + 1) and tok.convert_ids_to_tokens(n) == "<|pad|>"
    ids = torch.tensor([tok("问：你好<|pad|>", add_special_tokens=False)["input_ids"]])
    assert ids[0, -1] == n
    lm = models.load_causal_lm(bc_dir, trust_remote_code=True)
    clf = models.load_sequence_classifier(bc_dir, trust_remote_code=True)
    for model in (lm, clf):
        models.resize_for_tokenizer(model, tok)
        assert model.config.vocab_size == n + 1 and model.get_input_embeddings().weight.shape[0] == n + 1
        assert model.config.pad_token_id == n
    assert lm.lm_head.weight.shape == (n + 1, lm.config.hidden_size) and type(lm.lm_head).__name__ == "NormHead"
    assert lm.generation_config.pad_token_id == n
    with torch.no_grad():
        assert lm(input_ids=ids).logits.shape == (1, ids.shape[1], n + 1)
        assert clf(input_ids=ids).logits.shape == (1, 1)  # read at the last token that is not the pad


def test_remote_code_needs_trust_remote_code(bc_dir):
    with pytest.raises(ValueError, match="trust_remote_code"):
        models.load_causal_lm(bc_dir)
    with pytest.raises(ValueError, match="trust_remote_code"):
        models.load_sequence_classifier(bc_dir)
    with pytest.raises(ValueError, match="trust_remote_code"):
        models.load_tokenizer(bc_dir)


def test_trusting_remote_code_warns_with_the_directory(bc_dir, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="rlhf_trl.models"):
        models.load_tokenizer(bc_dir, trust_remote_code=True)
    assert f"trust_remote_code: the Python code in '{bc_dir}' will run in this process" in caplog.text


# ----------------------------------------------------------------------------------------------------------------
# causal LM (policy)
# ----------------------------------------------------------------------------------------------------------------
def left_pad(rows, pad_id):
    width = max(map(len, rows))
    return torch.tensor([[pad_id] * (width - len(r)) + r for r in rows])


def test_causal_lm_generates_left_padded_with_the_legacy_cache(bc_dir, bc_tok):
    from transformers import GenerationConfig

    model = models.load_causal_lm(bc_dir, trust_remote_code=True).eval()
    assert type(model).__name__ == "BaichuanForCausalLM" and model.can_generate()
    assert model.generation_config.eos_token_id == bc_tok.eos_token_id
    t = Template()
    prompts = [encode_prompt(bc_tok, t, p["question"]) for p in PAIRS]
    assert len({len(p) for p in prompts}) > 1
    query = left_pad(prompts, bc_tok.pad_token_id)
    mask = query != bc_tok.pad_token_id

    # TRL's policy forward (position_ids included) works and matches the forward without them
    with torch.no_grad():
        out = model(input_ids=query, attention_mask=mask, position_ids=mask.cumsum(1) - mask.long(),
                    return_dict=True, output_hidden_states=True)
        plain = model(input_ids=query, attention_mask=mask)
    assert out.logits.shape == (3, query.shape[1], model.config.vocab_size) and out.hidden_states is not None
    assert torch.allclose(out.logits, plain.logits)

    # generation as TRL calls it; count the tokens each forward is fed
    fed = []
    hook = model.model.register_forward_pre_hook(
        lambda module, args, kwargs: fed.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    greedy = GenerationConfig(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    with torch.no_grad():
        res = model.generate(input_ids=query, attention_mask=mask, generation_config=greedy,
                             return_dict_in_generate=True, output_scores=True)
        fed_cached, fed[:] = list(fed), []
        no_cache = model.generate(input_ids=query, attention_mask=mask,
                                  generation_config=GenerationConfig(max_new_tokens=6, min_new_tokens=6,
                                                                     do_sample=False, use_cache=False))
    hook.remove()
    assert res.sequences.shape == (3, query.shape[1] + 6) and len(res.scores) == 6
    assert fed_cached == [query.shape[1]] + [1] * 5  # prefill, then one token per step from the tuple cache
    assert torch.equal(res.sequences, no_cache)
    # left padding changes nothing: each prompt alone generates the same tokens
    with torch.no_grad():
        for i, p in enumerate(prompts):
            alone = model.generate(input_ids=torch.tensor([p]), generation_config=greedy)
            assert alone[0, len(p):].tolist() == res.sequences[i, query.shape[1]:].tolist()
    # PPO rollouts: sampling, model in train mode with gradient checkpointing (the remote code then drops its cache)
    model.gradient_checkpointing_enable()  # the remote code's old-style _set_gradient_checkpointing(module, value)
    assert model.model.gradient_checkpointing
    model.train()
    with torch.no_grad():
        assert torch.equal(model.generate(input_ids=query, attention_mask=mask, generation_config=greedy),
                           res.sequences)
        sampled = model.generate(input_ids=query, attention_mask=mask, generation_config=GenerationConfig(
            max_new_tokens=4, temperature=0.7, top_k=0, top_p=1.0, do_sample=True))
    assert sampled.shape == (3, query.shape[1] + 4)


# ----------------------------------------------------------------------------------------------------------------
# sequence classifier (reward / value model)
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def classifier(bc_dir):
    torch.manual_seed(0)
    model = models.load_sequence_classifier(bc_dir, trust_remote_code=True).eval()
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)  # a visible score scale for the comparisons below
    return model


def test_classifier_reads_the_last_non_pad_token(classifier, bc_tok):
    from conftest import engine_reward as get_reward

    model, pad = classifier, bc_tok.pad_token_id
    assert isinstance(model, baichuan.BaichuanForSequenceClassification)
    assert model.base_model_prefix == "model" and model.score.out_features == 1 and model.score.bias is None
    assert model.config.pad_token_id == pad == 0 and model.config.num_labels == 1
    feats = pair_features(PAIRS, bc_tok, Template())
    seqs = feats["chosen_ids"] + feats["rejected_ids"]
    lengths = [len(s) for s in seqs]
    assert len(set(lengths)) > 2
    ids = pad_right(seqs, pad)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=ids != pad).logits
        per_token = model.score(model.model(input_ids=ids, attention_mask=ids != pad).last_hidden_state)
        alone = torch.cat([model(input_ids=torch.tensor([s])).logits for s in seqs])
    assert logits.shape == (len(seqs), 1)
    assert model.last_token_index(ids, ids.shape[1], ids.device, len(seqs)).tolist() == [n - 1 for n in lengths]
    assert torch.allclose(logits[:, 0], per_token[torch.arange(len(seqs)), torch.tensor(lengths) - 1, 0])
    assert torch.allclose(logits, alone, atol=1e-5)  # padding does not leak into the score
    # the project's scoring and TRL's PPO reward path (left-padded query + right-padded response) agree
    assert torch.allclose(score_sequences(model, seqs, pad), logits[:, 0], atol=1e-5)
    t = Template()
    prompts = [encode_prompt(bc_tok, t, p["question"]) for p in PAIRS]
    query = left_pad(prompts, pad)
    resp = pad_right([encode_response(bc_tok, t, p["chosen"]) for p in PAIRS], pad)
    with torch.no_grad():
        _, ppo_scores, _ = get_reward(model, torch.cat([query, resp], 1), pad, query.shape[1])
    assert torch.allclose(ppo_scores, logits[: len(PAIRS), 0], atol=1e-4)
    # scores depend on the response
    assert not torch.allclose(logits[: len(PAIRS)], logits[len(PAIRS):], atol=1e-3)


def test_classifier_saves_and_reloads_its_score_head(classifier, bc_tok, tmp_path):
    out = str(tmp_path / "rm")
    atomic.save_pretrained_atomic(classifier, bc_tok, out)
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["architectures"] == ["BaichuanForSequenceClassification"] and cfg["model_type"] == "baichuan"
    assert cfg["auto_map"]["AutoConfig"] == "configuration_baichuan.BaichuanConfig"
    for name in ("modeling_baichuan.py", "configuration_baichuan.py", "tokenization_baichuan.py", "tokenizer.model"):
        assert os.path.isfile(os.path.join(out, name)), name
    assert models.is_baichuan(out)
    reloaded, info = baichuan.classifier_class(out).from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    reloaded = models.load_sequence_classifier(out, trust_remote_code=True).eval()
    assert torch.equal(reloaded.score.weight, classifier.score.weight)
    ids = pad_right(pair_features(PAIRS, bc_tok, Template())["chosen_ids"], bc_tok.pad_token_id)
    with torch.no_grad():
        assert torch.allclose(reloaded(input_ids=ids).logits, classifier(input_ids=ids).logits, atol=1e-6)
    assert models.load_tokenizer(out, trust_remote_code=True).pad_token_id == bc_tok.pad_token_id


def test_classifier_built_from_a_config_saves_its_code(bc_dir, tmp_path):
    """Not loaded from a directory: the remote code is found through the dynamic-module cache."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(bc_dir, trust_remote_code=True)  # a config module without the model code
    policy_config = models.load_causal_lm(bc_dir, trust_remote_code=True).config
    with pytest.raises(TypeError, match="classifier_class"):
        baichuan.BaichuanForSequenceClassification(config)
    for model in (baichuan.classifier_class(bc_dir)(config), baichuan.BaichuanForSequenceClassification(policy_config)):
        assert type(model.model).__name__ == "BaichuanModel" and model.model.layers[0].self_attn.W_pack is not None
        out = tmp_path / str(id(model))
        model.save_pretrained(str(out))
        assert (out / "modeling_baichuan.py").is_file() and (out / "configuration_baichuan.py").is_file()
        reloaded = models.load_sequence_classifier(str(out), trust_remote_code=True)
        assert torch.equal(reloaded.score.weight, model.score.weight)


def test_lora_on_w_pack_and_o_proj_trains_adapter_and_score_and_merges(bc_dir, bc_tok, tmp_path):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = models.load_sequence_classifier(bc_dir, trust_remote_code=True)
    score_before = base.score.weight.detach().clone()
    model = get_peft_model(base, LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, lora_dropout=0.0,
                                            target_modules=["W_pack", "o_proj"]))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("W_pack.lora_A" in n for n in names) and any("o_proj.lora_B" in n for n in names)
    assert any("score" in n for n in names) and not any("gate_proj" in n for n in names)
    feats = pair_features(PAIRS, bc_tok, Template())
    pad = bc_tok.pad_token_id
    chosen, rejected = pad_right(feats["chosen_ids"], pad), pad_right(feats["rejected_ids"], pad)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for _ in range(5):
        margin = (model(input_ids=chosen, attention_mask=chosen != pad).logits
                  - model(input_ids=rejected, attention_mask=rejected != pad).logits)
        loss = -torch.nn.functional.logsigmoid(margin).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert all(float(p.detach().abs().sum()) > 0 for p in lora_b)  # LoRA B starts at zero
    trained_score = model.base_model.model.score.modules_to_save["default"].weight
    assert not torch.allclose(trained_score, score_before)

    adapter = tmp_path / "adapter"
    model.save_pretrained(str(adapter))
    saved = load_file(str(adapter / "adapter_model.safetensors"))
    assert any("score" in k for k in saved) and any("W_pack" in k for k in saved)

    with torch.no_grad():
        expected = model(input_ids=chosen, attention_mask=chosen != pad).logits
    merged_dir = str(tmp_path / "merged")
    merged = models.merge_and_save(model, bc_tok, merged_dir)
    assert isinstance(merged, baichuan.BaichuanForSequenceClassification)
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=chosen, attention_mask=chosen != pad).logits, expected, atol=1e-5)
    reloaded = models.load_sequence_classifier(merged_dir, trust_remote_code=True).eval()
    with torch.no_grad():
        assert torch.allclose(reloaded(input_ids=chosen, attention_mask=chosen != pad).logits, expected, atol=1e-5)


def test_models_and_tokenizer_pickle_and_deepcopy(bc_dir, bc_tok, classifier):
    """The classes built at runtime around the remote code survive pickle (DataLoader workers, spawn) and deepcopy."""
    import copy
    import pickle

    ids = torch.tensor([bc_tok("问：你喜欢茶吗？", add_special_tokens=False)["input_ids"]])
    tok = pickle.loads(pickle.dumps(bc_tok))
    assert type(tok) is type(bc_tok) and tok("问：你喜欢茶吗？", add_special_tokens=False)["input_ids"] == ids[0].tolist()
    policy = models.load_causal_lm(bc_dir, trust_remote_code=True).eval()
    for model, out in ((policy, lambda m: m(input_ids=ids).logits), (classifier, lambda m: m(input_ids=ids).logits)):
        for clone in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
            assert type(clone) is type(model) and type(clone.model) is type(model.model)
            with torch.no_grad():
                assert torch.equal(out(clone), out(model))


# ----------------------------------------------------------------------------------------------------------------
# the three stages: SFT, reward model, then PPO with Baichuan as policy, reward model and value model
# ----------------------------------------------------------------------------------------------------------------
LORA = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules=["W_pack", "o_proj"])


def pair_rows(n, seed):
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        t = rng.choice(TOPICS_ZH)
        rows.append({"prompt": rng.choice([f"你喜欢{t}吗？", f"你觉得{t}怎么样？"]),
                     "chosen": t + rng.choice(["很棒，我很喜欢。", "非常好，推荐给大家。"]),
                     "rejected": t + rng.choice(["很糟糕，我很讨厌。", "太差了。"])})
    return rows


@pytest.fixture(scope="module")
def sft_run(bc_dir, tmp_path_factory):
    from trl import ModelConfig, SFTConfig

    from rlhf_trl import sft
    from rlhf_trl.data import DataArguments

    work = tmp_path_factory.mktemp("bc_sft")
    rows = [{"instruction": r["prompt"], "output": r["chosen"]} for r in pair_rows(36, seed=0)]
    data = DataArguments(dataset_name=write_jsonl(work / "sft.jsonl", rows), dataset_format="alpaca",
                         eval_split_size=4)
    # loss_type nll: TRL's default chunked loss reads lm_head.weight / .bias directly, which Baichuan2's NormHead
    # (a normalized weight, no bias) does not support
    args = SFTConfig(output_dir=str(work / "out"), num_train_epochs=1, per_device_train_batch_size=8,
                     learning_rate=3e-3, max_length=64, completion_only_loss=True, loss_type="nll", logging_steps=1,
                     eval_strategy="no", save_strategy="no", report_to="none", seed=0, bf16=False, use_cpu=True,
                     trust_remote_code=True)
    return sft.run(Recipe(data=data, training=args, model=ModelConfig(model_name_or_path=bc_dir, dtype="float32",
                                                                      **LORA)))


@pytest.fixture(scope="module")
def rm_run(sft_run, tmp_path_factory):
    from trl import ModelConfig, RewardConfig

    from rlhf_trl import rm
    from rlhf_trl.data import DataArguments

    work = tmp_path_factory.mktemp("bc_rm")
    data = DataArguments(dataset_name=write_jsonl(work / "pairs.jsonl", pair_rows(40, seed=1)),
                         dataset_format="pairwise", eval_split_size=8)
    args = RewardConfig(output_dir=str(work / "out"), num_train_epochs=1, per_device_train_batch_size=8,
                        per_device_eval_batch_size=8, learning_rate=3e-3, max_length=64, logging_steps=1,
                        eval_strategy="no", save_strategy="no", report_to="none", seed=0, bf16=False,
                        use_cpu=True, trust_remote_code=True)
    return rm.run(Recipe(data=data, training=args, model=ModelConfig(model_name_or_path=sft_run["merged"],
                                                                     dtype="float32", **LORA)))


def test_sft_stage_fine_tunes_the_baichuan_causal_lm(bc_dir, sft_run):
    merged = sft_run["merged"]
    assert models.is_baichuan(merged) and os.path.isfile(os.path.join(merged, "tokenization_baichuan.py"))
    before, after = weights(bc_dir), weights(merged)
    moved = [k for k in before if not torch.allclose(before[k], after[k])]
    assert moved and all("W_pack" in k or "o_proj" in k for k in moved)  # LoRA merged into the targets only
    assert sft_run["metrics"]["train_loss"] > 0


def test_reward_model_stage_trains_a_baichuan_classifier(rm_run):
    merged = rm_run["merged"]
    assert models.is_baichuan(merged)
    assert "score.weight" in weights(merged)
    adapter = load_file(os.path.join(rm_run["output_dir"], "adapter", "adapter_model.safetensors"))
    assert any("W_pack" in k for k in adapter) and any("score" in k for k in adapter)
    assert rm_run["metrics"]["eval_num_pairs"] == 8


@pytest.mark.slow  # a PPO run (~3 s)
def test_ppo_with_baichuan_policy_reward_and_value_models(sft_run, rm_run, tmp_path, caplog):
    from trl import ModelConfig
    from rlhf_trl.ppo_engine import PPOConfig

    from rlhf_trl import ppo
    from rlhf_trl.data import DataArguments

    prompts = [{"instruction": q} for t in TOPICS_ZH for q in (f"你喜欢{t}吗？", f"说说你对{t}的看法。")]
    data = DataArguments(dataset_name=write_jsonl(tmp_path / "prompts.jsonl", prompts), dataset_format="prompt",
                         eval_split_size=4, max_prompt_length=16)
    args = PPOConfig(
        output_dir=str(tmp_path / "ppo"), sft_model_path=sft_run["merged"], reward_model_path=rm_run["merged"],
        total_episodes=16, per_device_train_batch_size=4, gradient_accumulation_steps=2, num_mini_batches=1,
        num_ppo_epochs=1, learning_rate=5e-3, response_length=8, temperature=0.7, stop_token="eos",
        missing_eos_penalty=1.0, local_rollout_forward_batch_size=8, per_device_eval_batch_size=4,
        num_sample_generations=1, save_strategy="no", logging_steps=1, report_to="none", seed=0, bf16=False,
        use_cpu=True,
    )
    model_args = ModelConfig(dtype="float32", **LORA)
    with caplog.at_level("WARNING", logger="rlhf_trl.baichuan"):
        result = ppo.run(Recipe(data=data, script=ppo.PPOScriptArguments(trust_remote_code=True), training=args,
                                model=model_args))
    assert not [r for r in caplog.records if r.name == "rlhf_trl.baichuan"]  # no keyword TRL passes is dropped

    assert result["metrics"]["global_step"] == 2 and result["metrics"]["episode"] == 16
    before, after = weights(sft_run["merged"]), weights(result["merged"])
    moved = [k for k in before if not torch.allclose(before[k], after[k])]
    assert moved and all("W_pack" in k or "o_proj" in k for k in moved)  # LoRA merged into the targets only
    value = weights(result["value_model"])
    assert "score.weight" in value
    assert not torch.allclose(value["score.weight"], weights(rm_run["merged"])["score.weight"])  # critic trained
    for path in (result["merged"], result["value_model"]):
        assert models.is_baichuan(path) and os.path.isfile(os.path.join(path, "modeling_baichuan.py"))
        auto_map = json.load(open(os.path.join(path, "config.json")))["auto_map"]
        assert set(auto_map) >= {"AutoConfig", "AutoModelForCausalLM"}
    policy = models.load_causal_lm(result["merged"], trust_remote_code=True)
    assert policy.can_generate()
    rows = [json.loads(x) for x in open(os.path.join(result["output_dir"], "samples.jsonl"), encoding="utf-8")]
    assert rows and rows[0]["query"].startswith("问：")


"""A Baichuan reward model (the remote-code fixture, tests/baichuan_fixture.py: a sentencepiece tokenizer) with a Qwen2
policy (the real Qwen2 tokenizer): recipes/qwen2.5-7b/ppo-baichuan-rm.yaml, run at a tiny size.

- the recipe parses, says how to run it, states its batch and memory;
- its scores re-encode the decoded text with the Baichuan tokenizer and the RM's template, ending with Baichuan's EOS:
  equal to the RM's own scoring of that text (PPO's rollouts, ``reward_baseline: auto`` calibrated on the same path).
"""

import os
import re

import pytest
import torch
import yaml

from baichuan_fixture import write_tiny_baichuan
from conftest import REPO, SHARED, import_ppo, write_jsonl

QWEN2 = SHARED / "tokenizers" / "qwen2"
RECIPE = str(REPO / "recipes" / "qwen2.5-7b" / "ppo-baichuan-rm.yaml")
pytestmark = [pytest.mark.skipif(not QWEN2.is_dir(), reason=f"needs the Qwen2 tokenizer at {QWEN2}"),
              pytest.mark.usefixtures("one_thread")]  # conftest.py
QUESTIONS = [f"{q}{t}{e}" for t in ("咖啡", "茶", "海边", "电影", "音乐", "火锅")
             for q, e in (("你喜欢", "吗？"), ("说说你对", "的看法。"))]


@pytest.fixture(scope="module")
def bc_rm(tmp_path_factory):
    """A tiny Baichuan classifier with a visible score head, saved as an RM stage's ``merged/`` with the stage's
    ``run_config.yaml`` (the default text template) beside it."""
    from rlhf_trl import atomic, models

    work = tmp_path_factory.mktemp("bc_rm_other")
    base = write_tiny_baichuan(str(work / "Baichuan2-tiny"))
    torch.manual_seed(0)
    model = models.load_sequence_classifier(base, trust_remote_code=True)
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)
    out = str(work / "rm" / "merged")
    atomic.save_pretrained_atomic(model, models.load_tokenizer(base, trust_remote_code=True), out)
    with open(work / "rm" / "run_config.yaml", "w", encoding="utf-8") as f:
        yaml.safe_dump({"prompt_template": "问：{question}\n\n答：", "completion_template": "{answer}",
                        "chat_template": False}, f, allow_unicode=True)
    return out


@pytest.fixture(scope="module")
def qwen_policy(tmp_path_factory):
    from rlhf_trl.models import load_tokenizer
    from rlhf_trl.tiny import build_tiny_qwen2

    out = str(tmp_path_factory.mktemp("qwen_policy") / "policy")
    build_tiny_qwen2(load_tokenizer(str(QWEN2)), out, hidden_size=32, num_layers=1, num_heads=2)
    return out


def direct_scores(rm_path, questions, texts, ended):
    """The Baichuan RM's own scoring: its tokenizer, the text template, prompt ids + response ids + its EOS."""
    from rlhf_trl.data import Template, encode_prompt, encode_response
    from rlhf_trl.models import load_sequence_classifier, load_tokenizer
    from rlhf_trl.scoring import score_sequences

    tok, t = load_tokenizer(rm_path, trust_remote_code=True), Template()
    seqs = [encode_prompt(tok, t, q) + encode_response(tok, t, x, raw=True)[:None if e else -1]
            for q, x, e in zip(questions, texts, ended)]
    assert tok.eos_token_id == 2 and all(s[-1] == 2 for s, e in zip(seqs, ended) if e)
    return score_sequences(load_sequence_classifier(rm_path, trust_remote_code=True), seqs, tok.pad_token_id)


def test_the_recipe_parses_and_states_how_to_run_it():
    from rlhf_trl.config import parse_recipe

    text = open(RECIPE, encoding="utf-8").read()
    assert text.startswith("# ") and "rlhf-trl ppo --config recipes/qwen2.5-7b/ppo-baichuan-rm.yaml" in text
    extra = [] if torch.cuda.is_available() else ["--bf16", "false", "--use_cpu", "true"]
    recipe = parse_recipe(import_ppo().recipe_types(), ["--config", RECIPE, *extra])
    ppo_args, training_args = recipe.script, recipe.training
    assert "baichuan" in training_args.reward_model_path and "qwen" in training_args.sft_model_path
    assert ppo_args.trust_remote_code and not ppo_args.share_reward_value_base and not ppo_args.value_model_path
    n = re.search(r"= (\d+) x (\d+) x (\d+) = (\d+) episodes", text).groups()
    assert int(n[0]) * int(n[1]) * int(n[2]) == int(n[3]) == 4 * 16
    assert re.search(r"Memory \(an estimate, not measured\).*peak ~\d", text, re.S)


def test_baichuan_rm_scores_the_decoded_text_with_its_own_tokenizer(bc_rm):
    from rlhf_trl.data import Template
    from rlhf_trl.models import load_sequence_classifier, load_tokenizer
    from rlhf_trl.reward_models import reward_tokens, score_responses

    qwen = load_tokenizer(str(QWEN2))
    tokens = reward_tokens(bc_rm, qwen, Template(chat=True), trust_remote_code=True)
    assert tokens is not None and tokens.template == Template() and tokens.eos_id == 2
    texts, ended = ["咖啡很棒，我很喜欢。", "I really like tea", "火锅太差了。"], [True, False, True]
    responses = [qwen(x, add_special_tokens=False)["input_ids"] + ([qwen.eos_token_id] if e else [])
                 for x, e in zip(texts, ended)]
    tokens.add_prompts("eval", [{"question": q} for q in QUESTIONS[:3]])
    rm = load_sequence_classifier(bc_rm, trust_remote_code=True)
    ours = score_responses(rm, tokens.prompts["eval"], responses, ended, qwen.pad_token_id, tokens)
    assert torch.allclose(ours, direct_scores(bc_rm, QUESTIONS[:3], texts, ended), atol=1e-5)


def test_the_recipe_runs_ppo_through_the_re_encoding_path(bc_rm, qwen_policy, tmp_path):
    """The recipe at a tiny size: rollouts' scores (RM score - auto baseline - missing-EOS penalty) equal the Baichuan
    RM's scoring of the prompt records and the decoded Qwen2 responses."""
    from rlhf_trl.data import DataArguments, read_records, split_records
    from rlhf_trl.models import load_tokenizer
    from rlhf_trl.ppo_engine import PPOEngine
    from rlhf_trl.scoring import eos_mask, truncate_at_eos

    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"instruction": q} for q in QUESTIONS])
    seen, rollout = [], PPOEngine.rollout

    def spy(self, queries, rows, update):
        ro = rollout(self, queries, rows, update)
        seen.append((rows.cpu().clone(), ro.responses.cpu().clone(), ro.scores.cpu().clone()))
        return ro

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(PPOEngine, "rollout", spy)
        result = import_ppo().main([
            "--config", RECIPE, "--dataset_name", prompts, "--sft_model_path", qwen_policy, "--reward_model_path",
            bc_rm, "--output_dir", str(tmp_path / "ppo"), "--eval_split_size", "4", "--max_prompt_length", "16",
            "--total_episodes", "16", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
            "--num_ppo_epochs", "1", "--response_length", "8", "--local_rollout_forward_batch_size", "8",
            "--per_device_eval_batch_size", "4", "--log_samples_every", "1", "--save_strategy", "no",
            "--report_to", "none", "--bf16", "false", "--use_cpu", "true", "--dtype", "float32",
            "--gradient_checkpointing", "false", "--reward_baseline_batches", "1", "--value_lora_r", "4",
            "--lora_r", "4", "--learning_rate", "1e-3"])
    assert result["metrics"]["global_step"] == 2 and len(seen) == 2
    baseline, trainer = result["metrics"]["reward_baseline"], result["trainer"]
    assert isinstance(baseline, float) and baseline != 0.0  # 'auto', calibrated on the re-encoded path
    qwen, eos = load_tokenizer(qwen_policy), trainer.eos_token_ids
    records = split_records(read_records(DataArguments(dataset_name=prompts, dataset_format="prompt"), "prompts"),
                            4, 42)[0]
    for rows, responses, scores in seen:
        post = truncate_at_eos(responses, eos, qwen.pad_token_id)
        ended = eos_mask(post, eos).any(1).tolist()
        texts = [qwen.decode([t for t in r.tolist() if t != qwen.pad_token_id and t not in eos],
                             skip_special_tokens=True) for r in post]
        expected = direct_scores(bc_rm, [records[i]["question"] for i in rows.tolist()], texts, ended) - baseline
        expected -= torch.tensor([0.0 if e else 1.0 for e in ended])  # missing_eos_penalty: 1.0
        assert torch.allclose(scores.float(), expected, atol=1e-4)
    assert os.path.isfile(os.path.join(result["output_dir"], "samples.jsonl"))

"""A reward model of another tokenizer: the demo policy (a 600-token BPE) against a tiny Qwen2 reward model
on the real Qwen2 tokenizer (../shared/tokenizers/qwen2), trained by the project's RM stage on the demo's pairs.

- the scores PPO, GRPO / RLOO, ``rlhf-trl eval`` and ``compare`` read equal the reward model's own scoring of the
  decoded text: its tokenizer, its recipe's template, prompt ids + response ids + its EOS (`encode_prompt`,
  `encode_response`), computed here straight from the prompt records and the decoded responses;
- the same tokenizer keeps the policy's ids (no `RewardTokens`: nothing decoded);
- PPO against that reward model raises its score in a short run; its value model starts from the SFT policy;
- the refusals (shared reward / value base, the reward model as value model) are one line naming the key.
"""

import json
import os

import pytest
import torch

from conftest import RECIPES, SHARED, import_ppo

QWEN2 = SHARED / "tokenizers" / "qwen2"
pytestmark = pytest.mark.skipif(not QWEN2.is_dir(), reason=f"needs the Qwen2 tokenizer at {QWEN2}")


@pytest.fixture(scope="module")
def policy(assets, tmp_path_factory):
    """The demo's SFT policy after a short SFT (1 pass over 200 rows), on the demo tokenizer."""
    from rlhf_trl import sft

    out = tmp_path_factory.mktemp("rt_sft")
    return sft.main(["--config", f"{RECIPES}/sft.yaml", "--dataset_name", assets["sft"], "--model_name_or_path",
                     assets["base_model"], "--max_samples", "200", "--output_dir", str(out), "--num_train_epochs",
                     "1", "--report_to", "none", "--save_strategy", "no"])["merged"]


@pytest.fixture(scope="module")
def qwen_rm(assets, tmp_path_factory):
    """A tiny random-init Qwen2 on the Qwen2 tokenizer, trained in full by the RM stage on the demo's ranked answers
    (its ``run_config.yaml`` records the demo's text template); returns its ``merged/``."""
    from rlhf_trl import rm
    from rlhf_trl.models import load_tokenizer
    from rlhf_trl.tiny import build_tiny_qwen2

    out = tmp_path_factory.mktemp("rt_qwen")
    build_tiny_qwen2(load_tokenizer(str(QWEN2)), str(out / "base"), hidden_size=32, num_layers=2, num_heads=2)
    return rm.main(["--config", f"{RECIPES}/rm.yaml", "--dataset_name", assets["rm"], "--model_name_or_path",
                    str(out / "base"), "--use_peft", "false", "--learning_rate", "3e-3", "--max_samples", "120",
                    "--num_train_epochs", "2", "--output_dir", str(out / "rm"), "--report_to", "none"])["merged"]


def direct_scores(rm_path, questions, texts, ended, baseline=0.0):
    """The reward model's own scoring of prompt records and response texts, computed here from scratch: its
    tokenizer, the demo template, prompt ids + response ids + its EOS (none where the response did not end)."""
    from rlhf_trl.data import Template, encode_prompt, encode_response
    from rlhf_trl.models import load_sequence_classifier, load_tokenizer
    from rlhf_trl.scoring import score_sequences

    tok, t = load_tokenizer(rm_path), Template()
    seqs = [encode_prompt(tok, t, q) + encode_response(tok, t, x, raw=True)[:None if e else -1]
            for q, x, e in zip(questions, texts, ended)]
    assert all(s[-1] == tok.eos_token_id for s, e in zip(seqs, ended) if e)
    return score_sequences(load_sequence_classifier(rm_path), seqs, tok.pad_token_id) - baseline


def test_same_tokenizer_keeps_the_policys_ids(assets, tokenizer):
    from conftest import reward_stand_in
    from rlhf_trl.data import Template
    from rlhf_trl.reward_models import reward_tokens

    assert reward_tokens(reward_stand_in(assets), tokenizer, Template()) is None
    assert reward_tokens(None, tokenizer, Template()) is None


def test_rewards_of_another_tokenizer_are_its_scoring_of_the_text(qwen_rm, tokenizer):
    """`RewardTokens` re-encodes with the RM's tokenizer and the template of its run_config.yaml; `score_responses`
    equals the RM's own scoring of the decoded text; the policy's ids would be read as other tokens."""
    from rlhf_trl.data import Template, encode_prompt
    from rlhf_trl.models import load_sequence_classifier
    from rlhf_trl.reward_models import reward_tokens, rm_template, score_responses

    chat = Template(chat=True)  # the recipe's template is not the RM's: run_config.yaml wins
    template, where = rm_template(qwen_rm, chat)
    assert template == Template() and where.endswith("run_config.yaml")
    tokens = reward_tokens(qwen_rm, tokenizer, chat)
    assert tokens is not None and tokens.template == Template() and len(tokens.tokenizer) > 150_000
    questions = ["你喜欢咖啡吗？", "说说你对电影的看法。", "你觉得火锅怎么样？"]
    texts = ["咖啡很棒，我很喜欢。", "电影太差了", "火锅让人开心。"]
    ended = [True, False, True]
    eos = tokenizer.eos_token_id
    responses = [tokenizer(x, add_special_tokens=False)["input_ids"] + ([eos] if e else [])
                 for x, e in zip(texts, ended)]
    tokens.add_prompts("eval", [{"question": q} for q in questions])
    assert tokens.prompts["eval"][0] == encode_prompt(tokens.tokenizer, Template(), questions[0])
    rm = load_sequence_classifier(qwen_rm)
    ours = score_responses(rm, tokens.prompts["eval"], responses, ended, tokenizer.pad_token_id, tokens)
    assert torch.allclose(ours, direct_scores(qwen_rm, questions, texts, ended), atol=1e-5)
    # the tensor path the PPO engine takes: right-padded responses cut after their EOS
    from rlhf_trl.scoring import pad_right

    batch = tokens.score_batch(rm, "eval", torch.tensor([0, 1, 2]), pad_right(responses, tokenizer.pad_token_id),
                               [eos], tokenizer.pad_token_id)
    assert torch.allclose(batch, ours, atol=1e-5)


@pytest.fixture(scope="module")
def ppo_cross(policy, qwen_rm, assets, tmp_path_factory):
    """A short PPO run (20 updates of 32 episodes) against the Qwen2 RM; ``rollouts``: the first two updates' rows,
    responses and scores, as the engine returned them."""
    from rlhf_trl.ppo_engine import PPOEngine

    ppo, out, seen = import_ppo(), tmp_path_factory.mktemp("rt_ppo"), []
    rollout = PPOEngine.rollout

    def spy(self, queries, rows, update):
        ro = rollout(self, queries, rows, update)
        if len(seen) < 2:
            seen.append({"rows": rows.cpu().clone(), "responses": ro.responses.cpu().clone(),
                         "scores": ro.scores.cpu().clone(), "tokens": self.reward_tokens})
        return ro

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(PPOEngine, "rollout", spy)
        result = ppo.main(["--config", f"{RECIPES}/ppo.yaml", "--dataset_name", assets["prompts"], "--sft_model_path",
                           policy, "--reward_model_path", qwen_rm, "--output_dir", str(out), "--total_episodes", "640",
                           "--num_ppo_epochs", "2", "--logging_steps", "1", "--log_samples_every", "6",
                           "--save_strategy", "no", "--report_to", "none", "--missing_eos_penalty", "0.0"])
    return {**result, "rollouts": seen}


def test_ppo_scores_are_the_reward_models_scoring_of_the_text(ppo_cross, qwen_rm, tokenizer, assets):
    """The rollouts' scores equal the RM's own scoring of the prompt records and the decoded responses; the value
    model was started from the SFT policy (the RM reads another vocabulary)."""
    from rlhf_trl.data import DataArguments, read_records, split_records
    from rlhf_trl.scoring import eos_mask, truncate_at_eos

    trainer = ppo_cross["trainer"]
    assert trainer.unwrapped.value_model.config.vocab_size == len(tokenizer)  # the policy's vocabulary
    pad, eos = tokenizer.pad_token_id, trainer.eos_token_ids
    assert len(ppo_cross["rollouts"]) == 2
    records = split_records(read_records(DataArguments(dataset_name=assets["prompts"], dataset_format="prompt"),
                                         "prompts"), 16, 42)[0]  # the recipe's eval_split_size and seed
    for ro in ppo_cross["rollouts"]:
        tokens = ro["tokens"]
        assert tokens is not None and tokens.tokenizer.get_vocab() != tokenizer.get_vocab()
        post = truncate_at_eos(ro["responses"], eos, pad)
        ended = eos_mask(post, eos).any(1).tolist()
        texts = [tokenizer.decode([t for t in row.tolist() if t != pad and t not in eos], skip_special_tokens=True)
                 for row in post]
        questions = [records[i]["question"] for i in ro["rows"].tolist()]
        expected = direct_scores(qwen_rm, questions, texts, ended, trainer.reward_baseline)
        assert torch.allclose(ro["scores"].float(), expected, atol=1e-4)
    samples = [json.loads(x) for x in open(os.path.join(ppo_cross["output_dir"], "samples.jsonl"), encoding="utf-8")]
    assert samples and all(isinstance(s["score"], float) for s in samples)


def test_ppo_against_another_tokenizers_reward_model_raises_its_score(ppo_cross):
    logs = [h["objective/scores"] for h in ppo_cross["trainer"].state.log_history if "objective/scores" in h]
    assert len(logs) == 20
    print("objective/scores per update:", [round(x, 3) for x in logs])
    assert sum(logs[-3:]) / 3 > sum(logs[:3]) / 3, logs


def test_eval_scores_with_the_reward_models_own_tokenizer(ppo_cross, policy, qwen_rm, assets):
    """`rlhf-trl eval` / `compare` (`sample_and_score`): each sample's reward is the RM's scoring of its text."""
    from rlhf_trl.evaluate import sample_and_score

    ppo = import_ppo()
    from rlhf_trl.config import parse_recipe

    recipe = parse_recipe(ppo.recipe_types(), [
        "--config", f"{RECIPES}/ppo.yaml", "--dataset_name", assets["prompts"], "--output_dir",
        ppo_cross["output_dir"]])
    data_args, training_args = recipe.data, recipe.training
    rows, n, _ = sample_and_score(data_args, training_args, {"sft": policy, "ppo": ppo_cross["merged"]}, qwen_rm,
                                  num_prompts=8, samples_per_prompt=4)
    assert n == 8
    mean = {k: sum(r[k]["reward"] for r in rows) / len(rows) for k in ("sft", "ppo")}
    assert mean["ppo"] > mean["sft"], mean  # held-out prompts: PPO raised the other tokenizer's RM score
    for name in ("sft", "ppo"):
        got = torch.tensor([r[name]["reward"] for r in rows])
        expected = direct_scores(qwen_rm, [r["question"] for r in rows], [r[name]["text"] for r in rows],
                                 [r[name]["eos"] for r in rows])
        assert torch.allclose(got, expected, atol=1e-4)


@pytest.mark.parametrize("method", ["grpo", "rloo"])
def test_group_methods_score_with_the_reward_models_tokenizer(method, policy, qwen_rm, assets, tmp_path,
                                                              monkeypatch):
    """GRPO / RLOO get the RM's prompt ids as ``reward_query_ids``; their reward is the RM's scoring of the text."""
    from rlhf_trl import grpo

    seen = []
    call = grpo.RewardModelReward.__call__

    def spy(self, prompts, completions, completion_ids, query_ids, **columns):
        out = call(self, prompts, completions, completion_ids, query_ids, **columns)
        seen.append((completion_ids, columns["reward_query_ids"], out, self.tokens))
        return out

    monkeypatch.setattr(grpo.RewardModelReward, "__call__", spy)
    grpo.main(["--config", f"{RECIPES}/{method}.yaml", "--dataset_name", assets["prompts"], "--model_name_or_path",
               policy, "--reward_model_path", qwen_rm, "--max_samples", "24", "--per_device_train_batch_size", "8",
               "--num_generations", "4", "--max_steps", "1", "--max_completion_length", "8", "--output_dir",
               str(tmp_path / method), "--report_to", "none", "--eval_strategy", "no"], method=method)
    assert seen
    completion_ids, rm_prompts, out, tokens = seen[0]
    tok = tokens.policy_tokenizer
    eos = {tok.eos_token_id}
    ended = [bool(c) and c[-1] in eos for c in completion_ids]
    texts = [tok.decode(c[:-1] if e else c, skip_special_tokens=True) for c, e in zip(completion_ids, ended)]
    questions = [tokens.tokenizer.decode(p).removeprefix("问：").removesuffix("\n\n答：") for p in rm_prompts]
    expected = direct_scores(qwen_rm, questions, texts, ended)
    penalty = torch.tensor([0.0 if e else 1.0 for e in ended])  # the demo recipes' missing_eos_penalty: 1.0
    assert torch.allclose(torch.tensor(out), expected - penalty, atol=1e-4)


def test_refusals_name_the_key(policy, qwen_rm, assets, tmp_path):
    from rlhf_trl.config import RecipeError

    ppo = import_ppo()
    base = ["--config", f"{RECIPES}/ppo.yaml", "--dataset_name", assets["prompts"], "--sft_model_path", policy,
            "--reward_model_path", qwen_rm, "--output_dir", str(tmp_path / "ppo"), "--report_to", "none"]
    for extra, key in ((["--value_use_peft", "true", "--share_reward_value_base", "true"], "share_reward_value_base"),
                       (["--value_model_path", qwen_rm], "value_model_path")):
        with pytest.raises((ValueError, RecipeError)) as err:
            ppo.main(base + extra)
        message = str(err.value)
        assert message.startswith(key) and "\n" not in message and "tokenizer" in message
        assert not (tmp_path / "ppo" / "merged").exists()


def test_a_chat_template_rm_renders_its_own_chat_prompt_or_is_refused(qwen_rm, tokenizer, tmp_path):
    """``chat_template: true`` in the RM's run_config.yaml: its chat template renders the prompt and its end-of-turn
    ends the response; an RM tokenizer without a chat template is refused in one line naming the key."""
    import glob
    import shutil

    import yaml

    from rlhf_trl.data import Template, encode_prompt, encode_response
    from rlhf_trl.models import load_tokenizer
    from rlhf_trl.reward_models import reward_tokens

    stage, plain = tmp_path / "rm_chat", tmp_path / "rm_plain"
    shutil.copytree(os.path.dirname(qwen_rm), stage)
    config = yaml.safe_load(open(stage / "run_config.yaml", encoding="utf-8"))
    config["chat_template"] = True
    yaml.safe_dump(config, open(stage / "run_config.yaml", "w", encoding="utf-8"), allow_unicode=True)
    shutil.copytree(stage, plain)
    for f in glob.glob(str(plain / "merged" / "chat_template.*")):
        os.remove(f)
    cfg = json.load(open(plain / "merged" / "tokenizer_config.json", encoding="utf-8"))
    cfg.pop("chat_template", None)
    json.dump(cfg, open(plain / "merged" / "tokenizer_config.json", "w", encoding="utf-8"))
    with pytest.raises(ValueError) as err:
        reward_tokens(str(plain / "merged"), tokenizer, Template())
    assert str(err.value).startswith("chat_template: true") and "\n" not in str(err.value)

    merged, rm_tok = str(stage / "merged"), load_tokenizer(str(stage / "merged"))
    tokens = reward_tokens(merged, tokenizer, Template())
    im_end = rm_tok.convert_tokens_to_ids("<|im_end|>")
    assert tokens.template.chat and tokens.eos_id == im_end
    tokens.add_prompts("eval", [{"question": "你喜欢茶吗？"}])
    assert tokens.prompts["eval"][0] == encode_prompt(rm_tok, Template(chat=True), "你喜欢茶吗？")
    assert rm_tok.decode(tokens.prompts["eval"][0]).endswith("<|im_start|>assistant\n")
    response = tokenizer("茶很好。", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = tokens.sequences(tokens.prompts["eval"], [response], [True])[0]
    assert ids == tokens.prompts["eval"][0] + encode_response(rm_tok, Template(chat=True), "茶很好。")
    assert ids[-1] == im_end

"""Reward model: where the score is read, merge/reload fidelity, consistency between RM training and PPO scoring."""

import os

import torch

from rlhf_trl.data import Template, encode_prompt, encode_response, pair_features
from rlhf_trl.scoring import last_token_index, pad_right, score_sequences

PAIRS = [
    {"question": "你喜欢海边吗？", "chosen": "海边很棒，我很喜欢。", "rejected": "海边很无聊，我很讨厌。"},
    {"question": "说说你对咖啡的看法。", "chosen": "咖啡真不错，推荐给大家。", "rejected": "咖啡太差了，劝大家别试。"},
    {"question": "地铁好不好？", "chosen": "地铁令人满意，下次还想再来。", "rejected": "地铁一塌糊涂，再也不想碰了。"},
]


def test_score_is_read_at_the_response_eos(tokenizer):
    """Rows of different lengths, right-padded: the index is the last real token, the EOS ending the response."""
    feats = pair_features(PAIRS, tokenizer, Template())
    seqs = feats["chosen_ids"] + feats["rejected_ids"]
    assert len({len(s) for s in seqs}) > 1
    ids = pad_right(seqs, tokenizer.pad_token_id)
    idx = last_token_index(ids, tokenizer.pad_token_id)
    assert idx.tolist() == [len(s) - 1 for s in seqs]
    assert all(int(ids[i, j]) == tokenizer.eos_token_id for i, j in enumerate(idx.tolist()))
    # no EOS inside the template or the prompt: the only EOS of a row is the one that ends its response
    assert all(s.count(tokenizer.eos_token_id) == 1 for s in seqs)


def test_training_and_ppo_read_the_same_score(rm_run, tokenizer):
    """RewardTrainer's forward (HF last-non-pad logic) and PPO's get_reward path give the same scores."""
    from transformers import AutoModelForSequenceClassification

    from rlhf_trl.scoring import get_reward

    model = AutoModelForSequenceClassification.from_pretrained(rm_run["merged"]).eval()
    t = Template()
    feats = pair_features(PAIRS, tokenizer, t)
    seqs = feats["chosen_ids"] + feats["rejected_ids"]
    ours = score_sequences(model, seqs, tokenizer.pad_token_id)
    ids = pad_right(seqs, tokenizer.pad_token_id)
    with torch.no_grad():
        hf = model(input_ids=ids, attention_mask=ids != tokenizer.pad_token_id).logits.squeeze(-1)
    assert torch.allclose(ours, hf, atol=1e-5)
    # PPO: left-padded prompt ids, then response ids right-padded; TRL reads at the last non-pad response token
    prompts = [encode_prompt(tokenizer, t, p["question"]) for p in PAIRS]
    responses = [encode_response(tokenizer, t, p["chosen"]) for p in PAIRS]
    width = max(map(len, prompts))
    query = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    resp = pad_right(responses, tokenizer.pad_token_id)
    with torch.no_grad():
        _, ppo_scores, _ = get_reward(model, torch.cat([query, resp], 1), tokenizer.pad_token_id, width)
    assert torch.allclose(ppo_scores, ours[: len(PAIRS)], atol=1e-4)


def test_scores_depend_on_the_response(rm_run, tokenizer):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(rm_run["merged"])
    feats = pair_features(PAIRS, tokenizer, Template())
    chosen = score_sequences(model, feats["chosen_ids"], tokenizer.pad_token_id)
    rejected = score_sequences(model, feats["rejected_ids"], tokenizer.pad_token_id)
    assert (chosen > rejected).all()


def test_merged_rm_scores_equal_the_adapter_model(sft_run, rm_run, tokenizer):
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    base = AutoModelForSequenceClassification.from_pretrained(sft_run["merged"], num_labels=1)
    base.config.pad_token_id = tokenizer.pad_token_id
    adapter = PeftModel.from_pretrained(base, os.path.join(rm_run["output_dir"], "adapter")).eval()
    merged = AutoModelForSequenceClassification.from_pretrained(rm_run["merged"]).eval()
    feats = pair_features(PAIRS, tokenizer, Template())
    ids = pad_right(feats["chosen_ids"] + feats["rejected_ids"], tokenizer.pad_token_id)
    mask = ids != tokenizer.pad_token_id
    with torch.no_grad():
        a = adapter(input_ids=ids, attention_mask=mask).logits
        m = merged(input_ids=ids, attention_mask=mask).logits
    assert torch.allclose(a, m, atol=1e-5)

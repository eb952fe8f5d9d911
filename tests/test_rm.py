"""The reward model the RM stage trains: its scores depend on the response, and the merged model scores as its
adapter does. Where a score is read, and that RM training and PPO read the same one: test_scoring.py."""

import os

import torch
from conftest import PAIRS

from rlhf_trl.data import Template, pair_features
from rlhf_trl.scoring import pad_right, score_sequences


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

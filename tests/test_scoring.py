"""`rlhf_trl.scoring`, the tensor operations every stage shares: padding and model inputs, EOS cuts, sampling
(`sample`, `generate_rollouts`: one log-softmax per decoding step), log-probs (chunked = whole, gradients too),
reward-model scores (read at the response's EOS, as the RM trains and PPO reads them; a PEFT reward model scores as
its merge), RNG preservation, and the intervals of the reported figures (Wilson, paired)."""

import math
import random

import numpy as np
import pytest
import torch
from conftest import PAIRS, demo_rollout_setup

from rlhf_trl import models
from rlhf_trl import ppo_math as pm
from rlhf_trl.data import Template, encode_prompt, encode_response, pair_features
from rlhf_trl.models import load_tokenizer, sampling_generation_config
from rlhf_trl.scoring import (
    eos_mask,
    generate_rollouts,
    last_token_index,
    model_inputs,
    pad_left,
    pad_right,
    paired_ci,
    pairwise_metrics,
    preserved_rng,
    score_sequences,
    truncate_at_eos,
    wilson_ci,
)

PAD = 9


# ----------------------------------------------------------------------------------------------------------------
# padding, model inputs, EOS cuts
# ----------------------------------------------------------------------------------------------------------------
def test_pad_left_and_pad_right_put_the_pads_on_their_side():
    rows = [[5, 6, 7], [8], [1, 2]]
    assert pad_left(rows, PAD).tolist() == [[5, 6, 7], [PAD, PAD, 8], [PAD, 1, 2]]
    assert pad_right(rows, PAD).tolist() == [[5, 6, 7], [8, PAD, PAD], [1, 2, PAD]]
    assert pad_left(rows, PAD).dtype == pad_right(rows, PAD).dtype == torch.long


def test_model_inputs_mask_the_pads_and_count_positions_from_the_first_real_token():
    qr = torch.tensor([[PAD, PAD, 5, 6, 7, PAD], [4, 5, 6, 7, 8, 8]])  # left-padded prompt, right-padded response
    inputs = model_inputs(qr, PAD)
    assert inputs["input_ids"].tolist() == [[0, 0, 5, 6, 7, 0], [4, 5, 6, 7, 8, 8]]
    assert inputs["attention_mask"].tolist() == [[False, False, True, True, True, False], [True] * 6]
    assert inputs["position_ids"].tolist() == [[0, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]]
    assert inputs["use_cache"] is False


def test_last_token_index_counts_after_the_context_and_refuses_rows_of_pads():
    qr = torch.tensor([[PAD, 4, 5, 6, PAD], [7, 8, 5, 6, 7]])  # context 2, then the response
    assert last_token_index(qr, PAD, context_length=2).tolist() == [3, 4]
    assert last_token_index(pad_right([[3, 4, 5], [6]], PAD), PAD).tolist() == [2, 0]
    with pytest.raises(ValueError, match="a sequence holds only pad tokens"):
        last_token_index(torch.tensor([[PAD, PAD], [1, 2]]), PAD)


def test_truncate_at_eos_keeps_the_first_eos_of_any_id():
    responses = torch.tensor([[5, 7, 1, 5, 2],    # stops at EOS id 7
                              [5, 2, 7, 5, 5],    # stops at EOS id 2 (the second EOS of the list)
                              [5, 5, 5, 5, 5]])   # no EOS: unchanged
    out = truncate_at_eos(responses, [7, 2], PAD)
    assert out.tolist() == [[5, 7, PAD, PAD, PAD], [5, 2, PAD, PAD, PAD], [5, 5, 5, 5, 5]]
    assert eos_mask(responses, [7, 2]).any(1).tolist() == [True, True, False]
    assert truncate_at_eos(responses, 7, PAD).tolist()[1] == [5, 2, 7, PAD, PAD]  # a single id, as TRL does


# ----------------------------------------------------------------------------------------------------------------
# sampling and log-probs
# ----------------------------------------------------------------------------------------------------------------
def test_sample_cuts_each_response_at_its_first_eos_of_any_id(assets):
    """`scoring.sample` (eval and the demo): the tokens ``generate`` draws for the seed, up to and including the
    first id of the EOS list, else all ``max_new_tokens``; the flag says which."""
    from transformers import AutoModelForCausalLM

    from rlhf_trl.scoring import pad_left, sample

    tok = load_tokenizer(assets["tokenizer"])
    policy = AutoModelForCausalLM.from_pretrained(assets["base_model"]).eval()
    prompts, eos = [[5, 6, 7], [8, 9], [10, 11, 12, 13]] * 4, list(range(3, 40))  # many EOS ids: some responses end
    out = sample(policy, prompts, tok.pad_token_id, eos, max_new_tokens=6, temperature=1.0, seed=3)
    torch.manual_seed(3)
    queries = pad_left(prompts, tok.pad_token_id)
    config = sampling_generation_config(1.0, 6, eos, tok.pad_token_id)
    drawn = policy.generate(input_ids=queries.masked_fill(queries == tok.pad_token_id, 0),
                            attention_mask=queries != tok.pad_token_id, generation_config=config)[:, 4:].tolist()
    assert {ended for _, ended in out} == {True, False}
    for (ids, ended), row in zip(out, drawn):
        first = next((i for i, t in enumerate(row) if t in eos), None)
        assert ended == (first is not None)
        assert ids == (row[:first + 1] if ended else row[:6])


def test_rollout_log_probs_take_one_log_softmax_per_decoding_step(assets, monkeypatch):
    """`generate_rollouts` turns each decoding step's sampling logits ``[rows, vocab]`` into the sampled tokens'
    log-probs with one logsumexp over all rows of the step, not one per row and step (selective_log_softmax's
    per-row loop): the same values (bit for bit at the demo's vocabulary; log_softmax + gather to 1e-6), and
    ``rows x steps`` logsumexp calls become ``steps``."""
    tok, policy, config = demo_rollout_setup(assets, response_length=7)
    queries = torch.randint(3, 200, (6, 5), generator=torch.Generator().manual_seed(0))
    calls = []
    real_lse = torch.logsumexp
    monkeypatch.setattr(torch, "logsumexp", lambda x, *a, **kw: calls.append(tuple(x.shape)) or real_lse(x, *a, **kw))
    torch.manual_seed(3)
    query_responses, logprobs = generate_rollouts(policy, queries, tok.pad_token_id, config, 3)
    assert calls == [(3, policy.config.vocab_size)] * 14  # 2 generate calls of 3 rows x 7 steps: one per step
    monkeypatch.setattr(torch, "logsumexp", real_lse)
    torch.manual_seed(3)
    mask = queries != tok.pad_token_id
    expected = []
    with torch.no_grad():
        for i in (0, 3):
            out = policy.generate(input_ids=queries[i:i + 3].masked_fill(~mask[i:i + 3], 0),
                                  attention_mask=mask[i:i + 3], generation_config=config, return_dict_in_generate=True,
                                  output_scores=True)
            assert torch.equal(out.sequences, query_responses[i:i + 3])
            ids = out.sequences[:, 5:]
            per_row = torch.stack([pm.selective_log_softmax(s[:, None], ids[:, t, None])[:, 0]
                                   for t, s in enumerate(out.scores)], 1)
            full = torch.log_softmax(torch.stack(out.scores, 1), -1).gather(-1, ids[..., None])[..., 0]
            torch.testing.assert_close(per_row, full, rtol=0, atol=1e-6)
            expected.append(per_row)
    assert torch.equal(logprobs, torch.cat(expected))


def test_chunked_response_logprobs_equal_whole_ones_with_gradients():
    """The engine forms logits ``logits_chunk_size`` positions at a time (recomputed in the backward): same
    log-probs and same gradients as forming them all at once."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlhf_trl.scoring import response_logprobs

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, pad_token_id=0))
    qr = torch.tensor([[0, 5, 6, 7, 8, 9, 10, 0], [3, 4, 5, 6, 7, 8, 9, 11]])  # prompt 3 tokens, response 5
    grads = []
    for chunk in (0, 2):
        model.zero_grad()
        lp, ent = response_logprobs(model, qr, 3, 0, temperature=0.7, chunk_size=chunk, with_entropy=True)
        lp.sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        if chunk == 0:
            whole, whole_ent = lp.detach(), ent
    torch.testing.assert_close(lp.detach(), whole)
    torch.testing.assert_close(ent, whole_ent)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
    assert lp.shape == (2, 5)


def test_preserved_rng_leaves_every_generator_as_it_was():
    """Sampling inside ``preserved_rng`` (sample tables, eval) changes no draw after it, even when it raises."""
    def seed():
        random.seed(1)
        np.random.seed(1)
        torch.manual_seed(1)

    def draw():
        return random.random(), float(np.random.rand()), torch.rand(3).tolist()

    seed()
    expected = draw()
    seed()
    with preserved_rng():
        draw()
    assert draw() == expected
    seed()
    with pytest.raises(RuntimeError), preserved_rng():
        draw()
        raise RuntimeError("sampling failed")
    assert draw() == expected


# ----------------------------------------------------------------------------------------------------------------
# reward-model scores
# ----------------------------------------------------------------------------------------------------------------
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
    from conftest import engine_reward as get_reward

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


def test_scores_of_a_peft_reward_model_are_its_adapter_scores(assets, tokenizer):
    """score_sequences on a PeftModel (what the RM stage evaluates after QLoRA: the adapter on the quantized base is
    kept) reads its backbone with the LoRA layers and the trained score copy: the scores of the merged model."""
    import copy

    from peft import LoraConfig, get_peft_model

    from rlhf_trl.scoring import score_sequences

    base = models.load_sequence_classifier(assets["base_model"], torch.float32)
    models.resize_for_tokenizer(base, tokenizer)
    model = get_peft_model(base, LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False))
    with torch.no_grad():
        model.base_model.model.score.modules_to_save["default"].weight.add_(0.5)  # a trained head differs
    seqs = [tokenizer("今天天气很好").input_ids + [tokenizer.eos_token_id], tokenizer("你好").input_ids]
    got = score_sequences(model, seqs, tokenizer.pad_token_id)
    merged = copy.deepcopy(model).merge_and_unload()
    expected = score_sequences(merged, seqs, tokenizer.pad_token_id)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with model.disable_adapter():
        assert not torch.allclose(score_sequences(model, seqs, tokenizer.pad_token_id), expected, atol=1e-3)


# ----------------------------------------------------------------------------------------------------------------
# intervals of the reported figures
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k,n", [(0, 10), (10, 10), (1, 1), (0, 1), (5, 10), (99, 100)])
def test_wilson_intervals_stay_inside_0_1_and_hold_the_estimate(k, n):
    low, high = wilson_ci(k, n)
    assert 0.0 <= low <= k / n <= high <= 1.0
    assert high - low > 0


def test_wilson_interval_known_value():
    low, high = wilson_ci(10, 10)  # Wilson (1927): 10 of 10 -> [0.7225, 1]
    assert math.isclose(low, 0.7225, abs_tol=1e-4) and high == 1.0
    assert wilson_ci(0, 0) is None


def test_rm_accuracy_interval_stays_inside_0_1_when_every_pair_is_right():
    chosen, rejected = torch.tensor([2.0, 3.0, 1.0, 5.0]), torch.tensor([0.0, 1.0, -1.0, 0.0])
    m = pairwise_metrics(chosen, rejected, [3, 4, 5, 6], [3, 4, 5, 6])
    assert m["accuracy"] == 1.0 and 0.0 <= m["accuracy_ci"][0] < 1.0 and m["accuracy_ci"][1] == 1.0


def test_paired_interval_known_values():
    """Differences 2, 0, 1: mean 1, sample sd 1, standard error 1 / sqrt(3), 95% interval 1 +- 1.96 / sqrt(3)."""
    mean, ci = paired_ci([3.0, 1.0, 2.0], [1.0, 1.0, 1.0])
    half = 1.96 / math.sqrt(3)
    assert mean == 1.0 and ci == pytest.approx([1 - half, 1 + half])
    assert paired_ci([0.5], [0.0]) == (0.5, None)  # one pair: no interval
    assert paired_ci([1.0, 1.0], [0.0, 0.0]) == (1.0, [1.0, 1.0])  # no spread

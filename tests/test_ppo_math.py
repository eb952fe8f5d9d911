"""PPO's arithmetic (`rlhf_trl.ppo_math`) against values computed by hand, and the engine's chunked log-probs."""

import math

import pytest
import torch

from rlhf_trl import ppo_math as pm


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    assert pm.kl_estimate(logp, ref, "k1").item() == pytest.approx(math.log(2))  # log p - log p_ref
    assert pm.kl_estimate(logp, ref, "k3").item() == pytest.approx(-0.5 + math.log(2))  # (r - 1) - log r, r = 0.5
    assert pm.kl_estimate(ref, logp, "k3").item() >= 0
    with pytest.raises(ValueError, match="kl_estimator must be 'k1' or 'k3', got 'k2'"):
        pm.kl_estimate(logp, ref, "k2")


def test_gae_from_the_last_token_backwards():
    rewards, values = torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.5, 0.5]])
    adv, ret = pm.gae(rewards, values, gamma=1.0, lam=0.95)
    # t=2: delta = 1 - 0.5 = 0.5; t=1: delta 0, A = 0.95 * 0.5; t=0: A = 0.95 * 0.475
    torch.testing.assert_close(adv, torch.tensor([[0.45125, 0.475, 0.5]]))
    torch.testing.assert_close(ret, adv + values)
    adv, _ = pm.gae(rewards, values, gamma=0.9, lam=0.5)
    # t=2: 0.5; t=1: delta = 0.9 * 0.5 - 0.5 = -0.05, A = -0.05 + 0.45 * 0.5; t=0: A = -0.05 + 0.45 * 0.175
    torch.testing.assert_close(adv, torch.tensor([[0.02875, 0.175, 0.5]]))


def test_reward_shaping_puts_the_score_after_the_last_token():
    kl = torch.tensor([[0.1, 0.2, 0.0, 0.0], [0.1, 0.1, 0.1, 0.1]])
    rewards, non_score = pm.shape_rewards(kl, torch.tensor([2.0, -1.0]), kl_coef=0.5,
                                          sequence_lengths=torch.tensor([1, 3]))
    torch.testing.assert_close(non_score, -0.5 * kl)
    # row 0 ends at index 1: score at index 2; row 1 fills the width: score at its last token
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, -0.1, 2.0, 0.0], [-0.05, -0.05, -0.05, -1.05]]))


def test_masks_and_first_true_indices():
    assert pm.first_true_indices(torch.tensor([[False, True, True], [False, False, False]])).tolist() == [1, 3]
    lengths = torch.tensor([1, 3])
    assert pm.response_padding_mask(lengths, 4).tolist() == [[False, False, True, True], [False] * 4]
    assert pm.value_padding_mask(lengths, 4).tolist() == [[False, False, False, True], [False] * 4]
    assert pm.score_positions(lengths, 4).tolist() == [2, 3]


def test_masked_whitening_by_hand():
    values, mask = torch.tensor([1.0, 2.0, 3.0, 100.0]), torch.tensor([True, True, True, False])
    assert pm.masked_mean(values, mask).item() == pytest.approx(2.0)
    assert pm.masked_var(values, mask).item() == pytest.approx(1.0)  # (1 + 0 + 1) / 2: Bessel-corrected
    torch.testing.assert_close(pm.masked_whiten(values, mask)[:3], torch.tensor([-1.0, 0.0, 1.0]))
    torch.testing.assert_close(pm.masked_whiten(values, mask, shift_mean=False)[:3], torch.tensor([1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match="empty mask"):
        pm.masked_var(values, torch.zeros(4, dtype=torch.bool))


def test_clipped_policy_loss_by_hand():
    old = torch.log(torch.tensor([[0.2, 0.2]]))
    new = torch.log(torch.tensor([[0.3, 0.3]]))  # ratio 1.5
    mask = torch.tensor([[True, False]])
    up = pm.policy_loss(new, old, torch.tensor([[1.0, 9.0]]), mask, cliprange=0.2)
    assert up["loss"].item() == pytest.approx(-1.2)  # max(-1.5, -1.2): the clipped term
    assert up["clipfrac"].item() == 1.0 and up["ratio"].item() == pytest.approx(1.5)
    assert up["approxkl"].item() == pytest.approx(0.5 * math.log(1.5) ** 2)
    down = pm.policy_loss(new, old, torch.tensor([[-1.0, 9.0]]), mask, cliprange=0.2)
    assert down["loss"].item() == pytest.approx(1.5) and down["clipfrac"].item() == 0.0  # max(1.5, 1.2)


def test_clipped_value_loss_by_hand():
    out = pm.value_loss(torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([[2.0]]),
                        torch.tensor([[True]]), cliprange_value=0.2)
    assert out["loss"].item() == pytest.approx(0.5 * (0.2 - 2.0) ** 2)  # max((1-2)^2, (0.2-2)^2) / 2
    assert out["clipfrac"].item() == 1.0


def test_selective_log_softmax_and_entropy():
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(0))
    index = torch.tensor([[0, 3, 6], [1, 1, 2]])
    expected = torch.log_softmax(logits, -1).gather(-1, index[..., None])[..., 0]
    torch.testing.assert_close(pm.selective_log_softmax(logits, index), expected)
    torch.testing.assert_close(pm.selective_log_softmax(logits.bfloat16(), index), expected.bfloat16(), atol=0.05,
                               rtol=0.05)
    assert pm.entropy_from_logits(torch.zeros(1, 1, 7)).item() == pytest.approx(math.log(7))


def test_chunked_response_logprobs_equal_whole_ones_with_gradients():
    """The engine forms logits ``logits_chunk_size`` positions at a time (recomputed in the backward): same
    log-probs and same gradients as forming them all at once."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlhf_trl.ppo_engine import response_logprobs

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


def test_a_frozen_lm_head_gives_its_gradient_rows_in_the_forward_pass(monkeypatch):
    """A frozen plain LM head (a LoRA policy's) takes `FrozenHeadLogprobs`: one LM-head product per chunk (none in the
    backward pass: no recomputation), log-probs and entropy bit for bit those of the checkpointed path, and the
    trained parameters' gradients those of plain autograd through whole logits, to fp32 rounding. A head that trains
    keeps the checkpointed path."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlhf_trl.ppo_engine import FrozenHeadLogprobs, response_logprobs

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, pad_token_id=0))
    model.lm_head.weight.requires_grad_(False)
    qr = torch.tensor([[0, 5, 6, 7, 8, 9, 10, 0], [3, 4, 5, 6, 7, 8, 9, 11]])  # prompt 3 tokens, response 5
    weights = torch.randn(2, 5)  # a loss that weighs each position's log-prob differently
    heads, applied = [], []
    model.lm_head.register_forward_pre_hook(lambda module, args: heads.append(1))
    real = FrozenHeadLogprobs.apply
    monkeypatch.setattr(FrozenHeadLogprobs, "apply", lambda *a: applied.append(1) or real(*a))
    lp, ent = response_logprobs(model, qr, 3, 0, temperature=0.7, chunk_size=2, with_entropy=True)
    assert len(applied) == len(heads) == 3  # chunks of 2, 2 and 1 positions
    (lp * weights).sum().backward()
    assert len(heads) == 3
    rank_one = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    logits = model(input_ids=qr, attention_mask=qr != 0).logits[:, 2:-1] / (0.7 + 1e-7)
    (pm.selective_log_softmax(logits, qr[:, 3:]) * weights).sum().backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(rank_one[name], p.grad, rtol=1e-5, atol=1e-6)
    model.lm_head.weight.requires_grad_(True)  # a trained head: checkpointed chunks, the head in the backward too
    heads.clear()
    lp2, ent2 = response_logprobs(model, qr, 3, 0, temperature=0.7, chunk_size=2, with_entropy=True)
    lp2.sum().backward()
    assert len(heads) == 6 and torch.equal(lp2, lp) and torch.equal(ent2, ent)


def test_response_logprobs_feed_the_lm_head_contiguous_rows():
    """The response positions are a strided slice of the hidden states; the LM head gets them contiguous, so that
    its product is one matmul (a strided 3-D input goes through a broadcast bmm: measured 1.75 s against ~0.7 s per
    chunk of 8 x 32 positions on Qwen2.5-0.5B, the largest single cost of the policy's backward)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlhf_trl.ppo_engine import response_logprobs

    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, pad_token_id=0))
    seen = []
    model.lm_head.register_forward_pre_hook(lambda module, args: seen.append(args[0].is_contiguous()))
    qr = torch.tensor([[0, 5, 6, 7, 8, 9, 10, 0], [3, 4, 5, 6, 7, 8, 9, 11]])
    response_logprobs(model, qr, 3, 0, temperature=0.7, chunk_size=2).sum().backward()
    assert seen and all(seen)  # every chunk, the backward's recomputation included


def test_inverse_cdf_sample_by_hand_and_in_distribution():
    """Inverting the CDF at u: by hand on one row, never a zero-probability entry, and over 200,000 draws the
    frequencies of `torch.multinomial`'s distribution (within 5 standard errors)."""
    probs = torch.tensor([[0.0, 0.2, 0.0, 0.5, 0.3]])
    for u, want in ((0.0, 1), (0.19, 1), (0.2, 3), (0.69, 3), (0.7, 4), (0.999, 4)):
        assert pm.inverse_cdf_sample(probs, torch.tensor([u], dtype=torch.float64)).tolist() == [want]
    unnormalised = probs * 7.0  # any positive row total
    assert pm.inverse_cdf_sample(unnormalised, torch.tensor([0.5], dtype=torch.float64)).tolist() == [3]
    gen = torch.Generator().manual_seed(0)
    n = 200_000
    draws = pm.inverse_cdf_sample(probs.expand(n, -1), torch.rand(n, dtype=torch.float64, generator=gen))
    freq = torch.bincount(draws, minlength=5).double() / n
    p = probs[0].double()
    assert freq[0] == 0 and freq[2] == 0
    assert torch.all((freq - p).abs() <= 5 * torch.sqrt(p * (1 - p) / n) + 1e-12), freq


def test_the_inverse_cdf_rollout_sampler_routes_generates_draws():
    """Inside `rollout_sampler("inverse_cdf")` a `[batch, V]` multinomial draw is `inverse_cdf_sample` at one
    `torch.rand` uniform per row (the same numbers for the same seed); other calls and the block's end leave
    PyTorch's own; an unknown name is refused."""
    from rlhf_trl.ppo_engine import rollout_sampler

    real = torch.multinomial
    probs = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(1)), -1)
    torch.manual_seed(3)
    want = pm.inverse_cdf_sample(probs, torch.rand(4, dtype=torch.float64))
    with rollout_sampler("inverse_cdf"):
        torch.manual_seed(3)
        got = torch.multinomial(probs, num_samples=1)
        assert torch.multinomial(probs, num_samples=3).shape == (4, 3)  # PyTorch's for anything else
    assert torch.equal(got[:, 0], want) and torch.multinomial is real
    with rollout_sampler("multinomial"):
        assert torch.multinomial is real
    with pytest.raises(ValueError, match=r"^rollout_sampler must be 'multinomial' or 'inverse_cdf', got 'gumbel'$"):
        with rollout_sampler("gumbel"):
            pass

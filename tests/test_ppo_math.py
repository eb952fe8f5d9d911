"""PPO's arithmetic (`rlhf_trl.ppo_math`) against values computed by hand. The chunked log-probs the engine forms
(`rlhf_trl.scoring.response_logprobs`) are in test_scoring.py."""

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


def test_compute_advantages_by_hand():
    """One response of 2 real tokens in 3 positions: KL (k1), the score one past the last token, GAE (gamma 1,
    lambda 0.5) from the end, returns = advantages + values, then advantages whitened over the 2 real tokens."""
    out = pm.compute_advantages(
        logprobs=torch.tensor([[-1.0, -2.0, 0.5]]), ref_logprobs=torch.tensor([[-1.5, -2.0, 0.3]]),
        values=torch.tensor([[0.5, 1.0, 2.0]]), scores=torch.tensor([3.0]), sequence_lengths=torch.tensor([1]),
        kl_coef=0.1, gamma=1.0, lam=0.5, whiten_advantages=False)
    assert out["padding_mask"].tolist() == [[False, False, True]]
    assert out["padding_mask_p1"].tolist() == [[False, False, False]]
    torch.testing.assert_close(out["logprobs"], torch.tensor([[-1.0, -2.0, pm.INVALID_LOGPROB]]))
    torch.testing.assert_close(out["kl"], torch.tensor([[0.5, 0.0, 0.0]]))
    torch.testing.assert_close(out["non_score_reward"], torch.tensor([[-0.05, 0.0, 0.0]]))
    # rewards [-0.05, 0, 3]; deltas [0.45, 1.0, 1.0]; A2 = 1, A1 = 1 + 0.5 * 1, A0 = 0.45 + 0.5 * 1.5
    torch.testing.assert_close(out["advantages"], torch.tensor([[1.2, 1.5, 1.0]]))
    torch.testing.assert_close(out["returns"], torch.tensor([[1.7, 2.5, 3.0]]))
    whitened = pm.compute_advantages(
        torch.tensor([[-1.0, -2.0, 0.5]]), torch.tensor([[-1.5, -2.0, 0.3]]), torch.tensor([[0.5, 1.0, 2.0]]),
        torch.tensor([3.0]), torch.tensor([1]), kl_coef=0.1, gamma=1.0, lam=0.5)
    # mean 1.35 and unbiased variance 0.045 over the two real tokens; the padded position is 0
    torch.testing.assert_close(whitened["advantages"], torch.tensor([[-0.15, 0.15, 0.0]]) / math.sqrt(0.045 + 1e-8))
    torch.testing.assert_close(whitened["returns"], out["returns"])  # returns come before whitening
    k3 = pm.compute_advantages(torch.tensor([[-1.0]]), torch.tensor([[-1.5]]), torch.tensor([[0.0]]),
                               torch.tensor([0.0]), torch.tensor([0]), kl_coef=1.0, kl_estimator="k3",
                               whiten_advantages=False)
    torch.testing.assert_close(k3["kl"], torch.tensor([[math.exp(-0.5) - 1 + 0.5]]))

"""PPO's arithmetic for language models as pure tensor functions (``batch`` rollouts, ``R`` response positions, ``V``
vocabulary entries): Ziegler et al. 2019 ("Fine-Tuning Language Models from Human Preferences"), Schulman et al. 2016
(GAE) and 2017 (PPO's clipped objectives), Huang et al. 2024 ("The N+ Implementation Details of RLHF with PPO"), as TRL
1.12's PPOTrainer computes them (tests/test_ppo_oracle.py). Positions (docs/ppo-engine.md): ``sequence_lengths[i]`` is
the index of response ``i``'s last real token; log-probs are real through it, values (and the score) one further."""

from __future__ import annotations

import torch

INVALID_LOGPROB = 1.0  # written into padded log-prob positions (as TRL); both policy and reference get it: KL 0


def first_true_indices(bools: torch.Tensor) -> torch.Tensor:
    """Index of the first ``True`` of each row, or the row length if there is none: ``[batch, R] -> [batch]``."""
    width = bools.shape[-1]
    return torch.where(bools, torch.arange(width, device=bools.device).expand_as(bools), width).min(-1).values


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[..., index]`` without a second ``[..., V]`` tensor, ``[b, R, V], [b, R] -> [b, R]``, as
    TRL's ``selective_log_softmax`` (fp32 / fp64: logit minus logsumexp; else a per-row log_softmax)."""
    if logits.dtype in (torch.float32, torch.float64):
        selected = torch.gather(logits, -1, index.unsqueeze(-1)).squeeze(-1)
        return selected - torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
    return torch.stack([torch.log_softmax(row, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
                        for row, ids in zip(logits, index)])


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` per position, in nats: ``[b, R, V] -> [b, R]``."""
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is true (same shapes)."""
    return (values * mask).sum() / mask.sum()


def masked_var(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Bessel-corrected variance of ``values`` where ``mask`` is true. Raises `ValueError`: the mask selects nothing."""
    count = mask.sum()
    if count == 0:
        raise ValueError("whitening over an empty mask: raise the mini-batch size")
    return masked_mean((values - masked_mean(values, mask)) ** 2, mask) * count / (count - 1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """``(values - mean) / sqrt(var + 1e-8)`` over the masked entries (``shift_mean=False`` adds the mean back)."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def response_padding_mask(sequence_lengths: torch.Tensor, width: int) -> torch.Tensor:
    """``True`` after each response's last real token: ``[batch] -> [batch, width]`` (log-probs are masked there)."""
    return torch.arange(width, device=sequence_lengths.device)[None, :] > sequence_lengths[:, None]


def value_padding_mask(sequence_lengths: torch.Tensor, width: int) -> torch.Tensor:
    """``True`` two or more positions after the last real token: ``[batch] -> [batch, width]`` (values, rewards)."""
    return response_padding_mask(sequence_lengths + 1, width)


def score_positions(sequence_lengths: torch.Tensor, width: int) -> torch.Tensor:
    """Where each score is added: one past the last real token (the last token if final): ``[batch] -> [batch]``."""
    return (sequence_lengths + 1).clamp(max=width - 1)


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens' log-probs, nats: ``[b, R] x 2 -> [b, R]``.
    ``k1``: ``logp - logp_ref`` (can be negative per token); ``k3``: ``(r - 1) - log r``, ``r = p_ref / p`` (never
    negative, lower variance); J. Schulman, "Approximating KL Divergence" (2020). Raises `ValueError`: unknown."""
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k3":
        return log_ratio.exp() - 1 - log_ratio
    raise ValueError(f"kl_estimator must be 'k1' or 'k3', got {estimator!r}")


def shape_rewards(kl: torch.Tensor, scores: torch.Tensor, kl_coef: float,
                  sequence_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards, ``-kl_coef * kl`` everywhere plus each sequence's score at `score_positions` (Ziegler et al.
    2019, eq. 2): ``kl [b, R]`` (nats), ``scores [b]`` (reward units, baseline and penalties already applied),
    ``sequence_lengths [b]`` -> ``(rewards [b, R], non_score_reward [b, R])``."""
    non_score_reward = -kl_coef * kl
    rewards = non_score_reward.clone()
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, score_positions(sequence_lengths, rewards.shape[1])] += scores
    return rewards, non_score_reward


def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation, backwards (Schulman et al. 2016, eq. 16): ``delta_t = r_t + gamma * V_{t+1} -
    V_t`` (``V_R = 0``), ``A_t = delta_t + gamma * lam * A_{t+1}``, ``returns = A + V``. ``rewards, values [b, R] ->
    (advantages [b, R], returns [b, R])``; padded positions must hold zero values and rewards."""
    width, last, reversed_advantages = rewards.shape[1], torch.zeros_like(rewards[:, 0]), []
    for t in reversed(range(width)):
        next_value = values[:, t + 1] if t < width - 1 else 0.0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = delta + gamma * lam * last
        reversed_advantages.append(last)
    advantages = torch.stack(reversed_advantages[::-1], dim=1)
    return advantages, advantages + values


def policy_loss(new_logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, cliprange: float) -> dict[str, torch.Tensor]:
    """PPO's clipped surrogate loss (Schulman et al. 2017, eq. 7) over real tokens: ``new_logprobs, old_logprobs,
    advantages, mask [b, R]`` (mask: true on real tokens) -> scalars ``loss``, ``clipfrac`` (share of tokens clipped),
    ``ratio`` (mean probability ratio, all positions), ``approxkl`` (``0.5 * mean(log_ratio^2)``)."""
    log_ratio = new_logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped, clipped = -advantages * ratio, -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = masked_mean(torch.max(unclipped, clipped), mask)
    with torch.no_grad():
        clipfrac, approxkl = masked_mean((clipped > unclipped).float(), mask), 0.5 * (log_ratio ** 2).mean()
    return {"loss": loss, "clipfrac": clipfrac, "ratio": ratio.mean().detach(), "approxkl": approxkl}


def value_loss(new_values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               cliprange_value: float) -> dict[str, torch.Tensor]:
    """Clipped value loss ``0.5 * mean(max((V - G)^2, (clip(V, V_old +- c) - G)^2))`` over real positions:
    ``new_values, old_values, returns, mask [b, R]`` -> ``{"loss", "clipfrac"}`` (scalars)."""
    unclipped = (new_values - returns) ** 2
    clipped = (torch.clamp(new_values, old_values - cliprange_value, old_values + cliprange_value) - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(unclipped, clipped), mask)
    with torch.no_grad():
        clipfrac = masked_mean((clipped > unclipped).float(), mask)
    return {"loss": loss, "clipfrac": clipfrac}


def compute_advantages(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, values: torch.Tensor, scores: torch.Tensor,
                       sequence_lengths: torch.Tensor, kl_coef: float, kl_estimator: str = "k1", gamma: float = 1.0,
                       lam: float = 0.95, whiten_rewards: bool = False,
                       whiten_advantages: bool = True) -> dict[str, torch.Tensor]:
    """Step 3 of a PPO update, as TRL 1.12's PPOTrainer: ``logprobs, ref_logprobs [b, R]`` (nats, unmasked), ``values
    [b, R]``, ``scores [b]`` (reward units), ``sequence_lengths [b]`` -> dict of ``[b, R]`` tensors: ``padding_mask``
    (log-probs'), ``padding_mask_p1`` (values'), ``logprobs`` and ``values`` masked (`INVALID_LOGPROB`, 0), ``kl``,
    ``non_score_reward`` (``-kl_coef * kl``), ``advantages`` (`gae`; whitened over real tokens if ``whiten_advantages``)
    and ``returns``. ``whiten_rewards`` whitens the shaped rewards first (without shifting their mean)."""
    width = logprobs.shape[1]
    padding_mask = response_padding_mask(sequence_lengths, width)
    padding_mask_p1 = value_padding_mask(sequence_lengths, width)
    logprobs = logprobs.masked_fill(padding_mask, INVALID_LOGPROB)
    values = values.masked_fill(padding_mask_p1, 0)
    kl = kl_estimate(logprobs, ref_logprobs.masked_fill(padding_mask, INVALID_LOGPROB), kl_estimator)
    rewards, non_score_reward = shape_rewards(kl, scores, kl_coef, sequence_lengths)
    if whiten_rewards:
        rewards = masked_whiten(rewards, ~padding_mask_p1, shift_mean=False).masked_fill(padding_mask_p1, 0)
    advantages, returns = gae(rewards, values, gamma, lam)
    if whiten_advantages:
        advantages = masked_whiten(advantages, ~padding_mask).masked_fill(padding_mask, 0)
    return {"padding_mask": padding_mask, "padding_mask_p1": padding_mask_p1, "logprobs": logprobs, "values": values,
            "kl": kl, "non_score_reward": non_score_reward, "advantages": advantages, "returns": returns}


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 ("Fine-Tuning Language Models from Human Preferences", 2.2):
    after an update of ``n_steps`` episodes with mean KL ``kl`` (nats per response),
    ``coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon``."""

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        self.value, self.target, self.horizon = float(init_kl_coef), float(target), int(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        error = max(-0.2, min(0.2, current_kl / self.target - 1))
        self.value *= 1 + error * n_steps / self.horizon
        return self.value

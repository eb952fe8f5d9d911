"""Reward-model scoring shared by RM evaluation, PPO and the demo.

The score of a sequence is the reward model's ``score`` head applied to the hidden state of its last real token
(prompt ids + response ids + EOS, right-padded with a pad token distinct from EOS), as in `get_reward`, the
project's copy of the ``get_reward`` that TRL 1.12's PPOTrainer uses (TRL's experimental utils).
"""

from __future__ import annotations

import torch


def pad_right(sequences: list[list[int]], pad_token_id: int) -> torch.Tensor:
    """Right-pad token id lists into a ``[batch, max_len]`` long tensor."""
    width = max(len(s) for s in sequences)
    out = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    for i, s in enumerate(sequences):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out


def last_token_index(input_ids: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """Index of the last non-pad token of each right-padded row: ``[batch, seq_len] -> [batch]``.

    Raises:
        ValueError: a row is all padding.
    """
    real = input_ids != pad_token_id
    if not bool(real.any(dim=1).all()):
        raise ValueError("a sequence holds only pad tokens")
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    return (positions * real).argmax(dim=1)


@torch.no_grad()
def score_sequences(model, sequences: list[list[int]], pad_token_id: int, batch_size: int = 16) -> torch.Tensor:
    """Reward-model scores of token id sequences, ``[num_sequences]`` (float32, on CPU).

    Runs the model's backbone (``model.base_model_prefix``) and its ``score`` head, and reads the score at the last
    non-pad token, exactly as PPO does during rollouts. ``model`` may be a `peft.PeftModel` (e.g. the QLoRA reward
    model the RM stage evaluates: adapter on a 4-bit base): its active adapter and trained ``score`` copy are used.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    # a PeftModel's LoRA layers sit inside the transformers model (get_base_model); getattr(peft_model, "model")
    # would be that whole model, whose output has no last_hidden_state
    plain = model.get_base_model() if hasattr(model, "get_base_model") else model
    scores = []
    for i in range(0, len(sequences), batch_size):
        ids = pad_right(sequences[i : i + batch_size], pad_token_id).to(device)
        mask = ids != pad_token_id
        position_ids = mask.long().cumsum(1) - mask.long()
        backbone = getattr(plain, plain.base_model_prefix)
        hidden = backbone(
            input_ids=ids.masked_fill(~mask, 0), attention_mask=mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        logits = plain.score(hidden).squeeze(-1)  # [batch, seq_len]
        idx = last_token_index(ids, pad_token_id)
        scores.append(logits[torch.arange(len(idx), device=device), idx].float().cpu())
    model.train(was_training)
    return torch.cat(scores)


def first_true_indices(bools: torch.Tensor, dtype=torch.long) -> torch.Tensor:
    """Position of the first ``True`` of each row, or the row length where a row has none: ``[..., n] -> [...]``.

    Replaces TRL 1.12's ``first_true_indices`` (in its experimental ``utils`` module, which is not a stable API),
    with the same result.
    """
    row_len = bools.size(-1)
    zero_or_index = row_len * (~bools).type(dtype) + torch.arange(row_len, dtype=dtype, device=bools.device)
    return torch.min(zero_or_index, dim=-1).values


def get_reward(model, query_responses: torch.Tensor, pad_token_id: int, context_length: int):
    """Reward-model logits of every position and the score of each query + response, read at the response's end.

    ``query_responses``: ``[batch, context_length + response_len]``, the (left-padded) query ids followed by the
    response ids, right-padded with ``pad_token_id`` after the response. Pad positions are masked out of attention,
    position ids count the real tokens only, and the score is read at the last token before the response's first pad
    (the EOS that ends it, for a response that stopped).

    Returns ``(reward_logits [batch, seq_len, 1], scores [batch], sequence_lengths [batch])``.

    Replaces TRL 1.12's ``get_reward`` (in its experimental ``utils`` module: the scoring of its PPOTrainer; TRL has
    no stable equivalent): same arguments, masks and read-out, so the same scores. It reads the backbone's
    ``last_hidden_state`` (as `score_sequences` does, and as TRL does from 1.13 on) where TRL 1.12 read
    ``hidden_states[-1]`` of ``output_hidden_states=True``: the same tensor for transformers 5 decoders (both after
    the final norm), without keeping every layer's hidden states.
    """
    attention_mask = query_responses != pad_token_id
    position_ids = attention_mask.cumsum(1) - attention_mask.long()  # exclusive cumsum
    lm_backbone = getattr(model, model.base_model_prefix)
    input_ids = torch.masked_fill(query_responses, ~attention_mask, 0)
    output = lm_backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         return_dict=True, use_cache=False)
    reward_logits = model.score(output.last_hidden_state)
    sequence_lengths = first_true_indices(query_responses[:, context_length:] == pad_token_id) - 1 + context_length
    rows = torch.arange(reward_logits.size(0), device=reward_logits.device)
    return reward_logits, reward_logits[rows, sequence_lengths].squeeze(-1), sequence_lengths


def pairwise_metrics(chosen: torch.Tensor, rejected: torch.Tensor, chosen_len, rejected_len) -> dict:
    """Pairwise accuracy, mean margin and the length-only baseline for ``[num_pairs]`` score tensors.

    ``length_baseline_accuracy`` is the accuracy of "the longer response wins" (ties count half).
    """
    chosen_len = torch.as_tensor(chosen_len, dtype=torch.float)
    rejected_len = torch.as_tensor(rejected_len, dtype=torch.float)
    longer = (chosen_len > rejected_len).float() + 0.5 * (chosen_len == rejected_len).float()
    return {
        "accuracy": float((chosen > rejected).float().mean()),
        "margin": float((chosen - rejected).mean()),
        "length_baseline_accuracy": float(longer.mean()),
        "num_pairs": int(chosen.numel()),
    }


def eos_mask(tokens: torch.Tensor, eos_token_ids) -> torch.Tensor:
    """``True`` where a token is any of ``eos_token_ids`` (an int or a list): ``[batch, seq_len] -> [batch, seq_len]``."""
    ids = torch.as_tensor(eos_token_ids if isinstance(eos_token_ids, (list, tuple)) else [eos_token_ids],
                          device=tokens.device, dtype=tokens.dtype)
    return torch.isin(tokens, ids)


def truncate_at_eos(responses: torch.Tensor, eos_token_ids, pad_token_id: int) -> torch.Tensor:
    """Replace every token after the first EOS (any of ``eos_token_ids``) of each row by ``pad_token_id``.

    ``[batch, response_len] -> [batch, response_len]``; the EOS itself is kept, so the reward model's score is read
    at the response's own EOS (the last non-pad token). Rows without EOS are unchanged. The list-valued form of
    TRL 1.12's ``truncate_response`` (its experimental PPO trainer module), which stops at one id only.
    """
    hit = eos_mask(responses, eos_token_ids)
    first = torch.where(hit.any(1), hit.int().argmax(1), responses.shape[1])  # [batch]
    after = torch.arange(responses.shape[1], device=responses.device)[None, :] > first[:, None]
    return responses.masked_fill(after, pad_token_id)

"""Reward-model scoring shared by RM evaluation, PPO and the demo.

The score of a sequence is the reward model's ``score`` head applied to the hidden state of its last real token
(prompt ids + response ids + EOS, right-padded with a pad token distinct from EOS), as in TRL's
``get_reward`` that TRL 1.12's PPOTrainer used (`rlhf_trl.scoring.sequence_scores`).
"""

from __future__ import annotations

import torch

from .last_layer import reads_from


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


def _classifier_parts(model):
    """``(backbone, score_head)`` of a sequence classifier, a peft model on one, or `SharedBaseRewardModel`."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, base.base_model_prefix), base.score


def model_inputs(query_responses: torch.Tensor, pad_token_id: int) -> dict:
    """Model inputs of left-padded prompt + right-padded response ids ``[b, T]``: pad masked, positions counted."""
    mask = query_responses != pad_token_id
    return {"input_ids": query_responses.masked_fill(~mask, 0), "attention_mask": mask,
            "position_ids": mask.cumsum(1) - mask.long(), "use_cache": False}


def token_scores(model, query_responses: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """A sequence classifier's score head at every position: ``[b, T] -> [b, T]`` (reward units)."""
    backbone, head = _classifier_parts(model)
    hidden = backbone(**model_inputs(query_responses, pad_token_id)).last_hidden_state
    return head(hidden).squeeze(-1)


def response_hidden(backbone, query_responses: torch.Tensor, context_length: int, pad_token_id: int) -> torch.Tensor:
    """A backbone's last hidden states before each response token: ``[b, T] -> [b, R, hidden]``, ``R = T -
    context_length``, positions ``context_length - 1 .. T - 2`` (what predicts, or values, each response token).

    The same numbers as the full forward's there (up to fp32 rounding) for less work: the last token is not fed (no
    read position sees it) and the last decoder layer forms its output at the ``R`` read positions only
    (`last_layer.reads_from`). Shared by the policy's and reference's log-probs and the value model's estimates.
    """
    with reads_from(backbone, context_length - 1):
        hidden = backbone(**model_inputs(query_responses[:, :-1], pad_token_id)).last_hidden_state
    return hidden[:, context_length - 1:]


def response_values(model, query_responses: torch.Tensor, context_length: int, pad_token_id: int) -> torch.Tensor:
    """A value model's estimates before each response token: ``[b, T] -> [b, R]`` (reward units): the score head on
    `response_hidden`, TRL 1.12's ``values[:, context_length - 1 : -1]`` (`token_scores` there, to fp32 rounding)."""
    backbone, head = _classifier_parts(model)
    return head(response_hidden(backbone, query_responses, context_length, pad_token_id)).squeeze(-1)


def sequence_scores(model, query_responses: torch.Tensor, pad_token_id: int, context_length: int) -> torch.Tensor:
    """The reward model's score of each sequence, read at its last non-pad response token: ``[b, T] -> [b]``.

    Agrees with TRL 1.12's ``get_reward`` (its experimental utilities; ``[1]`` of its result). Feeds the tokens up to
    the latest such token and forms the last decoder layer's output from the earliest one on (`last_layer.reads_from`):
    the same scores, up to fp32 rounding, for less work.
    """
    hit = query_responses[:, context_length:] == pad_token_id  # the last response token precedes its first pad
    first_pad = torch.where(hit.any(1), hit.int().argmax(1), hit.shape[1])
    last = first_pad - 1 + context_length
    backbone, head = _classifier_parts(model)
    with reads_from(backbone, int(last.min())):
        hidden = backbone(**model_inputs(query_responses[:, :int(last.max()) + 1], pad_token_id)).last_hidden_state
    return head(hidden[torch.arange(len(last), device=last.device), last]).squeeze(-1)


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
    scores = []
    for i in range(0, len(sequences), batch_size):
        ids = pad_right(sequences[i : i + batch_size], pad_token_id).to(device)
        logits = token_scores(model, ids, pad_token_id)  # [batch, seq_len]
        idx = last_token_index(ids, pad_token_id)
        scores.append(logits[torch.arange(len(idx), device=device), idx].float().cpu())
    model.train(was_training)
    return torch.cat(scores)


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
    TRL 1.12's ``truncate_response`` (its PPOTrainer module), which stops at one id only.
    """
    hit = eos_mask(responses, eos_token_ids)
    first = torch.where(hit.any(1), hit.int().argmax(1), responses.shape[1])  # [batch]
    after = torch.arange(responses.shape[1], device=responses.device)[None, :] > first[:, None]
    return responses.masked_fill(after, pad_token_id)

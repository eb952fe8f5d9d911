"""The tensor operations every stage shares (PPO, ``rlhf-trl eval``, the demo, RM evaluation), one implementation
each: sampling, log-probs, values and reward-model scores. ``query_responses [batch, T]`` holds a left-padded prompt
of ``context_length`` tokens, then the response (right-padded with ``pad_token_id``, distinct from every EOS id);
models see pads masked and positions counted from the first real token (`model_inputs`)."""

from __future__ import annotations

import copy
import functools
import random
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

from . import ppo_math as pm
from .models import sampling_generation_config


def rng_state() -> dict:
    """Python, numpy and torch (CPU, CUDA) RNG states."""
    cuda = {"cuda": torch.cuda.random.get_rng_state_all()} if torch.cuda.is_available() else {}
    return {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()} | cuda


def set_rng_state(state: dict) -> None:
    """Put back the RNG states `rng_state` returned."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.random.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.random.set_rng_state_all(state["cuda"])


@contextmanager
def preserved_rng():
    """Run a block without changing any RNG state seen after it (for sampling that is not part of training)."""
    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)


def pad_left(sequences: list[list[int]], pad_token_id: int) -> torch.Tensor:
    """Left-pad token id lists into a ``[batch, max_len]`` long tensor (prompts for ``generate``)."""
    width = max(len(s) for s in sequences)
    return torch.tensor([[pad_token_id] * (width - len(s)) + list(s) for s in sequences], dtype=torch.long)


def pad_right(sequences: list[list[int]], pad_token_id: int) -> torch.Tensor:
    """Right-pad token id lists into a ``[batch, max_len]`` long tensor."""
    width = max(len(s) for s in sequences)
    return torch.tensor([list(s) + [pad_token_id] * (width - len(s)) for s in sequences], dtype=torch.long)


def model_inputs(query_responses: torch.Tensor, pad_token_id: int) -> dict:
    """Model inputs of left-padded prompt + right-padded response ids ``[b, T]``: pad masked, positions counted."""
    mask = query_responses != pad_token_id
    return {"input_ids": query_responses.masked_fill(~mask, 0), "attention_mask": mask,
            "position_ids": mask.cumsum(1) - mask.long(), "use_cache": False}


def _parts(model, head: str):
    """``(backbone, head)`` of a (peft) causal LM (``head="lm"``), classifier, shared-base RM or the policy's
    `rlhf_trl.policy_value.ValueHead` (``"score"``)."""
    if head == "score" and hasattr(model, "score_parts"):
        return model.score_parts()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, base.base_model_prefix), (base.get_output_embeddings() if head == "lm" else base.score)


def eos_mask(tokens: torch.Tensor, eos_token_ids) -> torch.Tensor:
    """``True`` where a token is any of ``eos_token_ids`` (an int or a list): ``[batch, seq_len]`` -> the same."""
    return torch.isin(tokens, torch.as_tensor(eos_token_ids, device=tokens.device, dtype=tokens.dtype))


def truncate_at_eos(responses: torch.Tensor, eos_token_ids, pad_token_id: int) -> torch.Tensor:
    """Pad every token after each row's first EOS (kept): ``[b, R] -> [b, R]``; TRL 1.12's ``truncate_response``."""
    first = pm.first_true_indices(eos_mask(responses, eos_token_ids))  # [batch]
    return responses.masked_fill(torch.arange(responses.shape[1], device=responses.device)[None, :] > first[:, None],
                                 pad_token_id)


@torch.no_grad()
def generate_rollouts(policy, queries: torch.Tensor, pad_token_id: int, generation_config,
                      batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one response per left-padded prompt, ``batch`` prompts per ``generate`` call: ``queries [b, Q]`` ->
    ``(query_responses [b, Q + R], logprobs [b, R])`` (right-padded with ``pad_token_id`` / 0.0; log-probs under
    ``logits / temperature``). TRL 1.12's ``batch_generation``, with one ``[rows, vocab]`` log-softmax per step."""
    context, config = queries.shape[1], copy.deepcopy(generation_config)
    config.return_dict_in_generate, config.output_scores = True, True  # the sampling logits give the log-probs
    pieces, logps = [], []
    for i in range(0, queries.shape[0], batch):
        query = queries[i:i + batch]
        mask = query != pad_token_id
        out = policy.generate(input_ids=query.masked_fill(~mask, 0), attention_mask=mask, generation_config=config)
        response = out.sequences[:, context:]
        logps.append(torch.stack([pm.selective_log_softmax(s[None], response[None, :, t])[0]
                                  for t, s in enumerate(out.scores)], 1))
        pieces.append(torch.cat((query, response), 1))
        del out
    width = max(p.shape[1] for p in pieces)
    return (torch.cat([nn.functional.pad(p, (0, width - p.shape[1]), value=pad_token_id) for p in pieces]),
            torch.cat([nn.functional.pad(p, (0, width - context - p.shape[1]), value=0.0) for p in logps]))


def sample(model, prompts: list[list[int]], pad_token_id: int, eos_token_ids, max_new_tokens: int,
           temperature: float, seed: int, batch_size: int = 64) -> list[tuple[list[int], bool]]:
    """PPO's sampling of one response per prompt: ``(ids through the first EOS, ended with EOS)`` each, seeded once."""
    eos = list(eos_token_ids) if isinstance(eos_token_ids, (list, tuple)) else [eos_token_ids]
    config = sampling_generation_config(temperature, max_new_tokens, eos, pad_token_id)
    model.eval()
    queries = pad_left(prompts, pad_token_id).to(next(model.parameters()).device)
    torch.manual_seed(seed)
    query_responses, _ = generate_rollouts(model, queries, pad_token_id, config, batch_size)
    responses = truncate_at_eos(query_responses[:, queries.shape[1]:], eos, pad_token_id).cpu()
    lengths = pm.first_true_indices(responses == pad_token_id).tolist()  # ends at its first pad, as PPO reads it
    return [(row[:n].tolist(), bool(eos_mask(row[:n], eos).any())) for row, n in zip(responses, lengths)]


def response_hidden(backbone, query_responses: torch.Tensor, context_length: int, pad_token_id: int) -> torch.Tensor:
    """A backbone's last hidden states before each response token (last token not fed): ``[b, T] -> [b, R, hidden]``."""
    return backbone(**model_inputs(query_responses[:, :-1], pad_token_id)).last_hidden_state[:, context_length - 1:]


def response_logprobs(policy, query_responses: torch.Tensor, context_length: int, pad_token_id: int,
                      temperature: float, chunk_size: int = 0, with_entropy: bool = False,
                      hidden: torch.Tensor | None = None):
    """Log-probs of the response tokens under ``softmax(logits / temperature)``: ``query_responses [b, T]`` ->
    ``logprobs [b, R]`` (and ``entropy [b, R]``, nats, no gradient). Logits are formed ``chunk_size`` response positions
    at a time (0: all), each chunk checkpointed under autograd. The engine passes TRL 1.12's ``temperature + 1e-7``.
    ``hidden``: `response_hidden` of the policy's backbone when the caller has it (a value head reads it too)."""
    backbone, lm_head = _parts(policy, "lm")
    if hidden is None:
        hidden = response_hidden(backbone, query_responses, context_length, pad_token_id)
    response = query_responses[:, context_length:]
    step = chunk_size if chunk_size and chunk_size > 0 else response.shape[1]

    def chunk(h, ids):  # one LM-head pass gives the chunk's log-probs and (without gradient) its entropy
        logits = lm_head(h) / temperature
        logprob = pm.selective_log_softmax(logits, ids)
        if not with_entropy:
            return logprob, None
        with torch.no_grad():
            return logprob, pm.entropy_from_logits(logits)

    checkpointed = torch.is_grad_enabled() and hidden.requires_grad and step < response.shape[1]
    run = functools.partial(torch.utils.checkpoint.checkpoint, chunk, use_reentrant=False) if checkpointed else chunk
    logprobs, entropies = zip(*(run(hidden[:, start:start + step], response[:, start:start + step])
                                for start in range(0, response.shape[1], step)))
    out = torch.cat(logprobs, 1)
    return (out, torch.cat(entropies, 1)) if with_entropy else out


def response_values(model, query_responses: torch.Tensor, context_length: int, pad_token_id: int) -> torch.Tensor:
    """The score head on `response_hidden`: value estimates (reward units), ``[b, T] -> [b, R]``, as TRL 1.12's."""
    backbone, head = _parts(model, "score")
    return head(response_hidden(backbone, query_responses, context_length, pad_token_id)).squeeze(-1)


def sft_loss(policy, input_ids: torch.Tensor, completion_mask: torch.Tensor, pad_token_id: int,
             chunk_size: int = 0) -> torch.Tensor:
    """The SFT loss of right-padded ``input_ids [b, L]``: mean negative log-likelihood (nats per token) of the tokens
    where ``completion_mask [b, L]`` is 1, at temperature 1 (`response_logprobs` from the first token on); PPO-ptx
    (InstructGPT, Ouyang et al. 2022, 3.5) mixes it into each PPO step. A scalar."""
    logprobs = response_logprobs(policy, input_ids, 1, pad_token_id, 1.0, chunk_size)  # tokens 1..L-1: [b, L-1]
    mask = completion_mask[:, 1:].to(logprobs.dtype)
    return -(logprobs * mask).sum() / mask.sum().clamp(min=1)


def last_token_index(query_responses: torch.Tensor, pad_token_id: int, context_length: int = 0) -> torch.Tensor:
    """Each row's last real token after ``context_length``: ``[b, T] -> [b]``. Raises `ValueError`: only pads."""
    last = pm.first_true_indices(query_responses[:, context_length:] == pad_token_id) - 1 + context_length
    if bool((last < 0).any()):
        raise ValueError("a sequence holds only pad tokens")
    return last


def sequence_scores(model, query_responses: torch.Tensor, pad_token_id: int, context_length: int) -> torch.Tensor:
    """The reward model's score at each sequence's last non-pad response token, ``[b, T] -> [b]`` (reward units): TRL
    1.12's ``get_reward``. Raises `ValueError`: a row has no real token to score (`last_token_index`)."""
    last = last_token_index(query_responses, pad_token_id, context_length)
    backbone, head = _parts(model, "score")
    hidden = backbone(**model_inputs(query_responses[:, :int(last.max()) + 1], pad_token_id)).last_hidden_state
    return head(hidden[torch.arange(len(last), device=last.device), last]).squeeze(-1)


@torch.no_grad()
def score_sequences(model, sequences: list[list[int]], pad_token_id: int, batch_size: int = 16) -> torch.Tensor:
    """RM scores ``[num_sequences]`` (float32, CPU) of id sequences, as PPO reads them. Raises `ValueError`: empty."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    batches = (pad_right(sequences[i: i + batch_size], pad_token_id).to(device)
               for i in range(0, len(sequences), batch_size))
    scores = [sequence_scores(model, ids, pad_token_id, 0).float().cpu() for ids in batches]
    model.train(was_training)
    return torch.cat(scores)


def pairwise_metrics(chosen: torch.Tensor, rejected: torch.Tensor, chosen_len, rejected_len) -> dict:
    """Pairwise accuracy, mean margin and length-only baseline (longer wins, ties half) of ``[num_pairs]`` scores, with
    95% intervals: ``accuracy_ci`` (Wilson score interval: inside [0, 1]) and ``length_gap_ci`` of ``length_gap``
    (accuracy minus the baseline, paired per pair, `paired_ci`; None for one pair: does the RM beat length?)."""
    chosen_len, rejected_len = (torch.as_tensor(n, dtype=torch.float) for n in (chosen_len, rejected_len))
    longer = ((chosen_len > rejected_len).float() + 0.5 * (chosen_len == rejected_len).float()).tolist()
    correct, n = (chosen > rejected).float().cpu().tolist(), int(chosen.numel())
    gap, gap_ci = paired_ci(correct, longer)
    return {"accuracy": sum(correct) / n, "margin": float((chosen - rejected).mean()),
            "length_baseline_accuracy": sum(longer) / n, "num_pairs": n,
            "accuracy_ci": wilson_ci(sum(correct), n), "length_gap": gap, "length_gap_ci": gap_ci}


Z95 = 1.96  # two-sided 95% normal quantile


def wilson_ci(successes: float, n: int) -> list[float] | None:
    """95% Wilson score interval of a proportion ``successes / n`` (Wilson 1927): inside [0, 1] even at 0 or n
    successes, where the normal approximation leaves it; None for n = 0."""
    if n < 1:
        return None
    p, z2 = successes / n, Z95 ** 2
    centre, half = (p + z2 / (2 * n)) / (1 + z2 / n), Z95 / (1 + z2 / n) * (p * (1 - p) / n + z2 / (4 * n * n)) ** 0.5
    return [max(0.0, centre - half), min(1.0, centre + half)]


def paired_ci(a: list[float], b: list[float]) -> tuple[float, list[float] | None]:
    """Mean of ``a[i] - b[i]`` over paired samples and its 95% interval: mean +- `Z95` standard errors (sample sd /
    sqrt(n)); None for fewer than 2 pairs."""
    diffs = [x - y for x, y in zip(a, b)]
    n, mean = len(diffs), sum(diffs) / len(diffs)
    if n < 2:
        return mean, None
    se = (sum((d - mean) ** 2 for d in diffs) / (n - 1) / n) ** 0.5
    return mean, [mean - Z95 * se, mean + Z95 * se]

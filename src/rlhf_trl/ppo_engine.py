"""The PPO engine: rollouts, rewards, advantages and clipped updates of a policy and a value model.

TRL removed its PPOTrainer in 1.13; this module is the project's own loop, written to the same algorithm (the math is
in `rlhf_trl.ppo_math`, each step a small pure function). `tests/test_ppo_oracle.py` checks ten updates of it against
TRL 1.12's ``PPOTrainer`` (live while trl 1.12 is installed, else against the trajectory
recorded in ``tests/fixtures/ppo_oracle.pt`` by ``benchmarks/ppo_oracle.py``).

One update (``PPOEngine.train``), for ``batch_size`` prompts of the data loader:

1. rollout (no gradients): sample a response per prompt with ``temperature`` only, stopping at any EOS id
   (`generate_rollouts`); the policy's log-probs of the sampled tokens come from the sampling logits;
2. the reference's log-probs (the policy with its LoRA adapter disabled, or a frozen copy), the value model's values
   and the reward: the reward model's score at the response's EOS (minus its baseline), plus weighted reward
   functions, minus ``missing_eos_penalty`` for responses that never end;
3. per-token rewards ``-kl_coef * KL`` plus the score at the end (`ppo_math.shape_rewards`), GAE advantages from
   the last token backwards, returns = advantages + values, advantages whitened over real tokens;
4. ``num_ppo_epochs`` passes over the batch in ``num_mini_batches`` shuffled mini-batches of micro-batches
   (``per_device_train_batch_size``; one optimizer step per mini-batch through gradient accumulation): clipped policy
   loss + ``vf_coef`` x clipped value loss.

With one PPO epoch of one mini-batch in one process (``single_value_forward``, the default), the value model runs
once per update instead of twice: its training forward (with gradient) on each micro-batch gives the rollout's values,
the micro-batch's returns and its value loss, back-propagated at once (`PPOEngine.value_step`). TRL 1.12 takes the
values from a separate no-grad forward in step 2; the weights are the same then, so the numbers are the same (to fp32
rounding where the rows are grouped differently), and the value loss is unclipped (``vf_clipfrac`` 0) in both.

Memory: the policy's vocabulary-sized logits are only formed for the response positions, ``logits_chunk_size``
positions at a time; with gradients a frozen LM head (a LoRA policy's) gives each chunk's gradient in the forward
pass as one ``[hidden]`` row per position (`FrozenHeadLogprobs`), a trained one recomputes the chunk in the backward
pass (activation checkpointing), so no ``[batch, seq_len, vocab]`` tensor (nor its softmax, nor their gradients) is
ever held whole.

Deliberate differences from TRL 1.12 (none changes a number on a tokenizer with one EOS id, the oracle's case):
every id of an EOS list ends a response (TRL: one id), the missing-EOS penalty and ``val/num_eos_tokens`` count any
of them; an adaptive KL coefficient, reward functions, ``logging_steps``, exact resume, a divergence stop and an opt-in
inverse-CDF sampler for rollouts (``rollout_sampler``: the same distribution, other tokens for a seed) exist.

Runs under ``accelerate`` like TRL's trainer: one process, DDP (``accelerate launch``), DeepSpeed ZeRO-2/3 (the
reward and reference models are prepared for inference; ZeRO-3 gathers the policy for generation when
``ds3_gather_for_generation``) or FSDP.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from torch import nn
from transformers import GenerationConfig, Trainer, TrainerControl, TrainerState, TrainingArguments

from . import ppo_math as pm
from .cpu import fuse_kernels, fuse_lora, lora_merged, mmap_threshold_raised, onednn_decoding, tensor_cache_installed
from .models import sampling_generation_config
from .scoring import eos_mask, response_hidden, response_values, sequence_scores, truncate_at_eos

logger = logging.getLogger(__name__)


@dataclass
class PPOConfig(TrainingArguments):
    """PPO settings: the keys (and defaults) of TRL 1.12's PPOConfig, so recipes written
    for it run unchanged, plus ``logits_chunk_size``.

    Batch sizes (episodes): ``batch_size = per_device_train_batch_size x gradient_accumulation_steps x processes``
    rollouts per update; ``num_total_batches`` updates = ceil(``total_episodes`` / ``batch_size``).
    """

    # defaults TRL's configs change from TrainingArguments
    learning_rate: float = field(default=3e-6, metadata={"help": "AdamW learning rate."})
    logging_steps: float = field(default=10, metadata={"help": "Updates between logged statistics."})
    gradient_checkpointing: bool = field(default=True, metadata={"help": "Recompute activations in the backward."})
    bf16: bool | None = field(default=None, metadata={"help": "bfloat16 weights (default: true unless fp16)."})
    lr_scheduler_kwargs: dict | str | None = field(default=None, metadata={"help": "Extra lr scheduler arguments."})
    # PPO
    dataset_num_proc: int | None = field(default=None, metadata={"help": "Unused (kept for TRL recipes)."})
    num_mini_batches: int = field(default=1, metadata={"help": "Mini-batches per rollout batch (optimizer steps)."})
    total_episodes: int | None = field(default=None, metadata={"help": "Episodes (prompt + response) to train on."})
    local_rollout_forward_batch_size: int = field(
        default=64, metadata={"help": "Rollouts generated / scored per forward pass (per process)."})
    num_sample_generations: int = field(default=10, metadata={"help": "Sample tables over the run (0: none)."})
    response_length: int = field(default=53, metadata={"help": "Maximum new tokens per response."})
    stop_token: Literal["eos"] | None = field(default=None, metadata={"help": "'eos': responses end at EOS."})
    stop_token_id: int | None = field(default=None, metadata={"help": "A token id that ends responses."})
    temperature: float = field(default=0.7, metadata={"help": "Rollout sampling temperature."})
    missing_eos_penalty: float | None = field(
        default=None, metadata={"help": "Subtracted from the score of responses without EOS (reward units)."})
    sft_model_path: str = field(default="EleutherAI/pythia-160m", metadata={"help": "Policy initialization."})
    reward_model_path: str | None = field(default="EleutherAI/pythia-160m", metadata={"help": "Reward model."})
    world_size: int | None = field(default=None, metadata={"help": "Computed: processes."})
    num_total_batches: int | None = field(default=None, metadata={"help": "Computed: updates."})
    micro_batch_size: int | None = field(default=None, metadata={"help": "Computed."})
    local_batch_size: int | None = field(default=None, metadata={"help": "Computed."})
    batch_size: int | None = field(default=None, metadata={"help": "Computed: episodes per update."})
    local_mini_batch_size: int | None = field(default=None, metadata={"help": "Computed."})
    mini_batch_size: int | None = field(default=None, metadata={"help": "Computed."})
    push_to_hub: bool = field(default=False, metadata={"help": "Push the model to the Hub after training."})
    model_adapter_name: str | None = field(default=None, metadata={"help": "Trained adapter (several adapters)."})
    ref_adapter_name: str | None = field(default=None, metadata={"help": "Reference adapter (several adapters)."})
    num_ppo_epochs: int = field(default=4, metadata={"help": "Optimisation passes over each rollout batch."})
    whiten_rewards: bool = field(default=False, metadata={"help": "Whiten per-token rewards (needs >= 8 per rank)."})
    kl_coef: float = field(default=0.05, metadata={"help": "KL coefficient (reward units per nat)."})
    kl_estimator: Literal["k1", "k3"] = field(default="k1", metadata={"help": "KL estimator: k1 or k3."})
    cliprange: float = field(default=0.2, metadata={"help": "Policy ratio clip range."})
    vf_coef: float = field(default=0.1, metadata={"help": "Value loss weight."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Value clip range (reward units)."})
    gamma: float = field(default=1.0, metadata={"help": "Discount factor."})
    lam: float = field(default=0.95, metadata={"help": "GAE lambda."})
    ds3_gather_for_generation: bool = field(
        default=True, metadata={"help": "ZeRO-3: gather the policy's weights for generation."})
    logits_chunk_size: int = field(
        default=32, metadata={"help": "Response positions whose vocabulary logits are formed at once (0: all)."})
    offload_reward_model: bool = field(
        default=False, metadata={"help": "Keep the reward model's weights on disk (output_dir/.tmp-offload-*) "
                                         "between rollouts: one model less in memory during the PPO epochs, one read "
                                         "of its weights per update."})
    onednn_decoding: bool = field(
        default=False, metadata={"help": "CPU, fp32: rollouts' decoding steps (<= 64 rows per matmul) through oneDNN "
                                         "instead of MKL (`rlhf_trl.cpu`: 1.3x faster generate on the AMD EPYC of "
                                         "bench-real); sampled log-probs then differ from MKL's in the last bits."})
    rollout_sampler: Literal["multinomial", "inverse_cdf"] = field(
        default="multinomial", metadata={"help": "How a rollout draws each token from softmax(logits / temperature): "
                                                 "'multinomial' (TRL's: torch.multinomial, one exponential draw per "
                                                 "vocabulary entry: 1.3 s of a 64-token rollout of 8 on Qwen2.5's "
                                                 "151,936 tokens in bench-real) or 'inverse_cdf' (the same "
                                                 "distribution from one uniform per row, `ppo_math."
                                                 "inverse_cdf_sample`; other tokens than multinomial's for a seed)."})
    fused_lora: bool = field(
        default=False, metadata={"help": "LoRA layers of policy and value model add their low-rank update into the "
                                         "base layer's output in one in-place addmm (`rlhf_trl.cpu.fuse_lora`): two "
                                         "passes less over every [tokens, out_features] output, forward and backward; "
                                         "rollouts generate with a temporary merged copy of each adapted weight "
                                         "(`rlhf_trl.cpu.lora_merged`; one copy more during generate). Equal to "
                                         "peft's to fp32 rounding."})
    fused_kernels: bool = field(
        default=False, metadata={"help": "CPU, fp32: the gated MLPs' silu(gate) * up and the RMSNorms (Qwen2, Llama, "
                                         "Baichuan) of policy, reference, value and reward model in one pass forward "
                                         "and one backward (`rlhf_trl.cpu.fuse_kernels`, small C++ kernels built on "
                                         "first use; needs a C++ compiler with OpenMP, else a warning and PyTorch's "
                                         "operations): fewer passes over memory, and silu(gate) no longer kept per "
                                         "layer. Equal to PyTorch's to fp32 rounding."})
    single_value_forward: bool = field(
        default=True, metadata={"help": "With 1 PPO epoch, 1 mini-batch, 1 process and whiten_rewards off: the value "
                                        "model's training forward also gives the rollout's values (one value forward "
                                        "less per update; `PPOEngine.value_step`). false: TRL 1.12's separate "
                                        "no-grad forward."})
    malloc_mmap_threshold: int = field(
        default=0, metadata={"help": "Bytes; glibc: allocations at least this large get their own mmap and go back "
                                     "to the system when freed (`rlhf_trl.cpu.set_malloc_mmap_threshold`; 131072 "
                                     "cut bench-real's peak RSS by 3.6 GB); 32 MB during the rollout's generate "
                                     "(`rlhf_trl.cpu.mmap_threshold_raised`). 0: glibc's default."})
    tensor_cache: bool = field(
        default=False, metadata={"help": "CPU: freed tensor blocks (>= 128 KB) are kept and reused by the next "
                                         "tensors of their size instead of going back to the system, whose pages the "
                                         "kernel would zero again every step (`rlhf_trl.cpu.install_tensor_cache`, a "
                                         "small C++ allocator built on first use; needs a C++ compiler, else a "
                                         "warning and PyTorch's allocator); a request no kept block fits is made "
                                         "of the pages of the oldest kept blocks (one phase's freed blocks become "
                                         "the next phase's tensors), and the value model's gradient tensors are "
                                         "kept between updates. Same numbers, bit for bit."})
    tensor_cache_headroom_mb: int = field(
        default=0, metadata={"help": "MB (2^20 bytes) the tensor cache may raise the peak of the live tensors' "
                                     "footprint by (peak RSS for fewer fresh blocks; bench-real runs at 0)."})

    def __post_init__(self):
        self.bf16 = not self.fp16 if self.bf16 is None else self.bf16
        super().__post_init__()


class TrainingDivergedError(RuntimeError):
    """A loss, reward or value became NaN or infinite; the message names the update and the last good checkpoint."""


@dataclass
class OnlineTrainerState(TrainerState):
    """`transformers.TrainerState` plus the episode counter (episodes trained so far)."""

    episode: int = 0


def _exact_div(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what}: {a} is not a multiple of {b}")
    return a // b


def check_config(args: "PPOConfig") -> None:
    """The batch-size checks of `PPOEngine` that need no model: `rlhf_trl.ppo.run` makes them before it reads its
    data, so a bad value fails before anything of an earlier run goes.

    Raises:
        ValueError: ``num_mini_batches`` < 1 or not dividing each process's rollouts per update
            (``per_device_train_batch_size x gradient_accumulation_steps``), or ``whiten_rewards`` with fewer than 8
            rollouts per process mini-batch, a negative ``tensor_cache_headroom_mb``, or an unknown
            ``rollout_sampler`` (one line naming the keys).
    """
    if args.num_mini_batches < 1:
        raise ValueError(f"num_mini_batches must be >= 1, got {args.num_mini_batches}")
    local = args.per_device_train_batch_size * args.gradient_accumulation_steps
    local_mini = _exact_div(local, args.num_mini_batches, "per_device_train_batch_size x gradient_accumulation_steps "
                                                          "(rollouts per process and update) / num_mini_batches")
    if args.whiten_rewards and local_mini < 8:
        raise ValueError(f"whiten_rewards needs >= 8 rollouts per process mini-batch, got {local_mini}")
    if args.tensor_cache_headroom_mb < 0:
        raise ValueError(f"tensor_cache_headroom_mb must be >= 0 MB, got {args.tensor_cache_headroom_mb}")
    check_rollout_sampler(args.rollout_sampler)


def _lm_parts(model):
    """``(backbone, lm_head)`` of a causal LM (or a peft model on one): hidden states, then vocabulary logits."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, base.base_model_prefix), base.get_output_embeddings()


class FrozenHeadLogprobs(torch.autograd.Function):
    """Log-probs (and entropy) of one chunk of response tokens under a frozen LM head, with their gradient formed in
    the forward pass: ``h [b, n, hidden]``, ``ids [b, n]`` -> ``logprobs [b, n]``, ``entropy [b, n]`` (nats, no
    gradient).

    A log-prob is one number per position, so its vector-Jacobian product is rank one per position:
    ``d logprobs[b, t] / d h[b, t] = ((onehot(ids[b, t]) - softmax(logits[b, t])) / divisor) @ W`` (``W`` the head's
    ``[vocab, hidden]`` weight, ``logits = h @ W.T / divisor``), a ``[hidden]`` row. The forward keeps those rows
    (``[b, n, hidden]``) and the backward scales them by the incoming gradient: no ``[b, n, vocab]`` tensor outlives
    the forward and none is recomputed (activation checkpointing's second LM-head product and softmax per chunk).
    The same products as autograd's backward (``(g (onehot - softmax) / divisor) @ W``) with the per-position
    gradient ``g`` applied after the product instead of before: equal to fp32 rounding. Log-probs and entropy are
    `ppo_math.selective_log_softmax` / `ppo_math.entropy_from_logits` of the same logits, bit for bit.
    For a plain, bias-free, frozen fp32 ``nn.Linear`` head outside autocast (`frozen_plain_head`); the head
    itself has no gradient here (a trained head takes `response_logprobs`' checkpointed path).
    """

    @staticmethod
    def forward(ctx, h: torch.Tensor, lm_head: nn.Linear, ids: torch.Tensor, divisor: float):
        logits = lm_head(h.contiguous()) / divisor  # contiguous: see `response_logprobs`
        logprobs = pm.selective_log_softmax(logits, ids)
        entropy, probs = pm.entropy_from_logits(logits, with_probs=True)
        del logits
        # (onehot(ids) - softmax) / divisor in the softmax's own memory (the entropy's softmax, not a second one)
        grad_rows = probs.neg_().scatter_add_(-1, ids.unsqueeze(-1), torch.ones_like(logprobs).unsqueeze(-1))
        grad_rows.div_(divisor)
        ctx.save_for_backward(torch.matmul(grad_rows, lm_head.weight))  # [b, n, vocab] @ [vocab, hidden]
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor):
        (rows,) = ctx.saved_tensors
        return grad_logprobs.unsqueeze(-1) * rows, None, None, None


def frozen_plain_head(lm_head: nn.Module, h: torch.Tensor) -> bool:
    """Whether `FrozenHeadLogprobs` applies: ``lm_head`` a plain ``nn.Linear`` without bias whose ``[vocab, hidden]``
    fp32 weight does not train (a LoRA policy's head; not a DeepSpeed ZeRO-3 partition), fp32 hidden states ``h``, no
    autocast."""
    w = getattr(lm_head, "weight", None)
    return (type(lm_head) is nn.Linear and lm_head.bias is None and w is not None and not w.requires_grad
            and w.dtype == h.dtype == torch.float32 and w.dim() == 2 and w.shape[1] == h.shape[-1]
            and not hasattr(w, "ds_id") and not torch.is_autocast_enabled(h.device.type))


def response_logprobs(policy, query_responses: torch.Tensor, context_length: int, pad_token_id: int,
                      temperature: float, chunk_size: int = 0, with_entropy: bool = False):
    """Log-probs of the response tokens under ``softmax(logits / temperature)``, optionally their entropy.

    ``query_responses [b, T]`` (prompt of ``context_length`` tokens, then the response) -> ``logprobs [b, R]`` with
    ``R = T - context_length`` (and ``entropy [b, R]`` in nats, without gradient). Vocabulary logits are formed
    only for the response positions, ``chunk_size`` positions at a time (0: all at once). Under autograd a frozen
    plain LM head (a LoRA policy's) gives each chunk's gradient rows in the forward pass (`FrozenHeadLogprobs`);
    any other head's chunks are checkpointed, so their logits are recomputed in the backward pass instead of kept.
    """
    backbone, lm_head = _lm_parts(policy)
    hidden = response_hidden(backbone, query_responses, context_length, pad_token_id)
    response = query_responses[:, context_length:]
    step = chunk_size if chunk_size and chunk_size > 0 else response.shape[1]
    divisor = temperature + 1e-7

    def chunk(h, ids):  # one LM-head pass gives the chunk's log-probs and (without gradient) its entropy
        # contiguous: a strided [b, n, hidden] slice goes through a broadcast bmm, 1.6-2.8x slower than one matmul
        logits = lm_head(h.contiguous()) / divisor
        logprob = pm.selective_log_softmax(logits, ids)
        if not with_entropy:
            return logprob, None
        with torch.no_grad():
            return logprob, pm.entropy_from_logits(logits)

    logprobs, entropies = [], []
    grad = torch.is_grad_enabled() and hidden.requires_grad
    rank_one = grad and frozen_plain_head(lm_head, hidden)
    for start in range(0, response.shape[1], step):
        h, ids = hidden[:, start:start + step], response[:, start:start + step]
        if rank_one:
            logprob, entropy = FrozenHeadLogprobs.apply(h, lm_head, ids, divisor)
        elif grad and step < response.shape[1]:
            logprob, entropy = torch.utils.checkpoint.checkpoint(chunk, h, ids, use_reentrant=False)
        else:
            logprob, entropy = chunk(h, ids)
        logprobs.append(logprob)
        entropies.append(entropy)
    out = torch.cat(logprobs, 1)
    return (out, torch.cat(entropies, 1)) if with_entropy else out


class PolicyAndValue(nn.Module):
    """Policy and value model as one module, so that one ``accelerator.prepare`` (DDP, DeepSpeed, FSDP) covers both
    and one forward pass (through the wrapper, as DDP needs) trains both."""

    def __init__(self, policy, value_model):
        super().__init__()
        self.policy = policy
        self.value_model = value_model

    def forward(self, query_responses: torch.Tensor, context_length: int, pad_token_id: int, temperature: float,
                chunk_size: int):
        """``[b, T]`` ids -> ``(logprobs [b, R], entropy [b, R], values [b, R])``: policy log-probs of the response
        tokens, their entropy (no gradient) and the value model's estimate at each response position's context."""
        logprobs, entropy = response_logprobs(self.policy, query_responses, context_length, pad_token_id,
                                              temperature, chunk_size, with_entropy=True)
        values = response_values(self.value_model, query_responses, context_length, pad_token_id)
        return logprobs, entropy, values


@torch.no_grad()
def generate_rollouts(policy, queries: torch.Tensor, pad_token_id: int, generation_config: GenerationConfig,
                      batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one response per left-padded prompt, ``batch`` prompts per ``generate`` call.

    ``queries [b, Q]`` -> ``(query_responses [b, Q + R], logprobs [b, R])``: prompt then response ids (right-padded
    with ``pad_token_id`` where a call ended early), and each sampled token's log-prob under the sampling
    distribution (the processed logits ``generate`` returns: ``logits / temperature``). Same rollout as TRL 1.12's
    ``batch_generation``, without stacking the ``[b, R, vocab]`` logits.
    """
    import copy

    context = queries.shape[1]
    config = copy.deepcopy(generation_config)
    config.return_dict_in_generate, config.output_scores = True, True  # the sampling logits give the log-probs
    if config.min_p == 0.0 and getattr(getattr(policy, "generation_config", None), "min_p", None) is None:
        # min_p 0.0 (`sampling_generation_config`'s guard against a checkpoint's min_p) still builds transformers'
        # MinPLogitsWarper: a softmax and a top-k over the vocabulary per decoding step that remove nothing. Unset, it
        # is not built, and the model has no min_p of its own to fill in: the same scores, bit for bit.
        config.min_p = None
    pieces, logps = [], []
    for i in range(0, queries.shape[0], batch):
        query = queries[i:i + batch]
        mask = query != pad_token_id
        out = policy.generate(input_ids=query.masked_fill(~mask, 0), attention_mask=mask, generation_config=config)
        response = out.sequences[:, context:]
        # one [rows, vocab] log-softmax per decoding step (the step's rows as one "row" of selective_log_softmax,
        # whose per-row loop would otherwise run once per sequence and step: 4.4 -> 0.6 ms per rollout of 32 x 16
        # tokens on the demo model, 9% of its generate)
        lp = torch.stack([pm.selective_log_softmax(s[None], response[None, :, t])[0] for t, s in enumerate(out.scores)],
                         1)
        pieces.append(torch.cat((query, response), 1))
        logps.append(lp)
        del out
    width = max(p.shape[1] for p in pieces)
    query_responses = torch.cat([nn.functional.pad(p, (0, width - p.shape[1]), value=pad_token_id) for p in pieces])
    logprobs = torch.cat([nn.functional.pad(p, (0, width - context - p.shape[1]), value=0.0) for p in logps])
    return query_responses, logprobs


def check_rollout_sampler(name: str) -> None:
    """Raises ValueError (one line) unless ``name`` is a ``rollout_sampler``: 'multinomial' or 'inverse_cdf'."""
    if name not in ("multinomial", "inverse_cdf"):
        raise ValueError(f"rollout_sampler must be 'multinomial' or 'inverse_cdf', got {name!r}")


@contextmanager
def rollout_sampler(name: str):
    """Within the block, ``generate``'s draws (``torch.multinomial(probs, num_samples=1)`` on ``[batch, V]``) come from
    `ppo_math.inverse_cdf_sample` with one ``torch.rand`` uniform per row when ``name`` is ``"inverse_cdf"``; any other
    call of ``torch.multinomial`` goes to PyTorch's. ``"multinomial"``: nothing changes.

    Raises:
        ValueError: another ``name``.
    """
    check_rollout_sampler(name)
    if name == "multinomial":
        yield
        return
    real = torch.multinomial

    def multinomial(input, num_samples, replacement=False, *, generator=None, out=None):
        if input.dim() != 2 or num_samples != 1 or out is not None:
            return real(input, num_samples, replacement, generator=generator, out=out)
        uniform = torch.rand(input.shape[0], dtype=torch.float64, device=input.device, generator=generator)
        return pm.inverse_cdf_sample(input, uniform).unsqueeze(-1)

    torch.multinomial = multinomial
    try:
        yield
    finally:
        torch.multinomial = real


@contextmanager
def rows_only_embedding_gradient(model: nn.Module):
    """Within the block, the backward of ``model``'s input embedding (a plain ``nn.Embedding`` whose weight
    ``[vocab, hidden]`` trains) adds the rows of the looked-up tokens into a dense gradient, zeroed on entry when the
    weight had none: its lookups run with ``sparse=True``, so each backward gives only the micro-batch's rows
    (``[tokens, hidden]``) instead of a zero-filled ``[vocab, hidden]`` tensor per micro-batch that is then added
    into the gradient (Qwen2.5-0.5B: 545 MB filled and added per micro-batch, ~0.3 s each on the 2-core bench VM).
    The gradient stays dense for the optimizer; the same sums to fp32 rounding (rows of tokens in several
    micro-batches are summed in another order). Anything else (frozen, LoRA-wrapped or another embedding class):
    nothing changes. Restores ``sparse`` on exit; raises nothing of its own. For `PPOEngine.value_step`."""
    embedding = model.get_input_embeddings()
    if type(embedding) is not nn.Embedding or embedding.sparse or not embedding.weight.requires_grad:
        yield
        return
    if embedding.weight.grad is None:
        embedding.weight.grad = torch.zeros_like(embedding.weight)
    embedding.sparse = True
    try:
        yield
    finally:
        embedding.sparse = False


class _InPlaceGradLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` (``x [..., in]`` -> ``[..., out]``) whose backward writes the weight's
    (``[out, in]``) and bias's gradients straight into their ``.grad`` (`weight_gradients_in_place`) and hands
    autograd none for them: the input gradient ``grad @ weight`` as autograd's, the weight gradient the same
    ``grad^T @ x`` product with its output in ``.grad`` itself."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: nn.Parameter, bias: nn.Parameter | None, written: set):
        if torch.is_autocast_enabled(x.device.type):  # the gradients would come in autocast's dtype
            raise RuntimeError("weight_gradients_in_place: a linear ran under autocast")
        ctx.save_for_backward(x)
        ctx.weight, ctx.bias, ctx.written = weight, bias, written
        return nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        g, x = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])  # [tokens, out], [tokens, in]
        _into_grad(ctx.weight, ctx.written, lambda out: torch.mm(g.t(), x, out=out), lambda acc: acc.addmm_(g.t(), x))
        if ctx.bias is not None:
            _into_grad(ctx.bias, ctx.written, lambda out: torch.sum(g, 0, out=out), lambda acc: acc.add_(g.sum(0)))
        grad_x = torch.matmul(grad, ctx.weight) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None


def _into_grad(p: nn.Parameter, written: set, write, add) -> None:
    """``p.grad`` := ``write(out)`` on ``p``'s first gradient in the block (into the kept ``.grad`` tensor, or a new
    one when it has none), ``add(p.grad)`` in place after that."""
    if id(p) in written:
        add(p.grad)
    else:
        p.grad = write(p.grad)
        written.add(id(p))


@contextmanager
def weight_gradients_in_place(model: nn.Module):
    """Within the block, each plain fp32 ``nn.Linear`` of ``model`` whose weight trains writes its weight and bias
    gradients straight into their ``.grad`` tensors: the block's first backward into the kept tensor (overwriting
    what it held: a gradient the caller keeps between updates needs no zeroing), later backward passes add in place
    (``addmm_``), instead of a fresh ``[out, in]`` gradient per micro-batch that autograd then adds into ``.grad``
    (Qwen2.5-0.5B: 1.4 GB of gradient products added and 1.4 GB of kept gradients zeroed per update, ~0.3 s on the
    2-core bench VM). The same products: the first micro-batch's gradient bit for bit, the sum over micro-batches
    to fp32 rounding (the GEMM adds into its output). On exit a handled parameter that no backward reached has its
    kept gradient zeroed (as autograd would have left it: zero). For one process's unwrapped model outside autocast
    (`PPOEngine.value_step`; DDP's hooks would not see these gradients); yields the handled parameters. LoRA-
    wrapped, frozen, non-fp32 or subclassed linears keep their own forward.

    Raises:
        RuntimeError: a handled linear runs under autocast (its gradients would come in autocast's dtype).
    """
    written: set[int] = set()
    patched = [m for m in model.modules() if type(m) is nn.Linear and m.weight.requires_grad
               and m.weight.dtype == torch.float32 and "forward" not in vars(m)]
    for m in patched:
        m.forward = lambda x, m=m: _InPlaceGradLinear.apply(x, m.weight, m.bias, written)
    handled = [p for m in patched for p in (m.weight, m.bias) if p is not None]
    try:
        yield handled
    finally:
        for m in patched:
            del m.forward
        for p in handled:
            if id(p) not in written and p.grad is not None:
                p.grad.zero_()


def sampling_config(args: PPOConfig, eos_ids: list[int] | None, pad_token_id: int) -> GenerationConfig:
    """Sampling from ``softmax(logits / temperature)`` alone (`rlhf_trl.models.sampling_generation_config`: every
    biasing setting neutral), ``response_length`` new tokens, stopping at any of ``eos_ids`` (None: never)."""
    config = sampling_generation_config(args.temperature + 1e-7, args.response_length, eos_ids or [], pad_token_id)
    if eos_ids is None:
        config.eos_token_id = None
    return config


def disable_dropout(model: nn.Module) -> None:
    """Set every dropout probability to 0 (log-probs must be a function of the weights alone)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0


OFFLOAD_PREFIX = ".tmp-offload-"


class OffloadedWeights:
    """A frozen module whose parameters live in a safetensors file between uses (``offload_reward_model``).

    The parameters are written once to ``path`` and their storage is released (each becomes an empty tensor); inside
    ``with offloaded.loaded():`` they are read back, bit for bit, and released again on exit. Buffers (rotary
    frequencies, ...) stay in memory. Shared (tied) parameters are stored once.

    Raises:
        ValueError: a parameter that is not a plain floating-point tensor (a quantized model).
    """

    def __init__(self, module: nn.Module, path: str):
        from safetensors.torch import save_file

        self.module, self.path = module, path
        self.params = dict(module.named_parameters())  # remove_duplicate: a tied parameter once
        bad = [n for n, p in self.params.items() if type(p) is not nn.Parameter or not p.is_floating_point()]
        if bad:
            raise ValueError(f"offload_reward_model: the reward model has quantized or non-float weights ({bad[0]}); "
                             "set `offload_reward_model: false`")
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        save_file({n: p.detach().contiguous() for n, p in self.params.items()}, path)
        self.nbytes = sum(p.numel() * p.element_size() for p in self.params.values())  # of weights when read
        self.release()

    def release(self) -> None:
        for p in self.params.values():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    @contextmanager
    def loaded(self):
        self.read()
        try:
            yield self.module
        finally:
            self.release()

    def read(self) -> None:
        """Read the weights back, bit for bit, into tensors of PyTorch's CPU allocator (with ``tensor_cache``: the
        pages of blocks training freed, not fresh ones the kernel zeroes), straight from the file's safetensors
        layout (an 8-byte little-endian header length, the JSON header, the data). The parameters are read in
        ``torch.get_num_threads()`` groups of about equal bytes, one thread and file handle each (the copies out of
        the page cache run in parallel: Qwen2.5-0.5B's 2 GB in 0.19 s with 2 threads, 0.36 s with one, on the 2-core
        bench VM).

        Raises:
            RuntimeError: a tensor's bytes in the file do not match its parameter (the file changed underneath).
        """
        import json
        import struct
        from concurrent.futures import ThreadPoolExecutor

        with open(self.path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        nbytes = {name: header[name]["data_offsets"][1] - header[name]["data_offsets"][0] for name in self.params}
        threads = max(1, torch.get_num_threads())
        groups, loads = [[] for _ in range(threads)], [0] * threads
        for name in sorted(self.params, key=nbytes.get, reverse=True):  # largest first, each to the lightest group
            i = loads.index(min(loads))
            groups[i].append((name, self.params[name]))
            loads[i] += nbytes[name]

        def read_group(group):
            with open(self.path, "rb", buffering=0) as f:
                for name, p in group:
                    t = torch.empty(header[name]["shape"], dtype=p.dtype)
                    f.seek(8 + size + header[name]["data_offsets"][0])
                    view, got = memoryview(t.reshape(-1).view(torch.uint8).numpy()), 0
                    if nbytes[name] == len(view):  # a raw read may return less than asked: read until full or EOF
                        while got < len(view) and (n := f.readinto(view[got:])):
                            got += n
                    if got != len(view) or nbytes[name] != len(view):
                        raise RuntimeError(f"offload_reward_model: {self.path}: {name} does not hold "
                                           f"{list(t.shape)} {t.dtype} values")
                    p.data = t.to(p.device)

        with ThreadPoolExecutor(len(groups)) as pool:
            for done in [pool.submit(read_group, g) for g in groups if g]:
                done.result()  # the first group's error, if any

    def restore(self) -> None:
        """Read the weights back for good and delete the file (the module is an ordinary module again)."""
        self.read()
        os.remove(self.path)


class PPOEngine(Trainer):
    """PPO of a policy (plus value model) against a reward model and/or reward functions; see the module docstring.

    Subclasses `transformers.Trainer` for its optimizer / scheduler construction, logging, callbacks and checkpoint
    writing; ``Trainer.__init__`` is not run (it would wrap a single model), the attributes it sets are set here.

    Args:
        args: `PPOConfig`.
        processing_class: the tokenizer (pad distinct from every EOS id).
        model: the policy (a causal LM; a peft model for LoRA).
        ref_model: the reference, or None with a peft policy (the adapter is disabled for reference log-probs).
        reward_model: a sequence classifier, or None when ``reward_functions`` give all the reward.
        value_model: a sequence classifier (or peft model on one).
        train_dataset / eval_dataset: rows of ``input_ids`` (prompts); an optional ``row`` column indexes
            ``reward_columns`` for reward functions.
        eos_token_ids: ids that end a response (default: the tokenizer's EOS; None with ``stop_token`` unset).
        reward_functions: a `rlhf_trl.rewards.RewardFunctions` (or None), called with decoded prompts and
            completions; ``reward_columns(rows)`` gives its keyword columns for dataset row indices.

    Raises:
        ValueError: bad batch sizes or stop settings.
    """

    def __init__(self, args: PPOConfig, processing_class, model, ref_model, reward_model, train_dataset,
                 value_model, data_collator=None, eval_dataset=None, optimizers=(None, None), callbacks=None,
                 eos_token_ids: list[int] | None = None, reward_functions=None, reward_columns=None):
        from accelerate import Accelerator
        from torch.utils.data import DataLoader
        from transformers import DataCollatorWithPadding
        from transformers.trainer_callback import (CallbackHandler, ExportableState, PrinterCallback)
        from transformers.trainer import DEFAULT_CALLBACKS, DEFAULT_PROGRESS_CALLBACK
        from transformers.integrations import get_reporting_integration_callbacks

        if ref_model is not None and ref_model is model:
            raise ValueError("the reference must be a copy of the policy (or None with a LoRA policy)")
        if args.stop_token and args.stop_token_id is not None:
            raise ValueError("set stop_token or stop_token_id, not both")
        if args.stop_token not in (None, "eos"):
            raise ValueError(f"stop_token must be 'eos' or unset, got {args.stop_token!r}")
        if args.kl_estimator not in ("k1", "k3"):
            raise ValueError(f"kl_estimator must be 'k1' or 'k3', got {args.kl_estimator!r}")
        check_config(args)
        self.args = args
        self.processing_class = processing_class
        self.policy_model = model
        if args.stop_token == "eos":
            self.eos_token_ids = list(eos_token_ids or [processing_class.eos_token_id])
        elif args.stop_token_id is not None:
            self.eos_token_ids = [args.stop_token_id]
        else:
            self.eos_token_ids = None
        model.generation_config.eos_token_id = self.eos_token_ids
        self.is_peft_model = hasattr(model, "disable_adapter") and hasattr(model, "peft_config")
        if ref_model is None and not self.is_peft_model:
            import copy

            ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        self.ref_model = ref_model
        self.reward_model = reward_model
        self.value_model = value_model
        self.reward_functions = reward_functions
        self.reward_columns = reward_columns
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.train_dataset_len = len(train_dataset)
        self.data_collator = data_collator or DataCollatorWithPadding(processing_class)
        self.optimizer, self.lr_scheduler = optimizers
        self.optimizer_cls_and_kwargs = None

        # batch sizes (episodes)
        if args.total_episodes is None:
            args.total_episodes = int(args.num_train_epochs * self.train_dataset_len)
        accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
        self.accelerator = accelerator
        args.world_size = accelerator.num_processes
        args.local_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps
        args.micro_batch_size = args.per_device_train_batch_size * args.world_size
        args.batch_size = args.local_batch_size * args.world_size
        args.mini_batch_size = _exact_div(args.batch_size, args.num_mini_batches,
                                          "batch_size (episodes per update) / num_mini_batches")
        args.local_mini_batch_size = _exact_div(args.local_batch_size, args.num_mini_batches,
                                                "per-process batch / num_mini_batches")
        if args.whiten_rewards and args.local_mini_batch_size < 8:
            raise ValueError(f"whiten_rewards needs >= 8 rollouts per process mini-batch, got "
                             f"{args.local_mini_batch_size}")
        args.num_total_batches = math.ceil(args.total_episodes / args.batch_size)
        self.local_seed = args.seed + accelerator.process_index * 100003
        self.sample_generations_freq = max(1, args.num_total_batches // max(1, args.num_sample_generations))

        # models, optimizer
        for m in (self.policy_model, self.ref_model, self.value_model, self.reward_model):
            if m is not None:
                disable_dropout(m)
        self.model = PolicyAndValue(self.policy_model, self.value_model)
        self.model.config = self.policy_model.config
        self.create_optimizer_and_scheduler(num_training_steps=args.num_total_batches)

        # Trainer machinery: callbacks, state
        callbacks_all = DEFAULT_CALLBACKS + get_reporting_integration_callbacks(args.report_to) + list(callbacks or [])
        self.callback_handler = CallbackHandler(callbacks_all, self.model, processing_class, self.optimizer,
                                                self.lr_scheduler)
        self.add_callback(PrinterCallback if args.disable_tqdm else DEFAULT_PROGRESS_CALLBACK)
        self.control = TrainerControl()
        self.state = OnlineTrainerState(
            is_local_process_zero=self.is_local_process_zero(), is_world_process_zero=self.is_world_process_zero(),
            stateful_callbacks=[cb for cb in self.callback_handler.callbacks + [self.control]
                                if isinstance(cb, ExportableState)],
        )
        self.current_flos = 0
        self.hp_search_backend = None
        self.is_deepspeed_enabled = getattr(accelerator.state, "deepspeed_plugin", None) is not None
        self.is_fsdp_enabled = getattr(accelerator.state, "fsdp_plugin", None) is not None
        self.is_distributed_loading_by_transformers = False
        self.hub_model_id = None
        if args.should_save:
            os.makedirs(args.output_dir, exist_ok=True)

        # data: the shuffle is drawn from `seed` on every process, then each process reseeds for its own sampling
        self.dataloader = DataLoader(train_dataset, batch_size=args.local_batch_size, shuffle=True,
                                     collate_fn=self.data_collator, drop_last=True)
        torch.manual_seed(args.seed)
        self.model, self.optimizer, self.dataloader = accelerator.prepare(self.model, self.optimizer, self.dataloader)
        torch.manual_seed(self.local_seed)
        self.eval_dataloader = None
        if eval_dataset is not None:
            self.eval_dataloader = accelerator.prepare(DataLoader(
                eval_dataset, batch_size=args.per_device_eval_batch_size, collate_fn=self.data_collator,
                drop_last=True))
        if self.is_deepspeed_enabled:
            from trl.models.utils import prepare_deepspeed

            for name in ("reward_model", "ref_model"):
                if getattr(self, name) is not None:
                    setattr(self, name, prepare_deepspeed(getattr(self, name), accelerator))
        else:
            for name in ("reward_model", "ref_model"):
                if getattr(self, name) is not None:
                    setattr(self, name, getattr(self, name).to(accelerator.device))
        # one process, no wrapper: policy and value losses back-propagated one after the other (`losses`)
        self.split_backward = isinstance(self.model, PolicyAndValue)
        if args.fused_lora:
            logger.info("fused_lora: %d LoRA layers add their update in place", fuse_lora(self.unwrapped))
        if args.fused_kernels:  # policy (and the reference: the same layers), value, reward and a separate reference
            fused = sum(fuse_kernels(m) for m in {id(m): m for m in (self.unwrapped, self.reward_model, self.ref_model)
                                                  if m is not None}.values())
            logger.info("fused_kernels: %d MLPs and RMSNorms run one-pass kernels", fused)
        self.single_value_forward = (args.single_value_forward and self.split_backward and args.num_ppo_epochs == 1
                                     and args.num_mini_batches == 1 and not args.whiten_rewards)
        logger.info("values: %s", "from the value model's training forward (single_value_forward)"
                    if self.single_value_forward else "a no-grad forward in the rollout")
        # `tensor_cache`: the value model's gradient tensors kept between updates (`value_step`)
        self.value_grads: list[torch.Tensor | None] | None = None
        self.reward_offload = None
        if args.offload_reward_model and self.reward_model is not None:
            if self.is_deepspeed_enabled or self.is_fsdp_enabled:
                raise ValueError("offload_reward_model works without DeepSpeed / FSDP (they shard or offload "
                                 "themselves); set `offload_reward_model: false`")
            if any(p is q for p in self.reward_model.parameters() for q in self.value_model.parameters()):
                raise ValueError("offload_reward_model: the reward model shares weights with the value model "
                                 "(share_reward_value_base); set `offload_reward_model: false`")
            self.reward_offload = OffloadedWeights(self.reward_model, os.path.join(
                args.output_dir, f"{OFFLOAD_PREFIX}reward-model-{accelerator.process_index}.safetensors"))

    # -- pieces of one update -----------------------------------------------------------------------------------
    @contextmanager
    def reward_weights(self):
        """The reward model (None without one), its weights read back from disk for the block when
        ``offload_reward_model`` keeps them there."""
        if self.reward_offload is None:
            yield self.reward_model
        else:
            with self.reward_offload.loaded() as model:
                yield model

    @property
    def unwrapped(self) -> PolicyAndValue:
        return self.accelerator.unwrap_model(self.model)

    @contextmanager
    def reference(self):
        """The reference policy: a frozen copy, or the policy with its adapter disabled (or set to
        ``ref_adapter_name``)."""
        if self.ref_model is not None:
            yield self.ref_model
            return
        policy = self.unwrapped.policy
        if self.args.ref_adapter_name:
            policy.set_adapter(self.args.ref_adapter_name)
            try:
                yield policy
            finally:
                policy.set_adapter(self.args.model_adapter_name or "default")
        else:
            with policy.disable_adapter():
                yield policy

    @contextmanager
    def generation_policy(self):
        """The policy for ``generate``: unwrapped, with ZeRO-3 parameters gathered when configured."""
        if self.is_deepspeed_enabled and self.args.ds3_gather_for_generation:
            import deepspeed

            stage = self.accelerator.state.deepspeed_plugin.zero_stage
            ctx = deepspeed.zero.GatheredParameters(self.model.parameters()) if stage == 3 else nullcontext()
            with ctx:
                yield self.unwrapped.policy
        else:
            yield self.unwrapped.policy

    @torch.no_grad()
    def score_rollouts(self, query_responses: torch.Tensor, context: int, step: int, reward_model, out: dict) -> None:
        """Step 2 of an update, ``step`` rows at a time: appends to ``out`` the reference log-probs and values
        ``[step, R]`` (values only without ``single_value_forward``: `value_step` gives them then), the responses
        cut after their first EOS id and the reward model's scores ``[step]``."""
        args, pad = self.args, self.processing_class.pad_token_id
        for i in range(0, query_responses.shape[0], step):
            qr = query_responses[i:i + step]
            response = qr[:, context:]
            with self.reference() as ref:
                out["ref_logprobs"].append(response_logprobs(ref, qr, context, pad, args.temperature,
                                                             args.logits_chunk_size))
            post = response if self.eos_token_ids is None else truncate_at_eos(response, self.eos_token_ids, pad)
            out["postprocessed"].append(post)
            if not self.single_value_forward:
                out["values"].append(response_values(self.unwrapped.value_model, qr, context, pad))
            if reward_model is not None:
                out["scores"].append(sequence_scores(reward_model, torch.cat((qr[:, :context], post), 1), pad,
                                                     context))

    @torch.no_grad()
    def rollout(self, queries: torch.Tensor, rows: torch.Tensor | None, update: int) -> dict:
        """Steps 1-2 of an update for left-padded prompts ``queries [b, Q]``.

        Returns a dict of tensors: ``query_responses [b, T]``, ``responses [b, R]`` (as sampled),
        ``logprobs / ref_logprobs / values [b, R]`` (unmasked; values None with ``single_value_forward``),
        ``sequence_lengths [b]`` (index of the last real response token), ``scores [b]`` (reward units: RM score -
        baseline + reward functions - EOS penalty), ``ended [b]`` (bool: the response holds an EOS id), and
        ``fn_values`` (per reward function, ``[b]``).
        """
        args, tok = self.args, self.processing_class
        pad = tok.pad_token_id
        context = queries.shape[1]
        step = args.local_rollout_forward_batch_size
        # fused_lora: generate with merged copies of the adapted weights (whole weights on this process only)
        merge = args.fused_lora and not (self.is_deepspeed_enabled or self.is_fsdp_enabled)
        with self.generation_policy() as policy, lora_merged(policy, merge), \
                onednn_decoding(policy, args.onednn_decoding), mmap_threshold_raised(args.malloc_mmap_threshold), \
                rollout_sampler(args.rollout_sampler):
            query_responses, logprobs = generate_rollouts(
                policy, queries, pad, sampling_config(args, self.eos_token_ids, pad), step)
        out = {k: [] for k in ("ref_logprobs", "values", "scores", "postprocessed")}
        with self.reward_weights() as reward_model:
            self.score_rollouts(query_responses, context, step, reward_model, out)
        responses = query_responses[:, context:]
        post = torch.cat(out["postprocessed"])
        sequence_lengths = pm.first_true_indices(post == pad) - 1
        scores = torch.cat(out["scores"]) if out["scores"] else torch.zeros(len(post), device=post.device)
        fn_values = {}
        if self.reward_functions is not None:
            prompts = tok.batch_decode(queries, skip_special_tokens=True)
            completions = tok.batch_decode(post, skip_special_tokens=True)
            columns = self.reward_columns(rows.tolist()) if (self.reward_columns and rows is not None) else {}
            total, fn_values = self.reward_functions.compute(prompts, completions, update=update, **columns)
            scores = scores + total.to(scores.device, scores.dtype)
        ended = (eos_mask(post, self.eos_token_ids).any(1) if self.eos_token_ids is not None
                 else torch.zeros(len(post), dtype=torch.bool, device=post.device))
        if args.missing_eos_penalty is not None:
            scores = scores - args.missing_eos_penalty * (~ended).to(scores.dtype)
        return {"query_responses": query_responses, "responses": responses, "logprobs": logprobs,
                "ref_logprobs": torch.cat(out["ref_logprobs"]),
                "values": torch.cat(out["values"]) if out["values"] else None,
                "sequence_lengths": sequence_lengths, "scores": scores, "ended": ended, "fn_values": fn_values}

    def advantages(self, ro: dict, whiten: bool = True) -> dict:
        """Step 3: masks, KL, shaped rewards, GAE advantages (whitened over the rows of ``ro`` unless ``whiten`` is
        false) and returns, all ``[b, R]``."""
        args = self.args
        width = ro["responses"].shape[1]
        padding_mask = pm.response_padding_mask(ro["sequence_lengths"], width)
        padding_mask_p1 = pm.value_padding_mask(ro["sequence_lengths"], width)
        logprobs = ro["logprobs"].masked_fill(padding_mask, pm.INVALID_LOGPROB)
        ref_logprobs = ro["ref_logprobs"].masked_fill(padding_mask, pm.INVALID_LOGPROB)
        values = ro["values"].masked_fill(padding_mask_p1, 0)
        kl = pm.kl_estimate(logprobs, ref_logprobs, args.kl_estimator)
        rewards, non_score_reward = pm.shape_rewards(kl, ro["scores"], args.kl_coef, ro["sequence_lengths"])
        if args.whiten_rewards:
            rewards = pm.masked_whiten(rewards, ~padding_mask_p1, shift_mean=False).masked_fill(padding_mask_p1, 0)
        advantages, returns = pm.gae(rewards, values, args.gamma, args.lam)
        if whiten:
            advantages = pm.masked_whiten(advantages, ~padding_mask).masked_fill(padding_mask, 0)
        return {"padding_mask": padding_mask, "padding_mask_p1": padding_mask_p1, "logprobs": logprobs,
                "values": values, "kl": kl, "non_score_reward": non_score_reward, "advantages": advantages,
                "returns": returns}

    def micro_batches(self, order: np.ndarray):
        """The micro-batches (arrays of row indices) of each mini-batch of one epoch's shuffled ``order [b]``:
        yields ``(mini-batch, micro-batch, rows)``."""
        args = self.args
        for mb, start in enumerate(range(0, args.local_batch_size, args.local_mini_batch_size)):
            mini = order[start:start + args.local_mini_batch_size]
            for k, micro_start in enumerate(range(0, args.local_mini_batch_size, args.per_device_train_batch_size)):
                yield mb, k, mini[micro_start:micro_start + args.per_device_train_batch_size]

    def value_step(self, ro: dict, order: np.ndarray) -> list[dict]:
        """Steps 2-4 of the value model with ``single_value_forward`` (1 epoch, 1 mini-batch, one process): for each
        micro-batch of ``order`` (the epoch's shuffle, so the micro-batches are `optimise`'s), one forward with
        gradient gives the values ``[micro, R]`` (written into ``ro["values"] [b, R]``), their GAE returns (from the
        micro-batch's own rewards: returns need no whitening) and the value loss, back-propagated at once (scaled by
        ``vf_coef`` / ``gradient_accumulation_steps`` as in `losses`). Then AdamW steps the value model's parameters
        and their gradients are freed, before the policy's forward (its parameters have no gradient yet, so the step
        skips them; each parameter's AdamW update is its own and nothing clips the global norm, so the update equals
        one step after both backward passes; the policy steps in `optimise`). Returns each micro-batch's value-loss
        statistics (`ppo_math.value_loss`).

        With ``tensor_cache`` the gradient tensors are kept between updates (one value model's parameters' worth of
        memory more through the rollout and the policy's step) and reused by the next update instead of fresh pages
        from the kernel: zeroed, or, for the linears, written over by their first backward. Outside mixed precision
        the linears' weight gradients go straight into ``.grad`` (`weight_gradients_in_place`), and a value model
        trained in full adds its embedding's gradient row by row (`rows_only_embedding_gradient`).

        Same gradient as TRL 1.12's second value forward: the weights have not moved since the rollout, so the
        rollout's values equal the training forward's and the clipped term equals the unclipped one."""
        args, acc, pad = self.args, self.accelerator, self.processing_class.pad_token_id
        context = ro["query_responses"].shape[1] - ro["responses"].shape[1]
        fp32 = (lambda t: t.float()) if acc.native_amp else (lambda t: t)
        values, stats = None, []
        self.model.train()
        value_model = self.model.value_model
        params = [p for p in value_model.parameters() if p.requires_grad]
        in_place = nullcontext([]) if acc.native_amp else weight_gradients_in_place(value_model)
        with in_place as handled:  # the linears' weight gradients go straight into .grad
            if self.value_grads is not None:  # `tensor_cache`: the last update's gradient tensors: no fresh pages
                overwritten = {id(p) for p in handled}  # the linears' first backward writes over them: no zeroing
                for p, grad in zip(params, self.value_grads):
                    if grad is not None:
                        p.grad = grad if id(p) in overwritten else grad.zero_()
            with rows_only_embedding_gradient(value_model):  # no [vocab, hidden] fill per micro-batch
                for _, _, idx in self.micro_batches(order):
                    with acc.autocast():
                        vpred = response_values(value_model, ro["query_responses"][idx], context, pad)
                    vpred = fp32(vpred)
                    with torch.no_grad():
                        rows = {k: ro[k][idx] for k in
                                ("responses", "logprobs", "ref_logprobs", "sequence_lengths", "scores")}
                        a = self.advantages({**rows, "values": vpred.detach()}, whiten=False)
                    vf = pm.value_loss(vpred.masked_fill(a["padding_mask_p1"], 0), a["values"], a["returns"],
                                       ~a["padding_mask_p1"], args.cliprange_value)
                    acc.backward(args.vf_coef * vf["loss"])
                    if values is None:  # the value model's output dtype, as the no-grad forward's
                        values = vpred.new_zeros(ro["responses"].shape)
                    values[idx] = vpred.detach()
                    stats.append({k: v.detach() for k, v in vf.items()})
                    del vpred, vf
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # the torch optimizer inside accelerate's
        optimizer.step()
        if tensor_cache_installed():
            self.value_grads = [p.grad for p in params]
        optimizer.zero_grad(set_to_none=True)  # the policy's step must skip the value model's parameters
        ro["values"] = values
        return stats

    def optimise(self, ro: dict, adv: dict, orders: list[np.ndarray], value_stats: list[dict] | None = None) -> dict:
        """Step 4: ``num_ppo_epochs`` x ``num_mini_batches`` optimizer steps over each epoch's shuffle ``orders[e]``
        ``[b]``; returns the per-micro-batch statistics ``[epochs, mini-batches, micro-batches]`` of approxkl,
        clipfrac, losses, entropy and ratio. ``value_stats``: the value losses `value_step` already
        back-propagated (then only the policy's forward and backward run here)."""
        args, acc = self.args, self.accelerator
        context = ro["query_responses"].shape[1] - ro["responses"].shape[1]
        shape = (args.num_ppo_epochs, args.num_mini_batches, args.gradient_accumulation_steps)
        stats = {k: torch.zeros(shape, device=acc.device) for k in
                 ("approxkl", "pg_clipfrac", "pg_loss", "vf_loss", "vf_clipfrac", "entropy", "ratio")}
        self.model.train()
        for epoch in range(args.num_ppo_epochs):
            for mb, k, idx in self.micro_batches(orders[epoch]):
                with acc.accumulate(self.model):
                    pg, vf, entropy = self.losses(ro, adv, idx, context, value=value_stats is None)
                    self.optimizer.step()
                    self.optimizer.zero_grad()
                vf = vf if value_stats is None else value_stats[k]
                at = (epoch, mb, k)
                stats["approxkl"][at], stats["pg_clipfrac"][at] = pg["approxkl"], pg["clipfrac"]
                stats["pg_loss"][at], stats["vf_loss"][at] = pg["loss"].detach(), vf["loss"].detach()
                stats["vf_clipfrac"][at], stats["ratio"][at] = vf["clipfrac"], pg["ratio"]
                stats["entropy"][at] = entropy.mean()
                del entropy, vf, pg
        return stats

    def losses(self, ro: dict, adv: dict, idx, context: int, value: bool = True
               ) -> tuple[dict, dict | None, torch.Tensor]:
        """Forward and backward of one micro-batch ``idx``: the clipped policy loss plus ``vf_coef`` x the clipped
        value loss (`ppo_math.policy_loss`, `ppo_math.value_loss`); returns their statistics and the entropy
        ``[b, R]``. ``value`` false (`value_step` did the value model's part): the policy's alone, value stats None.

        In one process (no DDP / DeepSpeed / FSDP wrapper) the two losses, which share no parameters, are
        back-propagated one after the other: the policy's activations are freed before the value model's forward,
        so only one model's activations are alive at a time, and every gradient is the same sum as TRL's single
        backward of ``pg_loss + vf_coef * vf_loss``. Wrapped models take TRL's single forward and backward through
        the wrapper (DDP synchronises once per backward)."""
        args, acc, pad = self.args, self.accelerator, self.processing_class.pad_token_id
        ids = ro["query_responses"][idx]

        def policy_loss(new_logprobs):
            new_logprobs = new_logprobs.masked_fill(adv["padding_mask"][idx], pm.INVALID_LOGPROB)
            return pm.policy_loss(new_logprobs, adv["logprobs"][idx], adv["advantages"][idx],
                                  ~adv["padding_mask"][idx], args.cliprange)

        def value_loss(vpred):
            vpred = vpred.masked_fill(adv["padding_mask_p1"][idx], 0)
            return pm.value_loss(vpred, adv["values"][idx], adv["returns"][idx], ~adv["padding_mask_p1"][idx],
                                 args.cliprange_value)

        if self.split_backward:  # not wrapped: one model's activations at a time
            # what `accelerate` does to a prepared model's forward under mixed precision: autocast, fp32 outputs
            fp32 = (lambda t: t.float()) if acc.native_amp else (lambda t: t)
            with acc.autocast():
                new_logprobs, entropy = response_logprobs(self.model.policy, ids, context, pad, args.temperature,
                                                          args.logits_chunk_size, with_entropy=True)
            pg = policy_loss(fp32(new_logprobs))
            entropy = fp32(entropy)
            acc.backward(pg["loss"])
            del new_logprobs
            if not value:
                return pg, None, entropy
            with acc.autocast():
                vpred = response_values(self.model.value_model, ids, context, pad)
            vf = value_loss(fp32(vpred))
            acc.backward(args.vf_coef * vf["loss"])
            return pg, vf, entropy
        new_logprobs, entropy, vpred = self.model(ids, context, pad, args.temperature, args.logits_chunk_size)
        pg, vf = policy_loss(new_logprobs), value_loss(vpred)
        acc.backward(pg["loss"] + args.vf_coef * vf["loss"])
        return pg, vf, entropy

    def update_metrics(self, ro: dict, adv: dict, stats: dict, start_time: float) -> dict:
        """The logged statistics of one update (TRL 1.12's names), averaged over processes."""
        g = self.accelerator.gather_for_metrics
        kl_sum = adv["kl"].sum(1).mean()
        entropy = ((-adv["logprobs"]) * (~adv["padding_mask"]).float()).sum(1).mean()
        non_score = adv["non_score_reward"].sum(1).mean()
        metrics = {
            "eps": int(self.state.episode / max(time.time() - start_time, 1e-9)),
            "objective/kl": g(kl_sum).mean().item(),
            "objective/entropy": g(entropy).mean().item(),
            "objective/non_score_reward": g(non_score).mean().item(),
            "objective/rlhf_reward": g(non_score + ro["scores"].mean()).mean().item(),
            "objective/scores": g(ro["scores"].mean()).mean().item(),
            "policy/approxkl_avg": g(stats["approxkl"]).mean().item(),
            "policy/clipfrac_avg": g(stats["pg_clipfrac"]).mean().item(),
            "loss/policy_avg": g(stats["pg_loss"]).mean().item(),
            "loss/value_avg": g(stats["vf_loss"]).mean().item(),
            "val/clipfrac_avg": g(stats["vf_clipfrac"]).mean().item(),
            "policy/entropy_avg": g(stats["entropy"]).mean().item(),
            "val/ratio": g(stats["ratio"]).mean().item(),
            "val/ratio_var": g(stats["ratio"]).var().item(),
            "val/num_eos_tokens": int(g(eos_mask(ro["responses"], self.eos_token_ids).sum()).sum().item())
            if self.eos_token_ids is not None else 0,
            "val/eos_rate": g(ro["ended"].float().mean()).mean().item(),
        }
        for name, values in ro["fn_values"].items():
            metrics[f"objective/reward_fn/{name}"] = g(values.to(self.accelerator.device).float().mean()).mean().item()
        metrics["lr"] = self.lr_scheduler.get_last_lr()[0]
        metrics["episode"] = self.state.episode
        return metrics

    # -- the loop ---------------------------------------------------------------------------------------------------
    def begin_state(self, done: int = 0) -> None:
        """Counters and logging / saving intervals for a run of ``num_total_batches`` updates, ``done`` of them done."""
        args = self.args
        self.state.max_steps = args.num_total_batches
        self.state.num_train_epochs = args.total_episodes / self.train_dataset_len
        for name in ("logging_steps", "eval_steps", "save_steps"):
            value = getattr(args, name)
            if value is not None:
                setattr(self.state, name, math.ceil(self.state.max_steps * value) if value < 1 else value)

    def train(self, resume_from_checkpoint: str | None = None):
        """Run the remaining updates (all of them, or those after ``resume_from_checkpoint``)."""
        args = self.args
        done = self.restore(resume_from_checkpoint) if resume_from_checkpoint else 0
        if not done:
            self.state.global_step, self.state.episode = 0, 0
        self.begin_state(done)
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        if self.is_deepspeed_enabled:
            self.deepspeed = self.model_wrapped = self.model
        batches = self.batches()
        start_time = time.time()
        for update in range(done + 1, args.num_total_batches + 1):
            self.state.episode += args.batch_size
            data = next(batches)
            ro = self.rollout(data["input_ids"].to(self.accelerator.device), data.get("row"), update)
            gc.collect()
            # each epoch's shuffle of the batch, drawn before anything trains (the same numpy draws as one per epoch)
            orders = [np.random.permutation(args.local_batch_size) for _ in range(args.num_ppo_epochs)]
            value_stats = self.value_step(ro, orders[0]) if self.single_value_forward else None
            with torch.no_grad():
                adv = self.advantages(ro)
            stats = self.optimise(ro, adv, orders, value_stats)
            with torch.no_grad():
                metrics = self.update_metrics(ro, adv, stats, start_time)
            self.state.epoch = self.state.episode / self.train_dataset_len
            self.state.global_step += 1
            self.log(metrics)
            self.lr_scheduler.step()
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
            del ro, adv, stats
            gc.collect()
            # the sample table before the checkpoint: a checkpoint of update N comes with the tables of updates <= N
            # (a resumed run drops later ones and writes them again: no table is lost or written twice)
            if args.num_sample_generations > 0 and (update - 1) % self.sample_generations_freq == 0:
                self.generate_completions(sampling=True)
            if self.control.should_save:
                self._save_checkpoint(self.model, trial=None)
                self.control = self.callback_handler.on_save(args, self.state, self.control)
        if self.reward_offload is not None:  # training is over: the reward model is an ordinary module again
            self.reward_offload.restore()
            self.reward_offload = None
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        if self.control.should_save:
            self._save_checkpoint(self.model, trial=None)
            self.control = self.callback_handler.on_save(args, self.state, self.control)

    def batches(self):
        """Prompt batches without end: passes over the (shuffled) data loader one after another."""
        while True:
            yield from self.dataloader

    def restore(self, checkpoint: str) -> int:
        """Load a checkpoint's state; returns the number of updates it had done (hook for subclasses)."""
        raise NotImplementedError("resume is provided by rlhf_trl.ppo.RLHFPPOTrainer")

    def generate_completions(self, sampling: bool = False) -> None:
        """Sample tables (hook for subclasses; the engine writes none)."""

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Save the policy only (adapter or full weights), as the Trainer's checkpoint model files."""
        wrapper = self.model
        self.model = self.unwrapped.policy
        if self.is_deepspeed_enabled:
            backup, self.deepspeed = self.deepspeed, self.model
        try:
            super().save_model(output_dir, _internal_call)
        finally:
            self.model = wrapper
            if self.is_deepspeed_enabled:
                self.deepspeed = backup

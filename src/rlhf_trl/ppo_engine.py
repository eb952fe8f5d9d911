"""PPO of a policy and a value model as TRL 1.12's PPOTrainer (removed in 1.13) computes it; `tests/test_ppo_oracle.py`
holds it to its numbers. One update, top to bottom in `PPOEngine.train`: `rollout` (sample; score = RM - baseline +
reward functions - EOS penalty) -> `advantages` -> `optimise` (`losses`) -> `update_metrics` -> `end_update`
(`check_finite`, the KL controller, log, sample table, checkpoint). A `Rollout` and the run's `BatchSizes` (derived
once) carry it; the functions after the class follow the update's order (docs/ppo-engine.md: memory measures,
differences from TRL 1.12). One process or ``accelerate``: DDP, ZeRO-2/3, FSDP."""

from __future__ import annotations

import copy
import dataclasses
import gc
import itertools
import logging
import math
import os
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import numpy as np
import torch
from safetensors.torch import save_file
from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin
from torch import nn
from torch.utils.data import DataLoader
from transformers import DataCollatorWithPadding, Trainer, TrainerControl, TrainerState
from transformers.integrations import get_reporting_integration_callbacks
from transformers.trainer import DEFAULT_CALLBACKS, DEFAULT_PROGRESS_CALLBACK
from transformers.trainer_callback import CallbackHandler, ExportableState, PrinterCallback
from transformers.trainer_utils import get_last_checkpoint

from . import ppo_math as pm
from .ppo_config import BatchSizes, PPOConfig, sampling_config
from .reward_models import OFFLOAD_PREFIX, OffloadedWeights
from .policy_value import VALUE_HEAD_FILE, ValueHead
from .scoring import (eos_mask, generate_rollouts, response_hidden, response_logprobs, response_values,
                      sequence_scores, sft_loss, truncate_at_eos)


logger = logging.getLogger(__name__)


class TrainingDivergedError(RuntimeError):
    """A loss, reward or value became NaN or infinite; the message names the update and the last good checkpoint."""


@dataclass
class OnlineTrainerState(TrainerState):
    """`transformers.TrainerState` plus the episode counter (episodes trained so far)."""

    episode: int = 0


@dataclass(frozen=True)
class Rollout:
    """One update's rollouts on this process (``b`` rows, prompts ``Q`` and responses ``R`` tokens wide): what
    `PPOEngine.rollout` sampled and scored, read by the rest of the update and never changed (`value_step` makes a
    copy with its ``values``)."""

    query_responses: torch.Tensor  # [b, Q + R] left-padded prompt, then the response right-padded with pad_token_id
    logprobs: torch.Tensor  # [b, R] the policy's log-probs of the sampled tokens (unmasked)
    ref_logprobs: torch.Tensor  # [b, R] the reference's
    values: torch.Tensor | None  # [b, R] the value model's (None until `value_step` with single_value_forward)
    sequence_lengths: torch.Tensor  # [b] index of each response's last real token (first pad - 1)
    scores: torch.Tensor  # [b] reward units: RM score - reward_baseline + reward functions - missing-EOS penalty
    ended: torch.Tensor  # [b] bool: the response holds a stop (EOS) token
    fn_values: dict  # reward function name -> [b] its raw values (empty without reward functions)
    context_length: int  # Q: the prompt width

    @property
    def responses(self) -> torch.Tensor:
        """``[b, R]`` the sampled responses (not cut at EOS)."""
        return self.query_responses[:, self.context_length:]

    def rows(self, idx, **changes) -> Rollout:
        """The rollouts of rows ``idx`` (reward-function values left whole), with ``changes`` (field -> value)."""
        picked = {k: v[idx] for k, v in vars(self).items() if isinstance(v, torch.Tensor)}
        return dataclasses.replace(self, **{**picked, **changes})


class PolicyAndValue(nn.Module):
    """Policy and value model (or the policy's `ValueHead`) as one module: one ``accelerator.prepare`` and one forward
    (the wrapper's) for both."""

    def __init__(self, policy, value_model):
        super().__init__()
        self.policy = policy
        self.value_model = value_model

    def forward(self, query_responses: torch.Tensor, context_length: int, pad_token_id: int, temperature: float,
                chunk_size: int, ptx: tuple[torch.Tensor, torch.Tensor] | None = None):
        """``[b, T]`` ids -> ``(logprobs, entropy, values, ptx_loss)``, each ``[b, R]`` (entropy without gradient; a
        `ValueHead` reads the policy's own hidden states: one backbone pass); ``ptx``: ``(input_ids [p, L],
        completion_mask [p, L])`` of SFT data -> ptx_loss, `scoring.sft_loss` (else None)."""
        hidden = (response_hidden(self.value_model.score_parts()[0], query_responses, context_length, pad_token_id)
                  if isinstance(self.value_model, ValueHead) else None)
        logprobs, entropy = response_logprobs(self.policy, query_responses, context_length, pad_token_id,
                                              temperature, chunk_size, with_entropy=True, hidden=hidden)
        values = (self.value_model.summary(hidden).squeeze(-1) if hidden is not None else
                  response_values(self.value_model, query_responses, context_length, pad_token_id))
        ptx_loss = None if ptx is None else sft_loss(self.policy, *ptx, pad_token_id, chunk_size)
        return logprobs, entropy, values, ptx_loss


def _fp32(accelerator):
    """What `accelerate` does to a prepared model's outputs under mixed precision: fp32 (else the identity)."""
    return (lambda t: t.float()) if accelerator.native_amp else (lambda t: t)


class PPOEngine(Trainer):
    """PPO of a policy (causal LM; peft model for LoRA) and a value model against a reward model (None: the
    ``reward_functions`` alone) and/or `rlhf_trl.rewards.RewardFunctions` (keyword columns: ``reward_columns(rows)``).
    A `transformers.Trainer` for its optimizer, scheduler, callbacks and checkpoint writing, without its ``__init__``
    (`set_trainer_machinery`); ``args`` is read, never changed. ``ref_model`` None: the peft policy with its adapter
    disabled, else a frozen copy; ``eos_token_ids``: default the tokenizer's EOS; ``reward_tokens``: a reward model of
    another tokenizer (`rlhf_trl.reward_models.RewardTokens`; batches carry ``row``). Raises `ValueError`: the
    reference is the policy; ``offload_reward_model`` under DeepSpeed / FSDP or shared reward / value weights."""

    def __init__(self, args: PPOConfig, processing_class, model, ref_model, reward_model, train_dataset,
                 value_model, data_collator=None, eval_dataset=None, optimizers=(None, None), callbacks=None,
                 eos_token_ids: list[int] | None = None, reward_functions=None, reward_columns=None,
                 reward_tokens=None, ptx_batches=None, ptx_coef: float = 0.0):
        from trl.trainer.utils import disable_dropout_in_model

        if ref_model is not None and ref_model is model:
            raise ValueError("the reference must be a copy of the policy (or None with a LoRA policy)")
        self.args, self.processing_class, self.policy_model = args, processing_class, model
        self.eos_token_ids = (list(eos_token_ids or [processing_class.eos_token_id]) if args.stop_token == "eos"
                              else None if args.stop_token_id is None else [args.stop_token_id])
        model.generation_config.eos_token_id = self.eos_token_ids
        # the one rollout sampling config (TRL 1.12's: temperature alone, stop at the EOS ids)
        self.generation_config = sampling_config(args, self.eos_token_ids, processing_class.pad_token_id)
        self.is_peft_model = hasattr(model, "disable_adapter") and hasattr(model, "peft_config")
        if ref_model is None and not self.is_peft_model:
            ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        self.ref_model, self.reward_model, self.value_model = ref_model, reward_model, value_model
        self.reward_functions, self.reward_columns = reward_functions, reward_columns
        self.reward_tokens = reward_tokens  # a reward model of another tokenizer: `reward_models.RewardTokens`
        self.value_head = isinstance(value_model, ValueHead)  # the value on the policy's backbone
        self.ptx_batches, self.ptx_coef = ptx_batches, ptx_coef  # PPO-ptx: SFT micro-batches (`PtxBatches`)
        self.kl_coef = args.kl_coef  # reward units per nat; the KL controller moves it
        self.kl_controller: pm.AdaptiveKLController | None = None  # None: kl_coef stays fixed
        self.reward_baseline = 0.0  # reward units, subtracted from every RM score (`rollout`)
        self.train_dataset, self.eval_dataset, self.train_dataset_len = train_dataset, eval_dataset, len(train_dataset)
        self.data_collator = data_collator or DataCollatorWithPadding(processing_class)
        self.optimizer, self.lr_scheduler = optimizers
        self.optimizer_cls_and_kwargs = None
        self.sizes = BatchSizes.derive(args, self.train_dataset_len, args.world_size)  # processes: accelerate's
        if (episodes := self.sizes.num_updates * self.sizes.batch) != self.sizes.total_episodes:
            logger.info("total_episodes %d: %d updates of %d episodes (whole updates: %d episodes)",
                        self.sizes.total_episodes, self.sizes.num_updates, self.sizes.batch, episodes)
        # one optimizer step per mini-batch, always: accumulate over its micro-batches only, and never step early at
        # the end of a pass over the prompts (TRL 1.12 synced there, stepping once per micro-batch in that update)
        self.accelerator = Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=self.sizes.micro_batches_per_step, sync_with_dataloader=False))
        self.local_seed = args.seed + self.accelerator.process_index * 100003
        # updates between sample tables (0: none)
        self.sample_every = (max(1, self.sizes.num_updates // args.num_sample_generations)
                             if args.num_sample_generations > 0 else 0)
        for m in (self.policy_model, self.ref_model, self.value_model, self.reward_model):
            if m is not None:
                disable_dropout_in_model(m)  # log-probs must be a function of the weights alone
        self.model = PolicyAndValue(self.policy_model, self.value_model)
        self.model.config = self.policy_model.config
        self.create_optimizer_and_scheduler(num_training_steps=self.sizes.num_updates)
        set_trainer_machinery(self, callbacks)
        self._prepare()
        self.reward_offload = offload_reward_model(self) if args.offload_reward_model else None

    def _prepare(self) -> None:
        """Data loaders (one shuffle on all processes, then a seed each) and ``accelerator.prepare`` of the models."""
        args, acc = self.args, self.accelerator
        self.dataloader = DataLoader(self.train_dataset, batch_size=self.sizes.local_batch, shuffle=True,
                                     collate_fn=self.data_collator, drop_last=True)
        torch.manual_seed(args.seed)
        self.model, self.optimizer, self.dataloader = acc.prepare(self.model, self.optimizer, self.dataloader)
        torch.manual_seed(self.local_seed)
        self.eval_dataloader = None if self.eval_dataset is None else acc.prepare(DataLoader(
            self.eval_dataset, args.per_device_eval_batch_size, collate_fn=self.data_collator, drop_last=True))
        from trl.models.utils import prepare_deepspeed

        for name in ("reward_model", "ref_model"):
            if (m := getattr(self, name)) is not None:
                setattr(self, name, prepare_deepspeed(m, acc) if self.is_deepspeed_enabled else m.to(acc.device))
        # one process, no wrapper: policy and value losses back-propagated one after the other (`losses`)
        self.split_backward = isinstance(self.model, PolicyAndValue)
        self.single_value_forward = (args.single_value_forward and self.split_backward and args.num_ppo_epochs == 1
                                     and args.num_mini_batches == 1 and not args.whiten_rewards
                                     and not self.value_head)  # a value head's step would move the policy too

    # -- the models ---------------------------------------------------------------------------------------------------
    @property
    def unwrapped(self) -> PolicyAndValue:
        return self.accelerator.unwrap_model(self.model)

    def reward_weights(self):
        """The reward model (None without one) for a ``with`` block, its weights read back for it when offloaded."""
        return nullcontext(self.reward_model) if self.reward_offload is None else self.reward_offload.loaded()

    @contextmanager
    def reference(self):
        """The reference policy: a frozen copy, or the policy with its adapter disabled (or ``ref_adapter_name``)."""
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
        ctx = nullcontext()
        if self.is_deepspeed_enabled and self.args.ds3_gather_for_generation \
                and self.accelerator.state.deepspeed_plugin.zero_stage == 3:
            import deepspeed

            ctx = deepspeed.zero.GatheredParameters(self.model.parameters())
        with ctx:
            yield self.unwrapped.policy

    # -- the loop: one update, top to bottom ----------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | None = None):
        """Run the remaining updates (all of them, or those after ``resume_from_checkpoint``)."""
        args, sizes = self.args, self.sizes
        done = self.restore(resume_from_checkpoint) if resume_from_checkpoint else 0
        if not done:
            self.state.global_step, self.state.episode = 0, 0
        begin_state(self)
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        if self.is_deepspeed_enabled:
            self.deepspeed = self.model_wrapped = self.model
        # prompt batches without end: passes over the (shuffled) data loader one after another
        batches, start_time = itertools.chain.from_iterable(itertools.repeat(self.dataloader)), time.time()
        for update in range(done + 1, sizes.num_updates + 1):
            self.state.episode += sizes.batch
            data = next(batches)
            # 1. rollout: sample, then score (RM score - baseline + reward functions - missing-EOS penalty)
            ro = self.rollout(data["input_ids"].to(self.accelerator.device), data.get("row"), update)
            gc.collect()
            # each epoch's shuffle of the batch, drawn before anything trains (the same numpy draws as one per epoch)
            orders = [np.random.permutation(sizes.local_batch) for _ in range(args.num_ppo_epochs)]
            # single_value_forward: the values come from the value model's training forward
            values, value_stats = value_step(self, ro, orders[0]) if self.single_value_forward else (ro.values, None)
            ro = dataclasses.replace(ro, values=values)
            # 2. advantages (GAE on the KL-shaped rewards), 3. optimise (the clipped PPO losses)
            with torch.no_grad():
                adv = self.advantages(ro)
            stats = self.optimise(ro, adv, orders, value_stats)
            # 4. statistics, then 5. finite check, KL controller, log, sample table, checkpoint
            with torch.no_grad():
                metrics = update_metrics(self, ro, adv, stats, start_time)
            del ro, adv, stats
            self.end_update(update, metrics)
            if self.control.should_training_stop:  # a stop signal: this update's checkpoint is written
                break
        if self.reward_offload is not None:  # training is over: the reward model is an ordinary module again
            self.reward_offload.restore()
            self.reward_offload = None
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        if self.control.should_save:
            self._save_checkpoint(self.model, trial=None)
            self.control = self.callback_handler.on_save(args, self.state, self.control)

    # -- 1. rollout ---------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def rollout(self, queries: torch.Tensor, rows: torch.Tensor | None, update: int) -> Rollout:
        """Sample and score responses to left-padded prompts ``queries [b, Q]`` (``rows [b]``: their record indices,
        for reward functions' columns and a reward model of another tokenizer; ``update``: 1-based): a `Rollout`
        (values None with ``single_value_forward``)."""
        args, tok = self.args, self.processing_class
        pad, context, step = tok.pad_token_id, queries.shape[1], args.local_rollout_forward_batch_size
        with self.generation_policy() as policy:
            query_responses, logprobs = generate_rollouts(policy, queries, pad, self.generation_config, step)
        post = query_responses[:, context:]  # the responses, cut after their first EOS
        post = post if self.eos_token_ids is None else truncate_at_eos(post, self.eos_token_ids, pad)
        out = {k: [] for k in ("ref_logprobs", "values", "scores")}
        with self.reward_weights() as reward_model:
            for i in range(0, query_responses.shape[0], step):
                qr = query_responses[i:i + step]
                with self.reference() as ref:
                    out["ref_logprobs"].append(response_logprobs(ref, qr, context, pad, args.temperature + 1e-7,
                                                                 args.logits_chunk_size))
                if not self.single_value_forward:  # else `value_step` gives the values
                    out["values"].append(response_values(self.unwrapped.value_model, qr, context, pad))
                if reward_model is not None:  # one of another tokenizer (`reward_tokens`) reads re-encoded text
                    out["scores"].append(
                        sequence_scores(reward_model, torch.cat((qr[:, :context], post[i:i + step]), 1), pad, context)
                        if self.reward_tokens is None else self.reward_tokens.score_batch(
                            reward_model, "train", None if rows is None else rows[i:i + step], post[i:i + step],
                            self.eos_token_ids, pad, step))
        # the score of each rollout, written out: RM score - reward_baseline + weighted reward functions - EOS penalty
        scores = (torch.cat(out["scores"]) - self.reward_baseline if out["scores"] else
                  torch.zeros(len(post), device=post.device))
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
        return Rollout(query_responses, logprobs, torch.cat(out["ref_logprobs"]),
                       torch.cat(out["values"]) if out["values"] else None, pm.first_true_indices(post == pad) - 1,
                       scores, ended, fn_values, context)

    # -- 2. advantages ------------------------------------------------------------------------------------------------
    def advantages(self, ro: Rollout, whiten: bool = True) -> dict:
        """`ppo_math.compute_advantages` of the rollout ``ro`` (or some of its rows) at this update's ``kl_coef``:
        ``[b, R]`` tensors."""
        args = self.args
        return pm.compute_advantages(ro.logprobs, ro.ref_logprobs, ro.values, ro.scores, ro.sequence_lengths,
                                     self.kl_coef, args.kl_estimator, args.gamma, args.lam, args.whiten_rewards,
                                     whiten_advantages=whiten)

    # -- 3. optimise --------------------------------------------------------------------------------------------------
    def optimise(self, ro: Rollout, adv: dict, orders: list[np.ndarray], value_stats: list[dict] | None = None
                 ) -> dict:
        """``num_ppo_epochs`` x ``num_mini_batches`` optimizer steps over each epoch's shuffle ``orders[e] [b]``;
        returns the ``[epochs, mini-batches, micro-batches]`` statistics (``value_stats``: `value_step`'s, applied)."""
        args, acc = self.args, self.accelerator
        shape = (args.num_ppo_epochs, args.num_mini_batches, args.gradient_accumulation_steps)
        stats = {k: torch.zeros(shape, device=acc.device) for k in
                 ("approxkl", "pg_clipfrac", "pg_loss", "vf_loss", "vf_clipfrac", "entropy", "ratio", "ptx_loss")}
        self.model.train()
        for epoch in range(args.num_ppo_epochs):
            for mb, k, idx in micro_batches(self.sizes, orders[epoch]):
                with acc.accumulate(self.model):
                    pg, vf, entropy, ptx = losses(self, ro, adv, idx, value=value_stats is None)
                    self.optimizer.step()
                    self.optimizer.zero_grad()
                vf = vf if value_stats is None else value_stats[k]
                for key, value in (("approxkl", pg["approxkl"]), ("pg_clipfrac", pg["clipfrac"]),
                                   ("pg_loss", pg["loss"]), ("vf_loss", vf["loss"]), ("vf_clipfrac", vf["clipfrac"]),
                                   ("ratio", pg["ratio"]), ("entropy", entropy.mean()),
                                   ("ptx_loss", ptx)):  # ptx: None without ptx data (stays 0)
                    if value is not None:
                        stats[key][epoch, mb, k] = value.detach()
                del entropy, vf, pg
        return stats

    # -- 5. the update's end ------------------------------------------------------------------------------------------
    def end_update(self, update: int, metrics: dict) -> None:
        """Counters, the finite check, the KL controller, log, scheduler step, callbacks, the sample table and the
        checkpoint of update ``update``. Raises `TrainingDivergedError`: a non-finite statistic."""
        self.state.epoch = self.state.episode / self.train_dataset_len
        self.state.global_step += 1
        check_finite(self, metrics)
        metrics["objective/kl_coef"] = self.kl_coef  # the coefficient this update's rewards used
        if self.kl_controller is not None:
            self.kl_coef = self.kl_controller.update(metrics["objective/kl"], self.sizes.batch)
        self.log(metrics)
        self.lr_scheduler.step()
        self.control = self.callback_handler.on_step_end(self.args, self.state, self.control)
        gc.collect()
        # the sample table before the checkpoint: a checkpoint of update N comes with the tables of updates <= N
        # (a resumed run drops later ones and writes them again: no table is lost or written twice)
        if self.sample_every and (update - 1) % self.sample_every == 0:
            self.generate_completions(sampling=True)
        if self.control.should_save:
            self._save_checkpoint(self.model, trial=None)
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)

    def restore(self, checkpoint: str) -> int:
        """Load a checkpoint's state; returns the number of updates it had done (hook for subclasses)."""
        raise NotImplementedError("resume is provided by rlhf_trl.ppo_trainer.RLHFPPOTrainer")

    def generate_completions(self, sampling: bool = False) -> None:
        """Sample tables (hook for subclasses; the engine writes none)."""

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Save the policy as the checkpoint's model files, with its value head (``value_head.safetensors``) when it
        has one; call on every process (DeepSpeed gathers the state)."""
        wrapper, self.model, out = self.model, self.unwrapped.policy, output_dir or self.args.output_dir
        try:
            if not self.is_deepspeed_enabled:
                super().save_model(out, _internal_call)
                head = self.accelerator.unwrap_model(wrapper).value_model.head_state() if self.value_head else None
            else:
                full = self.accelerator.get_state_dict(self.deepspeed)  # main process: the whole state dict
                head = None
                if self.args.should_save:
                    policy = {k.removeprefix("policy."): v for k, v in full.items() if k.startswith("policy.")}
                    self._save(out, state_dict=policy)
                    head = {f"v_head.{k.removeprefix('value_model.')}": v.detach().cpu().contiguous()
                            for k, v in full.items() if self.value_head and k.startswith("value_model.summary.")}
            if head and self.args.should_save:
                save_file(head, os.path.join(out, VALUE_HEAD_FILE))
        finally:
            self.model = wrapper


# -- the steps of one update, in order (`PPOEngine.train` / `optimise` / `end_update` call them) ------------------
def value_step(engine, ro: Rollout, order: np.ndarray) -> tuple[torch.Tensor, list[dict]]:
    """``single_value_forward`` (docs/ppo-engine.md): per micro-batch of ``order``, one forward with gradient gives
    ``values [micro, R]`` and the value loss, then AdamW steps the value model alone; returns the rollout's
    ``values [b, R]`` and the per-micro-batch value-loss statistics."""
    args, acc, pad = engine.args, engine.accelerator, engine.processing_class.pad_token_id
    fp32, values, stats = _fp32(acc), None, []
    engine.model.train()
    for _, _, idx in micro_batches(engine.sizes, order):
        with acc.autocast():
            vpred = fp32(response_values(engine.model.value_model, ro.query_responses[idx], ro.context_length, pad))
        with torch.no_grad():
            a = engine.advantages(ro.rows(idx, values=vpred.detach()), whiten=False)
        vf = pm.value_loss(vpred.masked_fill(a["padding_mask_p1"], 0), a["values"], a["returns"],
                           ~a["padding_mask_p1"], args.cliprange_value)
        acc.backward(args.vf_coef * vf["loss"])
        if values is None:  # the value model's output dtype, as the no-grad forward's
            values = vpred.new_zeros(ro.responses.shape)
        values[idx] = vpred.detach()
        stats.append({k: v.detach() for k, v in vf.items()})
        del vpred, vf
    optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)  # the torch optimizer inside accelerate's
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # the policy's step must skip the value model's parameters
    return values, stats


def losses(engine, ro: Rollout, adv: dict, idx, value: bool = True
           ) -> tuple[dict, dict | None, torch.Tensor, torch.Tensor | None]:
    """Forward and backward of micro-batch ``idx``: clipped policy loss + ``vf_coef`` x clipped value loss (one
    after the other without a wrapper, unless the value is the policy's head) + ``ptx_coef`` x the SFT loss of the
    next ptx micro-batch (PPO-ptx); returns their statistics, entropy ``[b, R]`` (``value`` false: the policy's
    only) and the ptx loss (None without ptx data)."""
    args, acc, pad = engine.args, engine.accelerator, engine.processing_class.pad_token_id
    ids, context = ro.query_responses[idx], ro.context_length
    mask, mask_p1 = adv["padding_mask"][idx], adv["padding_mask_p1"][idx]
    ptx = None if engine.ptx_batches is None else engine.ptx_batches.next(acc.device)

    def policy_loss(new_logprobs):
        return pm.policy_loss(new_logprobs.masked_fill(mask, pm.INVALID_LOGPROB), adv["logprobs"][idx],
                              adv["advantages"][idx], ~mask, args.cliprange)

    def value_loss(vpred):
        return pm.value_loss(vpred.masked_fill(mask_p1, 0), adv["values"][idx], adv["returns"][idx], ~mask_p1,
                             args.cliprange_value)

    if not engine.split_backward or engine.value_head:  # one forward (the wrapper's) and one backward
        new_logprobs, entropy, vpred, ptx_loss = engine.model(ids, context, pad, args.temperature + 1e-7,
                                                            args.logits_chunk_size, ptx)
        pg, vf = policy_loss(new_logprobs), value_loss(vpred)
        loss = pg["loss"] + args.vf_coef * vf["loss"]
        acc.backward(loss if ptx_loss is None else loss + engine.ptx_coef * ptx_loss)
        return pg, vf, entropy, None if ptx_loss is None else ptx_loss.detach()
    fp32 = _fp32(acc)
    with acc.autocast():
        new_logprobs, entropy = response_logprobs(engine.model.policy, ids, context, pad, args.temperature + 1e-7,
                                                  args.logits_chunk_size, with_entropy=True)
    pg = policy_loss(fp32(new_logprobs))
    acc.backward(pg["loss"])
    del new_logprobs
    ptx_loss = None
    if ptx is not None:
        with acc.autocast():
            ptx_loss = fp32(sft_loss(engine.model.policy, *ptx, pad, args.logits_chunk_size))
        acc.backward(engine.ptx_coef * ptx_loss)
        ptx_loss = ptx_loss.detach()
    if not value:
        return pg, None, fp32(entropy), ptx_loss
    with acc.autocast():
        vpred = response_values(engine.model.value_model, ids, context, pad)
    vf = value_loss(fp32(vpred))
    acc.backward(args.vf_coef * vf["loss"])
    return pg, vf, fp32(entropy), ptx_loss


def micro_batches(sizes: BatchSizes, order: np.ndarray):
    """Yields ``(mini-batch, micro-batch, row indices)`` over one epoch's shuffled ``order [b]``."""
    for mb, start in enumerate(range(0, sizes.local_batch, sizes.local_mini_batch)):
        mini = order[start:start + sizes.local_mini_batch]
        for k, micro_start in enumerate(range(0, sizes.local_mini_batch, sizes.per_device)):
            yield mb, k, mini[micro_start:micro_start + sizes.per_device]


def update_metrics(engine, ro: Rollout, adv: dict, stats: dict, start_time: float) -> dict:
    """The logged statistics of one update (TRL 1.12's names), averaged over processes."""
    g = engine.accelerator.gather_for_metrics
    metrics = {"eps": int(engine.state.episode / max(time.time() - start_time, 1e-9))}
    non_score, scores = adv["non_score_reward"].sum(1).mean(), ro.scores.mean()
    for name, value in (("objective/kl", adv["kl"].sum(1).mean()),
                        ("objective/entropy", ((-adv["logprobs"]) * (~adv["padding_mask"]).float()).sum(1).mean()),
                        ("objective/non_score_reward", non_score), ("objective/rlhf_reward", non_score + scores),
                        ("objective/scores", scores), ("policy/approxkl_avg", stats["approxkl"]),
                        ("policy/clipfrac_avg", stats["pg_clipfrac"]), ("loss/policy_avg", stats["pg_loss"]),
                        ("loss/value_avg", stats["vf_loss"]), ("val/clipfrac_avg", stats["vf_clipfrac"]),
                        ("policy/entropy_avg", stats["entropy"]), ("val/ratio", stats["ratio"])):
        metrics[name] = g(value).mean().item()
    if engine.ptx_batches is not None:
        metrics["loss/ptx_avg"] = g(stats["ptx_loss"]).mean().item()
    ratios = g(stats["ratio"])  # one value per micro-batch; one alone has no spread: 0 (TRL 1.12 logged NaN)
    metrics["val/ratio_var"] = ratios.var().item() if ratios.numel() > 1 else 0.0
    metrics["val/num_eos_tokens"] = (int(g(eos_mask(ro.responses, engine.eos_token_ids).sum()).sum().item())
                                     if engine.eos_token_ids is not None else 0)
    metrics["val/eos_rate"] = g(ro.ended.float().mean()).mean().item()
    for name, values in ro.fn_values.items():
        metrics[f"objective/reward_fn/{name}"] = g(values.to(engine.accelerator.device).float().mean()).mean().item()
    metrics.update(lr=engine.lr_scheduler.get_last_lr()[0], episode=engine.state.episode)
    return metrics


def check_finite(engine, metrics: dict) -> None:
    """Stop on a non-finite statistic (`TrainingDivergedError`, naming the last good checkpoint); warn about a
    negative mean KL (the rollouts are then not samples of the policy, or the estimate is noisy)."""
    if bad := sorted(k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)):
        out = engine.args.output_dir
        last = get_last_checkpoint(out) if os.path.isdir(out) else None
        raise TrainingDivergedError(
            f"non-finite {', '.join(bad)} at update {engine.state.global_step} (episode {engine.state.episode}); "
            f"nothing was saved for this update; last good checkpoint: {last or 'none yet'}")
    if metrics["objective/kl"] < -1e-3:  # below rounding noise
        logger.warning("update %d: mean KL to the reference is negative (%.4f): the rollouts are not samples of "
                       "the policy (check temperature / generation settings) or the estimate is noisy (use "
                       "kl_estimator k3)", engine.state.global_step, metrics["objective/kl"])


# -- construction (`PPOEngine.__init__` calls them) --------------------------------------------------------------
def set_trainer_machinery(engine, callbacks) -> None:
    """What ``Trainer.__init__`` would set: callbacks, control, state, flags."""
    args = engine.args
    callbacks_all = DEFAULT_CALLBACKS + get_reporting_integration_callbacks(args.report_to) + list(callbacks or [])
    engine.callback_handler = CallbackHandler(callbacks_all, engine.model, engine.processing_class, engine.optimizer,
                                            engine.lr_scheduler)
    engine.add_callback(PrinterCallback if args.disable_tqdm else DEFAULT_PROGRESS_CALLBACK)
    engine.control = TrainerControl()
    engine.state = OnlineTrainerState(
        is_local_process_zero=engine.is_local_process_zero(), is_world_process_zero=engine.is_world_process_zero(),
        stateful_callbacks=[cb for cb in engine.callback_handler.callbacks + [engine.control]
                            if isinstance(cb, ExportableState)])
    engine.current_flos, engine.hp_search_backend, engine.hub_model_id = 0, None, None
    engine.is_deepspeed_enabled = getattr(engine.accelerator.state, "deepspeed_plugin", None) is not None
    engine.is_fsdp_enabled = getattr(engine.accelerator.state, "fsdp_plugin", None) is not None
    engine.is_distributed_loading_by_transformers = False
    if args.should_save:
        os.makedirs(args.output_dir, exist_ok=True)


def offload_reward_model(engine) -> OffloadedWeights | None:
    """``offload_reward_model``: the reward model's weights to ``output_dir/.tmp-offload-*`` between uses."""
    if engine.reward_model is None:
        return None
    if engine.is_deepspeed_enabled or engine.is_fsdp_enabled:
        raise ValueError("offload_reward_model works without DeepSpeed / FSDP (they shard or offload "
                         "themselves); set `offload_reward_model: false`")
    if any(p is q for p in engine.reward_model.parameters() for q in engine.value_model.parameters()):
        raise ValueError("offload_reward_model: the reward model shares weights with the value model "
                         "(share_reward_value_base); set `offload_reward_model: false`")
    return OffloadedWeights(engine.reward_model, os.path.join(
        engine.args.output_dir, f"{OFFLOAD_PREFIX}reward-model-{engine.accelerator.process_index}.safetensors"))


def begin_state(engine) -> None:
    """Counters and logging / saving intervals for a run of ``sizes.num_updates`` updates."""
    engine.state.max_steps = engine.sizes.num_updates
    engine.state.num_train_epochs = engine.sizes.total_episodes / engine.train_dataset_len
    for name in ("logging_steps", "eval_steps", "save_steps"):
        if (value := getattr(engine.args, name)) is not None:
            setattr(engine.state, name, math.ceil(engine.state.max_steps * value) if value < 1 else value)

"""`RLHFPPOTrainer`: the PPO engine (`rlhf_trl.ppo_engine.PPOEngine`) plus atomic checkpoints (value model, data
position, baseline, KL coefficient, recipe), exact resume, ``logging_steps``, adaptive KL, a NaN stop, sample tables."""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
from contextlib import contextmanager, suppress

import torch
from accelerate.utils import gather_object
from peft import PeftModel, set_peft_model_state_dict
from safetensors.torch import load_file
from transformers.integrations.deepspeed import deepspeed_load_checkpoint
from transformers.trainer_utils import load_sharded_checkpoint

from .atomic import strict_json, write_json, write_jsonl
from .checkpoints import AtomicCheckpointMixin
from .config import save_recipe
from .ppo_config import sampling_config
from .ppo_engine import OnlineTrainerState, PPOEngine
from .ppo_math import AdaptiveKLController
from .policy_value import VALUE_HEAD_FILE
from .scoring import (generate_rollouts, pad_right, preserved_rng, rng_state, sequence_scores, set_rng_state,
                      truncate_at_eos)

logger = logging.getLogger(__name__)


class ResumableLoader:
    """The prompt dataloader with an exactly restorable data position: the RNG states at each pass's start (global,
    and the sampler's generators) and the batches consumed; a resume replays the shuffle, skips those batches, then
    restores the checkpoint's RNG state. Raises `ValueError` (after `resume_from`): another number of generators."""

    def __init__(self, loader):
        self.loader, self.consumed = loader, 0
        self.epoch_rng: dict | None = None
        self.epoch_generators: list[torch.Tensor] | None = None
        self._resume: dict | None = None  # the checkpoint's `state` until the next pass starts

    def _generators(self) -> list[torch.Generator]:
        """The sampler's own generators (none in one process: it draws from the global torch RNG)."""
        batch_sampler = getattr(self.loader, "batch_sampler", None)
        found = [getattr(self.loader, "synchronized_generator", None)] + [getattr(h, "generator", None) for h in (
            getattr(self.loader, "sampler", None), getattr(batch_sampler, "sampler", None),
            getattr(getattr(batch_sampler, "batch_sampler", None), "sampler", None))]
        return list(dict.fromkeys(g for g in found if isinstance(g, torch.Generator)))  # each once (by identity)

    def __iter__(self):
        resume, self._resume = self._resume, None
        if resume is None:
            self.epoch_rng, self.epoch_generators = rng_state(), [g.get_state() for g in self._generators()]
        else:
            self.epoch_rng, self.epoch_generators = resume["epoch_rng"], resume.get("epoch_generators")
            set_rng_state(self.epoch_rng)
            generators, saved = self._generators(), self.epoch_generators
            if saved is not None and len(generators) != len(saved):
                raise ValueError(f"the checkpoint's data position holds {len(saved)} sampler generator "
                                 f"states, this run's data loader has {len(generators)} (another number of processes?)")
            if saved is None and generators:  # a checkpoint written before sampler generators were saved
                logger.warning("the checkpoint's data position lacks the sampler's generator state: the data "
                               "order of this pass may differ from the interrupted run's")
            for gen, state in zip(generators, saved or []):
                gen.set_state(state)
        self.consumed, it = 0, iter(self.loader)
        if resume is not None:
            for _ in range(resume["consumed"]):
                next(it)
                self.consumed += 1
            set_rng_state(resume["now"])
        for batch in it:
            self.consumed += 1
            yield batch

    def state(self) -> dict:
        return {"epoch_rng": self.epoch_rng, "epoch_generators": self.epoch_generators, "consumed": self.consumed,
                "now": rng_state()}

    def resume_from(self, state: dict) -> None:
        self._resume = state


class PtxBatches:
    """PPO-ptx's SFT micro-batches without end: ``features`` (``input_ids`` / ``completion_mask`` lists, `sft_features`)
    in passes of a shuffled order drawn from its own generator (``seed``; the run's other RNG streams are untouched),
    ``batch_size`` rows each (a pass drops its last partial batch). The data position, `state` (the generator at the
    pass's start and the batches consumed), goes into each checkpoint: a resume draws the same batches. Raises
    `ValueError`: fewer rows than ``batch_size``."""

    def __init__(self, features: dict[str, list], batch_size: int, pad_token_id: int, seed: int):
        if len(features["input_ids"]) < batch_size:
            raise ValueError(f"ptx_dataset: {len(features['input_ids'])} rows, fewer than one micro-batch "
                             f"(per_device_train_batch_size={batch_size}); add rows or lower the batch size")
        self.features, self.batch_size, self.pad_token_id = features, batch_size, pad_token_id
        self.generator = torch.Generator().manual_seed(seed)
        self.pass_start, self.order, self.consumed = None, [], 0

    def _new_pass(self) -> None:
        self.pass_start, self.consumed = self.generator.get_state(), 0
        self.order = torch.randperm(len(self.features["input_ids"]), generator=self.generator).tolist()

    def next(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The next micro-batch: right-padded ``(input_ids [batch, L], completion_mask [batch, L])`` on ``device``."""
        if self.pass_start is None or (self.consumed + 1) * self.batch_size > len(self.order):
            self._new_pass()
        rows = self.order[self.consumed * self.batch_size:(self.consumed + 1) * self.batch_size]
        self.consumed += 1
        return tuple(pad_right([self.features[key][i] for i in rows], pad).to(device)
                     for key, pad in (("input_ids", self.pad_token_id), ("completion_mask", 0)))

    def state(self) -> dict:
        return {"pass_start": self.pass_start, "consumed": self.consumed}

    def load_state(self, state: dict) -> None:
        if state["pass_start"] is not None:
            self.generator.set_state(state["pass_start"])
            self._new_pass()
            self.consumed = state["consumed"]


class RLHFPPOTrainer(AtomicCheckpointMixin, PPOEngine):
    """The PPO engine plus resumable, atomic checkpoints, KL control, divergence checks and sample tables."""

    stop_unit = "update"

    def __init__(self, *args, script_args, recipe_configs: tuple = (), stock_generation_config=None, **kwargs):
        """``recipe_configs``: saved as each checkpoint's ``run_config.yaml``; ``stock_generation_config``: with the
        merged policies. The rest: `PPOEngine`'s."""
        super().__init__(*args, **kwargs)
        self.stock_generation_config, self.script_args = stock_generation_config, script_args
        self.recipe_configs = recipe_configs
        self.dataloader = ResumableLoader(self.dataloader)
        self.sample_every = max(0, script_args.log_samples_every or 0)  # updates between sample tables (0: none)
        # the sample tables' near-greedy sampling, built once as the rollouts' (`PPOEngine.generation_config`)
        self.sample_table_config = sampling_config(self.args, self.eos_token_ids, self.processing_class.pad_token_id,
                                                   temperature=0.01)
        self.kl_controller = None if script_args.kl_target is None else AdaptiveKLController(
            self.kl_coef, script_args.kl_target, script_args.kl_horizon)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Log an update's statistics every ``logging_steps`` updates (the last always); other logs as they come."""
        every, step = max(1, int(self.state.logging_steps or 1)), self.state.global_step
        if "objective/kl" not in logs or not step % every or step >= self.state.max_steps:
            super().log(logs, start_time)

    def generate_completions(self, sampling: bool = False):
        """Sample one eval batch (temperature 0.01), score it, log query / response / score / reward. Never changes the
        run: the RNG is preserved, the loader's ``end()`` runs on an early exit (else accumulation would step early)."""
        if self.eval_dataloader is None:
            return
        tok, pad = self.processing_class, self.processing_class.pad_token_id
        rows, loader = [], self.eval_dataloader
        with preserved_rng():
            try:
                for batch in loader:
                    query, context = batch["input_ids"], batch["input_ids"].shape[1]
                    with self.generation_policy() as policy:
                        query_response, _ = generate_rollouts(policy, query, pad, self.sample_table_config, len(query))
                    response = (query_response[:, context:] if self.eos_token_ids is None else
                                truncate_at_eos(query_response[:, context:], self.eos_token_ids, pad))
                    with torch.no_grad(), self.reward_weights() as reward_model:
                        reward = (torch.zeros(len(query)) if reward_model is None else
                                  sequence_scores(reward_model, torch.cat((query, response), 1), pad, context)
                                  if self.reward_tokens is None else self.reward_tokens.score_batch(
                                      reward_model, "eval", batch.get("row"), response, self.eos_token_ids, pad))
                    texts = zip(tok.batch_decode(query, skip_special_tokens=True),
                                tok.batch_decode(response, skip_special_tokens=True), reward.float().cpu().tolist())
                    rows += [{"step": self.state.global_step, "query": q, "response": r,
                              "score": s, "reward": s - self.reward_baseline} for q, r, s in texts]
                    if sampling:
                        break
            finally:  # off accelerate's gradient state, also after a `break` (`_prepare`: a prepared loader)
                loader.end()
        if self.accelerator.num_processes > 1:  # each process sampled its shard of the eval prompts
            rows = gather_object(rows)
        if not self.accelerator.is_main_process or not rows:
            return
        lines = [f"samples at update {self.state.global_step} (score = RM score, reward = score - baseline):"]
        lines += [f"  {r['query']!r} -> {r['response']!r}  score={r['score']:.3f} reward={r['reward']:.3f}"
                  for r in rows[:4]]
        logger.info("\n".join(lines))
        os.makedirs(self.args.output_dir, exist_ok=True)
        with open(os.path.join(self.args.output_dir, "samples.jsonl"), "a", encoding="utf-8") as f:
            f.writelines(json.dumps(strict_json(row), ensure_ascii=False, allow_nan=False) + "\n" for row in rows)

    def checkpoint_extras(self, ckpt: str) -> None:
        """What the Trainer's checkpoint files lack: each process's data position and RNG state; from the main
        process the value model, the merged policy (``save_merged_checkpoints``), baseline / KL state and recipe."""
        rank, data_state = self.accelerator.process_index, self.dataloader.state()
        if self.ptx_batches is not None:
            data_state["ptx"] = self.ptx_batches.state()
        if rank > 0:
            os.makedirs(ckpt, exist_ok=True)
            torch.save(data_state, os.path.join(ckpt, _data_state_name(rank)))
        if not self.args.should_save:  # under `accelerate launch`, the main process writes the other extras
            return
        if not self.value_head:  # a value head is saved with the policy (`save_model`)
            self.unwrapped.value_model.save_pretrained(os.path.join(ckpt, "value_model"), safe_serialization=True)
        if self.script_args.save_merged_checkpoints:
            policy = self.unwrapped.policy
            policy = copy.deepcopy(policy).merge_and_unload() if isinstance(policy, PeftModel) else policy
            with deployable_generation_config(policy, self.stock_generation_config):
                policy.save_pretrained(os.path.join(ckpt, "merged"), safe_serialization=True)
            if self.value_head:  # `save_model` wrote it beside the policy's files
                shutil.copyfile(os.path.join(ckpt, VALUE_HEAD_FILE), os.path.join(ckpt, "merged", VALUE_HEAD_FILE))
            self.processing_class.save_pretrained(os.path.join(ckpt, "merged"))
        torch.save(data_state, os.path.join(ckpt, "data_state.pt"))
        write_json(os.path.join(ckpt, "reward_baseline.json"), {"reward_baseline": self.reward_baseline,
                                                                "kl_coef": self.kl_coef})
        if self.recipe_configs:
            save_recipe(ckpt, self.recipe_configs)

    def restore(self, ckpt: str) -> int:
        """Continue the run of ``checkpoint-N`` ``ckpt`` exactly (weights, optimizer, scheduler, counters, logs, KL
        coefficient, data position, RNG); returns the updates done. Raises `FileNotFoundError`: a file needed is
        missing; `ValueError`: a run of another number of updates, or none left."""
        needed = ["scheduler.pt", "trainer_state.json", "data_state.pt",
                  VALUE_HEAD_FILE if self.value_head else "value_model",
                  "latest" if self.is_deepspeed_enabled else "optimizer.pt"]
        if missing := [n for n in needed if not os.path.exists(os.path.join(ckpt, n))]:
            raise FileNotFoundError(f"cannot resume from {ckpt}: missing {missing}")
        if self.is_deepspeed_enabled:  # weights and this process's optimizer partition from the global_stepN shards
            deepspeed_load_checkpoint(self.model, ckpt, load_module_strict=False)  # self.model: the DeepSpeed engine
        else:
            _load_weights(self.unwrapped.policy, ckpt)
            if self.value_head:
                head = os.path.join(ckpt, VALUE_HEAD_FILE)
                self.unwrapped.value_model.load_head_state(load_file(head), head)
            else:
                _load_weights(self.unwrapped.value_model, os.path.join(ckpt, "value_model"))
            self.optimizer.load_state_dict(torch.load(os.path.join(ckpt, "optimizer.pt"), weights_only=True))
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(ckpt, "scheduler.pt"), weights_only=True))
        saved = OnlineTrainerState.load_from_json(os.path.join(ckpt, "trainer_state.json"))
        extras = json.load(open(os.path.join(ckpt, "reward_baseline.json"))) if os.path.exists(
            os.path.join(ckpt, "reward_baseline.json")) else {}
        self.kl_coef = extras.get("kl_coef", self.kl_coef)
        if self.kl_controller is not None:
            self.kl_controller.value = self.kl_coef
        total, done = self.sizes.num_updates, saved.global_step
        planned = getattr(saved, "max_steps", 0) or total
        if planned != total:  # the learning-rate schedule and the data order were laid out for the saved run
            raise ValueError(f"{ckpt} belongs to a run of {planned} updates; this recipe makes {total} (total_episodes "
                             "/ effective batch): resume with the same total_episodes and batch sizes, or start afresh")
        self.state.global_step, self.state.log_history = done, saved.log_history
        self.state.episode = getattr(saved, "episode", 0) or done * self.sizes.batch
        data_state = os.path.join(ckpt, _data_state_name(self.accelerator.process_index))
        if not os.path.exists(data_state):
            raise FileNotFoundError(f"cannot resume from {ckpt}: missing {os.path.basename(data_state)} (the "
                                    "checkpoint was written by fewer processes than this run has)")
        data_state = torch.load(data_state, weights_only=False)
        self.dataloader.resume_from(data_state)
        if self.ptx_batches is not None:
            if "ptx" not in data_state:
                raise ValueError(f"{ckpt} was written without ptx_dataset; resume it without ptx_dataset, or start "
                                 "afresh")
            self.ptx_batches.load_state(data_state["ptx"])
        samples = os.path.join(self.args.output_dir, "samples.jsonl")
        if self.accelerator.is_main_process and os.path.exists(samples):  # a resume rewrites the later updates' rows
            rows = []
            with open(samples, encoding="utf-8") as f:
                for line in f:
                    with suppress(json.JSONDecodeError):  # a torn line
                        rows.append(json.loads(line))
            write_jsonl(samples, [row for row in rows if isinstance(row, dict) and row.get("step", 0) <= done])
        logger.info("resuming from %s at update %d of %d (episode %d)", ckpt, done, total, self.state.episode)
        return done


def _data_state_name(rank: int) -> str:
    """The file of a process's data position and RNG state in a checkpoint (process 0: ``data_state.pt``)."""
    return "data_state.pt" if rank == 0 else f"data_state_rank{rank}.pt"


def _load_weights(model, folder: str) -> None:
    """Load a policy / value model's weights saved by ``save_pretrained`` in ``folder`` (ValueError: a mismatch)."""
    if isinstance(model, PeftModel):
        set_peft_model_state_dict(model, load_file(os.path.join(folder, "adapter_model.safetensors")))
    elif os.path.isfile(single := os.path.join(folder, "model.safetensors")):
        missing, unexpected = model.load_state_dict(load_file(single), strict=False)
        if [k for k in missing if "lm_head" not in k] or unexpected:  # a tied lm_head is missing: not an error
            raise ValueError(f"{folder}: weights do not match the model (missing {missing}, unexpected {unexpected})")
    else:
        load_sharded_checkpoint(model, folder, strict=False)


@contextmanager
def deployable_generation_config(policy, stock):
    """Save ``policy`` (or its peft base) with its stock generation config ``stock``, not PPO's; restore after."""
    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    current = base.generation_config
    base.generation_config = current if stock is None else stock
    try:
        yield
    finally:
        base.generation_config = current

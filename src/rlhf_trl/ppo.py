"""Stage 3: PPO against the reward model (and/or reward functions) with a KL penalty to a frozen reference.

Run: ``rlhf-trl ppo --config recipes/demo/ppo.yaml`` (or ``python -m rlhf_trl.ppo``, ``make ppo RECIPE=...``).
Resume: ``make ppo RECIPE=... resume_from_checkpoint=true`` (the last checkpoint) or ``=path/to/checkpoint-N``.

The PPO loop is the project's own (`rlhf_trl.ppo_engine`, math in `rlhf_trl.ppo_math`; TRL removed its PPOTrainer in
1.13); recipes keep TRL 1.12's PPOConfig keys. This module reads top to bottom: recipe, data, tokenizer and models,
trainer, train, save.

Models:
  - policy: the merged SFT model (``sft_model_path``) plus a LoRA adapter (``use_peft: true``); the reference is the
    same model with the adapter disabled, so no second copy of the weights is held;
  - reward model: the merged RM (``reward_model_path``), frozen, in eval mode, its score shifted by
    ``reward_baseline`` (a number, or ``auto``: the mean RM score of SFT rollouts on a calibration batch);
  - value model: initialized from the reward model (``value_model_path`` overrides), trained with the policy, fully
    or through its own LoRA adapter (``value_use_peft``) with a frozen base;
  - ``share_reward_value_base: true`` (with ``value_use_peft``): the value model's LoRA adapter sits on the reward
    model's own weights and the reward model is that base with the adapter switched off (`SharedBaseRewardModel`),
    so reward and value model hold one copy of the weights. With a LoRA policy, PPO then holds two copies of base
    weights in all (policy/reference, reward/value) where TRL's layout holds three (four without LoRA);
  - reward functions (``reward_funcs`` / ``reward_weights``, `rlhf_trl.rewards`): added to the reward model's score,
    or the whole reward without ``reward_model_path`` (the value model then starts from ``value_model_path``).

What `RLHFPPOTrainer` adds around the engine:
  - checkpoints written under a temporary name, then renamed, holding the policy (adapter and merged), the value
    model, optimizer / scheduler / RNG / trainer state, the data position and the run's recipe;
  - exact resume from such a checkpoint;
  - ``logging_steps`` honoured (the engine logs every update);
  - an adaptive KL coefficient (``kl_target`` / ``kl_horizon``; Ziegler et al. 2019, "Fine-Tuning Language Models
    from Human Preferences", section 2.2), logged as ``objective/kl_coef``;
  - a stop on the first non-finite loss, reward or value, naming the update (the last good checkpoint is kept);
  - sample tables (query / response / score / reward) every ``log_samples_every`` updates, to the logs and to
    ``samples.jsonl``; sampling for them never perturbs the training RNG;
  - stock checkpoints as downloaded: rollouts sample with the recipe's ``temperature`` only (the policy's own
    top_k / top_p / repetition_penalty are overridden, named in one log line, and kept in the saved ``merged/``),
    and an EOS list (Qwen2.5-Instruct: ``[<|im_end|>, <|endoftext|>]``) is honoured: rollouts stop at any id, the
    missing-EOS penalty and ``val/eos_rate`` count any id, the reward is read at whichever ends the response.

Outputs under ``output_dir``: ``checkpoint-N/``, ``adapter/``, ``merged/`` (plain causal LM + tokenizer),
``value_model/`` (plain sequence classifier), ``samples.jsonl``, ``run_config.yaml`` and ``metrics.json``.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import random
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from datasets import Dataset

from .checkpoints import AtomicCheckpointMixin, begin_writing, distributed_state, start_run
from .config import RunArguments, parse_recipe, save_recipe, sibling_recipe
from .cpu import install_tensor_cache, set_malloc_mmap_threshold
from .data import DataArguments, Template, describe_sources, prompt_features, read_records, split_records
from .models import (
    BIASING_GENERATION_KEYS,
    eos_token_ids,
    load_causal_lm,
    load_sequence_classifier,
    load_tokenizer,
    merge_and_save,
    recipe_quantization_config,
    require_model_dir,
    sampling_generation_config,
    save_pretrained_atomic,
    torch_dtype,
    write_json,
    write_jsonl,
)
from .ppo_engine import (
    OnlineTrainerState,
    PPOConfig,
    PPOEngine,
    TrainingDivergedError,
    check_config,
    generate_rollouts,
    sampling_config,
    sequence_scores,
)
from .scoring import truncate_at_eos

logger = logging.getLogger(__name__)


@dataclass
class PPOScriptArguments:
    """PPO fields that TRL's PPOConfig lacks."""

    reward_baseline: str = field(
        default="0.0",
        metadata={
            "help": "Subtracted from every reward-model score (reward units): a number, or 'auto' for the mean RM "
            "score of SFT rollouts on reward_baseline_batches calibration batches before training."
        },
    )
    reward_baseline_batches: int = field(
        default=2, metadata={"help": "Rollout batches (of per_device_train_batch_size prompts) for 'auto'."}
    )
    value_model_path: str | None = field(
        default=None, metadata={"help": "Value model initialization (default: the reward model)."}
    )
    value_use_peft: bool = field(
        default=False, metadata={"help": "Train the value model through a LoRA adapter; its base stays frozen."}
    )
    value_lora_r: int = field(default=16, metadata={"help": "LoRA rank of the value model."})
    value_lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha of the value model."})
    value_lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout of the value model."})
    value_lora_target_modules: list[str] | None = field(
        default=None, metadata={"help": "Value-model modules given LoRA (default: peft's choice for the model)."}
    )
    share_reward_value_base: bool = field(
        default=False,
        metadata={
            "help": "Put the value model's LoRA adapter on the reward model's own weights (one copy for both; the "
            "reward is read with the adapter off). Needs value_use_peft: true and no value_model_path; not with "
            "DeepSpeed."
        },
    )
    kl_target: float | None = field(
        default=None,
        metadata={"help": "Adaptive KL control: target KL per response (nats). None keeps kl_coef fixed."},
    )
    kl_horizon: int = field(
        default=10000, metadata={"help": "Adaptive KL control horizon (episodes), as in Ziegler et al. 2019."}
    )
    log_samples_every: int = field(
        default=10, metadata={"help": "Updates between sample tables (logs and samples.jsonl); 0 turns them off."}
    )
    save_merged_checkpoints: bool = field(
        default=True,
        metadata={"help": "Write the merged policy into each checkpoint too (default true; costs one model copy in "
                  "memory while it is written, and its size on disk; false for large or quantized models)."},
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Run model code shipped in the model directories (e.g. Baichuan)."}
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={"help": "Reward functions 'package.module:function' (or 'file.py:function'), each "
                  "f(prompts, completions, **columns) -> list[float]; added to the reward model's score (or alone "
                  "without reward_model_path)."},
    )
    reward_weights: list[float] | None = field(
        default=None, metadata={"help": "Weight of each reward function (default: 1.0 each)."}
    )


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 ("Fine-Tuning Language Models from Human Preferences", 2.2).

    After each update with mean KL ``kl`` (nats per response) over ``n_steps`` episodes::

        error = clip(kl / target - 1, -0.2, 0.2)
        coef *= 1 + error * n_steps / horizon
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        if target <= 0 or horizon <= 0:
            raise ValueError(f"kl_target and kl_horizon must be positive, got {target} and {horizon}")
        self.value, self.target, self.horizon = float(init_kl_coef), float(target), int(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        error = float(np.clip(current_kl / self.target - 1, -0.2, 0.2))
        self.value *= 1 + error * n_steps / self.horizon
        return self.value


class BaselineShiftedScore(torch.nn.Module):
    """Wraps a reward model's ``score`` head so that it returns ``score(hidden) - baseline``.

    The engine reads rewards as ``reward_model.score(hidden_states)`` at the last non-pad token
    (`rlhf_trl.scoring.sequence_scores`); replacing the head is how the baseline reaches it.
    Input ``[batch, seq_len, hidden]``, output ``[batch, seq_len, 1]``.
    """

    def __init__(self, score: torch.nn.Module, baseline: float):
        super().__init__()
        self.inner = score
        self.register_buffer("baseline", torch.tensor(float(baseline)), persistent=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.inner(hidden_states) - self.baseline.to(hidden_states.dtype)


class SharedBaseRewardModel(torch.nn.Module):
    """The reward model read off the value model's weights: the value model's base with its LoRA adapter (and
    trained value head) switched off, plus the reward model's own frozen score head.

    Built by ``share_reward_value_base: true``: the value model is ``get_peft_model(reward_model, LoRA SEQ_CLS)``,
    which wraps the reward model's modules in place, so without this the reward model would hold a second full
    copy of the same weights. It has what `rlhf_trl.scoring.sequence_scores` reads: ``base_model_prefix`` naming
    a backbone callable (``backbone(input_ids=[batch, seq_len], attention_mask=..., ...)`` run under
    ``value_model.disable_adapter()``) and ``score`` (``[batch, seq_len, hidden] -> [batch, seq_len, 1]``).

    The value model is deliberately not a submodule (``.eval()``, ``requires_grad_(False)`` and device moves of
    the reward model must not reach the trainable adapter); only the original score head is.

    Raises:
        ValueError: ``value_model`` is not a peft sequence-classification model with a wrapped ``score`` head.
    """

    base_model_prefix = "backbone"

    def __init__(self, value_model):
        super().__init__()
        from peft import PeftModel

        if not isinstance(value_model, PeftModel):
            raise ValueError("share_reward_value_base needs the value model to be a LoRA (peft) model")
        inner = value_model.get_base_model()
        head = getattr(inner, "score", None)
        if head is None or not hasattr(head, "original_module"):
            raise ValueError("share_reward_value_base: the value model has no adapter-wrapped `score` head "
                             "(LoRA task_type must be SEQ_CLS)")
        object.__setattr__(self, "_value_model", value_model)  # not registered: see the class docstring
        object.__setattr__(self, "_backbone", getattr(inner, inner.base_model_prefix))
        self.score = head.original_module  # the reward model's own head, frozen
        self.config = inner.config

    def backbone(self, **kwargs):
        """The shared transformer with the value model's adapter off: the reward model's forward."""
        with self._value_model.disable_adapter():
            return self._backbone(**kwargs)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """Per-token reward logits ``[batch, seq_len, 1]`` (the score at the last real token is the reward)."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
        return self.score(hidden)


def apply_reward_baseline(reward_model, baseline: float):
    """Freeze ``reward_model``, put it in eval mode and shift its score head by ``-baseline``. Returns the model."""
    reward_model.eval()
    reward_model.requires_grad_(False)
    if isinstance(reward_model.score, BaselineShiftedScore):
        reward_model.score = reward_model.score.inner
    if baseline:
        reward_model.score = BaselineShiftedScore(reward_model.score, baseline)
    return reward_model


def rng_state() -> dict:
    """Python, numpy and torch (CPU, CUDA) RNG states."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.random.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
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


class ResumableLoader:
    """Wraps PPOTrainer's prompt dataloader so the data position can be saved and restored exactly.

    It records the RNG state at which each pass over the data started (the shuffle is drawn from it: the global torch
    RNG in one process; under several processes accelerate gives the sampler its own generator, synchronized from
    process 0 at the start of each pass, whose state is recorded too) and how many batches of that pass were consumed.
    Resuming replays the shuffle from those states, skips the consumed batches, then restores the RNG state of the
    checkpoint.

    Raises (on the first pass after `resume_from`):
        ValueError: the saved data position holds another number of sampler generators than this data loader has.
    """

    def __init__(self, loader):
        self.loader = loader
        self.epoch_rng: dict | None = None
        self.epoch_generators: list[torch.Tensor] | None = None
        self.consumed = 0
        self._resume: tuple[dict, list[torch.Tensor] | None, int, dict] | None = None

    def __len__(self):
        return len(self.loader)

    def _generators(self) -> list[torch.Generator]:
        """The sampler's own generators (none in one process: it draws from the global torch RNG)."""
        found = []
        candidates = [getattr(self.loader, "synchronized_generator", None)]
        batch_sampler = getattr(self.loader, "batch_sampler", None)
        for holder in (getattr(self.loader, "sampler", None), getattr(batch_sampler, "sampler", None),
                       getattr(getattr(batch_sampler, "batch_sampler", None), "sampler", None)):
            candidates.append(getattr(holder, "generator", None))
        for gen in candidates:
            if isinstance(gen, torch.Generator) and all(gen is not g for g in found):
                found.append(gen)
        return found

    def __iter__(self):
        if self._resume is not None:
            epoch_rng, epoch_generators, consumed, now = self._resume
            self._resume = None
            set_rng_state(epoch_rng)
            generators = self._generators()
            if epoch_generators is None:  # a checkpoint written before sampler generators were saved
                if generators:
                    logger.warning("the checkpoint's data position lacks the sampler's generator state: the data "
                                   "order of this pass may differ from the interrupted run's")
            elif len(generators) != len(epoch_generators):
                raise ValueError(f"the checkpoint's data position holds {len(epoch_generators)} sampler generator "
                                 f"states, this run's data loader has {len(generators)} (another number of "
                                 "processes?)")
            else:
                for gen, state in zip(generators, epoch_generators):
                    gen.set_state(state)
            self.epoch_rng, self.epoch_generators, self.consumed = epoch_rng, epoch_generators, 0
            it = iter(self.loader)
            for _ in range(consumed):
                next(it)
                self.consumed += 1
            set_rng_state(now)
        else:
            self.epoch_rng, self.consumed = rng_state(), 0
            self.epoch_generators = [g.get_state() for g in self._generators()]
            it = iter(self.loader)
        for batch in it:
            self.consumed += 1
            yield batch

    def state(self) -> dict:
        return {"epoch_rng": self.epoch_rng, "epoch_generators": self.epoch_generators, "consumed": self.consumed,
                "now": rng_state()}

    def resume_from(self, state: dict) -> None:
        self._resume = (state["epoch_rng"], state.get("epoch_generators"), state["consumed"], state["now"])


class RLHFPPOTrainer(AtomicCheckpointMixin, PPOEngine):
    """The PPO engine (`rlhf_trl.ppo_engine.PPOEngine`) plus resumable, atomic checkpoints with the value model, KL
    control, divergence checks and sample tables. See the module docstring."""

    def __init__(self, *args, script_args: PPOScriptArguments | None = None, tokenizer_for_saving=None,
                 recipe_configs: tuple = (), stock_generation_config=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.stock_generation_config = stock_generation_config  # saved with merged policies (PPO samples otherwise)
        self.script_args = script_args or PPOScriptArguments()
        self.reward_baseline = 0.0
        self.recipe_configs = recipe_configs
        self.tokenizer_for_saving = tokenizer_for_saving or self.processing_class
        self.dataloader = ResumableLoader(self.dataloader)
        every = self.script_args.log_samples_every
        if every and every > 0:
            self.args.num_sample_generations = max(1, self.args.num_sample_generations or 1)
            self.sample_generations_freq = every
        else:
            self.args.num_sample_generations = 0
        self.kl_controller = None
        if self.script_args.kl_target is not None:
            self.kl_controller = AdaptiveKLController(
                self.args.kl_coef, self.script_args.kl_target, self.script_args.kl_horizon
            )

    # -- logging: KL control, divergence check -------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "objective/kl" in logs:
            # a variance over one statistic (one micro-batch, one mini-batch, one PPO epoch) is NaN by definition
            bad = sorted(k for k, v in logs.items()
                         if isinstance(v, float) and not math.isfinite(v) and not k.endswith("_var"))
            if bad:
                last = self._last_checkpoint()
                raise TrainingDivergedError(
                    f"non-finite {', '.join(bad)} at update {self.state.global_step} (episode {self.state.episode}); "
                    f"nothing was saved for this update; last good checkpoint: {last or 'none yet'}"
                )
            if logs["objective/kl"] < -1e-3:  # below rounding noise
                logger.warning(
                    "update %d: mean KL to the reference is negative (%.4f): the rollouts are not samples of the "
                    "policy (check temperature / generation settings) or the estimate is noisy (use kl_estimator k3)",
                    self.state.global_step, logs["objective/kl"],
                )
            logs["objective/kl_coef"] = self.args.kl_coef
            if self.kl_controller is not None:
                self.args.kl_coef = self.kl_controller.update(logs["objective/kl"], self.args.batch_size)
            every = max(1, int(self.state.logging_steps or 1))  # the engine logs every update: honour logging_steps
            step = self.state.global_step
            if step % every and step < self.state.max_steps:  # the last update is always logged
                return
        super().log(logs, start_time)

    def _last_checkpoint(self) -> str | None:
        from transformers.trainer_utils import get_last_checkpoint

        return get_last_checkpoint(self.args.output_dir) if os.path.isdir(self.args.output_dir) else None

    # -- sample tables -------------------------------------------------------------------------------------------
    def generate_completions(self, sampling: bool = False):
        """Sample one eval batch (near-greedy, temperature 0.01), score it and log query / response / score / reward.

        Runs under `preserved_rng`, and hands accelerate's gradient state back to the prompt loader (``end()`` of
        the eval loader when the loop is left early: a loader left mid-iteration stays accelerate's active loader,
        and the optimizer's accumulation syncs early at the end of the active loader's pass, so a sample table used to
        change how the next update that ends a pass over the prompts steps the optimizer, and a resumed run, which
        had not sampled yet, stepped differently). Sample tables never change the training run.
        """
        if self.eval_dataloader is None:
            return
        tok = self.processing_class
        pad = tok.pad_token_id
        gen_config = sampling_generation_config(0.01 + 1e-7, self.args.response_length, self.eos_token_ids or [], pad)
        if self.eos_token_ids is None:
            gen_config.eos_token_id = None
        rows = []
        loader = self.eval_dataloader
        with preserved_rng(), _ended(loader):
            for batch in loader:
                query = batch["input_ids"]
                context = query.shape[1]
                with self.generation_policy() as policy:
                    query_response, _ = generate_rollouts(policy, query, pad, gen_config, query.shape[0])
                response = query_response[:, context:]
                if self.eos_token_ids is not None:
                    response = truncate_at_eos(response, self.eos_token_ids, pad)
                with torch.no_grad(), self.reward_weights() as reward_model:
                    if reward_model is not None:
                        reward = sequence_scores(reward_model, torch.cat((query, response), 1), pad, context)
                    else:
                        reward = torch.zeros(len(query))
                for q, r, s in zip(
                    tok.batch_decode(query, skip_special_tokens=True),
                    tok.batch_decode(response, skip_special_tokens=True),
                    reward.float().cpu().tolist(),
                ):
                    rows.append({"step": self.state.global_step, "query": q, "response": r,
                                 "score": s + self.reward_baseline, "reward": s})
                if sampling:
                    break
        if self.accelerator.num_processes > 1:  # each process sampled its shard of the eval prompts
            from accelerate.utils import gather_object

            rows = gather_object(rows)
        if not self.accelerator.is_main_process or not rows:
            return
        lines = [f"samples at update {self.state.global_step} (score = RM score, reward = score - baseline):"]
        for row in rows[:4]:
            lines.append(f"  {row['query']!r} -> {row['response']!r}  score={row['score']:.3f} reward={row['reward']:.3f}")
        logger.info("\n".join(lines))
        os.makedirs(self.args.output_dir, exist_ok=True)
        with open(os.path.join(self.args.output_dir, "samples.jsonl"), "a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")

    # -- checkpoints ---------------------------------------------------------------------------------------------
    def checkpoint_extras(self, checkpoint_dir: str) -> None:
        """What the Trainer's checkpoint files lack: value model, merged policy, data position, baseline / KL state,
        recipe."""
        self._save_extras(checkpoint_dir, self.dataloader.state(), merged=self.script_args.save_merged_checkpoints)

    def _save_extras(self, ckpt: str, data_state: dict | None, merged: bool) -> None:
        rank = self.accelerator.process_index
        if data_state is not None and rank > 0:  # each process's own data position and RNG state
            os.makedirs(ckpt, exist_ok=True)
            torch.save(data_state, os.path.join(ckpt, _data_state_name(rank)))
        if not self.args.should_save:  # under `accelerate launch`, the main process writes the other extras
            return
        unwrapped = self.unwrapped
        unwrapped.value_model.save_pretrained(os.path.join(ckpt, "value_model"), safe_serialization=True)
        if merged:
            from peft import PeftModel

            policy = unwrapped.policy
            if isinstance(policy, PeftModel):
                policy = copy.deepcopy(policy).merge_and_unload()
            with deployable_generation_config(policy, self.stock_generation_config):
                policy.save_pretrained(os.path.join(ckpt, "merged"), safe_serialization=True)
            self.tokenizer_for_saving.save_pretrained(os.path.join(ckpt, "merged"))
        if data_state is not None:
            torch.save(data_state, os.path.join(ckpt, "data_state.pt"))
        write_json(os.path.join(ckpt, "reward_baseline.json"), {"reward_baseline": self.reward_baseline,
                                                                "kl_coef": self.args.kl_coef})
        if self.recipe_configs:
            save_recipe(ckpt, *self.recipe_configs)

    # -- resume --------------------------------------------------------------------------------------------------
    def restore(self, ckpt: str) -> int:
        """Continue the run of ``ckpt`` (a ``checkpoint-N`` directory) exactly: policy (adapter or full weights),
        value model, optimizer, scheduler, step / episode counters and log history, KL coefficient, data position
        and RNG state. Returns the number of updates done.

        Raises:
            FileNotFoundError: the checkpoint lacks a file needed to resume.
            ValueError: the checkpoint belongs to a run with another number of updates, or has none left.
        """
        from peft import PeftModel, set_peft_model_state_dict
        from safetensors.torch import load_file

        needed = ["optimizer.pt", "scheduler.pt", "trainer_state.json", "data_state.pt", "value_model"]
        missing = [n for n in needed if not os.path.exists(os.path.join(ckpt, n))]
        if missing:
            raise FileNotFoundError(f"cannot resume from {ckpt}: missing {missing}")
        unwrapped = self.unwrapped
        _load_weights(unwrapped.policy, ckpt, PeftModel, set_peft_model_state_dict, load_file)
        _load_weights(unwrapped.value_model, os.path.join(ckpt, "value_model"), PeftModel,
                      set_peft_model_state_dict, load_file)
        self.optimizer.load_state_dict(torch.load(os.path.join(ckpt, "optimizer.pt"), weights_only=True))
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(ckpt, "scheduler.pt"), weights_only=True))
        saved = OnlineTrainerState.load_from_json(os.path.join(ckpt, "trainer_state.json"))
        extras = json.load(open(os.path.join(ckpt, "reward_baseline.json"))) if os.path.exists(
            os.path.join(ckpt, "reward_baseline.json")) else {}
        if "kl_coef" in extras:
            self.args.kl_coef = extras["kl_coef"]
            if self.kl_controller is not None:
                self.kl_controller.value = extras["kl_coef"]
        total = self.args.num_total_batches
        done = saved.global_step
        planned = getattr(saved, "max_steps", 0) or total
        if planned != total:  # the learning-rate schedule and the data order were laid out for the saved run
            raise ValueError(f"{ckpt} belongs to a run of {planned} updates; this recipe makes {total} (total_episodes "
                             "/ effective batch): resume with the same total_episodes and batch sizes, or start afresh")
        if done >= total:
            raise ValueError(f"{ckpt} is at update {done}; the recipe has {total} updates: nothing left to run")
        self.state.global_step = done
        self.state.episode = getattr(saved, "episode", 0) or done * self.args.batch_size
        self.state.log_history = saved.log_history
        data_state = os.path.join(ckpt, _data_state_name(self.accelerator.process_index))
        if not os.path.exists(data_state):
            raise FileNotFoundError(f"cannot resume from {ckpt}: missing {os.path.basename(data_state)} (the "
                                    "checkpoint was written by fewer processes than this run has)")
        self.dataloader.resume_from(torch.load(data_state, weights_only=False))
        if self.accelerator.is_main_process:
            drop_later_samples(self.args.output_dir, done)
        logger.info("resuming from %s at update %d of %d (episode %d)", ckpt, done, total, self.state.episode)
        return done


@contextmanager
def _ended(loader):
    """Run a loop over the accelerate-prepared ``loader``, then take it off accelerate's gradient state (its
    ``end()``, which a loop left with ``break`` never reaches; harmless after a complete pass)."""
    try:
        yield
    finally:
        if hasattr(loader, "end"):
            loader.end()


def drop_later_samples(output_dir: str, step: int) -> None:
    """Resume from update ``step``: keep the sample tables of updates <= ``step`` in ``samples.jsonl`` (the run
    writes later ones again) and drop a line torn by a kill."""
    path = os.path.join(output_dir, "samples.jsonl")
    if not os.path.exists(path):
        return
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and row.get("step", 0) <= step:
                rows.append(row)
    write_jsonl(path, rows)


def _data_state_name(rank: int) -> str:
    """The file of a process's data position and RNG state in a checkpoint (process 0: ``data_state.pt``)."""
    return "data_state.pt" if rank == 0 else f"data_state_rank{rank}.pt"


def _load_weights(model, folder, PeftModel, set_peft_model_state_dict, load_file) -> None:
    """Load a policy / value model's trainable weights saved by ``save_pretrained`` in ``folder``."""
    if isinstance(model, PeftModel):
        set_peft_model_state_dict(model, load_file(os.path.join(folder, "adapter_model.safetensors")))
        return
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        state = load_file(single)
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = {k for k in missing if "lm_head" in k}
        if set(missing) - tied or unexpected:
            raise ValueError(f"{folder}: weights do not match the model (missing {missing}, unexpected {unexpected})")
    else:
        from transformers.trainer_utils import load_sharded_checkpoint

        load_sharded_checkpoint(model, folder, strict=False)


def rollout_generation_config(model, source: str, eos_ids: list[int], pad_token_id: int, temperature: float):
    """Give ``model`` the generation config PPO samples with, and return the one it had (to be saved with it).

    Rollouts must be samples of ``softmax(logits / temperature)``, or the log-probs, the KL estimate and the policy
    gradient are biased; a stock checkpoint's ``generation_config.json`` (Qwen2.5-Instruct: top_k 20, top_p 0.8,
    repetition_penalty 1.1, temperature 0.7) would otherwise leak into ``generate``. The new config samples with
    ``temperature`` only and stops at any of ``eos_ids``; one log line names the settings of ``source`` it overrides.
    The returned original is what the merged policy is saved with, so it deploys as the stock model does.
    """
    stock = copy.deepcopy(model.generation_config)
    found = {k: getattr(stock, k, None) for k, ok in BIASING_GENERATION_KEYS.items()
             if getattr(stock, k, None) not in ok}
    if getattr(stock, "temperature", None) not in (None, 1.0, temperature):
        found["temperature"] = stock.temperature
    model.generation_config = sampling_generation_config(temperature, None, eos_ids, pad_token_id,
                                                         bos_token_id=getattr(stock, "bos_token_id", None))
    # min_p unset, not 0.0: this config replaces the model's own, so nothing can leak in below it, and a 0.0 here would
    # be filled into every rollout config, building transformers' no-op MinPLogitsWarper (a softmax and a top-k over
    # the vocabulary per decoding step; `generate_rollouts` leaves it out when the model has no min_p of its own)
    model.generation_config.min_p = None
    if found:
        logger.info("rollouts sample with temperature=%s only, stopping at EOS ids %s; overriding %s of "
                    "%s/generation_config.json (kept in the saved models)", temperature, list(eos_ids), found, source)
    return stock


@contextmanager
def deployable_generation_config(policy, stock):
    """Save ``policy`` (a causal LM or a peft model on one) with the generation config it came with (``stock``, from
    `rollout_generation_config`) instead of PPO's sampling config; put PPO's back after."""
    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    if stock is None:
        yield
        return
    current, base.generation_config = base.generation_config, stock
    try:
        yield
    finally:
        base.generation_config = current


@torch.no_grad()
def calibrate_reward_baseline(policy, reward_model, tokenizer, dataset: Dataset, args, batches: int,
                              eos_ids: list[int] | None = None) -> float:
    """Mean RM score (reward units) of SFT-policy rollouts on ``batches`` batches of prompts, as PPO would sample them.

    Uses the engine's rollout (`generate_rollouts`, `sequence_scores`) with the recipe's temperature and
    ``response_length``, responses cut after their first EOS (any of ``eos_ids``, default the tokenizer's);
    runs under `preserved_rng`.
    """
    from transformers import DataCollatorWithPadding

    collator = DataCollatorWithPadding(tokenizer)
    eos_ids = eos_ids or [tokenizer.eos_token_id]
    gen = sampling_config(args, eos_ids, tokenizer.pad_token_id)
    size = args.per_device_train_batch_size
    scores = []
    with preserved_rng():
        torch.manual_seed(args.seed)
        for b in range(batches):
            rows = [{"input_ids": dataset[i]["input_ids"]} for i in range(b * size, min(len(dataset), (b + 1) * size))]
            if not rows:
                break
            query = collator(rows)["input_ids"].to(policy.device)
            qr, _ = generate_rollouts(policy, query, tokenizer.pad_token_id, gen, len(rows))
            response = truncate_at_eos(qr[:, query.shape[1]:], eos_ids, tokenizer.pad_token_id)
            scores.append(sequence_scores(reward_model, torch.cat((query, response), 1), tokenizer.pad_token_id,
                                          query.shape[1]).float().cpu())
    value = float(torch.cat(scores).mean())
    logger.info("reward_baseline auto: mean RM score %.4f over %d SFT rollouts", value, sum(len(s) for s in scores))
    return value


def recipe_types() -> tuple:
    """The dataclasses a PPO recipe fills: data fields, `PPOScriptArguments`, the engine's `PPOConfig` (TRL 1.12's
    PPOConfig keys) and TRL's `ModelConfig`."""
    from trl import ModelConfig

    return (DataArguments, PPOScriptArguments, PPOConfig, ModelConfig, RunArguments)


def main(argv: list[str] | None = None, callbacks: list | None = None) -> dict:
    """Parse a recipe and run PPO; see `run` for the result."""
    data_args, ppo_args, training_args, model_args, run_args, recipe = parse_recipe(recipe_types(), argv, "ppo")
    return run(
        data_args, ppo_args, training_args, model_args,
        sft_hint=sibling_recipe(recipe, "sft"), rm_hint=sibling_recipe(recipe, "rm"), callbacks=callbacks,
        run_args=run_args,
    )


def run(data_args, ppo_args: PPOScriptArguments, training_args, model_args, sft_hint=None, rm_hint=None,
        callbacks: list | None = None, run_args: RunArguments | None = None) -> dict:
    """Train the policy with PPO on the prompts of the recipe's data.

    Returns ``{"output_dir", "merged", "value_model", "metrics", "trainer"}``.

    Raises:
        StageInputError: the SFT or reward model is missing (the hint names the stage to run first).
        DataError: bad rows.
        ValueError: fewer eval prompts than ``per_device_eval_batch_size``; biasing generation settings; a bad
            ``reward_baseline``, ``num_mini_batches`` (`rlhf_trl.ppo_engine.check_config`), ``kl_target`` /
            ``kl_horizon`` or ``max_prompt_length`` (`rlhf_trl.data.prompt_features`); ``reward_funcs`` /
            ``reward_weights`` that do not load (`rlhf_trl.rewards.load_reward_functions`); chat-template problems
            (`rlhf_trl.data.chat_end_of_turn_id`); ``load_in_4bit`` / ``load_in_8bit`` with ``use_peft`` or
            ``value_use_peft`` false, without bitsandbytes (on the CPU: without its working CPU backend, or 8 bits),
            or with ``save_merged_checkpoints``; ``share_reward_value_base`` without ``value_use_peft``, with a
            ``value_model_path`` or under DeepSpeed.
        TrainingDivergedError: a non-finite loss, reward or value.

    Every input error is raised before anything is written: an earlier run's files go only once the data is read
    and the models are loaded (`rlhf_trl.checkpoints.begin_writing`).

    With ``share_reward_value_base`` the value model is merged in place at the end, so the returned trainer's
    ``reward_model`` is None.
    """
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import set_seed
    from trl import get_peft_config

    set_seed(training_args.seed)  # LoRA initialization happens before TRL seeds its trainer
    set_malloc_mmap_threshold(training_args.malloc_mmap_threshold)  # before any model is loaded

    # inputs
    run_args, resume = start_run(training_args, run_args)
    dist = distributed_state(training_args)  # under `accelerate launch`: this process's place in the group
    pickle_ok = run_args.allow_pickle_weights
    sft_path = require_model_dir(training_args.sft_model_path, "SFT model", sft_hint, pickle_ok)
    reward_functions = None
    if ppo_args.reward_funcs or ppo_args.reward_weights:  # weights alone are an error, not ignored
        from .rewards import load_reward_functions, reward_columns

        reward_functions = load_reward_functions(ppo_args.reward_funcs, ppo_args.reward_weights)
    elif not training_args.reward_model_path:
        raise ValueError("reward_model_path: PPO needs a reward model, reward functions (reward_funcs) or both")
    rm_path = None
    if training_args.reward_model_path:
        rm_path = require_model_dir(training_args.reward_model_path, "reward model", rm_hint, pickle_ok)
    if not (ppo_args.value_model_path or rm_path):
        raise ValueError("value_model_path: without a reward model the value model needs its own initialization "
                         "(a sequence classifier, or a causal LM directory: its score head starts at random)")
    value_path = require_model_dir(ppo_args.value_model_path or rm_path, "value model", rm_hint, pickle_ok)
    if rm_path is None and (ppo_args.share_reward_value_base or str(ppo_args.reward_baseline).strip() == "auto"):
        raise ValueError("share_reward_value_base / reward_baseline auto need a reward model (reward_model_path)")
    if ppo_args.share_reward_value_base:
        if not ppo_args.value_use_peft:
            raise ValueError("share_reward_value_base: true needs value_use_peft: true (the value model is a LoRA "
                             "adapter on the reward model's weights)")
        if os.path.normpath(value_path) != os.path.normpath(rm_path):
            raise ValueError("share_reward_value_base: true starts the value model from the reward model; remove "
                             f"value_model_path ({ppo_args.value_model_path})")
        if training_args.deepspeed or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
            raise ValueError("share_reward_value_base: true is not supported under DeepSpeed (it shards the reward "
                             "and value models separately); set it to false")
        if training_args.offload_reward_model:
            raise ValueError("offload_reward_model: the reward model shares weights with the value model "
                             "(share_reward_value_base); set `offload_reward_model: false`")
    check_config(training_args)  # batch sizes: before the data, so a bad value leaves an earlier run as it was
    if ppo_args.kl_target is not None and (ppo_args.kl_target <= 0 or ppo_args.kl_horizon <= 0):
        raise ValueError(f"kl_target and kl_horizon must be positive, got {ppo_args.kl_target} and "
                         f"{ppo_args.kl_horizon}")
    baseline_arg = str(ppo_args.reward_baseline).strip().lower()
    if baseline_arg != "auto":
        try:
            baseline = float(baseline_arg)
        except ValueError:
            raise ValueError(f"reward_baseline must be a number or 'auto', got {ppo_args.reward_baseline!r}") from None
    if training_args.stop_token is None and training_args.stop_token_id is None:
        training_args.stop_token = "eos"  # responses end at EOS; the reward is read there
    if training_args.tensor_cache:  # the settings are checked (check_config); before any model is loaded
        install_tensor_cache(training_args.tensor_cache_headroom_mb << 20)

    # data
    template = Template.from_args(data_args)
    records = read_records(data_args, "prompts")
    train_records, eval_records = split_records(records, data_args.eval_split_size, training_args.seed)
    if len(eval_records) < training_args.per_device_eval_batch_size * dist.num_processes:  # one batch per process
        raise ValueError(
            f"{describe_sources(data_args)}: {len(eval_records)} eval prompts, fewer than per_device_eval_batch_size="
            f"{training_args.per_device_eval_batch_size} x {dist.num_processes} processes; raise eval_split_size"
        )

    # tokenizer and models (prompts left-padded; pad distinct from EOS)
    remote = ppo_args.trust_remote_code
    tokenizer = load_tokenizer(sft_path, padding_side="left", trust_remote_code=remote)
    source = describe_sources(data_args)
    train_ds = Dataset.from_dict(prompt_features(train_records, tokenizer, template, data_args.max_prompt_length,
                                                 f"{source} (train split)"))
    eval_ds = Dataset.from_dict(prompt_features(eval_records, tokenizer, template, data_args.max_prompt_length,
                                                f"{source} (eval split)"))
    dtype = torch.bfloat16 if training_args.bf16 else torch_dtype(model_args.dtype)  # TRL ignores bf16
    # load_in_4bit quantizes all three models; policy and value model are then trained through LoRA only
    quantized = model_args.load_in_4bit or model_args.load_in_8bit
    if quantized and ppo_args.save_merged_checkpoints:
        raise ValueError("load_in_4bit / load_in_8bit: set save_merged_checkpoints: false (merging an adapter into "
                         "quantized weights rounds the update away; merged/ is still written, unquantized, at the end)")
    quant = recipe_quantization_config(model_args, {"use_peft": model_args.use_peft,
                                                    "value_use_peft": ppo_args.value_use_peft}, training_args.use_cpu)
    policy = load_causal_lm(sft_path, dtype, remote, pickle_ok, quantization_config=quant)
    reward_model = rm_path and load_sequence_classifier(rm_path, dtype, remote, pickle_ok, quantization_config=quant)
    value_model = reward_model if ppo_args.share_reward_value_base else load_sequence_classifier(
        value_path, dtype, remote, pickle_ok, quantization_config=quant)
    for name, m in (("policy", policy), ("reward model", reward_model), ("value model", value_model)):
        if m is None:
            continue
        if m.config.vocab_size < len(tokenizer):
            raise ValueError(f"{name} vocabulary ({m.config.vocab_size}) is smaller than the tokenizer's ({len(tokenizer)})")
        m.config.pad_token_id = tokenizer.pad_token_id
    eos_ids = eos_token_ids(tokenizer, sft_path)  # e.g. Qwen2.5-Instruct: [<|im_end|>, <|endoftext|>]
    stock_generation_config = rollout_generation_config(policy, sft_path, eos_ids, tokenizer.pad_token_id,
                                                        training_args.temperature)
    if ppo_args.value_use_peft:
        value_model = get_peft_model(value_model, LoraConfig(
            task_type="SEQ_CLS", r=ppo_args.value_lora_r, lora_alpha=ppo_args.value_lora_alpha,
            lora_dropout=ppo_args.value_lora_dropout, target_modules=ppo_args.value_lora_target_modules,
        ))
        if ppo_args.share_reward_value_base:  # one copy of the weights: the reward is the base with the adapter off
            reward_model = SharedBaseRewardModel(value_model)
    if training_args.gradient_checkpointing:  # TRL ignores it
        kwargs = training_args.gradient_checkpointing_kwargs or {"use_reentrant": False}
        for m in (policy, value_model):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            m.config.use_cache = False
    if resume:
        saved = os.path.join(resume, "reward_baseline.json")
        baseline = json.load(open(saved))["reward_baseline"] if os.path.exists(saved) else 0.0
    elif baseline_arg == "auto":  # the main process calibrates; every process gets its number
        baseline = None
        if dist.is_main_process:
            baseline = calibrate_reward_baseline(policy, reward_model, tokenizer, train_ds, training_args,
                                                 ppo_args.reward_baseline_batches, eos_ids)
        if dist.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            baseline = broadcast_object_list([baseline], from_process=0)[0]
    ppo_args.reward_baseline = str(baseline)
    if reward_model is not None:
        apply_reward_baseline(reward_model, baseline)
    if reward_functions is not None:  # rows index the records, whose columns reach the reward functions
        train_ds = train_ds.add_column("row", list(range(len(train_ds))))

    # trainer (inputs proven: only now does anything of an earlier run go)
    begin_writing(training_args, run_args, resume)
    out = training_args.output_dir
    if not resume and dist.is_main_process and os.path.exists(os.path.join(out, "samples.jsonl")):
        os.remove(os.path.join(out, "samples.jsonl"))
    peft_config = get_peft_config(model_args)
    if peft_config is not None:  # the reference is then the policy with its adapter disabled: no second copy
        policy = get_peft_model(policy, peft_config)
        if training_args.bf16 and getattr(policy, "is_loaded_in_4bit", False):
            for name, module in policy.named_modules():  # norms in fp32, embeddings / head in bf16 (as TRL 1.12)
                if isinstance(module, torch.nn.LayerNorm) or "norm" in name:
                    module.to(torch.float32)
                elif any(x in name for x in ("lm_head", "embed_tokens")) and getattr(module, "weight", None) is not None \
                        and module.weight.dtype == torch.float32:
                    module.to(torch.bfloat16)
    trainer = RLHFPPOTrainer(
        args=training_args,
        processing_class=tokenizer,
        model=policy,
        ref_model=None,  # with LoRA: the policy with its adapter disabled; else a frozen copy
        reward_model=reward_model,
        value_model=value_model,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        callbacks=callbacks,
        script_args=ppo_args,
        recipe_configs=(data_args, ppo_args, training_args, model_args, run_args),
        eos_token_ids=eos_ids,
        stock_generation_config=stock_generation_config,
        reward_functions=reward_functions,
        reward_columns=(lambda rows: reward_columns([train_records[i] for i in rows])) if reward_functions else None,
    )
    trainer.reward_baseline = baseline

    # train
    trainer.train(resume_from_checkpoint=resume)

    # save: adapter, merged policy, value model (merged if it has an adapter), run config; under `accelerate launch`
    # the main process writes them
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    metrics = {"global_step": trainer.state.global_step, "episode": trainer.state.episode,
               "reward_baseline": baseline, "kl_coef_final": trainer.args.kl_coef}
    if logs:
        metrics.update({k: v for k, v in logs[-1].items() if isinstance(v, (int, float))})
        metrics["first_scores"] = logs[0]["objective/scores"]
    merged, value_dir = os.path.join(out, "merged"), os.path.join(out, "value_model")
    if not trainer.accelerator.is_main_process:
        trainer.accelerator.wait_for_everyone()
        return {"output_dir": out, "merged": merged, "value_model": value_dir, "metrics": metrics, "trainer": trainer}
    save_recipe(out, data_args, ppo_args, training_args, model_args, run_args)
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    if isinstance(unwrapped.policy, PeftModel):
        unwrapped.policy.save_pretrained(os.path.join(out, "adapter"))
    with deployable_generation_config(unwrapped.policy, stock_generation_config):
        merge_and_save(unwrapped.policy, tokenizer, merged)
    if isinstance(unwrapped.value_model, PeftModel):
        merge_and_save(unwrapped.value_model, tokenizer, value_dir)  # merges in place: training is over
        if ppo_args.share_reward_value_base:
            trainer.reward_model = None  # its weights now hold the merged value model
    else:
        save_pretrained_atomic(unwrapped.value_model, tokenizer, value_dir)

    # metrics: the last logged training statistics
    write_json(os.path.join(out, "metrics.json"), metrics)
    write_json(os.path.join(out, "log_history.json"), {"log_history": trainer.state.log_history})  # curves
    logger.info("PPO done: merged policy at %s, value model at %s", merged, value_dir)
    trainer.accelerator.wait_for_everyone()
    return {"output_dir": out, "merged": merged, "value_model": value_dir, "metrics": metrics, "trainer": trainer}


if __name__ == "__main__":
    from .cli_launch import run_stage

    run_stage("ppo")

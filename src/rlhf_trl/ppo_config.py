"""`PPOConfig`: TRL 1.12's PPOConfig keys (its recipes run unchanged) plus the project's, checked by `check_config`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from transformers import GenerationConfig, TrainingArguments

from .models import sampling_generation_config


def _f(default, help: str):
    """A dataclass field with its ``--help`` text."""
    return field(default=default, metadata={"help": help})


@dataclass
class PPOConfig(TrainingArguments):
    """PPO settings: TRL 1.12's PPOConfig keys (and defaults) plus ``logits_chunk_size``, ``offload_reward_model``,
    ``single_value_forward``; the batch sizes derived from it are a `BatchSizes` (TRL 1.12 wrote them into the config:
    this one is never changed after parsing). Raises `ValueError`: `check_config`."""

    # defaults TRL's configs change from TrainingArguments
    learning_rate: float = _f(3e-6, "AdamW learning rate.")
    logging_steps: float = _f(10, "Updates between logged statistics.")
    gradient_checkpointing: bool = _f(True, "Recompute activations in the backward.")
    bf16: bool | None = _f(None, "bfloat16 weights (default: true unless fp16).")
    lr_scheduler_kwargs: dict | str | None = _f(None, "Extra lr scheduler arguments.")
    # PPO
    dataset_num_proc: int | None = _f(None, "Unused (kept for TRL recipes).")
    num_mini_batches: int = _f(1, "Mini-batches per rollout batch (optimizer steps).")
    total_episodes: int | None = _f(None, "Episodes (prompt + response) to train on.")
    local_rollout_forward_batch_size: int = _f(64, "Rollouts generated / scored per forward pass (per process).")
    num_sample_generations: int = _f(10, "Sample tables over the run (0: none).")
    response_length: int = _f(53, "Maximum new tokens per response.")
    stop_token: Literal["eos"] | None = _f(None, "'eos': responses end at EOS.")
    stop_token_id: int | None = _f(None, "A token id that ends responses.")
    temperature: float = _f(0.7, "Rollout sampling temperature.")
    missing_eos_penalty: float | None = _f(None, "Subtracted from the score of responses without EOS (reward units).")
    sft_model_path: str | None = _f(None, "Policy initialization (a local directory).")
    reward_model_path: str | None = _f(None, "Reward model (a local directory).")
    push_to_hub: bool = _f(False, "Push the model to the Hub after training.")
    model_adapter_name: str | None = _f(None, "Trained adapter (several adapters).")
    ref_adapter_name: str | None = _f(None, "Reference adapter (several adapters).")
    num_ppo_epochs: int = _f(4, "Optimisation passes over each rollout batch.")
    whiten_rewards: bool = _f(False, "Whiten per-token rewards (needs >= 8 per rank).")
    kl_coef: float = _f(0.05, "KL coefficient (reward units per nat).")
    kl_estimator: Literal["k1", "k3"] = _f("k1", "KL estimator: k1 or k3.")
    cliprange: float = _f(0.2, "Policy ratio clip range.")
    vf_coef: float = _f(0.1, "Value loss weight.")
    cliprange_value: float = _f(0.2, "Value clip range (reward units).")
    gamma: float = _f(1.0, "Discount factor.")
    lam: float = _f(0.95, "GAE lambda.")
    ds3_gather_for_generation: bool = _f(True, "ZeRO-3: gather the policy's weights for generation.")
    logits_chunk_size: int = _f(32, "Response positions whose vocabulary logits are formed at once (0: all).")
    offload_reward_model: bool = _f(False, "Keep the reward model's weights on disk (output_dir/.tmp-offload-*) "
                                    "between rollouts: one model less in memory during the PPO epochs, one read of its "
                                    "weights per update.")
    single_value_forward: bool = _f(True, "With 1 PPO epoch, 1 mini-batch, 1 process and whiten_rewards off: the value "
                                    "model's training forward also gives the rollout's values (one value forward less "
                                    "per update; `ppo_engine.value_step`). false: TRL 1.12's separate no-grad forward.")

    def __post_init__(self):
        self.bf16 = not self.fp16 if self.bf16 is None else self.bf16
        super().__post_init__()
        check_config(self)


def check_config(args: PPOConfig) -> None:
    """Every check of a `PPOConfig` value that needs no model or data. Raises `ValueError` (one line naming the keys):
    ``num_mini_batches`` < 1 or not dividing each process's rollouts per update; ``whiten_rewards`` with fewer than 8
    rollouts per process mini-batch; ``stop_token`` not 'eos', or with ``stop_token_id``; a bad ``kl_estimator``."""
    if args.num_mini_batches < 1:
        raise ValueError(f"num_mini_batches must be >= 1, got {args.num_mini_batches}")
    local = args.per_device_train_batch_size * args.gradient_accumulation_steps
    if local % args.num_mini_batches:
        raise ValueError("per_device_train_batch_size x gradient_accumulation_steps (rollouts per process and update) "
                         f"/ num_mini_batches: {local} is not a multiple of {args.num_mini_batches}")
    if args.whiten_rewards and (local_mini := local // args.num_mini_batches) < 8:
        raise ValueError(f"whiten_rewards needs >= 8 rollouts per process mini-batch, got {local_mini}")
    if args.stop_token and args.stop_token_id is not None:
        raise ValueError("set stop_token or stop_token_id, not both")
    if args.stop_token not in (None, "eos"):
        raise ValueError(f"stop_token must be 'eos' or unset, got {args.stop_token!r}")
    if args.kl_estimator not in ("k1", "k3"):
        raise ValueError(f"kl_estimator must be 'k1' or 'k3', got {args.kl_estimator!r}")


@dataclass(frozen=True)
class BatchSizes:
    """A run's batch sizes, derived once (`derive`) and then fixed; units: rollouts (= episodes). One update samples
    ``local_batch`` rollouts per process (``batch`` in all), trained in mini-batches of ``local_mini_batch`` (one
    optimizer step each) made of micro-batches of ``per_device`` rows (one forward / backward each)."""

    per_device: int  # rows per micro-batch and process: per_device_train_batch_size
    local_batch: int  # rollouts per process and update: per_device x gradient_accumulation_steps
    local_mini_batch: int  # rollouts per process and optimizer step: local_batch / num_mini_batches
    batch: int  # episodes per update, all processes
    total_episodes: int  # episodes of the run (total_episodes, else num_train_epochs x prompts)
    num_updates: int  # ceil(total_episodes / batch)

    @classmethod
    def derive(cls, args: PPOConfig, num_prompts: int, num_processes: int) -> BatchSizes:
        """From the recipe's `PPOConfig` (`check_config` proved ``num_mini_batches`` divides ``local_batch``), the
        number of training prompts and of processes."""
        total = args.total_episodes if args.total_episodes is not None else int(args.num_train_epochs * num_prompts)
        local = args.per_device_train_batch_size * args.gradient_accumulation_steps
        batch = local * num_processes
        return cls(args.per_device_train_batch_size, local, local // args.num_mini_batches, batch, total,
                   math.ceil(total / batch))

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches accumulated into one optimizer step (one mini-batch's)."""
        return math.ceil(self.local_mini_batch / self.per_device)


def sampling_config(args: PPOConfig, eos_ids: list[int] | None, pad_token_id: int,
                    temperature: float | None = None) -> GenerationConfig:
    """Rollout sampling of ``softmax(logits / (temperature + 1e-7))`` alone (TRL 1.12's) to ``eos_ids`` (None: none)."""
    temperature = args.temperature if temperature is None else temperature
    config = sampling_generation_config(temperature + 1e-7, args.response_length, eos_ids or [], pad_token_id)
    if eos_ids is None:
        config.eos_token_id = None
    return config


@dataclass
class PPOScriptArguments:
    """PPO fields that TRL's PPOConfig lacks."""

    # what a YAML value may be where the field's type says less (`config.check_types`): argparse needs `str` here
    yaml_types: ClassVar[dict] = {"reward_baseline": float | str}

    reward_baseline: str = _f("0.0", "Subtracted from every reward-model score (reward units): a number, or 'auto' for "
                              "the mean RM score of SFT rollouts on reward_baseline_batches calibration batches before "
                              "training.")
    reward_baseline_batches: int = _f(2, "Rollout batches (of per_device_train_batch_size prompts) for 'auto'.")
    value_head: bool = _f(False, "The value is a linear head (v_head) on the policy's own backbone, trained with "
                          "vf_coef through the policy's LoRA adapter (or all its weights): TRL 0.x's "
                          "AutoModelForCausalLMWithValueHead. One backbone fewer in memory; the value loss also moves "
                          "the policy (lower vf_coef if it hurts). false: a separate value model.")
    value_model_path: str | None = _f(None, "Value model initialization (default: the reward model).")
    value_use_peft: bool = _f(False, "Train the value model through a LoRA adapter; its base stays frozen.")
    value_lora_r: int = _f(16, "LoRA rank of the value model.")
    value_lora_alpha: int = _f(32, "LoRA alpha of the value model.")
    value_lora_dropout: float = _f(0.0, "LoRA dropout of the value model.")
    value_lora_target_modules: list[str] | None = _f(None, "Value-model modules given LoRA (default: peft's choice for "
                                                     "the model).")
    share_reward_value_base: bool = _f(False, "Put the value model's LoRA adapter on the reward model's own weights "
                                       "(one copy for both; the reward is read with the adapter off). Needs "
                                       "value_use_peft: true and no value_model_path; not with DeepSpeed.")
    kl_target: float | None = _f(None, "Adaptive KL control: target KL per response (nats). None keeps kl_coef fixed.")
    kl_horizon: int = _f(10000, "Adaptive KL control horizon (episodes), as in Ziegler et al. 2019.")
    log_samples_every: int = _f(10, "Updates between sample tables (logs and samples.jsonl); 0 turns them off.")
    save_merged_checkpoints: bool = _f(True, "Write the merged policy into each checkpoint too (default true; costs "
                                       "one model copy in memory while it is written, and its size on disk; false for "
                                       "large or quantized models).")
    trust_remote_code: bool = _f(False, "Run model code shipped in the model directories (e.g. Baichuan).")
    reward_funcs: list[str] | None = _f(None, "Reward functions 'package.module:function' (or 'file.py:function'), "
                                        "each f(prompts, completions, **columns) -> list[float]; added to the reward "
                                        "model's score (or alone without reward_model_path).")
    reward_weights: list[float] | None = _f(None, "Weight of each reward function (default: 1.0 each).")
    ptx_dataset: str | None = _f(None, "PPO-ptx (InstructGPT): SFT data (any file the sft stage reads) whose SFT loss, "
                                 "x ptx_coef, is added to every PPO micro-batch's loss: limits the alignment tax. "
                                 "None: off.")
    ptx_coef: float | None = _f(None, "Weight of the ptx SFT loss (nats per token) against the PPO loss (default 0.05 "
                                "with ptx_dataset, as OpenRLHF).")
    ptx_split: str = _f("train", "Split of ptx_dataset to read (all its rows are used: none is held out).")
    ptx_prompt_template: str | None = _f(None, "Prompt template of ptx_dataset (default: the recipe's "
                                         "prompt_template).")
    ptx_completion_template: str | None = _f(None, "Completion template of ptx_dataset (default: the recipe's).")
    ptx_max_length: int = _f(512, "Tokens per ptx row (longer rows: dropped, or cut as the sft stage's "
                             "length_policy says; counted in data_report.json).")

    def __post_init__(self):
        if self.kl_target is not None and (self.kl_target <= 0 or self.kl_horizon <= 0):
            raise ValueError(f"kl_target and kl_horizon must be positive, got {self.kl_target} and {self.kl_horizon}")
        if self.reward_baseline_value() is None and str(self.reward_baseline).strip().lower() != "auto":
            raise ValueError(f"reward_baseline must be a number or 'auto', got {self.reward_baseline!r}")
        if self.value_head and (self.value_model_path or self.value_use_peft or self.share_reward_value_base):
            key = next(k for k in ("value_model_path", "value_use_peft", "share_reward_value_base") if getattr(self, k))
            raise ValueError(f"value_head: true puts the value on the policy's backbone, so there is no separate value "
                             f"model for {key}; remove {key} (or set value_head: false)")
        if self.ptx_coef is not None and not self.ptx_dataset:
            raise ValueError("ptx_coef is set without ptx_dataset: name the SFT data to mix in (ptx_dataset), or "
                             "remove ptx_coef")
        if self.ptx_dataset and self.ptx_coef is None:
            self.ptx_coef = 0.05
        if self.ptx_coef is not None and not (math.isfinite(self.ptx_coef) and self.ptx_coef > 0):
            raise ValueError(f"ptx_coef must be a positive number, got {self.ptx_coef}")
        if self.share_reward_value_base and not self.value_use_peft:
            raise ValueError("share_reward_value_base: true needs value_use_peft: true (the value model is a LoRA "
                             "adapter on the reward model's weights)")

    def reward_baseline_value(self) -> float | None:
        """``reward_baseline`` as a number (reward units), or None for 'auto'."""
        try:
            return float(str(self.reward_baseline).strip())
        except ValueError:
            return None

"""The reward model as PPO reads it (baseline-shifted, on the value model's weights, or offloaded between rollouts; the
'auto' baseline); each wrapper keeps ``base_model_prefix`` and ``score`` for `rlhf_trl.scoring.sequence_scores`."""

from __future__ import annotations

import glob
import json
import logging
import os
from contextlib import contextmanager

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from .models import StageInputError
from .ppo_config import sampling_config
from .scoring import generate_rollouts, preserved_rng, sequence_scores, truncate_at_eos

logger = logging.getLogger(__name__)

OFFLOAD_PREFIX = ".tmp-offload-"


def require_reward_model(path: str, train_hint: str | None = None) -> None:
    """Check that local ``path`` is a classifier with a trained ``score``. Raises `StageInputError`: it is not."""
    if not os.path.isdir(path):
        return
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        kinds = json.load(f).get("architectures") or []
    names = None  # the weight names of every safetensors file (shards included): their headers only
    for file in glob.glob(os.path.join(path, "*.safetensors")):
        with safe_open(file, "pt") as weights:
            names = (names or set()) | set(weights.keys())
    if kinds and not any(k.endswith("ForSequenceClassification") for k in kinds):
        problem = f"is a {kinds[0]}, not a sequence-classification model"
    elif names is not None and not any(n == "score.weight" or n.endswith(".score.weight") for n in names):
        problem = "has no score.weight in its weights (its score head would be newly initialised at random)"
    else:
        return
    raise StageInputError(f"reward_model_path '{path}' {problem}: a reward model needs a trained score head; train "
                          f"one with `{train_hint or 'make rm'}` and use its merged/ directory")


class BaselineShiftedScore(nn.Module):
    """A reward model's ``score`` head, ``[b, T, hidden] -> [b, T, 1]``, minus ``baseline`` (read there by PPO)."""

    def __init__(self, score: nn.Module, baseline: float):
        super().__init__()
        self.inner = score
        self.register_buffer("baseline", torch.tensor(float(baseline)), persistent=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.inner(hidden_states) - self.baseline.to(hidden_states.dtype)


def apply_reward_baseline(reward_model, baseline: float):
    """Freeze ``reward_model``, put it in eval mode and shift its score head by ``-baseline``. Returns the model."""
    reward_model.eval().requires_grad_(False)
    if isinstance(reward_model.score, BaselineShiftedScore):
        reward_model.score = reward_model.score.inner
    if baseline:
        reward_model.score = BaselineShiftedScore(reward_model.score, baseline)
    return reward_model


class SharedBaseRewardModel(nn.Module):
    """The reward model read off the value model's weights (``share_reward_value_base``): the value model (LoRA SEQ_CLS
    on the reward model, in place) with its adapter off, plus the reward model's frozen score head; not a submodule, so
    ``.eval()`` and device moves miss the adapter. Raises `ValueError`: no peft value model with a wrapped ``score``."""

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
        """The reward model's backbone forward: the shared transformer with the value model's adapter off."""
        with self._value_model.disable_adapter():
            return self._backbone(**kwargs)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """Per-token reward logits ``[batch, seq_len, 1]`` (the score at the last real token is the reward)."""
        return self.score(self.backbone(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state)


class OffloadedWeights:
    """A frozen module's weights kept on disk, back in ``loaded()``. Raises `ValueError`: quantized ones."""

    def __init__(self, module: nn.Module, path: str):
        self.module, self.path = module, path
        self.params = dict(module.named_parameters())  # remove_duplicate: a tied parameter once
        if bad := [n for n, p in self.params.items() if type(p) is not nn.Parameter or not p.is_floating_point()]:
            raise ValueError(f"offload_reward_model: the reward model has quantized or non-float weights ({bad[0]}); "
                             "set `offload_reward_model: false`")
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        save_file({n: p.detach().contiguous() for n, p in self.params.items()}, path)
        self.release()

    def release(self) -> None:
        for p in self.params.values():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def read(self) -> None:
        """Read the weights back from the file onto their devices."""
        for name, tensor in load_file(self.path).items():
            self.params[name].data = tensor.to(self.params[name].device)

    @contextmanager
    def loaded(self):
        self.read()
        try:
            yield self.module
        finally:
            self.release()

    def restore(self) -> None:
        """Read the weights back for good and delete the file (the module is an ordinary module again)."""
        self.read()
        os.remove(self.path)


@torch.no_grad()
def calibrate_reward_baseline(policy, reward_model, tokenizer, dataset, args, batches: int,
                              eos_ids: list[int] | None = None) -> float:
    """Mean RM score (reward units) of PPO-sampled SFT rollouts on ``batches`` batches, RNG seeded and restored."""
    from transformers import DataCollatorWithPadding

    collator, eos_ids = DataCollatorWithPadding(tokenizer), eos_ids or [tokenizer.eos_token_id]
    gen = sampling_config(args, eos_ids, tokenizer.pad_token_id)
    size, scores = args.per_device_train_batch_size, []
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

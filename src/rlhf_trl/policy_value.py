"""PPO's classic model layout (``value_head: true``): the value is a linear head on the policy's own backbone, TRL
0.x's ``AutoModelForCausalLMWithValueHead`` (``v_head``), as the scripts this project grew from and LLaMA-Factory's
PPO run it. One backbone fewer than a separate value model; the value loss (scaled by ``vf_coef``) reaches the
policy's weights (its LoRA adapter, or all of them). The head is saved as ``value_head.safetensors`` (TRL 0.x's
names ``v_head.summary.weight`` / ``.bias``) beside the policy's weights or adapter."""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file
from torch import nn

VALUE_HEAD_FILE = "value_head.safetensors"
KEYS = ("v_head.summary.weight", "v_head.summary.bias")


class ValueHead(nn.Module):
    """``summary``: ``Linear(hidden_size, 1)`` on the last hidden state of ``policy``'s backbone (with its adapter on):
    a value per position, reward units. ``policy`` is held as a reference, not a submodule (its weights are the
    policy's, trained and saved with it); the head's two tensors are this module's only parameters. Starts at zero
    (every value 0, the baseline-subtracted reward's mean; no gradient reaches the backbone until the head has
    moved). `rlhf_trl.scoring.response_values` reads it as it reads a value model (`score_parts`)."""

    def __init__(self, policy):
        super().__init__()
        base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
        weight = base.get_input_embeddings().weight  # never quantized: the policy's compute dtype and device
        self.summary = nn.Linear(base.config.hidden_size, 1, dtype=weight.dtype, device=weight.device)
        nn.init.zeros_(self.summary.weight)
        nn.init.zeros_(self.summary.bias)
        self.__dict__["policy"] = policy  # not registered: no second path to the policy's parameters

    def score_parts(self) -> tuple[nn.Module, nn.Module]:
        """``(backbone, head)`` as `rlhf_trl.scoring` reads a sequence classifier's."""
        base = self.policy.get_base_model() if hasattr(self.policy, "get_base_model") else self.policy
        return getattr(base, base.base_model_prefix), self.summary

    def head_state(self) -> dict[str, torch.Tensor]:
        """The head's tensors under TRL 0.x's names (CPU, contiguous), for `save_value_head`."""
        return dict(zip(KEYS, (t.detach().cpu().contiguous() for t in (self.summary.weight, self.summary.bias))))

    def load_head_state(self, tensors: dict[str, torch.Tensor], source: str) -> None:
        """Load `head_state`'s tensors. Raises `ValueError`: missing names or another hidden size, naming ``source``."""
        if any(k not in tensors for k in KEYS) or tensors[KEYS[0]].shape != self.summary.weight.shape:
            found = {k: tuple(v.shape) for k, v in tensors.items()}
            raise ValueError(f"{source}: not a value head of this policy (expected {KEYS[0]} of shape "
                             f"{tuple(self.summary.weight.shape)} and {KEYS[1]}; found {found})")
        self.summary.load_state_dict({"weight": tensors[KEYS[0]], "bias": tensors[KEYS[1]]})


def load_value_head(policy, folder: str) -> ValueHead:
    """The value head saved in ``folder`` (a checkpoint, ``adapter/`` or ``merged/`` of a ``value_head: true`` run) on
    ``policy`` (that folder's policy, loaded by the caller). Raises `FileNotFoundError`: no ``value_head.safetensors``;
    `ValueError`: it does not fit the policy."""
    path = os.path.join(folder, VALUE_HEAD_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder}: no {VALUE_HEAD_FILE} (written by PPO runs with value_head: true)")
    head = ValueHead(policy)
    head.load_head_state(load_file(path), path)
    return head

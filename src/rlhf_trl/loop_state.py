"""Exact resume of the stages trained by `transformers.Trainer`'s own loop (SFT, RM): the loop's running sums."""

from __future__ import annotations

import json
import logging
import os
from collections import defaultdict
from pathlib import Path

import torch
from accelerate.utils import gather_object

from .atomic import strict_json

logger = logging.getLogger(__name__)

LOOP_STATE_NAME = "loop_state.json"


def with_loop_state(trainer_cls):
    """``trainer_cls`` (a Trainer with `AtomicCheckpointMixin`) with `LoopStateMixin` mixed in before it."""
    return type(trainer_cls.__name__, (LoopStateMixin, trainer_cls), {})


class LoopStateMixin:
    """Loop sums Trainer checkpoints lack for an exact resume (losses, last logged step): ``loop_state.json``."""

    _loop_state_restored = False

    def checkpoint_extras(self, checkpoint_dir: str) -> None:
        """Write ``loop_state.json`` (every process's sums, gathered to the main process, which writes)."""
        super().checkpoint_extras(checkpoint_dir)
        metrics, loss = getattr(self, "_metrics", None), getattr(self, "_tr_loss", None)
        states = [{"tr_loss": loss.item() if isinstance(loss, torch.Tensor) else None,
                   "total_loss_scalar": getattr(self, "_total_loss_scalar", 0.0),
                   "globalstep_last_logged": getattr(self, "_globalstep_last_logged", self.state.global_step),
                   "total_train_tokens": getattr(self, "_total_train_tokens", None),
                   "metrics": {k: dict(v) for k, v in metrics.items()} if isinstance(metrics, dict) else None}]
        if self.accelerator.num_processes > 1:
            states = gather_object(states)
        if self.args.should_save:  # straight into the staged checkpoint (published whole by its rename)
            with open(os.path.join(checkpoint_dir, LOOP_STATE_NAME), "w", encoding="utf-8") as f:
                json.dump(strict_json({"processes": states}), f, indent=2, allow_nan=False)  # a NaN sum: null

    def _run_epoch(self, *args, **kwargs):
        """The Trainer's pass over the data; the first pass of a resumed run starts with the saved sums."""
        ckpt = kwargs.get("resume_from_checkpoint")
        if ckpt is not None and not self._loop_state_restored and kwargs["epoch"] == kwargs["epochs_trained"]:
            self._restore_loop_state(ckpt)
        return super()._run_epoch(*args, **kwargs)

    def _restore_loop_state(self, ckpt: str) -> None:
        """Put back this process's entry of ``ckpt/loop_state.json``. Raises `ValueError`: another process count."""
        self._loop_state_restored = True
        path = os.path.join(ckpt, LOOP_STATE_NAME)
        if not os.path.exists(path):
            logger.warning("%s has no %s: the first logged loss after the resume averages the resumed steps only",
                           ckpt, LOOP_STATE_NAME)
            return
        states = json.loads(Path(path).read_text(encoding="utf-8"))["processes"]
        if len(states) != self.accelerator.num_processes:
            raise ValueError(f"{path} was written by {len(states)} processes; this run has "
                             f"{self.accelerator.num_processes}")
        state = states[self.accelerator.process_index]
        if state["tr_loss"] is not None:
            self._tr_loss.fill_(state["tr_loss"])
        self._total_loss_scalar = state["total_loss_scalar"]
        self._globalstep_last_logged = state["globalstep_last_logged"]
        self._resumed_loss_total = True
        if state["total_train_tokens"] is not None:
            self._total_train_tokens = state["total_train_tokens"]
        if state["metrics"] is not None and isinstance(getattr(self, "_metrics", None), dict):
            self._metrics.update({mode: defaultdict(list, values) for mode, values in state["metrics"].items()})

    def log(self, logs: dict, start_time: float | None = None) -> None:
        """The Trainer's log; a resumed run's final ``train_loss`` is the whole run's mean, as without the resume."""
        if "train_loss" in logs and getattr(self, "_resumed_loss_total", False):
            logs["train_loss"] = self._total_loss_scalar / max(self.state.global_step, 0.001)
        super().log(logs, start_time)

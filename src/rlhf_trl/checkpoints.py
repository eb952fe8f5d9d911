"""Checkpoint plumbing shared by the three stages' trainers."""

from __future__ import annotations

import glob
import logging
import os
import shutil

logger = logging.getLogger(__name__)

STAGING_PREFIX = ".tmp-"


class AtomicCheckpointMixin:
    """Mixed into a `transformers.Trainer` subclass: each ``checkpoint-N`` is written under ``.tmp-checkpoint-N``
    and renamed into place only when complete, so a killed run never leaves a half-written ``checkpoint-N``
    (``get_last_checkpoint`` and ``resume_from_checkpoint=true`` only see complete ones).

    Subclasses add files with `checkpoint_extras`.
    """

    def checkpoint_extras(self, checkpoint_dir: str) -> None:
        """Write extra files into a checkpoint before it is renamed into place (default: nothing)."""

    def _save_checkpoint(self, model, trial):
        from transformers.trainer_utils import rotate_checkpoints

        root = self.args.output_dir
        name = f"checkpoint-{self.state.global_step}"
        staging = os.path.join(root, f"{STAGING_PREFIX}{name}")
        shutil.rmtree(staging, ignore_errors=True)
        self.args.output_dir = staging
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.output_dir = root
        if not self.args.should_save:
            return
        ckpt = os.path.join(staging, name)
        self.checkpoint_extras(ckpt)
        final = os.path.join(root, name)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(ckpt, final)
        shutil.rmtree(staging, ignore_errors=True)
        rotate_checkpoints(root, self.args.save_total_limit, self.state.best_model_checkpoint, use_mtime=False)


def with_atomic_checkpoints(trainer_cls):
    """``trainer_cls`` with `AtomicCheckpointMixin` mixed in (e.g. for `trl.SFTTrainer`, `trl.RewardTrainer`)."""
    return type(trainer_cls.__name__, (AtomicCheckpointMixin, trainer_cls), {})


def remove_staging(output_dir: str) -> None:
    """Delete ``.tmp-checkpoint-*`` leftovers of a killed run (never complete checkpoints)."""
    for path in glob.glob(os.path.join(output_dir, f"{STAGING_PREFIX}checkpoint-*")):
        logger.info("removing the unfinished checkpoint %s of an interrupted run", path)
        shutil.rmtree(path, ignore_errors=True)


def start_run(training_args, run_args=None):
    """Checks every stage makes before it writes anything into ``training_args.output_dir``.

    Resolves ``resume_from_checkpoint`` (``true`` -> the newest complete checkpoint), refuses to overwrite a finished
    run unless ``overwrite_output_dir``, and removes ``.tmp-checkpoint-*`` leftovers of a killed run.

    Returns:
        ``(run_args, resume)``: the run arguments (defaults if None) and the checkpoint to resume from, or None.

    Raises:
        StageInputError: resume requested but no checkpoint; RecipeError: a finished run is in the way.
    """
    from .config import RunArguments, check_output_dir
    from .models import resolve_resume

    run_args = run_args or RunArguments()
    resume = resolve_resume(training_args.resume_from_checkpoint, training_args.output_dir)
    check_output_dir(training_args.output_dir, run_args.overwrite_output_dir, bool(resume))
    remove_staging(training_args.output_dir)
    return run_args, resume

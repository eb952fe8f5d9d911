"""Checkpoint plumbing shared by the three stages' trainers."""

from __future__ import annotations

import glob
import logging
import os
import shutil

from . import faults

logger = logging.getLogger(__name__)

STAGING_PREFIX = ".tmp-"


class AtomicCheckpointMixin:
    """Mixed into a `transformers.Trainer` subclass: each ``checkpoint-N`` is written under ``.tmp-checkpoint-N``
    and renamed into place only when complete, so a killed run never leaves a half-written ``checkpoint-N``
    (``get_last_checkpoint`` and ``resume_from_checkpoint=true`` only see complete ones).

    Subclasses add files with `checkpoint_extras`.

    Under several processes (``accelerate launch``) every process calls ``_save_checkpoint`` (the trainer's save
    runs collective operations and each process writes its own ``rng_state_<rank>.pth``); only the main process
    clears the staging directory, writes the extras and renames, between barriers.
    """

    def checkpoint_extras(self, checkpoint_dir: str) -> None:
        """Write extra files into a checkpoint before it is renamed into place (default: nothing).

        Called on every process; collective operations are allowed, files must be written by the main process
        only (``self.args.should_save``).
        """

    def _save_checkpoint(self, model, trial):
        from transformers.trainer_utils import rotate_checkpoints

        root = self.args.output_dir
        name = f"checkpoint-{self.state.global_step}"
        staging = os.path.join(root, f"{STAGING_PREFIX}{name}")
        with faults.checkpoint_save():
            try:
                if self.args.should_save and os.path.exists(staging):
                    faults.file_op("remove", staging, lambda: shutil.rmtree(staging, ignore_errors=True))
                self.accelerator.wait_for_everyone()  # no process writes into staging before it is cleared
                self.args.output_dir = staging
                try:
                    super()._save_checkpoint(model, trial)
                finally:
                    self.args.output_dir = root
                ckpt = os.path.join(staging, name)
                self.checkpoint_extras(ckpt)
                self.accelerator.wait_for_everyone()  # every process's files are in staging
                if self.args.should_save:
                    publish_checkpoint(ckpt, os.path.join(root, name))
                    faults.file_op("remove", staging, lambda: shutil.rmtree(staging, ignore_errors=True))
                    faults.file_op("rotate", root, lambda: rotate_checkpoints(
                        root, self.args.save_total_limit, self.state.best_model_checkpoint, use_mtime=False))
            except OSError as exc:
                if self.args.should_save:
                    shutil.rmtree(staging, ignore_errors=True)
                raise CheckpointWriteError(name, root, exc) from exc
        self.accelerator.wait_for_everyone()  # checkpoint-N is in place for every process


class CheckpointWriteError(OSError):
    """Writing ``checkpoint-N`` failed (full disk, read-only ``output_dir``, ...): its staging directory was removed,
    no ``checkpoint-N`` was published, the earlier checkpoints are untouched. The message is one line naming the path
    the file system refused."""

    def __init__(self, name: str, root: str, cause: OSError):
        where = cause.filename or root
        earlier = complete_checkpoints(root)
        kept = f"the newest complete checkpoint is {os.path.basename(earlier[-1])}" if earlier else "no checkpoint yet"
        self.message = (f"cannot write {name} in '{root}': {cause.strerror or cause} ('{where}'); nothing of it was "
                        f"published, {kept}")
        super().__init__(cause.errno, self.message, where)

    def __str__(self) -> str:
        return self.message


def publish_checkpoint(staged: str, final: str) -> None:
    """Make the complete checkpoint ``staged`` visible as ``final``: fsync its files and directories, rename, fsync
    the parent (`faults.publish`). A ``final`` of the same step already there (saved again) is moved aside first and
    removed afterwards, so some complete ``checkpoint-N`` exists at every moment (as ``final`` or ``final.old``).

    Raises:
        OSError: a write, fsync or rename failed.
    """
    old = None
    if os.path.exists(final):
        old = final + ".old"
        faults.file_op("rename", old, lambda: os.rename(final, old))
    faults.publish(staged, final)
    if old is not None:
        faults.file_op("remove", old, lambda: shutil.rmtree(old, ignore_errors=True))


def with_atomic_checkpoints(trainer_cls):
    """``trainer_cls`` with `AtomicCheckpointMixin` mixed in (e.g. for `trl.SFTTrainer`, `trl.RewardTrainer`)."""
    return type(trainer_cls.__name__, (AtomicCheckpointMixin, trainer_cls), {})


def remove_staging(output_dir: str) -> None:
    """Delete ``.tmp-checkpoint-*`` leftovers of a killed run (never complete checkpoints) and its
    ``.tmp-offload-*`` weight files (``offload_reward_model``)."""
    for path in glob.glob(os.path.join(output_dir, f"{STAGING_PREFIX}checkpoint-*")):
        logger.info("removing the unfinished checkpoint %s of an interrupted run", path)
        shutil.rmtree(path, ignore_errors=True)
    for path in glob.glob(os.path.join(output_dir, f"{STAGING_PREFIX}offload-*")):
        logger.info("removing the offloaded weights %s of an interrupted run", path)
        os.remove(path)


def start_run(training_args, run_args=None):
    """Checks every stage makes before it reads its inputs; nothing of an earlier run is changed here.

    Resolves ``resume_from_checkpoint`` (``true`` -> the newest complete checkpoint), refuses to overwrite a finished
    run unless ``overwrite_output_dir``, refuses to start afresh next to an unfinished run's checkpoints unless
    ``overwrite_output_dir``, and removes ``.tmp-checkpoint-*`` leftovers of a killed run (never a complete
    checkpoint). The earlier run's checkpoints, logs and reports are removed later, by `begin_writing`, once the new
    run has read and tokenized its data and loaded its models: bad input leaves them as they were.

    Returns:
        ``(run_args, resume)``: the run arguments (defaults if None) and the checkpoint to resume from, or None.

    Raises:
        StageInputError: resume requested but no checkpoint; RecipeError: a finished run, or an unfinished run's
        checkpoints, in the way.
    """
    from .config import RecipeError, RunArguments, check_output_dir
    from .models import resolve_resume

    run_args = run_args or RunArguments()
    state = distributed_state(training_args)
    out = training_args.output_dir
    resume = resolve_resume(training_args.resume_from_checkpoint, out)
    check_output_dir(out, run_args.overwrite_output_dir, bool(resume))
    earlier = [] if resume else complete_checkpoints(out)
    if earlier and not run_args.overwrite_output_dir:
        raise RecipeError(
            f"output_dir '{out}' holds checkpoints of an earlier, unfinished run ({os.path.basename(earlier[-1])}); "
            "continue it with resume_from_checkpoint=true, or set `overwrite_output_dir: true` to start over"
        )
    if state.is_main_process:
        remove_staging(out)
    state.wait_for_everyone()  # every process has checked the output_dir before any of them writes into it
    return run_args, resume


def begin_writing(training_args, run_args, resume) -> None:
    """Call when the run has proven its inputs (recipe parsed, data read and tokenized, models loaded), right before
    it starts to write: with ``overwrite_output_dir`` and no resume, the earlier run's checkpoints, logs and reports
    go now (`remove_earlier_run`), not before, so a run that fails on its inputs changes nothing on disk."""
    state = distributed_state(training_args)
    if state.is_main_process and run_args.overwrite_output_dir and not resume:
        remove_earlier_run(training_args.output_dir)
    state.wait_for_everyone()


# what a run leaves besides its models; a fresh run over an old one removes them so none of them is mistaken for its
# own (merged/, adapter/, value_model/ and run_config.yaml are replaced, atomically, when the new run saves)
RUN_ARTIFACTS = ("runs", "eval.json", "eval_samples.jsonl", "report.md", "report", "samples.jsonl", "metrics.json",
                 "eval_metrics.json", "eval_pairs.jsonl", "log_history.json")


def complete_checkpoints(output_dir: str) -> list[str]:
    """The ``checkpoint-N`` directories in ``output_dir``, oldest first."""
    found = []
    for path in glob.glob(os.path.join(output_dir, "checkpoint-*")):
        suffix = os.path.basename(path)[len("checkpoint-"):]
        if suffix.isdigit() and os.path.isdir(path):
            found.append((int(suffix), path))
    return [p for _, p in sorted(found)]


def remove_earlier_run(output_dir: str) -> None:
    """``overwrite_output_dir`` without resume: delete the earlier run's checkpoints, logs and reports, so that
    ``resume_from_checkpoint=true``, the TensorBoard curves and ``rlhf-trl eval`` only ever see this run's."""
    stale = complete_checkpoints(output_dir) + [
        p for p in (os.path.join(output_dir, name) for name in RUN_ARTIFACTS) if os.path.exists(p)
    ]
    if stale:
        logger.info("overwrite_output_dir: removing %d checkpoints / logs of the earlier run in %s", len(stale),
                    output_dir)
    for path in stale:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.remove(path)


def distributed_state(training_args):
    """The `accelerate.PartialState` of this run, set up the way the trainer will set it up (from ``use_cpu``,
    ``ddp_backend``, ... of ``training_args``): under ``accelerate launch --num_processes N`` this joins the process
    group (gloo on CPU). One process: a state with ``is_main_process`` True and a no-op ``wait_for_everyone``.

    Raises:
        RecipeError: the launcher started several processes (``WORLD_SIZE`` > 1) but they did not form one process
            group, so each would train alone and all would write the same files (e.g. a GPU config on a machine
            without GPUs and a recipe without ``use_cpu: true``).
    """
    from .config import RecipeError

    training_args.device  # noqa: B018  (sets up PartialState / the process group, as the trainer does)
    state = getattr(training_args, "distributed_state", None)
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if state is not None and launched > 1 and state.num_processes != launched:
        raise RecipeError(
            f"launched {launched} processes but they did not join one process group (this one sees "
            f"{state.num_processes}); on a machine without GPUs set `use_cpu: true` in the recipe or launch with "
            "ACCEL=multi_cpu (ACCELERATE_USE_CPU=true)"
        )
    return state if state is not None else _SingleProcess()


class _SingleProcess:
    is_main_process = True
    num_processes = 1

    def wait_for_everyone(self) -> None:
        pass


def weights_are_sharded(trainer) -> bool:
    """True when the trainer's model weights are split across processes (DeepSpeed ZeRO-3 or FSDP), so no single
    process can merge or save them from its own copy."""
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    return bool((plugin is not None and plugin.zero_stage == 3) or getattr(trainer, "is_fsdp_enabled", False))


def save_final_model(trainer, tokenizer, path: str, adapter_dir: str | None, base_path: str, kind: str):
    """Write a stage's ``merged/`` model: a plain transformers model with the tokenizer. Call on every process.

    - One copy of the weights per process (single process, DDP): the main process merges the LoRA adapter (if any)
      into the trained model and saves it (`models.merge_and_save`); returns that model there.
    - Weights sharded (ZeRO-3 / FSDP), full-parameter training: every process calls ``trainer.save_model`` into a
      staging directory (it gathers the full weights: DeepSpeed needs ``zero3_save_16bit_model: true``, as in
      ``recipes/accelerate_configs/zero3.yaml``); the main process adds the tokenizer and renames it into place.
    - Weights sharded, LoRA: the adapter in ``adapter_dir`` (saved by ``trainer.save_model``) is merged into the base
      at ``base_path`` loaded again on the CPU of the main process (`merge.merge_adapter`).

    In the sharded cases the main process returns the merged model loaded from ``path`` (``kind``:
    ``causal_lm`` / ``sequence_classifier``). Other processes return None.
    """
    from .models import load_causal_lm, load_sequence_classifier, merge_and_save

    main = trainer.is_world_process_zero()
    if not weights_are_sharded(trainer):
        return merge_and_save(trainer.model, tokenizer, path) if main else None
    if adapter_dir is None:
        staging = path + ".tmp-gathered"
        if main:
            shutil.rmtree(staging, ignore_errors=True)
        trainer.accelerator.wait_for_everyone()
        trainer.save_model(staging)
        if main:
            tokenizer.save_pretrained(staging)
            if os.path.exists(path):
                shutil.rmtree(path)
            os.rename(staging, path)
    elif main:
        from .merge import merge_adapter

        merge_adapter(adapter_dir, path, base=base_path)
    trainer.accelerator.wait_for_everyone()
    if not main:
        return None
    return (load_causal_lm if kind == "causal_lm" else load_sequence_classifier)(path)

"""Checkpoint plumbing shared by the three stages' trainers."""

from __future__ import annotations

import functools
import glob
import json
import logging
import os
import shutil
import struct
import zipfile
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

from . import atomic
from .atomic import CheckpointWriteError, write_json
from .config import Recipe, RecipeError, RunArguments, check_output_dir, save_recipe
from .merge import merge_adapter
from .models import StageInputError, load_causal_lm, load_sequence_classifier, merge_and_save, peak_memory_mb
from .run_dir import (OutputDirError, RunBusyError, RunLock, StopOnSignal, StoppedBySignal, catch_stop_signals,
                      checkpoint_room, preflight, release_stop_signals)

logger = logging.getLogger(__name__)

STAGING_PREFIX = ".tmp-"
MANIFEST = "manifest.json"  # in every checkpoint-N: its files and their sizes (`write_manifest`)
DAMAGED_PREFIX = "damaged-"  # damaged-checkpoint-N: set aside by a resume from an older one (`set_aside_damaged`)


class AtomicCheckpointMixin:
    """Trainer mixin: ``checkpoint-N`` is written under ``.tmp-checkpoint-N``, renamed into place only when complete;
    a stop signal ends training after the current step with a checkpoint, then `train` raises `StoppedBySignal`."""

    stop_unit = "step"  # what a stop message counts (PPO: "update")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stop_on_signal = StopOnSignal()
        self.add_callback(self.stop_on_signal)

    def train(self, *args, **kwargs):
        result = super().train(*args, **kwargs)
        if (signum := self.stop_on_signal.signum) is not None:
            raise StoppedBySignal(signum, step := self.state.global_step,
                                  os.path.join(self.args.output_dir, f"checkpoint-{step}"), self.stop_unit)
        return result

    def checkpoint_extras(self, checkpoint_dir: str) -> None:
        """Add files to a checkpoint before it is renamed into place; called on every process, the main one writes."""

    def _save_checkpoint(self, model, trial):
        from transformers.trainer_utils import rotate_checkpoints

        root, name = self.args.output_dir, f"checkpoint-{self.state.global_step}"
        staging = os.path.join(root, f"{STAGING_PREFIX}{name}")
        with atomic.checkpoint_save():
            try:
                if self.args.should_save and os.path.exists(staging):
                    atomic.file_op("remove", staging, lambda: shutil.rmtree(staging, ignore_errors=True))
                self.accelerator.wait_for_everyone()  # no process writes into staging before it is cleared
                self.args.output_dir = staging
                try:
                    super()._save_checkpoint(model, trial)
                finally:
                    self.args.output_dir = root
                self.checkpoint_extras(ckpt := os.path.join(staging, name))
                self.accelerator.wait_for_everyone()  # every process's files are in staging
                if self.args.should_save:
                    # last: after every process's files (the barrier above), before publishing
                    write_manifest(ckpt, type(self.args).__name__)
                    atomic.publish(ckpt, os.path.join(root, name))  # a re-saved step: the old copy aside
                    atomic.file_op("remove", staging, lambda: shutil.rmtree(staging, ignore_errors=True))
                    atomic.file_op("rotate", root, lambda: rotate_checkpoints(
                        root, self.args.save_total_limit, self.state.best_model_checkpoint, use_mtime=False))
                    drop_earlier_run(root)  # this run has a checkpoint of its own now
            except OSError as exc:
                if self.args.should_save:
                    shutil.rmtree(staging, ignore_errors=True)
                earlier = complete_checkpoints(root)
                raise CheckpointWriteError(name, root, exc, os.path.basename(earlier[-1]) if earlier else None) from exc
        self.accelerator.wait_for_everyone()  # checkpoint-N is in place for every process


def with_atomic_checkpoints(trainer_cls):
    """``trainer_cls`` with `AtomicCheckpointMixin` mixed in (e.g. for `trl.SFTTrainer`, `trl.RewardTrainer`)."""
    return type(trainer_cls.__name__, (AtomicCheckpointMixin, trainer_cls), {})


_locks: list[RunLock] = []  # the output_dir locks this process holds (released by `keeps_earlier_run`)


def claim_output_dir(state, output_dir: str, model_path: str | None = None, full_training: bool = False) -> None:
    """The first thing a run does (main process): lock ``output_dir`` (`run_dir.RunLock`: a second run is refused
    at once, naming the holder), prove it takes files (`run_dir.preflight`) and estimate whether one checkpoint fits
    (`run_dir.checkpoint_room`, from ``model_path``'s weights), then put back an earlier run a killed run set aside
    (`restore_earlier_run`). Raises `RunBusyError`, `OutputDirError` (on every process of ``state``)."""
    error = None
    if state.is_main_process:
        try:
            _locks.append(lock := RunLock(output_dir).acquire())
            preflight(lock.output_dir)
            checkpoint_room(lock.output_dir, model_path, full_training)
            restore_earlier_run(output_dir)
        except (RunBusyError, OutputDirError) as exc:
            error = exc
    if state.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        error = broadcast_object_list([error], from_process=0)[0]
    if error is not None:
        raise error


def start_run(training_args, run_args=None, model_path: str | None = None, full_training: bool = False):
    """Every stage's checks before reading its inputs: catch SIGTERM / SIGINT (`run_dir.catch_stop_signals`), lock
    ``output_dir`` and prove it writable (`claim_output_dir`),
    seed every RNG, put back an earlier run a killed run set aside, resolve ``resume_from_checkpoint``, refuse (unless
    ``overwrite_output_dir``) a run in the way, remove a killed run's ``.tmp-*``. Returns ``(run_args or defaults,
    checkpoint or None)``. Raises `RunBusyError`: another run holds ``output_dir``; `OutputDirError`: not writable or
    no room; `StageInputError`: no intact checkpoint to resume, or the named one damaged; `RecipeError`: a run in the
    way."""
    from transformers import set_seed

    set_seed(training_args.seed)
    state, out, run_args = distributed_state(training_args), training_args.output_dir, run_args or RunArguments()
    catch_stop_signals()
    claim_output_dir(state, out, model_path, full_training)  # its broadcast: every process waits for the main one
    resume, config = resolve_resume(training_args.resume_from_checkpoint, out), type(training_args).__name__
    if resume and os.path.isfile(manifest := os.path.join(resume, MANIFEST)):  # resumable by this stage only
        if (wrote := json.loads(Path(manifest).read_bytes()).get("config", config)) != config:
            raise StageInputError(f"{resume} is a checkpoint of another stage ({wrote}, not {config}); resume it "
                                  "with that stage, or choose another output_dir for this one")
    check_output_dir(out, run_args.overwrite_output_dir, bool(resume))
    if not resume and not run_args.overwrite_output_dir and (earlier := complete_checkpoints(out)):
        raise RecipeError(f"output_dir '{out}' holds checkpoints of an earlier, unfinished run "
                          f"({os.path.basename(earlier[-1])}); continue it with resume_from_checkpoint=true, or set "
                          "`overwrite_output_dir: true` to start over")
    for kind, what in (("checkpoint", "unfinished checkpoint"), ("offload", "offloaded weights")):
        for path in glob.glob(os.path.join(out, f"{STAGING_PREFIX}{kind}-*")) if state.is_main_process else ():
            logger.info("removing the %s %s of an interrupted run", what, path)
            shutil.rmtree(path, ignore_errors=True) if kind == "checkpoint" else os.remove(path)
    state.wait_for_everyone()  # every process has checked the output_dir before any of them writes into it
    return run_args, resume


def begin_writing(training_args, run_args, resume) -> None:
    """Once the inputs are proven: set the earlier run aside (overwrite, no resume) or, resuming, newer damaged ones."""
    state = distributed_state(training_args)
    if state.is_main_process and run_args.overwrite_output_dir and not resume:
        set_earlier_run_aside(training_args.output_dir)
    elif state.is_main_process and resume:
        set_aside_damaged(training_args.output_dir, resume)
    state.wait_for_everyone()


# what a run leaves in output_dir besides checkpoints: a fresh run sets the earlier run's aside
RUN_FILES = ("merged", "adapter", "value_model", "run_config.yaml", "data_report.json", "README.md", "runs",
             "eval.json", "eval_samples.jsonl", "report.md", "report", "samples.jsonl", "metrics.json",
             "eval_metrics.json", "eval_pairs.jsonl", "log_history.json")
EARLIER_RUN = ".earlier-run"  # output_dir/.earlier-run/: the earlier run's files, set aside (`set_earlier_run_aside`)
LISTING = ".listing.json"  # in it: output_dir's entries before they were set aside
_set_aside: set[str] = set()  # output_dirs whose earlier run this process set aside and has not dropped yet


def complete_checkpoints(output_dir: str) -> list[str]:
    """The ``checkpoint-N`` directories in ``output_dir``, oldest first."""
    found = [p for p in glob.glob(os.path.join(output_dir, "checkpoint-*"))
             if checkpoint_step(p) is not None and os.path.isdir(p)]
    return sorted(found, key=lambda p: (checkpoint_step(p), p))


def set_earlier_run_aside(output_dir: str) -> None:
    """Move the earlier run's checkpoints and `RUN_FILES` into ``output_dir/.earlier-run/``, with a listing."""
    damaged = glob.glob(os.path.join(output_dir, f"{DAMAGED_PREFIX}checkpoint-*"))
    names = [os.path.basename(p) for p in complete_checkpoints(output_dir) + sorted(damaged)] + [
        n for n in RUN_FILES if os.path.lexists(os.path.join(output_dir, n))]
    if not names:
        return
    aside = os.path.join(output_dir, EARLIER_RUN)
    os.makedirs(aside)
    with open(os.path.join(aside, LISTING), "w", encoding="utf-8") as f:  # before any move: `restore_earlier_run`
        json.dump(sorted(set(os.listdir(output_dir)) - {EARLIER_RUN}), f)
    for name in names:
        os.rename(os.path.join(output_dir, name), os.path.join(aside, name))
    _set_aside.add(os.path.abspath(output_dir))
    logger.info("overwrite_output_dir: the earlier run in %s set aside in %s until this run has a checkpoint or "
                "finishes (put back if it fails)", output_dir, EARLIER_RUN)


def restore_earlier_run(output_dir: str) -> None:
    """Put back a set-aside earlier run byte-identical, removing what the new run wrote. Repeatable; main process."""
    aside = os.path.join(output_dir, EARLIER_RUN)
    _set_aside.discard(os.path.abspath(output_dir))
    if not os.path.isdir(aside):
        return
    try:
        before = set(json.loads(Path(aside, LISTING).read_text(encoding="utf-8")))
    except (OSError, ValueError):  # killed while the listing was written: nothing was moved yet
        before = set(os.listdir(output_dir))
    for name in sorted(set(os.listdir(output_dir)) - {EARLIER_RUN}):
        path = os.path.join(output_dir, name)
        if name not in before or os.path.lexists(os.path.join(aside, name)):  # the failed run's
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
    for name in sorted(set(os.listdir(aside)) - {LISTING}):
        os.rename(os.path.join(aside, name), os.path.join(output_dir, name))
    shutil.rmtree(aside)
    logger.warning("put back the earlier run in %s (the run over it stopped before its first checkpoint)", output_dir)


def drop_earlier_run(output_dir: str) -> None:
    """Delete the earlier run set aside in ``output_dir`` (this run has a checkpoint, or has finished). Main process."""
    _set_aside.discard(os.path.abspath(output_dir))
    shutil.rmtree(os.path.join(output_dir, EARLIER_RUN), ignore_errors=True)


def keeps_earlier_run(run):
    """Decorator for a stage's ``run``: a raise (Ctrl-C too) puts the set-aside earlier run back; a return drops it;
    either way the run ends last, however it ends: this process's ``output_dir`` lock released (a refused run's empty
    directories go too), the signal handlers `start_run` replaced put back."""
    @functools.wraps(run)
    def wrapper(*args, **kwargs):
        try:
            result = run(*args, **kwargs)
        except BaseException:
            for out in sorted(_set_aside):
                restore_earlier_run(out)
            raise
        else:
            for out in sorted(_set_aside):
                drop_earlier_run(out)
            return result
        finally:
            while _locks:
                _locks.pop().release()
            release_stop_signals()

    return wrapper


def distributed_state(training_args):
    """The run's `accelerate.PartialState`, or a one-process stand-in. Raises `RecipeError`: no process group."""
    training_args.device  # noqa: B018  (sets up PartialState / the process group, as the trainer does)
    state, launched = getattr(training_args, "distributed_state", None), int(os.environ.get("WORLD_SIZE", "1"))
    if state is not None and launched > 1 and state.num_processes != launched:
        raise RecipeError(f"launched {launched} processes but they did not join one process group (this one sees "
                          f"{state.num_processes}); on a machine without GPUs set `use_cpu: true` in the recipe or "
                          "launch with ACCEL=multi_cpu (ACCELERATE_USE_CPU=true)")
    return state if state is not None else SimpleNamespace(is_main_process=True, num_processes=1,
                                                           wait_for_everyone=lambda: None)


def weights_are_sharded(trainer) -> bool:
    """True when the trainer's model weights are split across processes (DeepSpeed ZeRO-3 or FSDP)."""
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    return bool((plugin is not None and plugin.zero_stage == 3) or getattr(trainer, "is_fsdp_enabled", False))


def save_final_model(trainer, tokenizer, path: str, adapter_dir: str | None, base_path: str, kind: str):
    """Write a stage's ``merged/`` model + tokenizer at ``path``; call on every process. Unsharded: the main process
    merges LoRA and saves. Sharded (ZeRO-3 / FSDP): full-parameter, every process saves into a staging directory
    (DeepSpeed needs ``zero3_save_16bit_model: true``) renamed into place; LoRA, the main process merges ``adapter_dir``
    into ``base_path`` on CPU; either loaded back as ``kind``. Returns the merged model on the main process, or None."""
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
            if os.path.exists(args_file := os.path.join(staging, "training_args.bin")):
                os.remove(args_file)  # Trainer._save's copy of the arguments: not part of a model directory
            if os.path.exists(path):
                shutil.rmtree(path)
            os.rename(staging, path)
    elif main:
        with loading_on_one_process():
            merge_adapter(adapter_dir, path, base=base_path)
    trainer.accelerator.wait_for_everyone()
    if not main:
        return None
    with loading_on_one_process():
        return (load_causal_lm if kind == "causal_lm" else load_sequence_classifier)(path)


@contextmanager
def loading_on_one_process():
    """Load models on this process alone under ZeRO-3 (not inside ``deepspeed.zero.Init``, a collective)."""
    from transformers.integrations import deepspeed as hf_deepspeed

    ref = hf_deepspeed._hf_deepspeed_config_weak_ref  # transformers has no public getter of the config object
    config = ref() if ref is not None else None
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if config is not None:
            hf_deepspeed.set_hf_deepspeed_config(config)


def save_stage_outputs(trainer, tokenizer, model_path: str, kind: str, metrics: dict, report, recipe: Recipe,
                       evaluate=None) -> dict:
    """End of SFT / RM (every process): adapter, merged model; main process: recipe, ``metrics.json`` (+
    ``evaluate(model)``), ``log_history.json``, data report. Returns ``{output_dir, merged, metrics}``."""
    out = recipe.training.output_dir
    adapter = os.path.join(out, "adapter") if recipe.model.use_peft else None
    if adapter:
        trainer.save_model(adapter)
    merged = os.path.join(out, "merged")
    model = save_final_model(trainer, tokenizer, merged, adapter, model_path, kind)  # gathers ZeRO-3 / FSDP shards
    if trainer.is_world_process_zero():
        save_recipe(out, recipe)
        metrics["peak_memory_mb"] = peak_memory_mb()  # training's peak (before evaluate loads another model)
        if evaluate is not None:
            metrics.update(evaluate(model))
        write_json(os.path.join(out, "metrics.json"), metrics)
        write_json(os.path.join(out, "log_history.json"), {"log_history": trainer.state.log_history})
        report.write(out)
    trainer.accelerator.wait_for_everyone()
    return {"output_dir": out, "merged": merged, "metrics": metrics}


# -- damaged checkpoints: a manifest at save time, an intactness check before a resume ---------------------------------
SAFETENSORS_MAX_HEADER = 100_000_000  # bytes; the safetensors library refuses larger headers


def write_manifest(checkpoint_dir: str, config: str | None = None) -> None:
    """Write ``manifest.json``: ``{"format": 1, "files": {relative path: size in bytes}}`` (no hashes: GBs), and
    ``"config"``: the stage's config class (``SFTConfig``, ``PPOConfig``, ...), which a resume must match."""
    files = {rel: os.path.getsize(os.path.join(checkpoint_dir, rel))
             for rel in _relative_files(checkpoint_dir) if rel != MANIFEST}
    with open(os.path.join(checkpoint_dir, MANIFEST), "w", encoding="utf-8") as f:
        json.dump({"format": 1, "files": files, **({"config": config} if config else {})}, f, indent=1)


def checkpoint_problem(path: str) -> str | None:
    """None when the checkpoint ``path`` looks intact, else a short reason naming the first damaged file (headers only;
    never raises). Files: ``manifest.json``'s with their sizes, else a Trainer checkpoint's (``trainer_state.json``,
    optimizer, ``scheduler.pt``, weights, or DeepSpeed's ``global_step*/``); ``*.json`` must parse (``*.index.json``
    shards exist), ``*.safetensors`` match their header, ``*.pt`` / ``*.bin`` be zips (legacy pickles unread)."""
    if not os.path.isdir(path):
        return "is not a directory"
    manifest = os.path.join(path, MANIFEST)
    listed: dict[str, int] = {}
    if os.path.exists(manifest):
        try:
            listed = json.loads(Path(manifest).read_bytes())["files"]
            if not isinstance(listed, dict) or not all(isinstance(v, int) for v in listed.values()):
                raise ValueError("'files' is not a mapping of paths to sizes")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return f"{MANIFEST} cannot be read: {_short(exc)}"
        for rel in sorted(listed):
            if not os.path.isfile(os.path.join(path, rel)):
                return f"{rel} is missing"
    else:
        names = set(os.listdir(path))
        deepspeed = any(n.startswith("global_step") and os.path.isdir(os.path.join(path, n)) for n in names)
        if "trainer_state.json" not in names:
            return "trainer_state.json is missing"
        if not (names & {"optimizer.pt", "optimizer.bin", "optimizer_0"} or deepspeed):
            return "optimizer.pt is missing"
        if "scheduler.pt" not in names and not deepspeed:
            return "scheduler.pt is missing"
        weights = {"model.safetensors", "adapter_model.safetensors", "model.safetensors.index.json",
                   "adapter_model.bin", "pytorch_model.bin", "pytorch_model.bin.index.json"}
        if not (names & weights or deepspeed or any(n.startswith("pytorch_model_fsdp") for n in names)):
            return "model weights are missing (no model.safetensors or adapter_model.safetensors)"
    for rel in _relative_files(path):
        if rel != MANIFEST and (problem := _file_problem(path, rel, listed.get(rel))):
            return problem
    return None


def _relative_files(root: str) -> list[str]:
    """Every file under ``root`` as a ``/``-separated relative path, in sorted walk order."""
    out = []
    for folder, dirs, names in os.walk(root):
        dirs.sort()
        out += [os.path.relpath(os.path.join(folder, n), root).replace(os.sep, "/") for n in sorted(names)]
    return out


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def _file_problem(root: str, rel: str, expected: int | None) -> str | None:
    """What is wrong with the file ``rel`` under ``root`` (``expected``: its size in the manifest, if listed)."""
    full = os.path.join(root, rel)
    try:
        size = os.path.getsize(full)
        if rel.endswith(".json"):  # parsed first: a garbled state file is named as unreadable, whatever its size
            data = json.loads(Path(full).read_bytes())
            if rel.endswith(".index.json") and isinstance(data, dict) and isinstance(data.get("weight_map"), dict):
                for shard in sorted(set(map(str, data["weight_map"].values()))):
                    if not os.path.isfile(os.path.join(os.path.dirname(full), shard)):
                        return f"{os.path.join(os.path.dirname(rel), shard)} is missing (listed in {rel})"
        if expected is not None and size < expected:
            return f"{rel} is truncated ({size} of {expected} bytes)"
        if expected is not None and size != expected:
            return f"{rel} has {size} bytes, {MANIFEST} lists {expected}"
        if rel.endswith(".safetensors"):
            return _safetensors_problem(full, rel, size)
        if rel.endswith((".pt", ".pth", ".bin")):
            return _torch_file_problem(full, rel, size)
    except (OSError, ValueError) as exc:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        return f"{rel} cannot be read: {_short(exc)}"
    return None


def _safetensors_problem(full: str, rel: str, size: int) -> str | None:
    """A ``*.safetensors`` file whose size differs from what its header describes (truncated, or garbage added)."""
    with open(full, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{rel} is truncated ({size} bytes, no complete header)"
        (length,) = struct.unpack("<Q", head)
        if length > SAFETENSORS_MAX_HEADER:
            return f"{rel} cannot be read: header length {length} is not plausible"
        if 8 + length > size:
            return f"{rel} is truncated ({size} bytes, inside its {length}-byte header)"
        header = json.loads(f.read(length))
    if not isinstance(header, dict):
        return f"{rel} cannot be read: its header is not a JSON object"
    end = 0
    header.pop("__metadata__", None)
    for name, entry in header.items():
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            return f"{rel} cannot be read: tensor {name!r} has no valid data_offsets"
        end = max(end, offsets[1])
    expected = 8 + length + end
    if size < expected:
        return f"{rel} is truncated ({size} of {expected} bytes)"
    if size > expected:
        return f"{rel} has {size} bytes, its header describes {expected}"
    return None


def _torch_file_problem(full: str, rel: str, size: int) -> str | None:
    """A ``torch.save`` file (``*.pt`` / ``*.pth`` / ``*.bin``) that is not a readable zip archive."""
    if size == 0:
        return f"{rel} is empty"
    with open(full, "rb") as f:
        magic = f.read(2)
    if magic == b"\x80\x02":  # torch's legacy (pre-1.6) pickle format: no cheap check
        return None
    if magic != b"PK":
        return f"{rel} cannot be read: not a torch file (no zip archive)"
    try:
        zipfile.ZipFile(full).close()  # reading the central directory: what a truncated archive lacks
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        return f"{rel} cannot be read: incomplete zip archive ({_short(exc)})"
    return None


def checkpoint_step(path: str) -> int | None:
    """N of a ``checkpoint-N`` directory path, else None."""
    name = os.path.basename(os.path.normpath(path))
    suffix = name[len("checkpoint-"):]
    return int(suffix) if name.startswith("checkpoint-") and suffix.isdigit() else None


def set_aside_damaged(output_dir: str, resume: str) -> list[str]:
    """Rename damaged ``checkpoint-N`` newer than ``resume`` to ``damaged-checkpoint-N``; returns the new paths."""
    if (step := checkpoint_step(resume)) is None:
        return []
    moved = []
    for path in complete_checkpoints(output_dir):
        if checkpoint_step(path) <= step or (problem := checkpoint_problem(path)) is None:
            continue
        target = os.path.join(output_dir, DAMAGED_PREFIX + os.path.basename(path))
        if os.path.exists(target):
            shutil.rmtree(target)
        os.rename(path, target)
        logger.warning("moved the damaged %s (%s) aside to %s; this run continues from %s", os.path.basename(path),
                       problem, os.path.basename(target), os.path.basename(resume))
        moved.append(target)
    return moved


def resolve_resume(value, output_dir: str) -> str | None:
    """``resume_from_checkpoint`` as a directory or None: ``true`` / ``last``, the newest intact ``checkpoint-N``; a
    path must be intact. Raises `StageInputError`: no checkpoint, none intact, the path missing or damaged."""
    if value is None or str(value).strip().lower() in ("", "false", "no", "0", "none"):
        return None
    if str(value).strip().lower() in ("true", "yes", "1", "last"):
        if not (found := complete_checkpoints(output_dir) if os.path.isdir(output_dir) else []):
            raise StageInputError(f"resume_from_checkpoint=true, but '{output_dir}' holds no checkpoint-N directory")
        damaged = []
        for path in reversed(found):
            if (problem := checkpoint_problem(path)) is None:
                for name, why in damaged:
                    logger.warning("%s is damaged (%s); resuming from %s", name, why, os.path.basename(path))
                return path
            damaged.append((os.path.basename(path), problem))
        name, why = damaged[0]
        raise StageInputError(f"resume_from_checkpoint=true: no intact checkpoint in '{output_dir}' (newest {name}: "
                              f"{why}); start over with `overwrite_output_dir: true` and no resume_from_checkpoint")
    if not os.path.isdir(str(value)):
        raise StageInputError(f"resume_from_checkpoint: checkpoint '{value}' not found")
    if (problem := checkpoint_problem(str(value))) is not None:
        raise StageInputError(f"resume_from_checkpoint: checkpoint '{value}' is damaged ({problem}); resume from "
                              "another checkpoint-N, or with resume_from_checkpoint=true (the newest intact one)")
    return str(value)

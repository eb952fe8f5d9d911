"""Running one command from the command line (`rlhf_trl.cli`, ``python -m rlhf_trl.<stage>``): the registry of
commands (`COMMANDS`), logging, one-line errors and exit statuses, printed summaries. Stage modules are imported by
name only when run: no import cycle."""

from __future__ import annotations

import functools
import importlib
import logging
import os
import shlex
import sys
import warnings
from typing import NamedTuple, NoReturn


class Command(NamedTuple):
    """One ``rlhf-trl`` command: ``help`` (its line of ``rlhf-trl --help``); for a recipe-driven stage, its recipe's
    ``training`` config and ``script`` arguments (if any) as ``"module:Class"`` (`recipe_types`), run by its module's
    ``run(recipe, callbacks)`` (`run_recipe`), else by the module's ``main(argv)``; ``module``: `rlhf_trl.<module>`,
    imported when run (None: the command's name)."""

    help: str
    training: str | None = None
    script: str | None = None
    module: str | None = None


COMMANDS = {
    "sft": Command("supervised fine-tuning (trl.SFTTrainer)", "trl:SFTConfig"),
    "rm": Command("reward model on chosen/rejected pairs (trl.RewardTrainer)", "trl:RewardConfig"),
    "ppo": Command("PPO against the reward model and/or reward functions (the project's engine, rlhf_trl.ppo_engine)",
                   "rlhf_trl.ppo_config:PPOConfig", "rlhf_trl.ppo_config:PPOScriptArguments"),
    "dpo": Command("stage 3 on preference pairs, no reward model (trl.DPOTrainer)", "trl:DPOConfig"),
    "grpo": Command("stage 3 without a value model: group-relative advantages (trl.GRPOTrainer), PPO's rewards",
                    "trl:GRPOConfig", "rlhf_trl.grpo:GroupRewardArguments"),
    "rloo": Command("stage 3 without a value model: leave-one-out advantages (trl.RLOOTrainer), PPO's rewards",
                    "trl:RLOOConfig", "rlhf_trl.grpo:GroupRewardArguments", module="grpo"),
    "kto": Command("stage 3 on answers labelled desirable / undesirable (or unpaired preference pairs), no reward "
                   "model (trl.KTOTrainer)", "trl:KTOConfig"),
    "demo": Command("build the embedded demo and run SFT -> RM -> PPO on it"),
    "launch": Command("a stage on several processes: --config_file ACCEL.yaml --num_processes N <stage> ... "
                      "(make ACCEL=)"),
    "init-model": Command("build a random-init tiny Qwen2 with a tokenizer's vocabulary (offline smoke runs)",
                          module="tiny"),
    # merge / evaluate / report
    "merge": Command("merge a LoRA adapter into its base: --adapter DIR --output DIR [--base DIR]"),
    "eval": Command("compare the PPO policy with its SFT policy (rewards, win rate, KL), write eval.json + report.md",
                    module="evaluate"),
    "compare": Command("stage-3 policies side by side (--policies sft=DIR ppo=DIR dpo=DIR ...): RM reward with 95% CI, "
                       "win rate, KL, cost; compare.json + compare.md"),
}


def recipe_types(command: str) -> tuple:
    """The dataclasses a ``command`` recipe fills, in recipe order (imported now): `DataArguments`, the script
    arguments (if any), the training config, TRL's `ModelConfig`, `RunArguments`."""
    spec = COMMANDS[command]
    names = "rlhf_trl.data:DataArguments", spec.script, spec.training, "trl:ModelConfig", "rlhf_trl.config:RunArguments"
    return tuple(getattr(importlib.import_module(m), cls) for m, cls in (name.split(":") for name in names if name))


def run_recipe(command: str, argv: list[str] | None = None, callbacks: list | None = None) -> dict:
    """Every recipe-driven stage's ``main``: ``argv`` (else ``sys.argv``) parsed into a `config.Recipe`, then the
    stage module's ``run(recipe, callbacks)`` and its result. Raises `RecipeError`: a bad recipe; else as ``run``."""
    from .config import parse_recipe

    recipe = parse_recipe(recipe_types(command), argv, command)
    return importlib.import_module(f"rlhf_trl.{COMMANDS[command].module or command}").run(recipe, callbacks)


def entry_points(command: str) -> tuple:
    """A recipe-driven stage module's ``main(argv=None, callbacks=None)`` (`run_recipe`) and ``recipe_types()``."""
    return functools.partial(run_recipe, command), functools.partial(recipe_types, command)


def stage_main(command: str):
    """A command's ``main(argv)``, its module imported now: a recipe-driven stage's `run_recipe`, else its ``main``."""
    module = importlib.import_module(f"rlhf_trl.{COMMANDS[command].module or command}")
    return functools.partial(run_recipe, command) if COMMANDS[command].training else module.main


def quiet_libraries() -> None:
    """Silence bitsandbytes' import-time WARNINGs (AVX512-BF16 CPUs, offline `kernels`): harmless, it falls back; and
    the libraries' deprecation notices (FutureWarning): not for users."""
    logging.getLogger("kernels").setLevel(logging.ERROR)
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(lambda r: "kernels-community" not in r.getMessage())
    warnings.filterwarnings("ignore", category=FutureWarning)


def log_to_stderr() -> None:
    """The command line's logs: INFO from rlhf_trl (and the trainers) on the main process, warnings from the rest."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S", level="WARNING")
    logging.getLogger("rlhf_trl").setLevel(logging.INFO if is_main_rank() else logging.WARNING)


def is_main_rank() -> bool:
    """False in the non-main processes of an ``accelerate launch`` / torchrun launch (``RANK`` > 0)."""
    return int(os.environ.get("RANK", "0") or 0) == 0


def one_line(exc: BaseException) -> str:
    """The exception's message on one line (bad input errors never print a traceback; RLHF_TRL_DEBUG=1 does)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def run_stage(stage: str, argv: list[str] | None = None) -> int:
    """Run one stage's ``main(argv)``. Exit status 2: bad input (one line on stderr, progress bars closed first); 3: a
    diverged PPO run; 4: a refused checkpoint write (`atomic.CheckpointWriteError`) or an unwritable ``output_dir``
    (`run_dir.OutputDirError`); a busy ``output_dir`` (`run_dir.RunBusyError`) is bad input (2); 143 / 130: stopped
    by SIGTERM / SIGINT (`run_dir.StoppedBySignal`), one line naming the checkpoint written. ``RLHF_TRL_DEBUG=1`` re-raises."""
    quiet_libraries()  # before any import of bitsandbytes (through transformers / peft)
    from .atomic import CheckpointWriteError
    from .config import RecipeError
    from .data import DataError
    from .models import StageInputError
    from .rewards import RewardFunctionError
    from .run_dir import OutputDirError, RunBusyError, StoppedBySignal

    diverged = (importlib.import_module("rlhf_trl.ppo_engine").TrainingDivergedError,) if stage == "ppo" else ()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    log_to_stderr()
    import transformers

    transformers.utils.logging.set_verbosity_warning()
    main = stage_main(stage)
    user_errors = (RecipeError, DataError, StageInputError, ValueError, FileNotFoundError, RewardFunctionError,
                   CheckpointWriteError, OutputDirError, RunBusyError)
    try:
        result = main(sys.argv[1:] if argv is None else argv)
    except BaseException as exc:
        from tqdm import tqdm

        for bar in list(getattr(tqdm, "_instances", ())):  # a trainer's stays open when training raises
            bar.close()  # ends its line
        if isinstance(exc, StoppedBySignal):
            if is_main_rank():
                print(f"rlhf-trl {stage}: {exc}{resume_hint(stage, argv, exc)}", file=sys.stderr)
            sys.exit(exc.exit_code)
        if isinstance(exc, user_errors) and not os.environ.get("RLHF_TRL_DEBUG"):
            if is_main_rank():  # every process meets the same bad input: the user reads it once
                print(f"rlhf-trl {stage}: error: {one_line(exc)}", file=sys.stderr)
            sys.exit(4 if isinstance(exc, (CheckpointWriteError, OutputDirError)) else 2)
        if isinstance(exc, diverged):
            print(f"rlhf-trl {stage}: training stopped: {exc}", file=sys.stderr)
            sys.exit(3)
        raise
    launched = end_process_group()
    if not is_main_rank():
        leave_launched_process(0)
    if stage == "demo" and "summary" in result:
        print_demo_summary(result["summary"], os.path.join(result["output_dir"], "summary.json"))
    else:
        metrics = result.get("metrics", {}) if isinstance(result, dict) else {}
        summary = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not k.endswith("_runtime")}
        for key in sorted(summary)[:30]:
            print(f"  {key}: {summary[key]:.4g}" if isinstance(summary[key], float) else f"  {key}: {summary[key]}")
    if line := outputs_line(stage, result):
        print(line)
    if launched:
        leave_launched_process(0)
    return 0


def outputs_line(stage: str, result) -> str | None:
    """The last line of a successful command: where its outputs are, and what is there (hidden files aside)."""
    out = result.get("output_dir") if isinstance(result, dict) else None
    if not out or not os.path.isdir(out):
        return None
    names = sorted(n + ("/" if os.path.isdir(os.path.join(out, n)) else "") for n in os.listdir(out)
                   if not n.startswith("."))
    shown = ", ".join(names[:12]) + (f", ... ({len(names)} in all)" if len(names) > 12 else "")
    return f"rlhf-trl {stage}: done; outputs in {out}: {shown}"


def resume_hint(stage: str, argv: list[str] | None, stop) -> str:
    """``; resume with make <stage> RECIPE=... resume_from_checkpoint=true`` for a run stopped with a checkpoint (with
    overrides on the command line: the same ``rlhf-trl`` command plus ``--resume_from_checkpoint true``)."""
    if stop.checkpoint is None:
        return ""
    if stage == "demo":  # several stages in one command: it has no resume of its own
        return f"; `make {stage}` starts it over"
    argv = list(sys.argv[1:] if argv is None else argv)
    at = argv.index("--config") if "--config" in argv[:-1] else None
    rest = argv[:at] + argv[at + 2:] if at is not None else argv
    if rest:  # overrides (an output_dir of its own...): the same command again
        return f"; resume with `rlhf-trl {stage} {shlex.join(argv)} --resume_from_checkpoint true`"
    command = f"make {stage} RECIPE={argv[at + 1]}" if at is not None else f"make {stage}"
    return f"; resume with `{command} resume_from_checkpoint=true` (or --resume_from_checkpoint true)"


def end_process_group() -> bool:
    """Destroy the process group of an ``accelerate launch`` once done, after a barrier: no process tears its
    connections down while another still uses them. True when there was one (this process is one of a launch); a
    no-op in one process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    dist.barrier()
    dist.destroy_process_group()
    return True


def leave_launched_process(code: int) -> NoReturn:
    """End a process of a launch that has done its work: logs and streams flushed, ``atexit`` callbacks run (trackers
    finish), then ``os._exit(code)``, skipping interpreter finalization. Why: DeepSpeed's engines keep their gloo
    groups alive past ``destroy_process_group``; a group's worker thread may still release a finished collective's
    tensors while the interpreter finalizes, cannot take the GIL and aborts the finished process ("terminate called
    without an active exception", exit -6: 1 run in 10 under ZeRO-3 here, the launcher then reports a failure)."""
    import atexit

    logging.shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def print_demo_summary(summary: dict, path: str) -> None:
    t, methods = summary["targets"], summary.get("methods", ["ppo"])
    rows = [("rm_accuracy (held-out topics)", summary["rm_accuracy"], ""),
            ("  rejected: on-topic negative", summary["rm_accuracy_vs_negative"], f">= {t['rm_accuracy_vs_negative']}"),
            ("  rejected: praise of another topic", summary["rm_accuracy_vs_off_topic"], "(reported, no target)"),
            ("rm length-only baseline", summary["rm_length_baseline_accuracy"], ""),
            ("sft_score (ground truth, [-1, 1])", summary["sft_score"], ""),
            *((f"{m}_score (ground truth, [-1, 1])", summary[f"{m}_score"], f">= sft_score + {t['ppo_minus_sft']}")
              for m in methods),
            ("sft_on_topic_rate ([0, 1])", summary["sft_on_topic_rate"], ""),
            *((f"{m}_on_topic_rate ([0, 1])", summary[f"{m}_on_topic_rate"], f">= {t['ppo_on_topic_rate']}")
              for m in methods),
            *((f"{m} seconds (training stage)", summary["stage_seconds"][m], "(reported, not gated)") for m in methods),
            ("seconds (whole demo)", summary["seconds"], "(reported, not gated)")]
    print("\nrlhf-trl demo summary (topics held out of the RM data and PPO prompts; the eval report uses the recipes' "
          "own splits)")
    for name, value, target in rows:
        print(f"  {name:36s} {value:8.3f}  {target}")
    for name in ("sft", *methods):
        ex = summary["examples"][name][0]
        print(f"  {name} sample: {ex['prompt']} -> {ex['response']}")
    print(f"  targets met: {summary['targets_met']}\n  written to {path}")
    if summary.get("report"):
        print(f"  report ({' vs '.join(m.upper() for m in ('sft', *methods))}): {summary['report']}")


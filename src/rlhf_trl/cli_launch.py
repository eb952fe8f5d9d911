"""Running one stage from the command line (`rlhf_trl.cli`, ``python -m rlhf_trl.<stage>``): logging, one-line errors
and exit statuses, printed summaries. Stage modules are imported by name only when run: no import cycle."""

from __future__ import annotations

import functools
import importlib
import logging
import os
import sys
import warnings

MODULES = {"init-model": "tiny", "eval": "evaluate", "demo-real": "demo_real", "rloo": "grpo"}


def stage_main(stage: str):
    """A command's ``main(argv)``, its module imported now (`MODULES`; ``rloo``: `rlhf_trl.grpo`, ``method="rloo"``)."""
    module = importlib.import_module(f"rlhf_trl.{MODULES.get(stage, stage)}")
    return functools.partial(module.main, method="rloo") if stage == "rloo" else module.main


def quiet_libraries() -> None:
    """Silence bitsandbytes' import-time WARNINGs (AVX512-BF16 CPUs, offline `kernels`): harmless, it falls back."""
    logging.getLogger("kernels").setLevel(logging.ERROR)
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(lambda r: "kernels-community" not in r.getMessage())


def is_main_rank() -> bool:
    """False in the non-main processes of an ``accelerate launch`` / torchrun launch (``RANK`` > 0)."""
    return int(os.environ.get("RANK", "0") or 0) == 0


def one_line(exc: BaseException) -> str:
    """The exception's message on one line (bad input errors never print a traceback; RLHF_TRL_DEBUG=1 does)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def run_stage(stage: str, argv: list[str] | None = None) -> int:
    """Run one stage's ``main(argv)``. Exit status 2: bad input (one line on stderr, progress bars closed first); 3: a
    diverged PPO run; 4: a refused checkpoint write (`faults.CheckpointWriteError`). ``RLHF_TRL_DEBUG=1`` re-raises."""
    quiet_libraries()  # before any import of bitsandbytes (through transformers / peft)
    from .config import RecipeError
    from .data import DataError
    from .faults import CheckpointWriteError
    from .models import StageInputError
    from .rewards import RewardFunctionError

    diverged = (importlib.import_module("rlhf_trl.ppo_engine").TrainingDivergedError,) if stage == "ppo" else ()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=FutureWarning)  # library deprecation notices are not for users
    # logs: INFO from rlhf_trl and the trainers, warnings from the rest
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S",
                        level=logging.WARNING)
    logging.getLogger("rlhf_trl").setLevel(logging.INFO if is_main_rank() else logging.WARNING)
    import transformers

    transformers.utils.logging.set_verbosity_warning()
    main = stage_main(stage)
    user_errors = (RecipeError, DataError, StageInputError, ValueError, FileNotFoundError, RewardFunctionError,
                   CheckpointWriteError)
    try:
        result = main(sys.argv[1:] if argv is None else argv)
    except BaseException as exc:
        from tqdm import tqdm

        for bar in list(getattr(tqdm, "_instances", ())):  # a trainer's stays open when training raises
            bar.close()  # ends its line
        if isinstance(exc, user_errors) and not os.environ.get("RLHF_TRL_DEBUG"):
            print(f"rlhf-trl {stage}: error: {one_line(exc)}", file=sys.stderr)
            sys.exit(4 if isinstance(exc, CheckpointWriteError) else 2)
        if isinstance(exc, diverged):
            print(f"rlhf-trl {stage}: training stopped: {exc}", file=sys.stderr)
            sys.exit(3)
        raise
    end_process_group()
    if stage == "demo" and "summary" in result:
        print_demo_summary(result["summary"], os.path.join(result["output_dir"], "summary.json"))
        return 0
    if stage == "demo-real":
        print_real_summary(result["real_summary"], os.path.join(result["output_dir"], "summary.json"))
        return 0
    if not is_main_rank():
        return 0
    metrics = result.get("metrics", {}) if isinstance(result, dict) else {}
    summary = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not k.endswith("_runtime")}
    if summary:
        print(f"rlhf-trl {stage}: done -> {result.get('output_dir')}")
        for key in sorted(summary)[:30]:
            print(f"  {key}: {summary[key]:.4g}" if isinstance(summary[key], float) else f"  {key}: {summary[key]}")
    return 0


def end_process_group() -> None:
    """Destroy the process group of an ``accelerate launch`` once done (alive at exit, gloo's threads can abort a
    finished process: the launcher reports a failure). A no-op in one process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def print_demo_summary(summary: dict, path: str) -> None:
    t, methods = summary["targets"], summary.get("methods", ["ppo"])
    rows = [
        ("rm_accuracy (held-out topics)", summary["rm_accuracy"], ""),
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
        ("seconds (whole demo)", summary["seconds"], "(reported, not gated)"),
    ]
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


def print_real_summary(summary: dict, path: str) -> None:
    print(f"\nrlhf-trl demo-real summary ({summary['model']}; CPU smoke runs: figures, not targets)")
    for stage, sec in summary["stage_seconds"].items():
        print(f"  {stage + ' seconds':36s} {sec:8.1f}")
    for key in ("rm_accuracy", "rm_length_baseline_accuracy", "sft_eval_loss", "sft_reward", "ppo_reward", "win_rate",
                "kl_per_token", "sft_eos_rate", "ppo_eos_rate", "sft_mean_length", "ppo_mean_length"):
        if isinstance(summary.get(key), (int, float)):
            print(f"  {key:36s} {summary[key]:8.3f}")
    for ex in summary["examples"][:2]:
        print(f"  question: {ex['question'][:60]}\n    sft: {ex['sft'][:80]}\n    ppo: {ex['ppo'][:80]}")
    print(f"  written to {path}\n  report (SFT vs PPO, training curves): {summary['report']}")

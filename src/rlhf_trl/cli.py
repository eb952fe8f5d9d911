"""Command line: ``rlhf-trl {sft,rm,ppo,demo,...} --config recipe.yaml [--key value ...]``."""

from __future__ import annotations

import os
import sys

from .cli_launch import one_line, run_stage

STAGES = {
    "sft": "supervised fine-tuning (trl.SFTTrainer)",
    "rm": "reward model on chosen/rejected pairs (trl.RewardTrainer)",
    "ppo": "PPO against the reward model and/or reward functions (the project's engine, rlhf_trl.ppo_engine)",
    "dpo": "stage 3 on preference pairs, no reward model (trl.DPOTrainer)",
    "grpo": "stage 3 without a value model: group-relative advantages (trl.GRPOTrainer), PPO's rewards",
    "rloo": "stage 3 without a value model: leave-one-out advantages (trl.RLOOTrainer), PPO's rewards",
    "kto": "stage 3 on answers labelled desirable / undesirable (or unpaired preference pairs), no reward model "
           "(trl.KTOTrainer)",
    "demo": "build the embedded demo and run SFT -> RM -> PPO on it",
    "demo-real": "SFT -> RM -> PPO -> eval on a real Qwen2.5 Instruct directory (--model DIR), sized for a CPU",
    "launch": "a stage on several processes: --config_file ACCEL.yaml --num_processes N <stage> ... (make ACCEL=)",
    "init-model": "build a random-init tiny Qwen2 with a tokenizer's vocabulary (offline smoke runs)",
    # merge / evaluate / report
    "merge": "merge a LoRA adapter into its base: --adapter DIR --output DIR [--base DIR]",
    "eval": "compare the PPO policy with its SFT policy (rewards, win rate, KL), write eval.json + report.md",
    "compare": "stage-3 policies side by side (--policies sft=DIR ppo=DIR dpo=DIR ...): RM reward with 95% CI, win "
               "rate, KL, cost; compare.json + compare.md",
}

USAGE = "usage: rlhf-trl {" + ",".join(STAGES) + "} --config RECIPE.yaml [--key value ...] | --version\n\n" + "\n".join(
    f"  {name:10s} {text}" for name, text in STAGES.items())


def version_line() -> str:
    """``rlhf-trl X (trl Y, transformers Z, torch W, python V)``: the installed versions a bug report needs."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    def of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    libs = ", ".join(f"{n} {of(n)}" for n in ("trl", "transformers", "peft", "accelerate", "datasets", "torch"))
    return f"rlhf-trl {of('rlhf_trl')} ({libs}, python {platform.python_version()})"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(version_line())
        return 0
    stage, rest = argv[0], argv[1:]
    if stage == "launch":
        from .launch import LaunchRefused, main as launch

        try:
            return launch(rest)
        except LaunchRefused as exc:
            if os.environ.get("RLHF_TRL_DEBUG"):
                raise
            print(f"rlhf-trl {exc.stage}: error: {one_line(exc)}", file=sys.stderr)
            return 2
    if stage not in STAGES:
        print(f"rlhf-trl: error: unknown command '{stage}'\n\n{USAGE}", file=sys.stderr)
        return 2
    return run_stage(stage, rest)


if __name__ == "__main__":
    sys.exit(main())

"""Command line: ``rlhf-trl {sft,rm,ppo,demo} --config recipe.yaml [--key value ...]``.

The command puts PyTorch's large CPU tensors (>= 2 MB) on transparent huge pages (``THP_MEM_ALLOC_ENABLE=1``, read
by PyTorch once, at its first allocation: so here, before anything imports torch). Every fresh activation or gradient
tensor is then faulted in 2 MB at a time instead of 4 KB: a PPO update on the real 0.5B model at 8 x 320 tokens took
297 -> 245-279 s (four runs) with the same peak RSS (benchmarks/HISTORY.md). Numerics are unchanged (it is where
memory comes from, not how it is used). ``THP_MEM_ALLOC_ENABLE=0`` in the environment turns it off; a no-op where
the kernel's THP setting is ``never``.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # before torch's first allocation (see the docstring)

from .cli_launch import one_line, run_stage  # noqa: E402, F401  (importable from here too)

STAGES = {
    "sft": "supervised fine-tuning (trl.SFTTrainer)",
    "rm": "reward model on chosen/rejected pairs (trl.RewardTrainer)",
    "ppo": "PPO against the reward model and/or reward functions (the project's engine, rlhf_trl.ppo_engine)",
    "demo": "build the embedded demo and run SFT -> RM -> PPO on it",
    "demo-real": "SFT -> RM -> PPO -> eval on a real Qwen2.5 Instruct directory (--model DIR), sized for a CPU",
    "init-model": "build a random-init tiny Qwen2 with a tokenizer's vocabulary (offline smoke runs)",
    # merge / evaluate / report
    "merge": "merge a LoRA adapter into its base: --adapter DIR --output DIR [--base DIR]",
    "eval": "compare the PPO policy with its SFT policy (rewards, win rate, KL), write eval.json + report.md",
}

USAGE = "usage: rlhf-trl {" + ",".join(STAGES) + "} --config RECIPE.yaml [--key value ...]\n\n" + "\n".join(
    f"  {name:5s} {text}" for name, text in STAGES.items()
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    stage, rest = argv[0], argv[1:]
    if stage not in STAGES:
        print(f"rlhf-trl: error: unknown command '{stage}'\n\n{USAGE}", file=sys.stderr)
        return 2
    return run_stage(stage, rest)


if __name__ == "__main__":
    sys.exit(main())

"""Real weights end to end: ``make demo-real`` (or ``rlhf-trl demo-real --model DIR``).
Runs ``recipes/qwen2.5-0.5b-cpu/{sft,rm,ppo}.yaml`` on a stock Qwen2 / Qwen2.5 Instruct directory (``make
real-model``), then ``rlhf-trl eval``, and writes ``<output_dir>/summary.json``: each stage's wall time (seconds) and
the figures of ``eval.json`` with side-by-side samples. CPU-scale smoke runs: figures, no targets."""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

from .models import require_model_dir, write_json

logger = logging.getLogger(__name__)

QUALITY_KEYS = ["rm_accuracy", "rm_length_baseline_accuracy", "rm_num_pairs", "sft_reward", "ppo_reward", "win_rate",
                "kl_per_token", "sft_eos_rate", "ppo_eos_rate", "sft_mean_length", "ppo_mean_length"]


def run(model_dir: str, recipes_dir: str = "recipes/qwen2.5-0.5b-cpu", output_dir: str = "outputs/qwen2.5-0.5b-cpu",
        eval_prompts: int = 16) -> dict:
    """SFT -> RM -> PPO -> eval (``eval_prompts`` held-out prompts) on ``model_dir``; returns the summary, also written
    to ``summary.json``. Raises `StageInputError`: ``model_dir`` is not a model directory; stage errors."""
    from . import evaluate, ppo, rm, sft

    require_model_dir(model_dir, "base model", "make real-model")
    seconds: dict[str, float] = {}
    argv = {"sft": ["--model_name_or_path", model_dir, "--output_dir", f"{output_dir}/sft"],
            "rm": ["--model_name_or_path", f"{output_dir}/sft/merged", "--output_dir", f"{output_dir}/rm"],
            "ppo": ["--sft_model_path", f"{output_dir}/sft/merged", "--reward_model_path", f"{output_dir}/rm/merged",
                    "--output_dir", f"{output_dir}/ppo"]}
    results = {}
    for name, module in (("sft", sft), ("rm", rm), ("ppo", ppo)):
        t0 = time.time()
        results[name] = module.main(["--config", os.path.join(recipes_dir, f"{name}.yaml"), *argv[name]])
        seconds[name] = round(time.time() - t0, 1)
        logger.info("demo-real: %s done in %.0f s", name, seconds[name])
    t0, trainer = time.time(), results["ppo"].get("trainer")
    evaluation = evaluate.main(["--config", os.path.join(recipes_dir, "ppo.yaml"), *argv["ppo"], "--num_prompts",
                                str(eval_prompts), "--samples_per_prompt", "1"],
                               ppo_logs=trainer.state.log_history if trainer is not None else None)
    seconds["eval"] = round(time.time() - t0, 1)
    samples = [json.loads(line) for line in open(evaluation["samples"], encoding="utf-8")][:3]
    summary = {"model": model_dir, "stage_seconds": seconds, "seconds": round(sum(seconds.values()), 1),
               **{k: evaluation[k] for k in QUALITY_KEYS if k in evaluation},
               "sft_eval_loss": results["sft"]["metrics"].get("eval_loss"),
               "examples": [{"question": s["question"], "sft": s["sft"]["text"], "ppo": s["ppo"]["text"]}
                            for s in samples], "report": evaluation["report"]}
    write_json(os.path.join(output_dir, "summary.json"), summary)
    return summary


def main(argv: list[str] | None = None) -> dict:
    """``rlhf-trl demo-real --model DIR [--recipes DIR] [--output_dir DIR] [--eval_prompts N]``."""
    p = argparse.ArgumentParser(prog="rlhf-trl demo-real", description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True, help="a stock Qwen2 / Qwen2.5 Instruct directory (make real-model)")
    p.add_argument("--recipes", default="recipes/qwen2.5-0.5b-cpu", help="directory with sft.yaml, rm.yaml, ppo.yaml")
    p.add_argument("--output_dir", default="outputs/qwen2.5-0.5b-cpu", help="where the stages write")
    p.add_argument("--eval_prompts", type=int, default=16, help="held-out prompts for the SFT vs PPO evaluation")
    args = p.parse_args(argv)
    summary = run(args.model, args.recipes, args.output_dir, args.eval_prompts)
    return {"output_dir": args.output_dir, "real_summary": summary}

"""The embedded demo: build a tiny Qwen2 and a generated Chinese preference task, then run SFT -> RM -> PPO.

Run: ``make demo`` (or ``rlhf-trl demo``). Offline; about 3-5 minutes on 2 CPU cores. ``make demo-compare``
(``rlhf-trl demo --compare``): SFT -> RM -> {PPO, PPO with a value head, PPO-ptx, DPO, GRPO, KTO}, compared in
``outputs/demo/compare/compare.md``.
1. Assets, cached in ``outputs/demo/assets``: task data (`rlhf_trl.demo_task`), a byte-level BPE tokenizer (Qwen-style
   special tokens, a distinct pad token) and a random-init tiny Qwen2 model.
2. The stages with ``recipes/demo/{sft,rm,ppo}.yaml``, in this process.
3. Evaluation on held-out topics (not in the RM data or PPO prompts; the SFT data has all: a tiny model cannot name a
   topic token it never saw) into ``outputs/demo/summary.json``: ``rm_accuracy`` on held-out pairs (``_vs_negative`` /
   ``_vs_off_topic``: rejected answer on-topic negative / other-topic praise), ``sft_score`` / ``ppo_score`` (mean
   ground truth of sampled responses, in [-1, 1]), ``sft_on_topic_rate`` / ``ppo_on_topic_rate`` (in [0, 1])."""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

import torch
import yaml
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from . import compare, demo_task, evaluate
from .atomic import write_json, write_jsonl, write_text
from .data import DEFAULT_PROMPT_TEMPLATE, DataArguments, Template, encode_prompt, pair_features, pair_records
from .models import eos_token_ids, load_tokenizer
from .scoring import sample
from .tiny import build_tiny_qwen2, train_bpe_tokenizer

logger = logging.getLogger(__name__)

# CI gates these (with --compare: each stage-3 method); the RM's accuracy vs off-topic praise and wall time: reported
TARGETS = {"rm_accuracy_vs_negative": 0.95, "ppo_minus_sft": 0.25, "ppo_on_topic_rate": 0.8}


def build_assets(assets_dir: str, force: bool = False) -> dict:
    """Write the demo data, tokenizer and base model under ``assets_dir`` unless already built; returns their paths."""
    names = {"sft": "sft.jsonl", "rm": "rm_ranked.jsonl", "prompts": "prompts.jsonl",
             "heldout_prompts": "heldout_prompts.jsonl", "heldout_pairs": "heldout_pairs.jsonl",
             "tokenizer": "tokenizer", "base_model": "base_model"}
    paths = {key: os.path.join(assets_dir, name) for key, name in names.items()}
    if os.path.exists(done := os.path.join(assets_dir, "DONE")) and not force:
        return paths
    files = {"sft": demo_task.sft_rows(800, seed=1, topics=demo_task.TOPICS),  # every topic: the policy must name them
             "rm": demo_task.ranked_rows(300, seed=2), "prompts": demo_task.prompt_rows(demo_task.TRAIN_TOPICS, seed=3),
             "heldout_prompts": demo_task.prompt_rows(demo_task.HELDOUT_TOPICS, seed=4),
             "heldout_pairs": demo_task.pair_rows(200, seed=5)}
    for key, rows in files.items():
        write_jsonl(paths[key], rows)
    tokenizer = train_bpe_tokenizer(demo_task.corpus(), paths["tokenizer"], vocab_size=600)
    build_tiny_qwen2(tokenizer, paths["base_model"], hidden_size=128, num_layers=2, num_heads=4)
    write_text(done, "ok\n")
    logger.info("demo assets built in %s", assets_dir)
    return paths


@torch.no_grad()
def sample_responses(model_dir: str, questions: list[str], samples_per_prompt: int, max_new_tokens: int,
                     temperature: float, seed: int) -> list[str]:
    """``model_dir``'s responses (`rlhf_trl.scoring.sample`, as PPO's) to ``samples_per_prompt`` x each question."""
    tok = load_tokenizer(model_dir, padding_side="left")
    model, template = AutoModelForCausalLM.from_pretrained(model_dir).eval(), Template(DEFAULT_PROMPT_TEMPLATE)
    prompts = [encode_prompt(tok, template, q) for q in questions for _ in range(samples_per_prompt)]
    out = sample(model, prompts, tok.pad_token_id, eos_token_ids(tok, model_dir), max_new_tokens, temperature, seed,
                 batch_size=len(prompts))
    return tok.batch_decode([ids for ids, _ in out], skip_special_tokens=True)


# stage-3 variants of demo-compare: the stage whose recipe they run, with these overrides (assets, output_dir)
VARIANTS = {
    "ppo-value-head": lambda assets, out: ("ppo", ["--value_head", "true", "--output_dir", f"{out}/ppo-value-head"]),
    "ppo-ptx": lambda assets, out: ("ppo", ["--ptx_dataset", assets["sft"], "--ptx_coef", "0.1", "--output_dir",
                                            f"{out}/ppo-ptx"])}


def run_demo(recipes_dir: str = "recipes/demo", output_dir: str = "outputs/demo", rebuild: bool = False,
             methods: tuple[str, ...] = ("ppo",)) -> dict:
    """Build the assets, run SFT, RM and ``methods`` (``ppo``, ``dpo``, ``grpo``, ``rloo``, ``kto``; recipes in
    ``recipes_dir``; or a `VARIANTS` name: PPO with a value head on the policy, PPO-ptx) and evaluate; returns the
    summary (``summary.json``; several methods: ``compare/summary.json``, with compare's)."""
    from .cli_launch import stage_main
    from .rm import evaluate_pairs

    start, stage_seconds, results = time.time(), {}, {}
    paths = build_assets(os.path.join(output_dir, "assets"), force=rebuild)
    for name in ("sft", "rm", *methods):
        t0 = time.time()
        stage, extra = VARIANTS[name](paths, output_dir) if name in VARIANTS else (name, [])
        results[name] = stage_main(stage)(["--config", os.path.join(recipes_dir, f"{stage}.yaml"), *extra])
        stage_seconds[name] = round(time.time() - t0, 1)
        logger.info("demo: %s done in %.0f s", name, stage_seconds[name])

    # RM accuracy on held-out pairs (topics never seen in training)
    rm_dir = results["rm"]["merged"]
    tok, reward_model = load_tokenizer(rm_dir), AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    pair_rows = [json.loads(line) for line in open(paths["heldout_pairs"], encoding="utf-8")]
    # demo_task.pair_rows alternates the rejected answer: on-topic negative (even rows), praise of another topic (odd)
    rm_eval, rm_negative, rm_off_topic = (
        evaluate_pairs(reward_model, pair_features(pair_records(rows, DataArguments(), paths["heldout_pairs"]), tok,
                                                   Template()), tok.pad_token_id)
        for rows in (pair_rows, pair_rows[0::2], pair_rows[1::2]))

    # ground-truth scores of samples from each policy on held-out prompts
    with open(os.path.join(recipes_dir, "ppo.yaml"), encoding="utf-8") as f:
        ppo_cfg = yaml.safe_load(f) or {}
    questions = [json.loads(line)["instruction"] for line in open(paths["heldout_prompts"], encoding="utf-8")]
    figures, examples = {}, {}
    for name in ("sft", *methods):
        responses = sample_responses(results[name]["merged"], questions, samples_per_prompt=4,
                                     max_new_tokens=int(ppo_cfg.get("response_length", 24)),
                                     temperature=float(ppo_cfg.get("temperature", 0.7)), seed=1234)
        asked = [q for q in questions for _ in range(4)]
        figures[f"{name}_score"] = sum(map(demo_task.score_response, asked, responses)) / len(responses)
        figures[f"{name}_on_topic_rate"] = sum(map(demo_task.on_topic, asked, responses)) / len(responses)
        examples[name] = [{"prompt": q, "response": r} for q, r in zip(questions, responses[::4])][:5]

    summary = {"rm_accuracy": rm_eval["accuracy"], "rm_accuracy_vs_negative": rm_negative["accuracy"],
               "rm_accuracy_vs_off_topic": rm_off_topic["accuracy"], "rm_margin": rm_eval["margin"],
               "rm_length_baseline_accuracy": rm_eval["length_baseline_accuracy"], "rm_num_pairs": rm_eval["num_pairs"],
               "methods": list(methods), "stage_seconds": stage_seconds, "targets": TARGETS, "examples": examples,
               **figures}
    # merge / evaluate / report: SFT vs PPO (eval.json + report.md), or every method (compare.json + compare.md)
    if methods == ("ppo",):
        summary["report"] = evaluate.main(["--config", os.path.join(recipes_dir, "ppo.yaml"), "--demo"],
                                          ppo_logs=results["ppo"]["trainer"].state.log_history)["report"]
    else:
        policies = [f"{name}={os.path.dirname(results[name]['merged'])}" for name in ("sft", *methods)]
        summary["compare"] = compare.main(["--config", os.path.join(recipes_dir, "ppo.yaml"), "--demo",
                                           "--policies", *policies])["metrics"]
        summary["report"] = os.path.join(output_dir, "compare", "compare.md")
    summary["seconds"] = round(time.time() - start, 1)
    summary["targets_met"] = bool(summary["rm_accuracy_vs_negative"] >= TARGETS["rm_accuracy_vs_negative"] and all(
        summary[f"{m}_score"] >= summary["sft_score"] + TARGETS["ppo_minus_sft"]
        and summary[f"{m}_on_topic_rate"] >= TARGETS["ppo_on_topic_rate"] for m in methods))
    write_json(os.path.join(output_dir, *(["compare"] if methods != ("ppo",) else []), "summary.json"), summary)
    return summary


def main(argv: list[str] | None = None) -> dict:
    """``rlhf-trl demo [--recipes DIR] [--output_dir DIR] [--rebuild]``."""
    p = argparse.ArgumentParser(prog="rlhf-trl demo", description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--recipes", default="recipes/demo", help="directory holding sft.yaml, rm.yaml, ppo.yaml")
    p.add_argument("--output_dir", default="outputs/demo", help="must match the output paths in the recipes")
    p.add_argument("--rebuild", action="store_true", help="rebuild the cached assets (data, tokenizer, base model)")
    p.add_argument("--assets_only", action="store_true", help="only build the assets")
    p.add_argument("--compare", action="store_true", help="stage 3 as PPO (also with a value head on the "
                   "policy, and with ptx), DPO, GRPO and KTO, compared in one report")
    args = p.parse_args(argv)
    if args.assets_only:
        return {"output_dir": build_assets(os.path.join(args.output_dir, "assets"), force=args.rebuild)["base_model"]}
    methods = ("ppo", "ppo-value-head", "ppo-ptx", "dpo", "grpo", "kto") if args.compare else ("ppo",)
    return {"output_dir": os.path.join(args.output_dir, "compare") if args.compare else args.output_dir,
            "summary": run_demo(args.recipes, args.output_dir, args.rebuild, methods)}

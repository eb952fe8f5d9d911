"""Compare stage-3 methods on the same held-out prompts: ``rlhf-trl compare --config recipes/<run>/ppo.yaml
--policies sft=DIR ppo=DIR dpo=DIR grpo=DIR kto=DIR [--num_prompts N] [--samples_per_prompt K] [--demo]
[--output_dir DIR]`` plus any PPO recipe override.

Each DIR is a stage's output_dir (its ``merged/`` is sampled, its ``metrics.json`` read) or a model directory; the
policy named ``sft`` (else the first) is the reference. Every policy samples the PPO recipe's held-out prompts with the
same seed and settings, and its reward model scores them, as in ``rlhf-trl eval`` (`evaluate.sample_and_score`). Per
method: ``reward`` (mean raw RM score); ``reward_diff`` / ``reward_ci`` (mean of method - reference over the same
(prompt, sample) pairs; 95% interval: mean +- 1.96 standard errors, null for one pair); ``win_rate`` (vs the
reference, ties 1/2); ``kl_per_token`` (nats: mean of log p_method - log p_reference over the method's own response
tokens, temperature 1); ``eos_rate``; ``mean_length`` (tokens, EOS excluded); ``train_seconds`` / ``peak_memory_mb``
(the stage's metrics.json ``train_runtime`` / ``peak_memory_mb``, else null); with ``--demo`` the ground truth
``score`` in [-1, 1] (``score_diff`` / ``score_ci``) and ``on_topic_rate``.

Writes into ``--output_dir`` (default: ``compare`` beside the PPO recipe's output_dir): ``compare.json``,
``compare.md``, ``compare_samples.jsonl`` (rows as ``eval_samples.jsonl``) and ``compare/reward_vs_kl.png``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re

from .atomic import write_json, write_jsonl, write_text
from .cli_launch import recipe_types, run_stage
from .config import RecipeError, one_line_arguments, parse_recipe, sibling_recipe
from .evaluate import _cell, _stage_dir, policy_figures, rewards_sentence, sample_and_score, sample_values
from .models import StageInputError, require_model_dir
from .reward_models import require_reward_model
from .rewards import load_reward_functions

logger = logging.getLogger(__name__)

RESERVED = ("prompt_index", "sample_index", "question", "prompt_ids")  # the sample rows' own keys


def parse_policies(entries: list[str]) -> dict[str, tuple[str, str | None]]:
    """``NAME=DIR`` entries -> ``{name: (model dir, stage dir or None)}``, the reference first. Raises `RecipeError`:
    a bad entry, a name twice, < 2 entries; `StageInputError`: DIR missing, not a model, no ``merged/``."""
    policies: dict[str, tuple[str, str | None]] = {}
    for entry in entries:
        name, sep, path = entry.partition("=")
        if not sep or not path or not re.fullmatch(r"[A-Za-z][\w.-]*", name) or name in RESERVED:
            raise RecipeError(f"--policies: '{entry}' is not NAME=DIR (NAME: a letter, then letters, digits, _ . -; "
                              f"not {', '.join(RESERVED)}), e.g. dpo=outputs/demo/dpo")
        if name in policies:
            raise RecipeError(f"--policies: the name '{name}' is given twice; give each policy its own name")
        if not os.path.isdir(path):
            raise StageInputError(f"--policies {entry}: no directory '{path}'; give a stage's output_dir (holding "
                                  "merged/) or a model directory")
        model = merged if os.path.isdir(merged := os.path.join(path, "merged")) else path
        policies[name] = (require_model_dir(model, f"--policies {name} model"),
                          path if model == merged else _stage_dir(model))
    if len(policies) < 2:
        raise RecipeError(f"--policies: {len(policies)} given; compare needs at least 2, e.g. --policies "
                          "sft=outputs/demo/sft dpo=outputs/demo/dpo")
    ref = "sft" if "sft" in policies else entries[0].partition("=")[0]
    return {ref: policies.pop(ref), **policies}


def stage_metrics(stage_dir: str | None) -> dict:
    """``train_seconds`` / ``peak_memory_mb`` from ``<stage_dir>/metrics.json``; None if absent or unreadable."""
    path, data = os.path.join(stage_dir or "", "metrics.json"), {}
    try:
        if stage_dir and os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                data = dict(json.load(f))
    except (OSError, ValueError, TypeError) as exc:
        logger.warning("compare: %s cannot be read (%s): no training seconds or memory for it", path, exc)
    return {"train_seconds": data.get("train_runtime"), "peak_memory_mb": data.get("peak_memory_mb")}


def method_figures(rows: list[dict], name: str, ref: str, demo: bool = False) -> dict:
    """`rlhf_trl.evaluate.policy_figures` of ``name`` against ``ref`` (``reward_diff`` / ``reward_ci``, ...) as the
    module docstring says. The reference itself: win rate 0.5, KL 0, differences 0."""
    if name != ref:
        return policy_figures(rows, name, ref, demo)
    out = policy_figures(rows, name, None, demo)
    return {**out, **{f"{k}_{s}": 0.0 if s == "diff" else [0.0, 0.0] for k in sample_values(rows[0][name], demo)
                      for s in ("diff", "ci")}, "win_rate": 0.5, "kl_per_token": 0.0, "num_kl_tokens": 0}


def verdict(methods: dict[str, dict], ref: str, demo: bool, reward_name: str = "RM reward") -> str:
    """Which method scored highest on ground truth (``demo``) or ``reward_name``, by how much over ``ref``, at what
    KL."""
    key, what = ("score", "the demo's ground-truth score") if demo else ("reward", f"mean {reward_name}")
    best = max(methods, key=lambda m: methods[m][key])  # ties: the earlier, the reference first
    if best == ref:
        return f"No method beat the reference {ref} on {what} ({ref}: {methods[ref][key]:.3f})."
    m, ci = methods[best], methods[best][f"{key}_ci"]
    span = "" if ci is None else (f", 95% CI [{ci[0]:+.3f}, {ci[1]:+.3f}]" + (
        ", which excludes 0" if ci[0] > 0 else ", which includes 0: not clearly better at this sample size"))
    close = [f"{n} ({methods[n][key]:.3f})" for n in methods if n not in (ref, best) and ci is not None
             and ci[0] <= methods[n][f"{key}_diff"] <= ci[1]]
    tie = (f" {' and '.join(close)} {'lies' if len(close) == 1 else 'lie'} within that interval: not told apart at "
           "this sample size." if close else "")
    return (f"{best} scored highest on {what}: {m[key]:.3f} vs {methods[ref][key]:.3f} for {ref} (difference "
            f"{m[f'{key}_diff']:+.3f}{span}), at a KL of {m['kl_per_token']:.4f} nats per token to {ref}.{tie}")


def plot_reward_vs_kl(methods: dict[str, dict], ref: str, path: str, reward_name: str = "RM reward") -> str:
    """PNG: mean ``reward_name`` against KL per token, a labelled point per method, reward CIs as error bars."""
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure manager

    fig = Figure(figsize=(5, 3.6))
    ax = fig.subplots()
    for name, m in methods.items():
        err = (m["reward_ci"][1] - m["reward_ci"][0]) / 2 if m["reward_ci"] else 0.0
        ax.errorbar(m["kl_per_token"], m["reward"], yerr=err, fmt="o", capsize=4)
        ax.annotate(name, (m["kl_per_token"], m["reward"]), textcoords="offset points", xytext=(6, 4), fontsize=8)
    ax.set(xlabel=f"KL to {ref} (nats per token)", ylabel=f"mean {reward_name}")
    ax.set_title(f"error bars: 95% CI of the paired reward difference to {ref}", fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, format="png", dpi=80)
    return path


def write_md(path: str, result: dict, rows: list[dict], num_examples: int = 4) -> str:
    """``compare.md``: the table (a row per method), the verdict, the plot, side-by-side samples."""
    ref, methods, demo, reward_name = result["reference"], result["methods"], result["demo"], result["reward_name"]
    cols = [("reward", reward_name, ".3f"), ("reward_ci", f"reward - {ref}, 95% CI", "ci"),
            ("win_rate", f"win rate vs {ref}", ".3f"), ("kl_per_token", "KL (nats/token)", ".4f"),
            ("eos_rate", "EOS rate", ".2f"), ("mean_length", "mean length", ".1f"),
            ("train_seconds", "train s", ".0f"), ("peak_memory_mb", "peak MB", ".0f")]
    if demo:
        cols += [("score", "score", ".3f"), ("score_ci", f"score - {ref}, 95% CI", "ci"),
                 ("on_topic_rate", "on-topic", ".2f")]
    lines = ["# Stage-3 methods compared", "", f"Reference `{ref}`. Policies: "
             + ", ".join(f"{n} `{p['model']}`" for n, p in result["policies"].items())
             + f". Reward model `{result['reward_model_path']}`.", "",
             f"{result['num_prompts']} held-out prompts x {result['samples_per_prompt']} samples, the same for every "
             f"policy: temperature {result['temperature']}, top_k 0, top_p 1, at most {result['response_length']} "
             f"tokens, seed {result['seed']}. {rewards_sentence(result['reward_model_path'])}.", "",
             "| method | " + " | ".join(c[1] for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    lines += [f"| {n}{' (reference)' if n == ref else ''} | " + " | ".join(  # a CI as [lo, hi], a missing value: —
        "—" if m[k] is None else f"[{m[k][0]:+.3f}, {m[k][1]:+.3f}]" if spec == "ci" else format(m[k], spec)
        for k, _, spec in cols) + " |" for n, m in methods.items()]
    lines += ["", f"95% CI: paired over the same (prompt, sample) pairs, mean of (method - {ref}) +- 1.96 x its "
              f"standard error (sample standard deviation / sqrt(pairs)). Win rate: pairs where the method's "
              f"{reward_name} is above {ref}'s, ties 1/2. KL: mean over the method's own response tokens (EOS "
              f"included) of log p_method - log p_{ref} at temperature 1. Lengths in tokens, EOS excluded. Training "
              "seconds and peak memory: the stage's metrics.json (— when absent).", "", result["verdict"], "",
              "![reward vs KL](compare/reward_vs_kl.png)", "", "## Samples", "",
              "| prompt | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
    for r in [r for r in rows if r["sample_index"] == 0][:num_examples]:
        lines.append(f"| {_cell(r['question'])} | "
                     + " | ".join(f"{_cell(r[n]['text'])} ({r[n]['reward']:.2f})" for n in methods) + " |")
    write_text(path, "\n".join(lines) + "\n")
    return path


def compare(data_args, training_args, policies: dict[str, tuple[str, str | None]], out_dir: str,
            num_prompts: int | None = None, samples_per_prompt: int = 4, demo: bool = False,
            trust_remote_code: bool = False, rm_hint: str | None = None, functions=None) -> dict:
    """Compare ``policies`` (`parse_policies`) into ``out_dir``; return compare.json's content. Raises, before
    anything is loaded or written, as `rlhf_trl.evaluate.sample_and_score`; `StageInputError`: no reward model and
    no reward ``functions`` (`rlhf_trl.rewards.RewardFunctions`, which also score every sample)."""
    rm_path = None
    if training_args.reward_model_path or functions is None:
        rm_path = require_model_dir(training_args.reward_model_path, "reward model", rm_hint)
        require_reward_model(rm_path, rm_hint)
    ref = next(iter(policies))
    rows, n_prompts, _ = sample_and_score(data_args, training_args, {n: p[0] for n, p in policies.items()}, rm_path,
                                          num_prompts, samples_per_prompt, demo, trust_remote_code, None, functions)
    methods = {n: {**method_figures(rows, n, ref, demo), **stage_metrics(p[1])} for n, p in policies.items()}
    reward_name = "RM reward" if rm_path else f"reward ({' + '.join(functions.names)})"
    result = {"reference": ref, "methods": methods, "demo": demo, "reward_model_path": rm_path,
              "reward_name": reward_name,
              "policies": {n: {"model": p[0], "stage_dir": p[1]} for n, p in policies.items()},
              "num_prompts": n_prompts, "samples_per_prompt": samples_per_prompt,
              "temperature": training_args.temperature, "response_length": training_args.response_length,
              "seed": training_args.seed, "verdict": verdict(methods, ref, demo, reward_name),
              "samples": os.path.join(out_dir, "compare_samples.jsonl"), "report": os.path.join(out_dir, "compare.md"),
              "plot": plot_reward_vs_kl(methods, ref, os.path.join(out_dir, "compare", "reward_vs_kl.png"),
                                        reward_name)}
    write_jsonl(result["samples"], rows)
    write_md(result["report"], result, rows)
    write_json(os.path.join(out_dir, "compare.json"), result)
    logger.info("compare: %s", result["verdict"])
    return result


def main(argv: list[str] | None = None) -> dict:
    """``rlhf-trl compare``. Returns ``{"output_dir", "metrics" (``<method>_reward`` / ``_win_rate`` /
    ``_kl_per_token`` / ``_score``), **compare.json}``. Raises `RecipeError`: a bad recipe, argument or
    ``--policies`` entry; otherwise as `compare`."""
    p = one_line_arguments(argparse.ArgumentParser(
        prog="rlhf-trl compare", description=__doc__, formatter_class=argparse.RawTextHelpFormatter,
        epilog="Any other --key value is a PPO recipe override (see rlhf-trl ppo --help)."))
    p.add_argument("--config", help="the PPO recipe (recipes/<run>/ppo.yaml): prompts, reward model, sampling")
    p.add_argument("--policies", nargs="+", required=True, metavar="NAME=DIR",
                   help="stage output dirs (or model dirs) by name; sft (else the first) is the reference")
    p.add_argument("--num_prompts", type=int, default=None, help="first N held-out prompts (default: all)")
    p.add_argument("--samples_per_prompt", type=int, default=4, help="responses per prompt and policy")
    p.add_argument("--demo", action="store_true", help="also report the demo task's ground-truth scores")
    p.add_argument("--output_dir", default=None, help="default: compare/ beside the PPO recipe's output_dir")
    own, rest = p.parse_known_args(argv)
    policies = parse_policies(own.policies)
    recipe = parse_recipe(recipe_types("ppo"), ["--config", own.config, *rest] if own.config else rest)
    out_dir = own.output_dir or os.path.join(os.path.dirname(os.path.normpath(recipe.training.output_dir)), "compare")
    result = compare(recipe.data, recipe.training, policies, out_dir, own.num_prompts, own.samples_per_prompt, own.demo,
                     recipe.script.trust_remote_code, sibling_recipe(own.config, "rm"),
                     load_reward_functions(recipe.script.reward_funcs, recipe.script.reward_weights))
    metrics = {f"{n}_{k}": m[k] for n, m in result["methods"].items()
               for k in ("reward", "win_rate", "kl_per_token", "score") if k in m}
    return {"output_dir": out_dir, "metrics": metrics, **result}


if __name__ == "__main__":
    run_stage("compare")

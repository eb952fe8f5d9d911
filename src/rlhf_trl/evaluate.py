"""Evaluate a PPO run against its SFT policy: ``rlhf-trl eval --config recipes/<run>/ppo.yaml [--num_prompts N]
[--samples_per_prompt K] [--demo]`` plus any PPO recipe override.

Both policies (``sft_model_path``, ``<output_dir>/merged``) sample ``samples_per_prompt`` responses to each of the
first ``num_prompts`` held-out prompts of the PPO recipe with the same seed and settings, as PPO samples; the reward
model scores each ``prompt + response`` (raw: no ``reward_baseline`` or ``missing_eos_penalty``; a reward model of
another tokenizer: the decoded text re-encoded, `rlhf_trl.reward_models.score_responses`). Figures over the
pairs (same prompt, same sample index): ``sft_reward`` / ``ppo_reward`` (mean RM score, reward units); ``win_rate``
(PPO's score above SFT's, ties 1/2); ``kl_per_token`` (nats per token: mean of ``log p_ppo - log p_sft`` over the PPO
responses' tokens at temperature 1); ``*_mean_length`` (tokens, EOS excluded); ``*_eos_rate``; with ``--demo`` the
ground truth ``*_score`` in [-1, 1] and ``*_on_topic_rate``; ``rm_*`` on the RM stage's held-out pairs.

Writes into the PPO ``output_dir``: ``eval.json``, ``eval_samples.jsonl`` (one row per pair, with the per-token
log-probs behind the KL) and ``report.md`` (figures, side-by-side samples, each stage's training curves)."""

from __future__ import annotations

import argparse
import json
import logging
import os

import torch

from .atomic import write_json, write_jsonl, write_text
from .checkpoints import complete_checkpoints
from .cli_launch import recipe_types, run_stage
from .config import one_line_arguments, parse_recipe, sibling_recipe
from .data import DataError, Template, prompt_features, read_records, split_records
from .demo_task import on_topic, score_response
from .models import eos_token_ids, load_causal_lm, load_sequence_classifier, load_tokenizer, require_model_dir
from .reward_models import require_reward_model, reward_tokens, score_responses
from .rewards import load_reward_functions, reward_columns
from .scoring import pad_left, pad_right, paired_ci, response_logprobs, sample

logger = logging.getLogger(__name__)

PPO_CURVES = ["objective/scores", "objective/kl", "objective/entropy", "loss/value_avg", "objective/kl_coef"]
SFT_CURVES = ["loss", "eval_loss", "train_loss", "mean_token_accuracy", "eval_mean_token_accuracy"]
RM_CURVES = ["loss", "eval_loss", "train_loss", "eval_accuracy", "accuracy", "margin"]
FIGURES = ["sft_reward", "ppo_reward", "win_rate", "kl_per_token", "sft_mean_length", "ppo_mean_length",
           "sft_eos_rate", "ppo_eos_rate"]
RM_FIGURES = ["rm_accuracy", "rm_margin", "rm_length_baseline_accuracy", "rm_num_pairs"]
DEMO_FIGURES = ["sft_score", "ppo_score", "sft_on_topic_rate", "ppo_on_topic_rate"]  # with --demo


@torch.no_grad()
def policy_logprobs(model, prompts: list[list[int]], responses: list[list[int]], pad_token_id: int,
                    batch_size: int = 16) -> list[list[float]]:
    """Per-token log-probs (temperature 1, nats) of each response given its prompt, by the PPO engine's
    `rlhf_trl.scoring.response_logprobs`: one list of ``[len(response)]`` floats per response."""
    model.eval()
    device, out = next(model.parameters()).device, []
    for i in range(0, len(prompts), batch_size):
        query, chunk = pad_left(prompts[i:i + batch_size], pad_token_id), responses[i:i + batch_size]
        response = pad_right([list(r) or [pad_token_id] for r in chunk], pad_token_id)  # an empty one: one pad
        logp = response_logprobs(model, torch.cat((query, response), 1).to(device), query.shape[1], pad_token_id,
                                 1.0).float().cpu()
        out.extend(logp[j, :len(r)].tolist() for j, r in enumerate(chunk))
    return out


def sample_values(m: dict, demo: bool = False) -> dict[str, float]:
    """One policy's scored values in a `sample_and_score` row: ``reward``, ``objective``, ``fn_<name>`` per reward
    function and, with ``demo``, ``score``."""
    return {"reward": m["reward"], "objective": m.get("objective", m["reward"]),
            **{f"fn_{k}": v for k, v in m.get("functions", {}).items()}, **({"score": m["score"]} if demo else {})}


def policy_figures(rows: list[dict], name: str, ref: str | None = None, demo: bool = False) -> dict:
    """Policy ``name``'s unprefixed figures over `sample_and_score` rows (see the module docstring): the mean of each
    of `sample_values`, ``mean_length``, ``eos_rate``; against the policy ``ref``: ``<value>_diff`` / ``<value>_ci``
    (`paired_ci`), ``win_rate`` (on ``reward``), ``kl_per_token`` and ``num_kl_tokens``. Raises `ValueError`: no
    rows."""
    if not rows:
        raise ValueError("no eval samples")
    n, mine = len(rows), [r[name] for r in rows]
    values = [sample_values(m, demo) for m in mine]
    out = {**{k: sum(v[k] for v in values) / n for k in values[0]},
           "mean_length": sum(len(m["response_ids"]) - int(m["eos"]) for m in mine) / n,
           "eos_rate": sum(int(m["eos"]) for m in mine) / n}
    if demo:
        out["on_topic_rate"] = sum(int(m["on_topic"]) for m in mine) / n
    if ref:
        theirs = [sample_values(r[ref], demo) for r in rows]
        for k in values[0]:
            out[f"{k}_diff"], out[f"{k}_ci"] = paired_ci([v[k] for v in values], [t[k] for t in theirs])
        pairs = [(r[name]["reward"], r[ref]["reward"]) for r in rows]
        out["win_rate"] = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in pairs) / n
        diffs = [a - b for m in mine for a, b in zip(m[f"logprobs_{name}"], m[f"logprobs_{ref}"])]
        out.update(kl_per_token=sum(diffs) / len(diffs) if diffs else 0.0, num_kl_tokens=len(diffs))
    return out


def figures(rows: list[dict], demo: bool = False) -> dict:
    """The eval figures from ``eval_samples.jsonl`` rows: `policy_figures` of ``sft`` and ``ppo`` (``sft_*`` /
    ``ppo_*``) and PPO's against SFT unprefixed (``reward_diff``, ``objective_ci``, ...). Raises as it."""
    sft, ppo = policy_figures(rows, "sft", demo=demo), policy_figures(rows, "ppo", "sft", demo)
    per_policy = {f"{name}_{k}": f[k] for name, f in (("sft", sft), ("ppo", ppo)) for k in sft}
    return {**per_policy, **{k: v for k, v in ppo.items() if k not in sft}, "num_samples": len(rows)}


def rm_pair_figures(reward_model, path: str, pad_token_id: int) -> dict:
    """The ``rm_*`` figures of ``reward_model`` on the RM stage's held-out ``eval_pairs.jsonl``. Raises `DataError`: a
    malformed row (naming the file and line)."""
    from .rm import evaluate_pairs

    feats = {"chosen_ids": [], "rejected_ids": [], "prompt_length": []}
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            try:
                row = json.loads(line)
                for key in feats:
                    feats[key].append(row[key])
            except (ValueError, KeyError, TypeError) as exc:
                raise DataError(path, f"not an eval pair ({exc})", i) from None
    return ({f"rm_{k}": v for k, v in evaluate_pairs(reward_model, feats, pad_token_id).items()}
            if feats["chosen_ids"] else {})  # no pairs: no figures


def read_stage_logs(stage_dir: str | None) -> tuple[list[dict], str | None]:
    """A stage's ``(log records, source path or None)``: ``log_history.json``, else the newest readable
    ``checkpoint-N/trainer_state.json`` (damaged ones warned), else ``[metrics.json]``, else ``[]``."""
    if not stage_dir or not os.path.isdir(stage_dir):
        return [], None
    path = os.path.join(stage_dir, "log_history.json")
    if os.path.isfile(path) and (history := _log_history(path)):
        return history, path
    states = [os.path.join(ckpt, "trainer_state.json") for ckpt in reversed(complete_checkpoints(stage_dir))]
    for path in filter(os.path.isfile, states):  # the newest checkpoint whose state file reads
        try:
            if history := _log_history(path):
                return history, path
            break
        except (OSError, ValueError, AttributeError) as exc:
            logger.warning("%s is damaged (trainer_state.json cannot be read: %s); reading the logs of an older "
                           "checkpoint", os.path.dirname(path), exc)
    path = os.path.join(stage_dir, "metrics.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return [json.load(f)], path
    return [], None


def _log_history(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return json.load(f).get("log_history") or []


def plot_curves(logs: list[dict], keys: list[str], path: str, title: str) -> list[str]:
    """Plot each of ``keys`` in ``logs`` against ``step`` (else the record index), a panel each, into the PNG
    ``path``. Returns the keys plotted (``[]``, nothing written, when none is present)."""
    present = [k for k in keys if any(isinstance(r.get(k), (int, float)) for r in logs)]
    if not present:
        return []
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure manager

    fig = Figure(figsize=(3.2 * len(present), 2.8))
    for ax, key in zip(fig.subplots(1, len(present), squeeze=False)[0], present):
        pts = [(r.get("step", r.get("global_step", i)), r[key]) for i, r in enumerate(logs)
               if isinstance(r.get(key), (int, float))]
        ax.plot(*zip(*pts), marker="o" if len(pts) < 20 else None, markersize=3)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, format="png", dpi=80)
    return present


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", "⏎")


def _interval(ci: list[float] | None, up: str, down: str, none: str = "not told apart from 0 at this size") -> str:
    return "no interval (one sample)" if ci is None else (
        f"95% CI [{ci[0]:+.3f}, {ci[1]:+.3f}]: " + (up if ci[0] > 0 else down if ci[1] < 0 else none))


def quality_lines(figures: dict, rows: list[dict], reward: str = "raw RM score") -> list[str]:
    """Markdown lines: each effect with its 95% interval and what it shows. SFT: held-out completion loss after -
    before (``sft_loss_*``); RM: accuracy - the length-only baseline ("the longer response wins"), paired per pair;
    PPO - SFT over ``rows``' pairs: the optimised reward, the ``reward`` (raw RM score, or without a reward model the
    functions' sum) and each reward function; KL, EOS, length."""
    out = ["## Quality at this scale", ""]
    f = figures
    if "sft_loss_diff" in f:
        out.append(f"- SFT: held-out completion loss {f['sft_loss_before']:.3f} -> {f['sft_loss_after']:.3f} nats per "
                   f"token ({f['sft_loss_rows']} rows, difference {f['sft_loss_diff']:+.3f}, "
                   + _interval(f["sft_loss_ci"], "higher after training.", "lower: SFT fitted held-out rows.") + ")")
    if "rm_accuracy" in f:
        gap, ci = f["rm_accuracy"] - f["rm_length_baseline_accuracy"], f.get("rm_length_gap_ci")
        out.append(f"- Reward model: accuracy {f['rm_accuracy']:.3f} on {f['rm_num_pairs']} held-out pairs vs "
                   f"{f['rm_length_baseline_accuracy']:.3f} for the length-only baseline (gap {gap:+.3f}, "
                   + _interval(ci, "above the baseline: it learned more than length.", "below the baseline.",
                               "not above the baseline: it may have learned little beyond length.") + ")")
    if rows:
        for key, what in [("objective", "optimised reward"), ("reward", reward),
                          *((f"fn_{k}", f"reward function {k}") for k in rows[0]["ppo"].get("functions", {}))]:
            if f"{key}_diff" in f:
                out.append(f"- PPO vs SFT, {what}: {f[f'ppo_{key}']:.3f} vs {f[f'sft_{key}']:.3f} (difference "
                           f"{f[f'{key}_diff']:+.3f} over {len(rows)} paired samples, "
                           + _interval(f[f"{key}_ci"], "PPO higher.", "PPO lower.") + ")")
        out.append(f"- Cost: {f['kl_per_token']:.4f} nats per token of log-prob gap to the SFT policy; EOS rate "
                   f"{f['sft_eos_rate']:.2f} (SFT) -> {f['ppo_eos_rate']:.2f} (PPO); mean length "
                   f"{f['sft_mean_length']:.1f} -> {f['ppo_mean_length']:.1f} tokens.")
    return out + [""]


def rewards_sentence(rm_path: str | None) -> str:
    """What a report's ``reward`` column is: the raw RM score, or without ``rm_path`` the reward functions' sum."""
    return "Rewards are raw reward-model scores" if rm_path else "Rewards: the reward functions' weighted sum"


def sft_loss_figures(stage_dir: str | None) -> dict:
    """``sft_loss_before`` / ``_after`` / ``_diff`` / ``_ci`` / ``_rows`` from the SFT stage's ``metrics.json``
    (``eval_row_losses_before`` / ``eval_row_losses``, nats per token per held-out row); {} when absent."""
    try:
        with open(os.path.join(stage_dir or "", "metrics.json"), encoding="utf-8") as fh:
            m = json.load(fh)
        before, after = m["eval_row_losses_before"], m["eval_row_losses"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    diff, ci = paired_ci(after, before)
    return {"sft_loss_before": sum(before) / len(before), "sft_loss_after": sum(after) / len(after),
            "sft_loss_diff": diff, "sft_loss_ci": ci, "sft_loss_rows": len(after)}


def write_report(out_dir: str, result: dict, rows: list[dict], stage_logs: dict[str, tuple[list[dict], str | None]],
                 num_examples: int = 5) -> str:
    """Write ``report.md`` (and ``report/<stage>_curves.png``) into ``out_dir``; return its path. ``stage_logs``:
    stage name -> `read_stage_logs`'s ``(log records, source)``."""
    lines = ["# RLHF evaluation report", "",
             f"PPO run `{result['ppo_output_dir']}` against its SFT policy `{result['sft_model_path']}`, "
             + (f"reward model `{rm}`." if (rm := result["reward_model_path"]) else "no reward model."), "",
             f"{result['num_prompts']} held-out prompts x {result['samples_per_prompt']} samples, temperature "
             f"{result['temperature']}, top_k 0, top_p 1, at most {result['response_length']} tokens, seed "
             f"{result['seed']}. {rewards_sentence(result['reward_model_path'])} (no baseline, no missing-EOS "
             "penalty).", "", "## Figures", "", "| figure | value |", "|---|---|"]
    for key in FIGURES + [k for k in (*DEMO_FIGURES, *RM_FIGURES) if k in result["figures"]]:
        value = result["figures"][key]
        lines.append(f"| `{key}` | {value if isinstance(value, int) else format(value, '.4f')} |")
    rm_note = " No reward model: the reward functions score the samples."
    if result.get("rm_pairs"):
        rm_note = (f" `rm_*`: the reward model on the {result['figures']['rm_num_pairs']} pairs its stage held out "
                   f"(`{result['rm_pairs']}`); `rm_length_baseline_accuracy` is what \"the longer response wins\" "
                   "scores.")
    elif result["reward_model_path"]:
        rm_note = " RM pairwise accuracy: no held-out pairs found (the RM run had no eval split)."
    lines += ["", "`kl_per_token`: mean over PPO response tokens (EOS included) of log p_ppo - log p_sft at "
              "temperature 1 (nats per token); lengths in tokens, EOS excluded." + rm_note, ""]
    lines += quality_lines(result["figures"], rows, "raw RM score" if result["reward_model_path"] else
                           "reward functions' sum") + [
        "## Samples", "", "| prompt | SFT response | PPO response | SFT reward | PPO reward |", "|---|---|---|---|---|"]
    lines += [f"| {_cell(r['question'])} | {_cell(r['sft']['text'])} | {_cell(r['ppo']['text'])} | "
              f"{r['sft']['reward']:.3f} | {r['ppo']['reward']:.3f} |" for r in rows[:num_examples]]
    lines += ["", "## Training curves", ""]
    plots = result["plots"] = {}
    for stage, curves in (("sft", SFT_CURVES), ("rm", RM_CURVES), ("ppo", PPO_CURVES)):
        logs, source = stage_logs.get(stage, ([], None))
        png = os.path.join(out_dir, "report", f"{stage}_curves.png")
        plotted = plot_curves(logs, curves, png, f"{stage.upper()} training") if logs else []
        lines += [f"### {stage.upper()}", ""]
        if plotted:
            plots[stage] = png
            note = "" if len(logs) > 1 else " (one final record: no checkpoint `trainer_state.json` was kept)"
            lines += [f"From `{source}`{note}: {', '.join(plotted)}.", "",
                      f"![{stage} curves](report/{stage}_curves.png)", ""]
        else:
            lines += [f"No training logs found for this stage{f' (read {source})' if source else ''}.", ""]
    write_text(path := os.path.join(out_dir, "report.md"), "\n".join(lines) + "\n")
    return path


def _stage_dir(model_path: str | None) -> str | None:
    """The stage output_dir of a ``<output_dir>/merged`` model path; None for any other path, or none."""
    path = os.path.normpath(model_path or "")
    return os.path.dirname(path) if os.path.basename(path) == "merged" else None


def evaluate(data_args, training_args, num_prompts: int | None = None, samples_per_prompt: int = 4,
             demo: bool = False, ppo_logs: list[dict] | None = None, trust_remote_code: bool = False,
             hints: dict[str, str] | None = None, functions=None) -> dict:
    """Evaluate a PPO recipe (`DataArguments`, `PPOConfig`) as the module docstring says, into its output_dir.
    ``ppo_logs``: the PPO trainer's ``log_history`` (default: from the newest checkpoint); ``hints``: the command
    making each input (``sft`` / ``rm`` / ``ppo``), named when it is missing. Returns eval.json's content plus
    ``report`` and ``plots`` (stage -> PNG). Raises, before loading or writing anything, `StageInputError`: a model
    is missing; otherwise as `sample_and_score`."""
    out_dir, hints = training_args.output_dir, hints or {}
    sft_path = require_model_dir(training_args.sft_model_path, "SFT model", hints.get("sft"))
    rm_path = None
    if training_args.reward_model_path or functions is None:
        rm_path = require_model_dir(training_args.reward_model_path, "reward model", hints.get("rm"))
        require_reward_model(rm_path, hints.get("rm"))
    ppo_path = require_model_dir(os.path.join(out_dir, "merged"), "PPO policy", hints.get("ppo", "make ppo"))
    pairs = os.path.join(_stage_dir(rm_path) or "", "eval_pairs.jsonl")
    rows, n_prompts, rm_figures = sample_and_score(
        data_args, training_args, {"sft": sft_path, "ppo": ppo_path}, rm_path, num_prompts, samples_per_prompt, demo,
        trust_remote_code, pairs, functions)
    if rm_path and not rm_figures:
        logger.warning("eval: no RM held-out pairs at %s; rm_accuracy is not reported", pairs)
    result = {"figures": {**figures(rows, demo), **rm_figures, **sft_loss_figures(_stage_dir(sft_path))},
              "rm_pairs": pairs if rm_figures else None, "ppo_output_dir": out_dir, "sft_model_path": sft_path,
              "reward_model_path": rm_path, "ppo_model_path": ppo_path, "num_prompts": n_prompts,
              "samples_per_prompt": samples_per_prompt, "temperature": training_args.temperature,
              "response_length": training_args.response_length, "seed": training_args.seed}
    write_jsonl(samples := os.path.join(out_dir, "eval_samples.jsonl"), rows)
    stage_logs = {"sft": read_stage_logs(_stage_dir(training_args.sft_model_path)),
                  "rm": read_stage_logs(_stage_dir(training_args.reward_model_path)),
                  "ppo": (ppo_logs, "the PPO trainer's log_history") if ppo_logs else read_stage_logs(out_dir)}
    result["report"], result["samples"] = write_report(out_dir, result, rows, stage_logs), samples
    write_json(os.path.join(out_dir, "eval.json"), {**result["figures"], **result})
    logger.info("eval: %s", ", ".join(f"{k} {v:.4g}" for k, v in result["figures"].items() if isinstance(v, float)))
    return {**result["figures"], **result}


def sample_and_score(data_args, training_args, paths: dict[str, str], rm_path: str | None, num_prompts: int | None,
                     samples_per_prompt: int, demo: bool = False, trust_remote_code: bool = False,
                     pairs_file: str | None = None, functions=None) -> tuple[list[dict], int, dict]:
    """Each policy of ``paths`` (name -> model dir; the first, the reference, gives tokenizer and EOS ids) samples
    the PPO recipe's held-out prompts as PPO does, same seed; the RM scores each (raw). Returns ``(rows, number of
    prompts, rm_* figures on pairs_file or {})``: a row per prompt and sample index, per policy ``response_ids``,
    ``eos``, ``text``, ``reward`` (the raw RM score; without ``rm_path``, the reward functions' weighted sum),
    ``objective`` (PPO's reward before the KL penalty, less the constant ``reward_baseline``: ``reward`` plus the
    functions' sum with an RM, minus ``missing_eos_penalty`` without EOS), ``functions`` (name -> value of each of
    ``functions``, a `rlhf_trl.rewards.RewardFunctions`, fed the prompt file's columns), ``score`` / ``on_topic``
    with ``demo`` and, but for the reference, ``logprobs_<name>`` / ``logprobs_<reference>``. Raises, before loading
    anything, `DataError`: bad prompt rows; `ValueError`: no held-out prompt, no reward, bad template settings, a
    count < 1; then `rlhf_trl.rewards.RewardFunctionError`."""
    if rm_path is None and functions is None:
        raise ValueError("nothing scores the samples: set reward_model_path and/or reward_funcs")
    if samples_per_prompt < 1:
        raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1 (or unset: every held-out prompt), got {num_prompts}")
    template = Template.from_args(data_args)
    held_out = split_records(read_records(data_args, "prompts"), data_args.eval_split_size, training_args.seed)[1]
    if num_prompts is not None and num_prompts > len(held_out):
        logger.warning("num_prompts %d: the recipe holds out %d prompts (eval_split_size); evaluating on all of them",
                       num_prompts, len(held_out))
    eval_records = held_out[:num_prompts]  # num_prompts None: all
    if not eval_records:
        raise ValueError("no held-out prompts to evaluate on; raise eval_split_size")
    ref_path = next(iter(paths.values()))
    tokenizer = load_tokenizer(ref_path, padding_side="left", trust_remote_code=trust_remote_code)
    prompt_ids = prompt_features(eval_records, tokenizer, template, data_args.max_prompt_length)["input_ids"]
    prompts = [p for p in prompt_ids for _ in range(samples_per_prompt)]
    pad, eos = tokenizer.pad_token_id, eos_token_ids(tokenizer, ref_path)  # every EOS id ends a response
    responses, logprobs = _sample_policies(training_args, paths, prompts, pad, eos, trust_remote_code)
    reward_model = load_sequence_classifier(rm_path, None, trust_remote_code) if rm_path else None
    tokens = reward_tokens(rm_path, tokenizer, template, trust_remote_code)  # None: the same tokenizer, ids as they are
    if tokens is not None:
        tokens.add_prompts("eval", [r for r in eval_records for _ in range(samples_per_prompt)])
    rm_pad = pad if tokens is None else tokens.pad_token_id
    if reward_model is not None:
        reward_model.config.pad_token_id = rm_pad
    rows = [{"prompt_index": i, "sample_index": j, "question": r["question"], "prompt_ids": p}
            for i, (r, p) in enumerate(zip(eval_records, prompt_ids)) for j in range(samples_per_prompt)]
    columns = {k: [v for v in col for _ in range(samples_per_prompt)]
               for k, col in reward_columns(eval_records).items()} if functions else {}
    penalty = getattr(training_args, "missing_eos_penalty", None) or 0.0
    for name, resp in responses.items():
        texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids, _ in resp]
        total, values = (functions.compute(tokenizer.batch_decode(prompts, skip_special_tokens=True), texts, 0,
                                           **columns) if functions else (torch.zeros(len(texts)), {}))
        rewards = (score_responses(reward_model, prompts if tokens is None else tokens.prompts["eval"],
                                   [r for r, _ in resp], [e for _, e in resp], pad, tokens)
                   if reward_model is not None else total)
        for i, (row, (ids, ended), text) in enumerate(zip(rows, resp, texts)):
            objective = float(rewards[i]) + (float(total[i]) if reward_model is not None else 0.0)
            row[name] = {"response_ids": ids, "eos": ended, "text": text, "reward": float(rewards[i]),
                         "objective": objective - (0.0 if ended else penalty),
                         "functions": {k: float(v[i]) for k, v in values.items()}}
            if demo:
                row[name].update(score=score_response(row["question"], text), on_topic=on_topic(row["question"], text))
            row[name].update({f"logprobs_{k}": v[i] for k, v in logprobs.get(name, {}).items()})
    return rows, len(eval_records), (rm_pair_figures(reward_model, pairs_file, rm_pad)  # the RM's own held-out ids
                                     if reward_model is not None and pairs_file and os.path.isfile(pairs_file) else {})


def _sample_policies(training_args, paths: dict[str, str], prompts: list[list[int]], pad: int, eos: list[int],
                     trust_remote_code: bool) -> tuple[dict, dict]:
    """Each policy's ``(response ids, ended with EOS)`` per prompt, and ``{name: {name: ..., reference: ...}}``: the
    log-probs of each non-reference policy's responses under it and the reference. At most two models loaded."""
    ref, responses, logprobs = next(iter(paths)), {}, {}
    for name, path in paths.items():
        logger.info("sampling %s: %d responses of at most %d tokens (%s)", name, len(prompts),
                    training_args.response_length, path)
        model = load_causal_lm(path, None, trust_remote_code)
        model.generation_config.pad_token_id = pad
        responses[name] = sample(model, prompts, pad, eos, max_new_tokens=training_args.response_length,
                                 temperature=training_args.temperature, seed=training_args.seed)
        if name == ref:
            reference = model
            continue
        own = [r for r, _ in responses[name]]
        logprobs[name] = {name: policy_logprobs(model, prompts, own, pad),
                          ref: policy_logprobs(reference, prompts, own, pad)}
        del model
    return responses, logprobs


def main(argv: list[str] | None = None, ppo_logs: list[dict] | None = None) -> dict:
    """``rlhf-trl eval``; ``ppo_logs`` as in `evaluate`. Returns ``{"output_dir", "metrics" (the figures), "report",
    ...}``. Raises `RecipeError`: a bad recipe or command-line argument; otherwise as `evaluate`."""
    p = one_line_arguments(argparse.ArgumentParser(
        prog="rlhf-trl eval", description=__doc__, formatter_class=argparse.RawTextHelpFormatter,
        epilog="Any other --key value is a PPO recipe override (see rlhf-trl ppo --help)."))
    p.add_argument("--config", help="the PPO recipe (recipes/<run>/ppo.yaml)")
    p.add_argument("--num_prompts", type=int, default=None, help="first N held-out prompts (default: all)")
    p.add_argument("--samples_per_prompt", type=int, default=4, help="responses per prompt and policy")
    p.add_argument("--demo", action="store_true", help="also report the demo task's ground-truth scores")
    own, rest = p.parse_known_args(argv)
    recipe = parse_recipe(recipe_types("ppo"), ["--config", own.config, *rest] if own.config else rest)
    result = evaluate(recipe.data, recipe.training, own.num_prompts, own.samples_per_prompt, own.demo,
                      ppo_logs=ppo_logs, trust_remote_code=recipe.script.trust_remote_code,
                      functions=load_reward_functions(recipe.script.reward_funcs, recipe.script.reward_weights),
                      hints={stage: sibling_recipe(own.config, stage) for stage in ("sft", "rm", "ppo")})
    return {"output_dir": recipe.training.output_dir, "metrics": dict(result["figures"]), **result}


if __name__ == "__main__":
    run_stage("eval")

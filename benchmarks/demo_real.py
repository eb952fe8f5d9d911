"""Real weights end to end: ``make demo-real`` (or ``python benchmarks/demo_real.py --model DIR``).

Runs ``recipes/qwen2.5-0.5b-cpu/{sft,rm,ppo}.yaml`` on a stock Qwen2 / Qwen2.5 Instruct directory (``make
real-model``), then ``rlhf-trl eval``, and writes ``<output_dir>/summary.json``: per stage the effect on held-out data
with its 95% interval (normal approximation, paired where the same rows are scored twice), the targets and whether
they are met, each stage's wall time (seconds) and side-by-side samples.

- SFT: completion loss (nats per token) of the same held-out rows before and after; target: the interval of the
  difference below 0.
- RM: pairwise accuracy on held-out pairs minus the length-only baseline ("the longer answer wins"), paired per pair;
  target: its interval above 0. The pairs (`relevance_pairs`) are built from real human-written answers: a question's
  best answer against the best answer to the question whose best answer is nearest in length, a sharper preference than
  the human rankings (which a 0.5B RM does not learn above the length baseline in CPU minutes).
- PPO: the optimised reward (RM score minus the missing-EOS penalty) of PPO's responses minus SFT's, same held-out
  prompts and seed; targets: its interval above 0, KL per token in (0, `KL_BUDGET`); EOS rate and length reported;
  two second scorers the reward does not contain (`SECOND_SCORERS`: `question_overlap`, `complete_sentence`), with
  their intervals (reported, not gated)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time

from rlhf_trl.atomic import write_json, write_jsonl
from rlhf_trl.models import require_model_dir

logger = logging.getLogger(__name__)

KL_BUDGET = 0.3  # nats per token of log-prob gap, PPO vs SFT policy, on PPO's responses; 0.43 was repetition
RANKED_SOURCE = "../shared/data/zh/oaast_rm_zh.json"  # 775 questions with human-ranked answers (best first)
MAX_ANSWER_CHARS = 300  # longer best answers are skipped (counted): both sides of a pair fit the RM's 256 tokens
SENTENCE_ENDS = ("。", "！", "？", "!", "?", ".", "…", "”", "\"", "）", ")")
_UNIT = re.compile(r"[\u4e00-\u9fff]|[A-Za-z0-9]+")  # one CJK character or one latin word / number


def relevance_pairs(source: str, path: str) -> dict:
    """Write ``path`` (JSON lines ``{question, chosen, rejected}``) from a ranked file (``instruction``, ``input``,
    ``output`` best first): for each question its best answer (chosen) and the best answer of its neighbour by
    best-answer length (rejected; neighbours in pairs, the shorter and the longer one of each): lengths nearly match
    and either side is the longer as often, so the length-only baseline is near 0.5. Rows with history or no answer,
    repeated questions, best answers over `MAX_ANSWER_CHARS` and answers shared with the neighbour are skipped and
    counted. Returns the counts. Raises `OSError` / `ValueError`: ``source`` unreadable or not a JSON list."""
    with open(source, encoding="utf-8") as f:
        rows = json.load(f)
    if not isinstance(rows, list):
        raise ValueError(f"{source}: expected a JSON list of ranked rows")
    answered = [r for r in rows if not r.get("history") and isinstance(r.get("output"), list) and r["output"]]
    first = {_question(r): r for r in reversed(answered)}  # a question asked twice ("你好"): its first row only
    usable = [r for r in answered if first[_question(r)] is r and len(r["output"][0]) <= MAX_ANSWER_CHARS]
    usable.sort(key=lambda r: (len(r["output"][0]), r["output"][0]))
    pairs = []
    for i, row in enumerate(usable):
        other = usable[i ^ 1] if i ^ 1 < len(usable) else usable[i - 1]  # neighbours 0-1, 2-3, ...: either longer
        if other["output"][0] != row["output"][0]:
            pairs.append({"question": _question(row), "chosen": row["output"][0], "rejected": other["output"][0]})
    write_jsonl(path, sorted(pairs, key=lambda p: p["question"]))  # not by length: splits stay mixed
    counts = {"rows": len(rows), "skipped_history_or_no_answer": len(rows) - len(answered),
              "skipped_repeated_question": len(answered) - len(first),
              f"skipped_best_answer_over_{MAX_ANSWER_CHARS}_chars": len(first) - len(usable),
              "skipped_same_answer": len(usable) - len(pairs), "pairs": len(pairs)}
    logger.info("demo-real: %s -> %s: %s", source, path, counts)
    return counts


def _question(row: dict) -> str:
    return "\n".join(x for x in (row["instruction"], row.get("input") or "") if x)


def _units(text: str) -> set[str]:
    chars = _UNIT.findall(text.lower())
    return {a + b for a, b in zip(chars, chars[1:])}


def question_overlap(prompts: list[str], completions: list[str], question: list[str], **kwargs) -> list[float]:
    """The second scorer, a reward function the PPO reward does not contain: ``[batch]`` share in [0, 1] of the
    question's distinct bigrams (of CJK characters and latin words) found in the completion (does the answer stay on
    the question's terms?)."""
    return [len(want & _units(c)) / len(want) if want else 0.0 for want, c in zip(map(_units, question), completions)]


def complete_sentence(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """The other second scorer: ``[batch]`` 1.0 where the completion ends with sentence-final punctuation (an answer
    that finishes its sentence rather than being cut at the token budget; the reward sees EOS tokens, not text)."""
    return [1.0 if c.strip().endswith(SENTENCE_ENDS) else 0.0 for c in completions]


SECOND_SCORERS = {"question_overlap": question_overlap, "complete_sentence": complete_sentence}


def _ci_dict(mean: float, ci: list[float] | None) -> dict:
    return {"diff": mean, "ci95": ci}


def quality(evaluation: dict, rows: list[dict]) -> dict:
    """The summary's effects and targets from ``rlhf-trl eval``'s result (with the SFT stage's ``sft_loss_*``) and its
    sample rows."""
    from rlhf_trl.evaluate import paired_ci

    sft = ({"loss_before": evaluation["sft_loss_before"], "loss_after": evaluation["sft_loss_after"],
            "rows": evaluation["sft_loss_rows"], **_ci_dict(evaluation["sft_loss_diff"], evaluation["sft_loss_ci"])}
           if "sft_loss_diff" in evaluation else {})
    rm = {k: evaluation.get(f"rm_{k}") for k in ("accuracy", "accuracy_ci", "length_baseline_accuracy", "length_gap",
                                                 "length_gap_ci", "num_pairs")}
    second = {k: {name: fn([], [r[name]["text"] for r in rows], question=[r["question"] for r in rows])
                  for name in ("sft", "ppo")} for k, fn in SECOND_SCORERS.items()}
    ppo = {"objective_sft": evaluation["sft_objective"], "objective_ppo": evaluation["ppo_objective"],
           "objective": _ci_dict(evaluation["objective_diff"], evaluation["objective_ci"]),
           "rm_reward": _ci_dict(evaluation["reward_diff"], evaluation["reward_ci"]),
           "kl_per_token": evaluation["kl_per_token"], "kl_budget": KL_BUDGET, "win_rate": evaluation["win_rate"],
           **{f"{k}_{p}": evaluation[f"{p}_{k}"] for k in ("eos_rate", "mean_length") for p in ("sft", "ppo")},
           "second_scorers": {k: {"sft": sum(v["sft"]) / len(rows), "ppo": sum(v["ppo"]) / len(rows),
                                  **_ci_dict(*paired_ci(v["ppo"], v["sft"]))} for k, v in second.items()},
           "prompts": len(rows)}
    low = lambda d: d.get("ci95") is not None and d["ci95"][0] > 0  # noqa: E731
    targets = {"sft_loss_down": bool(sft) and sft["ci95"] is not None and sft["ci95"][1] < 0,
               "rm_above_length_baseline": rm["length_gap_ci"] is not None and rm["length_gap_ci"][0] > 0,
               "ppo_objective_up": low(ppo["objective"]), "ppo_kl_in_budget": 0 < ppo["kl_per_token"] < KL_BUDGET}
    return {"sft": sft, "rm": rm, "ppo": ppo, "targets": targets, "targets_met": all(targets.values())}


def run(model_dir: str, recipes_dir: str = "recipes/qwen2.5-0.5b-cpu", output_dir: str = "outputs/qwen2.5-0.5b-cpu",
        eval_prompts: int = 40, overrides: dict[str, list[str]] | None = None) -> dict:
    """Pairs -> SFT -> RM -> PPO -> eval (``eval_prompts`` held-out prompts, one sample each) on ``model_dir``;
    ``overrides``: extra ``--key value`` arguments per stage (``sft`` / ``rm`` / ``ppo``; smoke runs). Returns the
    summary, also written to ``summary.json``. Raises `StageInputError`: ``model_dir`` is not a model directory; stage
    errors; `OSError`: the ranked source is missing."""
    from rlhf_trl import evaluate, ppo, rm, sft

    require_model_dir(model_dir, "base model", "make real-model")
    t0, pairs_path = time.time(), os.path.join(output_dir, "data", "relevance_pairs.jsonl")
    pair_counts = relevance_pairs(RANKED_SOURCE, pairs_path)
    seconds: dict[str, float] = {"pairs": round(time.time() - t0, 1)}
    argv = {"sft": ["--model_name_or_path", model_dir, "--output_dir", f"{output_dir}/sft"],
            "rm": ["--model_name_or_path", f"{output_dir}/sft/merged", "--output_dir", f"{output_dir}/rm",
                   "--dataset_name", pairs_path],
            "ppo": ["--sft_model_path", f"{output_dir}/sft/merged", "--reward_model_path", f"{output_dir}/rm/merged",
                    "--output_dir", f"{output_dir}/ppo"]}
    results = {}
    for name, module in (("sft", sft), ("rm", rm), ("ppo", ppo)):
        t0 = time.time()
        results[name] = module.main(["--config", os.path.join(recipes_dir, f"{name}.yaml"), *argv[name],
                                     *(overrides or {}).get(name, [])])
        seconds[name] = round(time.time() - t0, 1)
        logger.info("demo-real: %s done in %.0f s", name, seconds[name])
    t0, trainer = time.time(), results["ppo"].get("trainer")
    evaluation = evaluate.main(["--config", os.path.join(recipes_dir, "ppo.yaml"), *argv["ppo"], "--num_prompts",
                                str(eval_prompts), "--samples_per_prompt", "1", *(overrides or {}).get("ppo", [])],
                               ppo_logs=trainer.state.log_history if trainer is not None else None)
    seconds["eval"] = round(time.time() - t0, 1)
    rows = [json.loads(line) for line in open(evaluation["samples"], encoding="utf-8")]
    summary = {"model": model_dir, "stage_seconds": seconds, "seconds": round(sum(seconds.values()), 1),
               "rm_pairs_file": pair_counts, **quality(evaluation, rows),
               "examples": [{"question": r["question"], "sft": r["sft"]["text"], "ppo": r["ppo"]["text"]}
                            for r in rows[:3]], "report": evaluation["report"]}
    write_json(os.path.join(output_dir, "summary.json"), summary)
    return summary


def print_summary(summary: dict, path: str) -> None:
    """The summary on stdout: each stage's seconds, each effect with its interval and target, samples."""
    sft, rm, ppo, t = summary["sft"], summary["rm"], summary["ppo"], summary["targets"]

    def ci(d: dict | None) -> str:
        if not d or d.get("ci95") is None:
            return "n/a"
        return f"{d['diff']:+.3f} [{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}]"

    gap = {"diff": rm["length_gap"], "ci95": rm["length_gap_ci"]} if rm.get("length_gap") is not None else None
    print(f"\ndemo-real summary ({summary['model']}); effects with 95% intervals, held-out data")
    for stage, sec in summary["stage_seconds"].items():
        print(f"  {stage + ' seconds':36s} {sec:8.1f}")
    print(f"  {'seconds (whole run)':36s} {summary['seconds']:8.1f}")
    rows = [("SFT completion loss after - before", ci(sft), sft.get("rows"), "rows", t["sft_loss_down"]),
            ("RM accuracy - length baseline", ci(gap), rm.get("num_pairs"), "pairs", t["rm_above_length_baseline"]),
            ("PPO - SFT optimised reward", ci(ppo["objective"]), ppo["prompts"], "prompts", t["ppo_objective_up"]),
            ("PPO - SFT raw RM score", ci(ppo["rm_reward"]), ppo["prompts"], "prompts", None),
            *((f"PPO - SFT {k} (2nd scorer)", ci(v), ppo["prompts"], "prompts", None)
              for k, v in ppo["second_scorers"].items())]
    for name, text, n, unit, met in rows:
        print(f"  {name:40s} {text:28s} {n} {unit}" + ("" if met is None else f"  target met: {met}"))
    print(f"  RM accuracy {rm['accuracy']:.3f} vs length-only {rm['length_baseline_accuracy']:.3f}; KL "
          f"{ppo['kl_per_token']:.4f} nats/token (budget {ppo['kl_budget']}, met: {t['ppo_kl_in_budget']}); EOS rate "
          f"{ppo['eos_rate_sft']:.2f} -> {ppo['eos_rate_ppo']:.2f}; length {ppo['mean_length_sft']:.1f} -> "
          f"{ppo['mean_length_ppo']:.1f} tokens")
    for ex in summary["examples"][:2]:
        print(f"  question: {ex['question'][:60]}\n    sft: {ex['sft'][:80]}\n    ppo: {ex['ppo'][:80]}")
    print(f"  targets met: {summary['targets_met']}\n  written to {path}\n  report (SFT vs PPO, training curves): "
          f"{summary['report']}")


def main(argv: list[str] | None = None) -> int:
    """``python benchmarks/demo_real.py --model DIR [--recipes DIR] [--output_dir DIR] [--eval_prompts N]``: the run,
    then its summary on stdout. Exit status 0, or 2 with one line on stderr for bad input (as ``rlhf-trl``)."""
    p = argparse.ArgumentParser(prog="demo_real.py", description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True, help="a stock Qwen2 / Qwen2.5 Instruct directory (make real-model)")
    p.add_argument("--recipes", default="recipes/qwen2.5-0.5b-cpu", help="directory with sft.yaml, rm.yaml, ppo.yaml")
    p.add_argument("--output_dir", default="outputs/qwen2.5-0.5b-cpu", help="where the stages write")
    p.add_argument("--eval_prompts", type=int, default=40, help="held-out prompts for the SFT vs PPO evaluation")
    args = p.parse_args(argv)
    from rlhf_trl.cli_launch import log_to_stderr, one_line, quiet_libraries

    quiet_libraries()
    log_to_stderr()  # as rlhf-trl's commands log
    logger.setLevel(logging.INFO)
    try:
        summary = run(args.model, args.recipes, args.output_dir, args.eval_prompts)
    except (ValueError, OSError) as exc:  # bad recipes, data, model directories (their one-line errors)
        print(f"demo_real.py: error: {one_line(exc)}", file=sys.stderr)
        return 2
    print_summary(summary, os.path.join(args.output_dir, "summary.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

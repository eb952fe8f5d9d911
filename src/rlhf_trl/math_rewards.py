"""Rule reward for math word problems: 1.0 when a completion's final number equals the gold answer, else 0.0::

    reward_funcs: ["rlhf_trl.math_rewards:correct"]

Gold answers come from the prompt file's own columns, one per completion (`rlhf_trl.rewards.reward_columns`): CMATH's
``golden`` ("68", "2.86", "5/8") or GSM8K's ``answer`` (a worked solution ending ``#### 18``). Numbers compare as exact
fractions ("0.50" == "1/2"; thousands commas dropped); the completion's last number is its answer (the convention of
the GSM8K paper, Cobbe et al. 2021, and CMATH, Wei et al. 2023)."""

from __future__ import annotations

import re
from fractions import Fraction

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def parse_number(text: str) -> Fraction | None:
    """The exact value of ``text`` ("1,024", "-2.5", "3/4"; "12%" as written: 12), or None (not a number, or a zero
    denominator)."""
    try:
        return Fraction(text.replace(",", "").removesuffix("%"))
    except (ValueError, ZeroDivisionError):
        return None


def final_number(text: str) -> Fraction | None:
    """The last number written in ``text`` (a completion), or None when it has none."""
    found = NUMBER.findall(text or "")
    return parse_number(found[-1].rstrip(",")) if found else None


def gold_number(golden: str | None = None, answer: str | None = None) -> Fraction | None:
    """A row's gold answer: ``golden`` (CMATH), else the number after ``####`` in ``answer`` (GSM8K), else None."""
    if golden is not None:
        return parse_number(str(golden).strip())
    return parse_number(answer.rsplit("####", 1)[1].strip()) if answer is not None and "####" in answer else None


def correct(completions: list[str], golden: list | None = None, answer: list | None = None, **kwargs) -> list[float]:
    """``[batch]`` 1.0 / 0.0: the completion's `final_number` equals its row's `gold_number`. ``golden`` / ``answer``:
    the ``[batch]`` columns (None where a row lacks one). Raises `ValueError`: neither column, or a row whose gold
    answer is not a number (naming the row in the batch)."""
    n = len(completions)
    golden, answer = golden or [None] * n, answer or [None] * n
    if len(golden) != n or len(answer) != n:
        raise ValueError(f"correct: {n} completions but {len(golden)} golden / {len(answer)} answer values")
    out = []
    for i, (text, g, a) in enumerate(zip(completions, golden, answer)):
        if (gold := gold_number(g, a)) is None:
            raise ValueError(f"correct: row {i} of the batch has no numeric gold answer (golden={g!r}, answer="
                             f"{(a or '')[-40:]!r}); the prompt file needs a `golden` column or an `answer` ending "
                             "'#### N'")
        out.append(1.0 if final_number(text) == gold else 0.0)
    return out

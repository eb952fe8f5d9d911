"""Bad data at any step of `rlhf_trl.data`: a `DataError` (one line: the file, the row, the field), or a skip
(``on_bad_row``) counted in the stage's `DataReport`, written as ``data_report.json`` beside the stage's outputs."""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import asdict, dataclass, field

logger = logging.getLogger("rlhf_trl.data")
EXAMPLES = 5  # row numbers kept per skip reason


class DataError(ValueError):
    """Bad input data. The message names the file, and for row-level problems the row (0-based) and field."""

    def __init__(self, source: str, message: str, row: int | None = None, field: str | None = None):
        where = (f", row {row}" if row is not None else "") + (f", field '{field}'" if field is not None else "")
        super().__init__(f"{source}{where}: {message}")
        self.source, self.row, self.field, self.message = source, row, field, message


@dataclass
class DataReport:
    """Counts of a stage's data: sources, skips per reason, truncated / dropped rows, token lengths; SFT: the
    assistant turns trained per split (`turns_trained`)."""

    stage: str
    template: str = ""
    sources: list = field(default_factory=list)
    skipped: dict = field(default_factory=dict)
    deduplicated: int = 0
    truncated: dict = field(default_factory=dict)
    dropped: dict = field(default_factory=dict)
    system_turns_dropped: int = 0
    train_size: int = 0
    eval_size: int = 0
    token_lengths: dict = field(default_factory=dict)
    turns: dict = field(default_factory=dict)

    def skip(self, source: str, row: int, reason: str, bad: bool) -> str:
        """Count one skipped row under ``reason`` (numbers in it generalised to N); returns the reason counted."""
        reason = re.sub(r"\d+", "N", reason)
        entry = self.skipped.setdefault(reason, {"count": 0, "bad": bad, "examples": []})
        entry["count"] += 1
        if len(entry["examples"]) < EXAMPLES:
            entry["examples"].append(f"{source}, row {row}")
        return reason

    def count(self, kind: str, what: str, n: int) -> None:
        """Add ``n`` to ``truncated`` / ``dropped`` (``kind``) under ``what`` (e.g. ``'train prompt'``)."""
        if n:
            bucket = getattr(self, kind)
            bucket[what] = bucket.get(what, 0) + n

    def lengths(self, split: str, part: str, values: list[int]) -> None:
        """Record token-length percentiles of ``values`` (tokens per row) for ``split`` / ``part``."""
        if values:
            ordered = sorted(values)
            pick = {f"p{q}": ordered[min(len(ordered) - 1, len(ordered) * q // 100)] for q in (50, 90, 99)}
            self.token_lengths.setdefault(split, {})[part] = {**pick, "max": ordered[-1]}

    def turns_trained(self, split: str, conversations: int, trained: int, tool_calls: int, cut: int) -> None:
        """Add to ``turns[split]``: ``conversations`` (SFT rows kept, each one or more assistant turns),
        ``assistant_turns_trained`` (target turns, tool calls included), ``tool_calls_trained`` (of those, tool calls)
        and ``turns_cut`` (target turns not trained in full: the reply cut at max_length, or left out after it)."""
        entry = self.turns.setdefault(split, dict.fromkeys(
            ("conversations", "assistant_turns_trained", "tool_calls_trained", "turns_cut"), 0))
        for key, n in zip(entry, (conversations, trained, tool_calls, cut)):
            entry[key] += n

    def summary(self) -> str:
        """One line: rows read, records, split sizes, skipped by reason, truncated, dropped, SFT turns per split."""
        read, records = (sum(s[k] for s in self.sources) for k in ("rows_read", "records"))
        split = f" -> {self.train_size} train / {self.eval_size} eval" if self.train_size else ""
        skipped = "; ".join(f"{reason}: {e['count']}" for reason, e in self.skipped.items()) or "none"
        extra = "".join(f", {kind} {d}" for kind, d in (("truncated", self.truncated), ("dropped", self.dropped)) if d)
        system = f", system turns dropped {self.system_turns_dropped}" if self.system_turns_dropped else ""
        turns = "".join(f"; {name}: {t['conversations']} conversations, {t['assistant_turns_trained']} assistant turns "
                        f"trained ({t['tool_calls_trained']} tool calls), {t['turns_cut']} cut"
                        for name, t in self.turns.items())
        head = f"{self.stage} data: {read} rows read, {records} records{split}"
        return f"{head}; skipped: {skipped}{extra}{system}{turns}"

    def write(self, output_dir: str) -> str:
        """Write ``output_dir/data_report.json`` and log `summary`; returns the path."""
        path = os.path.join(output_dir, "data_report.json")
        os.makedirs(output_dir, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(asdict(self), f, ensure_ascii=False, indent=2)
        logger.info("%s (%s)", self.summary(), path)
        return path

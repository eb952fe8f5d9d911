"""The one data formatter shared by SFT, reward-model and PPO stages (errors name the file, the row and the field:
`DataError`), in three steps:
1. **read** (`.read`) local files (also compressed), globs, shard directories or a hub dataset, in Arrow batches;
2. **normalise** (`.normalise`, `.rows`, `.turns`) each row, whatever its format (`FORMATS`), into records: SFT
   ``{"question", "history", "answer"}``, pairs ``{..., "chosen", "rejected"}``, prompts ``{"question", "history"}``
   (+ ``"columns"``, ``"system"``, ``"text"``, ``"messages"`` / ``"tools"`` where the row has them); bad rows follow
   ``on_bad_row``, every skip counted in a `DataReport`;
3. **tokenize** (`.features`): ``prompt_ids + response_ids + [eos]``, each part tokenized on its own as PPO joins
   prompt and generated ids, so the reward model scores the ids it was trained on (no tokens merged across ``"答："``)."""

from __future__ import annotations

import dataclasses
import difflib
import logging
import random
from typing import Literal

# re-exported: the public API of the data modules
from .args import (DEFAULT_ASSISTANT_MARKER, DEFAULT_COMPLETION_TEMPLATE, DEFAULT_HUMAN_MARKER,  # noqa: F401
                   DEFAULT_PROMPT_TEMPLATE, FORMATS, HISTORY_SEPARATOR, RAW_TEMPLATE, DataArguments, DataError,
                   Template)
from .features import (chat_end_of_turn_id, encode_prompt, encode_response, pair_features,  # noqa: F401
                       prompt_features, response_eos_id, sft_features, unpaired_features)
from .normalise import _counted, _normalise
from .read import (BATCH_ROWS, COMPRESSIONS, LOCAL_LOADERS, _arrow_batches, dialogue_counts, load_rows,  # noqa: F401
                   source_name)
from .report import DataReport
from .rows import (ANSWER_KEYS, QUESTION_KEYS, ROLES, SkipRow, _dialogue, _implicit, _pair_rows,  # noqa: F401
                   _prompt_row, _sft_row, detect_format, prompt_columns, split_transcript)

logger = logging.getLogger(__name__)


def sft_records(rows: list[dict], args: DataArguments, source: str) -> list[dict]:
    """In-memory rows as SFT records (target: the last assistant turn, or the chosen answer). Raises `DataError`."""
    return _normalise("sft", [rows], args, source)


def pair_records(rows: list[dict], args: DataArguments, source: str) -> list[dict]:
    """In-memory rows as pairs (ranked lists: all ordered or adjacent pairs, `ranked_pairs`). Raises `DataError`."""
    return _normalise("pairs", [rows], args, source)


def unpaired_records(rows: list[dict], args: DataArguments, source: str) -> list[dict]:
    """In-memory rows as KTO examples (``"answer"``, ``"label"``; a pair: two). Raises `DataError`."""
    return _normalise("unpaired", [rows], args, source)


def prompt_records(rows: list[dict], args: DataArguments, source: str) -> list[dict]:
    """In-memory rows as prompts (lists of user turns: ``prompt_turn``; extras: ``"columns"``). Raises `DataError`."""
    return _normalise("prompts", [rows], args, source)


def split_records(records: list[dict], eval_split_size: float, seed: int,
                  report: DataReport | None = None) -> tuple[list[dict], list[dict]]:
    """Seeded shuffle, ``eval_split_size`` (fraction or rows) split off. Raises `DataError`: no train row."""
    rows = list(records)
    random.Random(seed).shuffle(rows)
    n_eval = int(round(len(rows) * eval_split_size)) if eval_split_size < 1 else int(eval_split_size)
    if n_eval >= len(rows):
        raise DataError("eval_split_size", f"{eval_split_size} leaves no training record of the {len(rows)} read; "
                                           "lower it (a fraction < 1, or a row count below the records)")
    if report is not None:
        report.train_size, report.eval_size = len(rows) - n_eval, n_eval
    return rows[n_eval:], rows[:n_eval]


SOURCE_KEYS = ("dataset_name", "dataset_config", "dataset_split", "dataset_format", "max_samples", "question_key",
               "input_key", "answer_key", "good_key", "bad_key", "history_key", "conversations_key", "messages_key",
               "prompt_turn", "human_marker", "assistant_marker", "dataset_encoding")


def sources(args: DataArguments) -> list[DataArguments]:
    """The recipe's data sources: ``dataset_name`` (if set) then each entry of ``datasets``, which inherits the
    recipe's other fields and sets its own `SOURCE_KEYS` (unset: the defaults; ``max_samples``, ``dataset_split``:
    the recipe's). Raises `ValueError`: no source, or an entry with an unknown key or without ``dataset_name``."""
    out = [args] if args.dataset_name else []
    for j, entry in enumerate(args.datasets or []):
        if not isinstance(entry, dict) or not entry.get("dataset_name"):
            raise ValueError(f"datasets[{j}] must be a mapping with a dataset_name, got {entry!r}")
        if unknown := sorted(set(entry) - set(SOURCE_KEYS)):
            close = {k: difflib.get_close_matches(k, SOURCE_KEYS, 1) for k in unknown}
            hint = "; ".join(f"did you mean {c[0]!r} for {k!r}?" for k, c in close.items() if c)
            raise ValueError(f"datasets[{j}] ({entry['dataset_name']}): unknown key(s) {unknown}; "
                             f"{hint or f'use {SOURCE_KEYS}'}")
        defaults = {k: f.default for k, f in DataArguments.__dataclass_fields__.items()
                    if k in SOURCE_KEYS and k not in ("max_samples", "dataset_split")}
        out.append(dataclasses.replace(args, datasets=[], **{**defaults, **entry}))
    if not out:
        raise ValueError("the recipe names no data: set dataset_name (a local file or a hub dataset id) or datasets")
    return out


def describe_sources(args: DataArguments) -> str:
    """The recipe's data files / dataset ids, comma-separated (for messages)."""
    names = [source_name(args.dataset_name)] if args.dataset_name else []
    names += [source_name(e.get("dataset_name")) for e in args.datasets or [] if isinstance(e, dict)]
    return ", ".join(names) or "<no dataset>"


def read_records(args: DataArguments, kind: Literal["sft", "pairs", "prompts", "unpaired"],
                 report: DataReport | None = None) -> list[dict]:
    """Read every source of the recipe (`sources`) into records of ``kind``, in Arrow batches. Raises `DataError`."""
    records = []
    if report is not None:
        report.template = Template.from_args(args).mode
    for src in sources(args):
        name = source_name(src.dataset_name)
        shapes: dict = {}  # JSON arrays of dialogue lists: each row's length (`_arrow_batches`)
        counted = _counted(_arrow_batches(src.dataset_name, src.dataset_split, src.dataset_config, BATCH_ROWS,
                                          src.dataset_encoding, shapes), src.max_samples)
        part = _normalise(kind, counted, src, name, report)
        if report is not None and "dialogue_lengths" in shapes:  # in data_report.json, beside the source's counts
            report.sources[-1]["dialogue_lists"] = dialogue_counts(shapes["dialogue_lengths"][:counted.rows], kind)
        logger.info("%s: %d rows -> %d %s records", name, counted.rows, len(part), kind)
        records.extend(part)
    return records



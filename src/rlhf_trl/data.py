"""The one data formatter shared by SFT, reward-model and PPO stages.

Every stage goes through the same three steps:

1. **read** a local file (json / jsonl / csv / parquet) or a hub dataset through `datasets`;
2. **normalise** each row into plain records, whatever the source format:
   - SFT: ``{"question", "answer"}``
   - pairs: ``{"question", "chosen", "rejected"}``
   - prompts: ``{"question"}``
   Supported sources: alpaca (instruction / input / output [/ history]), sharegpt-style conversations
   (``[{from, value}]``, optionally with ``chosen`` / ``rejected``), prompt / chosen / rejected, and ranked answer
   lists (best first; expanded to all ordered pairs or adjacent pairs);
3. **tokenize** with one construction used by every stage: ``prompt_ids + response_ids + [eos]`` where
   ``prompt_ids = tokenize(template.prompt)`` and ``response_ids = tokenize(template.completion)``, each tokenized on
   its own. PPO concatenates prompt ids and generated response ids the same way, so the token ids the reward model
   is trained on equal the ids it scores during PPO (joining the strings first would merge tokens across the
   ``"答："`` boundary with byte-level BPE).

Errors name the file, the row and the field (`DataError`).
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal

logger = logging.getLogger(__name__)

DEFAULT_PROMPT_TEMPLATE = "问：{question}\n\n答："
DEFAULT_COMPLETION_TEMPLATE = "{answer}"
HISTORY_SEPARATOR = "\n\n"

FORMATS = ("auto", "alpaca", "sharegpt", "pairwise", "ranked", "prompt")
LOCAL_LOADERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


class DataError(ValueError):
    """Bad input data. The message names the file, and for row-level problems the row (0-based) and field."""

    def __init__(self, source: str, message: str, row: int | None = None, field: str | None = None):
        where = source
        if row is not None:
            where += f", row {row}"
        if field is not None:
            where += f", field '{field}'"
        super().__init__(f"{where}: {message}")
        self.source, self.row, self.field = source, row, field


@dataclass
class DataArguments:
    """Data fields shared by every stage's recipe (parsed by `TrlParser` next to the TRL config)."""

    dataset_name: str | None = field(
        default=None,
        metadata={"help": "Local file (.json/.jsonl/.csv/.parquet) or a hub dataset id."},
    )
    datasets: list[dict] = field(
        default_factory=list,
        metadata={
            "help": "More sources, concatenated after dataset_name (recipe YAML only): a list of mappings, each with "
            "dataset_name and optionally dataset_split, dataset_format, max_samples and the *_key column mapping."
        },
    )
    dataset_split: str = field(default="train", metadata={"help": "Split to read (hub datasets / local files)."})
    dataset_format: str = field(
        default="auto",
        metadata={"help": f"One of {FORMATS}. 'auto' detects it from the columns of the first row."},
    )
    question_key: str | None = field(
        default=None, metadata={"help": "Column holding the question (default: instruction / prompt / question)."}
    )
    input_key: str | None = field(
        default=None, metadata={"help": "Column appended to the question on a new line (default: input)."}
    )
    answer_key: str | None = field(
        default=None,
        metadata={"help": "Column holding the answer, or the ranked answer list (default: output / answer)."},
    )
    good_key: str | None = field(default=None, metadata={"help": "Column holding the preferred answer (chosen)."})
    bad_key: str | None = field(default=None, metadata={"help": "Column holding the rejected answer."})
    history_key: str | None = field(
        default=None, metadata={"help": "Column with earlier turns as [[question, answer], ...] (default: history)."}
    )
    conversations_key: str | None = field(
        default=None, metadata={"help": "Column with sharegpt turns [{from, value}] (default: conversations)."}
    )
    prompt_template: str = field(
        default=DEFAULT_PROMPT_TEMPLATE, metadata={"help": "Prompt template; must contain '{question}'."}
    )
    completion_template: str = field(
        default=DEFAULT_COMPLETION_TEMPLATE, metadata={"help": "Completion template; must contain '{answer}'."}
    )
    ranked_pairs: str = field(
        default="all",
        metadata={"help": "Ranked answer lists (best first) -> 'all' ordered pairs, or 'adjacent' pairs only."},
    )
    eval_split_size: float = field(
        default=0.05, metadata={"help": "Held-out fraction (<1) or number of rows (>=1) for evaluation."}
    )
    max_samples: int | None = field(default=None, metadata={"help": "Use at most this many rows (after reading)."})
    max_prompt_length: int = field(
        default=256, metadata={"help": "Prompt tokens kept (from the right) for PPO prompts and truncated RM pairs."}
    )
    length_policy: str = field(
        default="drop",
        metadata={
            "help": "RM pairs longer than max_length (tokens): 'drop' them, or 'truncate_prompt' from the left "
            "keeping the whole responses."
        },
    )


@dataclass(frozen=True)
class Template:
    """The prompt / completion template, e.g. ``问：{question}\\n\\n答：`` + ``{answer}`` (+ EOS at tokenization)."""

    prompt: str = DEFAULT_PROMPT_TEMPLATE
    completion: str = DEFAULT_COMPLETION_TEMPLATE

    def __post_init__(self):
        if "{question}" not in self.prompt:
            raise ValueError(f"prompt_template must contain '{{question}}', got {self.prompt!r}")
        if "{answer}" not in self.completion:
            raise ValueError(f"completion_template must contain '{{answer}}', got {self.completion!r}")

    @classmethod
    def from_args(cls, args: DataArguments) -> "Template":
        return cls(prompt=args.prompt_template, completion=args.completion_template)

    def format_prompt(self, question: str, history: list[tuple[str, str]] | None = None) -> str:
        """Render the prompt text. Earlier turns are rendered with the same template, separated by a blank line."""
        parts = [self.prompt.replace("{question}", q) + self.completion.replace("{answer}", a) for q, a in history or []]
        parts.append(self.prompt.replace("{question}", question))
        return HISTORY_SEPARATOR.join(parts)

    def format_completion(self, answer: str) -> str:
        """Render the completion text (EOS is appended as a token id by `encode_response`, not as text)."""
        return self.completion.replace("{answer}", answer)


# ----------------------------------------------------------------------------------------------------------------
# reading
# ----------------------------------------------------------------------------------------------------------------
def load_rows(dataset_name: str, split: str = "train") -> list[dict]:
    """Read a local json / jsonl / csv / parquet file (or a hub dataset id) into a list of row dicts.

    Raises:
        DataError: the file is missing, cannot be parsed, or holds no rows.
    """
    import datasets

    ext = os.path.splitext(dataset_name)[1].lower()
    with _quiet_datasets():
        return _load_rows(dataset_name, split, ext, datasets)


@contextmanager
def _quiet_datasets():
    """No progress bars or error logs from `datasets` while reading: a bad file gets one `DataError` line instead."""
    import datasets

    bars = datasets.utils.logging.is_progress_bar_enabled()
    level = datasets.utils.logging.get_verbosity()
    datasets.utils.logging.disable_progress_bar()
    datasets.utils.logging.set_verbosity(logging.CRITICAL)
    try:
        yield
    finally:
        datasets.utils.logging.set_verbosity(level)
        if bars:
            datasets.utils.logging.enable_progress_bar()


def _load_rows(dataset_name: str, split: str, ext: str, datasets) -> list[dict]:
    is_local = os.path.exists(dataset_name) or ext in LOCAL_LOADERS
    if is_local:
        if not os.path.isfile(dataset_name):
            raise DataError(dataset_name, "file not found")
        if ext not in LOCAL_LOADERS:
            raise DataError(dataset_name, f"unsupported file type '{ext}'; use one of {sorted(LOCAL_LOADERS)}")
        try:
            ds = datasets.load_dataset(LOCAL_LOADERS[ext], data_files=dataset_name, split="train")
        except Exception as exc:  # datasets wraps parser errors in several exception types
            raise DataError(dataset_name, f"cannot be read as {ext[1:]}: {_root_cause(exc)}") from None
    else:
        ds = datasets.load_dataset(dataset_name, split=split)
    rows = ds.to_list()
    if not rows:
        raise DataError(dataset_name, "holds no rows")
    return rows


def _root_cause(exc: BaseException) -> str:
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    return f"{type(exc).__name__}: {exc}".strip()


def detect_format(row: dict, args: DataArguments) -> str:
    """Guess the source format from the keys of one row (honouring the recipe's column mapping)."""
    keys = set(row)
    conv = args.conversations_key or "conversations"
    answer = args.answer_key or _first(keys, ("output", "answer", "response"))
    if conv in keys:
        return "sharegpt"
    if (args.good_key or "chosen") in keys and (args.bad_key or "rejected") in keys:
        return "pairwise"
    if answer is not None and answer in keys:
        return "ranked" if isinstance(row[answer], list) else "alpaca"
    return "prompt"


def _first(keys: Iterable[str], candidates: Iterable[str]) -> str | None:
    for c in candidates:
        if c in keys:
            return c
    return None


def _text(row: dict, key: str, source: str, i: int, allow_empty: bool = False) -> str:
    if key not in row:
        raise DataError(source, f"missing column (columns: {sorted(row)}); map it in the recipe", i, key)
    value = row[key]
    if value is None:  # json/jsonl rows are read as one table: a key absent from this row reads as null
        raise DataError(source, "is null or missing in this row", i, key)
    if not isinstance(value, str):
        raise DataError(source, f"must be a string, got {type(value).__name__}", i, key)
    if not allow_empty and not value.strip():
        raise DataError(source, "is empty", i, key)
    return value


def _question(row: dict, args: DataArguments, source: str, i: int) -> str:
    qkey = args.question_key or _first(row, ("instruction", "prompt", "question", "query")) or "instruction"
    question = _text(row, qkey, source, i)
    ikey = args.input_key or "input"
    extra = row.get(ikey)
    if extra is not None:
        extra = _text(row, ikey, source, i, allow_empty=True)
        if extra.strip():
            question = f"{question}\n{extra}"
    return question


def _history(row: dict, args: DataArguments, source: str, i: int) -> list[tuple[str, str]]:
    hkey = args.history_key or "history"
    history = row.get(hkey) or []
    if not isinstance(history, list) or not all(
        isinstance(t, (list, tuple)) and len(t) == 2 and all(isinstance(x, str) for x in t) for t in history
    ):
        raise DataError(source, "must be a list of [question, answer] string pairs", i, hkey)
    return [(q, a) for q, a in history]


def _sharegpt_turns(row: dict, args: DataArguments, source: str, i: int) -> list[tuple[str, str]]:
    """Return [(role, text)] with role in {'user', 'assistant'} from [{from, value}] turns."""
    ckey = args.conversations_key or "conversations"
    turns = row.get(ckey)
    if not isinstance(turns, list) or not turns:
        raise DataError(source, "must be a non-empty list of {from, value} turns", i, ckey)
    out = []
    for j, turn in enumerate(turns):
        if not isinstance(turn, dict) or "value" not in turn:
            raise DataError(source, f"turn {j} must be a {{from, value}} object", i, ckey)
        role = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}.get(
            turn.get("from", turn.get("role"))
        )
        if role is None:
            continue  # system / tool turns are not part of the single-turn template
        if not isinstance(turn["value"], str) or not turn["value"].strip():
            raise DataError(source, f"turn {j} has an empty or non-string value", i, ckey)
        out.append((role, turn["value"]))
    return out


def _split_conversation(turns: list[tuple[str, str]], source: str, i: int, key: str, needs_answer: bool):
    """Split turns into (history pairs, last question, last answer or None)."""
    if needs_answer:
        if len(turns) < 2 or turns[-1][0] != "assistant" or turns[-2][0] != "user":
            raise DataError(source, "must end with a user turn followed by an assistant turn", i, key)
        body, question, answer = turns[:-2], turns[-2][1], turns[-1][1]
    else:
        if not turns or turns[-1][0] != "user":
            raise DataError(source, "must end with a user turn", i, key)
        body, question, answer = turns[:-1], turns[-1][1], None
    history = [(body[k][1], body[k + 1][1]) for k in range(0, len(body) - 1, 2)]
    return history, question, answer


def _answer_text(value: Any, source: str, i: int, key: str) -> str:
    if isinstance(value, dict):  # LLaMA-Factory sharegpt pairs: {"from": "gpt", "value": "..."}
        value = value.get("value")
    if value is None:
        raise DataError(source, "is null or missing in this row", i, key)
    if not isinstance(value, str):
        raise DataError(source, f"must be a string, got {type(value).__name__}", i, key)
    if not value.strip():
        raise DataError(source, "is empty", i, key)
    return value


def sft_records(rows: list[dict], args: DataArguments, source: str) -> list[dict]:
    """Normalise rows into SFT records ``{"question", "history", "answer"}``.

    Accepts alpaca, sharegpt (last user -> assistant exchange is the target) and pairwise rows (the chosen answer).

    Raises:
        DataError: a row lacks a mapped column, or a field is null, empty or not a string.
    """
    fmt = _resolve_format(rows, args, source)
    out = []
    for i, row in enumerate(rows):
        _check_same_format(row, fmt, args, source, i)
        if fmt == "sharegpt":
            key = args.conversations_key or "conversations"
            turns = _sharegpt_turns(row, args, source, i)
            history, question, answer = _split_conversation(turns, source, i, key, needs_answer=True)
        elif fmt == "pairwise":
            history, question = _history(row, args, source, i), _question(row, args, source, i)
            key = args.good_key or "chosen"
            answer = _answer_text(row.get(key), source, i, key)
        elif fmt in ("alpaca", "ranked"):
            history, question = _history(row, args, source, i), _question(row, args, source, i)
            key = args.answer_key or _first(row, ("output", "answer", "response")) or "output"
            value = row.get(key)
            if fmt == "ranked":
                if not isinstance(value, list) or not value:
                    raise DataError(source, "must be a non-empty list of answers", i, key)
                value = value[0]
            answer = _answer_text(value, source, i, key) if key in row else _text(row, key, source, i)
        else:
            raise DataError(source, f"format '{fmt}' has no answers to fine-tune on")
        out.append({"question": question, "history": history, "answer": answer})
    return out


def pair_records(rows: list[dict], args: DataArguments, source: str) -> list[dict]:
    """Normalise rows into preference pairs ``{"question", "history", "chosen", "rejected"}``.

    Ranked answer lists (best first) give all ordered pairs (``n*(n-1)/2`` for ``n`` answers) when
    ``ranked_pairs='all'``, or the ``n-1`` adjacent pairs when ``ranked_pairs='adjacent'``. An answer repeated
    verbatim in a ranked list (real human-ranked data has them, e.g. oasst) counts once, at its best rank, so
    ``n`` is the number of distinct answers; a list with a single distinct answer gives no pair.

    Raises:
        DataError: missing / empty fields, a ranked list with fewer than two answers, or chosen == rejected
            (pairwise rows).
    """
    if args.ranked_pairs not in ("all", "adjacent"):
        raise ValueError(f"ranked_pairs must be 'all' or 'adjacent', got {args.ranked_pairs!r}")
    fmt = _resolve_format(rows, args, source)
    out = []
    deduplicated = 0
    for i, row in enumerate(rows):
        _check_same_format(row, fmt, args, source, i)
        if fmt == "sharegpt":
            key = args.conversations_key or "conversations"
            turns = _sharegpt_turns(row, args, source, i)
            history, question, _ = _split_conversation(turns, source, i, key, needs_answer=False)
        else:
            history, question = _history(row, args, source, i), _question(row, args, source, i)
        if fmt in ("pairwise", "sharegpt"):
            gkey, bkey = args.good_key or "chosen", args.bad_key or "rejected"
            if gkey not in row:
                raise DataError(source, f"missing column (columns: {sorted(row)}); map it in the recipe", i, gkey)
            if bkey not in row:
                raise DataError(source, f"missing column (columns: {sorted(row)}); map it in the recipe", i, bkey)
            ranked = [_answer_text(row[gkey], source, i, gkey), _answer_text(row[bkey], source, i, bkey)]
            pairs = [(0, 1)]
            field_name = f"{gkey}/{bkey}"
        elif fmt == "ranked":
            key = args.answer_key or _first(row, ("output", "answer", "response")) or "output"
            answers = row.get(key)
            if not isinstance(answers, list):
                raise DataError(source, "must be a list of answers ranked best first", i, key)
            if len(answers) < 2:
                raise DataError(source, f"a ranked list needs at least 2 answers, got {len(answers)}", i, key)
            ranked = [_answer_text(a, source, i, f"{key}[{j}]") for j, a in enumerate(answers)]
            if len(set(ranked)) < len(ranked):  # a repeated answer is one answer: keep its best (first) rank
                ranked = list(dict.fromkeys(ranked))
                deduplicated += 1
            n = len(ranked)
            if args.ranked_pairs == "all":
                pairs = [(a, b) for a in range(n) for b in range(a + 1, n)]
            else:
                pairs = [(a, a + 1) for a in range(n - 1)]
            field_name = key
        else:
            raise DataError(source, f"format '{fmt}' holds no preference pairs")
        for a, b in pairs:
            if ranked[a] == ranked[b]:
                raise DataError(source, "chosen and rejected answers are identical", i, field_name)
            out.append({"question": question, "history": history, "chosen": ranked[a], "rejected": ranked[b]})
    if deduplicated:
        logger.warning(
            "%s: %d ranked lists hold repeated answers; each kept once, at its best rank", source, deduplicated
        )
    return out


def prompt_records(rows: list[dict], args: DataArguments, source: str) -> list[dict]:
    """Normalise rows of any supported format into prompts ``{"question", "history"}`` (answers are ignored).

    Raises:
        DataError: the question field is missing, null, empty or not a string.
    """
    fmt = _resolve_format(rows, args, source)
    out = []
    for i, row in enumerate(rows):
        _check_same_format(row, fmt, args, source, i)
        if fmt == "sharegpt":
            key = args.conversations_key or "conversations"
            turns = _sharegpt_turns(row, args, source, i)
            if turns and turns[-1][0] == "assistant":
                turns = turns[:-1]
            history, question, _ = _split_conversation(turns, source, i, key, needs_answer=False)
        else:
            history, question = _history(row, args, source, i), _question(row, args, source, i)
        out.append({"question": question, "history": history})
    return out


def _resolve_format(rows: list[dict], args: DataArguments, source: str) -> str:
    if args.dataset_format not in FORMATS:
        raise ValueError(f"dataset_format must be one of {FORMATS}, got {args.dataset_format!r}")
    if not rows:
        raise DataError(source, "holds no rows")
    return detect_format(rows[0], args) if args.dataset_format == "auto" else args.dataset_format


def _check_same_format(row: dict, fmt: str, args: DataArguments, source: str, i: int) -> None:
    if not isinstance(row, dict):
        raise DataError(source, f"must be an object, got {type(row).__name__}", i)
    if args.dataset_format == "auto" and i > 0:
        got = detect_format(row, args)
        if got != fmt:
            raise DataError(source, f"looks like '{got}' but row 0 is '{fmt}' (mixed formats in one file)", i)


# ----------------------------------------------------------------------------------------------------------------
# tokenization: one construction for every stage
# ----------------------------------------------------------------------------------------------------------------
def _encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of plain text: no BOS/EOS added, and special-token strings in the data ("<|endoftext|>") are
    tokenized as text, so the only EOS / pad ids in a sequence are the ones this module places."""
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def encode_prompt(tokenizer, template: Template, question: str, history=None) -> list[int]:
    """Token ids of the rendered prompt, ``[prompt_len]``, without special tokens."""
    return _encode_text(tokenizer, template.format_prompt(question, history))


def encode_response(tokenizer, template: Template, answer: str) -> list[int]:
    """Token ids of the rendered completion followed by EOS, ``[response_len + 1]``; tokenized on its own."""
    return _encode_text(tokenizer, template.format_completion(answer)) + [tokenizer.eos_token_id]


def sft_features(
    records: list[dict], tokenizer, template: Template, max_length: int | None = None, source: str = "dataset"
) -> dict[str, list]:
    """Tokenize SFT records into ``input_ids`` and ``completion_mask`` (1 on response tokens incl. EOS).

    Returns columns for `trl.SFTTrainer` (pre-tokenized datasets skip its own tokenization), each a list of
    ``[prompt_len + response_len + 1]`` lists. Rows whose prompt alone fills ``max_length`` tokens (truncation would
    leave no answer token to learn from) are dropped and counted in a warning.

    Raises:
        DataError: no row is left.
    """
    input_ids, masks = [], []
    dropped = 0
    for r in records:
        p = encode_prompt(tokenizer, template, r["question"], r.get("history"))
        c = encode_response(tokenizer, template, r["answer"])
        if max_length is not None and len(p) >= max_length:
            dropped += 1
            continue
        input_ids.append(p + c)
        masks.append([0] * len(p) + [1] * len(c))
    if dropped:
        logger.warning("%s: %d of %d rows dropped: the prompt alone fills max_length=%s tokens",
                       source, dropped, len(records), max_length)
    if records and not input_ids:
        raise DataError(source, f"no row is left: every prompt fills max_length={max_length} tokens (raise max_length)")
    return {"input_ids": input_ids, "completion_mask": masks}


def pair_features(
    records: list[dict],
    tokenizer,
    template: Template,
    max_length: int | None = None,
    length_policy: Literal["drop", "truncate_prompt"] = "drop",
    source: str = "dataset",
) -> dict[str, list]:
    """Tokenize pairs into ``chosen_ids`` / ``rejected_ids`` (prompt ids + response ids + EOS) for `RewardTrainer`.

    Pairs longer than ``max_length`` tokens are dropped (``length_policy='drop'``) or have their prompt truncated
    from the left so that the longer response still fits whole (``'truncate_prompt'``; a pair whose response alone
    exceeds ``max_length`` is dropped). Counts of dropped / truncated pairs are logged.

    Raises:
        DataError: no pair is left.
    """
    if length_policy not in ("drop", "truncate_prompt"):
        raise ValueError(f"length_policy must be 'drop' or 'truncate_prompt', got {length_policy!r}")
    out = {"chosen_ids": [], "rejected_ids": [], "prompt_length": []}
    dropped = truncated = 0
    for r in records:
        p = encode_prompt(tokenizer, template, r["question"], r.get("history"))
        c = encode_response(tokenizer, template, r["chosen"])
        j = encode_response(tokenizer, template, r["rejected"])
        longest = max(len(c), len(j))
        if max_length is not None and len(p) + longest > max_length:
            room = max_length - longest
            if length_policy == "drop" or room < 1:
                dropped += 1
                continue
            p = p[-room:]
            truncated += 1
        out["chosen_ids"].append(p + c)
        out["rejected_ids"].append(p + j)
        out["prompt_length"].append(len(p))
    if dropped or truncated:
        logger.warning(
            "%s: %d of %d pairs dropped and %d truncated (max_length=%s tokens, length_policy=%s)",
            source, dropped, len(records), truncated, max_length, length_policy,
        )
    if not out["chosen_ids"]:
        raise DataError(
            source,
            f"no pair is left: all {len(records)} pairs exceed max_length={max_length} tokens "
            f"(raise max_length or set length_policy: truncate_prompt)",
        )
    return out


def prompt_features(records: list[dict], tokenizer, template: Template, max_prompt_length: int) -> dict[str, list]:
    """Tokenize prompts for PPO: ``input_ids`` of ``[<= max_prompt_length]`` tokens (kept from the right).

    Left padding is applied by the collator (the tokenizer's ``padding_side`` must be ``'left'``).
    """
    ids = [encode_prompt(tokenizer, template, r["question"], r.get("history"))[-max_prompt_length:] for r in records]
    return {"input_ids": ids}


def split_records(records: list[dict], eval_split_size: float, seed: int) -> tuple[list[dict], list[dict]]:
    """Shuffle deterministically and split off ``eval_split_size`` (fraction < 1, or a row count) for evaluation."""
    import random

    rows = list(records)
    random.Random(seed).shuffle(rows)
    n_eval = int(round(len(rows) * eval_split_size)) if eval_split_size < 1 else int(eval_split_size)
    n_eval = min(max(n_eval, 0), len(rows) - 1)
    return rows[n_eval:], rows[:n_eval]


SOURCE_KEYS = (
    "dataset_name", "dataset_split", "dataset_format", "max_samples", "question_key", "input_key", "answer_key",
    "good_key", "bad_key", "history_key", "conversations_key",
)


def sources(args: DataArguments) -> list[DataArguments]:
    """The recipe's data sources: ``dataset_name`` (if set) then each entry of ``datasets``.

    Each entry of ``datasets`` inherits the template, ``ranked_pairs``, ``max_samples`` and ``dataset_split`` of the
    recipe and sets its own ``dataset_name``, format and column mapping (`SOURCE_KEYS`); mapping keys it does not
    set start from their defaults.

    Raises:
        ValueError: no source at all, or an entry with an unknown key or without ``dataset_name``.
    """
    import dataclasses

    out = [args] if args.dataset_name else []
    for j, entry in enumerate(args.datasets or []):
        if not isinstance(entry, dict) or not entry.get("dataset_name"):
            raise ValueError(f"datasets[{j}] must be a mapping with a dataset_name, got {entry!r}")
        unknown = sorted(set(entry) - set(SOURCE_KEYS))
        if unknown:
            raise ValueError(f"datasets[{j}] ({entry['dataset_name']}): unknown key(s) {unknown}; use {SOURCE_KEYS}")
        defaults = {  # mapping keys start from their defaults; max_samples and dataset_split are inherited
            k: f.default for k, f in DataArguments.__dataclass_fields__.items()
            if k in SOURCE_KEYS and k not in ("max_samples", "dataset_split")
        }
        out.append(dataclasses.replace(args, datasets=[], **{**defaults, **entry}))
    if not out:
        raise ValueError("the recipe names no data: set dataset_name (a local file or a hub dataset id) or datasets")
    return out


def describe_sources(args: DataArguments) -> str:
    """The recipe's data files / dataset ids, comma-separated (for messages)."""
    names = [args.dataset_name] if args.dataset_name else []
    names += [str(e.get("dataset_name")) for e in args.datasets or [] if isinstance(e, dict)]
    return ", ".join(names) or "<no dataset>"


def read_records(args: DataArguments, kind: Literal["sft", "pairs", "prompts"]) -> list[dict]:
    """Read every source of the recipe (`sources`) and normalise it into records of ``kind`` (see module doc).

    Raises:
        DataError: see `load_rows`, `sft_records`, `pair_records`, `prompt_records`.
    """
    fn = {"sft": sft_records, "pairs": pair_records, "prompts": prompt_records}[kind]
    records = []
    for src in sources(args):
        rows = load_rows(src.dataset_name, src.dataset_split)
        if src.max_samples is not None:
            rows = rows[: src.max_samples]
        part = fn(rows, src, src.dataset_name)
        logger.info("%s: %d rows -> %d %s records", src.dataset_name, len(rows), len(part), kind)
        records.extend(part)
    return records

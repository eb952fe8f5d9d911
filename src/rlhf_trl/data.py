"""The one data formatter shared by SFT, reward-model and PPO stages, in three steps:

1. **read** (`data_read`) local json / jsonl / csv / parquet files (optionally .gz / .bz2 / .xz / .zst / .lz4), a list
   or glob of them, a directory of shards, or a hub dataset (config name, split) through `datasets`, in Arrow batches;
2. **normalise** (`data_rows`) each row, whatever its format (`FORMATS`, auto-detected from the first row: alpaca,
   sharegpt, OpenAI / TRL messages, TRL conversational / prompt-completion rows, prompt / chosen / rejected,
   implicit-prompt pairs, ranked answer lists, prompt-only rows), into records: SFT ``{"question", "history",
   "answer"}``, pairs ``{"question", "history", "chosen", "rejected"}``, prompts ``{"question", "history"}`` (+
   ``"columns"``: extra scalar columns, `prompt_columns`); plus ``"system"`` and ``"text"`` (a prompt carrying its
   own turns, e.g. ``"\n\nHuman: ...\n\nAssistant:"``, rendered verbatim) where the row has them. ``history`` is a
   list of earlier ``(question, answer)`` turns;
3. **tokenize** (`data_features`) every stage alike: ``prompt_ids + response_ids + [eos]``, prompt and response each
   tokenized on its own. Text templates (default ``问：{question}\n\n答：`` / ``{answer}``, or ``raw``): ``eos`` is
   the tokenizer's EOS; ``chat_template: true``: the prompt is ``apply_chat_template(messages,
   add_generation_prompt=True)`` and ``eos`` the template's end-of-turn token (`chat_end_of_turn_id`). PPO joins
   prompt and generated ids the same way, so the reward model scores the very ids it was trained on (joining strings
   first would merge tokens across the ``"答："`` boundary with byte-level BPE).

Errors name the file, the row and the field (`DataError`).
"""

from __future__ import annotations

import logging
from typing import Iterable, Literal

# re-exported: the public API of the data modules
from .data_args import (DEFAULT_ASSISTANT_MARKER, DEFAULT_COMPLETION_TEMPLATE, DEFAULT_HUMAN_MARKER,  # noqa: F401
                        DEFAULT_PROMPT_TEMPLATE, FORMATS, HISTORY_SEPARATOR, RAW_TEMPLATE, DataArguments, DataError,
                        Template)
from .data_features import (chat_end_of_turn_id, encode_prompt, encode_response, pair_features,  # noqa: F401
                            prompt_features, response_eos_id, sft_features)
from .data_read import (BATCH_ROWS, COMPRESSIONS, LOCAL_LOADERS, _arrow_batches, iter_row_batches,  # noqa: F401
                        load_rows, source_name)
from .data_rows import (ANSWER_KEYS, QUESTION_KEYS, ROLES, _dialogue, _implicit, _pair_rows, _prompt_row,  # noqa: F401
                        _sft_row, detect_format, prompt_columns, split_transcript)

logger = logging.getLogger(__name__)

_ROLE_CODES = {"system": 1, "user": 2, "assistant": 3}  # codes of `_message_records`' role signatures; 0: bad
_ROLE_NAMES = {code: role for role, code in _ROLE_CODES.items()}


def _is_message_column(schema, key: str) -> bool:
    """Whether column ``key`` is a list of structs with string ``role`` and ``content`` fields (others may follow)."""
    import pyarrow as pa

    k = schema.get_field_index(key)
    if k < 0:
        return False
    kind = schema.field(k).type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_struct(kind.value_type):
        return False
    struct = kind.value_type
    return all(struct.get_field_index(name) >= 0 and (pa.types.is_string(struct.field(name).type)
                                                       or pa.types.is_large_string(struct.field(name).type))
               for name in ("role", "content"))


def _message_plan(signature: bytes, end: str) -> tuple | None:
    """Where a row's record comes from, for rows whose messages have the role codes ``signature`` (all valid):
    ``(system, start, question, answer)``, indices into the row's message contents (``system`` / ``answer`` None where
    absent; the history pairs are ``contents[start:question]`` two by two). Found by running `_dialogue` itself on the
    messages' indices in place of their texts, so the records built from it are the ones `_dialogue` gives. None:
    `_dialogue` refuses these roles, or its result has another layout; such rows take the plain path."""
    if not signature or 0 in signature:
        return None
    try:
        system, history, question, answer = _dialogue([(_ROLE_NAMES[c], k) for k, c in enumerate(signature)],
                                                      "", 0, "", end)
    except DataError:
        return None
    start = question - 2 * len(history)
    if history != [(k, k + 1) for k in range(start, question, 2)]:
        return None
    return system, start, question, answer


def _message_records(column, end: str, plans: dict) -> list[dict | None]:
    """SFT records (``end='assistant'``) or prompts (``'user'``; without ``"columns"``) of one Arrow batch of a
    ``messages`` column (`_is_message_column`), each equal to what `_sft_row` / `_prompt_fields` give for the row, or
    None for a row those must handle (null / empty list or message, unknown / null role, null / blank content, roles
    `_dialogue` refuses): the plain path then reads it, with its exact errors. Faster than `RecordBatch.to_pylist`:
    contents come from the flat child array in one call, roles as a byte per message (`_ROLE_CODES`), and each distinct
    role sequence is resolved once (`_message_plan`, cached in ``plans``)."""
    import numpy as np
    import pyarrow.compute as pc

    offsets = column.offsets.to_numpy()
    first = int(offsets[0])
    messages = column.values.slice(first, int(offsets[-1]) - first)
    roles, contents = messages.field("role"), messages.field("content")
    texts = contents.to_pylist()
    coded = pc.dictionary_encode(roles)
    codes = np.array([_ROLE_CODES.get(ROLES.get(r), 0) for r in coded.dictionary.to_pylist()] + [0], np.uint8)
    codes = codes[pc.fill_null(coded.indices, len(codes) - 1).to_numpy()]  # a null role -> 0
    if messages.null_count:
        codes[~messages.is_valid().to_numpy(zero_copy_only=False)] = 0
    if not all(texts) or any(map(str.isspace, texts)):  # a null / empty content (falsy), or a blank one
        codes[[not t or t.isspace() for t in texts]] = 0
    signatures = codes.tobytes()
    bounds = (offsets - first).tolist()
    out: list[dict | None] = []
    append = out.append
    for a, b in zip(bounds, bounds[1:]):
        signature = signatures[a:b]
        plan = plans.get(signature, False)
        if plan is False:
            plan = plans[signature] = _message_plan(signature, end)
        if plan is None:
            append(None)
            continue
        system, start, question, answer = plan
        c = texts[a:b]
        rec = {"question": c[question], "history": list(zip(c[start:question:2], c[start + 1:question:2]))}
        if answer is not None:  # keys in `_record`'s order
            rec["answer"] = c[answer]
        if system is not None:
            rec["system"] = c[system]
        append(rec)
    if column.null_count:
        for k in np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False)).tolist():
            out[k] = None
    return out


def _normalise(kind: str, batches: Iterable, args: DataArguments, source: str) -> list[dict]:
    """Normalise batches of rows into records of ``kind`` ('sft' / 'pairs' / 'prompts'); row numbers run on across
    batches. The format is resolved from the first row (``dataset_format: auto``) and checked on every row."""
    if args.dataset_format not in FORMATS:
        raise ValueError(f"dataset_format must be one of {FORMATS}, got {args.dataset_format!r}")
    if kind == "pairs" and args.ranked_pairs not in ("all", "adjacent"):
        raise ValueError(f"ranked_pairs must be 'all' or 'adjacent', got {args.ranked_pairs!r}")
    import gc

    enabled = gc.isenabled()
    gc.disable()  # records hold no reference cycles: the cyclic GC would rescan millions of them for nothing
    try:
        return _normalise_rows(kind, batches, args, source)
    finally:
        if enabled:
            gc.enable()


def _normalise_rows(kind: str, batches: Iterable, args: DataArguments, source: str) -> list[dict]:
    """`_normalise`. ``batches``: lists of row dicts, or Arrow record batches (`_arrow_batches`; one source's rows
    share their columns), converted plainly (`RecordBatch.to_pylist`) or, for the message column of ``messages`` rows
    read as SFT records or prompts, through `_message_records`."""
    out: list[dict] = []
    counts = {"deduplicated": 0}
    fmt = None
    auto = args.dataset_format == "auto"
    i = 0
    for batch in batches:
        arrow = batch.__class__ is not list
        if fmt is None and len(batch):
            row = batch.slice(0, 1).to_pylist()[0] if arrow else batch[0]
            if not isinstance(row, dict):
                raise DataError(source, f"must be an object, got {type(row).__name__}", i)
            fmt = detect_format(row, args) if auto else args.dataset_format
            keys0 = tuple(row)
            by_keys = fmt not in ("alpaca", "ranked")  # these two also depend on the answer's type
            if kind == "pairs" and fmt == "implicit":
                add, one = out.append, lambda r, f, a, s, n: _implicit(r, a, s, n)
            elif kind == "pairs":
                add, one = out.extend, lambda r, f, a, s, n: _pair_rows(r, f, a, s, n, counts)
            else:
                add, one = out.append, _sft_row if kind == "sft" else _prompt_row
            # messages rows: SFT records and prompts come from the message column alone (`_sft_row`, `_prompt_row`)
            fast_key = (args.messages_key or "messages") if fmt == "messages" and kind != "pairs" else None
            plans: dict[bytes, tuple | None] = {}
        if arrow:
            if fast_key is not None and _is_message_column(batch.schema, fast_key):
                records = _message_records(batch.column(fast_key), "assistant" if kind == "sft" else "user", plans)
                extras = (batch.drop_columns([fast_key]).to_pylist()  # prompts: the other columns (`_prompt_row`)
                          if kind == "prompts" and batch.num_columns > 1 else None)
                for k, rec in enumerate(records):
                    if rec is None:  # a row the fast conversion does not vouch for: the plain path (and its errors)
                        rec = one(batch.slice(k, 1).to_pylist()[0], fmt, args, source, i)
                    elif extras is not None:
                        columns = prompt_columns(extras[k], fmt, args)
                        if columns:
                            rec["columns"] = columns
                    add(rec)
                    i += 1
                continue
            batch = batch.to_pylist()
        for row in batch:
            if i:
                if not isinstance(row, dict):
                    raise DataError(source, f"must be an object, got {type(row).__name__}", i)
                if auto and not (by_keys and tuple(row) == keys0):  # Arrow rows of one file share their columns
                    got = detect_format(row, args)
                    if got != fmt:
                        raise DataError(source, f"looks like '{got}' but row 0 is '{fmt}' (mixed formats in one "
                                                "file)", i)
            add(one(row, fmt, args, source, i))
            i += 1
    if fmt is None:
        raise DataError(source, "holds no rows")
    if counts["deduplicated"]:
        logger.warning("%s: %d ranked lists hold repeated answers; each kept once, at its best rank",
                       source, counts["deduplicated"])
    return out


def sft_records(rows: list[dict], args: DataArguments, source: str) -> list[dict]:
    """Normalise rows into SFT records ``{"question", "history", "answer"}`` (+ ``"system"`` / ``"text"``).

    Accepts alpaca (also TRL prompt / completion, text or message lists), sharegpt and ``messages`` rows (the last
    assistant turn is the target, earlier turns the history), pairwise, conversational preference and
    implicit-prompt rows (the chosen answer).

    Raises:
        DataError: a row lacks a mapped column, or a field is null, empty or mistyped; a list of several user turns
            as the question.
    """
    return _normalise("sft", [rows], args, source)


def pair_records(rows: list[dict], args: DataArguments, source: str) -> list[dict]:
    """Normalise rows into pairs ``{"question", "history", "chosen", "rejected"}`` (+ ``"system"`` / ``"text"``).

    Ranked answer lists (best first) give all ordered pairs (``n*(n-1)/2``; ``ranked_pairs='all'``) or the ``n-1``
    adjacent ones (``'adjacent'``), ``n`` counting distinct answers: a repeated answer (e.g. in oasst) counts once, at
    its best rank (one distinct answer: no pair). Implicit-prompt rows (only chosen / rejected) share their prompt:
    see `_implicit`.

    Raises:
        DataError: missing / empty fields, a ranked list with fewer than two answers, chosen == rejected, or an
            implicit pair without a shared prompt.
    """
    return _normalise("pairs", [rows], args, source)


def prompt_records(rows: list[dict], args: DataArguments, source: str) -> list[dict]:
    """Normalise rows of any supported format into prompts ``{"question", "history"}`` (+ ``"system"`` / ``"text"``).

    A list of user turns gives turn ``prompt_turn``; a message list gives everything up to its last user turn. A row
    with extra scalar columns (`prompt_columns`: e.g. ``topic``, or an answer column) also gets ``"columns"``, a dict
    of them, for PPO's reward functions; a row without any gets no ``"columns"`` key.

    Raises:
        DataError: the question field is missing, null, empty or mistyped.
    """
    return _normalise("prompts", [rows], args, source)


def split_records(records: list[dict], eval_split_size: float, seed: int) -> tuple[list[dict], list[dict]]:
    """Shuffle deterministically and split off ``eval_split_size`` (fraction < 1, or a row count) for evaluation."""
    import random

    rows = list(records)
    random.Random(seed).shuffle(rows)
    n_eval = int(round(len(rows) * eval_split_size)) if eval_split_size < 1 else int(eval_split_size)
    n_eval = min(max(n_eval, 0), len(rows) - 1)
    return rows[n_eval:], rows[:n_eval]


SOURCE_KEYS = ("dataset_name", "dataset_config", "dataset_split", "dataset_format", "max_samples", "question_key",
               "input_key", "answer_key", "good_key", "bad_key", "history_key", "conversations_key", "messages_key",
               "prompt_turn", "human_marker", "assistant_marker")


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
        # mapping keys start from their defaults; max_samples and dataset_split are inherited
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


def read_records(args: DataArguments, kind: Literal["sft", "pairs", "prompts"]) -> list[dict]:
    """Read every source of the recipe (`sources`) and normalise it into records of ``kind`` (see module doc).

    Rows are streamed from `datasets`' Arrow cache in batches (`iter_row_batches`), so only the records are held as
    Python objects; ``max_samples`` stops reading early.

    Raises:
        DataError: see `iter_row_batches`, `sft_records`, `pair_records`, `prompt_records`.
    """
    records = []
    for src in sources(args):
        name = source_name(src.dataset_name)
        batches = _arrow_batches(src.dataset_name, src.dataset_split, src.dataset_config, BATCH_ROWS)
        counted = _counted(batches, src.max_samples)
        part = _normalise(kind, counted, src, name)
        logger.info("%s: %d rows -> %d %s records", name, counted.rows, len(part), kind)
        records.extend(part)
    return records


class _counted:
    """Batches of rows, cut at ``limit`` rows in all; ``rows`` counts the rows handed out."""

    def __init__(self, batches: Iterable[list[dict]], limit: int | None):
        self.batches, self.limit, self.rows = batches, limit, 0

    def __iter__(self):
        for batch in self.batches:  # lists of rows, or Arrow record batches (sliced alike)
            if self.limit is not None and self.rows + len(batch) > self.limit:
                batch = batch[: self.limit - self.rows]
            self.rows += len(batch)
            if len(batch):
                yield batch
            if self.limit is not None and self.rows >= self.limit:
                return

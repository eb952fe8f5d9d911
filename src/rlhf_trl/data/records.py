"""Step 2 of `rlhf_trl.data`: a source's rows into records, each by its format (`.formats`) under ``on_bad_row``, skips
counted in a `DataReport`; `read_records` reads (step 1) and converts every source of a recipe."""

from __future__ import annotations

import gc
import logging
import random
from functools import partial
from typing import Iterable, Literal

from .args import DataArguments
from .formats import LABEL_KEYS, SkipRow, detect_format, pair_rows, prompt_columns, prompt_row, sft_row, unpaired_rows
from .read import arrow_batches, dialogue_counts, source_name, sources
from .report import DataError, DataReport
from .template import Template
from .turns import ROLES, dialogue

logger = logging.getLogger("rlhf_trl.data")  # the data modules log as one
SKIP_HINT = "; fix the row, or set on_bad_row: skip to skip such rows"

_ROLE_CODES = {"system": 1, "user": 2, "assistant": 3}  # codes of `message_records`' role signatures; 0: bad
_ROLE_NAMES = {code: role for role, code in _ROLE_CODES.items()}


def _is_message_column(schema, key: str) -> bool:
    """Whether column ``key`` is a list of structs with string ``role`` and ``content`` fields and no ``tool_calls``."""
    import pyarrow as pa

    if (k := schema.get_field_index(key)) < 0:
        return False
    kind = schema.field(k).type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_struct(kind.value_type):
        return False
    struct, text = kind.value_type, (pa.types.is_string, pa.types.is_large_string)
    return struct.get_field_index("tool_calls") < 0 and all(struct.get_field_index(name) >= 0 and any(
        t(struct.field(name).type) for t in text) for name in ("role", "content"))


def _message_plan(signature: bytes, end: str) -> tuple | None:
    """Indices ``(system, start, question, answer)`` of a role-code ``signature`` by `dialogue`, or None."""
    if not signature or 0 in signature:
        return None
    try:
        system, history, question, answer = dialogue([(_ROLE_NAMES[c], k) for k, c in enumerate(signature)],
                                                      "", 0, "", end)
    except DataError:
        return None
    start = question - 2 * len(history)
    return (system, start, question, answer) if history == [(k, k + 1) for k in range(start, question, 2)] else None


def message_records(column, end: str, plans: dict, train_history: bool = False) -> list[dict | None]:
    """SFT records (``end='assistant'``; ``train_history``: those with history marked ``"train_history": True``) or
    prompts (``'user'``; no ``"columns"``) of one Arrow batch of a ``messages`` column (`_is_message_column`), as
    `sft_row` / `prompt_row` give them, or None where the plain path must read the row (nulls, blank content,
    unknown roles, roles `dialogue` refuses). Faster than `RecordBatch.to_pylist`: roles as a byte per message
    (`_ROLE_CODES`), each distinct role sequence resolved once (`_message_plan`, in ``plans``)."""
    import numpy as np
    import pyarrow.compute as pc

    offsets = column.offsets.to_numpy()
    first = int(offsets[0])
    messages = column.values.slice(first, int(offsets[-1]) - first)
    texts, coded = messages.field("content").to_pylist(), pc.dictionary_encode(messages.field("role"))
    codes = np.array([_ROLE_CODES.get(ROLES.get(r), 0) for r in coded.dictionary.to_pylist()] + [0], np.uint8)
    codes = codes[pc.fill_null(coded.indices, len(codes) - 1).to_numpy()]  # a null role -> 0
    if messages.null_count:
        codes[~messages.is_valid().to_numpy(zero_copy_only=False)] = 0
    if not all(texts) or any(map(str.isspace, texts)):  # a null / empty content (falsy), or a blank one
        codes[[not t or t.isspace() for t in texts]] = 0
    signatures, bounds = codes.tobytes(), (offsets - first).tolist()
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
        if system is not None:  # keys in `sft_row`'s order
            rec["system"] = c[system]
        if answer is not None:
            rec["answer"] = c[answer]
            if train_history and start < question:
                rec["train_history"] = True
        append(rec)
    if column.null_count:
        for k in np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False)).tolist():
            out[k] = None
    return out


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


def read_records(args: DataArguments, kind: Literal["sft", "pairs", "prompts", "unpaired"],
                 report: DataReport | None = None) -> list[dict]:
    """Read every source of the recipe (`sources`) into records of ``kind``, in Arrow batches. Raises `DataError`."""
    records = []
    if report is not None:
        report.template = Template.from_args(args).mode
    for src in sources(args):
        name = source_name(src.dataset_name)
        shapes: dict = {}  # rows handed out (`_counted`); JSON arrays of dialogue lists: each row's length
        batches = arrow_batches(src.dataset_name, src.dataset_split, src.dataset_config, src.dataset_encoding, shapes)
        part = _normalise(kind, _counted(batches, src.max_samples, shapes), src, name, report)
        if report is not None and "dialogue_lengths" in shapes:  # in data_report.json, beside the source's counts
            report.sources[-1]["dialogue_lists"] = dialogue_counts(shapes["dialogue_lengths"][:shapes["rows"]], kind)
        logger.info("%s: %d rows -> %d %s records", name, shapes["rows"], len(part), kind)
        records.extend(part)
    return records


def _normalise(kind: str, batches: Iterable, args: DataArguments, source: str,
               report: DataReport | None = None) -> list[dict]:
    """Rows (lists of row dicts or Arrow batches; ``messages`` SFT / prompt rows: `message_records`) into ``kind``
    records (first row's format), per ``on_bad_row``. Raises `DataError`: bad rows."""
    report = report if report is not None else DataReport(kind)
    out: list[dict] = []
    counts = {"deduplicated": 0, "bad": 0, "skipped": {}}
    fmt, auto, i = None, args.dataset_format == "auto", 0
    enabled = gc.isenabled()
    gc.disable()  # records hold no reference cycles: the cyclic GC would rescan millions of them for nothing
    try:
        for batch in batches:
            arrow = batch.__class__ is not list
            if fmt is None and len(batch):
                row = batch.slice(0, 1).to_pylist()[0] if arrow else batch[0]
                if not isinstance(row, dict):
                    raise DataError(source, f"must be an object, got {type(row).__name__}", i)
                fmt, keys0 = detect_format(row, args) if auto else args.dataset_format, tuple(row)
                by_keys = fmt not in ("alpaca", "ranked")  # these two also depend on the answer's type
                if kind in ("pairs", "unpaired"):  # KTO: a labelled answer per row, or two per preference pair
                    add, one = out.extend, partial(pair_rows if kind == "pairs" else unpaired_rows, counts=counts)
                else:
                    add, one = out.append, sft_row if kind == "sft" else prompt_row
                # messages rows: SFT records and prompts come from the message column alone (`sft_row`, `prompt_row`)
                plain = {"system", "tools"} | (set(LABEL_KEYS) if kind == "sft" else set())  # ignored by the fast path
                fast_key = ((args.messages_key or "messages") if fmt == "messages" and kind in ("sft", "prompts")
                            and not plain & set(keys0) else None)
                plans: dict[bytes, tuple | None] = {}
            if arrow:
                if fast_key is not None and _is_message_column(batch.schema, fast_key):
                    records = message_records(batch.column(fast_key), "assistant" if kind == "sft" else "user", plans,
                                               not args.mask_history)
                    extras = (batch.drop_columns([fast_key]).to_pylist()  # prompts: the other columns (`prompt_row`)
                              if kind == "prompts" and batch.num_columns > 1 else None)
                    for k, rec in enumerate(records):
                        if rec is None:  # a row the fast conversion does not vouch for: the plain path (and its errors)
                            _policy(one, add, batch.slice(k, 1).to_pylist()[0], fmt, args, source, i, report, counts)
                        else:
                            if extras is not None and (columns := prompt_columns(extras[k], fmt, args)):
                                rec["columns"] = columns
                            add(rec)
                        i += 1
                    continue
                batch = batch.to_pylist()
            for row in batch:
                if i and not isinstance(row, dict):
                    raise DataError(source, f"must be an object, got {type(row).__name__}", i)
                # Arrow rows of one file share their columns
                if i and auto and not (by_keys and tuple(row) == keys0) and (got := detect_format(row, args)) != fmt:
                    _policy(_mixed, add, row, (got, fmt), args, source, i, report, counts)
                else:
                    _policy(one, add, row, fmt, args, source, i, report, counts)
                i += 1
    finally:
        if enabled:
            gc.enable()
    if fmt is None:
        raise DataError(source, "holds no rows")
    if counts["deduplicated"]:
        report.deduplicated += counts["deduplicated"]
        logger.warning("%s: %d ranked lists hold repeated answers; each kept once, at its best rank",
                       source, counts["deduplicated"])
    report.sources.append({"name": source, "format": fmt, "rows_read": i, "skipped": counts["skipped"],
                           "bad_rows": counts["bad"], "records": len(out)})
    skips = counts["skipped"]  # this source's: its skips logged, too many bad rows or no record left refused
    reasons = "; ".join(f"{reason}: {count}" for reason, count in skips.items())
    if skips:
        logger.warning("%s: %d of %d rows skipped (on_bad_row: %s): %s", source, sum(skips.values()), i,
                       args.on_bad_row, reasons)
    if counts["bad"] > args.max_bad_row_fraction * i:
        raise DataError(source, f"{counts['bad']} of {i} rows are bad, more than max_bad_row_fraction="
                                f"{args.max_bad_row_fraction} ({reasons}); fix the data or raise max_bad_row_fraction")
    if not out:
        raise DataError(source, f"no usable row: all {i} rows were skipped ({reasons})")
    return out


def _policy(one, add, row: dict, fmt, args: DataArguments, source: str, i: int, report: DataReport, counts: dict):
    """``add(one(row, ...))`` under the bad-row policy (see `_normalise`)."""
    try:
        add(one(row, fmt, args, source, i))
        return
    except SkipRow as skip:
        reason, bad = str(skip), False
    except DataError as exc:
        if exc.row is None:
            raise
        if args.on_bad_row != "skip":
            raise DataError(exc.source, exc.message + SKIP_HINT, exc.row, exc.field) from None
        reason, bad = (f"field '{exc.field}': {exc.message}" if exc.field else exc.message), True
    counts["bad"] += bad
    reason = report.skip(source, i, reason, bad)
    counts["skipped"][reason] = counts["skipped"].get(reason, 0) + 1


def _mixed(row, fmts, args, source, i):
    raise DataError(source, f"looks like '{fmts[0]}' but row 0 is '{fmts[1]}' (mixed formats in one file)", i)


def _counted(batches: Iterable, limit: int | None, counts: dict):
    """Batches of rows, cut at ``limit`` rows in all; ``counts["rows"]`` counts the rows handed out."""
    counts["rows"] = 0
    for batch in batches:  # lists of rows, or Arrow record batches (sliced alike)
        if limit is not None and counts["rows"] + len(batch) > limit:
            batch = batch[: limit - counts["rows"]]
        counts["rows"] += len(batch)
        if len(batch):
            yield batch
        if limit is not None and counts["rows"] >= limit:
            return

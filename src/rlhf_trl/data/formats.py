"""One row of any format (`FORMATS`) at a time, for `.records` (step 2 of `rlhf_trl.data`, which runs it over whole
sources): which format a row has (`detect_format`), which columns are extras (`prompt_columns`), and the row as an SFT
record (`sft_row`), pairs (`pair_rows`), KTO examples (`unpaired_rows`) or a prompt (`prompt_row`); `DataError` if
bad, `SkipRow` (skipped, counted) if it has nothing for the stage (empty answer, KTO label false, tied scores)."""

from __future__ import annotations

import difflib
from itertools import combinations
from typing import Any, Iterable

from .args import DataArguments
from .report import DataError
from .read import DIALOGUE_KEY
from .turns import (ROLES, TOOL_ROLES, chat_messages, dialogue, is_messages, marker_pair, message_content, parse_tools,
                    parse_turns, tool_dialogue)

QUESTION_KEYS = ("instruction", "prompt", "question", "query")
ANSWER_KEYS = ("output", "answer", "response", "completion")
CONVERSATION_KEYS = {"sharegpt": "conversations", "messages": "messages", "firefly": "conversation"}
LABEL_KEYS = ("label", "kto_tag")  # an unpaired row's boolean: TRL's unpaired rows; LLaMA-Factory's KTO rows


def _is_conversation(value) -> bool:
    """A message list opening with a user (or system) turn: a whole conversation, not an answer."""
    return is_messages(value) and ROLES.get(value[0].get("role", value[0].get("from"))) in ("user", "system")


def detect_format(row: dict, args: DataArguments) -> str:
    """Guess the source format from one row's keys (with the recipe's column mapping): chosen + rejected message lists
    -> implicit; ``conversations`` -> sharegpt; ``messages``; ``conversation`` -> firefly; chosen + rejected -> pairwise
    (with a question column) or implicit; an answer column -> ranked (a list, not messages) or alpaca; else prompt."""
    keys = row.keys()
    good, bad = args.good_key or "chosen", args.bad_key or "rejected"
    if good in keys and bad in keys and _is_conversation(row[good]) and _is_conversation(row[bad]):
        return "implicit"  # whole conversations on each side: the prompt is their shared leading messages
    if (args.conversations_key or "conversations") in keys:
        return "sharegpt"
    if (args.messages_key or "messages") in keys:
        return "messages"
    if (args.conversations_key or "conversation") in keys:
        return "firefly"
    if good in keys and bad in keys:  # (column names are strings: a None key is in no row)
        return "pairwise" if (args.question_key or _first(keys, QUESTION_KEYS)) in keys else "implicit"
    if (answer := args.answer_key or _first(keys, ANSWER_KEYS)) in keys:
        value = row[answer]
        return "ranked" if isinstance(value, list) and not is_messages(value) else "alpaca"
    return "prompt"


def _first(keys: Iterable[str], candidates: Iterable[str]) -> str | None:
    return next((c for c in candidates if c in keys), None)


_SCALAR_TYPES = frozenset((str, int, float, bool, type(None)))


def prompt_columns(row: dict, fmt: str, args: DataArguments) -> dict:
    """A prompt row's scalar columns other than the prompt (answers included), for PPO's reward functions."""
    if fmt in CONVERSATION_KEYS:
        key = "messages_key" if fmt == "messages" else "conversations_key"
        used = (getattr(args, key) or CONVERSATION_KEYS[fmt], "tools")
    elif fmt == "implicit":
        used = (args.good_key or "chosen", args.bad_key or "rejected")
    else:  # the question column as `_prompt` picks it
        qkey = args.question_key or _first(row, QUESTION_KEYS)
        used = (qkey, args.input_key or "input", args.history_key or "history")
    out = {}
    for k, v in row.items():  # a plain loop: faster than a comprehension here
        if k not in used and v.__class__ in _SCALAR_TYPES:
            out[k] = v
    return out


class SkipRow(Exception):
    """A valid row with nothing for this stage; ``reason`` is counted in the data report."""


def _column(row: dict, key: str, source: str, i: int, recipe_key: str):
    """``row[key]``; without it, `DataError` naming ``recipe_key`` and the file's columns, closest first."""
    if key not in row:
        close = difflib.get_close_matches(key, list(row), n=3, cutoff=0.3)
        names = close + sorted(k for k in row if k not in close)
        raise DataError(source, f"missing column; set {recipe_key} to one of {names}", i, key)
    return row[key]


def _string(value, source: str, i: int, key: str, allow_empty: bool = False) -> str:
    """``value``, which must be a string (not blank unless ``allow_empty``)."""
    if value is None:  # json/jsonl rows are read as one table: a key absent from this row reads as null
        raise DataError(source, "is null or missing in this row", i, key)
    if not isinstance(value, str):
        raise DataError(source, f"must be a string, got {type(value).__name__}", i, key)
    if not allow_empty and not value.strip():
        raise DataError(source, "is empty", i, key)
    return value


def _conversation(row: dict, fmt: str, args: DataArguments, source: str, i: int, end: str) -> tuple:
    """``(record fields, answer)`` of a conversation row cut at its last ``end`` turn (tools: chat ``messages``)."""
    recipe_key = "messages_key" if fmt == "messages" else "conversations_key"
    key = getattr(args, recipe_key) or CONVERSATION_KEYS[fmt]
    turns = parse_turns(_column(row, key, source, i, recipe_key), source, i, key)
    if turns[0][0] != "system" and isinstance(row.get("system"), str) and row["system"].strip():
        turns.insert(0, ("system", row["system"]))
    tools = parse_tools(row.get("tools"), source, i) if "tools" in row else None
    if tools is None and not any(role in TOOL_ROLES for role, _ in turns):
        system, history, question, answer = dialogue(turns, source, i, key, end)
        return _record(system, history, question), answer
    if not args.chat_template:
        role = next((r for r, _ in turns if r in TOOL_ROLES), "tools column")
        raise DataError(source, f"holds a tool-calling conversation ({role}); the text template cannot show it: set "
                                "chat_template: true (the tokenizer's template renders tools)", i, key)
    system, prompt, question, answer = tool_dialogue(turns, source, i, key, end)
    rec = _record(system, [], question, messages=chat_messages(([("system", system)] if system else []) + prompt))
    if tools:
        rec["tools"] = tools
    if answer is not None and answer[0] == "tool_call":
        rec["target"] = chat_messages([answer])[0]
    return rec, None if answer is None else answer[1]


def _prompt(row: dict, args: DataArguments, source: str, i: int, kind: str):
    """``(system, history, question)`` of a row (a dialogue list's: `_dialogue_list`). Raises `DataError`: a bad or
    missing field; `SkipRow`: a dialogue list without an answer, but for prompts."""
    if DIALOGUE_KEY in row:
        return _dialogue_list(row[DIALOGUE_KEY], source, i, kind)
    qkey = args.question_key or _first(row, QUESTION_KEYS) or "instruction"
    value = _column(row, qkey, source, i, "question_key")
    system, history = None, None
    if isinstance(value, list) and value and all(isinstance(t, str) for t in value):
        if kind != "prompts":
            raise DataError(source, f"must be a string for {kind.upper()} rows, got a list of {len(value)} user "
                                    "turn(s) without answers (only PPO prompts read such lists: prompt_turn)", i, qkey)
        if len(value) > 1 and not -len(value) <= args.prompt_turn < len(value):
            raise DataError(source, f"prompt_turn={args.prompt_turn} is out of range for {len(value)} turns", i, qkey)
        question = value[args.prompt_turn if len(value) > 1 else 0]
        if not question.strip():
            raise DataError(source, "holds an empty turn", i, qkey)
    elif is_messages(value):
        system, history, question, _ = dialogue(parse_turns(value, source, i, qkey), source, i, qkey, "user")
    elif isinstance(value, list):
        raise DataError(source, "must be a string, a list of user turns or a list of {role, content} messages", i, qkey)
    else:
        question = _string(value, source, i, qkey)
    ikey = _optional_key(args, "input_key", "input")
    if ikey and ikey != qkey and row.get(ikey) is not None:
        if (extra := _string(row[ikey], source, i, ikey, allow_empty=True)).strip():
            question = f"{question}\n{extra}"
    if history is None:
        hkey = _optional_key(args, "history_key", "history")
        history = (row.get(hkey) if hkey else None) or []
        if not isinstance(history, list) or not all(isinstance(t, (list, tuple)) and len(t) == 2
                                                    and all(isinstance(x, str) for x in t) for t in history):
            raise DataError(source, "must be a list of [question, answer] string pairs", i, hkey)
        history = [(q, a) for q, a in history]
    return system, history, question


_JSON_TYPES = {str: "string", int: "number", float: "number", bool: "boolean", type(None): "null", list: "array",
               dict: "object"}


def _dialogue_list(items, source: str, i: int, kind: str) -> tuple:
    """``(None, history, question)`` of a dialogue list (strings: user, assistant, user, ...; `read.dialogue_row`):
    for prompts, cut at its last user item (an even list's last answer dropped); for other stages, cut before its
    last answer (the row's ``output``), an odd list's last user item dropped. Raises `DataError`: not a non-empty list
    of strings (field ``[j]``: the item), a blank user item; `SkipRow`: one user item, no answer (but for prompts)."""
    if not isinstance(items, list) or not items:
        got = "an empty list" if items == [] else f"a JSON {_JSON_TYPES.get(type(items), type(items).__name__)}"
        raise DataError(source, f"must be a non-empty list of strings (user, assistant, user, ... turns), got {got}",
                        i)
    for j, item in enumerate(items):
        if not isinstance(item, str):
            raise DataError(source, f"must be a string (a dialogue list alternates user / assistant turns), got a "
                                    f"JSON {_JSON_TYPES.get(type(item), type(item).__name__)}", i, f"[{j}]")
        if j % 2 == 0 and not item.strip():
            raise DataError(source, "is an empty user turn", i, f"[{j}]")
    if kind != "prompts" and len(items) == 1:
        raise SkipRow("a dialogue list of one user turn (no answer to learn)")
    question = (len(items) - (1 if kind == "prompts" else 2)) // 2 * 2
    return None, list(zip(items[0:question:2], items[1:question:2])), items[question]


def _optional_key(args: DataArguments, attr: str, default: str) -> str | None:
    """An optional field's column: ``attr``, else ``default`` unless a recipe key maps another field there."""
    mapped = (args.question_key, args.answer_key, args.good_key, args.bad_key)
    return getattr(args, attr) or (None if default in mapped else default)


def _answer_text(value: Any, source: str, i: int, key: str) -> str:
    """An answer (may be empty): a string, a ``{from, value}`` / ``{role, content}`` object or one assistant message."""
    if isinstance(value, list) and value and all(isinstance(t, dict) for t in value):
        turns = parse_turns(value, source, i, key)
        if len(turns) != 1 or turns[0][0] != "assistant":
            raise DataError(source, f"must be one assistant message, got {len(turns)} message(s) "
                                    f"({', '.join(r for r, _ in turns)}); if chosen / rejected hold whole "
                                    "conversations, set dataset_format: implicit", i, key)
        return turns[0][1]
    if isinstance(value, dict):  # LLaMA-Factory sharegpt pairs: {"from": "gpt", "value": "..."}
        value = value.get("value") if value.get("value") is not None else value.get("content")
    value = _string(message_content(value), source, i, key, allow_empty=True)
    return value if value.strip() else ""


def _implicit(row: dict, args: DataArguments, source: str, i: int) -> dict:
    """Implicit-prompt pair: ``chosen`` / ``rejected`` transcripts or message lists sharing a prompt. Text: the shared
    prefix through the last ``assistant_marker`` (``text``, ``question``), the rest the answers (blank: empty).
    Messages: shared leading messages to a user turn, then one assistant message each. Raises `DataError`: bad sides."""
    gkey, bkey = args.good_key or "chosen", args.bad_key or "rejected"
    chosen, rejected, both = row.get(gkey), row.get(bkey), f"{gkey}/{bkey}"
    if chosen.__class__ is str and rejected.__class__ is str:  # the common case first: transcripts
        marker = args.assistant_marker
        k = chosen.rfind(marker)
        while k >= 0 and not rejected.startswith(chosen[: k + len(marker)]):
            k = chosen.rfind(marker, 0, k)
        text = chosen[: k + len(marker)]
        good, bad = chosen[len(text):], rejected[len(text):]
        if chosen == rejected:
            raise DataError(source, "chosen and rejected answers are identical", i, both)
        if k < 0:
            raise DataError(source, "chosen and rejected share no prefix ending in the assistant marker "
                                    f"{args.assistant_marker!r} (set human_marker / assistant_marker)", i, both)
        # the transcript is the prompt; its turns are parsed only to render it with a chat template (_prompt_ids)
        return {"question": text, "history": [], "chosen": good if good.strip() else "",
                "rejected": bad if bad.strip() else "", "text": text, "markers": marker_pair(args.human_marker, marker)}
    for key in (gkey, bkey):
        if _column(row, key, source, i, "good_key" if key == gkey else "bad_key") is None:
            raise DataError(source, "is null or missing in this row", i, key)
    if not (is_messages(chosen) and is_messages(rejected)):
        raise DataError(source, "chosen and rejected must both be transcripts (strings) or both message lists", i, both)
    c, r = parse_turns(chosen, source, i, gkey), parse_turns(rejected, source, i, bkey)
    if c == r:
        raise DataError(source, "chosen and rejected answers are identical", i, both)
    n = next((k for k, (a, b) in enumerate(zip(c, r)) if a != b), min(len(c), len(r)))  # shared leading messages
    if n == 0 or c[n - 1][0] != "user":
        raise DataError(source, "chosen and rejected share no leading messages ending with a user turn", i, both)
    for key, rest in ((gkey, c[n:]), (bkey, r[n:])):
        if len(rest) != 1 or rest[0][0] != "assistant":
            raise DataError(source, f"after the shared prompt must hold one assistant message, got {len(rest)}", i, key)
    system, history, question, _ = dialogue(c[:n], source, i, gkey, "user")
    return _record(system, history, question, chosen=c[n][1], rejected=r[n][1])


def _record(system, history, question, **answers) -> dict:
    rec = {"question": question, "history": history, **answers}
    if system is not None:
        rec["system"] = system
    return rec


def _kto_label_key(row: dict) -> str | None:
    """The key of a row's boolean KTO label (`LABEL_KEYS`: TRL's ``label``, LLaMA-Factory's ``kto_tag``), or None."""
    return next((k for k in LABEL_KEYS if isinstance(row.get(k), bool)), None)


def sft_row(row: dict, fmt: str, args: DataArguments, source: str, i: int) -> dict:
    """An SFT record ``{"question", "history", ["system", "messages", "tools", "target"], "answer"}``, and
    ``"train_history": True`` where every earlier assistant turn is a target too (`_trains_history`). Raises
    `DataError`: a bad field; `SkipRow`: ``label`` / ``kto_tag: false``, an empty last answer."""
    if (key := _kto_label_key(row)) is not None and row[key] is False:
        raise SkipRow(f"{key}: false (an undesirable KTO row: not a target)")
    if fmt in CONVERSATION_KEYS:
        rec, answer = _conversation(row, fmt, args, source, i, "assistant")
    elif fmt == "implicit":
        rec = _implicit(row, args, source, i)
        answer = rec.pop("chosen")
        del rec["rejected"]
    elif fmt == "pairwise":
        rec, key = _record(*_prompt(row, args, source, i, "sft")), args.good_key or "chosen"
        answer = _answer_text(row.get(key), source, i, key)
    else:
        rec = _record(*_prompt(row, args, source, i, "sft"))
        key = args.answer_key or _first(row, ANSWER_KEYS) or "output"
        answer = _column(row, key, source, i, "answer_key")
        if fmt == "ranked":
            if not isinstance(answer, list) or not answer:
                raise DataError(source, "must be a non-empty list of answers", i, key)
            answer = answer[0]
        answer = _answer_text(answer, source, i, key)
    if not answer.strip():
        raise SkipRow("empty answer (nothing to learn)")
    rec["answer"] = answer
    if not args.mask_history and _trains_history(row, fmt, args, rec):
        rec["train_history"] = True
    return rec


def _trains_history(row: dict, fmt: str, args: DataArguments, rec: dict) -> bool:
    """Whether an SFT record's earlier assistant turns are targets (``mask_history: false``): conversations
    (`CONVERSATION_KEYS`) and alpaca rows whose ``history`` column holds turns, not rows with a boolean KTO ``label``
    (it judges the last answer) nor TRL prompt / completion rows (a message-list prompt is a prompt)."""
    if _kto_label_key(row) is not None:
        return False
    if fmt in CONVERSATION_KEYS:
        return bool(rec["history"]) or any(m["role"] == "assistant" for m in rec.get("messages", ()))
    return fmt == "alpaca" and bool(rec["history"]) and not is_messages(
        row.get(args.question_key or _first(row, QUESTION_KEYS) or "instruction"))


def pair_rows(row: dict, fmt: str, args: DataArguments, source: str, i: int, counts: dict) -> list[dict]:
    """A row's pairs ``[{..., "chosen", "rejected"}]`` (a ranked list: ``ranked_pairs``). Raises `DataError`: a bad
    field, KTO rows; `SkipRow`: scores tied, reversed or below ``min_score_margin``."""
    if (key := _kto_label_key(row)) is not None:
        raise DataError(source, f"holds unpaired KTO rows (a boolean '{key}' per answer); a reward model needs chosen "
                                "/ rejected pairs (make kto trains on them)", i, key)
    good, bad = row.get("score_chosen"), row.get("score_rejected")
    if isinstance(good, (int, float)) and isinstance(bad, (int, float)):  # skipped unless chosen scores above rejected
        if good == bad:
            raise SkipRow("tied scores (score_chosen == score_rejected)")
        if good < bad:
            raise SkipRow("score_chosen below score_rejected")
        if args.min_score_margin is not None and good - bad < args.min_score_margin:
            raise SkipRow(f"score margin below min_score_margin={args.min_score_margin}")
    if fmt == "implicit":
        return [_implicit(row, args, source, i)]
    if fmt in CONVERSATION_KEYS:
        if (args.good_key or "chosen") not in row:
            raise DataError(source, f"format '{fmt}' holds no preference pairs (add chosen / rejected columns)")
        rec, _ = _conversation(row, fmt, args, source, i, "user")
    elif fmt in ("pairwise", "ranked"):
        rec = _record(*_prompt(row, args, source, i, "rm"))
    else:
        raise DataError(source, f"format '{fmt}' holds no preference pairs")
    if fmt != "ranked":
        gkey, bkey = args.good_key or "chosen", args.bad_key or "rejected"
        good, bad = _column(row, gkey, source, i, "good_key"), _column(row, bkey, source, i, "bad_key")
        ranked = [_answer_text(good, source, i, gkey), _answer_text(bad, source, i, bkey)]
        if ranked[0] == ranked[1]:  # (a ranked list's answers are distinct: repeated ones are dropped below)
            raise DataError(source, "chosen and rejected answers are identical", i, f"{gkey}/{bkey}")
        pairs = [(0, 1)]
    else:
        key = args.answer_key or _first(row, ANSWER_KEYS) or "output"
        answers = row.get(key)
        if not isinstance(answers, list):
            raise DataError(source, "must be a list of answers ranked best first", i, key)
        if len(answers) < 2:
            raise DataError(source, f"a ranked list needs at least 2 answers, got {len(answers)}", i, key)
        ranked = [_answer_text(a, source, i, f"{key}[{j}]") for j, a in enumerate(answers)]
        if len(set(ranked)) < len(ranked):  # a repeated answer is one answer: keep its best (first) rank
            ranked = list(dict.fromkeys(ranked))
            counts["deduplicated"] += 1
        pairs = (list(combinations(range(len(ranked)), 2)) if args.ranked_pairs == "all"
                 else [(a, a + 1) for a in range(len(ranked) - 1)])
    return [{**rec, "chosen": ranked[a], "rejected": ranked[b]} for a, b in pairs]


def prompt_row(row: dict, fmt: str, args: DataArguments, source: str, i: int) -> dict:
    """A prompt record ``{"question", "history", ["system", "text", "messages", "tools", "columns"]}`` (``columns``:
    the row's other scalar columns; none for a dialogue list, whose answer is dropped). Raises `DataError`: a bad
    field."""
    if DIALOGUE_KEY in row:
        return _record(*_prompt(row, args, source, i, "prompts"))
    if fmt in CONVERSATION_KEYS:
        rec = _conversation(row, fmt, args, source, i, "user")[0]
    elif fmt == "implicit":
        rec = _implicit(row, args, source, i)
        del rec["chosen"], rec["rejected"]
    else:
        rec = _record(*_prompt(row, args, source, i, "prompts"))
    # a one-column row is its prompt (the common prompt file): no extras; rows without extras keep plain records
    if len(row) > 1 and (columns := prompt_columns(row, fmt, args)):
        rec["columns"] = columns
    return rec


def unpaired_rows(row: dict, fmt: str, args: DataArguments, source: str, i: int, counts: dict) -> list[dict]:
    """KTO examples of a row, ``[{..., "answer", "label": bool}]``. A row with a boolean ``label`` (TRL's ``prompt`` /
    ``completion`` / ``label``, text or messages) or ``kto_tag`` (LLaMA-Factory's sharegpt / messages rows) gives one:
    its completion, or its last assistant turn; a preference row gives two per pair (`pair_rows`): the chosen answer
    desirable, the rejected one undesirable, as TRL's ``unpair_preference_dataset``. Raises `DataError`: neither a
    label nor a pair, a label that is not a boolean, a format without answers."""
    key = next((k for k in LABEL_KEYS if row.get(k) is not None), None)
    if key is None:
        if fmt in ("pairwise", "ranked", "implicit") or (args.good_key or "chosen") in row:
            return [{**{k: v for k, v in pair.items() if k not in ("chosen", "rejected")}, "answer": pair[side],
                     "label": side == "chosen"}
                    for pair in pair_rows(row, fmt, args, source, i, counts) for side in ("chosen", "rejected")]
        raise DataError(source, "holds neither a boolean 'label' (TRL's unpaired rows) or 'kto_tag' (LLaMA-Factory's "
                                "KTO rows) nor a chosen / rejected pair: KTO needs each answer marked desirable or "
                                "undesirable", i, "label")
    label = row[key]
    if not isinstance(label, bool):
        raise DataError(source, f"must be true (a desirable answer) or false (an undesirable one), got {label!r}", i,
                        key)
    if fmt in CONVERSATION_KEYS:
        rec, answer = _conversation(row, fmt, args, source, i, "assistant")
    elif fmt == "alpaca":
        rec = _record(*_prompt(row, args, source, i, "kto"))
        akey = args.answer_key or _first(row, ANSWER_KEYS) or "completion"
        answer = _answer_text(_column(row, akey, source, i, "answer_key"), source, i, akey)
    else:
        raise DataError(source, f"a '{key}' row needs a prompt and one answer (prompt / completion, or a "
                                f"conversation), not format '{fmt}'", i, key)
    rec.update(answer=answer, label=label)
    return [rec]

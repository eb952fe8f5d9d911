"""The row formats (`FORMATS`): which one a row has (`detect_format`), which columns are extras (`prompt_columns`)."""

from __future__ import annotations

from typing import Iterable

from .args import DataArguments
from .turns import ROLES, _is_messages

QUESTION_KEYS = ("instruction", "prompt", "question", "query")
ANSWER_KEYS = ("output", "answer", "response", "completion")
CONVERSATION_KEYS = {"sharegpt": "conversations", "messages": "messages", "firefly": "conversation"}
DIALOGUE_KEY = "_dialogue"  # a row of a JSON array of lists: the list (`dialogue_row`)


def dialogue_row(items) -> dict:
    """A row of a JSON array of dialogue lists (MOSS-RLHF's prompt files; user, assistant, user, ... strings) as an
    alpaca row: ``{DIALOGUE_KEY: items, "output": its last answer}`` (the last item of an even list, the one before
    the last of an odd one; None if none or not a string). `rows._prompt` checks and splits the list."""
    answer = None
    if isinstance(items, list) and len(items) >= 2:
        answer = items[-1] if len(items) % 2 == 0 else items[-2]
    return {DIALOGUE_KEY: items, "output": answer if isinstance(answer, str) else None}


def _is_conversation(value) -> bool:
    """A message list opening with a user (or system) turn: a whole conversation, not an answer."""
    return _is_messages(value) and ROLES.get(value[0].get("role", value[0].get("from"))) in ("user", "system")


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
    if good in keys and bad in keys:
        qkey = args.question_key or _first(keys, QUESTION_KEYS)
        return "pairwise" if qkey is not None and qkey in keys else "implicit"
    answer = args.answer_key or _first(keys, ANSWER_KEYS)
    if answer is not None and answer in keys:
        value = row[answer]
        return "ranked" if isinstance(value, list) and not _is_messages(value) else "alpaca"
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

"""Step 2 of `rlhf_trl.data`: normalise one row of any source format into an SFT record, pairs or a prompt."""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Iterable

from .data_args import DEFAULT_ASSISTANT_MARKER, DEFAULT_HUMAN_MARKER, HISTORY_SEPARATOR, DataArguments, DataError

QUESTION_KEYS = ("instruction", "prompt", "question", "query")
ANSWER_KEYS = ("output", "answer", "response", "completion")
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
_ALTERNATING = [(["user", "assistant"] * 33)[:n] for n in range(65)]  # well-formed role sequences, by length


def _is_messages(value) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict)


def detect_format(row: dict, args: DataArguments) -> str:
    """Guess the source format from the keys of one row (honouring the recipe's column mapping).

    ``conversations`` -> sharegpt; ``messages`` -> messages; ``chosen`` + ``rejected`` -> pairwise with a question
    column, else implicit; an answer column -> ranked (a list of answers) or alpaca (also a message list); else prompt.
    """
    keys = row.keys()
    if (args.conversations_key or "conversations") in keys:
        return "sharegpt"
    if (args.messages_key or "messages") in keys:
        return "messages"
    if (args.good_key or "chosen") in keys and (args.bad_key or "rejected") in keys:
        qkey = args.question_key or _first(keys, QUESTION_KEYS)
        return "pairwise" if qkey is not None and qkey in keys else "implicit"
    answer = args.answer_key or _first(keys, ANSWER_KEYS)
    if answer is not None and answer in keys:
        value = row[answer]
        return "ranked" if isinstance(value, list) and not _is_messages(value) else "alpaca"
    return "prompt"


def _first(keys: Iterable[str], candidates: Iterable[str]) -> str | None:
    return next((c for c in candidates if c in keys), None)


def _column(row: dict, key: str, source: str, i: int):
    """``row[key]``; raises `DataError` (missing column) without it."""
    if key not in row:
        raise DataError(source, f"missing column (columns: {sorted(row)}); map it in the recipe", i, key)
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


def _content(value):
    """A message's content: a string, or OpenAI content parts ``[{type: text, text}]`` joined."""
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):
        texts = [p.get("text") for p in value if p.get("type", "text") == "text"]
        if texts and all(isinstance(t, str) for t in texts):
            return "".join(texts)
    return value


def _turns(value, source: str, i: int, key: str) -> list[tuple[str, str]]:
    """``[(role, content)]`` with role in {system, user, assistant} from ``[{role, content}]`` or ``[{from, value}]``.

    Raises:
        DataError: not a non-empty list of such objects, an unknown role, or an empty / non-string content.
    """
    if value.__class__ is list and value:  # fast path: plain {role, content} messages with text content
        out = []
        append = out.append
        try:
            for turn in value:
                content = turn["content"]
                if content.__class__ is not str or not content or content.isspace():
                    break
                append((ROLES[turn["role"]], content))
            else:
                return out
        except (KeyError, TypeError):
            pass
    return _turns_checked(value, source, i, key)


def _turns_checked(value, source: str, i: int, key: str) -> list[tuple[str, str]]:
    """`_turns` for every shape it accepts ({from, value}, content parts), raising on the first bad message."""
    if value is None:
        raise DataError(source, "is null or missing in this row", i, key)
    if not isinstance(value, list) or not value:
        raise DataError(source, "must be a non-empty list of {role, content} messages, got "
                                f"{type(value).__name__}", i, key)
    out = []
    for j, turn in enumerate(value):
        if not isinstance(turn, dict):
            raise DataError(source, f"message {j} must be a {{role, content}} object, got {type(turn).__name__}",
                            i, key)
        role = turn.get("role") if turn.get("role") is not None else turn.get("from")
        content = _content(turn.get("content") if turn.get("content") is not None else turn.get("value"))
        if ROLES.get(role) is None:
            raise DataError(source, f"message {j} has role {role!r}; use system, user or assistant", i, key)
        if not isinstance(content, str) or not content.strip():
            raise DataError(source, f"message {j} ({role}) has an empty or non-string content", i, key)
        out.append((ROLES[role], content))
    return out


def _dialogue(turns: list[tuple[str, str]], source: str, i: int, key: str, end: str):
    """Split message turns into ``(system, history, question, answer)``.

    ``end='assistant'``: cut after the last assistant turn (SFT target: answer); ``end='user'``: cut after the last
    user turn (answer None). Turns before the cut must alternate user / assistant after an optional system turn.

    Raises:
        DataError: no turn of the kind ``end`` (or no user turn before the last assistant), a system turn that is not
            first, or turns that do not alternate.
    """
    system, offset = None, 0
    if turns and turns[0][0] == "system":
        system, turns, offset = turns[0][1], turns[1:], 1
    last = len(turns) - 1
    while last >= 0 and turns[last][0] != end:
        last -= 1
    if last < 0 or (end == "assistant" and last == 0):
        need = "a user turn followed by an assistant turn" if end == "assistant" else "a user turn"
        raise DataError(source, f"needs {need}", i, key)
    body = turns[: last + 1]
    roles = [role for role, _ in body]
    if len(roles) >= len(_ALTERNATING) or roles != _ALTERNATING[len(roles)]:
        for k, role in enumerate(roles):
            want = "user" if k % 2 == 0 else "assistant"
            if role != want:
                where = "is only allowed as the first message" if role == "system" else f"must be {want}"
                raise DataError(source, f"message {k + offset} ({role}) {where} (turns alternate user / assistant)",
                                i, key)
    answer = body.pop()[1] if end == "assistant" else None  # `body` is a copy
    texts = [text for _, text in body]
    return system, list(zip(texts[0:-1:2], texts[1::2])), texts[-1], answer


def _messages_dialogue(row: dict, args: DataArguments, source: str, i: int, end: str):
    """`_dialogue` of a ``messages`` row's message column."""
    key = args.messages_key or "messages"
    return _dialogue(_turns(row.get(key), source, i, key), source, i, key, end)


def _prompt(row: dict, args: DataArguments, source: str, i: int, kind: str):
    """The prompt part of a row: ``(system, history, question)``.

    The question column (``question_key`` or the first of `QUESTION_KEYS`) holds a string, a list of user turns
    (one question per row for SFT / RM; PPO prompts take turn ``prompt_turn``), or a message list (everything up to
    the last user turn); the ``input`` column (never the question column itself) is appended on a new line;
    ``history`` pairs come first.

    Raises:
        DataError: a missing / null / empty / mistyped field.
    """
    qkey = args.question_key or _first(row, QUESTION_KEYS) or "instruction"
    value = _column(row, qkey, source, i)
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
    elif _is_messages(value):
        system, history, question, _ = _dialogue(_turns(value, source, i, qkey), source, i, qkey, "user")
    elif isinstance(value, list):
        raise DataError(source, "must be a string, a list of user turns or a list of {role, content} messages", i, qkey)
    else:
        question = _string(value, source, i, qkey)
    ikey = args.input_key or "input"
    if ikey != qkey:
        extra = row.get(ikey)
        if extra is not None:
            extra = _string(extra, source, i, ikey, allow_empty=True)
            if extra.strip():
                question = f"{question}\n{extra}"
    if history is None:
        history = _history(row, args, source, i)
    return system, history, question


def _history(row: dict, args: DataArguments, source: str, i: int) -> list[tuple[str, str]]:
    hkey = args.history_key or "history"
    history = row.get(hkey) or []
    if not isinstance(history, list) or not all(isinstance(t, (list, tuple)) and len(t) == 2
                                                and all(isinstance(x, str) for x in t) for t in history):
        raise DataError(source, "must be a list of [question, answer] string pairs", i, hkey)
    return [(q, a) for q, a in history]


def _sharegpt_dialogue(row: dict, args: DataArguments, source: str, i: int, needs_answer: bool,
                       drop_answer: bool = False):
    """Split a sharegpt row's ``[{from, value}]`` user / assistant turns (system / tool turns skipped) into (history
    pairs, last question, last answer or None); ``drop_answer``: a last assistant turn is dropped first."""
    key = args.conversations_key or "conversations"
    value = row.get(key)
    if not isinstance(value, list) or not value:
        raise DataError(source, "must be a non-empty list of {from, value} turns", i, key)
    turns = []
    for j, turn in enumerate(value):
        if not isinstance(turn, dict) or "value" not in turn:
            raise DataError(source, f"turn {j} must be a {{from, value}} object", i, key)
        role = ROLES.get(turn.get("from", turn.get("role")))
        if role is None or role == "system":
            continue  # system / tool turns are not part of the single-turn template
        if not isinstance(turn["value"], str) or not turn["value"].strip():
            raise DataError(source, f"turn {j} has an empty or non-string value", i, key)
        turns.append((role, turn["value"]))
    if drop_answer and turns and turns[-1][0] == "assistant":
        turns = turns[:-1]
    answer = turns.pop()[1] if needs_answer and turns and turns[-1][0] == "assistant" else None
    if not turns or turns[-1][0] != "user" or (needs_answer and answer is None):
        need = "a user turn followed by an assistant turn" if needs_answer else "a user turn"
        raise DataError(source, f"must end with {need}", i, key)
    body, question = turns[:-1], turns[-1][1]
    history = [(body[k][1], body[k + 1][1]) for k in range(0, len(body) - 1, 2)]
    return history, question, answer


def _answer_text(value: Any, source: str, i: int, key: str) -> str:
    """An answer: a string, a ``{from, value}`` / ``{role, content}`` object, or a list of one assistant message."""
    if isinstance(value, list) and value and all(isinstance(t, dict) for t in value):
        turns = _turns(value, source, i, key)
        if len(turns) != 1 or turns[0][0] != "assistant":
            raise DataError(source, f"must be one assistant message, got {len(turns)} message(s) "
                                    f"({', '.join(r for r, _ in turns)})", i, key)
        return turns[0][1]
    if isinstance(value, dict):  # LLaMA-Factory sharegpt pairs: {"from": "gpt", "value": "..."}
        value = _content(value.get("value") if value.get("value") is not None else value.get("content"))
    return _string(value, source, i, key)


@lru_cache(maxsize=16)
def _markers(human: str, assistant: str) -> tuple[str, str]:
    """One shared tuple per marker pair (records hold a reference, not a copy)."""
    return human, assistant


@lru_cache(maxsize=16)
def _marker_pattern(human: str, assistant: str):
    return re.compile(f"({re.escape(human)}|{re.escape(assistant)})")


def split_transcript(text: str, human_marker: str = DEFAULT_HUMAN_MARKER,
                     assistant_marker: str = DEFAULT_ASSISTANT_MARKER):
    """Parse a prompt transcript ending with the assistant marker into ``(system, history, question)``.

    Text before the first marker is the system turn (None if blank); turn texts are stripped; consecutive turns of
    one speaker are joined by a blank line. Lenient: a transcript without a user turn gives the whole text (minus
    the final marker) as the question. Used to render implicit-prompt pairs with a chat template.
    """
    pieces = _marker_pattern(human_marker, assistant_marker).split(text)
    system = pieces[0].strip() or None
    turns: list[list[str]] = []
    for marker, body in zip(pieces[1::2], pieces[2::2]):
        role = "user" if marker == human_marker else "assistant"
        if turns and turns[-1][0] == role:
            turns[-1][1] += HISTORY_SEPARATOR + body.strip()
        else:
            turns.append([role, body.strip()])
    if turns and turns[-1] == ["assistant", ""]:
        turns.pop()
    if not turns or turns[-1][0] != "user":
        body = text[: len(text) - len(assistant_marker)] if text.endswith(assistant_marker) else text
        return None, [], body.strip() or text
    if turns[0][0] == "assistant":
        turns = turns[1:]
    history = [(turns[k][1], turns[k + 1][1]) for k in range(0, len(turns) - 1, 2)]
    return system, history, turns[-1][1]


def _implicit(row: dict, args: DataArguments, source: str, i: int) -> dict:
    """An implicit-prompt pair: ``chosen`` / ``rejected`` transcripts (strings) or message lists sharing a prompt.

    Text: the prompt is the shared prefix through the last ``assistant_marker``, kept verbatim as ``text`` and
    ``question`` (``markers``: for `split_transcript` with chat templates); the answers are the rest, leading space
    included. Messages: the prompt is the shared leading messages (ending with a user turn), then one assistant
    message on each side.

    Raises:
        DataError: missing / mistyped sides, identical sides, or no shared prefix ending in the assistant marker
            (text) / a user turn (messages).
    """
    gkey, bkey = args.good_key or "chosen", args.bad_key or "rejected"
    chosen, rejected = row.get(gkey), row.get(bkey)
    if chosen.__class__ is str and rejected.__class__ is str:  # the common case first: transcripts
        marker = args.assistant_marker
        k = chosen.rfind(marker)
        text = chosen[: k + len(marker)]
        while k >= 0 and not rejected.startswith(text):
            k = chosen.rfind(marker, 0, k)
            text = chosen[: k + len(marker)]
        cut = len(text)
        good, bad = chosen[cut:], rejected[cut:]
        if k < 0 or not good or good.isspace() or not bad or bad.isspace() or good == bad:
            _implicit_text_error(row, args, source, i, k)
        # the transcript is the prompt; its turns are parsed only to render it with a chat template (_prompt_ids)
        return {"question": text, "history": [], "chosen": good, "rejected": bad, "text": text,
                "markers": _markers(args.human_marker, marker)}
    both = f"{gkey}/{bkey}"
    for key in (gkey, bkey):
        if _column(row, key, source, i) is None:
            raise DataError(source, "is null or missing in this row", i, key)
    if not (_is_messages(chosen) and _is_messages(rejected)):
        raise DataError(source, "chosen and rejected must both be transcripts (strings) or both message lists",
                        i, both)
    c, r = _turns(chosen, source, i, gkey), _turns(rejected, source, i, bkey)
    if c == r:
        raise DataError(source, "chosen and rejected answers are identical", i, both)
    n = 0
    while n < min(len(c), len(r)) and c[n] == r[n]:
        n += 1
    if n == 0 or c[n - 1][0] != "user":
        raise DataError(source, "chosen and rejected share no leading messages ending with a user turn", i, both)
    for key, rest in ((gkey, c[n:]), (bkey, r[n:])):
        if len(rest) != 1 or rest[0][0] != "assistant":
            raise DataError(source, f"after the shared prompt must hold one assistant message, got {len(rest)}",
                            i, key)
    system, history, question, _ = _dialogue(c[:n], source, i, gkey, "user")
    return _record(system, history, question, chosen=c[n][1], rejected=r[n][1])


def _implicit_text_error(row: dict, args: DataArguments, source: str, i: int, k: int):
    gkey, bkey = args.good_key or "chosen", args.bad_key or "rejected"
    if row[gkey] == row[bkey]:
        raise DataError(source, "chosen and rejected answers are identical", i, f"{gkey}/{bkey}")
    if k < 0:
        raise DataError(source, "chosen and rejected share no prefix ending in the assistant marker "
                                f"{args.assistant_marker!r} (set human_marker / assistant_marker)", i, f"{gkey}/{bkey}")
    cut = k + len(args.assistant_marker)
    for key in (gkey, bkey):
        if not row[key][cut:].strip():
            raise DataError(source, "is empty after the shared prompt", i, key)


def _record(system, history, question, **answers) -> dict:
    rec = {"question": question, "history": history, **answers}
    if system is not None:
        rec["system"] = system
    return rec


def _sft_row(row: dict, fmt: str, args: DataArguments, source: str, i: int) -> dict:
    if fmt == "sharegpt":
        history, question, answer = _sharegpt_dialogue(row, args, source, i, needs_answer=True)
        return _record(None, history, question, answer=answer)
    if fmt == "messages":
        system, history, question, answer = _messages_dialogue(row, args, source, i, "assistant")
        return _record(system, history, question, answer=answer)
    if fmt == "implicit":
        rec = _implicit(row, args, source, i)
        rec["answer"] = rec.pop("chosen")
        del rec["rejected"]
        return rec
    system, history, question = _prompt(row, args, source, i, "sft")
    if fmt == "pairwise":
        key = args.good_key or "chosen"
        return _record(system, history, question, answer=_answer_text(row.get(key), source, i, key))
    if fmt in ("alpaca", "ranked"):
        key = args.answer_key or _first(row, ANSWER_KEYS) or "output"
        value = _column(row, key, source, i)
        if fmt == "ranked":
            if not isinstance(value, list) or not value:
                raise DataError(source, "must be a non-empty list of answers", i, key)
            value = value[0]
        return _record(system, history, question, answer=_answer_text(value, source, i, key))
    raise DataError(source, f"format '{fmt}' has no answers to fine-tune on")


def _pair_rows(row: dict, fmt: str, args: DataArguments, source: str, i: int, counts: dict) -> list[dict]:
    if fmt == "implicit":
        return [_implicit(row, args, source, i)]
    system = None
    if fmt == "sharegpt":
        history, question, _ = _sharegpt_dialogue(row, args, source, i, needs_answer=False)
    elif fmt == "messages":
        if (args.good_key or "chosen") not in row:
            raise DataError(source, "format 'messages' holds no preference pairs (add chosen / rejected columns)")
        system, history, question, _ = _messages_dialogue(row, args, source, i, "user")
    elif fmt in ("pairwise", "ranked"):
        system, history, question = _prompt(row, args, source, i, "rm")
    else:
        raise DataError(source, f"format '{fmt}' holds no preference pairs")
    if fmt in ("pairwise", "sharegpt", "messages"):
        gkey, bkey = args.good_key or "chosen", args.bad_key or "rejected"
        good, bad = _column(row, gkey, source, i), _column(row, bkey, source, i)
        ranked = [_answer_text(good, source, i, gkey), _answer_text(bad, source, i, bkey)]
        pairs = [(0, 1)]
        field_name = f"{gkey}/{bkey}"
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
        n = len(ranked)
        pairs = ([(a, b) for a in range(n) for b in range(a + 1, n)] if args.ranked_pairs == "all"
                 else [(a, a + 1) for a in range(n - 1)])
        field_name = key
    out = []
    for a, b in pairs:
        if ranked[a] == ranked[b]:
            raise DataError(source, "chosen and rejected answers are identical", i, field_name)
        out.append(_record(system, history, question, chosen=ranked[a], rejected=ranked[b]))
    return out


_SCALAR_TYPES = frozenset((str, int, float, bool, type(None)))


def prompt_columns(row: dict, fmt: str, args: DataArguments) -> dict:
    """The extra columns of a prompt row, in row order, for PPO's reward functions (`rlhf_trl.rewards.reward_columns`):
    every scalar column (str / int / float / bool / None) not read as the prompt (``fmt`` sharegpt: conversations;
    messages: messages; implicit: chosen / rejected; else the question, ``input`` and ``history`` columns). Answer
    columns count (e.g. gsm8k's ``answer``: a reward function's reference); list / dict columns do not."""
    if fmt == "sharegpt":
        used = (args.conversations_key or "conversations",)
    elif fmt == "messages":
        used = (args.messages_key or "messages",)
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


def _prompt_row(row: dict, fmt: str, args: DataArguments, source: str, i: int) -> dict:
    rec = _prompt_fields(row, fmt, args, source, i)
    if len(row) > 1:  # a one-column row is its prompt (the common prompt file): no extras to look for
        columns = prompt_columns(row, fmt, args)
        if columns:  # rows without extra columns keep their plain records
            rec["columns"] = columns
    return rec


def _prompt_fields(row: dict, fmt: str, args: DataArguments, source: str, i: int) -> dict:
    if fmt == "sharegpt":
        history, question, _ = _sharegpt_dialogue(row, args, source, i, needs_answer=False, drop_answer=True)
        return _record(None, history, question)
    if fmt == "messages":
        return _record(*_messages_dialogue(row, args, source, i, "user")[:3])
    if fmt == "implicit":
        rec = _implicit(row, args, source, i)
        del rec["chosen"], rec["rejected"]
        return rec
    return _record(*_prompt(row, args, source, i, "prompts"))

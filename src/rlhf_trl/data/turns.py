"""The one turn parser of `rlhf_trl.data`, shared by step 2 (`.formats`) and step 3 (`.tokenize`): sharegpt
``[{from, value}]``, OpenAI / TRL ``[{role, content}]`` (content parts, ``tool_calls``) and Firefly
``[{human, assistant}]`` turns become ``(role, content)`` pairs with the same roles, checks and errors, then a dialogue:
``(system, history, question, answer)``; transcripts (``"\\n\\nHuman: ..."``) too. Roles: ``system``, ``user``,
``assistant``, and for tool-calling rows (chat template only: `chat_messages`) ``tool_call`` (sharegpt
``function_call``; content: the call as JSON) and ``tool`` (sharegpt ``observation``)."""

from __future__ import annotations

import json
import re
from functools import lru_cache

from .report import DataError
from .template import HISTORY_SEPARATOR

DEFAULT_HUMAN_MARKER = "\n\nHuman:"
DEFAULT_ASSISTANT_MARKER = "\n\nAssistant:"

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
         "function_call": "tool_call", "observation": "tool", "tool": "tool", "function": "tool"}
TOOL_ROLES = ("tool_call", "tool")
_NEEDS = {"assistant": "a user turn followed by an assistant turn", "user": "a user turn"}  # needed by a cut at `end`
_ALTERNATING = [(["user", "assistant"] * 33)[:n] for n in range(65)]  # well-formed role sequences, by length


def is_messages(value) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict)


def message_content(value):
    """A message's content: a string, or OpenAI content parts ``[{type: text, text}]`` joined."""
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):
        texts = [p.get("text") for p in value if p.get("type", "text") == "text"]
        if texts and all(isinstance(t, str) for t in texts):
            return "".join(texts)
    return value


def parse_turns(value, source: str, i: int, key: str) -> list[tuple[str, str]]:
    """``[(role, content)]`` of ``[{role, content}]``, ``[{from, value}]`` or Firefly turns. Raises `DataError`: not a
    non-empty list of these, an unknown role, an empty (non-assistant) or non-string content."""
    if value.__class__ is list and value:  # fast path: plain {role, content} messages with text content
        out = []
        append = out.append
        try:
            for turn in value:
                content = turn["content"]
                if content.__class__ is not str or not content or content.isspace() or "tool_calls" in turn:
                    break
                append((ROLES[turn["role"]], content))
            else:
                return out
        except (KeyError, TypeError):
            pass
    if value is None:  # the checked path: every shape, raising on the first bad message
        raise DataError(source, "is null or missing in this row", i, key)
    if not isinstance(value, list) or not value:
        raise DataError(source, "must be a non-empty list of {role, content} messages, got "
                                f"{type(value).__name__}", i, key)
    out = []
    for j, turn in enumerate(value):
        if not isinstance(turn, dict):
            raise DataError(source, f"message {j} must be a {{role, content}} object, got {type(turn).__name__}",
                            i, key)
        if "human" in turn or "assistant" in turn and "role" not in turn:  # Firefly: one exchange per object
            out += [_checked_turn("user", turn.get("human"), source, i, key, j),
                    _checked_turn("assistant", turn.get("assistant"), source, i, key, j)]
            continue
        role = turn.get("role") if turn.get("role") is not None else turn.get("from")
        content = message_content(turn.get("content") if turn.get("content") is not None else turn.get("value"))
        if ROLES.get(role) is None:
            raise DataError(source, f"message {j} has role {role!r}; use system, user, assistant or tool (sharegpt: "
                                    "human, gpt, function_call, observation)", i, key)
        if turn.get("tool_calls"):  # an OpenAI assistant message calling tools: its text, if any, is dropped
            calls = [c.get("function", c) if isinstance(c, dict) else c for c in turn["tool_calls"]]
            role, content = "function_call", json.dumps(calls[0] if len(calls) == 1 else calls, ensure_ascii=False)
        out.append(_checked_turn(ROLES[role], content, source, i, key, j))
    return out


def _checked_turn(role: str, content, source: str, i: int, key: str, j: int) -> tuple[str, str]:
    if not isinstance(content, str) or not content.strip() and role != "assistant":  # a reply may be empty
        raise DataError(source, f"message {j} ({role}) has an empty or non-string content", i, key)
    if role == "tool_call" and not isinstance(_json(content), (dict, list)):
        raise DataError(source, f"message {j} (function_call) must be a JSON object {{name, arguments}}", i, key)
    return role, content


def parse_tools(value, source: str, i: int, key: str = "tools") -> list[dict] | None:
    """A row's ``tools`` (function schemas, or their JSON); None if empty. Raises `DataError`: not a list of objects."""
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise DataError(source, f"is not valid JSON ({exc.msg})", i, key) from None
    if value is None or value == []:
        return None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise DataError(source, "must be a list of function schemas (objects) or its JSON text", i, key)
    return value


def chat_messages(turns: list[tuple[str, str]]) -> list[dict]:
    """``[{role, content}]`` for ``apply_chat_template``; a ``tool_call`` turn becomes an assistant's ``tool_calls``."""
    out = []
    for role, content in turns:
        if role != "tool_call":
            out.append({"role": role, "content": content})
            continue
        calls = json.loads(content)  # arguments as an object where they are JSON text (OpenAI's convention)
        calls = [{**c, "arguments": _json(c["arguments"], c["arguments"])} if isinstance(c.get("arguments"), str)
                 else c for c in ([calls] if isinstance(calls, dict) else calls)]
        out.append({"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": c}
                                                                       for c in calls]})
    return out


def _json(text: str, default=None):
    """``json.loads(text)``, or ``default`` where ``text`` is not valid JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return default


def dialogue(turns: list[tuple[str, str]], source: str, i: int, key: str, end: str):
    """Split turns without tool roles into ``(system, history, question, answer)``, cut after the last ``end`` turn
    (``'assistant'``: the answer; ``'user'``: None); before it, user / assistant alternate after an optional system
    turn. Raises `DataError`: no such cut (or no user turn before it), a system turn not first, or no alternation."""
    system, offset = None, 0
    if turns and turns[0][0] == "system":
        system, turns, offset = turns[0][1], turns[1:], 1
    last = next((k for k in range(len(turns) - 1, -1, -1) if turns[k][0] == end), -1)
    if last < 0 or (end == "assistant" and last == 0):
        raise DataError(source, f"needs {_NEEDS[end]}", i, key)
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


def tool_dialogue(turns: list[tuple[str, str]], source: str, i: int, key: str, end: str):
    """`dialogue` for turns with tool roles: ``(system, prompt_turns, question, answer_turn)``; the answer is the last
    assistant or tool-call turn (``end='assistant'``; ``'user'``: None, the prompt runs to the last user or tool turn).
    Raises `DataError`: no ``end`` turn, a first turn not the user's, a tool result after no call / result."""
    system = turns[0][1] if turns and turns[0][0] == "system" else None
    offset = int(system is not None)
    body, ends = turns[offset:], ("assistant", "tool_call") if end == "assistant" else ("user", "tool")
    last = max((k for k, (role, _) in enumerate(body) if role in ends), default=-1)
    if last < (1 if end == "assistant" else 0):
        raise DataError(source, f"needs {_NEEDS[end]}", i, key)
    for k, (role, _) in enumerate(body[: last + 1]):
        prev = body[k - 1][0] if k else None
        bad = "must be user" if k == 0 and role != "user" else (
            "must follow a function call or another tool result" if role == "tool" and prev not in TOOL_ROLES else None)
        if bad or role == "system":
            raise DataError(source, f"message {k + offset} ({role}) {bad or 'is only allowed as the first message'}",
                            i, key)
    prompt = body[: last + 1] if end == "user" else body[:last]
    question = next(text for role, text in reversed(prompt) if role == "user")
    return system, prompt, question, body[last] if end == "assistant" else None


@lru_cache(maxsize=16)
def marker_pair(human: str, assistant: str) -> tuple[str, str]:
    """One shared tuple per marker pair (records hold a reference, not a copy)."""
    return human, assistant


@lru_cache(maxsize=16)
def _marker_pattern(human: str, assistant: str):
    return re.compile(f"({re.escape(human)}|{re.escape(assistant)})")


def split_transcript(text: str, human_marker: str = DEFAULT_HUMAN_MARKER,
                     assistant_marker: str = DEFAULT_ASSISTANT_MARKER):
    """A prompt transcript ending with the assistant marker as ``(system, history, question)``: text before the first
    marker is the system turn; a speaker's consecutive turns join; no user turn: all is the question."""
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
        return None, [], text.removesuffix(assistant_marker).strip() or text
    if turns[0][0] == "assistant":
        turns = turns[1:]
    return system, [(turns[k][1], turns[k + 1][1]) for k in range(0, len(turns) - 1, 2)], turns[-1][1]

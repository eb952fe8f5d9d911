"""Step 3 of `rlhf_trl.data`: tokenize records, ``prompt_ids + response_ids + [eos]`` for every stage."""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any, Literal

from .args import DEFAULT_ASSISTANT_MARKER, DEFAULT_HUMAN_MARKER, DataError, Template
from .report import DataReport
from .turns import _markers, split_transcript

logger = logging.getLogger("rlhf_trl.data")  # the data modules log as one


def _encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of plain text: no BOS/EOS added, special-token strings in the data tokenized as text."""
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def _tokenizer_name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__


def _require_chat_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"chat_template: true, but the tokenizer at '{_tokenizer_name(tokenizer)}' has no chat "
                         "template; set chat_template: false (text templates) or use a tokenizer that has one")


def _render_chat(tokenizer, messages: list[dict], what: str, **kwargs) -> str:
    """``apply_chat_template(messages, tokenize=False)``. Raises `ValueError` (one line): the template fails."""
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except TemplateError as exc:
        raise ValueError(f"the chat template of '{_tokenizer_name(tokenizer)}' fails on {what}: "
                         f"{type(exc).__name__}: {exc}; fix its chat_template or set chat_template: false") from None


_END_OF_TURN: dict[int, tuple[Any, int]] = {}  # id(tokenizer) -> (weakref to it, end-of-turn id)
_PROBE = "\u2063probe\u2063"


def chat_end_of_turn_id(tokenizer, model_dir: str | None = None) -> int:
    """The token id a chat template ends an assistant turn with (Qwen: ``<|im_end|>``), an EOS id of ``model_dir``.
    Raises `ValueError`: no chat template, one that fails, no special token, no EOS id."""
    _require_chat_template(tokenizer)
    if (cached := _END_OF_TURN.get(id(tokenizer))) is not None and cached[0]() is tokenizer and model_dir is None:
        return cached[1]
    from ..models import eos_token_ids

    rendered = _render_chat(tokenizer, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}],
                            "a user turn and an assistant turn")
    tail = rendered[rendered.rindex(_PROBE) + len(_PROBE):] if _PROBE in rendered else ""
    special = set(tokenizer.all_special_ids) | {
        i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
    ids = tokenizer(tail, add_special_tokens=False)["input_ids"] if tail else []
    eot, name = next((i for i in ids if i in special), None), _tokenizer_name(tokenizer)
    if eot is None:
        raise ValueError(f"the chat template of '{name}' ends an assistant turn with {tail!r}, which holds no special "
                         "token to end responses with; use a template that closes turns with an EOS token")
    if model_dir is None and os.path.isdir(str(getattr(tokenizer, "name_or_path", "") or "")):
        model_dir = tokenizer.name_or_path
    allowed = eos_token_ids(tokenizer, model_dir)
    if eot not in allowed:
        config = os.path.join(model_dir or name, "generation_config.json")
        raise ValueError(f"the chat template of '{name}' ends assistant turns with "
                         f"{tokenizer.convert_ids_to_tokens(eot)!r} (id {eot}), which is neither the tokenizer's EOS "
                         f"{tokenizer.eos_token!r} nor in eos_token_id of {config} (EOS ids {allowed}); "
                         f"add {eot} there")
    _END_OF_TURN[id(tokenizer)] = (weakref.ref(tokenizer), eot)
    return eot


def response_eos_id(tokenizer, template: Template) -> int:
    """The id ending every response: EOS, or in chat mode `chat_end_of_turn_id` (raising as it does)."""
    return chat_end_of_turn_id(tokenizer) if template.chat else tokenizer.eos_token_id


def encode_prompt(tokenizer, template: Template, question: str, history=None, system: str | None = None,
                  text: str | None = None) -> list[int]:
    """Token ids ``[prompt_len]`` of the prompt: `Template.format_prompt`, or (chat) ``apply_chat_template(...,
    add_generation_prompt=True)``. Raises `ValueError`: no (working) chat template."""
    if not template.chat:
        return _encode_text(tokenizer, template.format_prompt(question, history, text, system))
    _require_chat_template(tokenizer)
    short = question if len(question) <= 40 else question[:37] + "..."
    return tokenizer(_render_chat(tokenizer, template.messages(question, history, system), f"the prompt {short!r}",
                                  add_generation_prompt=True), add_special_tokens=False)["input_ids"]


def encode_response(tokenizer, template: Template, answer: str, raw: bool = False) -> list[int]:
    """Token ids ``[response_len + 1]``: the completion (``raw``: the answer as is), tokenized alone, then the EOS."""
    return _encode_text(tokenizer, template.format_completion(answer, raw)) + [response_eos_id(tokenizer, template)]


def _prompt_ids(tokenizer, template: Template, record: dict) -> list[int]:
    if "messages" in record:  # a tool-calling conversation (chat mode only: `rlhf_trl.data.rows._conversation`)
        rendered = _render_chat(tokenizer, record["messages"], f"the tool-calling prompt {record['question'][:30]!r}",
                                tools=record.get("tools"), add_generation_prompt=True)
        return tokenizer(rendered, add_special_tokens=False)["input_ids"]
    if template.chat and record.get("text") is not None:  # a transcript: render its turns with the chat template
        markers = record.get("markers", _markers(DEFAULT_HUMAN_MARKER, DEFAULT_ASSISTANT_MARKER))
        system, history, question = split_transcript(record["text"], *markers)
        return encode_prompt(tokenizer, template, question, history, record.get("system", system))
    return encode_prompt(tokenizer, template, record["question"], record.get("history"), record.get("system"),
                         record.get("text"))


def _response_ids(tokenizer, template: Template, record: dict, key: str) -> list[int]:
    if "target" not in record:
        answer = record[key]
        if template.chat and record.get("text") is not None:
            answer = answer.lstrip()  # "\n\nAssistant: Sure" -> the chat template's assistant turn holds "Sure"
        return encode_response(tokenizer, template, answer, raw=record.get("text") is not None)
    # an assistant's tool call: the text the chat template renders for it after the prompt, up to its end-of-turn
    kwargs, what = {"tools": record.get("tools")}, f"the tool call answering {record['question'][:30]!r}"
    prompt = _render_chat(tokenizer, record["messages"], what, add_generation_prompt=True, **kwargs)
    full = _render_chat(tokenizer, record["messages"] + [record["target"]], what, **kwargs)
    end = tokenizer.convert_ids_to_tokens(chat_end_of_turn_id(tokenizer))
    if not full.startswith(prompt) or end not in full[len(prompt):]:
        raise ValueError(f"the chat template of '{_tokenizer_name(tokenizer)}' does not render {what} after its "
                         "prompt; use a template that supports tool calls")
    return _encode_text(tokenizer, full[len(prompt):].split(end, 1)[0]) + [response_eos_id(tokenizer, template)]


def _check_records(records: list[dict], tokenizer, template: Template, source: str, length_policy: str = "drop",
                   report: DataReport | None = None):
    """Check ``length_policy``, chat mode, tool support; count system turns dropped (no ``{system}`` slot)."""
    if length_policy not in ("drop", "truncate_prompt"):
        raise ValueError(f"length_policy must be 'drop' or 'truncate_prompt', got {length_policy!r}")
    if template.chat:
        chat_end_of_turn_id(tokenizer)
        if any("messages" in r for r in records) and "tools" not in tokenizer.chat_template:
            raise ValueError(f"{source}: tool-calling rows, but the chat template of '{_tokenizer_name(tokenizer)}' "
                             "does not take tools; use a tokenizer whose template renders tools (Qwen2.5's does)")
    dropped = 0 if template.has_system_slot else sum(
        1 for r in records if r.get("system") is not None and r.get("text") is None)
    if dropped:
        if report is not None:
            report.system_turns_dropped += dropped
        logger.warning("%s: %d of %d rows have a system turn; the text template has no {system} slot: dropped "
                       "(chat_template: true, or {system} in prompt_template, keeps it)", source, dropped,
                       len(records))


def _tally(report: DataReport, source: str, split: str, total: int, limit: int | None, counts: tuple, **lengths):
    """Log each non-zero count and add it, and the token ``lengths`` per part, to ``report`` under ``split``."""
    for kind, what, n in counts:
        if n:
            logger.warning("%s: %d of %d %s=%s tokens", source, n, total, what, limit)
        report.count(kind, f"{split}: {what}", n)
    for part, values in lengths.items():
        report.lengths(split, part, values)


def sft_features(records: list[dict], tokenizer, template: Template, max_length: int | None = None,
                 source: str = "dataset", length_policy: Literal["drop", "truncate_prompt"] = "drop",
                 max_prompt_length: int | None = None, report: DataReport | None = None,
                 split: str = "train") -> dict[str, list]:
    """Tokenize SFT records for `trl.SFTTrainer`: ``input_ids`` and ``completion_mask`` (1 on response tokens incl.
    EOS), lists of ``[prompt_len + response_len + 1]``. Rows over ``max_length`` tokens (counted in ``report``):
    ``'drop'`` drops those whose prompt fills it (the trainer cuts the others); ``'truncate_prompt'`` cuts the prompt
    from the left to fit the response (no room: ``min(max_prompt_length, max_length - 1)`` tokens kept). Raises
    `DataError`: no row left; `ValueError`: a bad ``length_policy``, chat mode problems."""
    _check_records(records, tokenizer, template, source, length_policy, report)
    input_ids, masks = [], []
    dropped = truncated = cut = 0
    for r in records:
        p, c = _prompt_ids(tokenizer, template, r), _response_ids(tokenizer, template, r, "answer")
        if max_length is not None and len(p) + len(c) > max_length:
            if length_policy == "truncate_prompt":
                room = max_length - len(c)
                keep = room if room >= 1 else min(max_prompt_length or max_length - 1, max_length - 1)
                if keep < len(p):
                    p = p[-keep:]
                    truncated += 1
            elif len(p) >= max_length:
                dropped += 1
                continue
            cut += len(p) + len(c) > max_length
        input_ids.append(p + c)
        masks.append([0] * len(p) + [1] * len(c))
    _tally(report or DataReport("sft"), source, split, len(records), max_length, (
        ("dropped", "rows dropped: the prompt alone fills max_length", dropped),
        ("truncated", "prompts truncated from the left to fit max_length", truncated),
        ("truncated", "answers are cut at max_length", cut)),
        prompt=[m.count(0) for m in masks], response=[sum(m) for m in masks])
    if records and not input_ids:
        raise DataError(source, f"no row is left: every prompt fills max_length={max_length} tokens (raise "
                                "max_length or set length_policy: truncate_prompt)")
    return {"input_ids": input_ids, "completion_mask": masks}


def pair_features(records: list[dict], tokenizer, template: Template, max_length: int | None = None,
                  length_policy: Literal["drop", "truncate_prompt"] = "drop",
                  source: str = "dataset", report: DataReport | None = None, split: str = "train") -> dict[str, list]:
    """Tokenize pairs for `RewardTrainer`: ``chosen_ids`` / ``rejected_ids`` (prompt + response + EOS),
    ``prompt_length``; pairs over ``max_length`` dropped or prompt-cut. Raises `DataError`: no pair left."""
    _check_records(records, tokenizer, template, source, length_policy, report)
    out = {"chosen_ids": [], "rejected_ids": [], "prompt_length": []}
    dropped = truncated = 0
    for r in records:
        p = _prompt_ids(tokenizer, template, r)
        c, j = _response_ids(tokenizer, template, r, "chosen"), _response_ids(tokenizer, template, r, "rejected")
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
    _tally(report or DataReport("rm"), source, split, len(records), max_length, (
        ("dropped", "pairs dropped: longer than max_length", dropped),
        ("truncated", "pair prompts truncated from the left to fit max_length", truncated)),
        prompt=out["prompt_length"], response=[max(len(c), len(j)) - p for c, j, p in
                                               zip(out["chosen_ids"], out["rejected_ids"], out["prompt_length"])])
    if not out["chosen_ids"]:
        raise DataError(source, f"no pair is left: all {len(records)} pairs exceed max_length={max_length} tokens "
                                "(raise max_length or set length_policy: truncate_prompt)")
    return out


def prompt_features(records: list[dict], tokenizer, template: Template, max_prompt_length: int,
                    source: str = "dataset", report: DataReport | None = None, split: str = "train") -> dict[str, list]:
    """PPO prompts, tokenized as SFT / RM do, ``[<= max_prompt_length]``. Raises `ValueError`: bad length."""
    if max_prompt_length < 1:
        raise ValueError(f"max_prompt_length must be >= 1 (prompt tokens kept), got {max_prompt_length}")
    _check_records(records, tokenizer, template, source, report=report)
    full = [_prompt_ids(tokenizer, template, r) for r in records]
    _tally(report or DataReport("ppo"), source, split, len(full), max_prompt_length, (
        ("truncated", "prompts cut to their last max_prompt_length", sum(len(p) > max_prompt_length for p in full)),),
        prompt=[min(len(p), max_prompt_length) for p in full])
    return {"input_ids": [p[-max_prompt_length:] for p in full]}

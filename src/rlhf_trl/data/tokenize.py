"""Step 3 of `rlhf_trl.data`: tokenize records, ``prompt_ids + response_ids + [eos]`` for every stage."""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any, Literal

from .report import DataError, DataReport
from .template import HISTORY_SEPARATOR, Template
from .turns import split_transcript

logger = logging.getLogger("rlhf_trl.data")  # the data modules log as one


def encode_text(tokenizer, text: str) -> list[int]:
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
        return encode_text(tokenizer, template.format_prompt(question, history, text, system))
    _require_chat_template(tokenizer)
    short = question if len(question) <= 40 else question[:37] + "..."
    return tokenizer(_render_chat(tokenizer, template.messages(question, history, system), f"the prompt {short!r}",
                                  add_generation_prompt=True), add_special_tokens=False)["input_ids"]


def encode_response(tokenizer, template: Template, answer: str, raw: bool = False) -> list[int]:
    """Token ids ``[response_len + 1]``: the completion (``raw``: the answer as is), tokenized alone, then the EOS."""
    return encode_text(tokenizer, template.format_completion(answer, raw)) + [response_eos_id(tokenizer, template)]


def _prompt_ids(tokenizer, template: Template, record: dict) -> list[int]:
    if "messages" in record:  # a tool-calling conversation (chat mode only: `rlhf_trl.data.formats._conversation`)
        rendered = _render_chat(tokenizer, record["messages"], f"the tool-calling prompt {record['question'][:30]!r}",
                                tools=record.get("tools"), add_generation_prompt=True)
        return tokenizer(rendered, add_special_tokens=False)["input_ids"]
    if template.chat and record.get("text") is not None:  # a transcript: render its turns with the chat template
        system, history, question = split_transcript(record["text"], *record.get("markers", ()))  # default markers
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
    return encode_text(tokenizer, full[len(prompt):].split(end, 1)[0]) + [response_eos_id(tokenizer, template)]


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


def _length_hint(length_policy: str) -> str:
    """How to fit more rows into ``max_length``: only what the recipe has not set already."""
    return ("(raise max_length: with length_policy: truncate_prompt the responses alone exceed it)"
            if length_policy == "truncate_prompt" else "(raise max_length or set length_policy: truncate_prompt)")


def _tally(report: DataReport, source: str, split: str, total: int, limit: int | None, counts: tuple, **lengths):
    """Log each non-zero count and add it, and the token ``lengths`` per part, to ``report`` under ``split``."""
    for kind, what, n in counts:
        if n:
            logger.warning("%s: %d of %d %s=%s tokens", source, n, total, what, limit)
        report.count(kind, f"{split}: {what}", n)
    for part, values in lengths.items():
        report.lengths(split, part, values)


def _text_turns(tokenizer, template: Template, record: dict) -> list[tuple]:
    """`_sft_turns` with a text / raw template: the history as `Template.format_prompt` renders it, cut into turns
    (``问：q1\\n\\n答：`` | ``a1`` EOS | ``\\n\\n问：q2\\n\\n答：`` | ``a2`` EOS ...), each piece tokenized on its own."""
    eos, sep = response_eos_id(tokenizer, template), "" if template.mode == "raw" else HISTORY_SEPARATOR
    system, out = record.get("system"), []
    for k, (question, answer) in enumerate(record["history"]):
        prompt = (sep if k else "") + template.format_prompt(question, system=None if k else system)
        reply = encode_text(tokenizer, template.format_completion(answer)) + [eos]
        out.append((encode_text(tokenizer, prompt), reply, False, bool(answer.strip())))
    prompt = (sep if out else "") + template.format_prompt(record["question"], system=None if out else system)
    out.append((encode_text(tokenizer, prompt), _response_ids(tokenizer, template, record, "answer"), False, True))
    return out


def _chat_turns(tokenizer, template: Template, record: dict) -> list[tuple]:
    """`_sft_turns` with the chat template: the conversation rendered up to each assistant turn (generation prompt
    included); the text after a reply's end-of-turn token up to the next generation prompt is a prompt piece, a reply
    the text the template renders for it (tool calls: the ``<tool_call>`` block). Raises `ValueError`: a template
    that renders earlier turns differently as the conversation grows (set ``mask_history: true``)."""
    if "messages" in record:  # a tool-calling conversation (`rlhf_trl.data.formats._conversation`)
        messages, kwargs = record["messages"], {"tools": record.get("tools")}
    else:  # the chat template is there: `_check_records` checked it (`chat_end_of_turn_id`)
        messages, kwargs = template.messages(record["question"], record["history"], record.get("system")), {}
    what = f"the conversation ending {record['question'][:30]!r}"
    at = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    renders = [_render_chat(tokenizer, messages[:k], what, add_generation_prompt=True, **kwargs)
               for k in at + [len(messages)]]  # the last: the record's answer's prompt, as `_prompt_ids` renders it
    eot = response_eos_id(tokenizer, template)
    end, out, pos = tokenizer.convert_ids_to_tokens(eot), [], 0
    for k, here, after in zip(at, renders, renders[1:]):
        content = None if messages[k].get("tool_calls") else messages[k]["content"]
        rest = after[len(here):] if after.startswith(here) else ""
        reply = content if content is not None and rest.startswith(content + end) else rest.split(end, 1)[0]
        if end not in rest:
            raise ValueError(f"the chat template of '{_tokenizer_name(tokenizer)}' renders the earlier turns of {what} "
                             "differently as the conversation grows, so its assistant turns cannot be trained one by "
                             "one; set mask_history: true (train the last turn only)")
        prompt = tokenizer(here[pos:], add_special_tokens=False)["input_ids"]
        out.append((prompt, encode_text(tokenizer, reply) + [eot], content is None, bool(reply.strip())))
        pos = len(here) + len(reply) + len(end)
    prompt = tokenizer(renders[-1][pos:], add_special_tokens=False)["input_ids"]
    out.append((prompt, _response_ids(tokenizer, template, record, "answer"), "target" in record, True))
    return out


def _sft_turns(tokenizer, template: Template, record: dict) -> list[tuple]:
    """A record's turns ``[(prompt_ids, reply_ids, is_tool_call, is_target)]``, ``reply_ids`` ending with the EOS /
    end-of-turn id: one (``prompt ids``, ``response ids``) without ``"train_history"``, else one per assistant turn
    (empty history replies are no targets). Joined they are the conversation as the template renders it, an EOS /
    end-of-turn id after each reply. Raises `ValueError`: chat mode problems."""
    if record.get("train_history"):
        return (_chat_turns if template.chat else _text_turns)(tokenizer, template, record)
    return [(_prompt_ids(tokenizer, template, record), _response_ids(tokenizer, template, record, "answer"),
             "target" in record, True)]


def _fit_turns(turns: list[tuple], max_length: int | None, length_policy: str, max_prompt_length: int | None):
    """``(input_ids, completion_mask, counts)`` of `_sft_turns` joined, mask 1 on target replies (EOS included), or
    None: dropped (the first prompt fills ``max_length``, ``'drop'``). Over ``max_length`` tokens: a first turn as a
    single-turn row (``'truncate_prompt'`` cuts its prompt from the left to fit the reply); a later turn whose prompt
    leaves no room for a reply token is left out with the turns after it (a cut at a turn boundary); the last turn
    kept may run over (the trainer cuts its reply). ``counts``: ``(prompt truncated, reply cut, any turn left out,
    turns trained, tool calls trained, turns cut)``."""
    ids, mask, truncated, over = [], [], False, False
    trained = calls = left_out = 0
    for k, (p, c, call, target) in enumerate(turns):
        if max_length is not None and len(ids) + len(p) + len(c) > max_length:
            if k == 0 and length_policy == "truncate_prompt":
                room = max_length - len(c)
                keep = room if room >= 1 else min(max_prompt_length or max_length - 1, max_length - 1)
                if keep < len(p):
                    p, truncated = p[-keep:], True
            elif len(ids) + len(p) >= max_length:
                if k == 0:
                    return None
                left_out = sum(t[3] for t in turns[k:])
                break
            over = len(ids) + len(p) + len(c) > max_length
        ids += p + c
        mask += [0] * len(p) + [int(target)] * len(c)
        trained += target
        calls += target and call
        if over:
            left_out = sum(t[3] for t in turns[k + 1:])
            break
    return ids, mask, (truncated, over, left_out > 0, trained, calls, left_out + (over and target))


def sft_features(records: list[dict], tokenizer, template: Template, max_length: int | None = None,
                 source: str = "dataset", length_policy: Literal["drop", "truncate_prompt"] = "drop",
                 max_prompt_length: int | None = None, report: DataReport | None = None,
                 split: str = "train") -> dict[str, list]:
    """Tokenize SFT records for `trl.SFTTrainer`: ``input_ids`` and ``completion_mask``, lists of ``[seq_len]``:
    ``prompt ids + response ids + EOS``, or for records with ``"train_history"`` every turn so (`_sft_turns`), mask 1
    on each target reply and its EOS / end-of-turn id, 0 elsewhere (prompts, tool results). Rows over ``max_length``
    tokens (`_fit_turns`, counted in ``report``): ``'drop'`` drops those whose first prompt fills it (the trainer cuts
    the others); ``'truncate_prompt'`` cuts that prompt from the left to fit its response (no room:
    ``min(max_prompt_length, max_length - 1)`` tokens kept); a conversation is cut at a turn boundary. ``report``
    gets per ``split`` the conversations, assistant turns / tool calls trained and turns cut. Raises `DataError`: no
    row left; `ValueError`: a bad ``length_policy``, chat mode problems."""
    _check_records(records, tokenizer, template, source, length_policy, report)
    report = report if report is not None else DataReport("sft")
    fitted = (_fit_turns(_sft_turns(tokenizer, template, r), max_length, length_policy, max_prompt_length)
              for r in records)
    kept = [f for f in fitted if f is not None]  # None: dropped
    input_ids, masks = [ids for ids, _, _ in kept], [mask for _, mask, _ in kept]
    truncated, cut, split_turns, trained, calls, turns_cut = [sum(c) for c in zip(*(n for *_, n in kept))] or [0] * 6
    _tally(report, source, split, len(records), max_length, (
        ("dropped", "rows dropped: the prompt alone fills max_length", len(records) - len(kept)),
        ("truncated", "prompts truncated from the left to fit max_length", truncated),
        ("truncated", "answers are cut at max_length", cut),
        ("truncated", "conversations cut after the last turn that fits max_length", split_turns)),
        prompt=[m.count(0) for m in masks], response=[sum(m) for m in masks])
    report.turns_trained(split, len(input_ids), trained, calls, turns_cut)
    if records and not input_ids:
        raise DataError(source, f"no row is left: every prompt fills max_length={max_length} tokens "
                                f"{_length_hint(length_policy)}")
    return {"input_ids": input_ids, "completion_mask": masks}


def pair_features(records: list[dict], tokenizer, template: Template, max_length: int | None = None,
                  length_policy: Literal["drop", "truncate_prompt"] = "drop",
                  source: str = "dataset", report: DataReport | None = None, split: str = "train") -> dict[str, list]:
    """Tokenize pairs for `RewardTrainer`: ``chosen_ids`` / ``rejected_ids`` (prompt + response + EOS),
    ``prompt_length``; pairs over ``max_length`` dropped or prompt-cut. Raises `DataError`: no pair left."""
    kept = _fit_prompts(records, tokenizer, template, ("chosen", "rejected"), max_length, length_policy, source,
                        report or DataReport("rm"), split, "pair")
    if not kept:
        raise DataError(source, f"no pair is left: all {len(records)} pairs exceed max_length={max_length} tokens "
                                f"{_length_hint(length_policy)}")
    return {"chosen_ids": [p + c for _, p, (c, _) in kept], "rejected_ids": [p + j for _, p, (_, j) in kept],
            "prompt_length": [len(p) for _, p, _ in kept]}


def _fit_prompts(records: list[dict], tokenizer, template: Template, keys: tuple[str, ...], max_length: int | None,
                 length_policy: str, source: str, report: DataReport, split: str, what: str) -> list[tuple]:
    """``[(record, prompt_ids, [response_ids of each of keys])]`` of `pair_features` (``what``: 'pair') and
    `unpaired_features` ('example'): records whose prompt and longest response exceed ``max_length`` tokens dropped
    or, with ``'truncate_prompt'``, their prompt cut from the left to fit (no room: dropped), counted in ``report``.
    Raises `ValueError`: a bad ``length_policy``, chat mode problems."""
    _check_records(records, tokenizer, template, source, length_policy, report)
    kept, dropped, truncated = [], 0, 0
    for r in records:
        p, responses = _prompt_ids(tokenizer, template, r), [_response_ids(tokenizer, template, r, k) for k in keys]
        longest = max(map(len, responses))
        if max_length is not None and len(p) + longest > max_length:
            room = max_length - longest
            if length_policy == "drop" or room < 1:
                dropped += 1
                continue
            p, truncated = p[-room:], truncated + 1
        kept.append((r, p, responses))
    _tally(report, source, split, len(records), max_length, (
        ("dropped", f"{what}s dropped: longer than max_length", dropped),
        ("truncated", f"{what} prompts truncated from the left to fit max_length", truncated)),
        prompt=[len(p) for _, p, _ in kept], response=[max(map(len, rs)) for _, _, rs in kept])
    return kept


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


def unpaired_features(records: list[dict], tokenizer, template: Template, max_length: int | None = None,
                      length_policy: Literal["drop", "truncate_prompt"] = "drop", source: str = "dataset",
                      report: DataReport | None = None, split: str = "train") -> dict[str, list]:
    """Tokenize unpaired (KTO) records for `trl.KTOTrainer`: ``prompt_ids`` ``[prompt_len]``, ``completion_ids``
    ``[response_len + 1]`` (the answer, then the EOS: the ids the reward model and PPO see) and ``label`` (True:
    desirable); records over ``max_length`` tokens dropped or, with ``'truncate_prompt'``, prompt-cut from the left.
    Raises `DataError`: no record left; `ValueError`: a bad ``length_policy``, chat mode problems."""
    kept = _fit_prompts(records, tokenizer, template, ("answer",), max_length, length_policy, source,
                        report or DataReport("kto"), split, "example")
    if not kept:
        raise DataError(source, f"no example is left: all {len(records)} exceed max_length={max_length} tokens "
                                f"{_length_hint(length_policy)}")
    return {"prompt_ids": [p for _, p, _ in kept], "completion_ids": [c for _, _, (c,) in kept],
            "label": [bool(r["label"]) for r, _, _ in kept]}

"""The recipe's data fields (`DataArguments`), the prompt / completion `Template` and `DataError` (`rlhf_trl.data`)."""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import ClassVar

DEFAULT_PROMPT_TEMPLATE = "问：{question}\n\n答："
DEFAULT_COMPLETION_TEMPLATE = "{answer}"
RAW_TEMPLATE = "raw"  # prompt_template: raw -> text rendered verbatim (it carries its own turns)
HISTORY_SEPARATOR = "\n\n"
DEFAULT_HUMAN_MARKER = "\n\nHuman:"
DEFAULT_ASSISTANT_MARKER = "\n\nAssistant:"

FORMATS = ("auto", "alpaca", "sharegpt", "pairwise", "ranked", "prompt", "messages", "conversational", "implicit",
           "firefly")


class DataError(ValueError):
    """Bad input data. The message names the file, and for row-level problems the row (0-based) and field."""

    def __init__(self, source: str, message: str, row: int | None = None, field: str | None = None):
        where = (f", row {row}" if row is not None else "") + (f", field '{field}'" if field is not None else "")
        super().__init__(f"{source}{where}: {message}")
        self.source, self.row, self.field, self.message = source, row, field, message


def _arg(default, help: str):
    """A recipe field and its ``--help`` text."""
    return field(default=default, metadata={"help": help})


@dataclass
class DataArguments:
    """Data fields shared by every stage's recipe (parsed by `TrlParser` next to the TRL config)."""

    # what a YAML value may be where the field's type says less (`rlhf_trl.config.check_types`)
    yaml_types: ClassVar[dict] = {"dataset_name": str | list[str]}

    dataset_name: str | None = _arg(None, "Local file (.json/.jsonl/.csv/.parquet, optionally .gz/.bz2/.xz/.zst/.lz4), "
                                    "a glob ('data/*.jsonl.gz'), a directory of shards, a YAML list of these, or a hub "
                                    "dataset id.")
    dataset_config: str | None = _arg(None, "Config (subset) name of a hub dataset, e.g. 'main' for gsm8k.")
    datasets: list[dict] = field(default_factory=list, metadata={
        "help": "More sources, concatenated after dataset_name (recipe YAML only): a list of mappings, each with "
        "dataset_name and optionally dataset_config, dataset_split, dataset_format, max_samples, prompt_turn, "
        "the markers and the *_key column mapping."})
    dataset_split: str = _arg("train", "Split to read (hub datasets / local files).")
    dataset_format: str = _arg("auto", f"One of {FORMATS}. 'auto' detects it from the columns of the first row.")
    question_key: str | None = _arg(None, "Column holding the question (default: instruction / prompt / question / "
                                    "query); a string, a list of user turns, or a message list.")
    input_key: str | None = _arg(None, "Column appended to the question on a new line (default: input; never the "
                                 "question column itself).")
    answer_key: str | None = _arg(None, "Column holding the answer, or the ranked answer list (default: output / "
                                  "answer / response / completion).")
    good_key: str | None = _arg(None, "Column holding the preferred answer (chosen).")
    bad_key: str | None = _arg(None, "Column holding the rejected answer.")
    history_key: str | None = _arg(None, "Column with earlier turns as [[question, answer], ...] (default: history).")
    conversations_key: str | None = _arg(None, "Column with sharegpt turns [{from, value}] (default: conversations).")
    messages_key: str | None = _arg(None, "Column with OpenAI / TRL turns [{role, content}] (default: messages).")
    prompt_turn: int = _arg(0, "Prompt columns holding a list of user turns: the turn a PPO prompt uses (0 = the "
                            "first; later turns refer to answers the model has not given; -1 = the last). SFT / RM "
                            "refuse such rows.")
    human_marker: str = _arg(DEFAULT_HUMAN_MARKER, "Implicit-prompt pairs (only chosen / rejected transcripts): the "
                             "marker opening a user turn.")
    assistant_marker: str = _arg(DEFAULT_ASSISTANT_MARKER, "Implicit-prompt pairs: the marker opening an assistant "
                                 "turn; the prompt is the shared prefix of chosen and rejected through the last one.")
    prompt_template: str = _arg(DEFAULT_PROMPT_TEMPLATE, "Prompt template; must contain '{question}', or 'raw': the "
                                "text as it is (it carries its own turns).")
    completion_template: str = _arg(DEFAULT_COMPLETION_TEMPLATE, "Completion template; must contain '{answer}'.")
    chat_template: bool = _arg(False, "Render prompts with the tokenizer's chat template (apply_chat_template with "
                               "the generation prompt) and end responses with its end-of-turn token instead of the "
                               "text templates.")
    system_prompt: str | None = _arg(None, "chat_template: true only: system turn for rows that have none of their "
                                     "own.")
    ranked_pairs: str = _arg("all", "Ranked answer lists (best first) -> 'all' ordered pairs, or 'adjacent' pairs "
                             "only.")
    eval_split_size: float = _arg(0.05, "Held-out fraction (<1) or number of rows (>=1) for evaluation.")
    max_samples: int | None = _arg(None, "Use at most this many rows (after reading).")
    max_prompt_length: int = _arg(256, "Prompt tokens kept (from the right) for PPO prompts.")
    length_policy: str = _arg("drop", "SFT rows / RM pairs longer than max_length (tokens): 'drop' them (SFT: rows "
                              "whose prompt alone fills max_length), or 'truncate_prompt' from the left (keeping the "
                              "newest turns and the whole response).")
    mask_history: bool = _arg(False, "SFT on conversations (sharegpt, messages, firefly; alpaca rows with history): "
                              "false trains every assistant turn (tool calls included, tool results never), a "
                              "conversation over max_length cut after the last turn that fits; true trains the last "
                              "turn only, the earlier ones being its prompt (LLaMA-Factory's key).")
    on_bad_row: str = _arg("error", "A bad row (missing / empty / mistyped field): 'error' stops with one line naming "
                           "file, row and field; 'skip' skips it, counted by reason in data_report.json.")
    max_bad_row_fraction: float = _arg(0.05, "on_bad_row: skip: stop when more than this fraction of a source's rows "
                                       "is bad.")
    min_score_margin: float | None = _arg(None, "Pairs with score_chosen / score_rejected: skip pairs whose margin is "
                                          "below this (tied pairs are always skipped).")
    dataset_encoding: str = _arg("utf-8", "Text encoding of local json / jsonl / csv files (any Python codec: gbk, "
                                 "gb18030, big5, ...); UTF-8 files may start with a BOM.")

    def __post_init__(self):
        for key, allowed in {"dataset_format": FORMATS, "ranked_pairs": ("all", "adjacent"),
                             "length_policy": ("drop", "truncate_prompt"), "on_bad_row": ("error", "skip")}.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"{key} must be one of {list(allowed)}, got {getattr(self, key)!r}")
        ranges = {"eval_split_size": (self.eval_split_size, 0, "a fraction < 1 or a row count >= 1, not negative"),
                  "max_prompt_length": (self.max_prompt_length, 1, ">= 1 (tokens)"),
                  "max_samples": (self.max_samples, 1, ">= 1 (rows) or null"),
                  "min_score_margin": (self.min_score_margin, 0, ">= 0 or null")}
        for key, (value, low, want) in ranges.items():
            if value is not None and value < low:
                raise ValueError(f"{key} must be {want}, got {value}")
        if not 0 <= self.max_bad_row_fraction <= 1:
            raise ValueError(f"max_bad_row_fraction must be within [0, 1], got {self.max_bad_row_fraction}")
        try:
            codecs.lookup(self.dataset_encoding)
        except LookupError:
            raise ValueError(f"dataset_encoding: unknown codec {self.dataset_encoding!r}; use e.g. utf-8, gbk, "
                             "gb18030, big5") from None
        Template.from_args(self)  # template placeholders and chat options


@dataclass(frozen=True)
class Template:
    """How prompts and completions render: text templates (default ``问：{question}\n\n答：`` + ``{answer}``), ``'raw'``, or
    ``chat`` (`encode_prompt`). Raises `ValueError`: a bad combination."""

    prompt: str = DEFAULT_PROMPT_TEMPLATE
    completion: str = DEFAULT_COMPLETION_TEMPLATE
    chat: bool = False
    system_prompt: str | None = None

    def __post_init__(self):
        if self.chat:
            if self.prompt != DEFAULT_PROMPT_TEMPLATE or self.completion != DEFAULT_COMPLETION_TEMPLATE:
                raise ValueError("chat_template: true renders turns with the tokenizer's chat template; remove "
                                 "prompt_template / completion_template")
            return
        if self.system_prompt is not None:
            raise ValueError("system_prompt needs chat_template: true (the text templates have no system turn)")
        if self.prompt != RAW_TEMPLATE and "{question}" not in self.prompt:
            raise ValueError(f"prompt_template must contain '{{question}}' or be 'raw', got {self.prompt!r}")
        if "{answer}" not in self.completion:
            raise ValueError(f"completion_template must contain '{{answer}}', got {self.completion!r}")

    @classmethod
    def from_args(cls, args: DataArguments) -> "Template":
        return cls(prompt=args.prompt_template, completion=args.completion_template,
                   chat=bool(args.chat_template), system_prompt=args.system_prompt)

    @property
    def mode(self) -> str:
        """``'chat'``, ``'raw'`` or ``'text'``."""
        return "chat" if self.chat else "raw" if self.prompt == RAW_TEMPLATE else "text"

    def format_prompt(self, question: str, history: list[tuple[str, str]] | None = None,
                      text: str | None = None, system: str | None = None) -> str:
        """The prompt text (text / raw modes), history first, ``{system}`` once. Raises `ValueError`: chat mode."""
        if self.chat:
            raise ValueError("chat-template prompts are rendered by the tokenizer: use encode_prompt")
        if text is not None:
            return text
        if self.prompt == RAW_TEMPLATE:
            return "".join(q + a for q, a in history or []) + question
        parts = [self.prompt.replace("{question}", q) + self.completion.replace("{answer}", a)
                 for q, a in history or []]
        parts.append(self.prompt.replace("{question}", question))
        if self.has_system_slot:
            parts = [p.replace("{system}", system or "" if k == 0 else "") for k, p in enumerate(parts)]
        return HISTORY_SEPARATOR.join(parts)

    @property
    def has_system_slot(self) -> bool:
        """Whether rendered prompts keep a row's system turn (chat mode, or ``{system}`` in the text template)."""
        return self.chat or "{system}" in self.prompt

    def format_completion(self, answer: str, raw: bool = False) -> str:
        """The completion text (EOS is appended as a token id by `encode_response`)."""
        plain = raw or self.chat or self.prompt == RAW_TEMPLATE
        return answer if plain else self.completion.replace("{answer}", answer)

    def messages(self, question: str, history: list[tuple[str, str]] | None = None,
                 system: str | None = None) -> list[dict]:
        """Chat messages ``[{role, content}]``: system turn (the row's, else ``system_prompt``), history, question."""
        system = system if system is not None else self.system_prompt
        out = [{"role": "system", "content": system}] if system is not None else []
        for q, a in history or []:
            out += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        out.append({"role": "user", "content": question})
        return out

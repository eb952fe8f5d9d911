"""The recipe's data fields (`DataArguments`) and the formats ``dataset_format`` names (`FORMATS`): the settings every
step of `rlhf_trl.data` reads."""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import ClassVar

from .template import DEFAULT_COMPLETION_TEMPLATE, DEFAULT_PROMPT_TEMPLATE, Template
from .turns import DEFAULT_ASSISTANT_MARKER, DEFAULT_HUMAN_MARKER

FORMATS = ("auto", "alpaca", "sharegpt", "pairwise", "ranked", "prompt", "messages", "conversational", "implicit",
           "firefly")


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

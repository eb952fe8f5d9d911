"""How prompts and completions render (`Template`) before step 3 of `rlhf_trl.data` (`.tokenize`) tokenizes them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .args import DataArguments

DEFAULT_PROMPT_TEMPLATE = "问：{question}\n\n答："
DEFAULT_COMPLETION_TEMPLATE = "{answer}"
RAW_TEMPLATE = "raw"  # prompt_template: raw -> text rendered verbatim (it carries its own turns)
HISTORY_SEPARATOR = "\n\n"


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

"""The one data formatter shared by SFT, reward-model and PPO stages.

Every stage goes through the same three steps:

1. **read** local files (json / jsonl / csv / parquet, each optionally compressed: .gz / .bz2 / .xz / .zst / .lz4),
   a list or glob of them, a directory of shards, or a hub dataset (with a config name and split) through
   `datasets`; rows are handed on in Arrow batches, never all as Python objects at once;
2. **normalise** each row into plain records, whatever the source format:
   - SFT: ``{"question", "history", "answer"}``
   - pairs: ``{"question", "history", "chosen", "rejected"}``
   - prompts: ``{"question", "history"}`` (+ ``"columns"``: the row's extra scalar columns, `prompt_columns`)
   plus ``"system"`` (a system turn of the row) and ``"text"`` (a prompt that already carries its own turns, e.g.
   ``"\n\nHuman: ...\n\nAssistant:"``; rendered verbatim, never wrapped in a template) where the row has them.
   ``history`` is a list of earlier ``(question, answer)`` turns. Supported sources (`FORMATS`, auto-detected from
   the first row): alpaca (instruction / input / output [/ history]; also TRL's prompt / completion text rows),
   sharegpt conversations (``[{from, value}]``, optionally with ``chosen`` / ``rejected``), OpenAI / TRL
   ``messages: [{role, content}]``, TRL's conversational preference and prompt / completion rows (message lists),
   prompt / chosen / rejected text, implicit-prompt text pairs (only ``chosen`` / ``rejected`` transcripts), ranked
   answer lists (best first; expanded to all ordered pairs or adjacent pairs), and prompt-only rows (the prompt a
   string, a list of user turns or a message list);
3. **tokenize** with one construction used by every stage: ``prompt_ids + response_ids + [eos]``, the prompt and
   the response each tokenized on its own. With the text templates (default ``问：{question}\n\n答：`` /
   ``{answer}``, or ``raw``) ``eos`` is the tokenizer's EOS; with ``chat_template: true`` the prompt ids are
   ``apply_chat_template(messages, add_generation_prompt=True)`` and ``eos`` is the template's end-of-turn token
   (`chat_end_of_turn_id`). PPO concatenates prompt ids and generated response ids the same way, so the token ids
   the reward model is trained on equal the ids it scores during PPO (joining the strings first would merge tokens
   across the ``"答："`` boundary with byte-level BPE).

Errors name the file, the row and the field (`DataError`).
"""

from __future__ import annotations

import glob
import logging
import os
import re
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Iterable, Iterator, Literal

logger = logging.getLogger(__name__)

DEFAULT_PROMPT_TEMPLATE = "问：{question}\n\n答："
DEFAULT_COMPLETION_TEMPLATE = "{answer}"
RAW_TEMPLATE = "raw"  # prompt_template: raw -> text rendered verbatim (it carries its own turns)
HISTORY_SEPARATOR = "\n\n"
DEFAULT_HUMAN_MARKER = "\n\nHuman:"
DEFAULT_ASSISTANT_MARKER = "\n\nAssistant:"

FORMATS = ("auto", "alpaca", "sharegpt", "pairwise", "ranked", "prompt", "messages", "conversational", "implicit")
LOCAL_LOADERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst", ".lz4")  # read by `datasets` (.zst needs zstandard, .lz4 needs lz4)
QUESTION_KEYS = ("instruction", "prompt", "question", "query")
ANSWER_KEYS = ("output", "answer", "response", "completion")
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
BATCH_ROWS = 8192  # rows converted from Arrow to Python objects at a time
_ALTERNATING = [(["user", "assistant"] * 33)[:n] for n in range(65)]  # well-formed role sequences, by length


class DataError(ValueError):
    """Bad input data. The message names the file, and for row-level problems the row (0-based) and field."""

    def __init__(self, source: str, message: str, row: int | None = None, field: str | None = None):
        where = source
        if row is not None:
            where += f", row {row}"
        if field is not None:
            where += f", field '{field}'"
        super().__init__(f"{where}: {message}")
        self.source, self.row, self.field = source, row, field


@dataclass
class DataArguments:
    """Data fields shared by every stage's recipe (parsed by `TrlParser` next to the TRL config)."""

    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Local file (.json/.jsonl/.csv/.parquet, optionally .gz/.bz2/.xz/.zst/.lz4), a glob "
            "('data/*.jsonl.gz'), a directory of shards, a YAML list of these, or a hub dataset id."
        },
    )
    dataset_config: str | None = field(
        default=None, metadata={"help": "Config (subset) name of a hub dataset, e.g. 'main' for gsm8k."}
    )
    datasets: list[dict] = field(
        default_factory=list,
        metadata={
            "help": "More sources, concatenated after dataset_name (recipe YAML only): a list of mappings, each with "
            "dataset_name and optionally dataset_config, dataset_split, dataset_format, max_samples, prompt_turn, "
            "the markers and the *_key column mapping."
        },
    )
    dataset_split: str = field(default="train", metadata={"help": "Split to read (hub datasets / local files)."})
    dataset_format: str = field(
        default="auto",
        metadata={"help": f"One of {FORMATS}. 'auto' detects it from the columns of the first row."},
    )
    question_key: str | None = field(
        default=None, metadata={"help": "Column holding the question (default: instruction / prompt / question / "
                                        "query); a string, a list of user turns, or a message list."}
    )
    input_key: str | None = field(
        default=None,
        metadata={"help": "Column appended to the question on a new line (default: input; never the question "
                          "column itself)."},
    )
    answer_key: str | None = field(
        default=None,
        metadata={"help": "Column holding the answer, or the ranked answer list (default: output / answer / "
                          "response / completion)."},
    )
    good_key: str | None = field(default=None, metadata={"help": "Column holding the preferred answer (chosen)."})
    bad_key: str | None = field(default=None, metadata={"help": "Column holding the rejected answer."})
    history_key: str | None = field(
        default=None, metadata={"help": "Column with earlier turns as [[question, answer], ...] (default: history)."}
    )
    conversations_key: str | None = field(
        default=None, metadata={"help": "Column with sharegpt turns [{from, value}] (default: conversations)."}
    )
    messages_key: str | None = field(
        default=None, metadata={"help": "Column with OpenAI / TRL turns [{role, content}] (default: messages)."}
    )
    prompt_turn: int = field(
        default=0,
        metadata={"help": "Prompt columns holding a list of user turns: the turn a PPO prompt uses (0 = the first; "
                          "later turns refer to answers the model has not given; -1 = the last). SFT / RM refuse "
                          "such rows."},
    )
    human_marker: str = field(
        default=DEFAULT_HUMAN_MARKER,
        metadata={"help": "Implicit-prompt pairs (only chosen / rejected transcripts): the marker opening a user "
                          "turn."},
    )
    assistant_marker: str = field(
        default=DEFAULT_ASSISTANT_MARKER,
        metadata={"help": "Implicit-prompt pairs: the marker opening an assistant turn; the prompt is the shared "
                          "prefix of chosen and rejected through the last one."},
    )
    prompt_template: str = field(
        default=DEFAULT_PROMPT_TEMPLATE,
        metadata={"help": "Prompt template; must contain '{question}', or 'raw': the text as it is (it carries its "
                          "own turns)."},
    )
    completion_template: str = field(
        default=DEFAULT_COMPLETION_TEMPLATE, metadata={"help": "Completion template; must contain '{answer}'."}
    )
    chat_template: bool = field(
        default=False,
        metadata={"help": "Render prompts with the tokenizer's chat template (apply_chat_template with the "
                          "generation prompt) and end responses with its end-of-turn token instead of the text "
                          "templates."},
    )
    system_prompt: str | None = field(
        default=None,
        metadata={"help": "chat_template: true only: system turn for rows that have none of their own."},
    )
    ranked_pairs: str = field(
        default="all",
        metadata={"help": "Ranked answer lists (best first) -> 'all' ordered pairs, or 'adjacent' pairs only."},
    )
    eval_split_size: float = field(
        default=0.05, metadata={"help": "Held-out fraction (<1) or number of rows (>=1) for evaluation."}
    )
    max_samples: int | None = field(default=None, metadata={"help": "Use at most this many rows (after reading)."})
    max_prompt_length: int = field(
        default=256, metadata={"help": "Prompt tokens kept (from the right) for PPO prompts."}
    )
    length_policy: str = field(
        default="drop",
        metadata={
            "help": "SFT rows / RM pairs longer than max_length (tokens): 'drop' them (SFT: rows whose prompt alone "
            "fills max_length), or 'truncate_prompt' from the left (keeping the newest turns and the whole "
            "response)."
        },
    )


@dataclass(frozen=True)
class Template:
    """How prompts and completions are rendered.

    Text mode (default): ``问：{question}\\n\\n答：`` + ``{answer}`` (+ EOS at tokenization). ``prompt='raw'``: the
    question and answer as they are. ``chat=True``: the tokenizer's chat template (`encode_prompt`), with
    ``system_prompt`` for rows without a system turn of their own.

    Raises:
        ValueError: a text template without its placeholder, ``system_prompt`` without ``chat``, or ``chat`` with
            a changed text template.
    """

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
                      text: str | None = None) -> str:
        """Render the prompt text (text / raw modes). Earlier turns are rendered with the same template, separated by
        a blank line (raw: concatenated as they are). ``text`` (a prompt carrying its own turns) is returned as is.

        Raises:
            ValueError: in chat mode (chat prompts are token ids: `encode_prompt`).
        """
        if self.chat:
            raise ValueError("chat-template prompts are rendered by the tokenizer: use encode_prompt")
        if text is not None:
            return text
        if self.prompt == RAW_TEMPLATE:
            return "".join(q + a for q, a in history or []) + question
        parts = [self.prompt.replace("{question}", q) + self.completion.replace("{answer}", a) for q, a in history or []]
        parts.append(self.prompt.replace("{question}", question))
        return HISTORY_SEPARATOR.join(parts)

    def format_completion(self, answer: str, raw: bool = False) -> str:
        """Render the completion text (EOS is appended as a token id by `encode_response`, not as text)."""
        if raw or self.chat or self.prompt == RAW_TEMPLATE:
            return answer
        return self.completion.replace("{answer}", answer)

    def messages(self, question: str, history: list[tuple[str, str]] | None = None,
                 system: str | None = None) -> list[dict]:
        """The chat messages ``[{role, content}]`` of a prompt: system turn (the row's, else ``system_prompt``),
        earlier turns, then the question as the last user turn."""
        system = system if system is not None else self.system_prompt
        out = [{"role": "system", "content": system}] if system is not None else []
        for q, a in history or []:
            out += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        out.append({"role": "user", "content": question})
        return out


# ----------------------------------------------------------------------------------------------------------------
# reading
# ----------------------------------------------------------------------------------------------------------------
def source_name(dataset_name) -> str:
    """A data source's name for messages: the path / id, or the comma-joined list of them."""
    if isinstance(dataset_name, (list, tuple)):
        return ", ".join(str(n) for n in dataset_name)
    return str(dataset_name)


def load_rows(dataset_name, split: str = "train", config: str | None = None) -> list[dict]:
    """Read a source (see `iter_row_batches`) into one list of row dicts (small data; stages stream batches).

    Raises:
        DataError: see `iter_row_batches`.
    """
    return [row for batch in iter_row_batches(dataset_name, split, config) for row in batch]


def iter_row_batches(dataset_name, split: str = "train", config: str | None = None,
                     batch_rows: int = BATCH_ROWS) -> Iterator[list[dict]]:
    """Read a source through `datasets` and yield its rows as lists of at most ``batch_rows`` dicts.

    ``dataset_name``: a local file (.json / .jsonl / .csv / .parquet, optionally compressed: `COMPRESSIONS`), a glob,
    a directory (every data file under it, sorted; one file type), a list of these, or a hub dataset id (read with
    ``config`` and ``split``; local files ignore both). `datasets` caches the parsed rows as Arrow on disk, so only
    one batch at a time is held as Python objects.

    Raises:
        DataError: a file is missing, of an unsupported type, cannot be parsed, the files mix types, nothing matches
            a glob, the source holds no rows, or a hub dataset cannot be loaded (offline: the message names
            ``HF_HUB_OFFLINE``).
    """
    for batch in _arrow_batches(dataset_name, split, config, batch_rows):
        yield batch if batch.__class__ is list else batch.to_pylist()


def _arrow_batches(dataset_name, split: str, config: str | None, batch_rows: int | None = None):
    """`iter_row_batches` before the conversion to Python: Arrow record batches of plain columns, or lists of row
    dicts where `datasets` must decode columns (e.g. `Json` features of mixed-type columns) or index rows; at most
    ``batch_rows`` (default `BATCH_ROWS`) rows each."""
    batch_rows = batch_rows or BATCH_ROWS
    with _quiet_datasets():
        ds = _open_dataset(dataset_name, split, config)
    if len(ds) == 0:
        raise DataError(source_name(dataset_name), "holds no rows")
    from datasets.features.features import require_decoding

    if getattr(ds, "_indices", None) is None and not any(require_decoding(f) for f in ds.features.values()):
        yield from ds.data.table.to_batches(max_chunksize=batch_rows)  # plain Arrow columns: fastest
        return
    for batch in ds.iter(batch_size=batch_rows):
        keys = list(batch)
        yield [dict(zip(keys, values)) for values in zip(*batch.values())]


@contextmanager
def _quiet_datasets():
    """No progress bars or error logs from `datasets` while reading: a bad file gets one `DataError` line instead."""
    import datasets

    bars = datasets.utils.logging.is_progress_bar_enabled()
    level = datasets.utils.logging.get_verbosity()
    datasets.utils.logging.disable_progress_bar()
    datasets.utils.logging.set_verbosity(logging.CRITICAL)
    try:
        yield
    finally:
        datasets.utils.logging.set_verbosity(level)
        if bars:
            datasets.utils.logging.enable_progress_bar()


def _split_ext(path: str) -> tuple[str, str]:
    """``('.jsonl', '.gz')`` for ``x.jsonl.gz``, ``('.csv', '')`` for ``x.csv``."""
    base, ext = os.path.splitext(path.lower())
    if ext in COMPRESSIONS:
        return os.path.splitext(base)[1], ext
    return ext, ""


def _is_local(name: str) -> bool:
    ext, compression = _split_ext(name)
    return (os.path.exists(name) or ext in LOCAL_LOADERS or bool(compression) or any(c in name for c in "*?[")
            or name.startswith((".", "/", "~")))


def _local_files(dataset_name) -> list[str] | None:
    """The data files of a local source, or None for a hub id.

    Raises:
        DataError: missing file, empty glob or directory, unsupported type, or mixed file types.
    """
    names = list(dataset_name) if isinstance(dataset_name, (list, tuple)) else [dataset_name]
    if not names:
        raise DataError("dataset_name", "an empty list of files")
    if len(names) == 1 and not _is_local(str(names[0])):
        return None
    kinds = "/".join(LOCAL_LOADERS) + ", optionally " + "/".join(COMPRESSIONS)
    files = []
    for name in names:
        name = os.path.expanduser(str(name))
        if any(c in name for c in "*?["):
            hits = sorted(f for f in glob.glob(name, recursive=True) if os.path.isfile(f))
            if not hits:
                raise DataError(name, "no file matches this pattern")
            files += hits
        elif os.path.isdir(name):
            hits = sorted(
                os.path.join(root, f) for root, dirs, fs in os.walk(name) for f in fs
                if not f.startswith(".") and _split_ext(f)[0] in LOCAL_LOADERS
                and not any(part.startswith(".") for part in os.path.relpath(root, name).split(os.sep) if part != ".")
            )
            if not hits:
                raise DataError(name, f"directory holds no data file ({kinds})")
            files += hits
        elif os.path.isfile(name):
            files.append(name)
        else:
            raise DataError(name, "file not found")
    for f in files:
        ext, compression = _split_ext(f)
        if ext not in LOCAL_LOADERS:
            raise DataError(f, f"unsupported file type '{ext + compression or os.path.basename(f)}'; use {kinds}")
    loaders = sorted({LOCAL_LOADERS[_split_ext(f)[0]] for f in files})
    if len(loaders) > 1:
        raise DataError(source_name(dataset_name), f"mixes file types ({', '.join(loaders)}); one source, one type")
    return files


def _offline_flag() -> str | None:
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return var
    return None


def _open_dataset(dataset_name, split: str, config: str | None):
    import datasets

    files = _local_files(dataset_name)
    if files is not None:
        loader = LOCAL_LOADERS[_split_ext(files[0])[0]]
        kind = loader if len(files) == 1 else f"{loader} ({len(files)} files)"
        try:
            return datasets.load_dataset(loader, data_files=files, split="train")
        except Exception as exc:  # datasets wraps parser errors in several exception types
            if loader == "json":
                for f in files:  # name the file and the row where Python's own parser stops
                    _check_json_file(f, kind)
            raise DataError(source_name(dataset_name), f"cannot be read as {kind}: {_root_cause(exc)}") from None
    try:
        return datasets.load_dataset(dataset_name, config, split=split)
    except Exception as exc:
        cause = _root_cause(exc)
        flag = _offline_flag()
        if flag and any(w in f"{exc} {cause}".lower() for w in ("offline", "couldn't reach", "connection")):
            raise DataError(dataset_name, f"a hub dataset, not in the local cache, and {flag}=1 forbids downloading "
                                          f"it; unset {flag} once to download it, or pass a local file") from None
        where = f"config {config!r}, split {split!r}" if config else f"split {split!r}"
        raise DataError(dataset_name, f"cannot be loaded from the hub ({where}): {cause}") from None


_OPENERS = {"": open, ".gz": "gzip", ".bz2": "bz2", ".xz": "lzma"}  # .zst / .lz4: not re-read here


def _check_json_file(path: str, kind: str) -> None:
    """Re-read a JSON / JSON Lines file that `datasets` could not parse, with Python's parser, to say where it breaks.

    A file whose first character is ``[`` is one JSON document (the message names its line and column); any other is
    JSON Lines: one object per non-blank line, row ``k`` being the ``k``-th such line (0-based, as in every
    `DataError`). Returns quietly when the file parses or cannot be re-read here (the caller then reports `datasets`'
    own error).

    Raises:
        DataError: the file, the row (JSON Lines) and what is wrong with it, or a file without any row.
    """
    import importlib
    import json

    opener = _OPENERS.get(_split_ext(path)[1])
    if opener is None:
        return
    if isinstance(opener, str):
        opener = importlib.import_module(opener).open
    try:
        with opener(path, "rt", encoding="utf-8-sig") as f:
            head = f.read(4096).lstrip()[:1]
            f.seek(0)
            if head == "[":
                try:
                    json.load(f)
                except json.JSONDecodeError as exc:
                    raise DataError(path, f"cannot be read as {kind}: not valid JSON: {exc}") from None
                return
            row = 0
            for line_number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    value = json.loads(line.rstrip("\r\n"))
                except json.JSONDecodeError as exc:
                    raise DataError(path, f"cannot be read as {kind}: line {line_number} is not valid JSON "
                                          f"({exc.msg} at column {exc.colno})", row) from None
                if not isinstance(value, dict):
                    raise DataError(path, f"cannot be read as {kind}: line {line_number} is a JSON "
                                          f"{type(value).__name__}, not an object", row)
                row += 1
            if row == 0:
                raise DataError(path, "holds no rows (the file is empty)")
    except (OSError, UnicodeDecodeError, EOFError):
        return


def _root_cause(exc: BaseException) -> str:
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    return " ".join(f"{type(exc).__name__}: {exc}".split())


# ----------------------------------------------------------------------------------------------------------------
# normalising
# ----------------------------------------------------------------------------------------------------------------
def _is_messages(value) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict)


def detect_format(row: dict, args: DataArguments) -> str:
    """Guess the source format from the keys of one row (honouring the recipe's column mapping).

    ``conversations`` -> sharegpt; ``messages`` -> messages; ``chosen`` + ``rejected`` -> pairwise with a question
    column, else implicit; an answer column -> ranked (a list of answers) or alpaca (also a message list); else
    prompt.
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
    for c in candidates:
        if c in keys:
            return c
    return None


def _missing(row: dict, key: str, source: str, i: int) -> DataError:
    return DataError(source, f"missing column (columns: {sorted(row)}); map it in the recipe", i, key)


def _text(row: dict, key: str, source: str, i: int, allow_empty: bool = False) -> str:
    if key not in row:
        raise _missing(row, key, source, i)
    value = row[key]
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
        raise DataError(source, f"must be a non-empty list of {{role, content}} messages, got {type(value).__name__}",
                        i, key)
    out = []
    for j, turn in enumerate(value):
        if not isinstance(turn, dict):
            raise DataError(source, f"message {j} must be a {{role, content}} object, got {type(turn).__name__}", i, key)
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
    system = None
    offset = 0
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
    answer = None
    if end == "assistant":
        answer, body = body[-1][1], body[:-1]
    texts = [text for _, text in body]
    return system, list(zip(texts[0:-1:2], texts[1::2])), texts[-1], answer


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
    if qkey not in row:
        raise _missing(row, qkey, source, i)
    value = row[qkey]
    system, history = None, None
    if isinstance(value, list) and value and all(isinstance(t, str) for t in value):
        if kind != "prompts":
            raise DataError(source, f"must be a string for {kind.upper()} rows, got a list of {len(value)} user "
                                    "turn(s) without answers (only PPO prompts read such lists: prompt_turn)", i, qkey)
        try:
            question = value[args.prompt_turn if len(value) > 1 else 0]
        except IndexError:
            raise DataError(source, f"prompt_turn={args.prompt_turn} is out of range for {len(value)} turns",
                            i, qkey) from None
        if not question.strip():
            raise DataError(source, "holds an empty turn", i, qkey)
    elif _is_messages(value):
        system, history, question, _ = _dialogue(_turns(value, source, i, qkey), source, i, qkey, "user")
    elif isinstance(value, list):
        raise DataError(source, "must be a string, a list of user turns or a list of {role, content} messages",
                        i, qkey)
    else:
        question = _text(row, qkey, source, i)
    ikey = args.input_key or "input"
    if ikey != qkey:
        extra = row.get(ikey)
        if extra is not None:
            extra = _text(row, ikey, source, i, allow_empty=True)
            if extra.strip():
                question = f"{question}\n{extra}"
    if history is None:
        history = _history(row, args, source, i)
    return system, history, question


def _history(row: dict, args: DataArguments, source: str, i: int) -> list[tuple[str, str]]:
    hkey = args.history_key or "history"
    history = row.get(hkey) or []
    if not isinstance(history, list) or not all(
        isinstance(t, (list, tuple)) and len(t) == 2 and all(isinstance(x, str) for x in t) for t in history
    ):
        raise DataError(source, "must be a list of [question, answer] string pairs", i, hkey)
    return [(q, a) for q, a in history]


def _sharegpt_turns(row: dict, args: DataArguments, source: str, i: int) -> list[tuple[str, str]]:
    """Return [(role, text)] with role in {'user', 'assistant'} from [{from, value}] turns."""
    ckey = args.conversations_key or "conversations"
    turns = row.get(ckey)
    if not isinstance(turns, list) or not turns:
        raise DataError(source, "must be a non-empty list of {from, value} turns", i, ckey)
    out = []
    for j, turn in enumerate(turns):
        if not isinstance(turn, dict) or "value" not in turn:
            raise DataError(source, f"turn {j} must be a {{from, value}} object", i, ckey)
        role = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}.get(
            turn.get("from", turn.get("role"))
        )
        if role is None:
            continue  # system / tool turns are not part of the single-turn template
        if not isinstance(turn["value"], str) or not turn["value"].strip():
            raise DataError(source, f"turn {j} has an empty or non-string value", i, ckey)
        out.append((role, turn["value"]))
    return out


def _split_conversation(turns: list[tuple[str, str]], source: str, i: int, key: str, needs_answer: bool):
    """Split turns into (history pairs, last question, last answer or None)."""
    if needs_answer:
        if len(turns) < 2 or turns[-1][0] != "assistant" or turns[-2][0] != "user":
            raise DataError(source, "must end with a user turn followed by an assistant turn", i, key)
        body, question, answer = turns[:-2], turns[-2][1], turns[-1][1]
    else:
        if not turns or turns[-1][0] != "user":
            raise DataError(source, "must end with a user turn", i, key)
        body, question, answer = turns[:-1], turns[-1][1], None
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
    if value is None:
        raise DataError(source, "is null or missing in this row", i, key)
    if not isinstance(value, str):
        raise DataError(source, f"must be a string, got {type(value).__name__}", i, key)
    if not value.strip():
        raise DataError(source, "is empty", i, key)
    return value


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

    Text: the prompt is the shared prefix through the last ``assistant_marker``, kept verbatim as ``text`` (and as
    ``question``; ``markers`` = (human, assistant) parse its turns for chat templates: `split_transcript`); the
    answers are the rest, leading space included. Messages: the prompt is the shared leading messages (ending with a
    user turn); each side must then hold exactly one assistant message.

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
        if key not in row:
            raise _missing(row, key, source, i)
        if row[key] is None:
            raise DataError(source, "is null or missing in this row", i, key)
    if _is_messages(chosen) and _is_messages(rejected):
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
        rec = {"question": question, "history": history, "chosen": c[n][1], "rejected": r[n][1]}
    else:
        raise DataError(source, "chosen and rejected must both be transcripts (strings) or both message lists",
                        i, both)
    if system is not None:
        rec["system"] = system
    return rec


def _implicit_text_error(row: dict, args: DataArguments, source: str, i: int, k: int):
    gkey, bkey = args.good_key or "chosen", args.bad_key or "rejected"
    if row[gkey] == row[bkey]:
        raise DataError(source, "chosen and rejected answers are identical", i, f"{gkey}/{bkey}")
    if k < 0:
        raise DataError(source, f"chosen and rejected share no prefix ending in the assistant marker "
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
        key = args.conversations_key or "conversations"
        history, question, answer = _split_conversation(_sharegpt_turns(row, args, source, i), source, i, key,
                                                        needs_answer=True)
        return {"question": question, "history": history, "answer": answer}
    if fmt == "messages":
        key = args.messages_key or "messages"
        system, history, question, answer = _dialogue(_turns(row.get(key), source, i, key), source, i, key,
                                                      "assistant")
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
        if key not in row:
            raise _missing(row, key, source, i)
        value = row[key]
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
        key = args.conversations_key or "conversations"
        history, question, _ = _split_conversation(_sharegpt_turns(row, args, source, i), source, i, key,
                                                   needs_answer=False)
    elif fmt == "messages":
        key = args.messages_key or "messages"
        if (args.good_key or "chosen") not in row:
            raise DataError(source, "format 'messages' holds no preference pairs (add chosen / rejected columns)")
        system, history, question, _ = _dialogue(_turns(row.get(key), source, i, key), source, i, key, "user")
    elif fmt in ("pairwise", "ranked"):
        system, history, question = _prompt(row, args, source, i, "rm")
    else:
        raise DataError(source, f"format '{fmt}' holds no preference pairs")
    if fmt in ("pairwise", "sharegpt", "messages"):
        gkey, bkey = args.good_key or "chosen", args.bad_key or "rejected"
        for key in (gkey, bkey):
            if key not in row:
                raise _missing(row, key, source, i)
        ranked = [_answer_text(row[gkey], source, i, gkey), _answer_text(row[bkey], source, i, bkey)]
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
        if args.ranked_pairs == "all":
            pairs = [(a, b) for a in range(n) for b in range(a + 1, n)]
        else:
            pairs = [(a, a + 1) for a in range(n - 1)]
        field_name = key
    out = []
    for a, b in pairs:
        if ranked[a] == ranked[b]:
            raise DataError(source, "chosen and rejected answers are identical", i, field_name)
        out.append(_record(system, history, question, chosen=ranked[a], rejected=ranked[b]))
    return out


_SCALAR_TYPES = frozenset((str, int, float, bool, type(None)))


def prompt_columns(row: dict, fmt: str, args: DataArguments) -> dict:
    """The extra columns of a prompt row: every column whose value is a scalar (str / int / float / bool / None) and
    that is not read as the prompt (``fmt`` sharegpt: the conversations column; messages: the messages column;
    implicit: chosen / rejected; else the question, ``input`` and ``history`` columns). Answer columns of SFT / pair
    rows count as extras (e.g. gsm8k's ``answer``: a reward function's reference); list / dict columns do not.

    PPO passes them to reward functions (`rlhf_trl.rewards.reward_columns`). Row order of the keys is kept.
    """
    if fmt == "sharegpt":
        used = (args.conversations_key or "conversations",)
    elif fmt == "messages":
        used = (args.messages_key or "messages",)
    elif fmt == "implicit":
        used = (args.good_key or "chosen", args.bad_key or "rejected")
    else:
        qkey = args.question_key
        if qkey is None:  # as `_prompt` picks it (the row has one: `_prompt_fields` read it)
            for qkey in QUESTION_KEYS:
                if qkey in row:
                    break
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
        key = args.conversations_key or "conversations"
        turns = _sharegpt_turns(row, args, source, i)
        if turns and turns[-1][0] == "assistant":
            turns = turns[:-1]
        history, question, _ = _split_conversation(turns, source, i, key, needs_answer=False)
        return {"question": question, "history": history}
    if fmt == "messages":
        key = args.messages_key or "messages"
        system, history, question, _ = _dialogue(_turns(row.get(key), source, i, key), source, i, key, "user")
        return _record(system, history, question)
    if fmt == "implicit":
        rec = _implicit(row, args, source, i)
        del rec["chosen"], rec["rejected"]
        return rec
    return _record(*_prompt(row, args, source, i, "prompts"))


_ROLE_CODES = {"system": 1, "user": 2, "assistant": 3}  # codes of `_message_records`' role signatures; 0: bad
_ROLE_NAMES = {code: role for role, code in _ROLE_CODES.items()}


def _is_message_column(schema, key: str) -> bool:
    """Whether column ``key`` is a list of structs with string ``role`` and ``content`` fields (others may follow)."""
    import pyarrow as pa

    k = schema.get_field_index(key)
    if k < 0:
        return False
    kind = schema.field(k).type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_struct(kind.value_type):
        return False
    struct = kind.value_type
    return all(struct.get_field_index(name) >= 0 and (pa.types.is_string(struct.field(name).type)
                                                       or pa.types.is_large_string(struct.field(name).type))
               for name in ("role", "content"))


def _message_plan(signature: bytes, end: str) -> tuple | None:
    """Where a row's record comes from, for rows whose messages have the role codes ``signature`` (all valid):
    ``(system, start, stop, question, answer)``, indices into the row's message contents (``system`` / ``answer``
    None where absent; the history pairs are ``contents[start:stop]`` two by two). Found by running `_dialogue` itself
    on the messages' indices in place of their texts, so the records built from it are the ones `_dialogue` gives.
    None: `_dialogue` refuses these roles, or its result has another layout; such rows take the plain path."""
    if not signature or 0 in signature:
        return None
    try:
        system, history, question, answer = _dialogue([(_ROLE_NAMES[c], k) for k, c in enumerate(signature)],
                                                      "", 0, "", end)
    except DataError:
        return None
    start = question - 2 * len(history)
    if history != [(k, k + 1) for k in range(start, question, 2)]:
        return None
    return system, start, question, question, answer


def _message_records(column, end: str, plans: dict) -> list[dict | None]:
    """SFT records (``end='assistant'``) or prompts (``'user'``; without ``"columns"``) of one Arrow batch of a
    ``messages`` column (`_is_message_column`), each equal to what `_sft_row` / `_prompt_fields` give for the row, or
    None for a row those must handle (a null or empty list, a null message, an unknown or null role, a null / empty / blank content, roles
    `_dialogue` refuses): the plain path then reads it, with its exact errors.

    Faster than converting the rows to Python first (`RecordBatch.to_pylist` builds a dict per message): the contents
    come from the flat child array in one call, the roles as a byte per message (`_ROLE_CODES`), and each distinct
    sequence of roles is resolved once (`_message_plan`, cached in ``plans``).
    """
    import numpy as np
    import pyarrow.compute as pc

    offsets = column.offsets.to_numpy()
    first = int(offsets[0])
    messages = column.values.slice(first, int(offsets[-1]) - first)
    roles, contents = messages.field("role"), messages.field("content")
    texts = contents.to_pylist()
    coded = pc.dictionary_encode(roles)
    codes = np.array([_ROLE_CODES.get(ROLES.get(r), 0) for r in coded.dictionary.to_pylist()] + [0], np.uint8)
    codes = codes[pc.fill_null(coded.indices, len(codes) - 1).to_numpy()]  # a null role -> 0
    if messages.null_count:
        codes[~messages.is_valid().to_numpy(zero_copy_only=False)] = 0
    if not all(texts) or any(map(str.isspace, texts)):  # a null / empty content (falsy), or a blank one
        codes[[not t or t.isspace() for t in texts]] = 0
    signatures = codes.tobytes()
    bounds = (offsets - first).tolist()
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
        system, start, stop, question, answer = plan
        c = texts[a:b]
        history = list(zip(c[start:stop:2], c[start + 1:stop:2])) if start != stop else []
        if answer is None:  # keys in `_record`'s order
            rec = {"question": c[question], "history": history}
            if system is not None:
                rec["system"] = c[system]
        elif system is None:
            rec = {"question": c[question], "history": history, "answer": c[answer]}
        else:
            rec = {"question": c[question], "history": history, "answer": c[answer], "system": c[system]}
        append(rec)
    if column.null_count:
        for k in np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False)).tolist():
            out[k] = None
    return out


def _normalise(kind: str, batches: Iterable, args: DataArguments, source: str) -> list[dict]:
    """Normalise batches of rows into records of ``kind`` ('sft' / 'pairs' / 'prompts'); row numbers run on across
    batches. The format is resolved from the first row (``dataset_format: auto``) and checked on every row."""
    if args.dataset_format not in FORMATS:
        raise ValueError(f"dataset_format must be one of {FORMATS}, got {args.dataset_format!r}")
    if kind == "pairs" and args.ranked_pairs not in ("all", "adjacent"):
        raise ValueError(f"ranked_pairs must be 'all' or 'adjacent', got {args.ranked_pairs!r}")
    with _no_gc():  # records hold no reference cycles: the cyclic GC would rescan millions of them for nothing
        return _normalise_rows(kind, batches, args, source)


@contextmanager
def _no_gc():
    import gc

    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _normalise_rows(kind: str, batches: Iterable, args: DataArguments, source: str) -> list[dict]:
    """`_normalise`. ``batches``: lists of row dicts, or Arrow record batches (`_arrow_batches`; one source's rows
    share their columns), converted here: plainly (`RecordBatch.to_pylist`), or, for the message column of
    ``messages`` rows read as SFT records or prompts, through `_message_records` (prompts get their other columns as
    `_prompt_row` gives them)."""
    out: list[dict] = []
    counts = {"deduplicated": 0}
    fmt = None
    auto = args.dataset_format == "auto"
    i = 0
    for batch in batches:
        arrow = batch.__class__ is not list
        if fmt is None and len(batch):
            row = batch.slice(0, 1).to_pylist()[0] if arrow else batch[0]
            if not isinstance(row, dict):
                raise DataError(source, f"must be an object, got {type(row).__name__}", i)
            fmt = detect_format(row, args) if auto else args.dataset_format
            keys0 = tuple(row)
            by_keys = fmt not in ("alpaca", "ranked")  # these two also depend on the answer's type
            if kind == "pairs" and fmt == "implicit":
                add, one = out.append, lambda r, f, a, s, n: _implicit(r, a, s, n)
            elif kind == "pairs":
                add, one = out.extend, lambda r, f, a, s, n: _pair_rows(r, f, a, s, n, counts)
            else:
                add, one = out.append, _sft_row if kind == "sft" else _prompt_row
            # messages rows: SFT records and prompts come from the message column alone (`_sft_row`, `_prompt_row`)
            fast_key = (args.messages_key or "messages") if fmt == "messages" and kind != "pairs" else None
            plans: dict[bytes, tuple | None] = {}
        if arrow:
            if fast_key is not None and _is_message_column(batch.schema, fast_key):
                records = _message_records(batch.column(fast_key), "assistant" if kind == "sft" else "user", plans)
                extras = (batch.drop_columns([fast_key]).to_pylist()  # prompts: the other columns (`_prompt_row`)
                          if kind == "prompts" and batch.num_columns > 1 else None)
                for k, rec in enumerate(records):
                    if rec is None:  # a row the fast conversion does not vouch for: the plain path (and its errors)
                        rec = one(batch.slice(k, 1).to_pylist()[0], fmt, args, source, i)
                    elif extras is not None:
                        columns = prompt_columns(extras[k], fmt, args)
                        if columns:
                            rec["columns"] = columns
                    add(rec)
                    i += 1
                continue
            batch = batch.to_pylist()
        for row in batch:
            if i:
                if not isinstance(row, dict):
                    raise DataError(source, f"must be an object, got {type(row).__name__}", i)
                if auto and not (by_keys and tuple(row) == keys0):  # Arrow rows of one file share their columns
                    got = detect_format(row, args)
                    if got != fmt:
                        raise DataError(source, f"looks like '{got}' but row 0 is '{fmt}' (mixed formats in one "
                                                "file)", i)
            add(one(row, fmt, args, source, i))
            i += 1
    if fmt is None:
        raise DataError(source, "holds no rows")
    if counts["deduplicated"]:
        logger.warning("%s: %d ranked lists hold repeated answers; each kept once, at its best rank",
                       source, counts["deduplicated"])
    return out


def sft_records(rows: list[dict], args: DataArguments, source: str) -> list[dict]:
    """Normalise rows into SFT records ``{"question", "history", "answer"}`` (+ ``"system"`` / ``"text"``).

    Accepts alpaca (also TRL prompt / completion, text or message lists), sharegpt and ``messages`` rows (the last
    assistant turn is the target, earlier turns the history), pairwise, conversational preference and
    implicit-prompt rows (the chosen answer).

    Raises:
        DataError: a row lacks a mapped column, or a field is null, empty or mistyped; a list of several user turns
            as the question.
    """
    return _normalise("sft", [rows], args, source)


def pair_records(rows: list[dict], args: DataArguments, source: str) -> list[dict]:
    """Normalise rows into preference pairs ``{"question", "history", "chosen", "rejected"}`` (+ ``"system"`` /
    ``"text"``).

    Ranked answer lists (best first) give all ordered pairs (``n*(n-1)/2`` for ``n`` answers) when
    ``ranked_pairs='all'``, or the ``n-1`` adjacent pairs when ``ranked_pairs='adjacent'``. An answer repeated
    verbatim in a ranked list (real human-ranked data has them, e.g. oasst) counts once, at its best rank, so
    ``n`` is the number of distinct answers; a list with a single distinct answer gives no pair. Implicit-prompt
    rows (only chosen / rejected) share their prompt: see `_implicit`.

    Raises:
        DataError: missing / empty fields, a ranked list with fewer than two answers, chosen == rejected, or an
            implicit pair without a shared prompt.
    """
    return _normalise("pairs", [rows], args, source)


def prompt_records(rows: list[dict], args: DataArguments, source: str) -> list[dict]:
    """Normalise rows of any supported format into prompts ``{"question", "history"}`` (+ ``"system"`` / ``"text"``).

    A list of user turns gives turn ``prompt_turn``; a message list gives everything up to its last user turn. A row
    with extra scalar columns (`prompt_columns`: e.g. ``topic``, or an answer column) also gets ``"columns"``, a dict
    of them, for PPO's reward functions; a row without any gets no ``"columns"`` key.

    Raises:
        DataError: the question field is missing, null, empty or mistyped.
    """
    return _normalise("prompts", [rows], args, source)


# ----------------------------------------------------------------------------------------------------------------
# tokenization: one construction for every stage
# ----------------------------------------------------------------------------------------------------------------
def _encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of plain text: no BOS/EOS added, and special-token strings in the data ("<|endoftext|>") are
    tokenized as text, so the only EOS / pad ids in a sequence are the ones this module places."""
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def _tokenizer_name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__


def _require_chat_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"chat_template: true, but the tokenizer at '{_tokenizer_name(tokenizer)}' has no chat "
                         "template; set chat_template: false (text templates) or use a tokenizer that has one")


def _render_chat(tokenizer, messages: list[dict], what: str, **kwargs) -> str:
    """``tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)``.

    Raises:
        ValueError: the template does not compile or fails to render (a Jinja syntax error, an undefined name, the
            template's own ``raise_exception``); one line naming the tokenizer and ``what`` was rendered.
    """
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except TemplateError as exc:
        raise ValueError(f"the chat template of '{_tokenizer_name(tokenizer)}' fails on {what}: "
                         f"{type(exc).__name__}: {exc}; fix its chat_template or set chat_template: false") from None


_END_OF_TURN: dict[int, tuple[Any, int]] = {}  # id(tokenizer) -> (weakref to it, end-of-turn id)
_PROBE = "\u2063probe\u2063"


def chat_end_of_turn_id(tokenizer, model_dir: str | None = None) -> int:
    """The token id the tokenizer's chat template ends an assistant turn with (Qwen: ``<|im_end|>``).

    Found by rendering a one-exchange conversation and taking the first special token after the assistant's text.
    It must be the tokenizer's EOS or one of the EOS ids of ``model_dir`` (default: the directory the tokenizer was
    loaded from; `rlhf_trl.models.eos_token_ids`, from generation_config.json), since rollouts stop there.

    Raises:
        ValueError: no chat template, one that does not compile or render (`_render_chat`), no special token after
            an assistant turn, or an end-of-turn token that is no EOS id (one line).
    """
    _require_chat_template(tokenizer)
    cached = _END_OF_TURN.get(id(tokenizer))
    if cached is not None and cached[0]() is tokenizer and model_dir is None:
        return cached[1]
    from .models import eos_token_ids

    rendered = _render_chat(tokenizer, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}],
                            "a user turn and an assistant turn")
    tail = rendered[rendered.rindex(_PROBE) + len(_PROBE):] if _PROBE in rendered else ""
    special = set(tokenizer.all_special_ids) | {
        i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
    ids = tokenizer(tail, add_special_tokens=False)["input_ids"] if tail else []
    eot = next((i for i in ids if i in special), None)
    name = _tokenizer_name(tokenizer)
    if eot is None:
        raise ValueError(f"the chat template of '{name}' ends an assistant turn with {tail!r}, which holds no special "
                         "token to end responses with; use a template that closes turns with an EOS token")
    if model_dir is None and os.path.isdir(str(getattr(tokenizer, "name_or_path", "") or "")):
        model_dir = tokenizer.name_or_path
    allowed = eos_token_ids(tokenizer, model_dir)
    if eot not in allowed:
        raise ValueError(
            f"the chat template of '{name}' ends assistant turns with {tokenizer.convert_ids_to_tokens(eot)!r} "
            f"(id {eot}), which is neither the tokenizer's EOS {tokenizer.eos_token!r} nor in eos_token_id of "
            f"{os.path.join(model_dir or name, 'generation_config.json')} (EOS ids {allowed}); add {eot} there")
    _END_OF_TURN[id(tokenizer)] = (weakref.ref(tokenizer), eot)
    return eot


def response_eos_id(tokenizer, template: Template) -> int:
    """The id that ends every response: the chat template's end-of-turn token in chat mode, else the tokenizer's
    EOS.

    Raises:
        ValueError: see `chat_end_of_turn_id`.
    """
    return chat_end_of_turn_id(tokenizer) if template.chat else tokenizer.eos_token_id


def encode_prompt(tokenizer, template: Template, question: str, history=None, system: str | None = None,
                  text: str | None = None) -> list[int]:
    """Token ids of the rendered prompt, ``[prompt_len]``.

    Text / raw modes: the template's text (or ``text``, a prompt carrying its own turns, verbatim), without special
    tokens (special-token strings in the data are tokenized as text). Chat mode: the tokens of
    ``apply_chat_template(messages, add_generation_prompt=True)``, messages from `Template.messages` (``text`` is
    ignored: `_prompt_ids` parses its turns), exactly as the tokenizer tokenizes the rendered template (as TRL does:
    special-token strings inside message contents become special tokens there).

    Raises:
        ValueError: chat mode with a tokenizer without a chat template, or a template that fails on these messages
            (`_render_chat`).
    """
    if not template.chat:
        return _encode_text(tokenizer, template.format_prompt(question, history, text))
    _require_chat_template(tokenizer)
    short = question if len(question) <= 40 else question[:37] + "..."
    rendered = _render_chat(tokenizer, template.messages(question, history, system), f"the prompt {short!r}",
                            add_generation_prompt=True)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def encode_response(tokenizer, template: Template, answer: str, raw: bool = False) -> list[int]:
    """Token ids of the rendered completion followed by the response EOS (`response_eos_id`),
    ``[response_len + 1]``; tokenized on its own. ``raw``: the answer verbatim (no completion template)."""
    return _encode_text(tokenizer, template.format_completion(answer, raw)) + [response_eos_id(tokenizer, template)]


def _prompt_ids(tokenizer, template: Template, record: dict) -> list[int]:
    if template.chat and record.get("text") is not None:  # a transcript: render its turns with the chat template
        system, history, question = split_transcript(record["text"], *record.get("markers", _markers(
            DEFAULT_HUMAN_MARKER, DEFAULT_ASSISTANT_MARKER)))
        return encode_prompt(tokenizer, template, question, history, record.get("system", system))
    return encode_prompt(tokenizer, template, record["question"], record.get("history"), record.get("system"),
                         record.get("text"))


def _response_ids(tokenizer, template: Template, record: dict, key: str) -> list[int]:
    answer = record[key]
    if template.chat and record.get("text") is not None:
        answer = answer.lstrip()  # "\n\nAssistant: Sure" -> the chat template's assistant turn holds "Sure"
    return encode_response(tokenizer, template, answer, raw=record.get("text") is not None)


def _check_records(records: list[dict], tokenizer, template: Template, source: str) -> None:
    """Validate chat mode once (template present, end-of-turn is an EOS id); log system turns the text templates
    drop."""
    if template.chat:
        chat_end_of_turn_id(tokenizer)
        return
    dropped = sum(1 for r in records if r.get("system") is not None and r.get("text") is None)
    if dropped:
        logger.warning("%s: %d of %d rows have a system turn; the text template has no place for it: dropped "
                       "(chat_template: true keeps it)", source, dropped, len(records))


def sft_features(
    records: list[dict], tokenizer, template: Template, max_length: int | None = None, source: str = "dataset",
    length_policy: Literal["drop", "truncate_prompt"] = "drop", max_prompt_length: int | None = None,
) -> dict[str, list]:
    """Tokenize SFT records into ``input_ids`` and ``completion_mask`` (1 on response tokens incl. EOS).

    Returns columns for `trl.SFTTrainer` (pre-tokenized datasets skip its own tokenization), each a list of
    ``[prompt_len + response_len + 1]`` lists. Rows longer than ``max_length`` tokens:

    - ``length_policy='drop'``: rows whose prompt alone fills ``max_length`` (truncation would leave no answer token
      to learn from) are dropped; longer rows are cut at the end by the trainer;
    - ``'truncate_prompt'``: the prompt is cut from the left (the newest turns are kept) so that the whole response
      fits; if the response alone leaves no room, ``min(max_prompt_length, max_length - 1)`` prompt tokens are kept
      (the trainer then cuts the response's end).

    Dropped / truncated counts are logged.

    Raises:
        DataError: no row is left. ValueError: an unknown ``length_policy``; chat mode problems
            (`chat_end_of_turn_id`).
    """
    if length_policy not in ("drop", "truncate_prompt"):
        raise ValueError(f"length_policy must be 'drop' or 'truncate_prompt', got {length_policy!r}")
    _check_records(records, tokenizer, template, source)
    input_ids, masks = [], []
    dropped = truncated = 0
    for r in records:
        p = _prompt_ids(tokenizer, template, r)
        c = _response_ids(tokenizer, template, r, "answer")
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
        input_ids.append(p + c)
        masks.append([0] * len(p) + [1] * len(c))
    if dropped:
        logger.warning("%s: %d of %d rows dropped: the prompt alone fills max_length=%s tokens "
                       "(length_policy: truncate_prompt keeps them)", source, dropped, len(records), max_length)
    if truncated:
        logger.warning("%s: %d of %d prompts truncated from the left to fit max_length=%s tokens",
                       source, truncated, len(records), max_length)
    if records and not input_ids:
        raise DataError(source, f"no row is left: every prompt fills max_length={max_length} tokens (raise "
                                "max_length or set length_policy: truncate_prompt)")
    return {"input_ids": input_ids, "completion_mask": masks}


def pair_features(
    records: list[dict],
    tokenizer,
    template: Template,
    max_length: int | None = None,
    length_policy: Literal["drop", "truncate_prompt"] = "drop",
    source: str = "dataset",
) -> dict[str, list]:
    """Tokenize pairs into ``chosen_ids`` / ``rejected_ids`` (prompt ids + response ids + EOS) for `RewardTrainer`.

    Pairs longer than ``max_length`` tokens are dropped (``length_policy='drop'``) or have their prompt truncated
    from the left so that the longer response still fits whole (``'truncate_prompt'``; a pair whose response alone
    exceeds ``max_length`` is dropped). Counts of dropped / truncated pairs are logged.

    Raises:
        DataError: no pair is left. ValueError: chat mode problems (`chat_end_of_turn_id`).
    """
    if length_policy not in ("drop", "truncate_prompt"):
        raise ValueError(f"length_policy must be 'drop' or 'truncate_prompt', got {length_policy!r}")
    _check_records(records, tokenizer, template, source)
    out = {"chosen_ids": [], "rejected_ids": [], "prompt_length": []}
    dropped = truncated = 0
    for r in records:
        p = _prompt_ids(tokenizer, template, r)
        c = _response_ids(tokenizer, template, r, "chosen")
        j = _response_ids(tokenizer, template, r, "rejected")
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
    if dropped or truncated:
        logger.warning(
            "%s: %d of %d pairs dropped and %d truncated (max_length=%s tokens, length_policy=%s)",
            source, dropped, len(records), truncated, max_length, length_policy,
        )
    if not out["chosen_ids"]:
        raise DataError(
            source,
            f"no pair is left: all {len(records)} pairs exceed max_length={max_length} tokens "
            f"(raise max_length or set length_policy: truncate_prompt)",
        )
    return out


def prompt_features(records: list[dict], tokenizer, template: Template, max_prompt_length: int,
                    source: str = "dataset") -> dict[str, list]:
    """Tokenize prompts for PPO: ``input_ids`` of ``[<= max_prompt_length]`` tokens (kept from the right), built by
    `encode_prompt` exactly as the SFT / RM stages build their prompts (chat mode: with the generation prompt).

    Left padding is applied by the collator (the tokenizer's ``padding_side`` must be ``'left'``).

    Raises:
        ValueError: ``max_prompt_length`` < 1; chat mode problems (`chat_end_of_turn_id`: rollouts must stop at the
            template's end-of-turn).
    """
    if max_prompt_length < 1:
        raise ValueError(f"max_prompt_length must be >= 1 (prompt tokens kept), got {max_prompt_length}")
    _check_records(records, tokenizer, template, source)
    ids = [_prompt_ids(tokenizer, template, r)[-max_prompt_length:] for r in records]
    return {"input_ids": ids}


def split_records(records: list[dict], eval_split_size: float, seed: int) -> tuple[list[dict], list[dict]]:
    """Shuffle deterministically and split off ``eval_split_size`` (fraction < 1, or a row count) for evaluation."""
    import random

    rows = list(records)
    random.Random(seed).shuffle(rows)
    n_eval = int(round(len(rows) * eval_split_size)) if eval_split_size < 1 else int(eval_split_size)
    n_eval = min(max(n_eval, 0), len(rows) - 1)
    return rows[n_eval:], rows[:n_eval]


SOURCE_KEYS = (
    "dataset_name", "dataset_config", "dataset_split", "dataset_format", "max_samples", "question_key", "input_key",
    "answer_key", "good_key", "bad_key", "history_key", "conversations_key", "messages_key", "prompt_turn",
    "human_marker", "assistant_marker",
)


def sources(args: DataArguments) -> list[DataArguments]:
    """The recipe's data sources: ``dataset_name`` (if set) then each entry of ``datasets``.

    Each entry of ``datasets`` inherits the template, ``ranked_pairs``, ``max_samples`` and ``dataset_split`` of the
    recipe and sets its own ``dataset_name``, format and column mapping (`SOURCE_KEYS`); mapping keys it does not
    set start from their defaults.

    Raises:
        ValueError: no source at all, or an entry with an unknown key or without ``dataset_name``.
    """
    import dataclasses

    out = [args] if args.dataset_name else []
    for j, entry in enumerate(args.datasets or []):
        if not isinstance(entry, dict) or not entry.get("dataset_name"):
            raise ValueError(f"datasets[{j}] must be a mapping with a dataset_name, got {entry!r}")
        unknown = sorted(set(entry) - set(SOURCE_KEYS))
        if unknown:
            raise ValueError(f"datasets[{j}] ({entry['dataset_name']}): unknown key(s) {unknown}; use {SOURCE_KEYS}")
        defaults = {  # mapping keys start from their defaults; max_samples and dataset_split are inherited
            k: f.default for k, f in DataArguments.__dataclass_fields__.items()
            if k in SOURCE_KEYS and k not in ("max_samples", "dataset_split")
        }
        out.append(dataclasses.replace(args, datasets=[], **{**defaults, **entry}))
    if not out:
        raise ValueError("the recipe names no data: set dataset_name (a local file or a hub dataset id) or datasets")
    return out


def describe_sources(args: DataArguments) -> str:
    """The recipe's data files / dataset ids, comma-separated (for messages)."""
    names = [source_name(args.dataset_name)] if args.dataset_name else []
    names += [source_name(e.get("dataset_name")) for e in args.datasets or [] if isinstance(e, dict)]
    return ", ".join(names) or "<no dataset>"


def read_records(args: DataArguments, kind: Literal["sft", "pairs", "prompts"]) -> list[dict]:
    """Read every source of the recipe (`sources`) and normalise it into records of ``kind`` (see module doc).

    Rows are streamed from `datasets`' Arrow cache in batches (`iter_row_batches`), so only the records are held as
    Python objects; ``max_samples`` stops reading early.

    Raises:
        DataError: see `iter_row_batches`, `sft_records`, `pair_records`, `prompt_records`.
    """
    records = []
    for src in sources(args):
        name = source_name(src.dataset_name)
        batches = _arrow_batches(src.dataset_name, src.dataset_split, src.dataset_config)
        counted = _counted(batches, src.max_samples)
        part = _normalise(kind, counted, src, name)
        logger.info("%s: %d rows -> %d %s records", name, counted.rows, len(part), kind)
        records.extend(part)
    return records


class _counted:
    """Batches of rows, cut at ``limit`` rows in all; ``rows`` counts the rows handed out."""

    def __init__(self, batches: Iterable[list[dict]], limit: int | None):
        self.batches, self.limit, self.rows = batches, limit, 0

    def __iter__(self):
        for batch in self.batches:  # lists of rows, or Arrow record batches (sliced alike)
            if self.limit is not None and self.rows + len(batch) > self.limit:
                batch = batch[: self.limit - self.rows]
            self.rows += len(batch)
            if len(batch):
                yield batch
            if self.limit is not None and self.rows >= self.limit:
                return

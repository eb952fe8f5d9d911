"""Recipe parsing: `trl.TrlParser` with ``--config recipe.yaml`` and ``--key value`` overrides."""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import os
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml


class RecipeError(ValueError):
    """A recipe (YAML file or command-line override) is invalid. The message names the file and the key."""


@dataclass
class RunArguments:
    """Run-level fields every stage's recipe accepts."""

    overwrite_output_dir: bool = field(default=False, metadata={
        "help": "Allow writing into an output_dir that already holds a finished run of this stage."})
    allow_pickle_weights: bool = field(default=False, metadata={
        "help": "Load *.bin / pickle weights when a model has no safetensors (pickle can run code)."})


@dataclass(frozen=True)
class Recipe:
    """A parsed recipe (`parse_recipe`), its ``path`` (None: the command line alone) and its dataclasses: ``data``
    (`DataArguments`), ``script`` (the stage's own: PPO's `PPOScriptArguments`, grpo's reward fields; or None),
    ``training`` (TRL's `SFTConfig`, ..., PPO's `PPOConfig`), ``model`` (TRL's `ModelConfig`), ``run`` (`RunArguments`;
    None: the defaults). Frozen: which objects, not their fields (a stage fills some in as it runs)."""

    data: Any = None
    script: Any = None
    training: Any = None
    model: Any = None
    run: RunArguments | None = None
    path: str | None = None

    @property
    def configs(self) -> tuple:
        """The dataclasses in recipe order (data, script, training, model, run), those not set left out."""
        return tuple(c for c in (self.data, self.script, self.training, self.model, self.run) if c is not None)


def recipe_role(cls) -> str:
    """The `Recipe` field of a recipe dataclass: ``run`` (`RunArguments`), ``data`` (with ``datasets``), ``training``
    (with ``output_dir``), ``model`` (with ``model_name_or_path``: TRL's `ModelConfig`), else ``script``."""
    names = {f.name for f in dataclasses.fields(cls)}
    return ("run" if cls is RunArguments else "data" if "datasets" in names else "training" if "output_dir" in names
            else "model" if "model_name_or_path" in names else "script")


def check_output_dir(output_dir: str, overwrite: bool, resuming: bool) -> None:
    """Raise `RecipeError` for a finished run in ``output_dir`` unless ``overwrite_output_dir`` or resuming."""
    if not (overwrite or resuming) and os.path.isfile(os.path.join(output_dir, "run_config.yaml")) and os.path.isdir(
            os.path.join(output_dir, "merged")):
        raise RecipeError(f"output_dir '{output_dir}' already holds a finished run; set `overwrite_output_dir: true` "
                          "(or --overwrite_output_dir true) to replace it, or choose another output_dir")


def one_line_arguments(parser):
    """Make an `argparse` parser raise `RecipeError` (``command line: <message>``) instead of exiting; returns it."""

    def error(message: str):
        raise RecipeError(f"command line: {message}")

    parser.error = error
    return parser


DEFAULT_REPORT_TO = "tensorboard"  # local event files under <output_dir>/runs; offline
# checkpoints kept unless the recipe says (transformers keeps all): the newest (resume) and two older ones (a resume
# falls back to them when the newest is damaged); older ones are deleted as new ones are published
DEFAULT_SAVE_TOTAL_LIMIT = "3"


def parse_recipe(dataclass_types: tuple, argv: list[str] | None, stage: str | None = None) -> Recipe:
    """``--config recipe.yaml`` plus ``--key value`` overrides parsed into ``dataclass_types`` (`trl.TrlParser`), as a
    `Recipe` (one of each `recipe_role`) with the recipe path. Raises `RecipeError`: no recipe, an unknown key (closest
    suggested), a bad value."""
    from trl import TrlParser

    argv = [a for arg in (sys.argv[1:] if argv is None else argv)  # `--config=PATH` as `--config PATH`
            for a in (arg.split("=", 1) if arg.startswith("--config=") else (arg,))]
    at = argv.index("--config") + 1 if "--config" in argv else None  # where the recipe path is
    if at == len(argv):
        raise RecipeError("--config needs a recipe path")
    path = argv[at] if at else None
    known, data = {f.name for t in dataclass_types for f in dataclasses.fields(t)}, {}
    if path is not None:
        if not os.path.isfile(path):
            raise RecipeError(f"recipe not found: {path}")
        try:
            with open(path, encoding="utf-8") as f:
                data = yaml.safe_load(f)
        except yaml.YAMLError as exc:
            raise RecipeError(f"{path}: not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise RecipeError(f"{path}: a recipe must be a YAML mapping of key: value")
        if unknown := sorted(set(data) - known - {"env"}):
            raise RecipeError(f"{path}: unknown key(s) {unknown}; {did_you_mean(unknown, known | {'env'}, '`--help`')}")
        check_types(dataclass_types, data, path)
    for key, default in (("report_to", DEFAULT_REPORT_TO), ("save_total_limit", DEFAULT_SAVE_TOTAL_LIMIT)):
        if key in known and key not in data and not any(a.split("=")[0] == f"--{key}" for a in argv):
            argv += [f"--{key}", default]
    parser = TrlParser(dataclass_types, prog=f"rlhf-trl {stage}" if stage else None, allow_abbrev=False,
                       usage=f"rlhf-trl {stage or '<stage>'} --config RECIPE.yaml [--key value ...]",
                       description="Run a stage from a YAML recipe (--config); any field below can also be set on the "
                       "command line, where it overrides the recipe.")

    def error(message: str):  # argparse would print usage and exit: one line naming where the bad value is
        flags = message.split(":", 1)[0].removeprefix("argument ").split("/")
        on_command_line = any(a.split("=")[0] in flags for a in argv)
        raise RecipeError(f"{'command line' if on_command_line or not path else path}: {message}")

    parser.error = error
    parser._negative_number_matcher = NEGATIVE_NUMBER  # `--learning_rate -1e-3`: a value, not a flag
    try:
        parsed = parser.parse_args_and_config(argv)
    except RecipeError:
        raise
    except SystemExit as exc:  # argparse reports bad CLI values / unknown flags on stderr and exits 2
        if exc.code in (0, None):  # --help
            raise
        raise RecipeError(f"{path or 'command line'}: invalid arguments (see the message above)") from exc
    except (ValueError, TypeError) as exc:
        message = str(exc)
        if "not used by the HfArgumentParser" in message:  # a flag typed on the command line that no field has
            unused = message.split(":", 1)[-1].strip()
            hint = did_you_mean(re.findall(r"'--([^'=]+)", unused), known, "--help", "--")
            raise RecipeError(f"command line: unknown argument(s) {unused}; {hint}") from None
        key = re.match(r"\w*", message).group()  # a dataclass's own check: "<key> must be ..."
        where = value_source(key, argv, path) if key else path or "command line"
        hint = "" if path else " (no recipe was given: pass --config recipes/<run>/<stage>.yaml)"
        raise RecipeError(f"{where}: {message}{hint}") from None
    check_values(parsed, argv, path)
    for cfg in (c for c in parsed if hasattr(c, "bf16")):
        check_launch(cfg, path)
    return Recipe(**{recipe_role(type(c)): c for c in parsed}, path=path)


def _fits(value, hint) -> bool:
    """Whether a YAML ``value`` can stand for a field annotated ``hint``: numbers where numbers belong, never booleans
    (strings go on to argparse, which converts ``"1e-4"`` or refuses ``"fast"`` in one line); lists / dicts only where
    the type allows them."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if origin is typing.Literal:
        return any(type(value) is type(a) for a in args)  # the stage's own check names the allowed values
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return isinstance(value, (str, hint))
    if hint is bool:  # or a string HfArgumentParser reads as a bool
        return isinstance(value, bool) or isinstance(value, str) and value.lower() in {
            "true", "false", "yes", "no", "1", "0", "t", "f", "y", "n"}
    if hint in (int, float):  # a string: argparse converts it ("1e-4") or refuses it in one line naming file and key
        return isinstance(value, str) or isinstance(value, int) and not isinstance(value, bool) or (
            hint is float and isinstance(value, float))
    if hint is str:
        return isinstance(value, str)
    if origin in (list, tuple) or hint in (list, tuple):
        item = args[0] if args else typing.Any
        if isinstance(value, (list, tuple)):
            return all(_fits(v, item) for v in value)
        return item is str and isinstance(value, str)  # `report_to: tensorboard`: argparse's one-item list
    if origin is dict or hint is dict:
        return isinstance(value, dict) and (len(args) < 2 or all(_fits(v, args[1]) for v in value.values()))
    return True  # `Any`, `object`, another class (accelerate's ParallelismConfig): the library checks it


def _describe(hint) -> str:
    """A field type in a user's words: ``a number``, ``an integer``, ``true or false``, ``a list of strings``..."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(_describe(a) for a in args if a is not type(None)))
    if origin is typing.Literal:
        return " or ".join(repr(a) for a in args)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "a string"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "a mapping"}
    if name := names.get(hint) or names.get(origin):  # dict[str, int] too
        return name
    if origin in (list, tuple) or hint in (list, tuple):
        return f"a list of {_describe(args[0]).removeprefix('a ').removeprefix('an ')}s" if args else "a list"
    return getattr(hint, "__name__", str(hint))


def _shown(value) -> str:
    kind = {list: "a list", tuple: "a list", dict: "a mapping", bool: "a boolean", str: "a string",
            type(None): "null"}.get(type(value), "a number")
    return f"{kind} {value!r}" if value is not None else kind


def check_types(dataclass_types: tuple, data: dict, path: str) -> None:
    """Check every value of a parsed YAML recipe against the type of the dataclass field(s) of its key (`typing`
    hints of every stage's and TRL's config classes, or the class's ``yaml_types`` where it says more; a key in
    several classes must fit each), and each ``datasets`` entry against `DataArguments`' fields. Raises `RecipeError`
    naming the file and the key."""
    hints = {t: typing.get_type_hints(t) for t in dataclass_types}
    for key, value in data.items():
        for cls in (t for t in dataclass_types if key in {f.name for f in dataclasses.fields(t)}):
            hint = getattr(cls, "yaml_types", {}).get(key, hints[cls].get(key))
            if not hint or _fits(value, hint):
                continue
            fix = f"write e.g. `{key}: {value[0]}`" if isinstance(value, list) and len(value) == 1 and not isinstance(
                value[0], (list, dict)) else "see `--help` for its type"
            strings = typing.get_args(hint) and set(typing.get_args(hint)) <= {str, type(None)}  # str | None
            if hint is str or strings and not isinstance(value, (list, dict)):
                fix = f"quote it: `{key}: \"{value}\"`"
            raise RecipeError(f"{path}: {key} must be {_describe(hint)}, got {_shown(value)}; {fix}")
    for j, entry in enumerate(data.get("datasets") or []):
        source = next((t for t in dataclass_types if "datasets" in {f.name for f in dataclasses.fields(t)}), None)
        if isinstance(entry, dict) and source is not None:
            try:
                check_types((source,), {k: v for k, v in entry.items() if k != "datasets"}, path)
            except RecipeError as exc:
                raise RecipeError(str(exc).replace(f"{path}: ", f"{path}: datasets[{j}].", 1)) from None


NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-inf$")
# the condition each recipe value must meet, checked when the recipe is parsed (`check_values`); None is always allowed
RANGES = {
    "> 0": ("learning_rate", "num_train_epochs", "temperature", "cliprange", "cliprange_value", "adam_epsilon"),
    ">= 1": ("max_length", "response_length", "per_device_train_batch_size", "per_device_eval_batch_size",
             "gradient_accumulation_steps", "num_ppo_epochs", "num_mini_batches", "local_rollout_forward_batch_size",
             "total_episodes", "reward_baseline_batches", "lora_r", "value_lora_r"),
    ">= 0": ("kl_coef", "vf_coef", "weight_decay", "max_grad_norm", "logits_chunk_size", "log_samples_every",
             "num_sample_generations"),
    "in [0, 1]": ("gamma", "lam"), "in [0, 1)": ("lora_dropout", "value_lora_dropout")}
_MEETS = {"> 0": lambda v: v > 0, ">= 1": lambda v: v >= 1, ">= 0": lambda v: v >= 0,
          "in [0, 1]": lambda v: 0 <= v <= 1, "in [0, 1)": lambda v: 0 <= v < 1}


def check_launch(training_args, path: str | None) -> None:
    """Refuse a launch that cannot run. Raises `RecipeError`: FSDP without GPUs; a mismatched DeepSpeed precision."""
    import torch

    fsdp, deepspeed = (os.environ.get(f"ACCELERATE_USE_{kind}", "").lower() in ("1", "true", "yes")
                       for kind in ("FSDP", "DEEPSPEED"))
    if fsdp and not torch.accelerator.is_available():
        raise RecipeError("ACCEL=fsdp: accelerate runs FSDP only on GPUs and this machine has none (it would run DDP "
                          "instead); use ACCEL=zero3 (DeepSpeed ZeRO-3) or ACCEL=multi_cpu here")
    config = os.environ.get("ACCELERATE_MIXED_PRECISION", "no") if deepspeed else "no"
    if config not in ("no", "bf16" if training_args.bf16 else "fp16" if training_args.fp16 else "no"):
        raise RecipeError(f"{path or 'command line'}: bf16: {str(training_args.bf16).lower()}, fp16: "
                          f"{str(training_args.fp16).lower()}, but the accelerate config says mixed_precision: "
                          f"{config}; the recipe decides precision: set mixed_precision: 'no' in the accelerate config "
                          f"(as recipes/accelerate_configs/zero3.yaml does), or {config}: true in the recipe")


def did_you_mean(unknown: list[str], known: set[str], manual: str, dashes: str = "") -> str:
    """``did you mean 'x'?`` for the known keys closest to ``unknown``, else ``check the spelling against <manual>``."""
    close = [repr(dashes + m) for m in sorted({c for k in unknown for c in difflib.get_close_matches(k, known, 1, .8)})]
    return f"did you mean {', '.join(close)}?" if close else f"check the spelling against {manual}"


def value_source(key: str, argv: list[str], path: str | None) -> str:
    """Where ``key``'s value came from: ``command line`` (``--key`` in ``argv``, or no recipe) or the recipe path."""
    flags = (f"--{key}", f"--{key.replace('_', '-')}")
    return "command line" if not path or any(a.split("=")[0] in flags for a in argv) else path


def check_values(configs, argv: list[str], path: str | None) -> None:
    """Check ``configs`` against `RANGES` and ``output_dir``. Raises `RecipeError`: ``<key> must be <rule>``."""
    for cfg in configs:
        for rule, key in ((rule, key) for rule, keys in RANGES.items() for key in keys):
            value = getattr(cfg, key, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and not _MEETS[rule](value):
                raise RecipeError(f"{value_source(key, argv, path)}: {key} must be {rule}, got {value}")
            if isinstance(value, float) and not math.isfinite(value):  # inf passes "> 0" (NaN fails every rule)
                raise RecipeError(f"{value_source(key, argv, path)}: {key} must be a finite number, got {value}")
        out = getattr(cfg, "output_dir", None)
        blocker = os.path.abspath(out) if out else None
        while blocker and not os.path.exists(blocker) and os.path.dirname(blocker) != blocker:
            blocker = os.path.dirname(blocker)
        if blocker and os.path.isfile(blocker):
            inside = "" if blocker == os.path.abspath(out) else f": '{blocker}'"
            raise RecipeError(f"{value_source('output_dir', argv, path)}: output_dir '{out}'{inside} is a file, not a "
                              "directory; choose another output_dir")


def sibling_recipe(path: str | None, stage: str) -> str:
    """The command that produces a stage's output, assuming recipes of one run share a directory."""
    return f"make {stage} RECIPE={os.path.join(os.path.dirname(path), stage + '.yaml')}" if path else f"make {stage}"


def save_recipe(output_dir: str, recipe: Recipe) -> None:
    """Write a run's resolved configuration, ``recipe``, to ``output_dir/run_config.yaml`` (for reproducibility)."""
    os.makedirs(output_dir, exist_ok=True)
    data = {}
    for cfg in recipe.configs:
        for f in (f for f in dataclasses.fields(cfg) if not f.name.startswith("_")):
            value = getattr(cfg, f.name)
            value = value.value if isinstance(value, enum.Enum) else value
            if isinstance(value, (str, int, float, bool, type(None))) or (isinstance(value, (list, tuple)) and all(
                    isinstance(v, (str, int, float, bool)) for v in value)):
                data[f.name] = list(value) if isinstance(value, tuple) else value
    with open(os.path.join(output_dir, "run_config.yaml"), "w", encoding="utf-8") as f:
        yaml.safe_dump(data, f, allow_unicode=True, sort_keys=True)

"""Recipe parsing: `trl.TrlParser` with ``--config recipe.yaml`` and ``--key value`` overrides."""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import sys
from dataclasses import dataclass, field

import yaml

logger = logging.getLogger(__name__)


class RecipeError(ValueError):
    """A recipe (YAML file or command-line override) is invalid. The message names the file and the key."""


@dataclass
class RunArguments:
    """Run-level fields every stage's recipe accepts."""

    overwrite_output_dir: bool = field(default=False, metadata={
        "help": "Allow writing into an output_dir that already holds a finished run of this stage."})
    allow_pickle_weights: bool = field(default=False, metadata={
        "help": "Load *.bin / pickle weights when a model has no safetensors (pickle can run code)."})


def check_output_dir(output_dir: str, overwrite: bool, resuming: bool) -> None:
    """Refuse to write over a finished run (its ``run_config.yaml`` and ``merged/`` exist) unless asked to.

    Raises:
        RecipeError: the directory holds a finished run and neither ``overwrite_output_dir`` nor resume is set.
    """
    finished = (os.path.isfile(os.path.join(output_dir, "run_config.yaml"))
                and os.path.isdir(os.path.join(output_dir, "merged")))
    if finished and not overwrite and not resuming:
        raise RecipeError(f"output_dir '{output_dir}' already holds a finished run; set `overwrite_output_dir: true` "
                          "(or --overwrite_output_dir true) to replace it, or choose another output_dir")


def one_line_arguments(parser):
    """Make an `argparse` parser (``rlhf-trl merge`` / ``eval``) raise `RecipeError` (``command line: <argparse's
    message>``) on a bad or missing argument instead of printing its usage and exiting. Returns ``parser``."""

    def error(message: str):
        raise RecipeError(f"command line: {message}")

    parser.error = error
    return parser


def recipe_path(argv: list[str]) -> str | None:
    """The value of ``--config`` in ``argv``, if any."""
    if "--config" in argv:
        i = argv.index("--config")
        return argv[i + 1] if i + 1 < len(argv) else None
    return None


DEFAULT_REPORT_TO = "tensorboard"  # local event files under <output_dir>/runs; offline


def parse_recipe(dataclass_types: tuple, argv: list[str] | None, stage: str | None = None):
    """Parse ``--config recipe.yaml`` plus ``--key value`` overrides into the given dataclasses (`trl.TrlParser`).

    ``stage`` (``sft`` / ``rm`` / ``ppo``) names the command in ``--help``. A recipe that sets no ``report_to`` logs to
    TensorBoard (`DEFAULT_REPORT_TO`) instead of transformers' ``none``.

    Returns:
        A tuple of dataclass instances, in the order of ``dataclass_types``, followed by the recipe path (or None).

    Raises:
        RecipeError: the recipe is missing or not a mapping, holds an unknown key, or a value has the wrong type.
    """
    from trl import TrlParser

    argv = list(sys.argv[1:] if argv is None else argv)
    path = recipe_path(argv)
    if "--config" in argv and path is None:
        raise RecipeError("--config needs a recipe path")
    data = {}
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
        known = {f.name for t in dataclass_types for f in dataclasses.fields(t)} | {"env"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise RecipeError(f"{path}: unknown key(s) {unknown}; check the spelling against `--help`")
    has_report_to = any("report_to" in {f.name for f in dataclasses.fields(t)} for t in dataclass_types)
    if has_report_to and "report_to" not in data and not any(a.split("=")[0] == "--report_to" for a in argv):
        argv += ["--report_to", DEFAULT_REPORT_TO]
    parser = TrlParser(dataclass_types, prog=f"rlhf-trl {stage}" if stage else None,
                       usage=f"rlhf-trl {stage or '<stage>'} --config RECIPE.yaml [--key value ...]",
                       description="Run a stage from a YAML recipe (--config); any field below can also be set on the "
                       "command line, where it overrides the recipe.")

    def error(message: str):  # argparse would print usage and exit: one line naming where the bad value is
        flags = message.split(":", 1)[0].removeprefix("argument ").split("/")
        on_command_line = any(a.split("=")[0] in flags for a in argv)
        raise RecipeError(f"{'command line' if on_command_line or not path else path}: {message}")

    parser.error = error
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
            raise RecipeError(f"command line: unknown argument(s) {unused}; check the spelling against --help"
                              ) from None
        raise RecipeError(f"{path or 'command line'}: {message}") from None
    return (*parsed, path)


def sibling_recipe(path: str | None, stage: str) -> str:
    """The command that produces a stage's output, assuming recipes of one run share a directory."""
    if path:
        return f"make {stage} RECIPE={os.path.join(os.path.dirname(path), stage + '.yaml')}"
    return f"make {stage}"


def save_recipe(output_dir: str, *configs) -> None:
    """Write the resolved configuration of a run to ``output_dir/run_config.yaml`` (for reproducibility)."""
    os.makedirs(output_dir, exist_ok=True)
    data = {}
    for cfg in (c for c in configs if c is not None):
        for f in dataclasses.fields(cfg):
            if f.name.startswith("_"):
                continue
            value = getattr(cfg, f.name)
            if isinstance(value, enum.Enum):
                value = value.value
            if isinstance(value, (str, int, float, bool, type(None))) or (
                isinstance(value, (list, tuple)) and all(isinstance(v, (str, int, float, bool)) for v in value)
            ):
                data[f.name] = list(value) if isinstance(value, tuple) else value
    with open(os.path.join(output_dir, "run_config.yaml"), "w", encoding="utf-8") as f:
        yaml.safe_dump(data, f, allow_unicode=True, sort_keys=True)

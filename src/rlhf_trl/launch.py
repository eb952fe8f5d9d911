"""``rlhf-trl launch --config_file ACCEL.yaml --num_processes N <stage> [args]`` (what ``make <stage> ACCEL=...
NPROC=...`` runs): check the recipe and the launch configuration once, in this process, before any worker starts,
then run accelerate's launcher in this process, so that a worker's error reaches the user once, as its one line,
with its exit status, and without the launcher's ``ChildFailedError`` traceback (``RLHF_TRL_DEBUG=1`` shows it).

Checked before launch: every recipe key and value (`config.parse_recipe`, as the workers will parse it) with the
environment accelerate sets for the config's ``distributed_type`` / ``mixed_precision`` (FSDP without GPUs, a
DeepSpeed precision other than the recipe's: `config.check_launch`); the inputs are the workers' to check (each
refusal is one line, printed by the main process only)."""

from __future__ import annotations

import argparse
import logging
import os

import yaml

from .cli_launch import COMMANDS, quiet_libraries, recipe_types
from .config import RecipeError, parse_recipe


def check_before_launch(config_file: str, stage: str, argv: list[str]) -> None:
    """Parse the accelerate config and the stage's recipe as the workers will: with the environment variables
    ``accelerate launch`` gives its workers for that config (those the recipe checks read) set meanwhile. Raises
    `RecipeError` (one line)."""
    if not os.path.isfile(config_file):
        raise RecipeError(f"accelerate config not found: {config_file}")
    with open(config_file, encoding="utf-8") as f:
        config = yaml.safe_load(f) or {}
    if stage not in COMMANDS:
        raise RecipeError(f"unknown command '{stage}'")
    if not COMMANDS[stage].training:
        raise RecipeError(f"'{stage}' runs in one process; launch it without ACCEL / NPROC")
    env = {"ACCELERATE_MIXED_PRECISION": str(config.get("mixed_precision") or "no")}
    if (kind := str(config.get("distributed_type", "")).upper()) in ("FSDP", "DEEPSPEED"):
        env[f"ACCELERATE_USE_{kind}"] = "true"
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        parse_recipe(recipe_types(stage), argv, stage)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


class LaunchRefused(RecipeError):
    """The recipe or the launch config of ``stage`` is refused before any worker starts (the CLI prints one line)."""

    def __init__(self, stage: str, cause: RecipeError):
        super().__init__(str(cause))
        self.stage = stage


def main(argv: list[str]) -> int:
    """Check, then launch ``rlhf-trl <stage> args`` on ``--num_processes`` processes. Returns the exit status: 0,
    or the first failed worker's status. Raises `LaunchRefused`: the recipe or launch config refused, before any
    worker starts."""
    ap = argparse.ArgumentParser(prog="rlhf-trl launch", allow_abbrev=False, usage="rlhf-trl launch --config_file "
                                 "ACCEL.yaml --num_processes N <stage> --config RECIPE.yaml [--key value ...]")
    ap.add_argument("--config_file", required=True, help="an accelerate config (recipes/accelerate_configs/*.yaml)")
    ap.add_argument("--num_processes", type=int, default=1)
    ap.add_argument("stage")
    args, rest = ap.parse_known_args(argv)
    debug = bool(os.environ.get("RLHF_TRL_DEBUG"))
    quiet_libraries()  # as `run_stage` does: library notices are not for users
    try:
        check_before_launch(args.config_file, args.stage, rest)
    except RecipeError as exc:
        raise LaunchRefused(args.stage, exc) from exc
    from accelerate.commands.launch import launch_command, launch_command_parser

    launch_args = launch_command_parser().parse_args(["--config_file", args.config_file, "--num_processes",
                                                      str(args.num_processes), "-m", "rlhf_trl.cli", args.stage, *rest])
    if not debug:  # the agent's "closing signal" / failure summaries: the worker's own line says what happened
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        launch_command(launch_args)
    except Exception as exc:  # torch's ChildFailedError (a worker exited non-zero)
        if debug or not hasattr(exc, "failures"):
            raise
        # the first failed worker's exit status (killed by a signal: 128 + the signal, as a shell reports it)
        code = next((f.exitcode for f in exc.failures.values() if f.exitcode is not None), 1)
        return 128 - code if code < 0 else code
    return 0

"""Command line: ``rlhf-trl {sft,rm,ppo,demo,...} --config recipe.yaml [--key value ...]``."""

from __future__ import annotations

import os
import sys

from .cli_launch import COMMANDS, one_line, run_stage

USAGE = "usage: rlhf-trl {" + ",".join(COMMANDS) + "} --config RECIPE.yaml [--key value ...] | --version\n\n" + \
    "\n".join(f"  {name:10s} {command.help}" for name, command in COMMANDS.items())


def version_line() -> str:
    """``rlhf-trl X (trl Y, transformers Z, torch W, python V)``: the installed versions a bug report needs."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    def of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    libs = ", ".join(f"{n} {of(n)}" for n in ("trl", "transformers", "peft", "accelerate", "datasets", "torch"))
    return f"rlhf-trl {of('rlhf_trl')} ({libs}, python {platform.python_version()})"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(version_line())
        return 0
    stage, rest = argv[0], argv[1:]
    if stage == "launch":
        from .launch import LaunchRefused, main as launch

        try:
            return launch(rest)
        except LaunchRefused as exc:
            if os.environ.get("RLHF_TRL_DEBUG"):
                raise
            print(f"rlhf-trl {exc.stage}: error: {one_line(exc)}", file=sys.stderr)
            return 2
    if stage not in COMMANDS:
        print(f"rlhf-trl: error: unknown command '{stage}'\n\n{USAGE}", file=sys.stderr)
        return 2
    return run_stage(stage, rest)


if __name__ == "__main__":
    sys.exit(main())

"""The `medha` command: one module per subcommand, each with `add_parser(sub)` and `run(args)`.

Building the parser imports no torch, fastapi, httpx, matplotlib or numpy (tests/test_startup.py
checks it): the flags come from light config modules, and each command imports what it runs
inside `run`, so that `--help` and a mistyped flag answer at once.
"""

from __future__ import annotations

import argparse
import sys

from medha import __version__
from medha.cli import (
    analyze,
    bench,
    chunks,
    demo,
    generate,
    hardware,
    plan,
    predict,
    profile,
    route,
    serve,
    simulate,
    trace,
)
from medha.cli.common import CliError
from medha.extras import missing_extra

COMMANDS = (
    demo, chunks, predict, generate, profile, serve, route, bench, simulate, plan, analyze,
    hardware, trace,
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="medha",
        description="LLM serving for mixed short and very long requests "
        "(preemptive chunked prefills, LARS scheduling, adaptive chunking).",
    )
    parser.add_argument("--version", action="version", version=f"medha {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    parser.simulate_parser = sub.choices["simulate"]  # for its --config file
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "simulate" and args.config:
            args = simulate.parse_with_config(parser, argv, args.config)
        args.func(args)
    except CliError as e:
        print(f"medha {args.command}: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:  # an extra not installed; anything else is a bug
        command = sys.modules[args.func.__module__]
        message = missing_extra(e, f"medha {args.command}", getattr(command, "EXTRA", None))
        if message is None:
            raise
        print(f"medha {args.command}: error: {message}", file=sys.stderr)
        return 2
    return 0


__all__ = ["CliError", "build_parser", "main"]

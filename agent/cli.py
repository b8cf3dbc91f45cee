"""The ``tokentrace`` command: one entry point, subcommands discovered through entry points.

Subcommands register under the ``tokentrace.commands`` entry-point group as classes with
``name``, ``help``, ``add_arguments(parser)`` and ``run(args) -> int``. Their modules must stay
import-light (argparse only at import time) so ``tokentrace --help`` is fast and the agent side
never pulls in the collector's dependencies.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from typing import Protocol

COMMAND_GROUP = "tokentrace.commands"


class Command(Protocol):
    name: str
    help: str

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


def _load_commands() -> dict[str, Command]:
    commands: dict[str, Command] = {}
    for entry in entry_points(group=COMMAND_GROUP):
        try:
            command_class = entry.load()
        except ImportError as error:
            # e.g. `tokentrace[agent]` only: the collector commands' extras are missing.
            print(f"tokentrace: command {entry.name!r} unavailable: {error}", file=sys.stderr)
            continue
        commands[entry.name] = command_class()
    return commands


def build_parser(commands: dict[str, Command]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokentrace",
        description="Tracing for LLM inference servers: which delay made this request slow, "
        "and is the fleet inside its latency targets?",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in sorted(commands):
        command = commands[name]
        sub = subparsers.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    commands = _load_commands()
    parser = build_parser(commands)
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    try:
        return commands[args.command].run(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

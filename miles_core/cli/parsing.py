"""The parsers of the `miles` commands: argparse that answers instead of exiting, and run flags inside.

    parser = command_parser("miles runs show", "what a run root holds")   # -h/--help anywhere
    add_run_flags(parser)      # fork/replay: every run flag, in any order around the positionals
    ns, extras = parser.parse_known_args(argv)   # UsageError, or ParserExit after --help

A usage mistake raises `UsageError` (the caller prints it with the usage line and exits 2); --help
prints the help on stdout and raises `ParserExit(0)`. Run flags are collected as typed
(`ns.run_flags`, in order) and judged by `miles_core.config.parse_flags`, which reports every
problem of them at once.
"""

from __future__ import annotations

import argparse
import difflib
from dataclasses import dataclass
from typing import Callable

from miles_core.config import flag_table


class UsageError(Exception):
    """A command line that does not fit its command; `usage` is that command's usage line."""

    def __init__(self, message: str, usage: str = ""):
        super().__init__(message)
        self.usage = usage


class ParserExit(Exception):
    """The parser finished the command itself (after --help): exit with `status`."""

    def __init__(self, status: int):
        super().__init__(status)
        self.status = status


class CommandParser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so `main()` keeps one exit-code rule."""

    actions: dict[str, "CommandParser"] | None = None  # `runs show|list`: the parser of each action

    def error(self, message: str):
        raise UsageError(message, self.format_usage().strip())

    def refuse(self, ns: argparse.Namespace, extras: list[str]):
        """A usage error for words no option takes, from the parser of the action given (with the closest
        option named)."""
        parser = self.actions.get(getattr(ns, "action", ""), self) if self.actions else self
        options = [o for a in parser._actions for o in a.option_strings]  # noqa: SLF001 - argparse has no public list
        close = [c for w in extras for c in difflib.get_close_matches(w.split("=")[0], options, n=1)]
        parser.error(f"unrecognized arguments: {' '.join(extras)}" + (f" (did you mean {close[0]}?)" if close else ""))

    def exit(self, status: int = 0, message: str | None = None):
        if message:
            raise UsageError(message.strip(), self.format_usage().strip())
        raise ParserExit(status)


@dataclass(frozen=True)
class Command:
    name: str
    summary: str  # one line for `miles --help` (and the description of its own --help)
    build: Callable[[CommandParser], None]  # adds the arguments and `handler`
    takes_flags: bool = False  # unknown --words are run flags (parse_flags judges them)
    own_help: bool = False  # build adds its own -h/--help

    def parser(self) -> CommandParser:
        p = command_parser(f"miles {self.name}", self.summary[:1].upper() + self.summary[1:] + ".",
                           add_help=not self.own_help)
        self.build(p)
        return p


def command_parser(prog: str, description: str, **kw) -> CommandParser:
    return CommandParser(prog=prog, description=description, allow_abbrev=False,
                         formatter_class=argparse.RawDescriptionHelpFormatter, **kw)


def subcommands(parser: CommandParser, title: str):
    """`miles runs show|list`-style actions of a command."""
    actions = parser.add_subparsers(title=title, dest="action", metavar="ACTION", required=True,
                                    parser_class=CommandParser)
    parser.actions = actions.choices
    return actions


class _RunFlag(argparse.Action):
    """Keeps a run flag as typed, in order, in `ns.run_flags` (its value is judged by parse_flags)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if self.nargs == 0 or values is _MISSING:
            words = [option_string]
        elif isinstance(values, list):
            words = [option_string, *values]
        else:
            words = [f"{option_string}={values}"]  # a value that starts with "--" stays this flag's
        namespace.run_flags = [*getattr(namespace, "run_flags", []), *words]


_MISSING = object()


def add_run_flags(parser: CommandParser) -> None:
    """Every run flag (hidden from --help), so they may come before or after the positionals."""
    parser.set_defaults(run_flags=[])
    for s in flag_table():
        names = (s.flag, "--no-" + s.flag[2:]) if s.kind == "bool" else (s.flag,)
        arity = {"nargs": 0} if s.kind == "bool" else {"nargs": "*"} if s.kind == "list" else \
            {"nargs": "?", "const": _MISSING}
        parser.add_argument(*names, action=_RunFlag, dest=f"_flag_{s.name}", default=argparse.SUPPRESS,
                            help=argparse.SUPPRESS, **arity)


def add_storage_timeout(parser: CommandParser, default: float) -> None:
    parser.add_argument("--storage-timeout", type=_seconds, default=default, metavar="SECONDS",
                        help=f"give up on unreachable storage after this many seconds of retries (default {default:g})")


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(text)
    return value


_seconds.__name__ = "number of seconds > 0"  # argparse names the type in its error


def unknown_command(name: str, commands: list[str]) -> str:
    close = difflib.get_close_matches(name, commands, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return f"unknown command '{name}'.{hint} Commands: {', '.join(commands)} (`miles --help`)."

"""The `miles` console script: one parser per command, one exit-code rule, no traceback for user errors.

    miles validate [FLAGS...]                       the resolved config as JSON, or every problem with it
    miles runs show RUN_URI [--json]                what a run root holds: state, steps, segments, lease,
                                                    checkpoints, snapshots, buffer counts, evals
    miles runs list STORAGE_ROOT [--json]           every run under a storage root: id, state, steps, last update
    miles buffer inspect RUN_URI [--ids] [--json]   the durable buffer's counts, or every group id and its fate
    miles lineage RUN_URI GROUP_ID [--json]         where one group came from and went
    miles report RUN_URI [-o FILE]                  a self-contained HTML report of a run
    miles trace RUN_URI [--steps A:B] [-o FILE]     the run's timeline as Chrome trace-event JSON (Perfetto)
    miles doctor RUN_URI [--repair] [--json]        a run root checked end to end (exit 1: it cannot continue
                                                    as it is); --repair fixes what can be fixed
    miles import-model SRC DEST_URI                 a GGUF file (or import:NAME) or an HF directory, imported
    miles fork RUN_URI --at-step K --new-run ID [FLAGS...]    a new run from step K's checkpoint
    miles replay RUN_URI [--steps N] [--from-step K] [--out URI] [FLAGS...]   retrain on the recorded groups
    miles engines add|remove RUN_URI N             a running run's engine fleet grows or shrinks by N
    miles engines show RUN_URI [--json]            its engine target and fleet

Every command answers -h/--help anywhere on its line, takes its options before or after its
positional arguments, and reports every problem of its command line at once. Exit status (see
`miles_core.cli.errors`): 0 ok, 1 a runtime failure, 2 a usage or configuration error. The commands
that read run roots (runs, buffer, lineage, report, trace, doctor) give up on unreachable storage after
--storage-timeout seconds (default 5). `main(argv)` returns the status instead of exiting, for
in-process callers.
"""

from __future__ import annotations

import io
import os
import sys

from miles_core import __version__
from miles_core.cli import engines, making, reading
from miles_core.cli.errors import EXIT_OK, EXIT_USAGE, explain
from miles_core.cli.parsing import Command, ParserExit, UsageError, unknown_command
from miles_core.storage import StorageUnavailable

COMMANDS = {c.name: c for c in [*making.COMMANDS, *reading.COMMANDS, *engines.COMMANDS]}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {c.summary}" for name, c in COMMANDS.items()]
    return ("usage: miles COMMAND [ARGS...]   (`miles COMMAND --help` for its arguments)\n\ncommands:\n"
            + "\n".join(lines) + "\n\nexit status: 0 ok, 1 runtime failure, 2 usage or configuration error")


def main(argv: list[str] | None = None) -> int:
    argv_given, argv = argv, sys.argv[1:] if argv is None else list(argv)
    name = argv[0] if argv and argv[0] in COMMANDS else ""
    try:
        status = _dispatch(argv)
        sys.stdout.flush()  # here, so a closed pipe is met inside the handler below, not at exit
        return status
    except BrokenPipeError:
        return _reader_gone()
    except KeyboardInterrupt:
        print(f"{_prefix(name)}: interrupted", file=sys.stderr)
        return 130
    except ParserExit as e:
        return e.status
    except Exception as e:  # noqa: BLE001 - one clear line for users; a bug keeps its traceback
        status = _report(e, name)
        if argv_given is None and isinstance(e, StorageUnavailable):
            _abandon(status)
        return status


def _dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "--version"):
        return _top_level(argv)
    if argv[0] not in COMMANDS:
        raise UsageError(unknown_command(argv[0], list(COMMANDS)), usage().splitlines()[0])
    return _run(COMMANDS[argv[0]], argv[1:])


def _top_level(argv: list[str]) -> int:
    """`miles` alone (a usage error), `miles --help`, `miles --version`."""
    if not argv:
        print(usage(), file=sys.stderr)
        return EXIT_USAGE
    print(f"miles {__version__}" if argv[0] == "--version" else usage())
    return EXIT_OK


def _run(command: Command, args: list[str]) -> int:
    parser = command.parser()
    try:
        ns, extras = parser.parse_known_args(args)
    except UsageError:
        if not {"-h", "--help"} & set(args):
            raise
        print(parser.format_help())  # --help asked for, after words that do not fit: the command's help
        return EXIT_OK
    if extras and not command.takes_flags:
        parser.refuse(ns, extras)
    ns.run_flags = [*getattr(ns, "run_flags", []), *extras]  # unknown --words: parse_flags names them
    ns.usage = parser.format_usage().strip()
    return ns.handler(ns)


def _report(exc: Exception, name: str) -> int:
    explained = explain(exc)
    if explained is None:
        raise exc
    status, line = explained
    if isinstance(exc, UsageError) and exc.usage:
        print(exc.usage, file=sys.stderr)
    print(f"{_prefix(name)}: {line}", file=sys.stderr)
    return status


def _prefix(name: str) -> str:
    return f"miles {name}" if name else "miles"


def _abandon(status: int) -> None:
    """Exit now, as the console script: an attempt cut at --storage-timeout may have left a name lookup
    or connect running in a worker thread, and Python's exit would wait for it (seconds past the
    timeout) before the status the line above already explains."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _reader_gone() -> int:
    """The reader of stdout went away (`miles ... | head`): not an error; silence the exit-time flush."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):
        pass
    return EXIT_OK

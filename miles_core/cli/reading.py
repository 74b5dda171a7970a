"""The `miles` commands that read run roots: runs show|list, buffer inspect, lineage, report, trace, and doctor
(which writes only with --repair).

Each takes --storage-timeout SECONDS (default `READ_TIMEOUT_SECONDS`): unreachable storage ends the
command after that many seconds of retries instead of the storage layer's 60 s, which exist so a
training run rides out a restarted S3 endpoint. Options and positionals come in any order.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from typing import Iterator

from miles_core.buffer.inspect import group_ids, inspect_buffer
from miles_core.cli.parsing import Command, CommandParser, add_storage_timeout, subcommands
from miles_core.metrics.report import write_report, write_text
from miles_core.metrics.trace import build_trace, parse_steps
from miles_core.storage import StorageUnavailable, Store, retry_deadline
from miles_core.storage.run_root import RunNotFound, require_run

READ_TIMEOUT_SECONDS = 5.0
DEFAULT_STORAGE_ROOT = ".miles"  # a run's --storage-root default (miles_core.config.sections)
RUN_URI_HELP = "a run root: {storage_root}/runs/{run_id}, a path or a URI (file://, s3://, gs://)"


@contextlib.contextmanager
def storage_budget(seconds: float) -> Iterator[None]:
    """Stores opened inside give up after `seconds`; the error then says how to wait longer."""
    storage_log = logging.getLogger("miles_core.storage")
    level = storage_log.level
    if not logging.getLogger().handlers:  # no logging set up: each retry would print a line before the error
        storage_log.setLevel(logging.ERROR)
    try:
        with retry_deadline(seconds):
            yield
    except StorageUnavailable as e:
        raise StorageUnavailable(f"{e} Gave up after --storage-timeout={seconds:g} s; pass a larger "
                                 "--storage-timeout to wait longer.") from e
    finally:
        storage_log.setLevel(level)


def _emit(data, render, as_json: bool) -> int:
    print(json.dumps(data, indent=2, sort_keys=True) if as_json else render(data))
    return 0


def _existing_run(run_uri: str) -> str:
    require_run(Store(run_uri))
    return run_uri


def _common(p: CommandParser, json_help: str = "print JSON instead of text") -> None:
    p.add_argument("--json", action="store_true", help=json_help)
    add_storage_timeout(p, READ_TIMEOUT_SECONDS)


# ----------------------------------------------------------------------------- runs


def _runs(p: CommandParser) -> None:
    actions = subcommands(p, "actions")
    show = actions.add_parser("show", help="state, steps, segments, lease, checkpoints, snapshots, buffer, evals, producers",
                              description="What a run root holds, in one screen.")
    show.add_argument("run_uri", metavar="RUN_URI", help=RUN_URI_HELP)
    _common(show)
    show.set_defaults(handler=_runs_show)
    listing = actions.add_parser("list", help="every run under a storage root: id, state, steps, last update",
                                 description="Every run under STORAGE_ROOT/runs/, one line each.")
    listing.add_argument("storage_root", metavar="STORAGE_ROOT", nargs="?", default=DEFAULT_STORAGE_ROOT,
                         help="the --storage-root of the runs (e.g. .miles, s3://bucket/miles; default "
                              f"{DEFAULT_STORAGE_ROOT}, a run's default)")
    _common(listing)
    listing.set_defaults(handler=_runs_list)


def _runs_show(ns) -> int:
    # torch: the lineage commands read checkpoints; `miles validate` and `miles report` must not load it
    from miles_core.lineage.show import render_summary, run_summary

    with storage_budget(ns.storage_timeout):
        store = Store(ns.run_uri)
        if not store.exists("config.json") and store.list_dirs("runs"):
            raise RunNotFound(f"{store.uri()} is a storage root, not a run: a run root is {store.uri('runs')}/"
                              f"RUN_ID. Its runs: `miles runs list {ns.run_uri}`.")
        summary = run_summary(ns.run_uri)
    return _emit(summary, render_summary, ns.json)


def _runs_list(ns) -> int:
    from miles_core.lineage.listing import list_runs, render_runs

    with storage_budget(ns.storage_timeout):
        root = Store(ns.storage_root)
        local = root.local_path()
        if not (os.path.isdir(local) if local is not None else root.list_dirs("")):
            raise RunNotFound(f"no storage root at {root.uri()}: it holds nothing (is that the runs' "
                              "--storage-root? a run's default is .miles, where the run was started)")
        runs = list_runs(ns.storage_root)
    return _emit(runs, lambda r: render_runs(r, ns.storage_root), ns.json)


# ----------------------------------------------------------------------------- buffer


def _buffer(p: CommandParser) -> None:
    actions = subcommands(p, "actions")
    inspect = actions.add_parser("inspect", help="counts of the durable buffer (JSON), or its group ids (--ids)",
                                 description="What the durable buffer of a run holds, read-only: counts as JSON, or "
                                             "with --ids each group's id, status and the step that took it.")
    inspect.add_argument("run_uri", metavar="RUN_URI", help=RUN_URI_HELP)
    inspect.add_argument("--ids", action="store_true",
                         help="list every group id with its status (consumed, rejected, available, or "
                              "consumed_or_rejected where its step's manifest does not parse) and step")
    _common(inspect, "with --ids: print JSON instead of text (the counts are always JSON)")
    inspect.set_defaults(handler=_buffer_inspect)


def _buffer_inspect(ns) -> int:
    with storage_budget(ns.storage_timeout):
        uri = _existing_run(ns.run_uri)
        if not ns.ids:
            return _emit(inspect_buffer(uri), None, True)
        rows = group_ids(uri)
    return _emit(rows, _render_ids, ns.json)


def _render_ids(rows: list[dict]) -> str:
    if not rows:
        return "no groups"
    width = max(len("GROUP"), *(len(r["group_id"]) for r in rows))
    lines = [f"{'GROUP':<{width}}  {'STATUS':<9}  STEP"]
    lines += [f"{r['group_id']:<{width}}  {r['status']:<9}  {'-' if r['step'] is None else r['step']}"
              f"{'' if r['stored'] else '  (object deleted)'}" for r in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- lineage, report


def _lineage(p: CommandParser) -> None:
    p.description = ("Where one group came from and went: who generated it (the run's own rollout or a producer "
                     "job), its prompt, samples and token versions, the step "
                     "that trained (or rejected) it, the first checkpoint and snapshot that include that "
                     "step, the evals around it.")
    p.add_argument("run_uri", metavar="RUN_URI", help=RUN_URI_HELP)
    p.add_argument("group_id", metavar="GROUP_ID", help="e.g. e0-p17-a0 (`miles buffer inspect RUN_URI --ids` "
                                                        "lists them)")
    _common(p)
    p.set_defaults(handler=_lineage_run)


def _lineage_run(ns) -> int:
    # torch: the lineage commands read checkpoints; `miles validate` and `miles report` must not load it
    from miles_core.lineage.group_lineage import group_lineage, render_lineage

    with storage_budget(ns.storage_timeout):
        trace = group_lineage(ns.run_uri, ns.group_id)
    return _emit(trace, render_lineage, ns.json)


def _report(p: CommandParser) -> None:
    p.add_argument("run_uri", metavar="RUN_URI", help=RUN_URI_HELP)
    p.add_argument("-o", "--output", default="report.html", metavar="FILE",
                   help="where to write it: a path or a URI (default report.html)")
    add_storage_timeout(p, READ_TIMEOUT_SECONDS)
    p.set_defaults(handler=_report_run)


def _report_run(ns) -> int:
    with storage_budget(ns.storage_timeout):
        print(write_report(_existing_run(ns.run_uri), ns.output))
    return 0


def _trace(p: CommandParser) -> None:
    p.description = ("The run's timeline as Chrome trace-event JSON (open it in https://ui.perfetto.dev or "
                     "chrome://tracing): engine requests, each group's life, trainer step phases, weight pushes, "
                     "checkpoints and evals, every process on one clock.")
    p.add_argument("run_uri", metavar="RUN_URI", help=RUN_URI_HELP)
    p.add_argument("--steps", metavar="A:B", type=_steps_arg,
                   help="only steps A (included) to B (excluded); A:, :B or one step N also work (default: every "
                        "step the trace keeps)")
    p.add_argument("-o", "--output", default="trace.json", metavar="FILE",
                   help="where to write it: a path or a URI (default trace.json)")
    add_storage_timeout(p, READ_TIMEOUT_SECONDS)
    p.set_defaults(handler=_trace_run)


def _steps_arg(text: str):
    try:
        return parse_steps(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _trace_run(ns) -> int:
    with storage_budget(ns.storage_timeout):
        store = Store(_existing_run(ns.run_uri))
        timeline = build_trace(store, ns.steps)
    spans = sum(1 for e in timeline["traceEvents"] if e["ph"] in ("X", "b"))
    if not spans:
        print(f"{ns.run_uri} has no trace (a run with --no-trace, or one from before traces)", file=sys.stderr)
        return 1
    print(f"{write_text(ns.output, json.dumps(timeline))}: {spans} spans; open it in https://ui.perfetto.dev")
    return 0


# ----------------------------------------------------------------------------- doctor


def _doctor(p: CommandParser) -> None:
    p.description = ("Checks a run root end to end: config and STATUS records, LATEST, the lease, every checkpoint "
                     "against its COMPLETE, the consumption manifests and compaction record, every buffer object "
                     "against them, eval results and requests, snapshots, temporaries of unfinished writes. Each "
                     "finding says what it means for the run and the fix. Exit status: 0 when the run can continue "
                     "as it is (warnings allowed), 1 when it cannot, 2 a usage error. With --repair it rebuilds "
                     "STATUS.json and covered consumption manifests, moves what it removes under "
                     "quarantine/doctor/{time}/ (undecodable buffer objects to buffer/quarantine/), never deletes a "
                     "committed group or a complete checkpoint, refuses while a live writer holds the lease, and "
                     "checks again.")
    p.add_argument("run_uri", metavar="RUN_URI", help=RUN_URI_HELP)
    p.add_argument("--repair", action="store_true",
                   help="make the repairs it can (see above), then check again and print what remains")
    p.add_argument("--verify-checksums", action="store_true",
                   help="verify every checkpoint file's sha256 too (default: sizes, and checksums of checkpoints "
                        "under 256 MiB, as a resume does)")
    _common(p)
    p.set_defaults(handler=_doctor_run)


def _doctor_run(ns) -> int:
    # torch: the checkpoints are verified by the trainer's checkpoint manager
    from miles_core.lineage.doctor import diagnose, render_report, repair

    with storage_budget(ns.storage_timeout):
        report = (repair if ns.repair else diagnose)(ns.run_uri, verify_checksums=ns.verify_checksums)
    _emit(report.to_json(), lambda _: render_report(report), ns.json)
    return 0 if report.can_continue else 1


COMMANDS = [
    Command("runs", "what runs hold: `runs show RUN_URI` one run, `runs list STORAGE_ROOT` every run", _runs),
    Command("buffer", "a run's durable buffer: `buffer inspect RUN_URI` its counts, with --ids its group ids",
            _buffer),
    Command("lineage", "where one group of a run came from and went", _lineage),
    Command("report", "a self-contained HTML report of a run", _report),
    Command("trace", "a run's timeline as Chrome trace-event JSON (Perfetto opens it)", _trace),
    Command("doctor", "check a run root end to end (--repair: fix what can be fixed)", _doctor),
]

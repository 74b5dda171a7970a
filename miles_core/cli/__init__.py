"""The `miles` console script.

    miles validate [FLAGS...]        resolved config as JSON (exit 0) or the problems (exit 2)
    miles buffer inspect RUN_URI     counts of the durable buffer as JSON
    miles report RUN_URI [-o FILE]   self-contained HTML report of a run
    miles import-model SRC DEST_URI  import a GGUF file (or import:NAME) or an HF directory (DESIGN §18)
    miles fork RUN_URI --at-step K --new-run ID [FLAGS...]   a new run from step K's checkpoint (§8.3)
    miles replay RUN_URI [--steps N] [FLAGS...]  retrain on the recorded groups, no generation
    miles runs show RUN_URI [--json]             state, steps, segments, lease, checkpoints, snapshots,
                                                 buffer counts and eval results of a run
    miles lineage RUN_URI GROUP_ID [--json]      a group's prompt, token versions, the step that consumed
                                                 it, the checkpoint and snapshot that include it, evals near it
"""

from __future__ import annotations

import json
import sys
import time

from miles_core.buffer.inspect import inspect_buffer
from miles_core.config import ConfigError, config_to_json, flag_table, parse_flags
from miles_core.metrics.report import write_report
from miles_core.models.source import import_source
from miles_core.prepare.checks import local_hf_config, validate
from miles_core.prepare.memory import estimate
from miles_core.prepare.model_import import import_model
from miles_core.storage import StorageError, Store
from miles_core.storage.run_root import require_run

USAGE = __doc__


def _validate(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print("usage: miles validate [FLAGS...]\n")
        for s in flag_table():
            choices = f" {{{','.join(s.choices)}}}" if s.choices else ""
            print(f"  {s.flag}{choices}  (default {s.default!r})\n      {s.help}")
        return 0
    try:
        cfg = validate(parse_flags(argv))
    except ConfigError as e:
        print(f"miles validate: {e}", file=sys.stderr)
        return 2
    print(config_to_json(cfg))
    hf_config = local_hf_config(cfg) if cfg.engine.engine_backend == "sglang" else None
    if hf_config is not None:
        print(f"miles validate: trainer memory per GPU (estimate): {estimate(hf_config, cfg).describe()}",
              file=sys.stderr)
    return 0


def _buffer(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "inspect":
        print("usage: miles buffer inspect RUN_URI", file=sys.stderr)
        return 2

    print(json.dumps(inspect_buffer(_existing_run(argv[1])), indent=2, sort_keys=True))
    return 0


def _report(argv: list[str]) -> int:
    if not argv or argv[-1] == "-o":
        print("usage: miles report RUN_URI [-o FILE]", file=sys.stderr)
        return 2

    out = argv[argv.index("-o") + 1] if "-o" in argv else "report.html"
    print(write_report(_existing_run(argv[0]), out))
    return 0


def _existing_run(run_uri: str) -> str:
    require_run(Store(run_uri))
    return run_uri


def _import_model(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: miles import-model SRC DEST_URI\n  SRC: a .gguf file (path or URI), import:NAME, "
              "or a local HF directory with safetensors weights", file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2

    started = time.time()
    try:
        uri = import_model(import_source(argv[0]), argv[1])
    except (ValueError, OSError, StorageError) as e:  # ModelSourceError is a ValueError
        print(f"miles import-model: {e}", file=sys.stderr)
        return 2
    print(uri)
    print(f"miles import-model: done in {time.time() - started:.1f}s", file=sys.stderr)
    return 0


def _fork(argv: list[str]) -> int:
    # torch: the lineage commands read checkpoints; `miles validate` and `miles report` must not load it
    from miles_core.lineage.fork import main as fork_main

    return fork_main(argv)


def _replay(argv: list[str]) -> int:
    # torch: the lineage commands read checkpoints; `miles validate` and `miles report` must not load it
    from miles_core.lineage.replay import main as replay_main

    return replay_main(argv)


def _runs(argv: list[str]) -> int:
    args = [a for a in argv if a != "--json"]
    if len(args) != 2 or args[0] != "show":
        print("usage: miles runs show RUN_URI [--json]", file=sys.stderr)
        return 2
    # torch: the lineage commands read checkpoints; `miles validate` and `miles report` must not load it
    from miles_core.lineage.show import render_summary, run_summary

    return _emit(run_summary(args[1]), render_summary, "--json" in argv)


def _lineage(argv: list[str]) -> int:
    args = [a for a in argv if a != "--json"]
    if len(args) != 2:
        print("usage: miles lineage RUN_URI GROUP_ID [--json]", file=sys.stderr)
        return 2
    # torch: the lineage commands read checkpoints; `miles validate` and `miles report` must not load it
    from miles_core.lineage.trace import group_lineage, render_lineage

    return _emit(group_lineage(*args), render_lineage, "--json" in argv)


def _emit(data: dict, render, as_json: bool) -> int:
    print(json.dumps(data, indent=2, sort_keys=True) if as_json else render(data))
    return 0


COMMANDS = {"validate": _validate, "buffer": _buffer, "report": _report, "import-model": _import_model,
            "fork": _fork, "replay": _replay, "runs": _runs, "lineage": _lineage}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(USAGE, file=sys.stderr)
        return 2
    try:
        return COMMANDS[argv[0]](argv[1:])
    except Exception as e:  # noqa: BLE001 - one clear line for users, not a stack trace

        if isinstance(e, (StorageError, ValueError, FileNotFoundError)):
            print(f"miles {argv[0]}: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())

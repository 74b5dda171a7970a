"""The `miles` commands that check a config or make something: validate, import-model, fork, replay.

`validate`, `fork` and `replay` take run flags (every flag of `miles validate --help`), in any order
around their own arguments; all the problems of them are reported at once (exit 2).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from miles_core.cli.parsing import Command, CommandParser, ParserExit, UsageError, add_run_flags
from miles_core.config import config_to_json, flag_table
from miles_core.config.flags import raise_flag_problems, read_flags, unrelated
from miles_core.models.source import ModelSourceError, import_source
from miles_core.prepare.checks import local_hf_config, model_fit, setting_warnings, validation_problems
from miles_core.prepare.memory import estimate
from miles_core.prepare.model_import import import_model

RUN_URI_HELP = "the run root to read: {storage_root}/runs/{run_id}, a path or a URI"
FLAGS_EPILOG = "FLAGS: run flags (`miles validate --help` lists them all), before or after the other arguments."

# ----------------------------------------------------------------------------- validate


def _validate(p: CommandParser) -> None:
    p.usage = "miles validate [FLAGS...]"
    p.add_argument("-h", "--help", action=_FlagTable, nargs=0, help="list every flag")
    p.set_defaults(handler=_validate_run, run_flags=[])


class _FlagTable(argparse.Action):
    """`miles validate --help`: the usage, then every run flag with its choices, default and help."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"usage: {parser.usage}\n\n{parser.description}\n")
        for s in flag_table():
            choices = f" {{{','.join(s.choices)}}}" if s.choices else ""
            print(f"  {s.flag}{choices}  (default {s.default!r})\n      {s.help}")
        raise ParserExit(0)


def _validate_run(ns) -> int:
    cfg, flag_problems = read_flags(ns.run_flags)  # every problem at once: the command line's and the checks'
    raise_flag_problems(flag_problems, unrelated(validation_problems(cfg), flag_problems))
    print(config_to_json(cfg))
    for warning in setting_warnings(cfg):  # a pretrained model with settings only a toy wants
        print(f"miles validate: warning: {warning}", file=sys.stderr)
    hf_config = local_hf_config(cfg.model) if cfg.engine.engine_backend == "sglang" else None
    if hf_config is not None:
        print(f"miles validate: trainer memory per GPU (estimate): {estimate(hf_config, cfg).describe()}",
              file=sys.stderr)
        for warning in model_fit(hf_config, cfg)[1]:  # may not fit --gpu-memory-gb
            print(f"miles validate: warning: {warning}", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------- import-model


def _import_model(p: CommandParser) -> None:
    p.add_argument("src", metavar="SRC", help="a .gguf file (path or URI), import:NAME (a packaged model), or a "
                                              "local HF directory with safetensors weights")
    p.add_argument("dest_uri", metavar="DEST_URI", help="where the HF safetensors directory goes (path or URI)")
    p.set_defaults(handler=_import_model_run)


def _import_model_run(ns) -> int:
    started = time.time()
    try:
        uri = import_model(import_source(ns.src), ns.dest_uri)
    except (ModelSourceError, FileNotFoundError) as e:  # SRC names no model: the command line's mistake
        raise UsageError(str(e)) from e
    print(uri)
    print(f"miles import-model: done in {time.time() - started:.1f}s", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------- fork, replay


def _fork(p: CommandParser) -> None:
    p.description = ("A new run {storage root}/runs/ID from step K's checkpoint of RUN_URI, FLAGS overriding its "
                     "recorded config; prints the command that continues it.")
    p.usage = "miles fork RUN_URI --at-step K --new-run ID [FLAGS...]"
    p.epilog = FLAGS_EPILOG
    p.add_argument("run_uri", metavar="RUN_URI", help=RUN_URI_HELP)
    p.add_argument("--at-step", type=int, metavar="K", help="the step whose checkpoint the fork starts from (required)")
    p.add_argument("--new-run", metavar="ID", help="the fork's run id (required)")
    add_run_flags(p)
    p.set_defaults(handler=_fork_run)


def _fork_run(ns) -> int:
    # torch: the lineage commands read checkpoints; `miles validate` and `miles report` must not load it
    from miles_core.lineage.fork import fork_run

    if ns.at_step is None or ns.new_run is None:
        raise UsageError("--at-step and --new-run are required", ns.usage)
    result = fork_run(ns.run_uri, ns.at_step, ns.new_run, ns.run_flags)
    print(f"forked {result.source_run} at step {result.at_step} into {result.run_uri}: {result.groups_carried} "
          f"unconsumed groups in {result.objects_copied} objects carried, {result.groups_lost} lost; overrides: "
          f"{json.dumps(result.overrides)}\ncontinue it with:\n  {result.command}")
    return 0


def _replay(p: CommandParser) -> None:
    from miles_core.lineage.replay import REPLAYABLE

    names = {s.name: s.flag for s in flag_table()}
    p.description = ("Retrain on RUN_URI's recorded groups in the recorded order, without generation "
                     "(docs/fork-replay.md).")
    p.usage = "miles replay RUN_URI [--steps N] [--from-step K] [--out URI] [FLAGS...]"
    p.epilog = f"FLAGS (training settings only): {' '.join(names[n] for n in REPLAYABLE)}"
    p.add_argument("run_uri", metavar="RUN_URI", help=RUN_URI_HELP)
    p.add_argument("--steps", type=int, metavar="N", help="replay N steps (default: every recorded step)")
    p.add_argument("--from-step", type=int, metavar="K", help="start from step K's checkpoint, replay K+1 on")
    p.add_argument("--out", metavar="URI", help="an empty location for the output (default {RUN_URI}/replays/...)")
    add_run_flags(p)
    p.set_defaults(handler=_replay_run)


def _replay_run(ns) -> int:
    # torch: the lineage commands read checkpoints; `miles validate` and `miles report` must not load it
    from miles_core.lineage.recorded import LineageError
    from miles_core.lineage.replay import render_replay, replay_run
    from miles_core.train.checkpoint import CheckpointError
    from miles_core.train.trainer import TrainError

    try:
        result = replay_run(ns.run_uri, steps=ns.steps, from_step=ns.from_step, out=ns.out, flags=ns.run_flags)
    except (CheckpointError, TrainError) as e:  # e.g. a checkpoint of another TP size: one line, not a trace
        raise LineageError(str(e)) from e
    print(render_replay(result))
    return 0


COMMANDS = [
    Command("validate", "check a run's flags: the resolved config as JSON (exit 0), or every problem (exit 2)",
            _validate, takes_flags=True, own_help=True),
    Command("import-model", "import a GGUF file (or import:NAME) or an HF directory as an HF safetensors directory",
            _import_model),
    Command("fork", "a new run from step K's checkpoint of a run, flags overriding its recorded config", _fork,
            takes_flags=True),
    Command("replay", "retrain on a run's recorded groups in the recorded order, without generation", _replay,
            takes_flags=True),
]

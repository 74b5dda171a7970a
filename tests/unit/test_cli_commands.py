"""The `miles` command line as a well-made CLI (issue 24): one parser per command, in-process via main().

Pins: --help/-h anywhere exits 0 with that command's usage (never read as a run URI); options come
before or after positionals; an unknown command is named with the closest one; `miles` alone is a
usage error (2) and `miles --help` is not; the exit-code rule (0 ok, 1 runtime failure, 2 usage or
configuration: ConfigError is 2 in validate, fork and replay alike); every problem of a command line
at once; missing credentials and unreachable storage as one line. The subprocess cases (no
traceback, a closed pipe, real S3 clients) are in test_cli_subprocess.py.
"""

from __future__ import annotations

import json

import pytest

from miles_core.cli import COMMANDS, main
from miles_core.cli.errors import EXIT_FAILURE, EXIT_USAGE, explain
from miles_core.cli.reading import storage_budget
from miles_core.storage import StorageUnavailable, Store
from tests.support.small_run import small_run

HELP_LINES = [["validate"], ["import-model"], ["fork"], ["replay"], ["runs"], ["runs", "show"], ["runs", "list"],
              ["buffer"], ["buffer", "inspect"], ["lineage"], ["report"], ["trace"], ["engines"], ["engines", "add"],
              ["engines", "remove"], ["engines", "show"], ["doctor"]]


@pytest.fixture
def run(tmp_path):
    return small_run(tmp_path)


@pytest.mark.parametrize("words", HELP_LINES, ids=" ".join)
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_anywhere_prints_usage_and_exits_0(words, flag, capsys, tmp_path):
    """Guards: `miles runs show --help` answering "no run at .../--help"; help that cites the design notes
    or a path outside the repository (a user has only the repository)."""
    for argv in ([*words, flag], [*words, str(tmp_path), flag]):
        assert main(argv) == 0, argv
        out, err = capsys.readouterr()
        assert f"usage: miles {' '.join(words)}" in out and "no run at" not in out + err, (argv, out, err)
        assert not [o for o in ("DESIGN", "§", "../shared") if o in out], (argv, out)


def test_top_level_help_and_usage(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS) and "DESIGN" not in out and "exit status" in out
    assert main([]) == EXIT_USAGE
    assert "usage: miles COMMAND" in capsys.readouterr().err


def test_unknown_command_is_named_with_the_closest(capsys):
    assert main(["runz", "show"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "unknown command 'runz'" in err and "Did you mean 'runs'?" in err and "lineage" in err
    assert main(["runs", "lst", "x"]) == EXIT_USAGE
    assert "invalid choice: 'lst'" in capsys.readouterr().err


def test_options_in_any_order(run, capsys):
    """Guards: options that only work after the run URI."""
    assert main(["runs", "show", "--json", run.uri]) == 0
    assert json.loads(capsys.readouterr().out)["status"]["state"] == "segment_done"
    assert main(["lineage", "--json", run.uri, run.trained[1]]) == 0
    assert json.loads(capsys.readouterr().out)["fate"] == {"step": 1, "outcome": "consumed"}
    assert main(["buffer", "inspect", "--ids", "--json", run.uri]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 5


def test_unknown_option_of_a_reading_command_is_a_usage_error(run, capsys):
    assert main(["runs", "show", run.uri, "--jsn"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "unrecognized arguments: --jsn" in err and "usage: miles runs show" in err


def test_every_bad_value_of_a_command_line_at_once(capsys):
    """Guards: parsing that stops at the first bad value."""
    assert main(["validate", "--preset", "tiny-reverse4", "--lr", "abc", "--n-samples-per-prompt", "x", "--engine-backend", "tpu",
                 "--rollout-batch-sise", "3", "--eps-clip", "-1"]) == EXIT_USAGE
    err = capsys.readouterr().err
    for needle in ("--lr: invalid float value: 'abc'", "--n-samples-per-prompt: invalid int value: 'x'",
                   "--engine-backend: invalid choice: 'tpu'", "Did you mean --rollout-batch-size?",
                   "--eps-clip=-1.0 must be > 0"):
        assert needle in err, (needle, err)
    assert "group of one" not in err  # no rule judged the default of the flag whose value was bad


def test_config_errors_exit_2_in_validate_fork_and_replay(run, capsys):
    """Guards: a ConfigError that exits 2 in validate but 1 in fork/replay."""
    assert main(["validate", "--preset", "tiny-reverse4", "--fully-async", "--colocate"]) == EXIT_USAGE
    for argv in (["fork", run.uri, "--at-step", "1", "--new-run", "b", "--tiny-hidden-size", "64"],
                 ["fork", "--lr", "abc", run.uri, "--at-step", "1", "--new-run", "b"],
                 ["fork", run.uri, "--at-step", "1", "--new-run", "b", "--run-id", "z"],
                 ["fork", run.uri, "--new-run", "b"],
                 ["fork", run.uri, "--at-step", "1", "--new-run", "../b"],
                 ["replay", run.uri, "--rollout-batch-size", "8"],
                 ["replay", run.uri, "--lr", "abc", "--steps", "x"]):
        capsys.readouterr()
        assert main(argv) == EXIT_USAGE, argv
        err = capsys.readouterr().err
        assert err.startswith(("miles fork:", "miles replay:", "usage: miles")) and "Traceback" not in err, err
    assert not (Store(run.storage_root).list("runs/b"))


def test_runtime_failures_exit_1(run, tmp_path, capsys):
    for argv in (["runs", "show", f"{run.storage_root}/runs/typo"], ["lineage", run.uri, "g9999"],
                 ["fork", run.uri, "--at-step", "0", "--new-run", "b"], ["buffer", "inspect", str(tmp_path / "no")]):
        assert main(argv) == EXIT_FAILURE, argv
        assert capsys.readouterr().err.count("\n") == 1


def test_missing_credentials_are_one_line_of_what_to_set():
    class NoCredentialsError(Exception):  # botocore's class, matched by name
        pass

    try:
        try:
            raise NoCredentialsError("Unable to locate credentials")
        except NoCredentialsError as e:
            raise RuntimeError("wrapped by the client") from e
    except RuntimeError as wrapped:
        status, line = explain(wrapped)
    assert status == EXIT_USAGE and "AWS_ACCESS_KEY_ID" in line and "Unable to locate credentials" in line


def test_unreachable_storage_names_the_timeout_flag():
    with pytest.raises(StorageUnavailable, match="--storage-timeout=2 s"):
        with storage_budget(2):
            raise StorageUnavailable("storage at s3://b/r unreachable")
    assert explain(StorageUnavailable("x"))[0] == EXIT_USAGE  # issue 36: an endpoint, network or credentials to fix


# ----------------------------------------------------------------------------- issue 36: the smaller CLI points


def test_runs_list_defaults_to_a_runs_storage_root_and_refuses_a_missing_one(run, tmp_path, monkeypatch, capsys):
    """Guards: `miles runs list` without STORAGE_ROOT a usage error, and a misspelt root answering
    "no runs" with exit 0 (a typo read as an empty root)."""
    monkeypatch.chdir(tmp_path)
    assert main(["runs", "list"]) == EXIT_FAILURE  # .miles, a run's default, is not there
    assert "no storage root at file://" in capsys.readouterr().err
    assert main(["runs", "list", str(tmp_path / "typo")]) == EXIT_FAILURE
    assert f"no storage root at file://{tmp_path}/typo" in capsys.readouterr().err
    (tmp_path / ".miles").symlink_to(tmp_path)  # the default root now holds the run
    assert main(["runs", "list"]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("r ")


def test_runs_show_on_a_storage_root_says_so(run, tmp_path, capsys):
    """Guards: `miles runs show STORAGE_ROOT` answering only "no run at ..." with no hint."""
    assert main(["runs", "show", str(tmp_path)]) == EXIT_FAILURE
    err = capsys.readouterr().err
    assert "is a storage root, not a run" in err and f"miles runs list {tmp_path}" in err


def test_trace_steps_with_nothing_in_them_is_a_usage_error(run, capsys):
    """Guards: `miles trace --steps 5:2` exiting 1 with a bare ValueError."""
    assert main(["trace", run.uri, "--steps", "5:2"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "usage: miles trace" in err and "--steps '5:2': no step is in it" in err


def test_engines_add_refuses_a_finished_run(run, capsys):
    """Guards: `miles engines add` on a finished run succeeding silently (no driver will ever read it)."""
    from miles_core.storage.run_root import FINISHED, write_status

    write_status(Store(run.uri), FINISHED, last_step=3, segment=0)
    assert main(["engines", "add", run.uri, "1"]) == EXIT_FAILURE
    assert "is finished" in capsys.readouterr().err
    assert not Store(run.uri).exists("engines/target.json")


def test_engines_show_defines_its_version_column(capsys):
    """Guards: a VERSION column nothing defines."""
    assert main(["engines", "show", "--help"]) == 0
    assert "VERSION is the newest weight version the engine answered" in " ".join(capsys.readouterr().out.split())


def test_engines_show_version_is_what_the_engine_served_not_what_it_joined_with(tmp_path, capsys):
    """Guards: an engine that served v7 shown as VERSION 1 (the version it began serving with)."""
    from miles_core.config import embedded_default
    from miles_core.engines.registry import write_fleet
    from miles_core.storage.run_root import write_config

    store = Store(f"file://{tmp_path}/runs/r")
    write_config(store, embedded_default(storage_root=f"file://{tmp_path}", run_id="r"))
    engine = {"name": "engine-0", "url": "http://e:1", "state": "serving", "phase": "serving", "version": 1}
    write_fleet(store, {"engines": [dict(engine, served={"min_version": 1, "max_version": 7, "requests": 9}),
                                    dict(engine, name="engine-1", url="http://e:2", version=6)],
                        "target": 2, "serving": 2, "step": 5, "version": 7, "events": []})
    assert main(["engines", "show", store.uri()]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("engine-")}
    assert rows["engine-0"][2] == "7" and rows["engine-1"][2:4] == ["6", "(joined)"]

"""The engine fleet's registry in the run root and the `miles engines` command that changes it.

Pins: the target is relative to the one asked before (else the run's --rollout-num-engines), never
below 0, and never below 1 on a run without --allow-rollout-producers, each refusal naming the count
(exit 1); a bad N is a usage error (exit 2); `show` prints the target and the fleet the driver
recorded; a target.json that holds no count is named, not read as "no target".
"""

from __future__ import annotations

import json

import pytest

from miles_core.cli import main
from miles_core.config import parse_flags
from miles_core.engines.registry import (
    TARGET_KEY,
    EngineTargetError,
    change_target,
    read_fleet,
    read_target,
    write_fleet,
    write_target,
)
from miles_core.storage import Store
from miles_core.storage.run_root import write_config
from tests.support.small_run import small_run


def test_target_read_write_and_change(tmp_path):
    store = Store(f"file://{tmp_path}/run")
    assert read_target(store) is None and read_fleet(store) is None
    assert change_target(store, 2, current=1) == 3  # no target yet: from `current`
    assert change_target(store, -1, current=99) == 2 and read_target(store) == 2  # from the target now
    record = store.get_json(TARGET_KEY)
    assert record["count"] == 2 and record["requested_at"] > 0
    with pytest.raises(EngineTargetError, match="cannot remove 3 engine.*is 2"):
        change_target(store, -3, current=0)
    with pytest.raises(EngineTargetError, match="is 2, and keeps one"):
        change_target(store, -2, current=0, minimum=1, why="keeps one")
    assert read_target(store) == 2  # refused changes write nothing
    assert write_target(store, 0) == 0 and read_target(store) == 0
    with pytest.raises(EngineTargetError, match=">= 0"):
        write_target(store, -1)


def test_a_target_that_holds_no_count_is_named(tmp_path):
    store = Store(f"file://{tmp_path}/run")
    store.put_json(TARGET_KEY, {"count": "three"})
    with pytest.raises(EngineTargetError, match="engines/target.json holds no engine count"):
        read_target(store)


def test_fleet_record_round_trips(tmp_path):
    store = Store(f"file://{tmp_path}/run")
    write_fleet(store, {"engines": [{"name": "engine-0", "state": "serving"}], "target": 1})
    fleet = read_fleet(store)
    assert fleet["engines"][0]["name"] == "engine-0" and fleet["target"] == 1 and fleet["updated_at"] > 0


def test_cli_add_remove_show(tmp_path, capsys):
    run = small_run(tmp_path)  # --rollout-num-engines 1, no producers
    assert main(["engines", "add", run.uri, "2"]) == 0
    assert "engine target of" in capsys.readouterr().out
    assert read_target(Store(run.uri)) == 3
    assert main(["engines", "remove", run.uri, "1"]) == 0
    assert read_target(Store(run.uri)) == 2
    assert main(["engines", "remove", run.uri, "2"]) == 1  # would leave 0 on a run without producers
    err = capsys.readouterr().err
    assert "cannot remove 2 engine(s)" in err and "is 2" in err and "--allow-rollout-producers" in err
    assert read_target(Store(run.uri)) == 2

    write_fleet(Store(run.uri), {"engines": [{"name": "engine-0", "url": "http://127.0.0.1:1", "state": "serving",
                                              "phase": "serving", "version": 4}], "target": 2, "serving": 1,
                                 "step": 9, "version": 10, "events": [{"step": 9, "event": "starting",
                                                                       "name": "engine-1"}]})
    assert main(["engines", "show", run.uri]) == 0
    out = capsys.readouterr().out
    assert "target 2 (asked by miles engines remove" in out and "serving 1 of target 2 at step 9" in out
    assert "engine-0" in out and "http://127.0.0.1:1" in out and "starting" in out
    assert main(["engines", "show", run.uri, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["target"]["count"] == 2 and shown["fleet"]["serving"] == 1


def test_cli_remove_to_zero_only_with_producers(tmp_path, capsys):
    uri = f"file://{tmp_path}/runs/p"
    write_config(Store(uri), parse_flags(["--preset", "tiny-reverse4", "--storage-root", f"file://{tmp_path}", "--run-id", "p",
                                          "--allow-rollout-producers", "--rollout-num-engines", "0"]))
    assert main(["engines", "add", uri, "1"]) == 0 and read_target(Store(uri)) == 1
    assert main(["engines", "remove", uri, "1"]) == 0 and read_target(Store(uri)) == 0
    assert main(["engines", "remove", uri, "1"]) == 1
    assert "cannot remove 1 engine(s)" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["engines", "add", "RUN", "0"], ["engines", "remove", "RUN", "x"],
                                  ["engines", "add", "RUN"], ["engines", "grow", "RUN", "1"]])
def test_cli_bad_command_lines_are_usage_errors(argv, tmp_path, capsys):
    run = small_run(tmp_path)
    assert main([run.uri if a == "RUN" else a for a in argv]) == 2
    assert "usage: miles engines" in capsys.readouterr().err
    assert read_target(Store(run.uri)) is None


def test_cli_no_run_and_bad_target(tmp_path, capsys):
    assert main(["engines", "add", str(tmp_path / "nope"), "1"]) == 1
    assert "no run at" in capsys.readouterr().err
    run = small_run(tmp_path)
    Store(run.uri).put_json(TARGET_KEY, {"count": -4})
    assert main(["engines", "show", run.uri]) == 1
    assert "holds no engine count" in capsys.readouterr().err

"""config.json / STATUS.json helpers (miles_core.storage.run_root, docs/quickstart.md#where-the-run-lives).

Pins: segment 0 writes config.json and a resumed segment writes config_segment_{n}.json without
touching it; STATUS.json round-trips; next_segment counts from the recorded status.
"""

from __future__ import annotations

import pytest

from miles_core.config import embedded_default, replace_fields
from miles_core.config.record import read_run_config
from miles_core.storage import Store
from miles_core.storage.run_root import (
    FAILED,
    FINISHED,
    RUNNING,
    next_segment,
    read_config,
    read_status,
    write_config,
    write_status,
)


@pytest.fixture
def store(tmp_path):
    return Store(f"file://{tmp_path}/run")


def test_config_per_segment(store):
    assert read_config(store) is None
    first = embedded_default()
    assert write_config(store, first, 0) == "config.json"
    second = replace_fields(first, lr=1e-4)
    assert write_config(store, second, 1) == "config_segment_0001.json"
    assert read_config(store)["train"]["lr"] == first.train.lr  # STATUS still names segment 0
    write_status(store, RUNNING, last_step=10, segment=1)
    assert read_config(store, 0)["train"]["lr"] == first.train.lr
    assert read_config(store)["train"]["lr"] == 1e-4  # latest segment by default
    assert read_run_config(store, 0) == first
    assert read_run_config(store) == second


def test_status_round_trip_and_segments(store):
    assert read_status(store) is None and next_segment(store) == 0
    s = write_status(store, RUNNING, last_step=-1, segment=0)
    assert s.active and read_status(store) == s
    write_status(store, FINISHED, last_step=9, segment=0)
    got = read_status(store)
    assert (got.state, got.last_step, got.segment, got.active) == (FINISHED, 9, 0, False)
    assert next_segment(store) == 1
    write_status(store, FAILED, last_step=12, segment=1, message="engine crashed")
    assert read_status(store).message == "engine crashed"


def test_unknown_state_rejected(store):
    with pytest.raises(ValueError, match="unknown run state"):
        write_status(store, "done", last_step=0, segment=0)

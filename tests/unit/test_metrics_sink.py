"""MetricsSink and read_metrics (docs/quickstart.md#where-the-run-lives metrics/, §12).

Pins: events round-trip through the run root on file:// and S3; each flush is a new immutable
part object (append-only on object storage); several writers of one component never collide;
close() loses nothing; non-finite values become null and non-numeric values are skipped.
"""

from __future__ import annotations

import json
import math

import pytest

from miles_core.metrics import METRIC_NAMES, PERF_METRICS, MetricsSink, read_metrics, series
from miles_core.storage import Store


@pytest.mark.s3
def test_round_trip(storage_root):
    run = storage_root + "/runs/r1"
    with MetricsSink(run, "trainer", flush_events=4, background=False) as sink:
        for step in range(5):
            sink.log(step, {"train/loss": 1.0 / (step + 1), "perf/step_seconds": 0.5})
    events = read_metrics(run)
    assert len(events) == 10
    assert {e["component"] for e in events} == {"trainer"}
    assert set(events[0]) == {"step", "time", "name", "value", "component"}
    steps, loss = series(events, "train/loss")
    assert steps == [0, 1, 2, 3, 4] and loss[2] == pytest.approx(1 / 3)
    keys = Store(run).list("metrics/trainer")
    assert len(keys) == 3  # 4 + 4 events by size, the last 2 at close
    assert all(k.endswith(".jsonl") for k in keys)


def test_parts_are_new_objects_never_rewritten(tmp_path):
    store = Store(f"file://{tmp_path}/run")
    sink = MetricsSink(store, "rollout", background=False)
    sink.log(0, {"a": 1})
    k1 = sink.flush()
    body1 = store.get_bytes(k1)
    sink.log(1, {"a": 2})
    k2 = sink.flush()
    assert k1 != k2 and k1 < k2
    assert store.get_bytes(k1) == body1
    assert sink.flush() is None  # nothing buffered: no empty part
    sink.close()
    assert len(store.list("metrics/rollout")) == 2


def test_two_writers_of_one_component_do_not_collide(tmp_path):
    run = f"file://{tmp_path}/run"
    a = MetricsSink(run, "rollout", background=False)
    b = MetricsSink(run, "rollout", background=False)
    a.log(0, {"x": 1})
    b.log(0, {"x": 3})
    a.close()
    b.close()
    assert series(read_metrics(run, "rollout"), "x") == ([0], [2.0])  # mean per step


def test_time_based_flush(tmp_path):
    store = Store(f"file://{tmp_path}/run")
    sink = MetricsSink(store, "eval", flush_seconds=0.0, background=False)
    sink.log(3, {"eval/heldout": 0.5})  # flush_seconds=0: every log is due
    assert len(store.list("metrics/eval")) == 1
    sink.close()


def test_background_thread_flushes_idle_sinks(tmp_path):
    import time

    store = Store(f"file://{tmp_path}/run")
    sink = MetricsSink(store, "eval", flush_seconds=0.2)
    sink.log(0, {"eval/heldout": 0.1})
    deadline = time.time() + 5
    while not store.list("metrics/eval") and time.time() < deadline:
        time.sleep(0.05)
    assert store.list("metrics/eval")
    sink.close()


def test_values_are_cleaned(tmp_path):
    run = f"file://{tmp_path}/run"
    with MetricsSink(run, "trainer", background=False) as sink:
        sink.log(0, {"nan": math.nan, "inf": math.inf, "flag": True, "text": "x", "ok": 2})
    by_name = {e["name"]: e["value"] for e in read_metrics(run)}
    assert by_name == {"nan": None, "inf": None, "flag": 1.0, "ok": 2.0}
    raw = Store(run).get_bytes(Store(run).list("metrics")[0]).decode()
    assert all(json.loads(line) for line in raw.splitlines())  # strict JSON: no NaN literals


def test_reader_skips_a_damaged_line(tmp_path):
    store = Store(f"file://{tmp_path}/run")
    store.put_bytes("metrics/x/0-000000.jsonl",
                    b'{"step": 1, "time": 1.0, "name": "a", "value": 1}\n{"step": \n')
    assert [e["value"] for e in read_metrics(store)] == [1.0]


def test_closed_sink_refuses_events(tmp_path):
    sink = MetricsSink(f"file://{tmp_path}/run", "trainer", background=False)
    sink.close()
    with pytest.raises(RuntimeError, match="closed"):
        sink.log(0, {"a": 1})


def test_bad_component_name_rejected(tmp_path):
    with pytest.raises(ValueError):
        MetricsSink(f"file://{tmp_path}/run", "../escape", background=False)


def test_perf_metric_names_are_documented():
    from miles_core.metrics import names as N

    components = (N.PERF_METRICS, N.WEIGHTS_METRICS, N.RUN_METRICS, N.PRODUCER_METRICS, N.ROLLOUT_METRICS, N.BUFFER_METRICS,
                  N.LOSS_METRICS, N.TRAIN_STEP_METRICS, N.EVAL_METRICS)
    assert set(METRIC_NAMES) == set().union(*components) and len(METRIC_NAMES) == len(set(METRIC_NAMES))
    assert all(all(c.values()) for c in components)  # every name has its meaning
    assert all(n.startswith("perf/") and PERF_METRICS[n] for n in PERF_METRICS)
    assert {"perf/tokens_per_second", "perf/train_wait_seconds", "perf/producer_blocked_seconds",
            "perf/weight_update_seconds", "perf/step_seconds"} <= set(METRIC_NAMES)


def test_docs_list_every_perf_metric_with_its_meaning():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    for name, meaning in PERF_METRICS.items():
        assert f"| `{name}` | {meaning} |" in doc, name

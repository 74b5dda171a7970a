"""The run's timeline trace: recording, chunks in the run root, one clock, the Chrome export, the
window, sampling, `miles trace` and the report's swimlane (miles_core.metrics.trace).

Pins: every span a process records reaches the run root and comes back in the export with its
process and lane named; async spans become b/e pairs with one id; spans from a node whose clock is
off by 2 s line up once trace/clock.json says so; --steps keeps the spans of those steps only; the
window deletes old chunks only; a full buffer drops (and counts) instead of growing; a group is
sampled the same way in every process; a process that never configured a tracer records nothing.
"""

from __future__ import annotations

import json

import pytest

from miles_core.cli import main
from miles_core.driver.timeline import Timeline
from miles_core.metrics import trace
from miles_core.metrics.report import render_html, swimlane_figure, swimlane_spans
from miles_core.storage import Store
from miles_core.storage.run_root import FINISHED, write_status
from tests.support.report_run import write_steps


@pytest.fixture
def store(tmp_path) -> Store:
    return Store(f"file://{tmp_path}/run")


def test_every_span_comes_back_named_in_chrome_format(store):
    write_steps(store)
    out = trace.build_trace(store)
    events = out["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"driver", "trainer-rank0", "rollout"}
    lanes = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert lanes == {"step", "train", "weights"}
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 6 * 5 and all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    begins = [e for e in events if e["ph"] == "b"]
    ends = {(e["id"], e["name"]) for e in events if e["ph"] == "e"}
    assert len(begins) == 6 * 3 and {(e["id"], e["name"]) for e in begins} <= ends
    driver_pid = next(e["pid"] for e in events if e["ph"] == "M" and e["args"]["name"] == "driver")
    assert driver_pid == 1  # the driver first: Perfetto lists it on top
    json.dumps(out)  # plain JSON


def test_a_skewed_node_lines_up_once_its_offset_is_recorded(store):
    write_steps(store, node="node-b", trainer_skew=2.0)  # that node's clock is 2 s ahead
    def optimizer_vs_step(events):
        steps = {e["args"]["step"]: e["ts"] for e in events if e["name"] == trace.STEP_SPAN}
        opt = sorted(e["ts"] for e in events if e["name"] == "optimizer")
        return [(o - s) / 1e6 for o, s in zip(opt, [steps[k] for k in sorted(steps)])]

    assert optimizer_vs_step(trace.build_trace(store)["traceEvents"]) == pytest.approx([2.6] * 6)
    trace.write_clock_offsets(store, {"node-b": trace.estimate_offset([(10.0, 12.0, 10.002)])}, "node-a")
    assert optimizer_vs_step(trace.build_trace(store)["traceEvents"]) == pytest.approx([0.6] * 6, abs=0.002)


def test_offset_comes_from_the_fastest_round_trip():
    got = trace.estimate_offset([(0.0, 5.0, 1.0), (2.0, 7.5, 2.01), (3.0, 8.0, 3.5)])
    assert got["offset_seconds"] == pytest.approx(2.005 - 7.5) and got["rtt_seconds"] == pytest.approx(0.01)


def test_steps_keep_only_spans_of_those_steps(store):
    write_steps(store)
    out = trace.build_trace(store, trace.parse_steps("2:4"))
    steps = sorted(e["args"]["step"] for e in out["traceEvents"] if e["name"] == trace.STEP_SPAN)
    assert steps == [1, 2, 3, 4]  # the neighbours touch the window's edges; 0 and 5 are out
    assert trace.parse_steps("3") == (3, 4) and trace.parse_steps(":4") == (None, 4)
    with pytest.raises(ValueError, match="steps in the trace: 0..5"):
        trace.build_trace(store, (50, 60))
    with pytest.raises(ValueError, match="expected A:B"):
        trace.parse_steps("x:y")


def test_the_window_deletes_old_chunks_only(store):
    old = trace.Tracer(store, "rollout", background=False)
    old.instant("x", 1.0)
    old.flush()
    [old_key] = store.list(trace.EVENTS_PREFIX + "/")
    written = int(old_key.rsplit("/", 1)[-1].split("-")[0]) / 1000
    new = trace.Tracer(store, "rollout", background=False)
    new.instant("y")
    assert trace.prune(store, keep_after=written + 0.001) == 1
    new_key = new.flush()
    assert store.list(trace.EVENTS_PREFIX + "/") == [new_key]


def test_timeline_prunes_every_100_steps_behind_the_window(store, monkeypatch):
    pruned = []
    monkeypatch.setattr(trace, "prune", lambda s, keep_after: pruned.append(keep_after) or 0)
    timeline = Timeline(store, window_steps=50)
    for step in range(201):
        timeline.on_step(step)
    assert len(pruned) == 2 and pruned[-1] == timeline.step_ends[150]
    assert min(timeline.step_ends) == 150  # the step times it keeps are bounded too


def test_a_full_buffer_drops_and_counts(store):
    t = trace.Tracer(store, "rollout", background=False, max_pending=3)
    for i in range(5):
        t.instant(f"e{i}")
    chunk = json.loads(store.get_bytes(t.flush()))
    assert len(chunk["events"]) == 3 and chunk["dropped"] == 2


def test_group_sampling_is_the_same_everywhere_and_near_its_fraction():
    ids = [f"e0-p{i}-a0-trainer" for i in range(4000)]
    picked = [g for g in ids if trace.sampled(g, 0.25)]
    assert picked == [g for g in ids if trace.sampled(g, 0.25)]
    assert 0.22 < len(picked) / len(ids) < 0.28
    assert all(trace.sampled(g, 1.0) for g in ids[:10])


def test_an_unconfigured_process_records_nothing(store):
    assert not trace.enabled()
    with trace.span("x", lane="y"):
        pass
    trace.tracer().async_span("group", "g", 0.0, 1.0)
    assert store.list("") == []


def test_configure_and_shutdown_flush(store):
    trace.configure(store, "driver", background=False)
    try:
        assert trace.enabled()
        with trace.span("a", lane="l", step=3) as extra:
            extra["n"] = 7
    finally:
        trace.shutdown()
    assert not trace.enabled()
    [(process, event)] = trace.aligned_events(store)
    assert process == "driver" and event["name"] == "a" and event["args"] == {"step": 3, "n": 7}


def test_miles_trace_writes_the_file(store, tmp_path, capsys):
    write_steps(store)
    write_status(store, FINISHED, last_step=5, segment=0)
    out = tmp_path / "t.json"
    assert main(["trace", store.uri(), "--steps", "1:3", "-o", str(out)]) == 0
    assert "open it in https://ui.perfetto.dev" in capsys.readouterr().out
    steps = {e["args"]["step"] for e in json.loads(out.read_text())["traceEvents"] if e["name"] == "step"}
    assert steps == {0, 1, 2, 3}
    assert main(["trace", store.uri(), "--steps", "x"]) == 2
    assert "expected A:B" in capsys.readouterr().err
    assert main(["trace", store.uri(), "--steps", "40:50"]) == 1
    assert "no traced step in 40:50" in capsys.readouterr().err


def test_miles_trace_on_a_run_without_one(store, capsys):
    write_status(store, FINISHED, last_step=5, segment=0)
    assert main(["trace", store.uri(), "-o", "/dev/null"]) == 1
    assert "has no trace" in capsys.readouterr().err


def test_swimlane_merges_an_engines_requests_and_names_the_phases(store):
    write_steps(store)
    spans = swimlane_spans(trace.aligned_events(store))
    lanes = {lane for lane, *_ in spans}
    assert lanes == {"engine 10.0.0.2:30000", "trainer", "weight push"}
    engine = sorted((s, e) for lane, _, s, e in spans if lane.startswith("engine"))
    # two overlapping requests make one busy span; the first window's first request ended before it
    assert engine[0] == pytest.approx((-0.3, 0.0)) and all(e - s == pytest.approx(0.5) for s, e in engine[1:])
    assert len(engine) == 5
    phases = {phase for lane, phase, *_ in spans if lane == "trainer"}
    assert phases == {"wait for data", "forward+backward", "optimizer"}
    assert min(s for *_, s, _ in spans) >= -0.5 and max(e for *_, e in spans) <= 5.0 + 1e-6
    fig = swimlane_figure(spans)
    assert fig.layout.title.text == "Timeline of the last 5 steps"
    assert [t.name for t in fig.data] == ["wait for data", "forward+backward", "optimizer", "pause", "generating"]
    assert "Timeline of the last 5 steps" in render_html([], "r", timeline=spans)
    assert swimlane_figure([]) is None

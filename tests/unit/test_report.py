"""The HTML report and its bottleneck reading (miles_core.metrics.report, docs/metrics.md).

Pins: the file is self-contained (plotly.js inline once, no external scripts) and holds the
reward, staleness, queue, throughput, wait-time and eval curves; the queue pinned at 0 reads
rollout-bound and pinned at capacity reads train-bound; `miles report` writes the file.
"""

from __future__ import annotations

import colorsys
import re

import pytest

from miles_core.config import embedded_default, replace_fields
from miles_core.metrics import MetricsSink
from miles_core.metrics.report import diagnose_bottleneck, render_report, write_report
from miles_core.storage import Store
from miles_core.storage.run_root import FINISHED, write_config, write_status

CURVES = ["rollout/reward/mean", "rollout/fully_async/avg_staleness", "rollout/fully_async/queue_size",
          "perf/tokens_per_second", "perf/train_wait_seconds", "perf/producer_blocked_seconds", "eval/heldout"]


def fake_run(run_uri: str, queue: float, steps: int = 20) -> None:
    store = Store(run_uri)
    write_config(store, replace_fields(embedded_default(), rollout_batch_size=4))  # capacity 8
    with MetricsSink(store, "trainer", background=False) as sink:
        for k in range(steps):
            sink.log(k, {"rollout/reward/mean": 0.07 + 0.04 * k, "rollout/fully_async/avg_staleness": 0.5,
                         "rollout/fully_async/queue_size": queue, "perf/tokens_per_second": 900 + k,
                         "perf/train_wait_seconds": 2.0 if queue == 0 else 0.0,
                         "perf/producer_blocked_seconds": 1.5 if queue >= 8 else 0.0})
    with MetricsSink(store, "eval", background=False) as sink:
        for k in range(0, steps, 5):
            sink.log(k, {"eval/heldout": 0.1 * k, "eval/heldout/pass@1": 0.05 * k})
    write_status(store, FINISHED, last_step=steps - 1, segment=0)


def test_report_is_self_contained_with_curves(tmp_path):
    run = f"file://{tmp_path}/run"
    fake_run(run, queue=0)
    path = write_report(run, str(tmp_path / "out" / "report.html"))
    html = open(path, encoding="utf-8").read().replace("\\u002f", "/")  # plotly escapes '/' in JSON
    assert html.startswith("<!DOCTYPE html>")
    assert not re.search(r"<script[^>]+src=", html), "no external scripts: the file must open offline"
    assert html.count("plotly.js v") <= 2 and "Plotly.newPlot" in html  # the library inline, once
    for name in CURVES:
        assert f'"name":"{name}"' in html, name
    assert "Bottleneck: rollout-bound" in html
    assert "finished (segment 0, last step 19)" in html


def test_bottleneck_readings(tmp_path):
    for queue, verdict in ((0, "rollout-bound"), (8, "train-bound"), (4, "balanced")):
        run = f"file://{tmp_path}/run-{queue}"
        fake_run(run, queue=queue)
        assert f"Bottleneck: {verdict}" in render_report(run)
    assert diagnose_bottleneck([], 8).verdict == "unknown"


def test_empty_queue_at_the_staleness_limit_reads_staleness_bound():
    """Pins: an empty queue while consumed groups sit at --max-weight-staleness reads staleness-bound
    (admission control holds the producer back), not rollout-bound. Guards: a report telling users
    to add engines that would sit idle (the embedded default's own situation)."""
    events = [{"step": k, "time": 0.0, "name": n, "value": v} for k in range(20)
              for n, v in (("rollout/fully_async/queue_size", 0.0), ("rollout/fully_async/max_staleness", 2.0))]
    assert diagnose_bottleneck(events, 8, max_staleness=2).verdict == "staleness-bound"
    assert diagnose_bottleneck(events, 8, max_staleness=3).verdict == "rollout-bound"
    assert diagnose_bottleneck(events, 8).verdict == "rollout-bound"


def test_report_of_an_empty_run(tmp_path):
    html = render_report(f"file://{tmp_path}/empty")
    assert "No metrics recorded yet" in html and "Bottleneck: unknown" in html


def test_cli_report(tmp_path, capsys):
    from miles_core.cli import main

    run = f"file://{tmp_path}/run"
    fake_run(run, queue=8)
    out = tmp_path / "r.html"
    assert main(["report", run, "-o", str(out)]) == 0
    assert out.exists() and "train-bound" in out.read_text()


@pytest.mark.s3
def test_report_from_object_storage(storage_root, tmp_path):
    run = storage_root + "/runs/rep"
    fake_run(run, queue=0, steps=6)
    html = open(write_report(run, str(tmp_path / "r.html")), encoding="utf-8").read().replace("\\u002f", "/")
    assert '"name":"rollout/reward/mean"' in html


def test_report_names_failed_samples_and_the_error_that_stopped_the_run(tmp_path):
    """A run whose reward raised on every sample: a `failed samples` row, `reward: none`, and the state row
    with the one line that failed the run (before: 'finished' and no reward row at all)."""
    from miles_core.storage.run_root import FAILED

    run = f"file://{tmp_path}/run"
    store = Store(run)
    write_config(store, replace_fields(embedded_default(), rollout_batch_size=4))
    with MetricsSink(store, "trainer", background=False) as sink:
        for k in range(5):
            sink.log(k, {"rollout/reward_failed": 32.0, "rollout/fully_async/queue_size": 0.0})
    line = ("SampleFailuresError: the reward function (--custom-rm-path) failed on 160 of 160 samples (100%) over "
            "steps 0-4, above --max-failed-sample-fraction=0.5; first: ValueError: no label")
    write_status(store, FAILED, last_step=-1, segment=0, message=line)
    html = render_report(run)
    assert "failed samples (reward)</th><td>160 in 5 of 5 steps (rollout/reward_failed)" in html
    assert "<th>reward</th><td>none: no sample was scored" in html
    assert "failed (segment 0, last step -1): SampleFailuresError: the reward function" in html


def _ev(step: int, name: str, value: float) -> dict:
    return {"step": step, "name": name, "value": value, "component": "trainer", "ts": float(step)}


def test_sparse_per_step_series_break_instead_of_joining_far_points():
    from miles_core.metrics import names as N
    from miles_core.metrics.report import report_figures

    events = [_ev(s, N.AVG_STALENESS, 1.0) for s in (0, 1, 2, 40, 41)] + [_ev(s, N.REWARD, 0.5) for s in range(42)]
    events += [_ev(s, "eval/heldout", 0.3) for s in (19, 39)]
    figs = {f.layout.title.text: f for f in report_figures(events)}
    staleness = next(t for t in figs["Staleness (weight versions)"].data if t.name == N.AVG_STALENESS)
    assert list(staleness.x) == [0, 1, 2, None, 40, 41]  # a gap where steps 3..39 logged nothing
    reward = {t.name: t for t in figs["Reward"].data}
    assert None not in list(reward[N.REWARD].x) and list(reward["eval/heldout"].x) == [19, 39]  # evals stay joined


def test_eval_lengths_get_their_own_axis():
    from miles_core.metrics.report import eval_figure, report_figures

    events = [_ev(s, n, v) for s in (19, 39) for n, v in (("eval/heldout/pass@1", 0.4), ("eval/heldout/response_len/mean", 5.0))]
    figs = {f.layout.title.text: f for f in report_figures(events)}
    assert [t.name for t in figs["Eval"].data] == ["eval/heldout/pass@1"]
    assert [t.name for t in figs["Eval response length"].data] == ["eval/heldout/response_len/mean"]
    assert figs["Eval response length"].layout.yaxis.title.text == "tokens"
    assert [t.name for t in eval_figure(events).data] == ["eval/heldout/pass@1"]


def test_the_swimlane_marks_each_step_and_its_phases_are_far_apart_in_colour():
    from miles_core.metrics.report import SWIMLANE_COLORS, swimlane_figure

    def hue(c):
        return colorsys.rgb_to_hsv(*(int(c[i:i + 2], 16) / 255 for i in (1, 3, 5)))[0] * 360

    spans = [("trainer", f"phase{i}", float(i), i + 0.5) for i in range(8)]
    fig = swimlane_figure(spans, [(7, 0.0), (8, 1.2), (9, 2.5)])
    lines = [s for s in fig.layout.shapes if s.type == "line"]
    assert [s.x0 for s in lines] == [0.0, 1.2, 2.5]
    assert [a.text for a in fig.layout.annotations] == ["step 7", "step 8", "step 9"]
    used = [hue(t.marker.color) for t in fig.data]
    closest = min(min(abs(x - y), 360 - abs(x - y)) for i, x in enumerate(used) for y in used[i + 1:])
    assert closest >= 25, closest  # no two of the first eight phases share a hue
    assert len(set(SWIMLANE_COLORS)) == len(SWIMLANE_COLORS)

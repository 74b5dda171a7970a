"""Mode 3 and the backfill on a real CPU engine process (docs/evaluation.md).

Pins: the eval follower evaluates the eval-step snapshots a (stand-in) trainer writes while it
runs, ignores non-eval snapshots, reports a requested snapshot without its marker as
`eval/skipped_ckpt_missing`, logs each point at the snapshot's own step with `eval/lag_steps`,
and exits once STATUS.json says finished and everything is settled. The backfill over a finished
run evaluates only what has no result yet (unless forced), and returns the table rows and curves
the Flyte workflow publishes.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from miles_core.eval import (
    backfill,
    backfill_plan,
    build_eval_scheduler,
    eval_curves_html,
    evaluate_snapshot,
    follow_snapshots,
)
from miles_core.eval.results import EvalResult, read_result, write_request, write_result
from miles_core.metrics.sink import MetricsSink, read_metrics
from miles_core.models.builtin import materialize_checkpoint
from miles_core.storage import Store
from miles_core.storage.run_root import FINISHED, RUNNING, write_config, write_status
from tests.integration.eval_support import config, copy_snapshot, exporter_from

FOLLOWER_END_SECONDS = 300  # past the follower's own max_seconds (240): it ends itself first


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return materialize_checkpoint("builtin:tiny-gpt", 1, str(tmp_path_factory.mktemp("eval-model") / "m"))


def test_follower_evaluates_snapshots_as_they_land_and_stops_when_finished(tmp_path, model):
    """The follower runs beside a trainer that exports every 2nd step through the EvalScheduler
    (Mode 3); it evaluates steps 1, 3, 5 while they appear, never the non-eval snapshot of step 0,
    and exits with state finished."""
    cfg = config(tmp_path, "--eval-mode", "tasks", "--eval-interval", "2", "--eval-keep-snapshots", "10",
                 "--eval-max-in-flight", "2")
    store = Store(cfg.run_uri)
    write_config(store, cfg)
    write_status(store, RUNNING, last_step=-1, segment=0)
    result = {}
    follower = threading.Thread(target=lambda: result.update(
        follow_snapshots(cfg, poll_seconds=0.2, start_grace_seconds=5, max_seconds=240)))
    follower.start()
    sink = MetricsSink(cfg.run_uri, "eval", background=False)
    sched = build_eval_scheduler(cfg, exporter=exporter_from(model), metrics=sink)
    snaps = store.local_path("snapshots")
    copy_snapshot(model, os.path.join(snaps, "step_00000000"))  # a weight-transport snapshot: not an eval step
    for step in range(6):
        write_status(store, RUNNING, last_step=step, segment=0)
        sched.on_step(step, version=step + 1, last=step == 5)
        time.sleep(0.2)  # the trainer's pace: its snapshots land while the follower runs
    write_request(store, 7, f"{store.uri('snapshots')}/step_00000007", 8)  # requested, never completed
    sched.close()
    sink.close()
    write_status(store, FINISHED, last_step=5, segment=0)
    follower.join(timeout=FOLLOWER_END_SECONDS)
    assert not follower.is_alive()
    assert result["state"] == "finished"
    assert result["evaluated"] == [1, 3, 5]
    assert result["skipped"] == {7: "ckpt_missing"}
    assert read_result(store, 0, "held") is None
    r5 = read_result(store, 5, "held")
    assert r5.weight_version == 6 and r5.mode == "tasks" and r5.lag_steps is not None
    events = {(e["step"], e["name"]) for e in read_metrics(cfg.run_uri, "eval")}
    assert {(1, "eval/held"), (3, "eval/lag_steps"), (5, "eval/held/pass@2"), (7, "eval/skipped_ckpt_missing")} <= events


def finished_run(tmp_path, model):
    cfg = config(tmp_path, "--eval-interval", "2")
    store = Store(cfg.run_uri)
    write_config(store, cfg)
    for step in (1, 3, 5):
        copy_snapshot(model, store.local_path(f"snapshots/step_{step:08d}"))
    copy_snapshot(model, store.local_path("snapshots/step_00000007"), marker=None)
    write_status(store, FINISHED, last_step=5, segment=0)
    write_result(store, EvalResult(step=1, dataset="held", metrics={"eval/held": 0.123}, evaluated_at=123.0))
    return cfg, store


def test_backfill_evaluates_only_missing_steps_unless_forced(tmp_path, model):
    """backfill() over a finished run: complete snapshots without a result get one, the existing
    result of step 1 is left alone, the incomplete step 7 is never evaluated; force re-plans all."""
    cfg, store = finished_run(tmp_path, model)
    assert backfill_plan(cfg.run_uri) == [(3, "held", "builtin:reverse4-heldout"), (5, "held", "builtin:reverse4-heldout")]
    rows = backfill(cfg.run_uri)
    assert sorted(r["step"] for r in rows) == [1, 3, 5]
    assert read_result(store, 1, "held").evaluated_at == 123.0
    assert read_result(store, 3, "held").mode == "backfill"
    assert read_result(store, 7, "held") is None
    assert backfill_plan(cfg.run_uri) == []
    assert [s for s, _, _ in backfill_plan(cfg.run_uri, steps=[1, 5, 7], force=True)] == [1, 5]
    assert "plotly" in eval_curves_html(rows)
    assert {(3, "eval/held"), (5, "eval/lag_steps")} <= {(e["step"], e["name"]) for e in read_metrics(cfg.run_uri, "eval")}


def test_evaluate_snapshot_for_one_map_task_item(tmp_path, model):
    """The map_task item: one snapshot x one dataset with sampling overrides; returns the metrics
    and writes the result (pass@k only up to the n asked for)."""
    cfg, store = finished_run(tmp_path, model)
    metrics = evaluate_snapshot(cfg.run_uri, 3, "other", "builtin:copy4", n_samples=1, temperature=0.0,
                                max_response_len=None)
    assert "eval/other/pass@1" in metrics and "eval/other/pass@2" not in metrics
    assert read_result(store, 3, "other").sampling["n_samples_per_prompt"] == 1
    missing = evaluate_snapshot(cfg.run_uri, 7, "other", "builtin:copy4")
    assert missing == {"eval/skipped_ckpt_missing": 1.0}

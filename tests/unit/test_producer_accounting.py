"""Accounting of producer jobs: `miles runs show` lists them, `miles lineage` names a group's producer,
the step metrics say who generated the batch, the report plots each producer's throughput over time.

The run root is built here by hand: a producer job's writer (`spot-a`) commits four groups, the trainer's
writer two; the trainer rejects one of spot-a's as too stale and trains on the rest over two steps. A
second producer (`spot-b`) joined, committed nothing and went silent (killed).
Guards: a producer's work missing from (or misattributed in) every view, a killed producer shown as
generating, a run without producers growing an empty producer table or plot.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

from miles_core.buffer import DropUnused, DurableBuffer
from miles_core.cli import main
from miles_core.config import parse_flags
from miles_core.elastic import heartbeat as H
from miles_core.metrics import names as N
from miles_core.metrics.report import groups_per_minute, render_report
from miles_core.rollout.drain import ProducerGuardedBuffer, drain_batch
from miles_core.samples import Group, Sample, SampleStatus
from miles_core.storage import Store
from miles_core.storage.run_root import RUNNING, write_config, write_status
from tests.support.small_run import small_run

STALE_ID = "e0-p4-a0-spot-a"


def group(position: int, holder: str, version: int) -> Group:
    gid = f"e0-p{position}-a0-{holder}"
    meta = json.dumps({"epoch": 0, "position": position, "attempt": 0, "writer": holder})
    return Group(gid, position, [Sample(gid, position, j, [1, 2], [3, 4], [-0.1, -0.2], [1, 1], [version, version],
                                        0.5, SampleStatus.COMPLETED, "stop", "{}", meta) for j in range(2)])


def beat(producer_id: str, writer: str, committed: int, started_ago: float, silent_for: float = 0.0,
         state: str = H.GENERATING) -> H.Heartbeat:
    """A heartbeat record as a producer that beat every 30 s (committing 2 groups each) would leave it."""
    now = time.time()
    history = [[now - started_ago + 30 * k, min(2 * k, committed)] for k in range(int(started_ago // 30) + 1)]
    return H.Heartbeat(producer_id, writer, f"{producer_id}.spot.example", now - started_ago, now - silent_for,
                       state=state, engines=2, version=3, groups_committed=committed, groups_rejected=1,
                       tokens=4000, tokens_per_second=123.4, history=history)


def fed_run(tmp_path) -> str:
    cfg = parse_flags(["--preset", "tiny-reverse4", "--storage-root", f"file://{tmp_path}", "--run-id", "r", "--allow-rollout-producers",
                       "--max-weight-staleness", "1"])
    store = Store(cfg.run_uri)
    write_config(store, cfg)
    with DurableBuffer(store, capacity_groups=2, unused_handler=DropUnused(), writer_id="wspot",
                       index_commits=False) as producer:
        for position, version in ((4, 1), (5, 3), (6, 3), (7, 3)):
            producer.put(group(position, "spot-a", version))
    H.write_heartbeat(store, beat("spot-a", "wspot", 4, started_ago=300))
    H.write_heartbeat(store, beat("spot-b", "wspotb", 0, started_ago=900, silent_for=600))
    with DurableBuffer.open(store, capacity_groups=8, unused_handler=DropUnused(), consumed_through_step=-1,
                            max_weight_staleness=1, writer_id="wtrainer") as buf:
        for position in (0, 1):
            buf.put(group(position, "trainer", 3))
        got = [buf.get(current_version=3).group_id for _ in range(4)]  # spot-a's p4 (version 1) is too stale
        buf.record_consumed(0, got[:2])
        buf.record_consumed(1, got[2:])
    write_status(store, RUNNING, last_step=1, segment=0)
    return cfg.run_uri


def test_runs_show_lists_each_producer_with_its_heartbeat_and_what_the_trainer_did_with_its_groups(tmp_path, capsys):
    uri = fed_run(tmp_path)
    assert main(["runs", "show", uri, "--json"]) == 0
    rows = {r["producer_id"]: r for r in json.loads(capsys.readouterr().out)["producers"]}
    assert list(rows) == ["spot-b", "spot-a", "trainer"]  # by start time, the run's own rollout last
    a = rows["spot-a"]
    assert (a["host"], a["groups_committed"], a["groups_consumed"], a["groups_rejected_at_get"]) == \
        ("spot-a.spot.example", 4, 3, 1)
    assert a["tokens_per_second"] == 123.4 and a["started_at"] < a["heartbeat_at"] and a["silent_seconds"] is None
    assert rows["spot-b"]["groups_consumed"] == 0 and rows["spot-b"]["silent_seconds"] >= 600
    assert (rows["trainer"]["groups_consumed"], rows["trainer"]["groups_rejected_at_get"]) == (1, 0)
    assert main(["runs", "show", uri]) == 0
    text = capsys.readouterr().out
    assert "producers    2 joined" in text and "spot-b.spot.example  generating (silent" in text
    line = next(x for x in text.splitlines() if x.strip().startswith("spot-a"))
    assert line.split()[-4:] == ["4", "3", "1", "123.4"]


def test_lineage_names_the_producer_of_a_group(tmp_path, capsys):
    uri = fed_run(tmp_path)
    assert main(["lineage", uri, STALE_ID, "--json"]) == 0
    t = json.loads(capsys.readouterr().out)
    assert t["generated_by"] == {"producer_id": "spot-a", "host": "spot-a.spot.example"}
    assert t["fate"]["outcome"] == "rejected"
    assert main(["lineage", uri, "e0-p0-a0-trainer"]) == 0
    assert "generated    by the run's own rollout" in capsys.readouterr().out
    assert main(["lineage", uri, "e0-p5-a0-spot-a"]) == 0
    assert "generated    by producer job spot-a (host spot-a.spot.example)" in capsys.readouterr().out


def test_a_run_without_producers_shows_none(tmp_path, capsys):
    run = small_run(tmp_path)
    assert main(["runs", "show", run.uri, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["producers"] == []
    assert main(["runs", "show", run.uri]) == 0
    assert "producers    none" in capsys.readouterr().out
    assert main(["lineage", run.uri, run.trained[1]]) == 0
    assert "by the run's own rollout" in capsys.readouterr().out
    assert "Generation throughput per producer" not in render_report(run.uri)


def test_the_report_plots_each_producers_throughput_over_time(tmp_path):
    html = render_report(fed_run(tmp_path)).replace("\\u002f", "/")
    assert "Generation throughput per producer job" in html and "groups committed / minute" in html
    assert '"name":"spot-a"' in html and '"name":"spot-b"' in html


def test_throughput_is_groups_committed_per_minute_over_windows():
    history = [[0.0, 0], [30.0, 1], [60.0, 10], [90.0, 12], [120.0, 30]]
    assert groups_per_minute(history) == ([60.0, 120.0], [10.0, 20.0])
    assert groups_per_minute([[0.0, 0], [10.0, 4]]) == ([10.0], [24.0])  # shorter than a window: half its span
    assert groups_per_minute([[5.0, 1]]) == ([], [])


def test_a_heartbeat_history_spans_the_producers_whole_life():
    """Guards: a long-lived producer whose report shows only its last hour."""
    b = H.Heartbeat.start("p", "w")
    for k in range(2000):
        b = dataclasses.replace(b, groups_committed=k).update()
    assert len(b.history) <= H.HISTORY_POINTS and b.history[0][1] == 0 and b.history[-1][1] == 1999


class _Worker:
    error = None

    def on_error(self, _callback) -> None:
        pass


def test_step_metrics_say_which_producers_generated_the_batch(tmp_path):
    store = Store(f"file://{tmp_path}/run")
    with DurableBuffer(store, capacity_groups=4, unused_handler=DropUnused(), writer_id="wspot",
                       index_commits=False) as producer:
        for position, holder in ((2, "spot-a"), (3, "spot-a"), (4, "spot-b")):
            producer.put(group(position, holder, 1))
    with DurableBuffer.open(store, capacity_groups=8, unused_handler=DropUnused(), consumed_through_step=-1,
                            writer_id="wtrainer") as buf:
        buf.put(group(0, "trainer", 1))
        batch = asyncio.run(drain_batch(ProducerGuardedBuffer(buf, _Worker()), 4, current_version=1))
    m = batch.metrics
    assert (m[N.PRODUCERS_CONSUMED_GROUPS], m[N.PRODUCERS_COUNT]) == (3, 2)
    assert m["rollout/producers/spot-a/consumed_groups"] == 2 and m["rollout/producers/spot-b/consumed_groups"] == 1


def test_a_run_without_claims_logs_no_producer_metrics(tmp_path):
    run = small_run(tmp_path)
    with DurableBuffer.open(Store(run.uri), capacity_groups=8, unused_handler=DropUnused(),
                            consumed_through_step=1) as buf:
        batch = asyncio.run(drain_batch(ProducerGuardedBuffer(buf, _Worker()), 1, current_version=None))
    assert not [k for k in batch.metrics if k.startswith("rollout/producers/")]

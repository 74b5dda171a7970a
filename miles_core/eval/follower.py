"""The eval_follower body (docs/evaluation.md Mode 3): evaluate snapshots while the run trains.

`follow_snapshots(cfg)` runs beside the train task. It polls the snapshot root and the eval
requests the trainer's EvalScheduler writes (eval/requests/step_k.json), evaluates each eval
step whose snapshot is complete on one engine it starts and re-pins per snapshot, writes
eval/step_{k:08d}/{ds}.json, and logs the metrics at the snapshot's own step with
`eval/lag_steps` = latest trained step at write time − snapshot step. Eval steps are the
requested ones, complete snapshots on the --eval-interval cadence (the snapshot root may also
hold the weight-transport snapshots of every step), and the run's last step.

It stops when STATUS.json has left `running` (finished, failed or segment_done) and every eval
step with a complete snapshot is settled. A STATUS that is already terminal when the follower
starts may be the previous segment's: the follower waits up to `start_grace_seconds` for the new
segment to announce itself before believing it. While it runs it keeps a heartbeat
(eval/follower_heartbeat.json); the trainer's scheduler applies --eval-max-in-flight backpressure
only while that heartbeat is fresh.
"""

from __future__ import annotations

import logging
import threading
import time

from miles_core.eval.datasets import load_eval_datasets, sampling_from_config
from miles_core.eval.local_engine import SnapshotEvaluator
from miles_core.eval.results import HEARTBEAT_KEY, SKIPPED_NAME, evaluated, record_skip, requests, write_heartbeat
from miles_core.eval.snapshots import SnapshotLayout, on_cadence, retire_snapshots
from miles_core.metrics import trace
from miles_core.metrics.sink import MetricsSink
from miles_core.storage import Store
from miles_core.storage.run_root import read_status

log = logging.getLogger(__name__)


def follow_snapshots(cfg, *, run_uri: str | None = None, poll_seconds: float = 5.0,
                     start_grace_seconds: float = 600.0, max_seconds: float | None = None,
                     metrics=None) -> dict:
    """Evaluate snapshots as they land until the run stops; returns a summary dict.

    `metrics`: a sink with log(step, dict); default MetricsSink(run root, "eval").
    `start_grace_seconds`: how long a STATUS that is already terminal at start may be the previous
    segment's (pass 0 when train is known to have run already, as in a local workflow run).
    `max_seconds`: give up after this long (None: never).
    """
    run_uri = run_uri or cfg.run_uri
    store = Store(run_uri)
    layout = SnapshotLayout.from_config(cfg, run_uri)
    datasets = load_eval_datasets(cfg, run_uri=run_uri)
    names = {d.name for d in datasets}
    own_sink = metrics is None
    sink = MetricsSink(store, "eval") if own_sink else metrics
    t0 = time.monotonic()
    initial = read_status(store)
    started = initial is not None and initial.active
    summary = {"evaluated": [], "skipped": {}, "state": None, "seconds": 0.0}
    heartbeat = _Heartbeat(store, poll_seconds)
    own_trace = not trace.enabled()
    if own_trace:
        trace.configure_from(cfg.metrics, store, "eval-follower")
    try:
        with SnapshotEvaluator(cfg, store=store, layout=layout, datasets=datasets,
                               sampling=sampling_from_config(cfg), metrics=sink, mode="tasks") as evaluator:
            while True:
                status = read_status(store)  # read before listing: a terminal status covers every snapshot listed after it
                if not started:
                    changed = status is not None and (initial is None or status.updated_at != initial.updated_at)
                    started = (status is not None and status.active) or changed or \
                        time.monotonic() - t0 > start_grace_seconds
                terminal = started and status is not None and not status.active
                todo, incomplete_requested = _todo(store, layout, cfg.eval.eval_interval, names, status, terminal)
                for step in incomplete_requested:
                    record_skip(store, step, "ckpt_missing", f"{layout.uri(step)} has no completion marker", sink)
                    summary["skipped"][step] = "ckpt_missing"
                for step, version in todo:
                    latest = read_status(store)
                    with trace.span("eval", lane="eval", step=step):
                        out = evaluator.evaluate(step, version, latest_step=latest.last_step if latest else step)
                    if out.skipped:
                        summary["skipped"][step] = out.skipped
                    else:
                        summary["evaluated"].append(step)
                    _retire(store, layout, cfg, names)
                if terminal and not todo:
                    summary["state"] = status.state
                    break
                if max_seconds is not None and time.monotonic() - t0 > max_seconds:
                    summary["state"] = "timeout"
                    log.warning("eval follower stopped after %.0f s (max_seconds)", max_seconds)
                    break
                if not todo:
                    time.sleep(poll_seconds)
    finally:
        heartbeat.stop()
        if own_sink:
            sink.close()
        if own_trace:
            trace.shutdown()
    summary["seconds"] = time.monotonic() - t0
    return summary


class _Heartbeat:
    """Writes eval/follower_heartbeat.json every few seconds from a thread (also while a long eval
    runs), so the trainer's scheduler knows an evaluator is there to wait for."""

    def __init__(self, store: Store, every_seconds: float):
        self.store, self.every = store, max(1.0, min(every_seconds, 10.0))
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._run, name="eval-follower-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        try:
            write_heartbeat(self.store)
        except Exception as e:  # noqa: BLE001 - a missed beat only relaxes the trainer's backpressure
            log.warning("eval follower heartbeat failed: %s", e)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._beat()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self.store.delete(HEARTBEAT_KEY)  # gone: the trainer stops waiting at once
        except Exception:  # noqa: BLE001
            pass


def _todo(store: Store, layout: SnapshotLayout, interval: int | None, names: set[str], status,
          terminal: bool) -> tuple[list[tuple[int, int | None]], list[int]]:
    """([(step, version)] to evaluate now, [requested steps whose snapshot is incomplete at the end])."""
    complete = set(layout.complete_steps())
    reqs = requests(store)
    done = {s for s, have in evaluated(store).items() if SKIPPED_NAME in have or names <= have}
    wanted = set(reqs) | {s for s in complete if on_cadence(s, interval)}
    if terminal and status.last_step >= 0 and status.last_step in complete:
        wanted.add(status.last_step)
    todo = [(s, (reqs.get(s) or {}).get("weight_version")) for s in sorted(wanted - done) if s in complete]
    # A request is written after its snapshot was seen complete, so an incomplete one was deleted
    # or damaged; report it once the run has stopped (until then a slow store may still show it).
    missing = sorted(s for s in set(reqs) - done - complete) if terminal else []
    return todo, missing


def _retire(store: Store, layout: SnapshotLayout, cfg, names: set[str]) -> None:
    if not layout.exports:
        return
    try:
        complete = layout.complete_steps()
        done = {s for s, have in evaluated(store).items() if SKIPPED_NAME in have or names <= have}
        wanted = set(requests(store)) | {s for s in complete if on_cadence(s, cfg.eval.eval_interval)}
        pending = {s for s in complete if s in wanted and s not in done}
        retire_snapshots(layout, cfg.eval.eval_keep_snapshots, pending, protected_uris=(cfg.model.hf_checkpoint,))
    except Exception as e:  # noqa: BLE001 - housekeeping
        log.warning("snapshot retirement failed: %s", e)

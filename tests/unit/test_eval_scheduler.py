"""EvalScheduler policy and snapshot retirement (docs/evaluation.md), with a stand-in mode and a stand-in
exporter on a file:// run root: cadence, the in-flight limit with both overflow policies, the
forced final eval, every failure as `eval/skipped_{reason}` (never an exception into training),
and ring retirement that keeps exactly the right directories.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time

from miles_core.eval.modes import EvalContext, Outcome, SnapshotTasks
from miles_core.eval.results import HEARTBEAT_KEY, EvalResult, requests, write_heartbeat, write_result
from miles_core.eval.scheduler import EvalScheduler
from miles_core.eval.snapshots import SnapshotLayout, on_cadence, retire_snapshots
from miles_core.storage import Store

BACKPRESSURE_SECONDS = 0.3  # how long a step waits for an eval slot before it skips (kept short: most tests skip)
SLOT_WAIT_SECONDS = 5.0  # a backpressure wait long enough for the slot the test frees after 0.2 s


class Sink:
    def __init__(self):
        self.events: list[tuple[int, dict]] = []

    def log(self, step, metrics):
        self.events.append((step, dict(metrics)))

    def names_at(self, step):
        return {n for s, m in self.events if s == step for n in m}


class FakeMode:
    """Records jobs; the test settles them by completing the futures."""

    def __init__(self):
        self.jobs, self.futures = [], {}

    def start(self, job):
        f = concurrent.futures.Future()
        self.jobs.append(job)
        self.futures[job.step] = f
        return f

    def finish(self, step):
        self.futures[step].set_result(Outcome(step, {"eval/x": 1.0}))


def write_snapshot(root: str, step: int, marker: str | None = ".complete") -> None:
    d = os.path.join(root, f"step_{step:08d}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(b"w")
    if marker:
        open(os.path.join(d, marker), "wb").close()


def make_scheduler(tmp_path, mode=None, *, interval=3, max_in_flight=2, policy="skip", keep=2, exporter="ok",
                   layout=None, timeout=BACKPRESSURE_SECONDS, sink=None):
    run = str(tmp_path / "run")
    layout = layout or SnapshotLayout(f"file://{run}/snapshots", "export")
    if exporter == "ok":
        def exporter(step, uri):
            write_snapshot(uri[len("file://"):].rsplit("/", 1)[0], step)
    return EvalScheduler(store=Store(run), layout=layout, datasets=[], sampling=None, eval_interval=interval,
                         max_in_flight=max_in_flight, overflow_policy=policy, keep_snapshots=keep,
                         backpressure_timeout_seconds=timeout, mode=mode or FakeMode(), exporter=exporter,
                         metrics=sink if sink is not None else Sink(), poll_seconds=0.02)


def steps_on_disk(root) -> list[int]:
    if not os.path.isdir(root):
        return []
    return sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("step_"))


def test_lost_segment_snapshot_and_results_are_replaced(tmp_path):
    """A snapshot and results for a step this segment is only now reaching come from a segment
    that crashed later and was resumed from an earlier checkpoint (other weights): the scheduler
    removes both, exports afresh and evaluates again, instead of trusting the stale marker."""
    mode = FakeMode()
    calls = []

    def exporter(step, uri):
        calls.append(step)
        write_snapshot(uri[len("file://"):].rsplit("/", 1)[0], step)

    s = make_scheduler(tmp_path, mode, exporter=exporter)
    run = tmp_path / "run"
    write_snapshot(str(run / "snapshots"), 2)
    with open(run / "snapshots" / "step_00000002" / "stale.bin", "wb") as f:
        f.write(b"old")
    write_result(Store(str(run)), EvalResult(step=2, dataset="held", metrics={"eval/held": 0.9}))
    s.on_step(2, 3)
    assert calls == [2] and [j.step for j in mode.jobs] == [2]
    assert not (run / "snapshots" / "step_00000002" / "stale.bin").exists()
    assert not (run / "eval" / "step_00000002").exists()


def test_cadence_and_final_step(tmp_path):
    """Evals happen at every --eval-interval steps (k+1 multiple of the interval) and always at
    the last step, once each, exporting the snapshot first (eval/export_seconds at that step)."""
    mode, sink = FakeMode(), Sink()
    s = make_scheduler(tmp_path, mode, max_in_flight=10, sink=sink)
    for step in range(8):
        s.on_step(step, version=step + 1, last=step == 7)
        if step in mode.futures:
            mode.finish(step)
    assert [j.step for j in mode.jobs] == [2, 5, 7]
    assert [j.version for j in mode.jobs] == [3, 6, 8]
    assert mode.jobs[0].snapshot_uri.endswith("/snapshots/step_00000002")
    assert "eval/export_seconds" in sink.names_at(2)
    assert on_cadence(9, 5) and not on_cadence(5, 5) and not on_cadence(3, None)


def test_skip_policy_counts_busy_but_final_step_always_runs(tmp_path):
    """--eval-overflow-policy=skip: with --eval-max-in-flight evals pending, a cadence step is
    skipped as eval/skipped_busy; the last step is evaluated anyway."""
    mode, sink = FakeMode(), Sink()
    s = make_scheduler(tmp_path, mode, max_in_flight=1, policy="skip", sink=sink)
    for step in range(9):
        s.on_step(step, version=step, last=step == 8)
    assert [j.step for j in mode.jobs] == [2, 8]
    assert "eval/skipped_busy" in sink.names_at(5)
    assert s.pending_steps == [2, 8]
    mode.finish(2)
    mode.finish(8)
    assert s.wait(1.0)


def test_backpressure_waits_for_a_slot_then_gives_up(tmp_path):
    """backpressure: the step waits until a pending eval settles; past the timeout it is skipped
    as busy instead of hanging training."""
    mode, sink = FakeMode(), Sink()
    s = make_scheduler(tmp_path, mode, max_in_flight=1, policy="backpressure", sink=sink, timeout=SLOT_WAIT_SECONDS)
    s.on_step(2, 1)
    threading.Timer(0.2, mode.finish, args=(2,)).start()
    t0 = time.monotonic()
    s.on_step(5, 2)
    assert 0.1 < time.monotonic() - t0 < 4.0
    assert [j.step for j in mode.jobs] == [2, 5]
    s.backpressure_timeout_seconds = 0.2
    s.on_step(8, 3)  # 5 never finishes
    assert "eval/skipped_busy" in sink.names_at(8)
    assert [j.step for j in mode.jobs] == [2, 5]


def test_export_failure_and_missing_marker_are_metrics(tmp_path):
    """An exporter that raises gives eval/skipped_export_failed; one that leaves no completion
    marker gives eval/skipped_ckpt_missing. Neither raises into the training loop."""
    mode, sink = FakeMode(), Sink()

    def broken(step, uri):
        raise OSError("disk full")

    s = make_scheduler(tmp_path, mode, exporter=broken, sink=sink)
    s.on_step(2, 1)
    assert "eval/skipped_export_failed" in sink.names_at(2)

    def no_marker(step, uri):
        write_snapshot(uri[len("file://"):].rsplit("/", 1)[0], step, marker=None)

    s.exporter = no_marker
    s.on_step(5, 2)
    assert "eval/skipped_ckpt_missing" in sink.names_at(5)
    assert mode.jobs == []


def test_reuse_mode_reads_save_hf_checkpoints_and_never_deletes_them(tmp_path):
    """Reuse mode (--save-hf): no export; the eval reads the saved HF checkpoint of the step (its
    COMPLETE marker required, else eval/skipped_ckpt_missing); retirement never deletes one."""
    hf = tmp_path / "hf"
    layout = SnapshotLayout.for_save_hf(str(hf), str(tmp_path / "run"))
    mode, sink = FakeMode(), Sink()
    s = make_scheduler(tmp_path, mode, layout=layout, exporter=None, keep=0, max_in_flight=10, sink=sink)
    for step in (1, 3, 5, 7):
        write_snapshot(str(hf), step, marker="COMPLETE")
    for step in range(8):
        s.on_step(step, version=step, last=step == 7)
        if step in mode.futures:
            mode.finish(step)
    assert [j.step for j in mode.jobs] == [5, 7]  # 2 has no checkpoint: skipped
    assert "eval/skipped_ckpt_missing" in sink.names_at(2)
    assert mode.jobs[0].snapshot_uri == f"file://{hf}/step_00000005"
    s.close()
    assert steps_on_disk(hf) == [1, 3, 5, 7]


def test_save_hf_step_template(tmp_path):
    layout = SnapshotLayout.for_save_hf(str(tmp_path / "hf" / "iter_{step:07d}"), "unused")
    assert layout.uri(12).endswith("/hf/iter_0000012")
    assert layout.step_of("iter_0000012") == 12 and layout.step_of("step_00000012") is None


def test_ring_retirement_keeps_exactly_the_right_directories(tmp_path):
    """Ring retirement keeps pending snapshots, the newest `keep` settled ones (the newest
    complete one always), the initial model, and newer incomplete exports in progress; it deletes
    older settled snapshots and leftovers of failed exports."""
    root = tmp_path / "snaps"
    for step in range(1, 8):
        write_snapshot(str(root), step)
    write_snapshot(str(root), 0)  # the initial model, exported under the root
    os.remove(root / "step_00000004" / ".complete")  # a failed export (older than the newest)
    write_snapshot(str(root), 9, marker=None)  # an export in progress
    layout = SnapshotLayout(f"file://{root}", "export")
    initial = (f"file://{root}/step_00000000",)
    deleted = retire_snapshots(layout, keep=2, pending={2}, protected_uris=initial)
    assert steps_on_disk(root) == [0, 2, 6, 7, 9]
    assert deleted == [1, 3, 4, 5]
    assert retire_snapshots(layout, keep=0, pending=set(), protected_uris=initial) == [2, 6]  # newest (7) stays
    assert steps_on_disk(root) == [0, 7, 9]


def test_scheduler_retires_after_evals_settle(tmp_path):
    """Snapshots of pending evals survive; once they settle the ring keeps --eval-keep-snapshots."""
    mode = FakeMode()
    s = make_scheduler(tmp_path, mode, interval=1, max_in_flight=10, keep=1)
    root = tmp_path / "run" / "snapshots"
    for step in range(4):
        s.on_step(step, step)
    assert steps_on_disk(root) == [0, 1, 2, 3]  # all pending
    for step in range(4):
        mode.finish(step)
    s.close()
    assert steps_on_disk(root) == [3]


def test_tasks_mode_writes_requests_and_settles_on_results(tmp_path):
    """Mode 3: the scheduler asks the follower through eval/requests/step_k.json and counts the
    step in flight until results for every dataset (or a skip) exist. The in-flight limit holds
    only while a follower heartbeat is fresh: with no follower (a local workflow runs train
    before eval_follower) requests pile up instead of stalling training."""
    run = tmp_path / "run"
    store = Store(str(run))
    ds = [type("D", (), {"name": "held"})()]
    ctx = EvalContext(store=store, datasets=ds, sampling=None, metrics=None, latest_step=lambda: 0)
    s = make_scheduler(tmp_path, SnapshotTasks(ctx), max_in_flight=1, policy="skip")
    s.datasets = ds
    write_heartbeat(store)
    s.on_step(2, 7)
    assert requests(store)[2]["weight_version"] == 7
    assert s.pending_steps == [2]
    s.on_step(5, 8)  # busy: the follower has not answered
    assert sorted(requests(store)) == [2]
    write_result(store, EvalResult(step=2, dataset="held", metrics={"eval/held": 1.0}))
    s.on_step(8, 9)
    assert sorted(requests(store)) == [2, 8]
    assert s.pending_steps == [8]
    store.delete(HEARTBEAT_KEY)  # the follower is gone
    s.on_step(11, 10)
    assert sorted(requests(store)) == [2, 8, 11]
    assert s.pending_steps == [8, 11]


def test_shared_mode_always_resumes_submission(tmp_path):
    """Mode 1: submission is resumed after the eval even when the eval fails (engine down:
    eval/skipped_unhealthy) or the pause hook itself raises (eval/skipped_crashed); training gets
    neither exception."""
    from miles_core.config import parse_flags
    from miles_core.engines.launcher import free_port
    from miles_core.eval import build_eval_scheduler

    cfg = parse_flags(["--preset", "tiny-reverse4", "--storage-root", str(tmp_path), "--eval-prompt-data", "h=builtin:reverse4-heldout",
                       "--eval-max-prompts", "2", "--eval-mode", "shared", "--eval-interval", "1"])
    calls, sink = [], Sink()

    def pause():
        calls.append("pause")
        if len(calls) > 2:
            raise RuntimeError("producer gone")

    sched = build_eval_scheduler(cfg, exporter=None, metrics=sink, shared_engine_urls=[f"http://127.0.0.1:{free_port()}"],
                                 pause_submission=pause, resume_submission=lambda: calls.append("resume"))
    sched.on_step(0, 1)
    sched.on_step(1, 2, last=True)
    sched.close()
    assert calls == ["pause", "resume", "pause", "resume"]
    assert "eval/skipped_unhealthy" in sink.names_at(0)
    assert "eval/skipped_crashed" in sink.names_at(1)


def test_tasks_mode_retirement_keeps_snapshots_the_follower_still_owes(tmp_path):
    """A snapshot requested by an earlier segment and not yet evaluated is pending for the ring,
    even though this scheduler never started it; evaluated or unrequested ones beyond
    --eval-keep-snapshots go (the newest complete one stays)."""
    run = tmp_path / "run"
    store = Store(str(run))
    ds = [type("D", (), {"name": "held"})()]
    ctx = EvalContext(store=store, datasets=ds, sampling=None, metrics=None, latest_step=lambda: 0)
    s = make_scheduler(tmp_path, SnapshotTasks(ctx), keep=0)
    s.datasets = ds
    root = run / "snapshots"
    for step in (2, 5, 8, 11):
        write_snapshot(str(root), step)
    from miles_core.eval.results import write_request

    write_request(store, 2, "", 3)
    write_request(store, 5, "", 6)
    write_result(store, EvalResult(step=5, dataset="held", metrics={}))
    assert s.retire() == [5, 8]
    assert steps_on_disk(root) == [2, 11]


def test_snapshots_on_object_storage_are_fetched_to_a_local_dir(tmp_path):
    """On a non-file store the snapshot is listed through its marker and downloaded for the engine
    (engines load from a filesystem path); an unmarked directory is not complete."""
    import uuid

    from miles_core.storage.node_local import localize

    root = f"memory://eval-{uuid.uuid4().hex[:8]}/snapshots"
    store = Store(root)
    store.put_bytes("step_00000004/config.json", b"{}")
    store.put_bytes("step_00000004/model.safetensors", b"w")
    store.put_bytes("step_00000004/.complete", b"")
    store.put_bytes("step_00000006/config.json", b"{}")
    layout = SnapshotLayout(root, "export")
    assert layout.scan() == ([4], [6])
    local = localize(layout.uri(4), "snapshots", required=".complete")
    assert sorted(os.listdir(local)) == [".complete", ".miles-complete", "config.json", "model.safetensors"]

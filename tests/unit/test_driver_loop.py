"""The driver loop and the roles that own their cadence (docs/fully-async.md), with recording stand-ins.

Pins: `run_loop` calls the roles in the order of the sequence diagram (batch, train, prefetch
wait, push, checkpoint, eval, metrics, progress), stops at `end_step`, and at an expired deadline
it finishes the step as the last one (last=True to weights, checkpoints and evals) and says why it
stopped; every step's metrics (train, batch, push, source, perf/step_seconds) are logged.
`WeightPusher` pushes every `interval` steps and at the last step, then publishes the version to
the rollout side (and the engine fleet) without waiting for it (a failure is raised at the next push).
`Checkpointer` records the consumed group ids every step (the buffer's exactly-once record), writing
step k's record while step k+1 trains (waited for before the next record, a checkpoint and the last
step), and saves on its cadence and at the last step only.
`PrefetchedBatches` asks for batch k+1 before training on k, against the version k+1 will be
trained under. Guards against modes re-checked in the loop, a last step without a save, and
consumption recorded only on save steps (groups trained twice after a resume).
"""

from __future__ import annotations

import concurrent.futures

import pytest

from miles_core.driver.loop import Batch, run_loop
from miles_core.driver.roles import (
    Checkpointer,
    Deadline,
    MetricsLog,
    OnDemandBatches,
    PrefetchedBatches,
    Roles,
    WeightPusher,
    batch_source,
)


def done(value=None) -> concurrent.futures.Future:
    f: concurrent.futures.Future = concurrent.futures.Future()
    f.set_result(value)
    return f


class FakeHandle:
    """A rollout or trainer handle: records every call, answers from `answers` (value or callable)."""

    def __init__(self, log: list, name: str, **answers):
        self.log, self.name, self.answers = log, name, answers
        self.calls: list[tuple] = []

    def call(self, method: str, *args) -> concurrent.futures.Future:
        self.calls.append((method, *args))
        self.log.append(f"{self.name}.{method}")
        answer = self.answers.get(method)
        return done(answer(*args) if callable(answer) else answer)


class Recorder:
    """Stand-ins for every role; `log` holds the calls in order, with their step and last flag."""

    def __init__(self):
        self.log: list[tuple] = []

    def batches(self):
        rec = self

        class Batches:
            def next_batch(self, step):
                rec.log.append(("next_batch", step))
                return Batch(step, [], [f"g{step}-{i}" for i in range(2)], {"rollout/reward/mean": 0.5})

            def before_weight_update(self, last=False):
                rec.log.append(("before_weight_update",))

            def metrics(self):
                return {"source/metric": 1.0}

        return Batches()

    def trainer(self):
        rec = self

        class Trainer:
            def train_step(self, step, batch):
                rec.log.append(("train_step", step, tuple(batch.group_ids)))
                return {"train/loss": float(step)}

        return Trainer()

    def weights(self):
        rec = self

        class Weights:
            def push(self, step, last=False):
                rec.log.append(("push", step, last))
                return step + 2, {"perf/weight_update_seconds": 0.1}

        return Weights()

    def checkpoints(self):
        rec = self

        class Checkpoints:
            def save(self, step, consumed, version, last):
                rec.log.append(("save", step, tuple(consumed), version, last))

        return Checkpoints()

    def evals(self):
        rec = self

        class Evals:
            def on_step(self, step, version, last=False):
                rec.log.append(("eval", step, version, last))

        return Evals()

    def progress(self):
        rec = self

        class Progress:
            def update(self, step, metrics):
                rec.log.append(("progress", step))

        return Progress()


class ListSink:
    def __init__(self):
        self.events = []

    def log(self, step, metrics):
        self.events.append((step, dict(metrics)))


class StepDeadline:
    """Expires once `expired()` has been asked `after` times (the loop asks once per step)."""

    def __init__(self, after: int):
        self.after, self.asked = after, 0

    def expired(self) -> bool:
        self.asked += 1
        return self.asked >= self.after


def build_roles(rec: Recorder, start=0, end=3, deadline=None, end_reason="num_rollout"):
    sink = ListSink()
    roles = Roles(driver="fully-async", start_step=start, end_step=end, end_reason=end_reason,
                  batches=rec.batches(), trainer=rec.trainer(), weights=rec.weights(),
                  checkpoints=rec.checkpoints(), evals=rec.evals(), metrics=MetricsLog(sink),
                  progress=rec.progress(), deadline=deadline or Deadline(None))
    return roles, sink


def test_loop_calls_roles_in_sequence_diagram_order():
    """Each step: batch, train, prefetch wait, push, checkpoint (with the batch's ids), eval, progress."""
    rec = Recorder()
    roles, _ = build_roles(rec, end=2)
    run_loop(roles)
    per_step = lambda s, last: [  # noqa: E731
        ("next_batch", s), ("train_step", s, (f"g{s}-0", f"g{s}-1")), ("before_weight_update",),
        ("push", s, last), ("save", s, (f"g{s}-0", f"g{s}-1"), s + 2, last), ("eval", s, s + 2, last),
        ("progress", s)]
    assert rec.log == per_step(0, False) + per_step(1, True)


def test_loop_runs_from_start_step_to_end_step_exclusive():
    rec = Recorder()
    roles, _ = build_roles(rec, start=2, end=5, end_reason="segment_steps")
    result = run_loop(roles)
    assert [e[1] for e in rec.log if e[0] == "train_step"] == [2, 3, 4]
    assert [e[2] for e in rec.log if e[0] == "push"] == [False, False, True]  # last only at end_step - 1
    assert (result.first_step, result.last_step, result.steps_run, result.stopped_by) == (2, 4, 3, "segment_steps")


def test_loop_with_no_steps_left_runs_nothing():
    rec = Recorder()
    roles, _ = build_roles(rec, start=3, end=3)
    result = run_loop(roles)
    assert rec.log == [] and result.steps_run == 0 and result.last_step is None


def test_deadline_makes_the_current_step_the_last_one():
    """An expired deadline ends the segment cleanly: that step pushes, saves and evaluates with last=True."""
    rec = Recorder()
    roles, _ = build_roles(rec, end=10, deadline=StepDeadline(after=2))
    result = run_loop(roles)
    assert [e[1] for e in rec.log if e[0] == "train_step"] == [0, 1]
    assert [e for e in rec.log if e[0] in ("push", "save", "eval") and e[1] == 1] == [
        ("push", 1, True), ("save", 1, ("g1-0", "g1-1"), 3, True), ("eval", 1, 3, True)]
    assert not any(e[-1] for e in rec.log if e[0] in ("push", "save", "eval") and e[1] == 0)
    assert (result.last_step, result.steps_run, result.stopped_by) == (1, 2, "deadline")


def test_already_expired_deadline_still_trains_one_step_and_saves_it():
    rec = Recorder()
    roles, _ = build_roles(rec, start=4, end=10, deadline=Deadline(0.0))
    result = run_loop(roles)
    assert [e for e in rec.log if e[0] == "save"] == [("save", 4, ("g4-0", "g4-1"), 6, True)]
    assert (result.steps_run, result.stopped_by) == (1, "deadline")


def test_deadline_expiring_at_the_last_step_reports_the_normal_end():
    rec = Recorder()
    roles, _ = build_roles(rec, end=2, deadline=StepDeadline(after=2))
    assert run_loop(roles).stopped_by == "num_rollout"


def test_every_step_logs_train_batch_push_source_and_step_time_metrics():
    rec = Recorder()
    roles, sink = build_roles(rec, end=3)
    run_loop(roles)
    assert [step for step, _ in sink.events] == [0, 1, 2]
    for step, m in sink.events:
        assert m["train/loss"] == float(step)
        assert m["rollout/reward/mean"] == 0.5 and m["source/metric"] == 1.0
        assert m["perf/weight_update_seconds"] == 0.1
        assert m["perf/step_seconds"] >= 0.0
    assert [h["step"] for h in roles.metrics.history] == [0, 1, 2]


# ----------------------------------------------------------------------------- WeightPusher


def pusher(interval: int):
    log: list = []
    versions = iter(range(2, 100))
    trainer = FakeHandle(log, "trainer", push_weights=lambda step, wait: {"version": next(versions),
                                                                           "perf/weight_update_seconds": 0.2})
    rollout = FakeHandle(log, "rollout")
    box = [1]
    return WeightPusher(trainer, rollout, interval, box), trainer, rollout, box


def test_weight_pusher_pushes_every_interval_and_at_the_last_step():
    wp, trainer, rollout, box = pusher(interval=3)
    out = [wp.push(step, last=step == 7) for step in range(8)]
    assert [c[1:] for c in trainer.calls] == [(2, True), (5, True), (7, True)]  # (step + 1) % 3 == 0, the last step
    assert rollout.calls == [("set_version", 2), ("set_version", 3), ("set_version", 4)]
    assert [v for v, _ in out] == [1, 1, 2, 2, 2, 3, 3, 4] and box == [4]
    assert out[0][1] == {} and out[2][1] == {"perf/weight_update_seconds": 0.2, "rollout/published_version": 2}


def test_weight_pusher_publishes_to_rollout_after_the_trainer_pushed():
    wp, trainer, rollout, _ = pusher(interval=1)
    wp.push(0)
    assert trainer.log == ["trainer.push_weights", "rollout.set_version"]


def test_an_overlapping_pusher_waits_only_on_the_last_step_and_leaves_publishing_to_the_trainer():
    """Under the fully async driver the trainer delivers to the engines while the next step trains and
    publishes the version itself ("published"): the driver must not publish it before the engines serve it."""
    log: list = []
    trainer = FakeHandle(log, "trainer", push_weights=lambda step, wait: {"version": step + 2, "published": True})
    rollout = FakeHandle(log, "rollout")
    box = [1]
    wp = WeightPusher(trainer, rollout, 1, box, overlap=True)
    out = [wp.push(step, last=step == 2) for step in range(3)]
    assert [c[1:] for c in trainer.calls] == [(0, False), (1, False), (2, True)]
    assert rollout.calls == [] and box == [4]
    assert [o[1] for o in out] == [{"rollout/published_version": v} for v in (2, 3, 4)]


def test_an_overlapping_pusher_publishes_what_the_trainer_did_not():
    """A trainer with no engine left (or no rollout actor yet) answers without "published": the driver
    publishes, as without overlap."""
    log: list = []
    trainer = FakeHandle(log, "trainer", push_weights=lambda step, wait: {"version": step + 2})
    rollout = FakeHandle(log, "rollout")
    WeightPusher(trainer, rollout, 1, [1], overlap=True).push(0)
    assert rollout.calls == [("set_version", 2)]


class PendingHandle(FakeHandle):
    """A handle whose calls named in `pending` stay unanswered until the test answers them."""

    def __init__(self, log, name, pending=(), **answers):
        super().__init__(log, name, **answers)
        self.pending, self.open = set(pending), []

    def call(self, method, *args):
        if method not in self.pending:
            return super().call(method, *args)
        self.calls.append((method, *args))
        self.log.append(f"{self.name}.{method}")
        f: concurrent.futures.Future = concurrent.futures.Future()
        self.open.append(f)
        return f


def test_weight_pusher_does_not_wait_for_the_rollout_side_but_raises_its_failure_at_the_next_push():
    log: list = []
    trainer = FakeHandle(log, "trainer", push_weights=lambda step, wait: {"version": step + 2})
    rollout = PendingHandle(log, "rollout", pending={"set_version"})
    wp = WeightPusher(trainer, rollout, 1, [1])
    assert wp.push(0)[0] == 2  # returned with set_version(2) unanswered
    rollout.open[0].set_exception(RuntimeError("rollout side gone"))
    try:
        wp.push(1)
    except RuntimeError as e:
        assert "rollout side gone" in str(e)
    else:
        raise AssertionError("the failed set_version was not raised at the next push")
    assert [c[0] for c in trainer.calls] == ["push_weights"]  # the failure stops the next push before it starts


def test_weight_pusher_waits_for_the_rollout_side_on_the_last_step():
    log: list = []
    trainer = FakeHandle(log, "trainer", push_weights=lambda step, wait: {"version": step + 2})
    rollout = PendingHandle(log, "rollout", pending={"set_version"})
    wp = WeightPusher(trainer, rollout, 1, [1])
    waited = []
    rollout.pending.discard("set_version")
    rollout.answers["set_version"] = lambda v: waited.append(v)
    wp.push(0, last=True)
    assert waited == [2] and wp.publishing is None


# ----------------------------------------------------------------------------- Checkpointer


def checkpointer(save_interval, enabled=True):
    log: list = []
    trainer = FakeHandle(log, "trainer")
    rollout = FakeHandle(log, "rollout", state={"data_source": "cursor"})
    return Checkpointer(trainer, rollout, save_interval, enabled=enabled), trainer, rollout


def test_checkpointer_records_consumption_every_step_and_saves_on_cadence_and_last():
    cp, trainer, rollout = checkpointer(save_interval=2)
    for step in range(5):
        cp.save(step, consumed=[f"g{step}"], version=step + 1, last=step == 4)
    records = [c for c in rollout.calls if c[0] == "record_consumed"]
    assert records == [("record_consumed", s, [f"g{s}"]) for s in range(5)]
    saves = [c for c in trainer.calls if c[0] == "save_checkpoint"]
    assert [c[1] for c in saves] == [1, 3, 4]
    assert saves[-1][2] == {"rollout_state": {"data_source": "cursor"}, "weight_version": 5, "consumed_through_step": 4}
    assert cp.last_saved == 4


def test_checkpointer_records_consumption_before_it_saves():
    """The checkpoint's rollout state and the consumption record of its step must agree on resume."""
    cp, trainer, _ = checkpointer(save_interval=1)
    cp.save(0, consumed=["g0"], version=1, last=False)
    # compaction only after the checkpoint is complete: a resume never starts before a compacted step
    assert trainer.log == ["rollout.record_consumed", "rollout.state", "trainer.save_checkpoint",
                           "rollout.compact_buffer"]


def test_checkpointer_writes_a_record_while_the_next_step_trains_and_waits_for_it_before_the_next():
    """Step k's record is in flight during step k+1; step k+1's record starts only after k's is written (records
    go in step order), and a failed record is raised at the next save."""
    log: list = []
    trainer = FakeHandle(log, "trainer")
    rollout = PendingHandle(log, "rollout", pending={"record_consumed"}, state={})
    cp = Checkpointer(trainer, rollout, save_interval=None, enabled=True)
    cp.save(0, consumed=["g0"], version=1, last=False)
    assert len(rollout.open) == 1 and not rollout.open[0].done()  # save returned with the record in flight
    rollout.open[0].set_exception(OSError("storage down"))
    try:
        cp.save(1, consumed=["g1"], version=1, last=False)
    except OSError:
        pass
    else:
        raise AssertionError("the failed record of step 0 was not raised")
    assert [c[1] for c in rollout.calls if c[0] == "record_consumed"] == [0]  # step 1's never started


def test_checkpointer_waits_for_the_record_before_a_checkpoint_and_on_the_last_step():
    log: list = []
    trainer = FakeHandle(log, "trainer")
    rollout = FakeHandle(log, "rollout", state={})
    answered = []
    rollout.answers["record_consumed"] = lambda step, ids: answered.append(step)
    cp = Checkpointer(trainer, rollout, save_interval=2, enabled=False)
    cp.save(0, consumed=["g0"], version=1, last=False)
    assert cp.recording is not None
    cp.save(1, consumed=["g1"], version=1, last=True)
    assert cp.recording is None and answered == [0, 1]
    cp = Checkpointer(trainer, rollout, save_interval=1, enabled=True)
    cp.save(0, consumed=["g0"], version=1, last=False)
    assert cp.recording is None  # the checkpoint of step 0 covers its record: written before it


def test_disabled_checkpointer_still_records_consumption_but_never_saves():
    cp, trainer, rollout = checkpointer(save_interval=1, enabled=False)
    for step in range(3):
        cp.save(step, consumed=[f"g{step}"], version=1, last=step == 2)
    assert [c[1] for c in rollout.calls if c[0] == "record_consumed"] == [0, 1, 2]
    assert trainer.calls == [] and cp.last_saved is None


def test_checkpointer_without_interval_saves_only_at_the_last_step():
    cp, trainer, _ = checkpointer(save_interval=None)
    for step in range(4):
        cp.save(step, consumed=[], version=1, last=step == 3)
    assert [c[1] for c in trainer.calls if c[0] == "save_checkpoint"] == [3]


# ----------------------------------------------------------------------------- batch sources


def drained(ids):
    class D:
        groups, group_ids, metrics = [], list(ids), {"rollout/x": 1.0}

    return D()


def test_batch_source_is_chosen_once_from_the_driver():
    assert isinstance(batch_source("sync", None, [1]), OnDemandBatches)
    assert isinstance(batch_source("one-step-off", None, [1]), PrefetchedBatches)
    assert isinstance(batch_source("fully-async", None, [1]), PrefetchedBatches)


def test_prefetched_batches_request_the_next_batch_for_the_version_it_will_train_under():
    """Batch k+1 is asked for before training on k; with a push after step k its staleness is checked
    against version v+1; with --update-weights-interval 2 only every second step pushes."""
    log: list = []
    rollout = FakeHandle(log, "rollout", next_batch=lambda v: drained([f"v{v}"]))
    box = [5]
    src = PrefetchedBatches(rollout, box, update_interval=2)
    b0 = src.next_batch(0)
    assert rollout.calls == [("next_batch", 5), ("next_batch", 5)]  # step 0 does not push (interval 2)
    assert b0.group_ids == ["v5"] and b0.metrics["perf/train_wait_seconds"] >= 0.0
    src.before_weight_update()
    src.next_batch(1)
    assert rollout.calls[-1] == ("next_batch", 6)  # step 1 pushes: batch 2 is trained under v6


def test_on_demand_batches_ask_for_one_batch_at_the_current_version():
    log: list = []
    rollout = FakeHandle(log, "rollout", next_batch=lambda v: drained([f"v{v}"]))
    box = [3]
    src = OnDemandBatches(rollout, box)
    assert src.next_batch(0).group_ids == ["v3"]
    src.before_weight_update()
    assert rollout.calls == [("next_batch", 3)]


@pytest.mark.parametrize("wait", ["next_batch", "before_weight_update"])
def test_a_driver_waiting_for_a_batch_that_cannot_come_raises_what_its_watch_found(monkeypatch, wait):
    """Under the fully async driver the groups of a version come only once the trainer delivered it and told
    the rollout side: a drain waiting for them watches the trainer, and raises what the watch raises (a rank
    gone, a delivery failed) instead of waiting for ever."""
    import miles_core.driver.roles as roles_module

    monkeypatch.setattr(roles_module, "WATCH_SECONDS", 0.05)
    log: list = []
    rollout = PendingHandle(log, "rollout", pending={"next_batch"} if wait == "next_batch" else set(),
                            next_batch=lambda v: drained(["g"]))
    watched: list = []

    def watch():
        watched.append(1)
        if len(watched) == 3:
            raise RuntimeError("trainer rank 0 is gone")

    src = PrefetchedBatches(rollout, [1], watch=watch)
    if wait == "before_weight_update":
        src.next_batch(0)
        rollout.pending = {"next_batch"}
        src.pending = rollout.call("next_batch", 2)  # the prefetch of the next batch, never answered
    with pytest.raises(RuntimeError, match="rank 0 is gone"):
        src.next_batch(0) if wait == "next_batch" else src.before_weight_update()
    assert len(watched) == 3


def test_a_prefetched_batch_that_comes_is_returned_without_raising_what_the_watch_saw():
    log: list = []
    rollout = FakeHandle(log, "rollout", next_batch=lambda v: drained(["g"]))
    watched: list = []
    src = PrefetchedBatches(rollout, [1], watch=lambda: watched.append(1))
    assert src.next_batch(0).group_ids == ["g"] and watched == []


def test_only_an_overlapping_pusher_asks_the_trainer_about_its_delivery():
    log: list = []
    trainer = FakeHandle(log, "trainer")
    WeightPusher(trainer, FakeHandle(log, "rollout"), 1, [1]).watch()
    assert trainer.calls == []
    WeightPusher(trainer, FakeHandle(log, "rollout"), 1, [1], overlap=True).watch()
    assert trainer.calls == [("check_delivery",)]

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
import threading

import pytest

from miles_core.driver.clients import Pending
from miles_core.driver.fleet_reconciler import NoFleet
from miles_core.driver.loop import Batch, run_loop
from miles_core.driver.pushes import WeightPusher, WeightVersion
from miles_core.driver.roles import (
    Checkpointer,
    Deadline,
    MetricsLog,
    OnDemandBatches,
    PrefetchedBatches,
    Roles,
    batch_source,
)
from miles_core.driver.switchboard import RankEnded, Switchboard
from miles_core.rank_batches import TrainBatch


def done(value=None) -> concurrent.futures.Future:
    f: concurrent.futures.Future = concurrent.futures.Future()
    f.set_result(value)
    return f


class FakeClient:
    """A rollout or trainer client: each method records its call and answers from `answers` (a value or a
    callable); a method named in `pending` stays unanswered until `answer` or `fail`."""

    def __init__(self, log: list, name: str, pending=(), **answers):
        self.log, self.name, self.answers, self.pending = log, name, answers, set(pending)
        self.calls: list[tuple] = []
        self.open: list[tuple[str, concurrent.futures.Future]] = []

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)

        def call(*args) -> Pending:
            self.calls.append((method, *args))
            self.log.append(f"{self.name}.{method}")
            if method in self.pending:
                f: concurrent.futures.Future = concurrent.futures.Future()
                self.open.append((method, f))
                return Pending(future=f)
            answer = self.answers.get(method)
            try:
                return Pending(future=done(answer(*args) if callable(answer) else answer))
            except Exception as e:  # noqa: BLE001 - the call's failure, as Ray would give it
                f = concurrent.futures.Future()
                f.set_exception(e)
                return Pending(future=f)

        return call

    def answer(self, method: str, value) -> None:
        next(f for m, f in self.open if m == method and not f.done()).set_result(value)

    def fail(self, method: str, error: BaseException) -> None:
        next(f for m, f in self.open if m == method and not f.done()).set_exception(error)


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


def pusher(interval: int = 1, overlap: bool = False, trainer_answer=None, fleet=None, pending=()):
    log: list = []
    trainer = FakeClient(log, "trainer", push_weights=trainer_answer or (
        lambda step, version: {"snapshot": f"mem://run/weights/v{version}", "delivered": False}))
    rollout = FakeClient(log, "rollout", pending=pending, deliver_weights=lambda uri, v, engines: {
        "perf/weight_update_seconds": 0.2})
    version = WeightVersion()
    board = Switchboard()
    wp = WeightPusher(trainer, rollout, fleet or NoFleet(), board, version, interval=interval, overlap=overlap)
    return wp, trainer, rollout, version, board


def test_weight_pusher_pushes_every_interval_and_at_the_last_step():
    wp, trainer, rollout, version, _ = pusher(interval=3)
    wp.first_push(-1, 0)
    out = [wp.push(step, last=step == 7) for step in range(8)]
    assert [c[1:] for c in trainer.calls] == [(-1, 1), (2, 2), (5, 3), (7, 4)]  # (step + 1) % 3 == 0, the last
    assert [c for c in rollout.calls if c[0] == "set_version"] == [("set_version", v) for v in (1, 2, 3, 4)]
    assert [v for v, _ in out] == [1, 1, 2, 2, 2, 3, 3, 4]
    assert version.exported == version.delivered == 4 and version.delivered_snapshot == "mem://run/weights/v4"
    assert out[0][1] == {}
    assert out[2][1]["perf/weight_update_seconds"] == 0.2 and out[2][1]["rollout/published_version"] == 2


def test_a_store_push_is_delivered_by_the_rollout_side_and_then_announced():
    wp, trainer, rollout, version, _ = pusher()
    wp.push(0)
    assert trainer.log == ["trainer.push_weights", "rollout.deliver_weights", "rollout.set_version"]
    assert rollout.calls[0] == ("deliver_weights", "mem://run/weights/v1", 1, [])


def test_a_push_the_trainer_delivered_is_only_announced():
    """The distributed transport: rank 0 paused, broadcast and resumed already."""
    wp, trainer, rollout, version, _ = pusher(trainer_answer=lambda step, v: {"delivered": True})
    wp.push(0)
    assert rollout.calls == [("set_version", 1)] and version.delivered == 1 and version.delivered_snapshot is None


def test_an_overlapping_push_returns_before_its_delivery_which_a_later_wait_finishes():
    """Under the fully async driver the delivery goes on while the next step trains: the push returns with
    it in flight, and whatever wait the driver is in next sees it end and announces the version."""
    wp, trainer, rollout, version, board = pusher(overlap=True, pending={"deliver_weights"})
    v, _ = wp.push(0)
    assert v == 1 and version.exported == 1 and version.delivered == 0 and version.delivering
    assert ("set_version", 1) not in rollout.calls
    rollout.answer("deliver_weights", {"perf/weight_update_seconds": 0.3})
    board.wait(rollout.state())  # any wait: here the one for a checkpoint's rollout state
    assert version.delivered == 1 and not version.delivering and rollout.calls[-1] == ("set_version", 1)
    rollout.pending.discard("deliver_weights")
    _, metrics = wp.push(1, last=True)  # the last push waits for its own delivery
    assert metrics["perf/weight_update_seconds"] == 0.2 and version.delivered == 2  # its own delivery's


def test_a_failed_delivery_is_raised_in_the_wait_that_sees_it():
    wp, trainer, rollout, version, board = pusher(overlap=True, pending={"deliver_weights"})
    wp.push(0)
    rollout.fail("deliver_weights", RuntimeError("engine refused v1"))
    with pytest.raises(RuntimeError, match="refused v1"):
        board.wait(rollout.state())
    assert version.delivered == 0


class LosingFleet:
    """A fleet whose engine e1 is gone: `drop_lost` drops it once."""

    def __init__(self):
        self.engines = [("http://e0", "a0"), ("http://e1", "a1")]
        self.dropped = 0

    def targets(self):
        return list(self.engines)

    def drop_lost(self):
        if len(self.engines) == 1:
            return False
        self.engines, self.dropped = self.engines[:1], self.dropped + 1
        return True


def test_a_delivery_that_failed_over_a_lost_engine_is_made_again_to_the_engines_left():
    fleet = LosingFleet()
    tries = []

    def deliver(uri, v, engines):
        tries.append([url for url, _ in engines])
        if len(engines) == 2:
            raise RuntimeError("engine e1's actor died")
        return {}

    wp, trainer, rollout, version, _ = pusher(fleet=fleet)
    rollout.answers["deliver_weights"] = deliver
    wp.push(0)
    assert tries == [["http://e0", "http://e1"], ["http://e0"]] and fleet.dropped == 1 and version.delivered == 1


def test_a_delivery_failing_with_no_engine_lost_raises():
    wp, trainer, rollout, version, _ = pusher(fleet=LosingFleet())
    wp.engines.engines = wp.engines.engines[:1]
    rollout.answers["deliver_weights"] = lambda uri, v, engines: (_ for _ in ()).throw(RuntimeError("disk full"))
    with pytest.raises(RuntimeError, match="disk full"):
        wp.push(0)


def test_a_push_the_trainer_delivers_made_again_once_the_fleet_dropped_a_lost_engine():
    """The distributed transport: rank 0's broadcast fails when an engine is gone; the push is made once
    more after the fleet dropped it, and a failure with no engine lost raises as it is."""
    fleet, tries = LosingFleet(), []

    def push(step, version):
        tries.append(len(fleet.engines))
        if len(fleet.engines) == 2:
            raise RuntimeError("broadcast to engine e1 failed: connection reset")
        return {"delivered": True}

    wp, trainer, rollout, version, _ = pusher(trainer_answer=push, fleet=fleet)
    wp.push(0)
    assert tries == [2, 1] and fleet.dropped == 1 and version.delivered == 1
    wp, *_ = pusher(trainer_answer=lambda step, v: (_ for _ in ()).throw(RuntimeError("NCCL timeout")),
                    fleet=LosingFleet())
    wp.engines.engines = wp.engines.engines[:1]
    with pytest.raises(RuntimeError, match="NCCL timeout"):
        wp.push(0)


# ----------------------------------------------------------------------------- Checkpointer


def checkpointer(save_interval, enabled=True):
    log: list = []
    trainer = FakeClient(log, "trainer")
    rollout = FakeClient(log, "rollout", state={"data_source": "cursor"})
    return Checkpointer(trainer, rollout, Switchboard(), save_interval, enabled=enabled), trainer, rollout


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
    trainer = FakeClient(log, "trainer")
    rollout = FakeClient(log, "rollout", pending={"record_consumed"}, state={})
    cp = Checkpointer(trainer, rollout, Switchboard(), save_interval=None, enabled=True)
    cp.save(0, consumed=["g0"], version=1, last=False)
    assert len(rollout.open) == 1 and not rollout.open[0][1].done()  # save returned with the record in flight
    rollout.fail("record_consumed", OSError("storage down"))
    with pytest.raises(OSError):
        cp.save(1, consumed=["g1"], version=1, last=False)
    assert [c[1] for c in rollout.calls if c[0] == "record_consumed"] == [0]  # step 1's never started


def test_checkpointer_waits_for_the_record_before_a_checkpoint_and_on_the_last_step():
    log: list = []
    trainer = FakeClient(log, "trainer")
    rollout = FakeClient(log, "rollout", state={})
    answered = []
    rollout.answers["record_consumed"] = lambda step, ids: answered.append(step)
    cp = Checkpointer(trainer, rollout, Switchboard(), save_interval=2, enabled=False)
    cp.save(0, consumed=["g0"], version=1, last=False)
    assert cp.recording is not None
    cp.save(1, consumed=["g1"], version=1, last=True)
    assert cp.recording is None and answered == [0, 1]
    cp = Checkpointer(trainer, rollout, Switchboard(), save_interval=1, enabled=True)
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
    return TrainBatch(list(ids), {"rollout/x": 1.0}, {}, [])


def test_batch_source_is_chosen_once_from_the_driver():
    board, v = Switchboard(), WeightVersion()
    assert isinstance(batch_source("sync", None, board, v), OnDemandBatches)
    assert isinstance(batch_source("one-step-off", None, board, v), PrefetchedBatches)
    assert isinstance(batch_source("fully-async", None, board, v), PrefetchedBatches)


def test_prefetched_batches_request_the_next_batch_for_the_version_it_will_train_under():
    """Batch k+1 is asked for before training on k; with a push after step k its staleness is checked
    against version v+1; with --update-weights-interval 2 only every second step pushes."""
    log: list = []
    rollout = FakeClient(log, "rollout", next_train_batch=lambda v: drained([f"v{v}"]))
    src = PrefetchedBatches(rollout, Switchboard(), WeightVersion(exported=5), update_interval=2)
    b0 = src.next_batch(0)
    assert rollout.calls == [("next_train_batch", 5), ("next_train_batch", 5)]  # step 0 does not push (interval 2)
    assert b0.group_ids == ["v5"] and b0.metrics["perf/train_wait_seconds"] >= 0.0
    src.before_weight_update()
    src.next_batch(1)
    assert rollout.calls[-1] == ("next_train_batch", 6)  # step 1 pushes: batch 2 is trained under v6


def test_on_demand_batches_ask_for_one_batch_at_the_current_version():
    log: list = []
    rollout = FakeClient(log, "rollout", next_train_batch=lambda v: drained([f"v{v}"]))
    src = OnDemandBatches(rollout, Switchboard(), WeightVersion(exported=3))
    assert src.next_batch(0).group_ids == ["v3"]
    src.before_weight_update()
    assert rollout.calls == [("next_train_batch", 3)]


# ----------------------------------------------------------------------------- the switchboard


@pytest.mark.parametrize("wait", ["next_batch", "before_weight_update"])
def test_a_driver_waiting_for_a_batch_learns_at_once_that_a_rank_died(wait):
    """The groups of a version come only once it was delivered: a driver waiting for them must not wait for
    ever when a trainer rank dies meanwhile. The ranks' `alive` calls are in the same wait and end it."""
    log: list = []
    rollout = FakeClient(log, "rollout", pending={"next_train_batch"}, next_train_batch=lambda v: drained(["g"]))
    alive = Pending(future=concurrent.futures.Future())
    src = PrefetchedBatches(rollout, Switchboard(watched=[alive]), WeightVersion(exported=1))
    if wait == "before_weight_update":
        rollout.pending.discard("next_train_batch")
        src.next_batch(0)
        rollout.pending.add("next_train_batch")
        src.pending = rollout.next_train_batch(2)  # the prefetch of the next batch, never answered
    died = threading.Timer(0.05, lambda: alive.future.set_exception(RuntimeError("trainer rank 0 died")))
    died.start()
    with pytest.raises(RuntimeError, match="rank 0 died"):
        src.next_batch(0) if wait == "next_batch" else src.before_weight_update()


def test_a_rank_whose_alive_call_ends_without_an_error_is_reported_too():
    alive = Pending(future=done(None))
    with pytest.raises(RankEnded):
        Switchboard(watched=[alive]).wait(Pending(future=concurrent.futures.Future()))


def test_duties_run_from_the_wait_when_due_and_a_failing_duty_is_logged(caplog):
    now = [0.0]
    board = Switchboard(clock=lambda: now[0])
    ran: list = []
    board.every(2.0, lambda: ran.append(now[0]))

    def broken():
        raise OSError("feed not written")

    board.every(1.0, broken)
    later = concurrent.futures.Future()

    def tick():
        now[0] += 1.0
        if now[0] >= 5.0:
            later.set_result("batch")
        else:
            threading.Timer(0.01, tick).start()

    threading.Timer(0.01, tick).start()
    assert board.wait(Pending(future=later)) == "batch"
    assert ran and all(t >= 2.0 for t in ran)
    assert "feed not written" in caplog.text


def test_a_delivery_to_an_engine_the_fleet_dropped_meanwhile_is_made_again_without_it():
    """The loop reconciles after the push: the fleet may drop a lost engine while the delivery to it is in
    flight; the delivery's failure then finds nothing more to drop, but the engines changed: made again."""
    fleet = LosingFleet()
    tries = []

    def deliver(uri, v, engines):
        tries.append([url for url, _ in engines])
        return {}

    wp, trainer, rollout, version, board = pusher(fleet=fleet, overlap=True, pending={"deliver_weights"})
    rollout.answers["deliver_weights"] = deliver
    wp.push(0)
    fleet.drop_lost()  # the loop's reconcile, after the push
    rollout.pending.discard("deliver_weights")
    rollout.fail("deliver_weights", RuntimeError("engine e1 refused the connection"))
    board.wait(rollout.state())  # sees the failure: made again to e0
    wp.settle()
    assert version.delivered == 1 and tries == [["http://e0"]]


def test_a_call_finishing_while_the_wait_looks_is_not_lost(monkeypatch):
    """Pins the wait's order: the calls' unfinished parts are collected, then finished calls are looked for.
    Guards: a call (the version's announcement to the rollout side) that finished between the first look and
    the collection left the wait sleeping on the ranks' `alive` calls only, for ever (a run hung after its
    first delivery under load in CI)."""
    from miles_core.driver import clients

    class FinishesWhileLooked(Pending):
        finished = False

        def done(self) -> bool:
            return self.finished

        def unfinished(self) -> list:
            self.finished = True  # it finishes just as its parts are collected
            return []

    def must_not_sleep(*args, **kwargs):
        raise AssertionError("the wait slept on the other calls although one had finished")

    monkeypatch.setattr(clients.concurrent.futures, "wait", must_not_sleep)
    alive = Pending(future=concurrent.futures.Future())  # a rank's alive call: never answers
    clients.wait_any([FinishesWhileLooked(future=concurrent.futures.Future()), alive], None)

"""The driver's fleet role (miles_core.driver.fleet_reconciler) over a fake fleet, trainer and rollout side.

Pins the order that keeps a joining engine from serving stale weights: it gets no request before it
holds the current version (loaded from the run root, then the trainer's set, then the rollout
manager's; or, without weights in the run root, the trainer's set, a push, then the rollout
manager's); a draining engine leaves the rollout manager at once and the trainer only when its
requests are done (or its grace is over), and never while a delivery is in flight; a lost engine leaves
both at once and is replaced; the target is read at most every read interval, never below the run's
minimum; fleet.json records it all. The version is read from the driver's `WeightVersion`, never kept.
The real fleet on Ray is exercised in tests/e2e/test_elastic_engines.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from miles_core.driver.fleet_reconciler import FleetReconciler
from miles_core.driver.pushes import WeightVersion
from miles_core.engines.launcher import DRAINING, SERVING, STARTING, FleetMember
from miles_core.engines.registry import read_fleet, write_target
from miles_core.metrics.names import ENGINES
from miles_core.storage import Store


class Done:
    def __init__(self, value=None):
        self.value = value

    def result(self, timeout=None):
        return self.value


class FakeFleet:
    def __init__(self, n: int):
        self.members, self.next, self.removed, self.lost_now = [], 0, [], []
        self.start_ok: set[str] = set()  # names whose start has finished
        self.load_ok: set[str] = set()
        self.fail: dict[str, Exception] = {}
        self.load_fail: dict[str, Exception] = {}  # the next `loaded` of that name raises it
        self.loads: list[tuple[str, str, int]] = []
        for _ in range(n):
            m = self.spawn()
            m.url, m.state = f"http://e/{m.name}", SERVING

    def serving(self):
        return [m for m in self.members if m.state == SERVING]

    def spawn(self):
        m = FleetMember(f"engine-{self.next}", actor=f"actor-{self.next}", started=None)
        self.next += 1
        self.members.append(m)
        return m

    def started(self, m):
        if m.name in self.fail:
            raise self.fail[m.name]
        if m.name in self.start_ok:
            m.url = f"http://e/{m.name}"
        return bool(m.url)

    def begin_load(self, m, uri, version):
        self.loads.append((m.name, uri, version))

    def loaded(self, m):
        if m.name in self.load_fail:
            raise self.load_fail.pop(m.name)
        return m.name in self.load_ok

    def lost(self):
        return [m for m in self.members if m.name in self.lost_now]

    def remove(self, m, graceful=True):
        self.members.remove(m)
        self.removed.append((m.name, graceful))

    def reap(self):
        pass


@dataclass
class Side:
    """The trainer or the rollout manager: every call recorded in `log` (shared, for their order)."""

    name: str
    log: list
    answers: dict = field(default_factory=dict)

    def __getattr__(self, method):
        if method.startswith("_"):
            raise AttributeError(method)

        def call(*args):
            if method in ("set_engines", "set_engine_urls"):
                self.log.append((self.name, list(args[0])))
            answer = self.answers.get(method)
            return Done(answer(*args) if callable(answer) else answer)

        return call


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def rig(tmp_path):
    log: list = []
    fleet = FakeFleet(1)
    trainer = Side("trainer", log)
    rollout = Side("rollout", log, {"engine_in_flight": {}, "engine_served_versions": {}})
    store, clock = Store(f"file://{tmp_path}/run"), Clock()
    version = WeightVersion(exported=5, delivered=5, delivered_snapshot="file:///w/v5")
    rec = FleetReconciler(fleet, trainer, rollout, store, version, target=1, clock=clock, drain_grace_seconds=30)
    return rec, fleet, trainer, rollout, store, clock, log


def urls(*names):
    return [f"http://e/{n}" for n in names]


def test_growing_engines_load_the_current_weights_before_any_request(rig):
    rec, fleet, trainer, rollout, store, clock, log = rig
    assert rec.reconcile(0) == {ENGINES: 1.0}
    assert read_fleet(store)["engines"][0]["version"] == 5  # the first record, with the starting fleet
    write_target(store, 3)
    clock.now += 2
    rec.reconcile(1)
    assert [m.state for m in fleet.members] == [SERVING, STARTING, STARTING] and log == []
    fleet.start_ok |= {"engine-1", "engine-2"}
    clock.now += 1
    assert rec.reconcile(2) == {ENGINES: 1.0}  # loading the staged weights of version 5: no set changes
    assert fleet.loads == [("engine-1", "file:///w/v5", 5), ("engine-2", "file:///w/v5", 5)] and log == []
    fleet.load_ok.add("engine-1")
    assert rec.reconcile(3) == {ENGINES: 2.0}
    assert log == [("trainer", urls("engine-0", "engine-1")), ("rollout", urls("engine-0", "engine-1"))]
    events = [(e["event"], e.get("name")) for e in read_fleet(store)["events"]]
    assert ("serving", "engine-1") in events and ("target", None) in events


def test_an_engine_whose_load_fell_behind_joins_at_the_next_push(rig):
    rec, fleet, trainer, rollout, store, clock, log = rig
    write_target(store, 2)
    rec.reconcile(0)
    fleet.start_ok.add("engine-1")
    rec.reconcile(1)
    fleet.load_ok.add("engine-1")
    rec.version.exported = rec.version.delivered = 6  # a push made and delivered version 6 while it loaded 5
    rec.reconcile(2)
    assert log == [("trainer", urls("engine-0", "engine-1"))]  # pushed to from now on, no request yet
    assert rec.targets() == [(u, f"actor-{i}") for i, u in enumerate(urls("engine-0", "engine-1"))]
    rec.reconcile(3)
    assert log[-1][0] == "trainer" and len(log) == 1
    rec.version.exported, rec.version.delivering = 7, True  # version 7 still delivering (it overlaps the next step)
    assert rec.reconcile(4) == {ENGINES: 1.0} and len(log) == 1
    rec.version.delivered, rec.version.delivering = 7, False
    assert rec.reconcile(5) == {ENGINES: 2.0}  # the push of version 7 reached it
    assert log[-1] == ("rollout", urls("engine-0", "engine-1"))


def test_a_load_of_a_version_deleted_meanwhile_loads_the_delivered_one_instead(rig):
    """The trainer keeps only the versions in use: a joiner slower than two pushes finds the version it began
    with deleted. It loads the delivered version instead of leaving the fleet; a load failing at the delivered
    version still fails it."""
    rec, fleet, trainer, rollout, store, clock, log = rig
    write_target(store, 2)
    rec.reconcile(0)
    fleet.start_ok.add("engine-1")
    rec.reconcile(1)
    rec.version.exported = rec.version.delivered = 7  # two pushes delivered while it loaded version 5
    rec.version.delivered_snapshot = "file:///w/v7"
    fleet.load_fail["engine-1"] = FileNotFoundError("file:///w/v5: no such directory")
    rec.reconcile(2)
    assert fleet.loads == [("engine-1", "file:///w/v5", 5), ("engine-1", "file:///w/v7", 7)] and fleet.removed == []
    fleet.load_ok.add("engine-1")
    assert rec.reconcile(3) == {ENGINES: 2.0}
    write_target(store, 3)
    clock.now += 2
    rec.reconcile(4)
    fleet.start_ok.add("engine-2")
    rec.reconcile(5)
    fleet.load_fail["engine-2"] = RuntimeError("the engine refused the weights")
    rec.reconcile(6)
    assert ("engine-2", True) in fleet.removed  # failed at the delivered version: it leaves, as before


def test_without_weights_in_the_run_root_an_engine_joins_through_a_push(rig):
    rec, fleet, trainer, rollout, store, clock, log = rig
    rec.version.delivered_snapshot = None  # the distributed transport
    write_target(store, 2)
    rec.reconcile(0)
    fleet.start_ok.add("engine-1")
    rec.reconcile(1)
    assert fleet.loads == [] and log == [("trainer", urls("engine-0", "engine-1"))]
    rec.version.exported = rec.version.delivered = 6
    rec.reconcile(2)
    assert log[-1] == ("rollout", urls("engine-0", "engine-1"))


def grow_to_two(rig) -> None:
    """Target 2 from 1: engine-1 starts, loads the current weights and serves (steps 0-2)."""
    rec, fleet, _, _, store, _, _ = rig
    write_target(store, 2)
    rec.reconcile(0)
    fleet.start_ok.add("engine-1")
    fleet.load_ok.add("engine-1")
    rec.reconcile(1)
    rec.reconcile(2)


def test_shrinking_drains_the_newest_then_removes_it(rig):
    rec, fleet, trainer, rollout, store, clock, log = rig
    grow_to_two(rig)
    log.clear()
    write_target(store, 1)
    clock.now += 2
    rollout.answers["engine_in_flight"] = {"http://e/engine-1": 3}
    rec.reconcile(3)
    assert [m.state for m in fleet.members] == [SERVING, DRAINING]
    assert log == [("rollout", urls("engine-0"))]  # no new request; the trainer still pushes to it
    rollout.answers["engine_in_flight"] = {"http://e/engine-1": 0}
    rollout.answers["engine_served_versions"] = {"http://e/engine-1": {"min_version": 5, "max_version": 6}}
    assert rec.reconcile(4) == {ENGINES: 1.0}
    assert fleet.removed == [("engine-1", True)] and log[-1] == ("trainer", urls("engine-0"))
    removed = [e for e in read_fleet(store)["events"] if e["event"] == "removed"]
    assert removed[0]["name"] == "engine-1" and removed[0]["served"]["min_version"] == 5


def test_no_engine_leaves_while_a_delivery_is_in_flight(rig):
    """A push's delivery may still be reaching an engine (it overlaps the next step): the fleet shrinks only
    in a round with no delivery in flight."""
    rec, fleet, trainer, rollout, store, clock, log = rig
    grow_to_two(rig)
    write_target(store, 1)
    clock.now += 2
    rec.version.exported, rec.version.delivering = 6, True
    rec.reconcile(3)
    assert [m.state for m in fleet.members] == [SERVING, SERVING] and fleet.removed == []
    rec.version.delivered, rec.version.delivering = 6, False
    rec.reconcile(4)  # drains, and nothing in flight: removed in the same round
    assert fleet.removed == [("engine-1", True)]


def test_a_drain_ends_after_its_grace(rig):
    rec, fleet, trainer, rollout, store, clock, log = rig
    grow_to_two(rig)
    write_target(store, 1)
    clock.now += 2
    rollout.answers["engine_in_flight"] = {"http://e/engine-1": 1}
    rec.reconcile(3)
    clock.now += 29
    rec.reconcile(4)
    assert fleet.removed == []
    clock.now += 2
    rec.reconcile(5)
    assert fleet.removed == [("engine-1", True)]
    assert [e for e in read_fleet(store)["events"] if e["event"] == "removed"][0]["left_in_flight"] == 1


def test_a_lost_engine_leaves_both_sets_at_once_and_is_replaced(rig):
    rec, fleet, trainer, rollout, store, clock, log = rig
    grow_to_two(rig)
    log.clear()
    fleet.lost_now.append("engine-0")
    assert rec.reconcile(3) == {ENGINES: 1.0}
    assert log == [("trainer", urls("engine-1")), ("rollout", urls("engine-1"))]
    assert fleet.removed == [("engine-0", False)] and fleet.members[-1].name == "engine-2"  # the replacement
    assert fleet.members[-1].state == STARTING


def test_a_failed_start_is_dropped_and_retried_later(rig):
    rec, fleet, trainer, rollout, store, clock, log = rig
    write_target(store, 2)
    rec.reconcile(0)
    fleet.fail["engine-1"] = RuntimeError("EngineStartError: no healthy /health")
    rec.reconcile(1)
    assert fleet.removed == [("engine-1", True)] and [m.name for m in fleet.members] == ["engine-0"]
    assert [e for e in read_fleet(store)["events"] if e["event"] == "failed"][0]["error"].startswith("EngineStart")
    clock.now += 2  # after the back-off
    rec.reconcile(2)
    assert [m.name for m in fleet.members] == ["engine-0", "engine-2"]


def test_the_target_is_read_at_most_every_interval_and_kept_at_the_minimum(rig, caplog):
    rec, fleet, trainer, rollout, store, clock, log = rig
    rec.reconcile(0)
    write_target(store, 3)
    rec.reconcile(1)
    assert rec.target == 1  # read 0 s ago
    clock.now += 2
    rec.reconcile(2)
    assert rec.target == 3
    for m in list(fleet.members[1:]):
        fleet.remove(m)
    write_target(store, 0)
    clock.now += 2
    rec.reconcile(3)
    assert rec.target == 1 and "keeps 1" in caplog.text  # a run without producers keeps one engine


def test_while_no_engine_serves_the_driver_s_waits_let_one_join(tmp_path):
    """A run of 0 engines waits in the loop for a batch that nothing generates: the engine asked for
    meanwhile joins without a step (`tick`, a duty of the driver's waits), in the same order as ever; once
    one serves, `tick` leaves the fleet to the loop."""
    log: list = []
    fleet = FakeFleet(0)
    trainer = Side("trainer", log)
    rollout = Side("rollout", log, {"engine_in_flight": {}, "engine_served_versions": {}})
    store = Store(f"file://{tmp_path}/run")
    version = WeightVersion(exported=3, delivered=3, delivered_snapshot="file:///w/v3")
    rec = FleetReconciler(fleet, trainer, rollout, store, version, target=0, min_engines=0, read_interval_seconds=0)
    write_target(store, 1)
    rec.tick()
    assert [m.state for m in fleet.members] == [STARTING]
    fleet.start_ok.add("engine-0")
    fleet.load_ok.add("engine-0")
    rec.tick()
    rec.tick()
    assert log == [("trainer", urls("engine-0")), ("rollout", urls("engine-0"))]
    assert read_fleet(store)["serving"] == 1 and fleet.loads == [("engine-0", "file:///w/v3", 3)]
    write_target(store, 2)
    rec.tick()
    assert len(fleet.members) == 1  # an engine serves: the loop reconciles


def test_drop_lost_drops_a_dead_engine_from_every_set_for_a_push_made_again(rig):
    rec, fleet, trainer, rollout, store, clock, log = rig
    grow_to_two(rig)
    log.clear()
    assert rec.drop_lost() is False
    fleet.lost_now.append("engine-1")
    assert rec.drop_lost() is True
    assert log == [("trainer", urls("engine-0")), ("rollout", urls("engine-0"))]
    assert rec.targets() == [("http://e/engine-0", "actor-0")]


def test_a_writer_that_lost_the_lease_changes_nothing(rig):
    rec, fleet, trainer, rollout, store, clock, log = rig

    def lost():
        raise RuntimeError("LeaseLost: another writer holds the run")

    rec.fence = lost
    write_target(store, 3)
    with pytest.raises(RuntimeError, match="LeaseLost"):
        rec.reconcile(0)
    assert len(fleet.members) == 1 and read_fleet(store) is None and log == []

"""The driver's fleet role: moves the engine fleet to the size the run root asks for while the run goes on.

    fleet = FleetReconciler(engines, trainer, rollout, store, version, target=cfg.engine.rollout_num_engines)
    metrics = fleet.reconcile(step)    # the loop, after each step's weight push; never waits for an engine
    fleet.tick()                       # a duty of the driver's waits: reconciles while no engine serves
    fleet.targets(); fleet.drop_lost() # what a weight push reaches; engines gone, dropped (one owner)

`--rollout-num-engines` is the starting size; engines/target.json (`miles engines add|remove RUN_URI N`,
miles_core.engines.registry) is the size asked for since. Each call:

1. engines whose actor died (a preempted node, a killed process) leave the rollout manager's and the
   trainer's sets at once; their requests in flight abort, so their groups are rejected and handled by
   the unused-samples handler like any aborted group;
2. the target is read, at most every `read_interval_seconds`;
3. engines that joined advance. Once started, one loads the weights of the current version when they
   are in the run root (the store transport's staged snapshot, or the weights published for producer
   jobs) and then serves; otherwise (the distributed transport, or a version moved on under its load)
   it is among the next weight push's targets (the distributed transport forms its group again with
   it), and it serves once that push was delivered (the driver's `WeightVersion.delivered`: a push's
   delivery may overlap the next step). Either way no request reaches an engine before it holds the
   current version;
4. fewer live (joining or serving) engines than the target: more are started in the background (Ray
   places them when the cluster has room: nothing here waits for it; one still starting after
   `stuck_after_seconds` is logged once); more than the target: joining ones are cancelled first, then
   the newest serving ones drain: the rollout manager sends them no new request, and once their
   requests in flight are done (or after `drain_grace_seconds`) they leave the trainer's set and shut
   down; nothing leaves while a delivery is in flight (it waits for the next round);
5. engines/fleet.json records the fleet, the target and the recent changes (with the weight versions
   each engine served) after every change.

It returns the step's `rollout/engines` (engines serving). A target below `min_engines` (1 unless
producer jobs may feed the run) is refused in the log and the minimum kept. This is the one owner of
engine liveness: a weight push that failed because an engine is gone asks `drop_lost`.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from miles_core.driver.clients import RolloutClient
from miles_core.driver.placement import TrainerGroup
from miles_core.driver.pushes import WeightVersion
from miles_core.engines.launcher import DRAINING, SERVING, STARTING, EngineFleet, FleetMember
from miles_core.engines.registry import EngineTargetError, read_target, write_fleet
from miles_core.metrics.names import ENGINES

log = logging.getLogger(__name__)

LOADING, JOINING = "loading", "joining"  # started, not serving yet: loading the weights, or waiting for a push
IN_TRAINER_SET = (JOINING, SERVING, DRAINING)
EVENTS_KEPT = 200


class NoFleet:
    """A loop without a fleet to reconcile (tests, benchmarks)."""

    def reconcile(self, step: int) -> dict:
        return {}

    def tick(self) -> None:
        pass

    def targets(self) -> list[tuple[str, Any]]:
        return []

    def drop_lost(self) -> bool:
        return False

    def close(self) -> None:
        pass


class FleetReconciler:
    def __init__(self, engines: EngineFleet, trainer: TrainerGroup, rollout: RolloutClient, store, version: WeightVersion, *,
                 target: int, min_engines: int = 1, read_interval_seconds: float = 2.0,
                 drain_grace_seconds: float = 30.0, stuck_after_seconds: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, fence: Callable[[], None] = lambda: None):
        self.engines, self.trainer, self.rollout, self.store, self.version = engines, trainer, rollout, store, version
        self.fence = fence  # raises when this writer lost the run root's lease (before every change)
        self.min_engines, self.read_interval, self.grace = min_engines, read_interval_seconds, drain_grace_seconds
        self.stuck_after, self.clock = stuck_after_seconds, clock
        self.target, self.step = max(target, min_engines), -1
        self.events: list[dict] = []
        self._read_at = float("-inf")
        self._spawn_after, self._backoff = float("-inf"), 1.0
        self._drain_until: dict[str, float] = {}
        self._joined_at: dict[str, int] = {}  # a joining engine's version when it became a push target
        self._told: set[str] = set()  # what was logged once
        self._sent = {"trainer": self._names(IN_TRAINER_SET), "rollout": self._names((SERVING,))}
        self._recorded = self._began = False

    def reconcile(self, step: int) -> dict[str, float]:
        """After `step`'s weight push: one round of the module doc's steps."""
        self.fence()
        self.step = step
        if not self._began:  # the starting fleet serves the version the run started on
            self._began = True
            for m in self.engines.serving():
                m.detail.setdefault("version", self.version.delivered)
                self._event("serving", m)
        changes = [self._drop_lost(), self._read_target(), self._advance(), self._resize(), self._finish_draining()]
        self.engines.reap()
        if any(changes):
            self._give_sets()
        if any(changes) or not self._recorded:
            self.record()
        return {ENGINES: float(len(self.engines.serving()))}

    def tick(self) -> None:
        """A duty of the driver's waits. While no engine serves, the loop waits for a batch that only an engine
        (or a producer job) can generate and reconciles no more until one does, so an engine asked for
        meanwhile must join from here. While engines drain or a shrink is due, it finishes them once no
        delivery is in flight (under the fully async driver one is in flight whenever the loop reconciles)."""
        live = [m for m in self.engines.members if m.state != DRAINING]
        draining = len(live) < len(self.engines.members)
        if not self.engines.serving() or ((draining or len(live) > self.target) and not self.version.delivering):
            self.reconcile(self.step)

    def targets(self) -> list[tuple[str, Any]]:
        """(url, engine actor) of every engine a weight push reaches: joining, serving and draining ones."""
        return [(m.url, m.actor) for m in self.engines.members if m.state in IN_TRAINER_SET]

    def drop_lost(self) -> bool:
        """Engines whose actor died leave every set now (a push that failed asks before it tries again)."""
        if not self._drop_lost():
            return False
        self._give_sets()
        self.record()
        return True

    def close(self) -> None:
        """The final record (with what each engine served), a failure to write it only logged."""
        try:
            self.fence()
            self.record()
        except Exception as e:  # noqa: BLE001 - the segment's end never fails over this record
            log.warning("could not record the engine fleet at the end: %s", e)

    # ---- 1. lost engines ----------------------------------------------------------------------
    def _drop_lost(self) -> bool:
        lost = self.engines.lost()
        for m in lost:
            log.warning("engine %s (%s) is gone (its actor died); its requests in flight abort", m.name, m.url)
            self._depart(m, "lost", graceful=False)
        return bool(lost)

    # ---- 2. the target ------------------------------------------------------------------------
    def _read_target(self) -> bool:
        now = self.clock()
        if now - self._read_at < self.read_interval:
            return False
        self._read_at = now
        try:
            asked = read_target(self.store)
        except EngineTargetError as e:
            self._once(str(e), "%s; the fleet keeps its target of %d", e, self.target)
            return False
        target = self.target if asked is None else self._allowed(asked)
        if target == self.target:
            return False
        log.info("engines: target %d -> %d", self.target, target)
        self.target = target
        self._event("target", count=target)
        return True

    def _allowed(self, asked: int) -> int:
        if asked >= self.min_engines:
            return asked
        self._once(f"min{asked}", "engines/target.json asks for %d engine(s); a run without "
                   "--allow-rollout-producers keeps %d (nothing else would generate)", asked, self.min_engines)
        return self.min_engines

    # ---- 3. joining engines -------------------------------------------------------------------
    def _advance(self) -> bool:
        changed = False
        for m in [m for m in self.engines.members if m.state in (STARTING, LOADING, JOINING)]:
            try:
                changed |= self._advance_one(m)
            except Exception as e:  # noqa: BLE001 - its start failed (Ray wraps EngineStartError) or its actor died
                changed |= self._superseded_load(m, e) or self._failed(m, e)
        return changed

    def _superseded_load(self, m: FleetMember, error: BaseException) -> bool:
        """A load that failed while newer versions were delivered (the trainer keeps only the versions in use,
        so the one it began with may be gone): it loads the delivered version now instead of leaving the
        fleet, which a joiner slower than two pushes would do at every try."""
        if m.state != LOADING or m.detail.get("loading") == self.version.delivered:
            return False
        log.info("engine %s: weight version %s was superseded while it loaded (%s); loading version %d",
                 m.name, m.detail.pop("loading"), str(error).splitlines()[-1][:200], self.version.delivered)
        return self._load_current(m)

    def _advance_one(self, m: FleetMember) -> bool:
        self._waiting(m)
        if m.state == STARTING:
            return self.engines.started(m) and self._load_current(m)
        if m.state == LOADING:
            return self.engines.loaded(m) and self._after_load(m)
        return self.version.delivered > self._joined_at[m.name] and self._serve(m)

    def _load_current(self, m: FleetMember) -> bool:
        """The delivered version's weights when the run root holds them; else it joins at the next push."""
        if self.version.delivered_snapshot is None:
            return self._wait_for_push(m)
        self.engines.begin_load(m, self.version.delivered_snapshot, self.version.delivered)
        m.state, m.detail["loading"] = LOADING, self.version.delivered
        return True

    def _after_load(self, m: FleetMember) -> bool:
        """It holds the loaded version: it serves when that is still the newest, with no delivery in flight."""
        loaded = m.detail.pop("loading")
        v = self.version
        if loaded == v.delivered == v.exported and not v.delivering:
            return self._serve(m)
        return self._wait_for_push(m)

    def _wait_for_push(self, m: FleetMember) -> bool:
        """A push target from now; it serves once a version newer than the newest now was delivered."""
        m.state = JOINING
        self._joined_at[m.name] = self.version.exported
        self._give_trainer()
        return True

    def _serve(self, m: FleetMember) -> bool:
        m.state, m.since, m.detail["version"] = SERVING, time.time(), self.version.delivered
        self._joined_at.pop(m.name, None)
        self._backoff = 1.0
        log.info("engine %s serves at %s from weight version %d", m.name, m.url, self.version.delivered)
        self._event("serving", m)
        return True

    def _failed(self, m: FleetMember, error: BaseException) -> bool:
        log.warning("engine %s did not join: %s", m.name, error)
        self._spawn_after, self._backoff = self.clock() + self._backoff, min(self._backoff * 2, 60.0)
        self._depart(m, "failed", graceful=True, error=str(error)[:500])
        return True

    def _waiting(self, m: FleetMember) -> None:
        if time.time() - m.since < self.stuck_after:
            return
        if m.state == STARTING:
            self._once(f"stuck{m.name}", "engine %s has not started after %.0f s: the cluster may have no room "
                       "for one more engine; it joins when Ray places it", m.name, self.stuck_after)
        elif m.state == JOINING and not self.engines.serving():
            self._once(f"push{m.name}", "engine %s waits for a weight push, which needs a training step, which "
                       "needs a batch, which no engine serves to generate: with --weight-transport distributed "
                       "and every engine lost the run waits until a rollout producer job feeds it; ending the "
                       "segment and resuming starts the engines afresh", m.name)

    # ---- 4. toward the target -----------------------------------------------------------------
    def _resize(self) -> bool:
        live = [m for m in self.engines.members if m.state != DRAINING]
        if len(live) < self.target:
            return self._grow(self.target - len(live))
        if len(live) > self.target and not self.version.delivering:  # none leaves while a delivery may be
            return self._shrink(live, len(live) - self.target)        # loading into it: a later round
        return False

    def _grow(self, n: int) -> bool:
        if self.clock() < self._spawn_after:  # after a failed start, a little later
            return False
        for _ in range(n):
            m = self.engines.spawn()
            log.info("engine %s starting (target %d)", m.name, self.target)
            self._event("starting", m)
        return True

    def _shrink(self, live: list[FleetMember], n: int) -> bool:
        newest_first = [m for m in reversed(live) if m.state != SERVING] + [m for m in reversed(live)
                                                                             if m.state == SERVING]
        for m in newest_first[:n]:
            if m.state == SERVING:
                self._drain(m)
            else:
                self._depart(m, "cancelled", graceful=True)
        return True

    def _drain(self, m: FleetMember) -> None:
        m.state, m.since = DRAINING, time.time()
        self._drain_until[m.name] = self.clock() + self.grace
        log.info("engine %s draining (target %d): no new request; its requests in flight finish", m.name,
                 self.target)
        self._event("draining", m)

    def _finish_draining(self) -> bool:
        draining = [m for m in self.engines.members if m.state == DRAINING]
        if not draining or self.version.delivering:
            return False
        in_flight = self.rollout.engine_in_flight().result()
        done = [m for m in draining if not in_flight.get(m.url) or self.clock() >= self._drain_until[m.name]]
        for m in done:
            self._depart(m, "removed", graceful=True, left_in_flight=int(in_flight.get(m.url, 0)))
        return bool(done)

    def _depart(self, m: FleetMember, event: str, graceful: bool, **extra) -> None:
        served = self._served().get(m.url) if m.url else None
        self.engines.remove(m, graceful=graceful)
        self._drain_until.pop(m.name, None)
        self._joined_at.pop(m.name, None)
        self._event(event, m, **extra, **({"served": served} if served else {}))

    # ---- the sets and the record --------------------------------------------------------------
    def _names(self, states: tuple[str, ...]) -> list[str]:
        return [m.name for m in self.engines.members if m.state in states]

    def _give_sets(self) -> None:
        """The trainer first (an engine it pushes to before it serves), then the rollout manager."""
        self._give_trainer()
        serving = self.engines.serving()
        if [m.name for m in serving] != self._sent["rollout"]:
            self.rollout.set_engine_urls([m.url for m in serving]).result()
            self._sent["rollout"] = [m.name for m in serving]

    def _give_trainer(self) -> None:
        """The trainer's set, when it changed (the distributed transport's group; nothing else keeps it)."""
        members = [m for m in self.engines.members if m.state in IN_TRAINER_SET]
        if [m.name for m in members] != self._sent["trainer"]:
            self.fence()
            self.trainer.set_engines([m.url for m in members], [m.actor for m in members]).result()
            self._sent["trainer"] = [m.name for m in members]

    def _served(self) -> dict:
        return self.rollout.engine_served_versions().result()

    def record(self) -> None:
        """engines/fleet.json: the fleet now, the target, the recent changes."""
        served = self._served()
        engines = [{"name": m.name, "url": m.url, "state": _public(m.state), "phase": m.state, "since": m.since,
                    **m.detail, **({"served": served[m.url]} if m.url in served else {})}
                   for m in self.engines.members]
        write_fleet(self.store, {"engines": engines, "target": self.target, "serving": len(self.engines.serving()),
                                 "step": self.step, "version": self.version.delivered, "events": self.events})
        self._recorded = True

    def _event(self, event: str, m: FleetMember | None = None, **extra) -> None:
        who = {"name": m.name, "url": m.url} if m is not None else {}
        self.events.append({"at": time.time(), "step": self.step, "version": self.version.delivered, "event": event,
                            **who, **extra})
        del self.events[:-EVENTS_KEPT]

    def _once(self, key: str, message: str, *args) -> None:
        if key not in self._told:
            self._told.add(key)
            log.warning(message, *args)


def _public(state: str) -> str:
    """starting | serving | draining: a loading or joining engine is still starting."""
    return STARTING if state in (LOADING, JOINING) else state

"""The run's weight version and the pushes that make it (docs/architecture.md, "Who owns what").

    version = WeightVersion()                                       # the one owner of the number
    pusher = WeightPusher(trainer, rollout, fleet, board, version, interval=1, overlap=True)
    pusher.first_push(start_step - 1, restored_version)            # the engines serve the trainer's weights
    v, metrics = pusher.push(step, last=False)                      # the loop, after each step

A push: the trainer exports the next version (`TrainerGroup.push_weights(step, version)`: every rank
holding the whole model writes its part of the weights at once; the driver seals them once all answered);
with the store transport the driver then asks the rollout side to deliver it to the fleet's engines (stage,
pause, load, resume) and holds that call as a handle in the switchboard; with the distributed
transport rank 0 delivered it already. Once delivered, the driver announces the version to the
rollout side (`set_version`) and records it here. With `overlap` (the fully async driver) a push but
the last one does not wait for its delivery: it finishes while the next step trains, in whatever wait
the driver is in (a failure is raised there). A delivery that fails because engines are gone is made
once more to the engines left, after the fleet dropped the lost ones (the fleet owns liveness).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

from miles_core.driver.clients import Pending, RolloutClient
from miles_core.driver.placement import TrainerGroup
from miles_core.driver.switchboard import Switchboard
from miles_core.metrics import names as N
from miles_core.metrics import trace
from miles_core.weights.snapshot import seal_uri


@dataclass
class WeightVersion:
    """The weight version of the run, held here only; every other part asks this object or is told.

    `exported`: the newest version the trainer made (the one the next batch trains under and a checkpoint
    holds); `snapshot`: its weights' run-root URI when they are there; `delivered`: the version every engine
    of the trainer's fleet serves, announced to the rollout side; `delivered_snapshot`: its weights' URI
    (what an engine that joins loads); `delivering`: a delivery is in flight."""

    exported: int = 0
    delivered: int = 0
    snapshot: str | None = None
    delivered_snapshot: str | None = None
    delivering: bool = False


class EngineTargets(Protocol):
    """What a push needs of the engine fleet (miles_core.driver.fleet_reconciler)."""

    def targets(self) -> list[tuple[str, Any]]: ...  # (url, engine actor) of every engine a push reaches
    def drop_lost(self) -> bool: ...  # drop engines whose actor died; True when one was


class WeightPusher:
    def __init__(self, trainer: TrainerGroup, rollout: RolloutClient, engines: EngineTargets, board: Switchboard,
                 version: WeightVersion, *, interval: int = 1, overlap: bool = False):
        self.trainer, self.rollout, self.engines, self.board = trainer, rollout, engines, board
        self.version, self.interval, self.overlap = version, interval, overlap
        self.delivery: Pending | None = None  # the delivery in flight (tracked by the board)
        self._unreported: dict[str, float] = {}  # a finished delivery's metrics, for the next push's

    def first_push(self, step: int, restored_version: int) -> None:
        """The trainer's weights (a checkpoint's hold its own version; a fresh run's are version 1) onto the
        engines, delivered and announced before the rollout side starts generating."""
        self._export_and_deliver(step, max(1, restored_version))
        self.settle()
        self._unreported = {}

    def push(self, step: int, last: bool = False) -> tuple[int, dict[str, float]]:
        """Every `interval` steps and at the last step; returns (the version the next batch trains under,
        this push's metrics)."""
        if (step + 1) % self.interval != 0 and not last:
            return self.version.exported, {}
        self.settle()
        metrics, self._unreported = self._unreported, {}
        metrics |= self._export_and_deliver(step, self.version.exported + 1)
        if last or not self.overlap:
            self.settle()
            metrics |= self._unreported
            self._unreported = {}
        return self.version.exported, metrics | {N.PUBLISHED_VERSION: self.version.exported}

    def settle(self) -> None:
        """Wait for the delivery in flight (raising its failure); its metrics go with the next push's."""
        if self.delivery is None:
            return
        t0 = time.perf_counter()
        with trace.span("weights.wait", lane="weights"):
            while self.delivery is not None:  # a delivery made again to the engines left is waited for too
                self.board.settle(self.delivery)
        self._unreported[N.WEIGHT_DELIVERY_WAIT_SECONDS] = time.perf_counter() - t0

    def _export_and_deliver(self, step: int, version: int) -> dict[str, float]:
        with trace.span("trainer.push_weights", lane="step", step=step):
            out = self._pushed(step, version)
        self.version.exported, self.version.snapshot = version, out.pop("snapshot", None)
        if not out.pop("sealed", True):  # written in parts by the ranks, all of which answered: complete now
            seal_uri(self.version.snapshot)
        if out.pop("delivered"):
            self._announce(version, self.version.snapshot)
            return out
        self._deliver(version, self.version.snapshot, retried=False)
        return out

    def _pushed(self, step: int, version: int) -> dict:
        """The trainer's push; one that failed because engines were lost (the distributed transport delivers
        in it) is made once more to the engines left."""
        try:
            return self.board.wait(self.trainer.push_weights(step, version))
        except Exception:
            if not self.engines.drop_lost():
                raise
        return self.board.wait(self.trainer.push_weights(step, version))

    def _deliver(self, version: int, uri: str | None, retried: bool) -> None:
        assert uri is not None, "the store transport's push names its snapshot"
        self.version.delivering = True
        targets = self.engines.targets()
        self.delivery = self.rollout.deliver_weights(uri, version, targets)
        sent = [url for url, _ in targets]
        self.board.track(self.delivery, lambda done: self._delivered(done, version, uri, retried, sent))

    def _delivered(self, done: Pending, version: int, uri: str, retried: bool, sent: list[str]) -> None:
        self.delivery = None
        try:
            metrics = done.result()
        except Exception:
            self.version.delivering = False
            dropped = self.engines.drop_lost()  # also when the fleet dropped one since the delivery began
            if retried or not (dropped or [url for url, _ in self.engines.targets()] != sent):
                raise
            self._deliver(version, uri, retried=True)
            return
        self._unreported |= metrics
        self._announce(version, uri)

    def _announce(self, version: int, uri: str | None) -> None:
        self.version.delivered, self.version.delivered_snapshot, self.version.delivering = version, uri, False
        self.board.wait(self.rollout.set_version(version))

"""Build the roles the training loop drives, once, from the config (docs/fully-async.md).

Modes are decided here: which batch source (sync / one-step-off / fully async), whether the
checkpointer saves, how evals run. Each role owns its cadence, so the loop never reads a flag.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress

from miles_core.driver.clients import Pending, RolloutClient
from miles_core.driver.feed_publisher import NoFeed
from miles_core.driver.fleet_reconciler import NoFleet
from miles_core.driver.loop import Batch, BatchSource
from miles_core.driver.placement import TrainerGroup
from miles_core.driver.pushes import WeightVersion
from miles_core.driver.switchboard import Switchboard
from miles_core.driver.timeline import NoTimeline
from miles_core.metrics import names as N
from miles_core.metrics import trace
from miles_core.rank_batches import TrainBatch
from miles_core.rollout.failures import FailureBudget

log = logging.getLogger(__name__)

def _as_batch(step: int, drained: TrainBatch | None) -> Batch:
    if drained is None:  # the manager answers None once it was stopped: no batch will come
        raise RuntimeError(f"the rollout side stopped before step {step}'s batch was drained")
    return Batch(step, list(drained.parts), list(drained.group_ids), dict(drained.metrics), dict(drained.failures))


class OnDemandBatches:
    """sync: generate batch k (the producer idles between batches), then train on it."""

    def __init__(self, rollout: RolloutClient, board: Switchboard, version: WeightVersion):
        self.rollout, self.board, self.version = rollout, board, version

    def next_batch(self, step: int) -> Batch:
        t0 = time.monotonic()
        batch = _as_batch(step, self.board.wait(self.rollout.next_train_batch(self.version.exported)))
        batch.metrics[N.TRAIN_WAIT_SECONDS] = time.monotonic() - t0
        return batch

    def before_weight_update(self, last: bool = False) -> None:
        pass

    def metrics(self) -> dict:
        return {}


class PrefetchedBatches:
    """one-step-off and fully async: batch k+1 is requested while the trainer works on batch k.

    one-step-off generates it; fully async drains it from the buffer that the continuous producer
    fills. Either way the driver waits for it before the next weight update (docs/fully-async.md), which is one
    source of staleness. The drain checks staleness against the version batch k+1 will be trained
    under: one more than now when step k ends with a weight push. The wait is the switchboard's: a
    delivery in flight, a rank that died and the duties are seen while it lasts.
    """

    def __init__(self, rollout: RolloutClient, board: Switchboard, version: WeightVersion, update_interval: int = 1):
        self.rollout, self.board, self.version, self.update_interval = rollout, board, version, update_interval
        self.pending: Pending | None = None

    def next_batch(self, step: int) -> Batch:
        t0 = time.monotonic()
        pending = self.pending if self.pending is not None else self.rollout.next_train_batch(self.version.exported)
        drained = self.board.wait(pending)
        pushes_after_step = (step + 1) % self.update_interval == 0
        self.pending = self.rollout.next_train_batch(self.version.exported + int(pushes_after_step))
        batch = _as_batch(step, drained)
        batch.metrics[N.TRAIN_WAIT_SECONDS] = time.monotonic() - t0
        return batch

    def before_weight_update(self, last: bool = False) -> None:
        # After the last step no batch is trained: don't wait for it (its groups stay unconsumed
        # in the buffer and are served first when the run resumes).
        if self.pending is not None and not last:
            self.board.wait(self.pending)

    def metrics(self) -> dict:
        return {}


class TrainerRole:
    def __init__(self, trainer: TrainerGroup, board: Switchboard):
        self.trainer, self.board = trainer, board

    def train_step(self, step: int, batch: Batch) -> dict:
        return self.board.wait(self.trainer.train_parts(step, batch.parts))


class Checkpointer:
    """Records the consumed group ids every step; saves trainer + rollout state at the cadence.

    A step's consumption record is written while the next step trains: the step waits only for the
    previous one's (and for its own before a checkpoint, which covers it, or on the last step). A record
    still in flight when the driver dies costs nothing: the resume starts from a checkpoint, and steps
    after it train their groups again whether or not their records were written."""

    def __init__(self, trainer, rollout: RolloutClient, board: Switchboard, save_interval: int | None, enabled: bool,
                 on_saved: Callable[[int], object] = lambda step: None):
        self.trainer, self.rollout, self.board = trainer, rollout, board
        self.save_interval, self.enabled, self.on_saved = save_interval, enabled, on_saved
        self.last_saved: int | None = None
        self.recording: Pending | None = None  # the rollout side's record_consumed call in flight

    def save(self, step: int, consumed: list[str], version: int, last: bool) -> None:
        self.recorded()
        self.recording = self.rollout.record_consumed(step, consumed)
        due = self.enabled and (last or (self.save_interval is not None and (step + 1) % self.save_interval == 0))
        if last or due:
            self.recorded()
        if not due:
            return
        extras = {"rollout_state": self.board.wait(self.rollout.state()), "weight_version": version,
                  "consumed_through_step": step}
        self.board.wait(self.trainer.save_checkpoint(step, extras))
        self.board.wait(self.rollout.compact_buffer(step))  # complete: no resume starts before it again
        self.last_saved = step
        self.on_saved(step)

    def recorded(self) -> None:
        """Wait for the consumption record in flight (raising its failure)."""
        pending, self.recording = self.recording, None
        if pending is not None:
            with trace.span("rollout.record_consumed", lane="step"):
                self.board.wait(pending)


class MetricsLog:
    """Each step's metrics into the run root's sink, and to live exporters (Prometheus) when served."""

    def __init__(self, sink, live=()):
        self.sink, self.live = sink, list(live)
        self.history: list[dict] = []

    def log(self, step: int, metrics: dict) -> None:
        self.sink.log(step, metrics)
        for exporter in self.live:
            exporter.log(step, metrics)
        self.history.append({"step": step, **metrics})


class Progress:
    """A rich progress bar on a terminal; one log line every 10 steps elsewhere."""

    def __init__(self, total: int, start: int, enabled: bool):
        self.enabled, self.total, self.start = enabled, total, start
        self.bar = None
        if enabled and sys.stderr.isatty():
            self.bar = RichProgress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                                    TextColumn("{task.fields[info]}"), TimeElapsedColumn(), transient=False)
            self.task = self.bar.add_task("train", total=total, completed=start, info="")
            self.bar.start()

    def update(self, step: int, m: dict) -> None:
        info = (f"reward {m.get(N.REWARD, float('nan')):.3f}  "
                f"staleness {m.get(N.AVG_STALENESS, 0.0):.2f}  "
                f"{m.get(N.TOKENS_PER_SECOND, 0.0):.0f} tok/s")
        if self.bar is not None:
            self.bar.update(self.task, completed=step + 1, info=info)
        elif self.enabled and ((step + 1) % 10 == 0 or step == self.start):
            print(f"[miles] step {step + 1}/{self.total}  {info}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


@dataclass
class Deadline:
    seconds: float | None
    t0: float = field(default_factory=time.monotonic)

    def expired(self) -> bool:
        return self.seconds is not None and time.monotonic() - self.t0 >= self.seconds


class Evals(Protocol):
    def on_step(self, step: int, version: int, last: bool = False) -> None: ...


class FleetRole(Protocol):
    def reconcile(self, step: int) -> dict[str, float]: ...


class FeedRole(Protocol):
    def publish(self, step: int) -> None: ...


class TimelineRole(Protocol):
    def on_step(self, step: int) -> None: ...


class FailureWindow(Protocol):
    def observe(self, step: int, failures: dict, last: bool = False) -> None: ...


class Weights(Protocol):
    def push(self, step: int, last: bool = False) -> tuple[int, dict[str, float]]: ...


class Checkpoints(Protocol):
    def save(self, step: int, consumed: list[str], version: int, last: bool) -> None: ...


@dataclass
class Roles:
    driver: str
    start_step: int
    end_step: int
    end_reason: str
    batches: BatchSource
    trainer: TrainerRole
    weights: Weights
    checkpoints: Checkpoints
    evals: Evals
    metrics: MetricsLog
    progress: Progress
    deadline: Deadline
    fence: Callable[[], None] = lambda: None  # raises when this writer lost the run root's lease
    feed: FeedRole = field(default_factory=NoFeed)  # what producer jobs read after each step (miles_core.driver.feed_publisher)
    fleet: FleetRole = field(default_factory=NoFleet)  # the engine fleet's size (miles_core.driver.fleet_reconciler)
    timeline: TimelineRole = field(default_factory=NoTimeline)  # the trace's window (miles_core.driver.timeline)
    # samples whose reward / generate function failed, over a window of steps (miles_core.rollout.failures)
    failures: FailureWindow = field(default_factory=lambda: FailureBudget(1.0, 1))


def batch_source(driver: str, rollout: RolloutClient, board: Switchboard, version: WeightVersion,
                 update_interval: int = 1) -> BatchSource:
    if driver == "sync":
        return OnDemandBatches(rollout, board, version)
    return PrefetchedBatches(rollout, board, version, update_interval)


"""Build the roles the training loop drives, once, from the config (docs/fully-async.md).

Modes are decided here: which batch source (sync / one-step-off / fully async), whether the
checkpointer saves, how evals run. Each role owns its cadence, so the loop never reads a flag.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress

from miles_core.driver.feed import NoFeed
from miles_core.driver.fleet_reconciler import NoFleet
from miles_core.driver.loop import Batch
from miles_core.driver.timeline import NoTimeline
from miles_core.metrics import names as N
from miles_core.metrics import trace
from miles_core.rollout.failures import FailureBudget

log = logging.getLogger(__name__)

WATCH_SECONDS = 5.0  # how often a driver waiting for a batch checks that what it waits for can still come


def _as_batch(step: int, drained) -> Batch:
    return Batch(step, list(drained.groups), list(drained.group_ids), dict(drained.metrics),
                 dict(getattr(drained, "failures", None) or {}))


class OnDemandBatches:
    """sync: generate batch k (the producer idles between batches), then train on it."""

    def __init__(self, rollout, version_box: list[int]):
        self.rollout, self.version_box = rollout, version_box

    def next_batch(self, step: int) -> Batch:
        t0 = time.monotonic()
        batch = _as_batch(step, self.rollout.call("next_batch", self.version_box[0]).result())
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
    source of staleness (docs/fully-async.md). The drain checks staleness against the version
    batch k+1 will be trained under: one more than now when step k ends with a weight push.
    """

    def __init__(self, rollout, version_box: list[int], update_interval: int = 1,
                 watch: Callable[[], None] = lambda: None):
        self.rollout, self.version_box, self.update_interval = rollout, version_box, update_interval
        self.watch = watch
        self.pending = None

    def next_batch(self, step: int) -> Batch:
        t0 = time.monotonic()
        future = self.pending if self.pending is not None else self.rollout.call("next_batch", self.version_box[0])
        drained = self._wait(future)
        pushes_after_step = (step + 1) % self.update_interval == 0
        self.pending = self.rollout.call("next_batch", self.version_box[0] + int(pushes_after_step))
        batch = _as_batch(step, drained)
        batch.metrics[N.TRAIN_WAIT_SECONDS] = time.monotonic() - t0
        return batch

    def before_weight_update(self, last: bool = False) -> None:
        # After the last step no batch is trained: don't wait for it (its groups stay unconsumed
        # in the buffer and are served first when the run resumes).
        if self.pending is not None and not last:
            self._wait(self.pending)

    def _wait(self, drain):
        """The drain's batch; every WATCH_SECONDS without it, `watch()`, which raises when the groups it
        waits for can no longer come (the trainer that was to deliver their version is gone)."""
        while True:
            try:
                return drain.result(timeout=WATCH_SECONDS)
            except TimeoutError:
                self.watch()

    def metrics(self) -> dict:
        return {}


class TrainerRole:
    def __init__(self, trainer):
        self.trainer = trainer

    def train_step(self, step: int, batch: Batch) -> dict:
        return self.trainer.call("train_step", step, batch.groups).result()


class WeightPusher:
    """Pushes every --update-weights-interval steps (and at the last step), then publishes the
    version to the rollout side. The engine actors that loaded the weights noted them themselves
    (a restarted engine comes back on them).

    The step does not wait for the rollout side to take the version: its calls run in the order they
    were made, so whatever the driver asks of it next sees the new version; a failure to take it is
    raised at the next push (or at once on the last step).

    With `overlap` (the fully async driver) a push but the last one asks the trainer not to wait for
    the engines: it returns once the weights are exported, the engines load them while the next step
    trains, and the trainer publishes the version to the rollout side itself once they serve it
    ("published" in its answer); a failure of that delivery is raised by the next push."""

    def __init__(self, trainer, rollout, interval: int, version_box: list[int], overlap: bool = False):
        self.trainer, self.rollout = trainer, rollout
        self.interval, self.version_box, self.overlap = interval, version_box, overlap
        self.snapshot: str | None = None  # the run-root URI of the pushed weights, when published there
        self.publishing = None  # the rollout side's set_version call in flight

    def push(self, step: int, last: bool = False) -> tuple[int, dict]:
        if (step + 1) % self.interval != 0 and not last:
            return self.version_box[0], {}
        self.published()
        with trace.span("trainer.push_weights", lane="step", step=step):
            out = self.trainer.call("push_weights", step, last or not self.overlap).result()
        version = out.pop("version")
        self.snapshot = out.pop("snapshot", None) or self.snapshot
        if not out.pop("published", False):
            self.publishing = self.rollout.call("set_version", version)
        if last:
            self.published()
        self.version_box[0] = version
        return version, out | {N.PUBLISHED_VERSION: version}

    def watch(self) -> None:
        """Raise when the version pushed last can no longer reach the rollout side: with `overlap` only the
        trainer tells it, once delivered, and a rank gone or a failed delivery would never tell it."""
        if self.overlap:
            self.trainer.call("check_delivery").result()

    def published(self) -> None:
        """Wait for the version published last (raising its failure)."""
        pending, self.publishing = self.publishing, None
        if pending is not None:
            pending.result()


class Checkpointer:
    """Records the consumed group ids every step; saves trainer + rollout state at the cadence.

    A step's consumption record is written while the next step trains: the step waits only for the
    previous one's (and for its own before a checkpoint, which covers it, or on the last step). A record
    still in flight when the driver dies costs nothing: the resume starts from a checkpoint, and steps
    after it train their groups again whether or not their records were written."""

    def __init__(self, trainer, rollout, save_interval: int | None, enabled: bool,
                 on_saved: Callable[[int], None] = lambda step: None):
        self.trainer, self.rollout = trainer, rollout
        self.save_interval, self.enabled, self.on_saved = save_interval, enabled, on_saved
        self.last_saved: int | None = None
        self.recording = None  # the rollout side's record_consumed call in flight

    def save(self, step: int, consumed: list[str], version: int, last: bool) -> None:
        self.recorded()
        self.recording = self.rollout.call("record_consumed", step, consumed)
        due = self.enabled and (last or (self.save_interval is not None and (step + 1) % self.save_interval == 0))
        if last or due:
            self.recorded()
        if not due:
            return
        extras = {"rollout_state": self.rollout.call("state").result(), "weight_version": version,
                  "consumed_through_step": step}
        self.trainer.call("save_checkpoint", step, extras).result()
        self.rollout.call("compact_buffer", step).result()  # complete: no resume starts before it again
        self.last_saved = step
        self.on_saved(step)

    def recorded(self) -> None:
        """Wait for the consumption record in flight (raising its failure)."""
        pending, self.recording = self.recording, None
        if pending is not None:
            with trace.span("rollout.record_consumed", lane="step"):
                pending.result()


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


@dataclass
class Roles:
    driver: str
    start_step: int
    end_step: int
    end_reason: str
    batches: Any
    trainer: TrainerRole
    weights: WeightPusher
    checkpoints: Checkpointer
    evals: Any
    metrics: MetricsLog
    progress: Progress
    deadline: Deadline
    feed: Any = field(default_factory=NoFeed)  # what producer jobs read after each step (miles_core.driver.feed)
    fleet: Any = field(default_factory=NoFleet)  # the engine fleet's size (miles_core.driver.fleet_reconciler)
    timeline: Any = field(default_factory=NoTimeline)  # the trace's window (miles_core.driver.timeline)
    # samples whose reward / generate function failed, over a window of steps (miles_core.rollout.failures)
    failures: Any = field(default_factory=lambda: FailureBudget(1.0, 1))


def batch_source(driver: str, rollout, version_box: list[int], update_interval: int = 1,
                 watch: Callable[[], None] = lambda: None):
    if driver == "sync":
        return OnDemandBatches(rollout, version_box)
    return PrefetchedBatches(rollout, version_box, update_interval, watch)

"""The one training loop shared by the sync, one-step-off and fully async drivers (docs/fully-async.md).

The drivers differ only in the batch source that `build_roles` picks; every component owns its
cadence (the checkpointer decides whether a step saves, the eval scheduler whether it evaluates,
the weight pusher whether this step pushes), so the loop reads like the sequence diagram.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from miles_core.metrics import trace
from miles_core.metrics.names import STEP_SECONDS


@dataclass
class Batch:
    step: int
    parts: list  # one per data-parallel rank, by reference (miles_core.rank_batches.TrainBatch)
    group_ids: list[str]
    metrics: dict[str, float] = field(default_factory=dict)
    failures: dict = field(default_factory=dict)  # samples tried/failed per kind (miles_core.rollout.failures)


class BatchSource(Protocol):
    def next_batch(self, step: int) -> Batch: ...
    def before_weight_update(self, last: bool = False) -> None: ...
    def metrics(self) -> dict[str, float]: ...


@dataclass
class LoopResult:
    first_step: int
    last_step: int | None
    steps_run: int
    stopped_by: str  # "num_rollout" | "segment_steps" | "deadline"
    seconds: float


def run_loop(roles) -> LoopResult:
    """Train from roles.start_step until roles.end_step (exclusive) or the deadline.

    `roles.fence()` (the run root's lease check, miles_core.storage.lease) runs before the weight push and
    before the checkpoint: they come before anything else of the step is committed (snapshot, consumption
    record, checkpoint, STATUS, evals, metrics), so a writer that lost the lease commits nothing more.
    Each role's call is a span of the step in the run's timeline trace."""
    t0, step, stopped_by = time.monotonic(), None, "num_rollout"
    for step in range(roles.start_step, roles.end_step):
        with trace.span(trace.STEP_SPAN, lane="step", step=step):
            step_t0 = time.monotonic()
            with _span("batches.next_batch"):
                batch = roles.batches.next_batch(step)
            with _span("trainer.train_step"):
                metrics = roles.trainer.train_step(step, batch)
            last = step == roles.end_step - 1 or roles.deadline.expired()
            with _span("batches.before_weight_update"):
                roles.batches.before_weight_update(last=last)  # wait for the prefetched drain of the next batch
            roles.fence()
            with _span("weights.push"):
                version, push_metrics = roles.weights.push(step, last=last)
            with _span("fleet.reconcile"):
                fleet_metrics = roles.fleet.reconcile(step)  # engines join and leave (engines/target.json)
            roles.fence()
            with _span("checkpoints.save"):
                roles.checkpoints.save(step, consumed=batch.group_ids, version=version, last=last)
            with _span("feed.publish"):
                roles.feed.publish(step)
            with _span("evals.on_step"):
                roles.evals.on_step(step, version, last=last)
            step_metrics = metrics | batch.metrics | push_metrics | fleet_metrics | roles.batches.metrics()
            step_metrics[STEP_SECONDS] = time.monotonic() - step_t0
            roles.metrics.log(step, step_metrics)
            roles.failures.observe(step, batch.failures, last=last)  # too many failed samples: the run fails
            roles.progress.update(step, step_metrics)
        roles.timeline.on_step(step)
        if last:
            stopped_by = "deadline" if step != roles.end_step - 1 else roles.end_reason
            break
    steps_run = 0 if step is None else step - roles.start_step + 1
    return LoopResult(roles.start_step, step, steps_run, stopped_by, time.monotonic() - t0)


def _span(name: str):
    return trace.span(name, lane="step")

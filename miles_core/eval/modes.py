"""The three places an eval can run (docs/evaluation.md), behind one small interface.

    SharedEngines     Mode 1: the rollout engines. The producer stops submitting new groups for
                      the duration (in-flight groups finish normally; nothing is aborted), the eval
                      runs, submission resumes. Blocking: training waits, so the engines' weights
                      cannot change under the eval.
    DedicatedEngines  Mode 2 (--eval-num-gpus): engines that never join the training weight push.
                      Each eval pins them to the step's snapshot (load from disk, read the version
                      back from every engine) and runs in the background; evals run one at a time.
    SnapshotTasks     Mode 3 (default): nothing runs in-process. The step is requested in
                      eval/requests/ and the eval_follower task (miles_core.eval.follower) does it.

`start(job)` returns a concurrent Future of an `Outcome` (None for Mode 3); results and metrics are
recorded by the mode itself, in the eval thread, so they are durable as soon as they exist.
Naming convention: `start` never blocks on an eval except in SharedEngines, where blocking is
the point.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from miles_core.engines.client import EngineClient
from miles_core.eval.datasets import EvalDataset, EvalSampling
from miles_core.eval.evaluate import EvalAborted, evaluate_all
from miles_core.eval.pinning import EvalSkip, check_health, pin, pin_by, verify_versions
from miles_core.eval.results import record_evals, record_skip, write_request
from miles_core.storage import Store
from miles_core.storage.node_local import localize

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalJob:
    step: int
    version: int | None
    snapshot_uri: str  # "" when there is no snapshot (Mode 1 without export)


@dataclass
class Outcome:
    step: int
    metrics: dict[str, float] = field(default_factory=dict)
    skipped: str = ""  # a miles_core.metrics.names.SKIP_REASONS entry when the eval did not happen
    detail: str = ""


@dataclass
class EvalContext:
    """What every mode needs to evaluate and record: shared, read-only after construction."""

    store: Store  # the run root
    datasets: list[EvalDataset]
    sampling: EvalSampling
    metrics: Any  # a sink with log(step, dict) (MetricsSink), or None
    latest_step: Callable[[], int]  # the latest trained step, for eval/lag_steps
    request_timeout_seconds: float = 600.0


class EventLoopThread:
    """One asyncio loop on a daemon thread: engine clients live and die inside it."""

    def __init__(self, name: str = "eval-loop"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


async def _maybe_await(value):
    if inspect.isawaitable(value):
        return await value
    return value


def skip_reason(e: BaseException) -> tuple[str, str]:
    if isinstance(e, EvalSkip):
        return e.reason, str(e)
    if isinstance(e, EvalAborted):
        return "crashed", str(e)
    return "crashed", f"{type(e).__name__}: {e}"


def _record(ctx: EvalContext, job: EvalJob, evals, mode: str, version: int | None, t0: float) -> Outcome:
    lag = max(0, ctx.latest_step() - job.step)
    metrics = record_evals(ctx.store, evals, step=job.step, version=version, snapshot_uri=job.snapshot_uri,
                           datasets=ctx.datasets, sampling=ctx.sampling, mode=mode, lag_steps=lag,
                           duration_seconds=time.monotonic() - t0, metrics=ctx.metrics)
    return Outcome(job.step, metrics)


def record_failure(ctx: EvalContext, job: EvalJob, e: BaseException) -> Outcome:
    reason, detail = skip_reason(e)
    log.warning("eval of step %d skipped (%s): %s", job.step, reason, detail)
    return Outcome(job.step, record_skip(ctx.store, job.step, reason, detail, ctx.metrics), reason, detail)


def _client(urls: Sequence[str], timeout: float):
    return EngineClient(list(urls), request_timeout_seconds=timeout)


class SharedEngines:
    mode = "shared"

    def __init__(self, ctx: EvalContext, loop: EventLoopThread,
                 engine_urls: Sequence[str] | Callable[[], Sequence[str]],
                 pause_submission: Callable[[], Any], resume_submission: Callable[[], Any]):
        """`engine_urls`: the rollout engines, or a callable giving those serving now (the fleet changes
        while the run goes on)."""
        self.ctx, self.loop = ctx, loop
        self._urls = engine_urls if callable(engine_urls) else (lambda urls=list(engine_urls): urls)
        self.pause_submission, self.resume_submission = pause_submission, resume_submission

    @property
    def urls(self) -> list[str]:
        return list(self._urls())

    def start(self, job: EvalJob) -> concurrent.futures.Future:
        done: concurrent.futures.Future = concurrent.futures.Future()
        t0 = time.monotonic()
        try:
            try:
                self._hook(self.pause_submission)
                done.set_result(self.loop.submit(self._run(job, t0)).result())
            except Exception as e:  # noqa: BLE001 - an eval never crashes training
                done.set_result(record_failure(self.ctx, job, e))
        finally:
            self._resume()
        return done

    def _resume(self) -> None:
        """Resume submission, whatever happened. A producer that cannot resume would starve
        training silently, so after one retry that error does propagate."""
        try:
            self._hook(self.resume_submission)
        except Exception as e:  # noqa: BLE001
            log.warning("resuming producer submission after the eval failed (%s); retrying once", e)
            self._hook(self.resume_submission)

    def _hook(self, fn) -> None:
        out = fn()
        if inspect.isawaitable(out):
            self.loop.submit(_maybe_await(out)).result()

    async def _run(self, job: EvalJob, t0: float) -> Outcome:
        urls = self.urls
        if not urls:
            return record_failure(self.ctx, job, EvalSkip("no rollout engine serves now", "unhealthy"))
        async with _client(urls, self.ctx.request_timeout_seconds) as client:
            try:
                await check_health(client)
                evals = await evaluate_all(client, self.ctx.datasets, self.ctx.sampling)
            except Exception as e:  # noqa: BLE001
                return record_failure(self.ctx, job, e)
        versions = sorted({v for ev in evals for v in ev.weight_versions})
        if len(versions) > 1:  # training is blocked, so this means an engine restarted mid-eval
            return record_failure(self.ctx, job, EvalSkip(f"shared engines answered with versions {versions}",
                                                           "pin_violation"))
        return _record(self.ctx, job, evals, self.mode, versions[0] if versions else job.version, t0)


class DedicatedEngines:
    mode = "dedicated"

    def __init__(self, ctx: EvalContext, loop: EventLoopThread, engine_urls: Sequence[str], load=None):
        """`load(uri, version, flush_cache)`: the engines' own loading (EngineFleet.load_weights);
        without it the engines are this node's and load a copy made here."""
        self.ctx, self.loop, self.urls, self.load = ctx, loop, list(engine_urls), load
        self._one_at_a_time: asyncio.Lock | None = None

    def start(self, job: EvalJob) -> concurrent.futures.Future:
        return self.loop.submit(self._run(job))

    async def _run(self, job: EvalJob) -> Outcome:
        if self._one_at_a_time is None:
            self._one_at_a_time = asyncio.Lock()
        async with self._one_at_a_time:
            t0 = time.monotonic()
            try:
                version = job.version if job.version is not None else job.step + 1
                async with _client(self.urls, self.ctx.request_timeout_seconds) as client:
                    if self.load is not None:
                        await pin_by(self.load, client, job.snapshot_uri, version)
                    else:
                        await pin(client, await asyncio.to_thread(localize, job.snapshot_uri, "snapshots"), version)
                    evals = await evaluate_all(client, self.ctx.datasets, self.ctx.sampling)
                for ev in evals:
                    if ev.weight_versions:
                        verify_versions({f"responses of {ev.dataset} #{i}": v for i, v in enumerate(ev.weight_versions)}, version)
                return _record(self.ctx, job, evals, self.mode, version, t0)
            except Exception as e:  # noqa: BLE001 - an eval never crashes training
                return record_failure(self.ctx, job, e)


class SnapshotTasks:
    mode = "tasks"

    def __init__(self, ctx: EvalContext):
        self.ctx = ctx

    def start(self, job: EvalJob) -> None:
        write_request(self.ctx.store, job.step, job.snapshot_uri, job.version)
        return None

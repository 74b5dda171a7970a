"""The consumer side: drain exactly one training batch of groups from the buffer (docs/fully-async.md).

    batch = await drain_batch(consumer, batch_size, current_version=v, sample_filter=f)

takes exactly `batch_size` groups (`--rollout-batch-size`) through `ProducerGuardedBuffer`, sorts
them by prompt index, applies the `--rollout-sample-filter-path` function (mark only: it may set
`loss_mask` entries to 0; it may not drop groups or samples), and attaches the rollout metrics of
the batch (`miles_core.rollout.batch_metrics`: with producer jobs, who generated it), the buffer's window
metrics and the producer's. While
starved it logs a warning every `starved_warn_seconds` (30 s); the time it waited is
`perf/train_wait_seconds`.

`generate_batch` is the sync / one-step-off path with the same machinery: it permits a
batch-mode producer exactly `batch_size` more groups and drains them (rejected groups are
replaced, since they give their place back). A sync driver awaits it and then trains; a
one-step-off driver starts it for batch k+1 before training on batch k.

`ProducerGuardedBuffer` is the consumer's view of the buffer: a failure of the rollout worker is
raised at the next `get`, before any queued group (docs/fully-async.md), whether or not the buffer itself
implements `fail`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from miles_core.config.plugins import load_optional
from miles_core.metrics import names as N
from miles_core.rollout.batch_metrics import batch_metrics, writer_metrics
from miles_core.samples import Group

log = logging.getLogger(__name__)

SAMPLE_FILTER_FLAG = "--rollout-sample-filter-path"
STARVED_WARN_SECONDS = 30.0


class SampleFilterError(RuntimeError):
    def __init__(self, message: str):
        super().__init__(message)


@dataclass
class DrainedBatch:
    groups: list[Group]  # sorted by prompt index
    group_ids: list[str]
    metrics: dict[str, float] = field(default_factory=dict)
    failures: dict = field(default_factory=dict)  # samples tried/failed per kind (miles_core.rollout.failures)


class ProducerGuardedBuffer:
    """The buffer's get side, guarded by the producer's worker-error slot.

    `get` runs the buffer's blocking get on its own thread (so it never starves behind blocked
    puts) and raises the producer's `error` first, or as soon as it is set while waiting.
    """

    def __init__(self, buffer: Any, producer: Any):
        self.buffer = buffer
        self.producer = producer
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-get")
        self._failed = asyncio.Event()
        producer.on_error(lambda _e: self._set_failed())
        self._loop: asyncio.AbstractEventLoop | None = None

    def _set_failed(self) -> None:
        loop = self._loop
        if loop is not None and loop.is_running():
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is not loop:
                loop.call_soon_threadsafe(self._failed.set)
                return
        self._failed.set()

    def _raise_if_failed(self) -> None:
        if self.producer.error is not None:
            raise self.producer.error

    async def get(self, **context: Any) -> Group:
        self._loop = asyncio.get_running_loop()
        self._raise_if_failed()
        if inspect.iscoroutinefunction(getattr(self.buffer, "get", None)):
            fut: asyncio.Future = asyncio.ensure_future(self.buffer.get(**context))
        else:
            fut = self._loop.run_in_executor(self._pool, lambda: self.buffer.get(**context))
        failed = asyncio.ensure_future(self._failed.wait())
        try:
            await asyncio.wait({fut, failed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            failed.cancel()
        if self.producer.error is not None:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                log.warning("a group got while the rollout worker failed stays unconsumed (re-served on resume)")
            elif not fut.done():
                fut.cancel()
            raise self.producer.error
        return fut.result()

    def get_metrics(self) -> dict[str, float]:
        return self.buffer.get_metrics()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def load_sample_filter(path: str) -> Callable[[list[Group]], None] | None:
    return load_optional(path, SAMPLE_FILTER_FLAG)


def apply_sample_filter(fn: Callable[[list[Group]], None], groups: list[Group]) -> None:
    """Run the batch-level sample filter, holding it to mark-only."""
    shape = [(g.group_id, [(id(s), len(s.loss_mask)) for s in g.samples]) for g in groups]
    ids = [id(g) for g in groups]
    try:
        fn(groups)
    except Exception as e:
        raise SampleFilterError(f"{SAMPLE_FILTER_FLAG} function raised: {e!r}") from e
    after = [(g.group_id, [(id(s), len(s.loss_mask)) for s in g.samples]) for g in groups]
    if after != shape or [id(g) for g in groups] != ids:
        raise SampleFilterError(f"{SAMPLE_FILTER_FLAG} function changed the batch; it may only set "
                                "sample.loss_mask entries to 0 (mark only), never add, drop or reorder "
                                "groups or samples, nor change a loss mask's length")
    for g in groups:
        for s in g.samples:
            if any(m not in (0, 1) for m in s.loss_mask):
                raise SampleFilterError(f"{SAMPLE_FILTER_FLAG} function set loss_mask values other than 0/1 "
                                        f"on {s.group_id}/{s.sample_index}")


async def drain_batch(consumer: ProducerGuardedBuffer, batch_size: int, *, current_version: int | None,
                      sample_filter: Callable[[list[Group]], None] | None = None,
                      producer_metrics: Callable[[], dict] | None = None,
                      failures: Callable[[], dict] | None = None,
                      starved_warn_seconds: float = STARVED_WARN_SECONDS) -> DrainedBatch:
    """Exactly `batch_size` groups; see the module docstring."""
    t0 = time.monotonic()
    groups: list[Group] = []
    next_warn = t0 + starved_warn_seconds
    while len(groups) < batch_size:
        get = asyncio.ensure_future(consumer.get(current_version=current_version))
        while True:
            done, _ = await asyncio.wait({get}, timeout=max(0.0, next_warn - time.monotonic()))
            if done:
                break
            log.warning("the drain is starved: %d/%d groups after %.0f s waiting for rollout data",
                        len(groups), batch_size, time.monotonic() - t0)
            next_warn += starved_warn_seconds
        groups.append(get.result())
    wait_seconds = time.monotonic() - t0
    groups.sort(key=lambda g: (g.prompt_index, g.group_id))
    if sample_filter is not None:
        apply_sample_filter(sample_filter, groups)
    metrics = batch_metrics(groups) | writer_metrics(groups)
    metrics[N.TRAIN_WAIT_SECONDS] = wait_seconds
    metrics.update(consumer.get_metrics())
    if producer_metrics is not None:
        metrics.update(producer_metrics())
    return DrainedBatch(groups, [g.group_id for g in groups], metrics, failures() if failures is not None else {})


async def generate_batch(producer: Any, consumer: ProducerGuardedBuffer, batch_size: int, *,
                         current_version: int | None,
                         sample_filter: Callable[[list[Group]], None] | None = None,
                         starved_warn_seconds: float = STARVED_WARN_SECONDS) -> DrainedBatch:
    """One batch of exactly `batch_size` groups from a batch-mode producer (sync / one-step-off)."""
    producer.allow(batch_size)
    return await drain_batch(consumer, batch_size, current_version=current_version, sample_filter=sample_filter,
                             producer_metrics=producer.metrics, failures=getattr(producer, "take_failures", None),
                             starved_warn_seconds=starved_warn_seconds)

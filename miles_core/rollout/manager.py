"""The rollout side of a run in one object: data source, producer, buffer and drain (a Ray actor).

    manager = RolloutManager(cfg, engine_urls=urls, state=ckpt_state, consumed_through_step=k)
    await manager.start()
    batch = await manager.next_batch(v)                    # DrainedBatch of exactly B groups
    batch = await manager.next_train_batch(v)              # the same, cut into the trainer's DP parts (by reference)
    await manager.deliver_weights(uri, v + 1, engines)     # the store transport's delivery (the driver asks)
    await manager.set_version(v + 1)                       # the driver announces it once delivered
    state = manager.state()                                # into the checkpoint
    await manager.record_consumed(step, batch.group_ids)   # with the checkpoint (durable)
    await manager.stop()

In production it runs as a Ray async actor (`rollout_manager_actor()` returns the actor class;
every async method is then called with `.remote(...)` and returns a Ray ref the caller must
`ray.get`). The buffer lives in this process because its in-memory index is shared by the put
(producer) and get (drain) sides.

The driver mode is decided once here: `fully-async` runs the producer continuously and
`next_batch` drains B groups; `sync` and `one-step-off` build a batch-mode producer and
`next_batch` generates exactly B groups (a one-step-off driver requests batch k+1 before
training on batch k).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from miles_core.buffer import build_buffer
from miles_core.buffer.contract import BufferExtras
from miles_core.buffer.objects import TRAINER_HOLDER, new_writer_id
from miles_core.engines.client import EngineClient
from miles_core.metrics import names as N
from miles_core.metrics import trace
from miles_core.rank_batches import RankBatch, TrainBatch, data_layout, split_for_run
from miles_core.rollout.assembly import build_rollout_side, notify_filter_drops, rejection_handler
from miles_core.rollout.claims import ClaimRenewer
from miles_core.rollout.drain import (
    DrainedBatch,
    ProducerGuardedBuffer,
    drain_batch,
    generate_batch,
    load_sample_filter,
)
from miles_core.rollout.producer import Producer
from miles_core.rollout.prompts import load_prompts
from miles_core.storage import Store
from miles_core.weights.sync import Exported, StoreWeightTransport, WeightSync
log = logging.getLogger(__name__)


class RolloutManager:
    """See the module docstring. Arguments other than `cfg` replace the component built from it
    (tests and custom deployments): `engine` (else an EngineClient over `engine_urls`), `rows` (else
    the run root's normalized prompts), `buffer_factory(handler)` (else `build_buffer`), `decode`."""

    def __init__(self, cfg, *, engine_urls: list[str] | None = None, engine: Any = None, rows: list[dict] | None = None,
                 buffer_factory: Callable[[Any], Any] | None = None, decode: Callable[[list[int]], str] | None = None,
                 state: dict | None = None, consumed_through_step: int | None = None):
        r = cfg.rollout
        self.cfg = cfg
        self.batch_size = r.rollout_batch_size
        self.layout = data_layout(cfg.train)
        self.batch_mode = cfg.driver != "fully-async"
        if engine is None:
            engine = EngineClient(list(engine_urls or []), request_timeout_seconds=r.engine_request_timeout_seconds)
        self.engine = engine
        if rows is None:
            rows = load_prompts(Store(cfg.run_uri))
        self.writer_id = new_writer_id()

        def buffer_for(producer: Producer):
            handler = rejection_handler(cfg.buffer.async_unused_samples_handler, producer)
            if buffer_factory is not None:
                buffer = buffer_factory(handler)
            elif consumed_through_step is None:
                raise ValueError("RolloutManager needs consumed_through_step (the resume checkpoint's step, -1 "
                                 "without one) to open the run's buffer")
            else:
                buffer = build_buffer(cfg, handler, consumed_through_step=consumed_through_step,
                                      writer_id=self.writer_id)
            notify_filter_drops(buffer, producer.on_rejected)
            return buffer

        # The groups the run's remaining steps take (from the step after the resume checkpoint to
        # --num-rollout): no group starts beyond them (see `_groups_wanted`).
        self._groups_needed = (None if consumed_through_step is None or cfg.run.num_rollout is None else
                               max(0, cfg.run.num_rollout - consumed_through_step - 1) * self.batch_size)
        side = build_rollout_side(cfg, Store(cfg.run_uri), rows=rows, engine=engine, holder=TRAINER_HOLDER,
                                  writer_id=self.writer_id, claims=cfg.buffer.allow_rollout_producers,
                                  sink_for=buffer_for, decode=decode, batch_mode=self.batch_mode,
                                  gates=(self._groups_wanted,))
        self.producer, self.buffer, self.claims = side.producer, side.sink, side.claims
        self.extras = BufferExtras(self.buffer)
        admission = self.producer.admission
        # Renewed from now on: blocks adopted at restore below must not lapse before start().
        self.claims_renewer = ClaimRenewer(self.claims).start() if self.claims is not None else None
        if isinstance(self.engine, EngineClient):  # a fleet of 0 engines starts no group until one joins
            self.producer.set_engines_available(bool(self.engine.urls))
        # Resume (or a fresh start over a run root whose buffer already holds groups, e.g. a crash
        # before the first checkpoint): skip what the buffer committed, count it as started.
        committed = self.extras.committed_positions()
        if state is not None or committed or self.claims is not None:  # claims: adopt this holder's blocks
            report = self.producer.restore(state or self.producer.state(), committed)
            log.info("rollout state restored: %s; started groups %d", report, admission.started_groups)
        self.consumer = ProducerGuardedBuffer(self.buffer, self.producer)
        self.sample_filter = load_sample_filter(r.rollout_sample_filter_path)
        self.stopping = False

    def _groups_wanted(self) -> bool:
        """The producer's gate: whether the run's remaining steps still need a group beyond those in
        flight and those the buffer received (any writer's, queued or handed to the drain). Without it
        a fully async run generated up to its staleness bound past its last step: on a 2-step run of the
        calculator preset, 12 groups of multi-turn episodes beyond the 8 it trained. A group lost or
        rejected leaves the count, and the producer is woken then (miles_core.rollout.producer), so the
        run never waits on a group the gate held back. A buffer without `groups_received` (a custom one)
        is not gated."""
        received = self.extras.groups_received()
        if self._groups_needed is None or received is None:
            return True
        return self.producer.in_flight_groups + received < self._groups_needed

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self.producer.start()

    async def stop(self, grace_seconds: float = 30.0) -> None:
        self.stopping = True
        await self.producer.stop(grace_seconds)
        if self.claims is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._release_claims)
        self.consumer.close()
        await asyncio.get_running_loop().run_in_executor(None, self.extras.close)
        aclose = getattr(self.engine, "close", None)
        if callable(aclose):
            result = aclose()
            if asyncio.iscoroutine(result):
                await result

    # ------------------------------------------------------------------ the driver's calls
    async def next_batch(self, current_version: int) -> DrainedBatch | None:
        """Exactly rollout_batch_size groups, sorted by prompt index, filtered, with metrics. None
        when the manager stops under it: the driver's prefetch of the batch after its last step,
        which it never reads (an error there would only be logged by Ray as unhandled)."""
        try:
            return await self._next_batch(current_version)
        except (Exception, asyncio.CancelledError):  # the buffer's close cancels a get in progress
            if self.stopping and not asyncio.current_task().cancelling():  # not this call being cancelled
                return None
            raise

    async def next_train_batch(self, current_version: int) -> TrainBatch | None:
        """`next_batch`, as the trainer takes it: cut into one part per data-parallel rank
        (miles_core.rank_batches), each handed over by `_hand_over` (by reference in the Ray actor), so the
        driver receives the group ids, metrics and failure tally and never the samples."""
        drained = await self.next_batch(current_version)
        if drained is None:
            return None
        parts = split_for_run(drained.groups, self.layout, self.cfg)
        return TrainBatch(drained.group_ids, drained.metrics, drained.failures, [self._hand_over(p) for p in parts])

    def _hand_over(self, part: RankBatch) -> Any:
        return part

    async def _next_batch(self, version: int) -> DrainedBatch:
        if self.batch_mode:
            return await generate_batch(self.producer, self.consumer, self.batch_size, current_version=version,
                                        sample_filter=self.sample_filter)
        return await drain_batch(self.consumer, self.batch_size, current_version=version,
                                 sample_filter=self.sample_filter, producer_metrics=self.producer.metrics,
                                 failures=self.producer.take_failures)

    async def set_version(self, version: int) -> None:
        """The driver announces `version`: every engine generation uses serves it (its delivery is done)."""
        self.producer.set_version(version)

    async def deliver_weights(self, uri: str, version: int, engines: list[tuple[str, Any]]) -> dict[str, float]:
        """The store transport's delivery of `version` (its snapshot at `uri` in the run root) to `engines`,
        (url, engine actor) pairs named by the driver's fleet: each actor copies it to its node and stages
        it while the engines generate, then every engine pauses, loads, resumes (weights.sync.paused_load).
        A failure (an engine gone: its actor died) is raised; the driver decides what follows."""
        if not engines:
            return {}
        import ray

        def stager(actor):
            return lambda u: ray.get(actor.stage_weights.remote(u))

        def loader(actor):
            return lambda u, v: ray.get(actor.load_weights.remote(u, v))

        transport = StoreWeightTransport(None, None, loaders=[loader(a) for _, a in engines],
                                         stagers=[stager(a) for _, a in engines])
        transport.uri = uri
        async with EngineClient([url for url, _ in engines], control_retries=6) as control:
            sync = WeightSync([control], transport, self.cfg.rollout.pause_generation_mode)
            result = await sync.deliver(Exported(-1, version, uri, time.perf_counter(), 0.0))
        read = transport.read  # what the engines' nodes read to rebuild the version (docs/weight-versions.md)
        return {N.WEIGHT_UPDATE_SECONDS: result.total_seconds, N.ENGINE_PAUSE_SECONDS: result.pause_seconds,
                **({N.WEIGHTS_READ_BYTES: read["read_bytes"], N.WEIGHTS_APPLY_SECONDS: read["apply_seconds"],
                    N.WEIGHTS_ANCHOR_READS: read["anchor_reads"], N.WEIGHTS_CHECKSUM_FAILURES: read["checksum_failures"]}
                   if read else {})}

    async def set_engine_urls(self, urls: list[str]) -> None:
        """The engines generation may use from now on (the fleet changed): a dropped engine gets no new
        request (its requests in flight finish or abort); with none, no group starts until one joins."""
        self.engine.set_urls(list(urls))
        self.producer.set_engines_available(bool(urls))

    def engine_in_flight(self) -> dict[str, int]:
        """Requests in flight per engine URL, engines dropped by `set_engine_urls` included while they have any."""
        return self.engine.in_flight()

    def engine_served_versions(self) -> dict[str, dict[str, int]]:
        """Per engine URL: the lowest and highest weight version it generated with (EngineClient.served_versions)."""
        return self.engine.served_versions()

    async def pause(self) -> None:
        self.producer.pause()

    async def resume(self) -> None:
        self.producer.resume()

    def state(self) -> dict:
        return self.producer.state()

    def feed_state(self, version: int | None = None) -> dict:
        """What producer jobs need of this buffer (miles_core.driver.feed_publisher): the groups queued that a step
        under `version` can still use (stale ones are about to be dropped: they hold no room), its
        capacity, and how many other writers committed lately (they share the room)."""
        return {"queue_size": self.extras.usable_queue_size(version), "capacity": self.cfg.buffer_capacity_groups,
                "producers": self.extras.recent_foreign_writers()}

    def _release_claims(self) -> None:
        if self.claims_renewer is not None:
            self.claims_renewer.stop()
        self.claims.release()

    async def record_consumed(self, step: int, group_ids: list[str]) -> None:
        at, t = trace.now(), trace.tracer()
        for group_id in group_ids:
            if t.traces_group(group_id):
                t.async_span("consumed", group_id, at, at, cat="group", step=step)
        await asyncio.get_running_loop().run_in_executor(None, self.extras.record_consumed, step, list(group_ids))

    async def compact_buffer(self, step: int) -> None:
        """After the checkpoint of `step` is complete: fold the consumption record (bounded reopen)."""
        delete = self.cfg.buffer.buffer_delete_consumed_objects
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: self.extras.compact(step, delete_consumed_objects=delete))

    def error(self) -> str | None:
        return None if self.producer.error is None else str(self.producer.error)


def rollout_manager_actor(**ray_options):
    """The Ray actor class of RolloutManager (`.remote(cfg, ...)` builds it). ray_options go to
    `ray.remote` (num_cpus, resources, ...)."""
    import ray

    ray_options.setdefault("num_cpus", 1)
    return ray.remote(**ray_options)(TracedRolloutManager)


class TracedRolloutManager(RolloutManager):
    """The manager as a Ray actor: its process records into the run's timeline trace as "rollout"."""

    def __init__(self, cfg, **kwargs):
        trace.join(cfg.metrics, Store(cfg.run_uri), "rollout")
        super().__init__(cfg, **kwargs)

    async def stop(self, grace_seconds: float = 30.0) -> None:
        await super().stop(grace_seconds)
        await asyncio.get_running_loop().run_in_executor(None, trace.shutdown)

    def _hand_over(self, part: RankBatch) -> Any:
        """Into the object store, owned by this actor: the ranks read it by reference."""
        import ray

        return ray.put(part)

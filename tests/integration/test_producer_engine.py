"""The rollout side for real: RolloutManager over a CPU engine process and the durable buffer.

Pins, end to end on real components: the builtin reverse4 task is generated, scored by the
default reward and committed; per-token weight versions come from the engine across an
in_place weight update; a checkpointed rollout state plus the buffer's committed positions
resume with no prompt consumed twice; the sync driver's batch path; the Ray actor wrapper.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from miles_core.config import RunConfig, embedded_default, replace_fields
from miles_core.engines.client import EngineClient
from miles_core.engines.launcher import EngineLaunchSpec, EngineServer
from miles_core.metrics.names import ROLLOUT_METRIC_NAMES
from miles_core.models.builtin import materialize_checkpoint
from miles_core.rollout.builtin_tasks import builtin_rows
from miles_core.rollout.manager import RolloutManager
from miles_core.samples import SampleStatus

from tests.support.timeouts import ENGINE_START_SECONDS, RAY_CALL_SECONDS, WAIT_SECONDS, await_until

SETTLE_SECONDS = 10  # a served group's task leaves the in-flight set (the put returns to it)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("producer-engine")
    return (materialize_checkpoint("builtin:tiny-gpt", 1, str(root / "a")),
            materialize_checkpoint("builtin:tiny-gpt", 2, str(root / "b")))


@pytest.fixture(scope="module")
def engine(ckpts):
    server = EngineServer(EngineLaunchSpec("cpu", ckpts[0], weight_version=1,
                                           startup_timeout_seconds=ENGINE_START_SECONDS))
    server.start()
    yield server
    server.stop()


def config(tmp_path, **fields) -> RunConfig:
    base = dict(run_id="prod", storage_root=str(tmp_path / "store"), rollout_batch_size=4,
                n_samples_per_prompt=4, rollout_max_response_len=5, max_weight_staleness=2,
                async_unused_samples_handler="retry")
    base.update(fields)
    return replace_fields(embedded_default(), **base)


ROWS = builtin_rows("builtin:reverse4")[:40]


def positions(batch):
    return [(json.loads(g.samples[0].metadata)["epoch"], json.loads(g.samples[0].metadata)["position"])
            for g in batch.groups]


def test_fully_async_generate_update_checkpoint_and_resume(tmp_path, engine, ckpts):
    """Fully async over a real engine and the durable buffer: scored reverse4 groups with per-token
    versions; after an in_place update tokens carry version 2; a 'crash' after the step-1
    checkpoint resumes from the rollout state + the buffer's committed positions, and across both
    segments no prompt position is consumed twice (groups consumed after the checkpoint are served
    again, which is right: the restored model never trained on them)."""
    async def segment_one():
        mgr = RolloutManager(config(tmp_path), engine_urls=[engine.url], rows=ROWS, consumed_through_step=-1)
        await mgr.set_version(1)
        await mgr.start()
        b0 = await mgr.next_batch(1)
        assert len(b0.groups) == 4 and len(b0.groups[0].samples) == 4
        for g in b0.groups:
            for s in g.samples:
                assert s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)
                assert s.reward is not None and 0.0 <= s.reward <= 1.0
                assert len(s.token_versions) == len(s.response_ids) == len(s.response_logprobs) > 0
                assert set(s.token_versions) == {1}
        # tool metrics belong to episodes that ran a tool; reverse4 is single-turn
        assert {m for m in ROLLOUT_METRIC_NAMES if m.startswith("rollout/") and "producer" not in m
                and not m.startswith("rollout/tool/")
                and m not in ("rollout/reward_failed", "rollout/generate_failed")} <= set(b0.metrics)
        # in_place weight update on the engine, then publish v2 (docs/fully-async.md order)
        async with EngineClient([engine.url]) as client:
            await client.pause_generation("in_place")
            await client.update_weights_from_disk(ckpts[1], 2)
            await client.continue_generation()
        await mgr.set_version(2)
        b1 = await mgr.next_batch(2)
        await mgr.record_consumed(0, b0.group_ids)
        await mgr.record_consumed(1, b1.group_ids)
        state = json.loads(json.dumps(mgr.state()))  # the checkpoint of step 1
        later = None
        for _ in range(5):  # consumed after the checkpoint: lost by the "crash", served again
            later = await mgr.next_batch(2)
            if later.metrics["rollout/weight_version/max"] == 2:
                break
        assert later.metrics["rollout/weight_version/max"] == 2.0
        await mgr.stop(grace_seconds=10)
        return state, positions(b0) + positions(b1)

    state, consumed = asyncio.run(segment_one())

    async def segment_two():
        mgr = RolloutManager(config(tmp_path), engine_urls=[engine.url], rows=ROWS, state=state,
                             consumed_through_step=1)
        version = 2
        await mgr.set_version(version)
        await mgr.start()
        batches = []
        async with EngineClient([engine.url]) as client:
            for _ in range(4):  # the trainer's loop: drain, (train), push weights, publish the version
                batches.append(await mgr.next_batch(version))
                version += 1
                await client.pause_generation("in_place")
                await client.update_weights_from_disk(ckpts[1], version)
                await client.continue_generation()
                await mgr.set_version(version)
        await mgr.stop(grace_seconds=10)
        return [p for b in batches for p in positions(b)]

    resumed = asyncio.run(segment_two())
    both = consumed + resumed
    assert len(both) == len(set(both)), "a prompt position was consumed twice across the resume"


def test_sync_driver_batch_path(tmp_path, engine):
    """--no-fully-async: next_batch generates exactly B groups per call (the sync driver)."""

    async def main():
        cfg = config(tmp_path, fully_async=False, max_weight_staleness=None)
        mgr = RolloutManager(cfg, engine_urls=[engine.url], rows=ROWS, consumed_through_step=-1)
        await mgr.set_version(1)
        await mgr.start()
        b0 = await mgr.next_batch(1)
        b1 = await mgr.next_batch(1)
        # A group is served as soon as its object is committed; its task leaves the in-flight set a
        # moment later, when the put returns to it: wait for that, then nothing more has started.
        await await_until(lambda: mgr.producer.in_flight_groups == 0, SETTLE_SECONDS, "no group in flight")
        assert mgr.producer.in_flight_groups == 0 and mgr.producer.admission.started_groups == 8
        await mgr.stop(grace_seconds=5)
        return b0, b1

    b0, b1 = asyncio.run(main())
    assert len(b0.groups) == len(b1.groups) == 4
    assert not set(b0.group_ids) & set(b1.group_ids)


def test_rollout_manager_as_a_ray_actor(tmp_path, engine, ray_local):
    """The actor wrapper the driver uses: built remotely from the config, async methods called
    with .remote(), a DrainedBatch comes back across processes, the state is JSON-able."""
    import ray

    from miles_core.rollout.manager import rollout_manager_actor

    actor = rollout_manager_actor(num_cpus=0).remote(config(tmp_path), engine_urls=[engine.url], rows=ROWS,
                                                     consumed_through_step=-1)
    try:
        ray.get(actor.set_version.remote(1))
        ray.get(actor.start.remote())
        batch = ray.get(actor.next_batch.remote(1), timeout=RAY_CALL_SECONDS)
        assert len(batch.groups) == 4 and batch.group_ids == [g.group_id for g in batch.groups]
        ray.get(actor.record_consumed.remote(0, batch.group_ids))
        state = ray.get(actor.state.remote())
        assert json.loads(json.dumps(state))["started_groups"] >= 4
        assert ray.get(actor.error.remote()) is None
        ray.get(actor.stop.remote(5))
    finally:
        ray.kill(actor)


def test_a_batch_still_draining_when_the_manager_stops_returns_none(tmp_path, engine):
    """The driver's prefetch of the batch after its last step is never read: when the manager stops
    under it, it returns None instead of raising (Ray would log the error as unhandled at exit)."""
    async def run():
        cfg = config(tmp_path, rollout_batch_size=5000, async_max_concurrent_samples=8)
        mgr = RolloutManager(cfg, engine_urls=[engine.url], rows=ROWS[:8], consumed_through_step=-1)
        await mgr.set_version(1)
        await mgr.start()
        pending = asyncio.ensure_future(mgr.next_batch(1))  # 5000 groups, 2 in flight: never done in time
        await await_until(lambda: mgr.producer.in_flight_groups > 0, WAIT_SECONDS, "groups in flight")  # draining
        await mgr.stop(grace_seconds=5)
        return await asyncio.wait_for(pending, 60)

    assert asyncio.run(run()) is None

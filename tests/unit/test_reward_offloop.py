"""Reward functions and decoding run off the rollout loop (rollout.rewards, rollout.reward_workers).

Pins: a reward that blocks for a while on one group (a sync function in time.sleep, or an
`async def` calling time.sleep) does not stop other groups from being submitted, scored and
committed meanwhile; decoding runs on a worker thread; async rewards share one loop thread while
it is responsive; close() stops the threads; Producer.stop() closes the Rewarder.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from miles_core.rollout.rewards import Rewarder
from miles_core.samples import Group, Sample, SampleStatus
from tests.unit.test_producer import TokenEngine, rig, run

SCORING_SECONDS = 30  # a producer scoring groups beside a reward that blocks
CANCEL_SECONDS = 10  # a producer stopped while its reward blocks: its task ends

BLOCK_SECONDS = 1.5


def blocking_rewards():
    """A sync and an async reward that block BLOCK_SECONDS on the first sample of prompt 0;
    `window` gets the (start, end) of the block."""
    window: list[float] = []

    def blocks(s) -> bool:
        return s.prompt_ids[0] == 0 and s.sample_index == 0 and not window

    def sync_reward(s):
        if blocks(s):
            window.append(time.monotonic())
            time.sleep(BLOCK_SECONDS)
            window.append(time.monotonic())
        return 1.0

    async def async_reward(s):
        return sync_reward(s)  # blocks its loop: no await around the sleep

    return {"sync": sync_reward, "async": async_reward}, window


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_blocking_reward_does_not_stall_other_groups(kind):
    rewards, window = blocking_rewards()

    async def main():
        eng = TokenEngine(tokens=3, token_seconds=0.005)
        r = rig(eng, n=2, budget_groups=4, reward=rewards[kind], k_rows=64)
        commits: list[tuple[float, str]] = []
        put = r.buffer.put

        async def recording_put(group):
            await put(group)
            commits.append((time.monotonic(), group.group_id))

        r.buffer.put = recording_put
        r.producer.start()
        for _ in range(2000):  # until the blocked group is committed
            if any(gid == "e0-p0-a0" for _, gid in commits):
                break
            await asyncio.sleep(0.005)
        else:
            raise AssertionError("the blocked group was never committed")
        started_during = eng.calls
        await r.producer.stop(grace_seconds=5)
        assert r.producer.error is None
        t0, t1 = window
        assert t1 - t0 >= BLOCK_SECONDS * 0.9
        during = [gid for t, gid in commits if t0 < t < t1]
        # the budget holds 4 groups: committing many more means new groups were submitted too
        assert len(during) >= 8, (len(during), started_during)
        blocked = next(g for g in r.buffer.queue if g.group_id == "e0-p0-a0")
        assert [s.reward for s in blocked.samples] == [1.0, 1.0]

    run(main(), timeout=SCORING_SECONDS)


def sample(i=0, response=(1, 2)):
    return Sample(group_id="g", prompt_index=0, sample_index=i, prompt_ids=[1, 10], response_ids=list(response),
                  loss_mask=[1] * len(response), label="", metadata="{}", status=SampleStatus.COMPLETED)


def score(rewarder: Rewarder, samples) -> tuple[Group, int]:
    """Score on a fresh loop; -> the group and the loop thread's id."""

    async def main():
        g = Group("g", 0, samples)
        await rewarder.score_group(g)
        return g, threading.get_ident()

    return asyncio.run(main())


@pytest.mark.parametrize("batched,is_async", [(False, False), (True, False), (False, True), (True, True)])
def test_decode_runs_off_the_loop_thread(batched, is_async):
    decode_threads: list[int] = []

    def decode(ids):
        decode_threads.append(threading.get_ident())
        return "x" * len(ids)

    def text_reward(s, text):
        return float(len(text))

    def batched_reward(samples, texts):
        return [float(len(t)) for t in texts]

    fn = batched_reward if batched else text_reward
    if is_async:
        inner = fn

        async def fn(a, b):
            return inner(a, b)

    fn.needs_text, fn.batched = True, batched
    rewarder = Rewarder(fn, decode)
    try:
        g, loop_thread = score(rewarder, [sample(0, (1, 2)), sample(1, (1, 2, 3))])
    finally:
        rewarder.close()
    assert [s.reward for s in g.samples] == [2.0, 3.0]
    assert len(decode_threads) == 2 and loop_thread not in decode_threads


def test_sync_and_async_rewards_run_on_worker_threads():
    seen: dict[str, set] = {"sync": set(), "async": set()}

    def sync_reward(s):
        seen["sync"].add(threading.current_thread().name)
        return 1.0

    async def async_reward(s):
        seen["async"].add(threading.current_thread().name)
        await asyncio.sleep(0)
        return 1.0

    for fn in (sync_reward, async_reward):
        rewarder = Rewarder(fn)
        try:
            for _ in range(3):
                score(rewarder, [sample(0), sample(1)])
        finally:
            rewarder.close()
    assert all(name.startswith("reward") for name in seen["sync"])
    assert seen["async"] == {"reward-loop-0"}  # one shared loop while it is responsive


def test_failures_still_mark_samples_with_threads():
    async def bad(s):
        raise ValueError("boom")

    rewarder = Rewarder(bad)
    try:
        g, _ = score(rewarder, [sample(0), sample(1)])
    finally:
        rewarder.close()
    assert [s.status for s in g.samples] == [SampleStatus.FAILED, SampleStatus.FAILED]
    assert all("ValueError: boom" in s.metadata for s in g.samples)
    assert rewarder.take_failed() == 2


def test_close_stops_the_threads_and_later_scoring_fails_the_samples():
    async def reward(s):
        return 1.0

    rewarder = Rewarder(reward)
    score(rewarder, [sample()])
    rewarder.close()
    rewarder.close()  # idempotent
    assert not [t for t in threading.enumerate() if t.name == "reward-loop-0" and t.is_alive()]
    g, _ = score(rewarder, [sample()])
    assert g.samples[0].status == SampleStatus.FAILED and "closed" in g.samples[0].metadata


def test_a_cancelled_group_cancels_its_async_reward():
    started, cancelled = threading.Event(), threading.Event()

    async def slow(s):
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return 1.0

    rewarder = Rewarder(slow)

    async def main():
        task = asyncio.ensure_future(rewarder.score_group(Group("g", 0, [sample()])))
        while not started.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        run(main(), timeout=CANCEL_SECONDS)
        assert cancelled.wait(5)
    finally:
        rewarder.close()


def test_producer_stop_closes_the_rewarder():
    closed = []

    async def main():
        r = rig(TokenEngine(), n=2, budget_groups=2)
        close = r.producer.rewarder.close
        r.producer.rewarder.close = lambda *a: (closed.append(True), close(*a))
        r.producer.start()
        await asyncio.sleep(0.05)
        await r.producer.stop(grace_seconds=1)

    run(main())
    assert closed == [True]

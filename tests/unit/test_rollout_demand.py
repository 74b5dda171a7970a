"""The rollout manager starts no group its run's remaining steps will not train.

A fully async producer runs ahead of the trainer up to its staleness bound; at the run's end that
lead was generated and never trained: on a 2-step run of the calculator preset (4 groups a step),
12 groups of multi-turn episodes past the 8 trained, the largest cost of that run. Pins: a run of
N steps from step k starts (N - k - 1) x B groups when none is lost; a group lost on the way (rejected
as stale at the drain) is made up, so the run never waits for one the gate held back; a
buffer already holding groups (a resume) counts them.
"""

from __future__ import annotations

import asyncio

from miles_core.config import parse_flags
from miles_core.rollout.manager import RolloutManager
from tests.unit.test_producer import MemoryBuffer, Result, run, until


def rows(k: int) -> list[dict]:
    return [{"prompt": [i % 10, 1, 2, 3], "label": f"{i % 10}", "task": "reverse4", "metadata": "{}"} for i in range(k)]


class InstantEngine:
    """Every /generate answers at once with weight version `version`; the first `stale` answers carry
    version 1 (their group is rejected as stale when a drain at version 4 or later gets it: lost)."""

    def __init__(self, stale: int = 0):
        self.calls, self.stale, self.version = 0, stale, 1

    async def generate(self, input_ids, sampling_params=None):
        self.calls += 1
        v = 1 if self.calls <= self.stale else self.version
        await asyncio.sleep(0)
        return Result([1, 2], [-0.5, -0.5], [v, v], "stop", v)


def _manager(tmp_path, engine, *, steps: int, consumed_through_step: int = -1, buffer=None) -> RolloutManager:
    cfg = parse_flags(["--preset", "tiny-reverse4", "--storage-root", str(tmp_path), "--num-rollout", str(steps),
                       "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--max-weight-staleness", "2"])
    buffer = buffer or MemoryBuffer()

    def factory(handler):
        buffer.handler = handler
        return buffer

    return RolloutManager(cfg, engine=engine, rows=rows(64), buffer_factory=factory,
                          consumed_through_step=consumed_through_step)


async def _train(mgr: RolloutManager, engine: InstantEngine, steps: range) -> None:
    engine.version = steps[0] + 1
    await mgr.start()
    for step in steps:
        batch = await asyncio.wait_for(mgr.next_batch(step + 1), 10)
        assert len(batch.groups) == 2
        engine.version = step + 2
        await mgr.set_version(step + 2)
    await until(lambda: mgr.producer.in_flight_groups == 0)
    assert not mgr._groups_wanted()  # closed: every group started so far is all the producer starts


def test_a_run_starts_only_the_groups_its_steps_train(tmp_path):
    async def main():
        engine = InstantEngine()
        mgr = _manager(tmp_path, engine, steps=3)
        await _train(mgr, engine, range(3))
        assert mgr.producer.admission.started_groups == 6 and not mgr.buffer.queue
        assert engine.calls == 12  # 6 groups x 2 samples
        await mgr.stop(grace_seconds=1)

    run(main())


def test_a_lost_group_is_made_up_and_a_resumed_buffer_counts(tmp_path):
    async def main():
        engine = InstantEngine(stale=2)  # the first group's samples carry version 1: rejected as stale
        buffer = MemoryBuffer(max_staleness=1)
        mgr = _manager(tmp_path, engine, steps=5, consumed_through_step=2, buffer=buffer)  # steps 3, 4: 4 groups
        await _train(mgr, engine, range(3, 5))
        assert buffer.rejected == [("e0-p0-a0", "stale")] and engine.calls == 10  # 5 groups made for 4
        await mgr.stop(grace_seconds=1)

        held = MemoryBuffer()  # a resume over a buffer holding 2 groups of the dead segment
        held.queue.extend(mgr.producer.source.next_group() for _ in range(2))
        engine = InstantEngine()
        mgr = _manager(tmp_path / "again", engine, steps=3, consumed_through_step=1, buffer=held)
        await _train(mgr, engine, range(2, 3))
        assert engine.calls == 0 and not held.queue
        await mgr.stop(grace_seconds=1)

    run(main())

"""The rollout producer and the drain, with scripted engines and an in-memory buffer.

The fakes stand in where timing must be controlled: `ScriptedEngine` parks every /generate until
the test resolves it; `TokenEngine` emits tokens on a clock, each tagged with its current weight
version (what the engine client reports from SGLang's stream); `MemoryBuffer` is a FIFO with the
DataBuffer contract (aborted groups and stale groups go to the unused-samples handler). The real
engine and durable buffer are exercised in tests/integration/test_producer.py.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
from dataclasses import dataclass, field

import pytest

from miles_core.buffer import build_unused_handler
from miles_core.metrics.names import ROLLOUT_METRIC_NAMES
from miles_core.rollout.admission import StalenessAdmission, SubmissionBudget
from miles_core.rollout.batch_metrics import batch_metrics
from miles_core.rollout.data_source import DataSource, position_of
from miles_core.rollout.drain import (
    ProducerGuardedBuffer,
    SampleFilterError,
    drain_batch,
    generate_batch,
)
from miles_core.rollout.assembly import RejectionNotifier
from miles_core.rollout.producer import Producer, RolloutWorkerError, fill_sample
from miles_core.rollout.rewards import Rewarder
from miles_core.samples import Sample, SampleStatus

RUN_SECONDS = 20.0  # one producer scenario in its own event loop, start to finish

# ----------------------------------------------------------------------------- fakes


@dataclass
class Result:
    output_ids: list
    output_logprobs: list
    token_versions: list
    finish_reason: str
    weight_version: int | None = None
    seconds: float = 0.0


@dataclass
class Call:
    input_ids: list
    future: asyncio.Future
    cancelled: bool = False


class ScriptedEngine:
    def __init__(self):
        self.calls: list[Call] = []

    async def generate(self, input_ids, sampling_params=None):
        call = Call(list(input_ids), asyncio.get_running_loop().create_future())
        self.calls.append(call)
        try:
            return await call.future
        except asyncio.CancelledError:
            call.cancelled = True
            raise

    def finish(self, call: Call, reason="stop", ids=(1, 2), version=1):
        call.future.set_result(Result(list(ids), [-0.5] * len(ids), [version] * len(ids), reason, version))

    def calls_for(self, prompt_first_token: int) -> list[Call]:
        return [c for c in self.calls if c.input_ids[0] == prompt_first_token]

    async def wait_calls(self, k: int):
        for _ in range(500):
            if len(self.calls) >= k:
                return
            await asyncio.sleep(0.002)
        raise AssertionError(f"expected {k} generate calls, saw {len(self.calls)}")


class BatchedScriptedEngine(ScriptedEngine):
    """ScriptedEngine behind EngineClient.generate_batch's contract (the producer sends each group as one
    request): `batches` counts the requests; each item is still one `Call` the test resolves and goes to
    `on_result` when it does; an aborted item ends the rest aborted at once (the client hangs up, so
    their calls are cancelled); an item that raises fails the whole request."""

    def __init__(self):
        super().__init__()
        self.batches = 0

    async def generate_batch(self, inputs, sampling_params=None, *, on_result=None):
        self.batches += 1
        tasks = [asyncio.ensure_future(self.generate(ids, sampling_params)) for ids in inputs]
        results = [None] * len(tasks)
        try:
            pending = {t: i for i, t in enumerate(tasks)}
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    i = pending.pop(t)
                    results[i] = t.result()
                    on_result(i, results[i])
                    if results[i].finish_reason == "abort":
                        for j in sorted(pending.values()):
                            results[j] = Result([], [], [], "abort")
                            on_result(j, results[j])
                        pending = {}
                        break
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return results


ENGINES = pytest.mark.parametrize("engine", [ScriptedEngine, BatchedScriptedEngine], ids=["each", "batched"])


class TokenEngine:
    """`tokens` tokens per request, `token_seconds` apart, each tagged with `version` at that moment."""

    def __init__(self, tokens=3, token_seconds=0.001, version=1):
        self.tokens, self.token_seconds, self.version = tokens, token_seconds, version
        self.abort_first: set[int] = set()  # prompts (first token) aborted the first time they are seen
        self.raise_on: set[int] = set()  # prompts whose generation raises (a worker failure)
        self.seen = collections.Counter()
        self.calls = 0
        self.emitted = 0

    async def generate(self, input_ids, sampling_params=None):
        self.calls += 1
        key = input_ids[0]
        self.seen[key] += 1
        first_call = self.seen[key] == 1
        if key in self.raise_on:
            raise ConnectionResetError("engine client bug")
        ids, versions = [], []
        for i in range(self.tokens):
            await asyncio.sleep(self.token_seconds)
            ids.append(i % 10)
            versions.append(self.version)
            self.emitted += 1
            if key in self.abort_first and first_call and i == 0:
                return Result(ids, [-1.0] * len(ids), versions, "abort", self.version)
        return Result(ids, [-1.0] * len(ids), versions, "length" if key % 3 == 0 else "stop", self.version)


class MemoryBuffer:
    """The DataBuffer contract in memory (async put/get); no `fail`, so the guard's own slot is used."""

    def __init__(self, capacity=10_000, max_staleness=None):
        self.queue: collections.deque = collections.deque()
        self.capacity, self.max_staleness = capacity, max_staleness
        self.handler = None
        self.cond = asyncio.Condition()
        self.rejected: list[tuple[str, str]] = []
        self.put_gate: asyncio.Event | None = None
        self.handed_out = 0

    async def put(self, group):
        if self.put_gate is not None:
            await self.put_gate.wait()
        if group.aborted:
            self.rejected.append((group.group_id, "aborted"))
            self.handler.handle(group, "aborted")
            return
        async with self.cond:
            await self.cond.wait_for(lambda: len(self.queue) < self.capacity)
            self.queue.append(group)
            self.cond.notify_all()

    async def get(self, **context):
        v = context.get("current_version")
        while True:
            async with self.cond:
                await self.cond.wait_for(lambda: self.queue)
                g = self.queue.popleft()
                self.cond.notify_all()
            s = g.staleness(v)
            if self.max_staleness is not None and s is not None and s > self.max_staleness:
                self.rejected.append((g.group_id, "stale"))
                self.handler.handle(g, "stale")
                continue
            self.handed_out += 1
            return g

    def get_metrics(self):
        return {"rollout/fully_async/queue_size": float(len(self.queue))}

    def groups_received(self) -> int:
        return len(self.queue) + self.handed_out


def rows(k=16):
    return [{"prompt": [i, 10], "label": str(i), "task": "t", "metadata": "{}"} for i in range(k)]


@dataclass
class Rig:
    producer: Producer
    buffer: MemoryBuffer
    consumer: ProducerGuardedBuffer
    budget: SubmissionBudget
    admission: StalenessAdmission
    admitted_over_limit: list = field(default_factory=list)


def rig(engine, *, n=2, budget_groups=2, granularity="sample", max_staleness=None, batch_size=2,
        reward=None, handler="drop", batch_mode=False, buffer=None, k_rows=16) -> Rig:
    source = DataSource(rows(k_rows), n, seed=1, shuffle=False)
    budget = SubmissionBudget(budget_groups, n, granularity)
    admission = StalenessAdmission(max_staleness, batch_size)
    buffer = buffer or MemoryBuffer()
    producer = Producer(source=source, engine=engine, sink=buffer,
                        rewarder=Rewarder(reward or (lambda s: float(s.response_ids[0] if s.response_ids else 0))),
                        budget=budget, admission=admission, sampling_params={"max_new_tokens": 4},
                        batch_mode=batch_mode)
    inner = build_unused_handler(handler, recycle=producer.recycle if handler == "retry" else None)
    buffer.handler = RejectionNotifier(inner, producer.on_rejected)
    r = Rig(producer, buffer, ProducerGuardedBuffer(buffer, producer), budget, admission)
    admit = admission.admit

    def checked_admit():  # the admission invariant, checked at every admission
        if admission.limit is not None and admission.started_groups + 1 > admission.limit:
            r.admitted_over_limit.append(admission.started_groups)
        admit()

    admission.admit = checked_admit
    return r


def run(coro, timeout=RUN_SECONDS):
    async def main():
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(main())


async def settle(seconds=0.02):
    await asyncio.sleep(seconds)


async def until(condition, seconds=30.0):
    """Wait until `condition()` holds (however loaded the machine: rewards run on threads)."""
    for _ in range(int(seconds / 0.002)):
        if condition():
            return
        await asyncio.sleep(0.002)
    raise AssertionError(f"not within {seconds} s")


# ----------------------------------------------------------------------------- budget and granularity


@ENGINES
@pytest.mark.parametrize("granularity", ["sample", "group"])
def test_credits_conserved_when_a_sample_raises(granularity, engine):
    """Pins §5.2 credit conservation across an exception: a raising generate fails the worker,
    siblings and other groups are cancelled, and every credit/slot comes back (used == 0)."""

    async def main():
        eng = engine()
        r = rig(eng, granularity=granularity)
        r.producer.start()
        await eng.wait_calls(4)
        eng.finish(eng.calls[0])
        eng.calls[1].future.set_exception(RuntimeError("bad request shape"))
        await settle()
        assert isinstance(r.producer.error, RolloutWorkerError)
        assert isinstance(r.producer.error.__cause__, RuntimeError)
        await r.producer.stop(grace_seconds=1)
        assert r.budget.used == 0
        assert all(c.cancelled for c in eng.calls[2:])

    run(main())


@ENGINES
@pytest.mark.parametrize("granularity", ["sample", "group"])
def test_credits_conserved_when_groups_are_cancelled(granularity, engine):
    """Pins §5.2 credit conservation across cancellation: stop() past its grace cancels in-flight
    groups; nothing is leaked and the cancelled prompts stay outstanding for a resume."""

    async def main():
        eng = engine()
        r = rig(eng, granularity=granularity)
        r.producer.start()
        await eng.wait_calls(4)
        eng.finish(eng.calls[0])
        await settle()
        await r.producer.stop(grace_seconds=0.01)
        assert r.budget.used == 0 and r.producer.in_flight_groups == 0
        assert r.producer.stopped and r.producer.error is None
        assert r.producer.source.outstanding == 2

    run(main())


@ENGINES
def test_sample_granularity_admits_a_group_as_soon_as_n_samples_finish(engine):
    """Pins §5.2 'sample': with budget 2 groups x n=2 and every group holding a straggler, a third
    group starts once n (=2) samples have finished, although no group has finished."""

    async def main():
        eng = engine()
        r = rig(eng, granularity="sample")
        r.producer.start()
        await eng.wait_calls(4)
        a0, b0 = eng.calls_for(0)[0], eng.calls_for(1)[0]
        eng.finish(a0)
        await settle()
        assert len(eng.calls) == 4  # 3 credits in flight: 3 + 2 > 4
        eng.finish(b0)
        await eng.wait_calls(6)
        assert len(eng.calls_for(2)) == 2
        assert getattr(eng, "batches", 3) == 3  # batched: one request per group
        await r.producer.stop(grace_seconds=0)

    run(main())


@ENGINES
def test_group_granularity_waits_for_a_whole_group(engine):
    """Pins §5.2 'group': finished samples free nothing; a new group starts only when fewer than
    budget group tasks are pending (here: when group A has finished and been put)."""

    async def main():
        eng = engine()
        r = rig(eng, granularity="group")
        r.producer.start()
        await eng.wait_calls(4)
        eng.finish(eng.calls_for(0)[0])
        eng.finish(eng.calls_for(1)[0])
        await settle()
        assert len(eng.calls) == 4
        eng.finish(eng.calls_for(0)[1])
        await eng.wait_calls(6)
        assert len(r.buffer.queue) == 1
        await r.producer.stop(grace_seconds=0)

    run(main())


def test_full_buffer_stops_submission():
    """Backpressure: when put blocks, finished groups waiting for put are bounded by the budget,
    so a full buffer stops new submissions even under sample granularity (at most the budget in
    flight plus the budget waiting for put: 2 x 2 groups of n=2 here)."""

    async def main():
        eng = TokenEngine()
        r = rig(eng, budget_groups=2)
        r.buffer.put_gate = asyncio.Event()  # every put blocks
        r.producer.start()
        await settle(0.1)
        calls = eng.calls
        await settle(0.1)
        # stable: 2 to 4 groups generated (a group waiting for scoring or put counts from its last
        # sample on, so how many start meanwhile depends on when the samples finish), none put
        assert eng.calls == calls and 4 <= calls <= 8
        assert r.budget.used == 0
        r.buffer.put_gate.set()
        await settle(0.05)
        assert eng.calls > calls
        await r.producer.stop(grace_seconds=0)

    run(main())


# ----------------------------------------------------------------------------- staleness


async def simulate_trainer(r: Rig, eng: TokenEngine, steps: int, batch_size: int, train_seconds: float):
    """The fully async trainer: drain B groups at version v, 'train', push v+1 to engines, publish."""
    staleness, v = [], 1
    for _ in range(steps):
        batch = await drain_batch(r.consumer, batch_size, current_version=v)
        staleness += [g.staleness(v) for g in batch.groups]
        await asyncio.sleep(train_seconds)
        v += 1
        eng.version = v  # weights updated on the engines ...
        r.producer.set_version(v)  # ... then the version is published to the rollout side
    return staleness


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_admission_control_bounds_consumed_staleness(max_staleness):
    """Pins §5.3 admission control: with --max-weight-staleness S and a producer much faster than
    the trainer, no consumed group is more than S versions stale, and no group is ever admitted
    beyond started + 1 <= (S + v + 1) * B. (The buffer's stale filter is off here: admission alone.)"""

    async def main():
        eng = TokenEngine(tokens=2, token_seconds=0.001)
        r = rig(eng, budget_groups=8, max_staleness=max_staleness, batch_size=2)
        r.producer.start()
        staleness = await simulate_trainer(r, eng, steps=6, batch_size=2, train_seconds=0.03)
        await r.producer.stop(grace_seconds=0)
        assert max(staleness) <= max_staleness
        assert not r.admitted_over_limit
        assert r.admission.started_groups <= (max_staleness + 6 + 1) * 2

    run(main())


def test_without_admission_control_the_same_schedule_goes_stale():
    """The control for the test above: the same schedule without S runs ahead (staleness > 2)."""

    async def main():
        eng = TokenEngine(tokens=2, token_seconds=0.001)
        r = rig(eng, budget_groups=8, max_staleness=None, batch_size=2)
        r.producer.start()
        staleness = await simulate_trainer(r, eng, steps=6, batch_size=2, train_seconds=0.03)
        await r.producer.stop(grace_seconds=0)
        assert max(staleness) > 2

    run(main())


def test_rejected_groups_leave_the_started_count():
    """Stale groups rejected at get leave started_groups (else admission would deadlock)."""

    async def main():
        eng = TokenEngine()
        r = rig(eng, budget_groups=2, max_staleness=0, batch_size=2, buffer=MemoryBuffer(max_staleness=0))
        r.producer.start()
        await settle(0.05)
        assert r.admission.started_groups == 2  # the limit at v=1
        r.producer.set_version(3)  # two updates: both buffered groups are now stale at get
        eng.version = 3
        batch = await drain_batch(r.consumer, 2, current_version=3)
        assert {g.oldest_version for g in batch.groups} == {3}
        assert [reason for _, reason in r.buffer.rejected] == ["stale", "stale"]
        await r.producer.stop(grace_seconds=0)

    run(main())


# ----------------------------------------------------------------------------- rejection and retry


def test_retry_re_serves_the_original_prompt_group():
    """Pins the retry handler path: an aborted group is rejected at put, the buffer's RetryUnused
    hands the cleared group to the producer's recycle, and the same prompt is generated again as
    the next attempt (same prompt ids and label, new group id)."""

    async def main():
        eng = TokenEngine()
        eng.abort_first = {0}
        r = rig(eng, handler="retry", budget_groups=1)
        r.producer.start()
        batch = await drain_batch(r.consumer, 3, current_version=1)
        await r.producer.stop(grace_seconds=0)
        ids = [g.group_id for g in batch.groups]
        assert "e0-p0-a1" in ids and "e0-p0-a0" not in ids
        retried = next(g for g in batch.groups if g.group_id == "e0-p0-a1")
        assert retried.samples[0].prompt_ids == [0, 10] and retried.samples[0].label == "0"
        assert position_of(retried) == (0, 0, 1)
        assert r.buffer.rejected == [("e0-p0-a0", "aborted")]

    run(main())


def test_drop_handler_does_not_re_serve_and_releases_the_started_count():
    async def main():
        eng = TokenEngine()
        eng.abort_first = {0}
        r = rig(eng, handler="drop", budget_groups=1)
        r.producer.start()
        batch = await drain_batch(r.consumer, 2, current_version=1)
        await r.producer.stop(grace_seconds=0)
        assert [g.group_id for g in batch.groups] == ["e0-p1-a0", "e0-p2-a0"]
        started = r.admission.started_groups
        assert started == r.producer.source.position - 1  # every served group but the dropped one

    run(main())


@ENGINES
def test_an_aborted_sample_aborts_its_group_and_cancels_the_siblings(engine):
    """A group is aborted if any sample is: the still-running siblings are cancelled (freeing the
    engines) and marked aborted; the buffer rejects the group."""

    async def main():
        eng = engine()
        r = rig(eng, budget_groups=1, n=3)
        r.producer.start()
        await eng.wait_calls(3)
        eng.finish(eng.calls[1], reason="abort", ids=[4])
        await settle()
        assert eng.calls[0].cancelled and eng.calls[2].cancelled
        assert r.buffer.rejected == [("e0-p0-a0", "aborted")]
        await r.producer.stop(grace_seconds=0)

    run(main())


# ----------------------------------------------------------------------------- worker failure


def test_worker_failure_is_raised_before_queued_groups():
    """Pins §5.1: after the worker fails, the trainer's next get raises RolloutWorkerError even
    though committed groups are queued in the buffer."""

    async def main():
        eng = TokenEngine()
        eng.raise_on = {3}
        r = rig(eng, budget_groups=1)
        r.producer.start()
        for _ in range(200):
            if r.producer.error is not None:
                break
            await settle(0.005)
        assert len(r.buffer.queue) == 3
        with pytest.raises(RolloutWorkerError, match="ConnectionResetError"):
            await r.consumer.get(current_version=1)
        assert len(r.buffer.queue) == 3  # nothing was handed out
        await r.producer.stop(grace_seconds=0)

    run(main())


def test_worker_failure_wakes_a_get_already_waiting():
    async def main():
        eng = ScriptedEngine()
        r = rig(eng, budget_groups=1)
        r.producer.start()
        await eng.wait_calls(2)
        getter = asyncio.ensure_future(r.consumer.get(current_version=1))
        await settle()
        assert not getter.done()
        eng.calls[0].future.set_exception(ValueError("decoder bug"))
        with pytest.raises(RolloutWorkerError):
            await asyncio.wait_for(getter, 2)
        await r.producer.stop(grace_seconds=0)

    run(main())


# ----------------------------------------------------------------------------- versions and rewards


def test_versions_recorded_across_an_in_place_update_mid_sample():
    """Pins §5.4 on the rollout side: a sample generated across an in_place weight update keeps
    each token's version, so it carries both; metrics report it as mixed."""

    async def main():
        eng = TokenEngine(tokens=6, token_seconds=0.01, version=1)
        r = rig(eng, budget_groups=1)
        r.producer.start()
        while eng.emitted < 2:  # both samples are past their first token
            await asyncio.sleep(0.001)
        eng.version = 2  # the engine paused in place, loaded v2 and resumed: requests kept going
        r.producer.set_version(2)
        batch = await drain_batch(r.consumer, 1, current_version=2)
        await r.producer.stop(grace_seconds=0)
        s = batch.groups[0].samples[0]
        assert s.token_versions[0] == 1 and s.token_versions[-1] == 2 and s.mixed_version
        assert batch.groups[0].staleness(2) == 1
        assert batch.metrics["rollout/weight_version/mixed_version_ratio"] == 1.0
        assert batch.metrics["rollout/weight_version/min"] == 1.0
        assert batch.metrics["rollout/weight_version/max"] == 2.0

    run(main())


def test_fill_sample_maps_finish_reasons_and_fills_missing_versions():
    s = Sample("g", 0, 0, [1])
    fill_sample(s, Result([1, 2, 3], [], [], "length", weight_version=4), 0.5)
    assert s.status == SampleStatus.TRUNCATED and s.token_versions == [4, 4, 4]
    assert s.loss_mask == [1, 1, 1] and len(s.response_logprobs) == 3 and s.generation_seconds == 0.5
    fill_sample(s, Result([], [], [], "abort"), 0.1)
    assert s.status == SampleStatus.ABORTED


def test_raising_reward_fails_samples_and_the_run_goes_on():
    """Pins docs/architecture.md for rewards: a raising reward function marks samples failed (reason in
    metadata), counts rollout/reward_failed, and the producer keeps producing batches."""

    def reward(s):
        if s.sample_index == 0:
            raise ZeroDivisionError("bad label")
        return 1.0

    async def main():
        eng = TokenEngine()
        r = rig(eng, reward=reward)
        r.producer.start()
        b1 = await drain_batch(r.consumer, 2, current_version=1, producer_metrics=r.producer.metrics)
        b2 = await drain_batch(r.consumer, 2, current_version=1, producer_metrics=r.producer.metrics)
        await r.producer.stop(grace_seconds=0)
        for batch in (b1, b2):
            for g in batch.groups:
                bad, good = g.samples
                assert bad.status == SampleStatus.FAILED and "ZeroDivisionError" in json.loads(bad.metadata)["reward_error"]
                assert good.reward == 1.0
        assert b1.metrics["rollout/reward_failed"] >= 2
        assert r.producer.error is None

    run(main())


# ----------------------------------------------------------------------------- pause / stop / state


def test_pause_stops_submission_without_aborting_in_flight_work():
    """Mode-1 eval: pause() starts no new group, lets in-flight ones finish; resume() continues."""

    async def main():
        eng = ScriptedEngine()
        r = rig(eng, budget_groups=1)
        r.producer.start()
        await eng.wait_calls(2)
        r.producer.pause()
        for c in eng.calls:
            eng.finish(c)
        await until(lambda: len(r.buffer.queue) == 1)  # scored (on a thread) and put
        await settle()
        assert len(eng.calls) == 2 and not any(c.cancelled for c in eng.calls)
        r.producer.resume()
        await eng.wait_calls(4)
        await r.producer.stop(grace_seconds=0)

    run(main())


def test_state_restores_started_groups_and_cursor():
    """The started-groups count is part of the checkpointed state (resumes included): groups lost
    in flight are re-served without being counted twice; groups committed after the checkpoint
    count."""

    async def main():
        eng = ScriptedEngine()
        r = rig(eng, budget_groups=2)
        r.producer.start()
        await eng.wait_calls(4)
        eng.finish(eng.calls[0]), eng.finish(eng.calls[1])
        await until(lambda: len(r.buffer.queue) == 1)  # e0-p0 scored, put and settled
        await eng.wait_calls(6)
        state = json.loads(json.dumps(r.producer.state()))
        await r.producer.stop(grace_seconds=0)
        assert state["started_groups"] == 3
        # resume: group e0-p1 (in flight at the checkpoint) was committed before the crash, and so
        # was a group started after the checkpoint at position 3.
        r2 = rig(ScriptedEngine(), budget_groups=2)
        report = r2.producer.restore(state, committed={(0, 1), (0, 3)})
        assert report.reserved_outstanding == 1  # e0-p2 is served again, already counted
        assert r2.admission.started_groups == 3 - 1 + 1
        assert [r2.producer.source.next_group().group_id for _ in range(2)] == ["e0-p2-a0", "e0-p4-a0"]

    run(main())


# ----------------------------------------------------------------------------- drain


def test_drain_takes_exactly_b_sorted_filters_and_reports():
    """Pins §5.5: exactly B groups, sorted by prompt index, the sample filter applied (mark only),
    then metrics (rollout metrics of §12, buffer and producer windows, perf/train_wait_seconds)."""

    def mask_first(groups):
        for g in groups:
            g.samples[0].loss_mask = [0] * len(g.samples[0].loss_mask)

    async def main():
        eng = TokenEngine()
        r = rig(eng, budget_groups=4)
        r.producer.start()
        await settle(0.05)
        batch = await drain_batch(r.consumer, 3, current_version=1, sample_filter=mask_first,
                                  producer_metrics=r.producer.metrics)
        await r.producer.stop(grace_seconds=0)
        assert len(batch.groups) == 3 and batch.group_ids == [g.group_id for g in batch.groups]
        assert [g.prompt_index for g in batch.groups] == sorted(g.prompt_index for g in batch.groups)
        assert all(set(g.samples[0].loss_mask) == {0} and set(g.samples[1].loss_mask) == {1} for g in batch.groups)
        for name in ["rollout/reward/mean", "rollout/response_len/mean", "rollout/response_len/max",
                     "rollout/truncated_ratio", "rollout/zero_std/ratio", "rollout/weight_version/mean",
                     "perf/tokens_per_second", "perf/train_wait_seconds", "rollout/fully_async/queue_size"]:
            assert name in batch.metrics, name

    run(main())


def test_sample_filter_that_drops_is_refused():
    async def main():
        eng = TokenEngine()
        r = rig(eng)
        r.producer.start()
        with pytest.raises(SampleFilterError, match="mark only"):
            await drain_batch(r.consumer, 2, current_version=1, sample_filter=lambda gs: gs[0].samples.pop())
        await r.producer.stop(grace_seconds=0)

    run(main())


def test_drain_warns_while_starved(caplog):
    """A starved drain logs a warning every interval (30 s by default; shortened here)."""

    async def main():
        eng = ScriptedEngine()
        r = rig(eng, budget_groups=1)
        r.producer.start()
        task = asyncio.ensure_future(drain_batch(r.consumer, 1, current_version=1, starved_warn_seconds=0.02))
        await settle(0.07)
        for c in eng.calls:
            eng.finish(c)
        batch = await task
        await r.producer.stop(grace_seconds=0)
        assert batch.metrics["perf/train_wait_seconds"] >= 0.05

    with caplog.at_level(logging.WARNING, logger="miles_core.rollout.drain"):
        run(main())
    assert sum("starved" in rec.message for rec in caplog.records) >= 2


def test_generate_batch_makes_exactly_b_groups_and_replaces_rejected_ones():
    """The sync / one-step-off path: a batch-mode producer starts exactly B groups per request,
    plus one replacement per rejected group; nothing runs ahead between batches."""

    async def main():
        eng = TokenEngine()
        eng.abort_first = {1}
        r = rig(eng, budget_groups=4, batch_mode=True, handler="drop")
        r.producer.start()
        await settle(0.03)
        assert eng.calls == 0  # nothing before the first request
        b1 = await generate_batch(r.producer, r.consumer, 3, current_version=1)
        await settle(0.03)
        assert len(b1.groups) == 3 and eng.calls == 4 * 2  # 3 groups + 1 replacement, n=2
        b2 = await generate_batch(r.producer, r.consumer, 3, current_version=2)
        await r.producer.stop(grace_seconds=0)
        assert len(b2.groups) == 3 and not set(b1.group_ids) & set(b2.group_ids)
        assert eng.calls == 7 * 2

    run(main())


def test_metric_names_constant_covers_batch_metrics():
    """The docs' metric reference is checked against ROLLOUT_METRIC_NAMES; every name batch_metrics
    can emit is in it."""
    s = Sample("g", 0, 0, [1], response_ids=[1, 2], token_versions=[1, 2], reward=1.0, status=SampleStatus.TRUNCATED)
    from miles_core.samples import Group

    assert set(batch_metrics([Group("g", 0, [s])])) <= set(ROLLOUT_METRIC_NAMES)

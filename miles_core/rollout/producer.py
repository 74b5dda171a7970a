"""The rollout producer (docs/fully-async.md): a persistent asyncio loop that keeps the engines busy.

Each turn of the loop waits until a new prompt group may start, takes it from the data source,
and spawns a group task: the group's n samples are generated on an engine (one batched request per
group; one call per sample with a custom generate function), scored by the reward function, and `put`
into the buffer. A group may start only when every gate is open:

- not paused (Mode-1 eval on shared engines) and not stopping;
- an engine to generate on (`set_engines_available`: a fleet of 0 engines starts no group until one joins);
- the submission budget (`SubmissionBudget`: group slots or sample credits, docs/fully-async.md);
- staleness admission (`StalenessAdmission`, docs/fully-async.md) with `--max-weight-staleness`;
- the put backlog: fewer than `budget_groups` generated groups waiting for scoring or `put`. Under sample
  granularity a group gives its credits back when its samples finish, so without this gate a full
  buffer (put blocks: backpressure) would let finished groups pile up in memory without bound;
- every extra gate in `gates` (a producer job's room in the run's buffer, read from the run root);
- the batch quota, when one is set (`allow(k)`: the sync and one-step-off drivers generate
  exactly k groups; rejected groups give their place back so they are replaced).

What it owns: generation, per-sample finish status, rewards, the started-groups count, the
worker-error slot. What it leaves to others: the order of prompts (the data source), group
decisions at put/get (the buffer: aborted groups, the dynamic filter, staleness at get), and
consumption (`miles_core.rollout.drain`).

A failure of the worker (an exception from the engine client, a bug; not an aborted request and
not a raising reward function) stops the loop and is recorded in `error`; the buffer's `fail`
(when it has one) and `ProducerGuardedBuffer` make the trainer's next get raise it before any
queued data. Aborted requests are not failures: the sample is `aborted`, the rest of its group is
cancelled, and the buffer rejects the group.

Threading: the loop and every method run on one asyncio event loop, except `on_rejected` and
`recycle`, which the buffer's unused-samples handler may call from the buffer's threads; they
hand the work to the loop. The buffer's blocking `put` runs on a dedicated thread pool; reward
functions and decoding run on the Rewarder's threads (`rewards`), never on the loop, so a slow
reward delays only its own group. `stop()` closes the Rewarder.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from miles_core.metrics import names as N
from miles_core.metrics import trace
from miles_core.rollout.admission import StalenessAdmission, SubmissionBudget, Ticket
from miles_core.rollout.data_source import DataSource, RestoreReport
from miles_core.rollout.episodes import GenerateArgs, GenerateFunction, GenerateFunctionError
from miles_core.rollout.failures import streak_error
from miles_core.rollout.rewards import Rewarder
from miles_core.samples import Group, Sample, SampleStatus

log = logging.getLogger(__name__)

STATE_VERSION = 1


class RolloutWorkerError(RuntimeError):
    """The rollout worker failed; raised at the trainer's next get. The cause is chained."""

    def __init__(self, message: str):
        super().__init__(message)


class Engine(Protocol):
    """What the producer needs from `miles_core.engines.client.EngineClient`."""

    async def generate(self, input_ids: list[int], sampling_params: dict | None = None) -> Any:
        """-> an object with output_ids, output_logprobs, token_versions, finish_reason
        ('stop' | 'length' | 'abort'), seconds. Never raises for an engine failure (it aborts)."""
        ...

    # An engine that also has `generate_batch(inputs, params, *, on_result)` (EngineClient) gets each
    # group in one request; `on_result(i, result)` as each sample finishes.


class GroupSink(Protocol):
    """The buffer's put side (`miles_core.buffer.DataBuffer.put`): blocking, or a coroutine."""

    def put(self, group: Group) -> None: ...


@dataclass(frozen=True)
class RouteLayout:
    """What a sample keeps of the engine's routed experts (--use-rollout-routing-replay): the engine
    answers SGLang's [positions, num_hidden_layers, top-k]; a sample keeps its MoE layers only."""

    num_layers: int
    moe_layers: tuple[int, ...]
    topk: int

    @staticmethod
    def from_spec(spec) -> "RouteLayout":
        """From the model's `ModelSpec` (miles_core.models.families)."""
        return RouteLayout(spec.num_layers, tuple(spec.moe_layers), spec.moe_topk)

    def keep(self, ids: list[int]) -> list[int]:
        from miles_core.engines.client import moe_layer_routes

        return moe_layer_routes(ids, self.num_layers, self.moe_layers, self.topk)


def _routes_kwargs(routes: RouteLayout | None) -> dict:
    """The engine call's routed-experts request (none without replay: other engines need not know it)."""
    return {"return_routed_experts": True} if routes is not None else {}


_FINISH_STATUS = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}


class Producer:
    """See the module docstring. Build it, then `start()` (or `await run()`) inside a running loop."""

    def __init__(self, *, source: DataSource, engine: Engine, rewarder: Rewarder,
                 budget: SubmissionBudget, admission: StalenessAdmission, sampling_params: dict,
                 sink: GroupSink | None = None, sink_for: Callable[[Producer], GroupSink] | None = None,
                 gates: Sequence[Callable[[], bool]] = (),
                 batch_mode: bool = False, put_threads: int | None = None, max_seq_len: int | None = None,
                 generate_fn: GenerateFunction | None = None, generate_args: GenerateArgs | None = None,
                 routes: RouteLayout | None = None, generate_failure_limit: int | None = None):
        """`sink` is where finished groups go; or `sink_for(producer)` builds it, for a sink whose
        unused-samples handler reports back to this producer (`on_rejected`, `recycle`): exactly one
        of the two. `gates`: more conditions to start a group (call `wake()` when one opens)."""
        if (sink is None) == (sink_for is None):
            raise TypeError("Producer takes exactly one of sink= and sink_for=")
        self.source = source
        self.routes = routes  # --use-rollout-routing-replay: each sample keeps its routed experts
        self.engine = engine
        # --custom-generate-function-path: one episode per sample instead of one engine call
        self.generate_fn = generate_fn
        self.generate_args = generate_args or GenerateArgs(engine=engine)
        self._generate_failed = 0
        # episodes failing in a row that fail the worker (`failures.streak_error`): their groups are
        # rejected, so no batch would ever reach the driver's FailureBudget; None: never
        self.generate_failure_limit = generate_failure_limit
        self._generate_streak, self._streak_first = 0, ""
        self.rewarder = rewarder
        self.tally = rewarder.tally  # reward and generate failures (miles_core.rollout.failures)
        self.budget = budget
        self.admission = admission
        self.sampling_params = dict(sampling_params)
        self.max_seq_len = max_seq_len  # prompt + response, in tokens (--max-seq-len); None: no cap
        self.error: BaseException | None = None
        self.paused = False
        self.engines_available = True
        self.gates = tuple(gates)
        self._stopping = False
        self._quota: int | None = 0 if batch_mode else None  # None: unlimited (fully async)
        self._groups: dict[asyncio.Task, Group] = {}
        self._awaiting_put = 0
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._put_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=put_threads or min(64, budget.budget_groups + 1), thread_name_prefix="rollout-put")
        self._error_listeners: list[Callable[[BaseException], None]] = []
        self._window_t0 = time.monotonic()
        self._window_tokens = 0
        self._window_groups = 0
        self.tokens_total = 0  # response tokens generated since start (a producer job's heartbeat)
        budget.listeners.append(self._wake.set)
        self.sink: GroupSink = sink if sink is not None else sink_for(self)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> asyncio.Task:
        """Run the loop as a task of the current event loop (idempotent)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run(), name="rollout-producer")
        return self._task

    async def run(self) -> None:
        """The producer loop. Returns when stopped or failed (then `error` is set); never raises."""
        self._loop = asyncio.get_running_loop()
        try:
            while await self._wait_admissible():
                group = self.source.next_group()  # first: if it raises, nothing has been taken
                ticket = self.budget.try_acquire()
                assert ticket is not None  # _wait_admissible checked it, on this loop, just now
                self.admission.admit()
                if self._quota is not None:
                    self._quota -= 1
                task = self._loop.create_task(self._run_group(group, ticket), name=f"group-{group.group_id}")
                self._groups[task] = group
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a bug in the loop itself fails the worker loudly
            self._fail(e)

    async def stop(self, grace_seconds: float = 30.0) -> None:
        """Stop starting groups; let in-flight groups finish (and commit) for up to `grace_seconds`,
        then cancel the rest (their prompts stay outstanding in the data source: served again on
        resume). Safe to call more than once."""
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        pending = list(self._groups)
        if pending:
            done, rest = await asyncio.wait(pending, timeout=grace_seconds)
            for t in rest:
                t.cancel()
            if rest:
                log.warning("producer stop: %d group(s) still running after %.0f s were cancelled",
                            len(rest), grace_seconds)
                await asyncio.gather(*rest, return_exceptions=True)
        self._put_pool.shutdown(wait=False, cancel_futures=True)
        self.tally.flush()
        # off the loop: a reward still blocking its thread must not stall the caller's loop
        await asyncio.get_running_loop().run_in_executor(None, self.rewarder.close)

    def pause(self) -> None:
        """Start no new group (Mode-1 eval on shared engines); nothing in flight is aborted."""
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        self._wake.set()

    def set_engines_available(self, available: bool) -> None:
        """Whether any engine serves now (the fleet changed); without one no group starts."""
        self.engines_available = bool(available)
        self._wake.set()

    def wake(self) -> None:
        """Re-check the gates (from any thread): one of `gates` may have opened."""
        self._call_on_loop(self._wake.set)

    def set_version(self, version: int) -> None:
        """The trainer published weight version `version` (after a weight update)."""
        self.admission.set_version(version)
        self._wake.set()

    def allow(self, groups: int) -> None:
        """Batch mode (built with batch_mode=True: the sync and one-step-off drivers): permit `groups`
        more groups to start. Outside batch mode the producer is unlimited (fully async)."""
        if self._quota is None:
            raise RuntimeError("Producer.allow() needs a producer built with batch_mode=True")
        self._quota += groups
        self._wake.set()

    @property
    def in_flight_groups(self) -> int:
        return len(self._groups)

    @property
    def stopped(self) -> bool:
        return self._stopping and (self._task is None or self._task.done())

    # ------------------------------------------------------------------ gates
    def _admissible(self) -> bool:
        return (not self.paused and self.engines_available and (self._quota is None or self._quota > 0)
                and self._awaiting_put < self.budget.budget_groups
                and self.budget.can_acquire() and self.admission.can_admit() and all(g() for g in self.gates))

    async def _wait_admissible(self) -> bool:
        while True:
            if self._stopping or self.error is not None:
                return False
            self._wake.clear()
            if self._admissible():
                return True
            await self._wake.wait()

    # ------------------------------------------------------------------ one group
    async def _run_group(self, group: Group, ticket: Ticket) -> None:
        backlog = _Backlog(self, len(group.samples))
        try:
            times = [trace.now()]  # submitted, generated, rewarded, committed
            await self._generate_group(group, ticket, backlog)
            times.append(trace.now())
            if not group.aborted:
                await self.rewarder.score_group(group)
            times.append(trace.now())
            await self._put(group)
            trace_group(group, *times, trace.now())
            backlog.close()
            self.source.settled(group)
            self._window_groups += 1
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the worker fails loudly (docs/fully-async.md)
            self._fail(e, group)
        finally:
            backlog.close()
            ticket.release()
            self._groups.pop(asyncio.current_task(), None)
            self._wake.set()

    async def _generate_group(self, group: Group, ticket: Ticket, backlog: "_Backlog") -> None:
        """Generate every sample; if one aborts, the rest are stopped (the group is rejected anyway)."""
        if self.generate_fn is None and hasattr(self.engine, "generate_batch"):
            await self._generate_together(group, ticket, backlog)
        else:
            await self._generate_each(group, ticket, backlog)
        for s in group.samples:
            if s.status == SampleStatus.PENDING:  # stopped because a sibling aborted
                s.status, s.finish_reason = SampleStatus.ABORTED, "abort"

    async def _generate_together(self, group: Group, ticket: Ticket, backlog: "_Backlog") -> None:
        """The group's samples in one engine request (SGLang's batched /generate): one HTTP exchange per
        group, not one per sample. Each sample's credit comes back as soon as it finished."""
        samples, t0, start = group.samples, time.monotonic(), trace.now()
        left = set(range(len(samples)))

        def finished(i: int, out: Any) -> None:
            left.discard(i)
            _sample_finished(ticket, backlog)
            trace_request(group.group_id, out, start)
            self._fill(samples[i], out, time.monotonic() - t0)

        try:
            params = [sample_params(self.sampling_params, len(s.prompt_ids), self.max_seq_len) for s in samples]
            same = all(p == params[0] for p in params)
            await self.engine.generate_batch([s.prompt_ids for s in samples], params[0] if same else params,
                                             on_result=finished, **_routes_kwargs(self.routes))
        finally:
            for _ in range(len(left)):  # failed or cancelled: their credits come back too
                _sample_finished(ticket, backlog)

    async def _generate_each(self, group: Group, ticket: Ticket, backlog: "_Backlog") -> None:
        """One engine call (or custom episode) per sample; if one aborts, cancel its siblings."""
        tasks = [asyncio.ensure_future(self._generate_sample(s, ticket, backlog)) for s in group.samples]
        try:
            pending = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    t.result()  # re-raise a worker failure
                if pending and group.aborted:
                    for t in pending:
                        t.cancel()
                    await asyncio.gather(*pending, return_exceptions=True)
                    pending = set()
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
            # retrieves every outcome too: a second failing sample must not log "never retrieved"
            await asyncio.gather(*tasks, return_exceptions=True)
        _take_episode_samples(group, tasks)

    async def _generate_sample(self, sample: Sample, ticket: Ticket, backlog: "_Backlog") -> list[Sample] | None:
        """-> the samples of a custom generate function's episode (None: `sample` was filled in place)."""
        t0 = time.monotonic()
        try:
            params = sample_params(self.sampling_params, len(sample.prompt_ids), self.max_seq_len)
            if self.generate_fn is not None:  # the credit is held for the whole episode (docs/agentic.md)
                return await self._run_episode(sample, params, t0)
            start = trace.now()
            out = await self.engine.generate(sample.prompt_ids, params, **_routes_kwargs(self.routes))
            trace_request(sample.group_id, out, start)
        finally:
            _sample_finished(ticket, backlog)  # finished, failed or cancelled
        self._fill(sample, out, time.monotonic() - t0)
        return None

    def _fill(self, sample: Sample, out: Any, seconds: float) -> None:
        fill_sample(sample, out, seconds, self.routes)
        self._window_tokens += len(sample.response_ids)
        self.tokens_total += len(sample.response_ids)

    async def _run_episode(self, sample: Sample, params: dict, t0: float) -> list[Sample] | None:
        """Run the custom generate function on `sample`. Its failure fails only this group: the
        sample is aborted with the error (naming the function) in its metadata, so the group is
        rejected at put and the unused-samples handler (drop or retry) applies."""
        try:
            samples = await self.generate_fn(self.generate_args, sample, params)
        except GenerateFunctionError as e:
            self.tally.tried("generate")  # counted with its outcome (a step's tally never splits them)
            self._generate_failed += 1
            message = self.tally.failed("generate", e, f"group {sample.group_id}")
            log.debug("group %s failed", sample.group_id, exc_info=e.__cause__)
            mark_episode_failed(sample, e)
            if not self._generate_streak:
                self._streak_first = message
            self._generate_streak += 1
            if self.generate_failure_limit is not None and self._generate_streak >= self.generate_failure_limit:
                raise streak_error("generate", self._generate_streak, self._streak_first)
            return None
        self.tally.tried("generate")
        self._generate_streak = 0
        for s in samples:
            s.generation_seconds = s.generation_seconds or time.monotonic() - t0
            self._window_tokens += sum(s.loss_mask)  # generated tokens, not the environment's
            self.tokens_total += sum(s.loss_mask)
        return samples

    async def _put(self, group: Group) -> None:
        if inspect.iscoroutinefunction(getattr(self.sink, "put", None)):
            await self.sink.put(group)
        else:  # the DataBuffer contract: a blocking put (backpressure) on its own thread
            await self._loop.run_in_executor(self._put_pool, self.sink.put, group)

    # ------------------------------------------------------------------ failure
    def _fail(self, error: BaseException, group: Group | None = None) -> None:
        if self.error is not None:
            return
        where = f" while generating group {group.group_id!r}" if group is not None else ""
        log.error("rollout worker failed%s: %r", where, error, exc_info=error)
        wrapped = RolloutWorkerError(f"the rollout worker failed{where}: {type(error).__name__}: {error}")
        wrapped.__cause__ = error
        self.error = wrapped
        self._stopping = True
        self._wake.set()
        for listener in self._error_listeners:
            listener(wrapped)
        fail = getattr(self.sink, "fail", None)
        if callable(fail):
            fail(wrapped)
        for task in list(self._groups):
            if task is not asyncio.current_task():
                task.cancel()

    def on_error(self, listener: Callable[[BaseException], None]) -> None:
        self._error_listeners.append(listener)
        if self.error is not None:
            listener(self.error)

    # ------------------------------------------------------------------ buffer feedback (any thread)
    def on_rejected(self, group: Group, reason: str = "") -> None:
        """A group this producer started was rejected (aborted at put, stale at get, filtered):
        it leaves the started-groups count, and in batch mode its place is given back."""
        if trace.tracer().traces_group(group.group_id):
            at = trace.now()
            trace.tracer().async_span("rejected", group.group_id, at, at, cat="group", reason=reason)
        self._call_on_loop(self._rejected, group)

    def recycle(self, group: Group) -> None:
        """The retry handler's callback: serve the original prompt group again."""
        self._call_on_loop(self.source.recycle, group)

    def _rejected(self, group: Group) -> None:
        self.admission.rejected()
        if self._quota is not None:
            self._quota += 1
        self._wake.set()

    def _call_on_loop(self, fn: Callable, *args) -> None:
        loop = self._loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is None or running is loop:
            fn(*args)
        else:
            loop.call_soon_threadsafe(fn, *args)

    # ------------------------------------------------------------------ state and metrics
    def state(self) -> dict:
        """JSON-able rollout state for the checkpoint: the data-source cursor and started groups."""
        return {"version": STATE_VERSION, "data_source": self.source.state(),
                "started_groups": self.admission.started_groups}

    def restore(self, state: dict, committed=()) -> RestoreReport:
        """Restore `state()` before `start()`; `committed` as in `DataSource.restore` (the buffer's
        `committed_positions()`)."""
        report = self.source.restore(state["data_source"], committed)
        self.admission.started_groups = max(
            0, int(state["started_groups"]) - report.reserved_outstanding + report.committed_beyond_checkpoint)
        return report

    def take_failures(self) -> dict:
        """Samples tried and failed per kind since the last call (`FailureTally.take`)."""
        return self.tally.take()

    def metrics(self) -> dict[str, float]:
        """Producer metrics for the window since the last call."""
        now = time.monotonic()
        seconds = max(now - self._window_t0, 1e-9)
        out = {
            N.TOKENS_PER_SECOND: self._window_tokens / seconds,
            N.REWARD_FAILED: float(self.rewarder.take_failed()),
            N.GENERATE_FAILED: float(self._generate_failed),
            N.PRODUCER_GROUPS_PER_SECOND: self._window_groups / seconds,
            N.PRODUCER_IN_FLIGHT_GROUPS: float(len(self._groups)),
            N.PRODUCER_STARTED_GROUPS: float(self.admission.started_groups),
        }
        self._window_t0, self._window_tokens, self._window_groups = now, 0, 0
        self._generate_failed = 0
        return out


class _Backlog:
    """A group's place in the put backlog (the gate in the module docstring): taken when its last
    sample finishes, in the same step as its last credit comes back, so the loop never sees the
    credits without the backlog; given back once, when the group is put or its task ends."""

    def __init__(self, producer: Producer, samples: int):
        self._producer, self._left = producer, samples
        self._held = self._closed = False

    def sample_finished(self) -> None:
        self._left -= 1
        if self._left == 0 and not self._closed:
            self._held = True
            self._producer._awaiting_put += 1

    def close(self) -> None:
        self._closed = True
        if self._held:
            self._held = False
            self._producer._awaiting_put -= 1


def _sample_finished(ticket: Ticket, backlog: _Backlog) -> None:
    """A sample finished, failed or was cancelled: its credit comes back (docs/fully-async.md), the backlog first so
    the loop never sees one without the other."""
    backlog.sample_finished()
    ticket.sample_done()


def _take_episode_samples(group: Group, tasks: list[asyncio.Future]) -> None:
    """Put the samples that custom generate functions returned in place of their input samples
    (a function may return a new Sample or several); sample indices are renumbered when that
    changes the group."""
    out, changed = [], False
    for s, t in zip(group.samples, tasks):
        result = t.result() if t.done() and not t.cancelled() and t.exception() is None else None
        if result is None:
            out.append(s)
            continue
        out.extend(result)
        changed = changed or len(result) != 1 or result[0] is not s
    if changed:
        for i, s in enumerate(out):
            s.sample_index = i
        group.samples = out


def trace_group(group: Group, submitted: float, generated: float, rewarded: float, committed: float) -> None:
    """A group's life in the run's trace: generate, reward, commit nested in one span (by group id)."""
    t = trace.tracer()
    if not t.traces_group(group.group_id):
        return
    rewards = [s.reward for s in group.samples if isinstance(s.reward, (int, float))]
    t.async_span("group", group.group_id, submitted, committed, cat="group", aborted=group.aborted,
                 reward=sum(rewards) / len(rewards) if rewards else None, samples=len(group.samples))
    t.async_span("generate", group.group_id, submitted, generated, cat="group")
    t.async_span("reward", group.group_id, generated, rewarded, cat="group")
    t.async_span("commit", group.group_id, rewarded, committed, cat="group")


def trace_request(group_id: str, out: Any, start: float) -> None:
    """One engine request in the group's span: which engine, its tokens, time to the first token."""
    t = trace.tracer()
    if not t.traces_group(group_id):
        return
    first = getattr(out, "first_token_seconds", None)
    t.async_span("request", group_id, start, trace.now(), cat="group", engine=getattr(out, "engine_url", ""),
                 tokens=getattr(out, "completion_tokens", None), finish=getattr(out, "finish_reason", None),
                 first_token_ms=None if first is None else round(first * 1000, 1))


def mark_episode_failed(sample: Sample, error: BaseException) -> None:
    """An episode that raised: the sample is aborted (its group is rejected at put) with the reason."""
    try:
        meta = json.loads(sample.metadata or "{}")
    except ValueError:
        meta = {}
    meta = meta if isinstance(meta, dict) else {}
    meta["generate_error"] = str(error)[:500]
    sample.metadata = json.dumps(meta, sort_keys=True)
    sample.status, sample.finish_reason = SampleStatus.ABORTED, "error"


def sample_params(params: dict, prompt_len: int, max_seq_len: int | None) -> dict:
    """One sample's sampling params: `max_new_tokens` capped so prompt + response fit in
    `max_seq_len`. A prompt leaving no room is an error (preparation drops those prompts)."""
    if max_seq_len is None:
        return params
    room = max_seq_len - prompt_len
    if room < 1:
        raise ValueError(f"a prompt of {prompt_len} tokens leaves no room for a response under "
                         f"--max-seq-len={max_seq_len}; prepare the prompt data again with this --max-seq-len")
    limit = params.get("max_new_tokens")
    return {**params, "max_new_tokens": room if limit is None else min(int(limit), room)}


def fill_sample(sample: Sample, out: Any, seconds: float, routes: RouteLayout | None = None) -> None:
    """Copy one engine result (`GenerateResult`) into the sample; with `routes`, its routed experts
    (the MoE layers') too, when the engine returned them (an aborted answer may not have)."""
    sample.response_ids = [int(t) for t in out.output_ids]
    sample.response_logprobs = [float(x) for x in (out.output_logprobs or [])]
    sample.token_versions = [int(v) for v in (out.token_versions or [])]
    if len(sample.response_logprobs) != len(sample.response_ids):
        sample.response_logprobs = (sample.response_logprobs + [0.0] * len(sample.response_ids))[: len(sample.response_ids)]
    if len(sample.token_versions) != len(sample.response_ids):
        v = getattr(out, "weight_version", None)
        sample.token_versions = [int(v) if v is not None else 0] * len(sample.response_ids)
    sample.loss_mask = [1] * len(sample.response_ids)
    sample.finish_reason = str(out.finish_reason)
    sample.status = _FINISH_STATUS.get(sample.finish_reason, SampleStatus.ABORTED)
    sample.generation_seconds = float(getattr(out, "seconds", 0.0) or seconds)
    routed = getattr(out, "routed_experts", None)
    sample.routed_experts = routes.keep(routed) if routes is not None and routed else []

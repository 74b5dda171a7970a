"""Fully async vs one-step-off vs sync on the real rollout and driver code (docs/fully-async.md).

    .venv/bin/python bench/async_speedup.py            # ~6 minutes: 3 drivers x 20 steps, then the sensitivity table
    .venv/bin/python bench/async_speedup.py --no-table --push-model tiny-store
    .venv/bin/python bench/async_speedup.py --drivers fully-async --async-max-concurrent-samples 64
    flags: --steps --batch-size --n --engines --slots-per-engine --median-tokens --sigma --cap-factor
           --generation-step-seconds --train-ratio --push-model --push-seconds --pause-seconds --drivers
           --warmup-steps --storage-root --async-max-concurrent-samples --buffer-capacity-factor
           --max-weight-staleness --table-sigmas --table-push --table-steps --no-table --results

What is real: RolloutManager (data source, producer, submission budget, staleness admission,
durable buffer on a memory:// run root (or `--storage-root file://...`), drain), `run_loop` and the
Roles of `miles_core.driver` (OnDemandBatches / PrefetchedBatches, TrainerRole, WeightPusher,
Checkpointer recording consumed ids every step), the rollout side behind `RolloutClient.in_process` (its own event-loop
thread) and the trainer behind `InProcessTrainer` (one thread), where the Ray path has actors. The config is the product's, with its defaults
(`--max-weight-staleness 2`, buffer capacity factor 2). What is timed, not computed:
- `TimedEngines`: `engines` engines of `slots_per_engine` concurrent slots each (an asyncio.Semaphore
  per engine; a request goes to the engine with the fewest requests running or queued); a sample of
  L tokens needs L x `token_seconds` of unpaused engine time. L is lognormal (sigma 1.0), capped at
  16x the median, and a deterministic function of (prompt, sample index), so every driver sees the
  same lengths for the same prompts. Each token carries the weight version the engine held when that
  token was produced (a sample that straddles a push carries both).
- `TimedTrainer`: train_step takes `train_seconds_per_sample` per sample (time.sleep on its own
  thread). push_weights is `WeightSync.push` (miles_core/weights/sync.py) in time: the export
  (`push_seconds - pause_seconds`; the store transport's snapshot, the distributed one's gather),
  during which the engines keep generating, then `pause_seconds` with every engine paused (the
  load): in-flight samples stall for the pause, samples that get a slot during it wait for its end,
  and tokens after it carry the new version. The trainer waits for the whole push in every driver,
  as the shared loop does (`WeightPusher.push` after `before_weight_update`).
The push cost is the one bench/weights.py measured for `--push-model` (bench/results/weights.json
when present, else PUSH_COSTS below, from docs/engines.md); the default, smollm-store, is a
SmolLM2-135M-size model (513 MiB fp32) on the product's default store transport (documented: 1.55 s
per push, the engines paused 0.16 s of it; weights.json's figures when present). Every driver pays
it: sync and one-step-off push between batches (the engines have nothing in flight, so the pause
stalls no sample, but the whole push sits on the step's critical path); fully async pushes while
the producer runs (the trainer waits the push, the engines lose the pause). Not modelled: the
re-prefill of requests that `--pause-generation-mode retract` retracted (fully async only).

The per-sample training time is set so that the mean generation time of a step with every slot
busy equals the training time of a step: T = B x n x E[L] x token_seconds / slots (`--train-ratio`
scales training against that). Nothing CPU-bound is timed: generation and training are sleeps, so a
loaded machine changes only the real overheads (put, commit, drain, hops between threads).

Budgets: sync and one-step-off keep their defaults (B groups, group granularity: the whole batch is
submitted at once and queues for the slots; the batch ends with its longest sample). Fully async
gets `--async-max-concurrent-samples`, by default slots + n: under sample granularity a new group
starts when in_flight + n <= budget, so slots + n is the least budget that keeps every slot busy.

Printed: the median time per steady-state step of each driver (after `--warmup-steps`) and the
whole run, the speedup of fully async over sync (AReaL reports 2.77x), the ideal time per step
(generation and training fully overlapped, slots always full, the push paid:
max(T + pause, train + push)) and efficiency = ideal / measured, where the trainer's step went, slot
occupancy, consumed staleness and the groups dropped as stale at get. Then the sensitivity table:
speedup and efficiency over the length spread (`--table-sigmas`) and the push cost (`--table-push`),
sync and fully async in each cell. Everything is also written to bench/results/async_speedup.json.
tests/integration/test_drivers.py runs the same harness (`bench_config`, `run_driver`) with tiny times.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import concurrent.futures
import dataclasses
import functools
import logging
import math
import os
import random
import statistics
import sys
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import results_file  # noqa: E402
from miles_core.config import RunConfig, embedded_default, replace_fields  # noqa: E402
from miles_core.driver.clients import Pending, RolloutClient  # noqa: E402
from miles_core.driver.fleet_reconciler import NoFleet  # noqa: E402
from miles_core.driver.loop import LoopResult, run_loop  # noqa: E402
from miles_core.driver.roles import (  # noqa: E402
    Checkpointer,
    Deadline,
    MetricsLog,
    Progress,
    Roles,
    TrainerRole,
    batch_source,
)
from miles_core.driver.pushes import WeightPusher, WeightVersion  # noqa: E402
from miles_core.driver.switchboard import Switchboard  # noqa: E402
from miles_core.metrics.names import STALE_GROUPS_FILTERED  # noqa: E402
from miles_core.prepare.checks import validate  # noqa: E402
from miles_core.rollout.builtin_tasks import builtin_rows  # noqa: E402
from miles_core.rollout.failures import FailureBudget  # noqa: E402
from miles_core.rollout.assembly import digit_decode  # noqa: E402
from miles_core.rollout.manager import RolloutManager  # noqa: E402

DRIVERS = ("sync", "one-step-off", "fully-async")
AREAL_SPEEDUP = 2.77
PRODUCT_MAX_WEIGHT_STALENESS = embedded_default().rollout.max_weight_staleness


# ----------------------------------------------------------------------------- push costs


@dataclass(frozen=True)
class PushCost:
    """One weight push as bench/weights.py measured it: the whole push, and the engines' pause within it."""

    name: str
    push_seconds: float
    pause_seconds: float
    source: str


# bench/weights.py medians on the 2-core dev machine (docs/engines.md, "Measurements"); used for a
# model or transport that bench/results/weights.json does not hold.
PUSH_COSTS = {
    "tiny-store": PushCost("tiny-store", 0.015, 0.005, "docs/engines.md"),
    "tiny-distributed": PushCost("tiny-distributed", 0.016, 0.015, "docs/engines.md"),
    "smollm-store": PushCost("smollm-store", 1.55, 0.16, "docs/engines.md"),
    "smollm-distributed": PushCost("smollm-distributed", 0.45, 0.43, "docs/engines.md"),
}
DEFAULT_PUSH = "smollm-store"  # a SmolLM2-135M-size model on the product's default transport
DEFAULT_TABLE_PUSH = "tiny-store,smollm-store,smollm-distributed"


def measured_push_costs(path: str = results_file.default_path("weights")) -> dict[str, PushCost]:
    """PUSH_COSTS, with every model and transport that the weights bench's results file holds."""
    costs = dict(PUSH_COSTS)
    for row in (results_file.read(path) or {}).get("rows", []):
        if "push_s" not in row:  # the versions measure (bf16 deltas): no push cost of a transport
            continue
        name = f"{row['model']}-{row['transport']}"
        costs[name] = PushCost(name, row["push_s"], row["pause_s"], os.path.relpath(path))
    return costs


def push_cost(spec: str, costs: dict[str, PushCost]) -> PushCost:
    """A named cost (`smollm-store`) or a literal `PUSH:PAUSE` in seconds (`0.45:0.43`)."""
    if spec in costs:
        return costs[spec]
    push, sep, pause = spec.partition(":")
    try:
        return PushCost(spec, float(push), float(pause) if sep else float(push), "flag")
    except ValueError:
        raise SystemExit(f"push cost {spec!r}: use one of {', '.join(sorted(costs))} or PUSH:PAUSE seconds") from None


# ----------------------------------------------------------------------------- the workload


@dataclass(frozen=True)
class Workload:
    """Sizes and times of the benchmark; `token_seconds` follows from `generation_step_seconds`."""

    steps: int = 20
    batch_size: int = 32  # B groups per step
    n: int = 8  # samples per group
    engines: int = 4
    slots_per_engine: int = 16
    median_tokens: int = 48
    sigma: float = 1.0
    cap_factor: float = 16.0  # lengths capped at cap_factor x median
    generation_step_seconds: float = 0.4  # T: a step's generation with every slot busy; training = train_ratio x T
    push_seconds: float = PUSH_COSTS[DEFAULT_PUSH].push_seconds  # the whole push: the trainer waits for it
    seed: int = 1
    train_ratio: float = 1.0  # training time per step / generation time per step (1: balanced, the benchmark)
    pause_seconds: float = PUSH_COSTS[DEFAULT_PUSH].pause_seconds  # its last part, every engine paused

    @property
    def slots(self) -> int:
        return self.engines * self.slots_per_engine

    @property
    def cap_tokens(self) -> int:
        return int(round(self.cap_factor * self.median_tokens))

    @property
    def engine_pause_seconds(self) -> float:
        """The pause is part of the push, so at most all of it."""
        return min(self.pause_seconds, self.push_seconds)

    @property
    def export_seconds(self) -> float:
        return self.push_seconds - self.engine_pause_seconds

    def length(self, prompt: tuple[int, ...], k: int) -> int:
        """Response length of the k-th sample of `prompt` (deterministic: same for every driver)."""
        x = random.Random(f"{self.seed}-{prompt}-{k}").lognormvariate(math.log(self.median_tokens), self.sigma)
        return max(1, min(self.cap_tokens, int(round(x))))

    @functools.cached_property
    def mean_tokens(self) -> float:
        """E[L] of the rounded, capped lognormal, exactly (a sum over the integer lengths)."""
        mu, s, cap = math.log(self.median_tokens), self.sigma, self.cap_tokens

        def cdf(x: float) -> float:
            return 0.0 if x <= 0 else 0.5 * (1 + math.erf((math.log(x) - mu) / (s * math.sqrt(2))))

        total = 1 * cdf(1.5)  # round(x) <= 1 -> 1
        total += sum(k * (cdf(k + 0.5) - cdf(k - 0.5)) for k in range(2, cap))
        total += cap * (1 - cdf(cap - 0.5))
        return total

    @functools.cached_property
    def token_seconds(self) -> float:
        return self.generation_step_seconds * self.slots / (self.batch_size * self.n * self.mean_tokens)

    @property
    def train_seconds_per_sample(self) -> float:
        return self.train_ratio * self.mean_tokens * self.token_seconds / self.slots

    @property
    def ideal_seconds(self) -> float:
        """Per step, generation and training fully overlapped, slots always full, and the push paid: the
        engines lose the pause, the trainer waits the whole push."""
        T = self.generation_step_seconds
        return max(T + self.engine_pause_seconds, self.train_ratio * T + self.push_seconds)


# ----------------------------------------------------------------------------- stand-ins


class WeightClock:
    """The weight version the engines serve and the windows they were paused in (any thread).

    A push announces its pause window before it sleeps through it, and the next version serves from
    the window's end, so an engine reads here alone how long a sample stalled and which version each
    of its tokens was produced under. Appends are atomic; pushes never overlap.
    """

    def __init__(self, version: int = 0):
        self.changes: list[tuple[float, int]] = [(float("-inf"), version)]  # (from time, version)
        self.pauses: list[tuple[float, float]] = []  # (start, end), in order

    @property
    def version(self) -> int:
        return self.version_at(time.monotonic())

    def version_at(self, t: float) -> int:
        changes = self.changes[:]
        return changes[bisect.bisect_right(changes, (t, math.inf)) - 1][1]

    def pause(self, seconds: float) -> tuple[float, int]:
        """Pause every engine for `seconds` from now, the next version serving after: (end, version)."""
        start = time.monotonic()
        end, version = start + seconds, self.changes[-1][1] + 1
        self.pauses.append((start, end))
        self.changes.append((end, version))
        return end, version

    def finish_time(self, t0: float, work: float) -> float:
        """When `work` seconds of generation started at t0 end, the engine stopped during every pause."""
        t = t0 + work
        for start, end in self.pauses[:]:
            if end <= t0:
                continue
            if start >= t:
                break
            t += end - max(start, t0)
        return t

    def unpaused_seconds(self, t0: float, t1: float) -> float:
        return (t1 - t0) - sum(max(0.0, min(e, t1) - max(s, t0)) for s, e in self.pauses[:])

    def token_versions(self, t0: float, t1: float, tokens: int) -> list[int]:
        """Versions of `tokens` tokens produced evenly over the unpaused time in [t0, t1]."""
        dt = self.unpaused_seconds(t0, t1) / tokens
        current, out = self.version_at(t0), []
        for t, v in self.changes[:]:
            if t0 < t <= t1:
                before = min(tokens, int(self.unpaused_seconds(t0, t) / dt)) if dt > 0 else 0
                out.extend([current] * max(0, before - len(out)))
                current = v
        out.extend([current] * (tokens - len(out)))
        return out


@dataclass
class TimedResult:
    """What `fill_sample` reads from an engine result."""

    output_ids: list[int]
    output_logprobs: list[float]
    token_versions: list[int]
    finish_reason: str
    seconds: float


class _Engine:
    def __init__(self, slots: int):
        self.slots = asyncio.Semaphore(slots)
        self.load = 0  # running + queued


class TimedEngines:
    """Engines with a fixed number of slots and a per-token time (the producer's Engine protocol)."""

    def __init__(self, workload: Workload, clock: WeightClock):
        self.w, self.clock = workload, clock
        self.engines = [_Engine(workload.slots_per_engine) for _ in range(workload.engines)]
        self.calls: dict[tuple[int, ...], int] = defaultdict(int)
        self.busy_intervals: list[tuple[float, float]] = []  # one per generated sample (slot held)

    async def generate(self, input_ids: list[int], sampling_params: dict | None = None) -> TimedResult:
        prompt = tuple(input_ids)
        k, self.calls[prompt] = self.calls[prompt], self.calls[prompt] + 1
        tokens = self.w.length(prompt, k)
        engine = min(self.engines, key=lambda e: e.load)
        engine.load += 1
        try:
            async with engine.slots:
                t0 = time.monotonic()
                await self._work(t0, tokens * self.w.token_seconds)
                t1 = time.monotonic()
        finally:
            engine.load -= 1
        self.busy_intervals.append((t0, t1))
        finish = "length" if tokens >= self.w.cap_tokens else "stop"
        return TimedResult([5] * tokens, [-1.0] * tokens, self.clock.token_versions(t0, t1, tokens), finish, t1 - t0)

    async def _work(self, t0: float, work: float) -> None:
        """Sleep until `work` seconds of unpaused time since t0 are done (a pause may begin meanwhile)."""
        end = self.clock.finish_time(t0, work)
        while (now := time.monotonic()) < end:
            await asyncio.sleep(end - now)
            end = self.clock.finish_time(t0, work)

    def busy_slot_seconds(self, start: float, end: float) -> float:
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b in self.busy_intervals)


class TimedTrainer:
    """The trainer actor's calls, timed: train_step sleeps per sample, push_weights exports then pauses."""

    def __init__(self, workload: Workload, clock: WeightClock):
        self.w, self.clock = workload, clock
        self.trained: list[list[str]] = []  # group ids per step
        self.staleness: list[int] = []  # per trained group: version at train time - min token version
        self.tokens: list[int] = []  # response tokens per step
        self.slept: list[tuple[float, float]] = []  # (asked, got) per train_step

    def train_parts(self, step: int, parts: list) -> dict:
        """A step over the batch's DP parts (miles_core.rank_batches; one in this process): its trainable samples."""
        t0, version = time.monotonic(), self.clock.version
        samples = [s for p in parts for st in p.steps for s, _ in st.items]
        by_group: dict[str, list] = {}
        for s in samples:
            by_group.setdefault(s.group_id, []).append(s)
        asked = len(samples) * self.w.train_seconds_per_sample
        self.trained.append(list(by_group))
        self.staleness.extend(version - min(s.oldest_version for s in g) for g in by_group.values())
        self.tokens.append(sum(len(s.response_ids) for s in samples))
        time.sleep(max(0.0, t0 + asked - time.monotonic()))  # the bookkeeping above is part of the step
        self.slept.append((asked, time.monotonic() - t0))
        return {"train/samples": float(len(samples))}

    def overshoot(self, skip: int = 0) -> float:
        """Mean seconds time.sleep overslept per train_step (a loaded machine wakes threads late)."""
        tail = self.slept[skip:] or self.slept
        return sum(got - asked for asked, got in tail) / len(tail)

    def push_weights(self, step: int, version: int) -> dict:
        """WeightSync.push in time: export (engines generate), pause + load + resume (engines stopped); the
        engines serve it when this returns (as the distributed transport's push)."""
        time.sleep(self.w.export_seconds)
        end, _ = self.clock.pause(self.w.engine_pause_seconds)
        while (now := time.monotonic()) < end:
            time.sleep(end - now)
        return {"delivered": True}

    def save_checkpoint(self, step: int, extras: dict) -> None:
        pass


class InProcessTrainer:
    """The trainer client's calls (miles_core.driver.placement.TrainerGroup) on one thread of this process."""

    def __init__(self, trainer: TimedTrainer):
        self.trainer = trainer
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer")

    def train_parts(self, step: int, parts: list) -> Pending:
        return Pending(future=self.pool.submit(self.trainer.train_parts, step, parts))

    def push_weights(self, step: int, version: int) -> Pending:
        return Pending(future=self.pool.submit(self.trainer.push_weights, step, version))

    def save_checkpoint(self, step: int, extras: dict) -> Pending:
        return Pending(future=self.pool.submit(self.trainer.save_checkpoint, step, extras))

    def close(self) -> None:
        self.pool.shutdown()


class NoEvals:
    def on_step(self, step: int, version: int, last: bool = False) -> None:
        pass


class ListSink:
    def __init__(self):
        self.events: list[tuple[int, dict]] = []

    def log(self, step: int, metrics: dict) -> None:
        self.events.append((step, dict(metrics)))


class PhaseTimes:
    """Wall time of every call of selected role methods (bench instrumentation, no role changes)."""

    def __init__(self):
        self.seconds: dict[str, list[float]] = defaultdict(list)
        self.step_end: list[float] = []

    def wrap(self, obj, method: str, name: str) -> None:
        inner = getattr(obj, method)

        def timed(*args, **kwargs):
            t0 = time.monotonic()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[name].append(time.monotonic() - t0)

        setattr(obj, method, timed)

    def mark_step_end(self, obj, method: str) -> None:
        inner = getattr(obj, method)

        def marked(*args, **kwargs):
            out = inner(*args, **kwargs)
            self.step_end.append(time.monotonic())
            return out

        setattr(obj, method, marked)


# ----------------------------------------------------------------------------- one driver


@dataclass
class DriverRun:
    driver: str
    result: LoopResult
    t_start: float
    phases: PhaseTimes
    trainer: TimedTrainer
    engines: TimedEngines
    metrics: list[tuple[int, dict]]

    def steady_steps(self, warmup: int) -> list[float]:
        """Seconds of each step after the first `warmup` (all of them when the run is not longer)."""
        ends = [self.t_start] + self.phases.step_end
        durations = [b - a for a, b in zip(ends, ends[1:])]
        return durations[warmup:] if len(durations) > warmup else durations

    def step_seconds(self, warmup: int) -> float:
        """Median seconds per steady-state step."""
        return statistics.median(self.steady_steps(warmup))

    def slot_utilisation(self, w: Workload, warmup: int) -> float:
        """Share of slot time held by a sample (a sample stalled by a pause holds its slot)."""
        ends = self.phases.step_end
        start = ends[warmup - 1] if 0 < warmup < len(ends) else self.t_start
        return self.engines.busy_slot_seconds(start, ends[-1]) / (w.slots * (ends[-1] - start))


def bench_config(w: Workload, driver: str, *, storage_root: str, async_max_concurrent_samples: int | None = None,
                 buffer_capacity_factor: float = 2.0, max_weight_staleness: int | None = None) -> RunConfig:
    cfg = replace_fields(
        embedded_default(), run_id=f"bench-{driver}-{uuid.uuid4().hex[:8]}", storage_root=storage_root,
        num_rollout=w.steps, seed=w.seed, fully_async=driver == "fully-async", one_step_off=driver == "one-step-off",
        progress=False, save="", save_interval=None, rollout_batch_size=w.batch_size, n_samples_per_prompt=w.n,
        rollout_max_response_len=w.cap_tokens, async_max_concurrent_samples=async_max_concurrent_samples,
        async_data_buffer_capacity_factor=buffer_capacity_factor, max_weight_staleness=max_weight_staleness)
    return validate(cfg)


def run_driver(w: Workload, cfg: RunConfig) -> DriverRun:
    """Run `cfg.run.num_rollout` steps of the real driver loop against the timed stand-ins."""
    clock = WeightClock()
    engines, trainer = TimedEngines(w, clock), TimedTrainer(w, clock)
    rows = builtin_rows("builtin:reverse4")
    rollout = RolloutClient.in_process(RolloutManager(cfg, engine=engines, rows=rows, decode=digit_decode,
                                                      consumed_through_step=-1))
    trainer_h = InProcessTrainer(trainer)
    board, version = Switchboard(), WeightVersion()
    roles = None
    try:
        pusher = WeightPusher(trainer_h, rollout, NoFleet(), board, version,
                              interval=cfg.rollout.update_weights_interval)
        pusher.first_push(-1, 0)  # engines serve v1, as run_training
        rollout.start().result()
        sink, phases = ListSink(), PhaseTimes()
        roles = Roles(
            driver=cfg.driver, start_step=0, end_step=cfg.run.num_rollout, end_reason="num_rollout",
            batches=batch_source(cfg.driver, rollout, board, version, cfg.rollout.update_weights_interval),
            trainer=TrainerRole(trainer_h, board), weights=pusher,
            checkpoints=Checkpointer(trainer_h, rollout, board, cfg.train.save_interval, enabled=False),
            evals=NoEvals(), metrics=MetricsLog(sink), progress=Progress(cfg.run.num_rollout, 0, enabled=False),
            deadline=Deadline(None),
            failures=FailureBudget(cfg.rollout.max_failed_sample_fraction, cfg.rollout.failed_sample_window_steps))
        for obj, method, name in ((roles.batches, "next_batch", "wait batch"),
                                  (roles.trainer, "train_step", "train"),
                                  (roles.batches, "before_weight_update", "prefetch wait"),
                                  (roles.weights, "push", "push"),
                                  (roles.checkpoints, "save", "record"),
                                  (roles.metrics, "log", "metrics")):
            phases.wrap(obj, method, name)
        phases.mark_step_end(roles.progress, "update")
        t_start = time.monotonic()
        result = run_loop(roles)
        return DriverRun(cfg.driver, result, t_start, phases, trainer, engines, sink.events)
    finally:
        rollout.stop(0.0).result(30)
        if roles is not None:
            settle(roles.batches)
        rollout.close()
        trainer_h.close()


def settle(batches) -> None:
    """Let the drain that was prefetched for a step after the last end (the stop closed its buffer) before
    its event loop stops, so no task of it is destroyed pending."""
    pending = getattr(batches, "pending", None)
    if pending is not None and pending.future is not None:
        concurrent.futures.wait([pending.future], timeout=10)


@dataclass(frozen=True)
class Knobs:
    """The product knobs every run of one invocation shares."""

    storage_root: str
    async_max_concurrent_samples: int | None  # fully async only; None: slots + n
    buffer_capacity_factor: float
    max_weight_staleness: int | None
    warmup_steps: int

    def budget(self, w: Workload) -> int:
        return self.async_max_concurrent_samples or w.slots + w.n


def run_one(w: Workload, driver: str, knobs: Knobs) -> DriverRun:
    budget = knobs.budget(w) if driver == "fully-async" else None
    cfg = bench_config(w, driver, storage_root=knobs.storage_root, async_max_concurrent_samples=budget,
                       buffer_capacity_factor=knobs.buffer_capacity_factor,
                       max_weight_staleness=knobs.max_weight_staleness)
    return run_driver(w, cfg)


# ----------------------------------------------------------------------------- report


def summarize(w: Workload, run: DriverRun, warmup: int) -> dict:
    per_step, st, tokens = run.step_seconds(warmup), run.trainer.staleness, run.trainer.tokens
    phases = {k: statistics.median(v[warmup:] or v) for k, v in run.phases.seconds.items()}
    generation = sum(tokens) * w.token_seconds / w.slots  # the consumed batches' work at full slots
    training = w.steps * w.batch_size * w.n * w.train_seconds_per_sample
    ideal_run = max(generation + w.steps * w.engine_pause_seconds, training + w.steps * w.push_seconds)
    return {"driver": run.driver, "step_seconds": per_step,
            "step_seconds_mean": statistics.mean(run.steady_steps(warmup)), "efficiency": w.ideal_seconds / per_step,
            "whole_run_seconds": run.result.seconds, "whole_run_efficiency": ideal_run / run.result.seconds,
            "first_batch_wait": run.phases.seconds["wait batch"][0],
            "slot_utilisation": run.slot_utilisation(w, warmup), "phases": phases,
            "train_sleep_overshoot": run.trainer.overshoot(warmup),
            "realized_generation_step_seconds": generation / w.steps,
            "staleness_max": max(st), "staleness_mean": sum(st) / len(st),
            "stale_groups_dropped": sum(m.get(STALE_GROUPS_FILTERED, 0.0) for _, m in run.metrics)}


def describe(w: Workload, push: PushCost, knobs: Knobs) -> None:
    print(f"\nworkload: {w.steps} steps x B={w.batch_size} groups x n={w.n}; {w.engines} engines x "
          f"{w.slots_per_engine} slots = {w.slots}; lengths lognormal(median {w.median_tokens}, sigma {w.sigma}) "
          f"capped at {w.cap_tokens} (E[L] {w.mean_tokens:.1f}); {w.token_seconds * 1e3:.3f} ms/token; "
          f"train {w.train_seconds_per_sample * 1e3:.3f} ms/sample")
    print(f"push: {push.name} ({push.source}): {w.push_seconds:.3f} s per step, the engines paused for the last "
          f"{w.engine_pause_seconds:.3f} s of it (push / T = {w.push_seconds / w.generation_step_seconds:.2f})")
    print(f"knobs: fully async budget {knobs.budget(w)} samples, buffer capacity factor "
          f"{knobs.buffer_capacity_factor}, max weight staleness {knobs.max_weight_staleness}")
    print(f"ideal time per step = max(T + pause, train + push) = {w.ideal_seconds:.3f} s\n")


def print_drivers(out: dict[str, dict], warmup: int) -> None:
    print(f"{'driver':<13}{'s/step':>8}{'efficiency':>12}{'whole run':>11}{'(eff)':>7}{'slots held':>12}"
          f"{'staleness max/mean':>20}{'stale dropped':>15}")
    for name, o in out.items():
        print(f"{name:<13}{o['step_seconds']:>8.3f}{o['efficiency']:>12.2f}{o['whole_run_seconds']:>10.1f}s"
              f"{o['whole_run_efficiency']:>7.2f}{o['slot_utilisation']:>12.2f}"
              f"{o['staleness_max']:>13d} / {o['staleness_mean']:.2f}{o['stale_groups_dropped']:>15.0f}")
    print(f"(s/step: median over the steps after the first {warmup}; whole run: from the start of the loop, "
          "pipeline fill included, against max(total generation + pauses, total training + pushes))")
    names = list(next(iter(out.values()))["phases"]) if out else []
    width = {k: max(9, len(k) + 2) for k in names}
    print("\nwhere the trainer's step went (median seconds per steady-state step):")
    print(f"{'driver':<13}" + "".join(f"{k:>{width[k]}}" for k in names) + f"{'train sleep overshoot':>23}")
    for name, o in out.items():
        print(f"{name:<13}" + "".join(f"{o['phases'][k]:>{width[k]}.3f}" for k in names)
              + f"{o['train_sleep_overshoot']:>23.3f}")


def headline(w: Workload, out: dict[str, dict]) -> dict:
    """The figures the docs quote: speedup over sync and each driver's efficiency."""
    figures = {f"{name}_step_seconds": o["step_seconds"] for name, o in out.items()}
    figures |= {f"{name}_efficiency": o["efficiency"] for name, o in out.items()}
    figures |= {"ideal_step_seconds": w.ideal_seconds, "push_seconds": w.push_seconds,
                "pause_seconds": w.engine_pause_seconds}
    if "sync" in out and "fully-async" in out:
        figures["speedup"] = out["sync"]["step_seconds"] / out["fully-async"]["step_seconds"]
        whole = out["sync"]["whole_run_seconds"] / out["fully-async"]["whole_run_seconds"]
        figures["speedup_whole_run"] = whole
        print(f"\nspeedup of fully async over sync: {figures['speedup']:.2f}x per step ({whole:.2f}x whole run); "
              f"AReaL reports {AREAL_SPEEDUP}x")
    if "fully-async" in out:
        fa = out["fully-async"]
        print(f"fully async efficiency = {w.ideal_seconds:.3f} / {fa['step_seconds']:.3f} = {fa['efficiency']:.2f} "
              f"(whole run: {fa['whole_run_efficiency']:.2f}, as it includes the pipeline fill: the first batch "
              f"waited {fa['first_batch_wait']:.2f} s for its {w.batch_size} groups)")
        print(f"workload check: the consumed batches held {fa['realized_generation_step_seconds']:.3f} s of "
              f"generation per step at full slots (E[L] gives {w.generation_step_seconds:.3f} s)")
    return figures


# ----------------------------------------------------------------------------- sensitivity


def sensitivity(w: Workload, knobs: Knobs, sigmas: list[float], pushes: list[PushCost], steps: int) -> list[dict]:
    """Sync and fully async in every (sigma, push cost) cell: speedup and fully async efficiency."""
    print(f"\nsensitivity: {steps} steps per cell (median over the steps after the first {knobs.warmup_steps}), "
          f"sync and fully async; efficiency = ideal / fully async s/step")
    print(f"{'sigma':>5}  {'push':<20}{'push s':>8}{'pause s':>9}{'push/T':>8}{'sync s/step':>13}"
          f"{'async s/step':>14}{'ideal':>8}{'speedup':>9}{'efficiency':>12}")
    rows = []
    for sigma in sigmas:
        for push in pushes:
            cell = dataclasses.replace(w, steps=steps, sigma=sigma, push_seconds=push.push_seconds,
                                       pause_seconds=push.pause_seconds)
            sync, fa = (summarize(cell, run_one(cell, d, knobs), knobs.warmup_steps) for d in ("sync", "fully-async"))
            rows.append({"kind": "sensitivity", "sigma": sigma, "push": push.name, "push_seconds": cell.push_seconds,
                         "pause_seconds": cell.engine_pause_seconds, "sync_step_seconds": sync["step_seconds"],
                         "fully_async_step_seconds": fa["step_seconds"], "ideal_step_seconds": cell.ideal_seconds,
                         "speedup": sync["step_seconds"] / fa["step_seconds"], "efficiency": fa["efficiency"],
                         "fully_async_staleness_max": fa["staleness_max"]})
            r = rows[-1]
            print(f"{sigma:>5.1f}  {push.name:<20}{r['push_seconds']:>8.3f}{r['pause_seconds']:>9.3f}"
                  f"{r['push_seconds'] / w.generation_step_seconds:>8.2f}{r['sync_step_seconds']:>13.3f}"
                  f"{r['fully_async_step_seconds']:>14.3f}{r['ideal_step_seconds']:>8.3f}{r['speedup']:>8.2f}x"
                  f"{r['efficiency']:>12.2f}", flush=True)
    return rows


# ----------------------------------------------------------------------------- command line


def staleness_flag(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def parse_args(argv=None) -> argparse.Namespace:
    d = Workload()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="B: groups per step")
    p.add_argument("--n", type=int, default=d.n, help="samples per group")
    p.add_argument("--engines", type=int, default=d.engines)
    p.add_argument("--slots-per-engine", type=int, default=d.slots_per_engine)
    p.add_argument("--median-tokens", type=int, default=d.median_tokens)
    p.add_argument("--sigma", type=float, default=d.sigma)
    p.add_argument("--cap-factor", type=float, default=d.cap_factor)
    p.add_argument("--generation-step-seconds", type=float, default=d.generation_step_seconds,
                   help="T: a step's generation time with every slot busy (scales every time but the push)")
    p.add_argument("--push-model", default=DEFAULT_PUSH,
                   help=f"whose measured push cost every driver pays: one of {', '.join(PUSH_COSTS)} "
                        "(from bench/results/weights.json when it holds it), or PUSH:PAUSE seconds")
    p.add_argument("--push-seconds", type=float, default=None, help="override the whole push (seconds)")
    p.add_argument("--pause-seconds", type=float, default=None,
                   help="override the engines' pause at the end of the push (seconds; at most --push-seconds)")
    p.add_argument("--train-ratio", type=float, default=d.train_ratio,
                   help="training / generation time per step (default 1: balanced)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--drivers", default=",".join(DRIVERS))
    p.add_argument("--warmup-steps", type=int, default=1)
    p.add_argument("--storage-root", default="memory://miles-bench")
    p.add_argument("--async-max-concurrent-samples", type=int, default=None,
                   help="fully async budget in samples (default: slots + n, the least that keeps every slot busy)")
    p.add_argument("--buffer-capacity-factor", type=float, default=2.0)
    p.add_argument("--max-weight-staleness", type=staleness_flag, default=PRODUCT_MAX_WEIGHT_STALENESS,
                   help=f"the product default ({PRODUCT_MAX_WEIGHT_STALENESS}); 'none' removes the limit")
    p.add_argument("--table-sigmas", type=floats, default=[0.5, 1.0, 1.5])
    p.add_argument("--table-push", default=DEFAULT_TABLE_PUSH, help="push costs of the sensitivity table")
    p.add_argument("--table-steps", type=int, default=8)
    p.add_argument("--no-table", action="store_true", help="skip the sensitivity table")
    results_file.add_results_flag(p, "async_speedup")
    return p.parse_args(argv)


def workload_of(a: argparse.Namespace, push: PushCost) -> Workload:
    return Workload(steps=a.steps, batch_size=a.batch_size, n=a.n, engines=a.engines,
                    slots_per_engine=a.slots_per_engine, median_tokens=a.median_tokens, sigma=a.sigma,
                    cap_factor=a.cap_factor, generation_step_seconds=a.generation_step_seconds,
                    push_seconds=push.push_seconds, pause_seconds=push.pause_seconds, seed=a.seed,
                    train_ratio=a.train_ratio)


def chosen_push(a: argparse.Namespace, costs: dict[str, PushCost]) -> PushCost:
    push = push_cost(a.push_model, costs)
    if a.push_seconds is None and a.pause_seconds is None:
        return push
    seconds = push.push_seconds if a.push_seconds is None else a.push_seconds
    pause = min(seconds, push.pause_seconds) if a.pause_seconds is None else a.pause_seconds
    return PushCost(f"{seconds:g}:{pause:g}", seconds, pause, "flag")


def main(argv=None) -> dict:
    a = parse_args(argv)
    results = results_file.ResultsFile("async_speedup", vars(a))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # Each run ends by stopping the producer with no grace: its in-flight groups are cancelled on purpose.
    logging.getLogger("miles_core.rollout.producer").setLevel(logging.ERROR)
    costs = measured_push_costs()
    push = chosen_push(a, costs)
    w = workload_of(a, push)
    knobs = Knobs(a.storage_root, a.async_max_concurrent_samples, a.buffer_capacity_factor, a.max_weight_staleness,
                  a.warmup_steps)
    out = {}
    for driver in a.drivers.split(","):
        t0 = time.monotonic()
        out[driver] = summarize(w, run_one(w, driver, knobs), a.warmup_steps)
        print(f"{driver}: {w.steps} steps in {time.monotonic() - t0:.1f} s", flush=True)
    describe(w, push, knobs)
    print_drivers(out, a.warmup_steps)
    figures = headline(w, out) | {"push_model": push.name, "push_source": push.source}
    rows = [{"kind": "driver", **o} for o in out.values()]
    if not a.no_table:
        pushes = [push_cost(s, costs) for s in a.table_push.split(",")]
        rows += sensitivity(w, knobs, a.table_sigmas, pushes, a.table_steps)
    return results.write(a.results, figures, rows)


if __name__ == "__main__":
    main()

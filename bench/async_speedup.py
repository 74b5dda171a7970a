"""Fully async vs one-step-off vs sync on the real rollout and driver code (issue #7, DESIGN §5).

    .venv/bin/python bench/async_speedup.py            # ~1 minute: 20 steps x 32 groups x 8 samples, 3 drivers
    .venv/bin/python bench/async_speedup.py --drivers fully-async --async-max-concurrent-samples 64
    flags: --steps --batch-size --n --engines --slots-per-engine --median-tokens --sigma --cap-factor
           --generation-step-seconds --train-ratio --push-seconds --drivers --warmup-steps --storage-root
           --async-max-concurrent-samples --buffer-capacity-factor --max-weight-staleness

What is real: RolloutManager (data source, producer, submission budget, staleness admission,
durable buffer on a memory:// run root (or `--storage-root file://...`), drain), `run_loop` and the
Roles of `miles_core.driver` (OnDemandBatches / PrefetchedBatches, TrainerRole, WeightPusher,
Checkpointer recording consumed ids every step), each side behind a LocalHandle (its own event-loop
thread), where the Ray path has actors. What is timed, not computed:
- `TimedEngines`: `engines` engines of `slots_per_engine` concurrent slots each (an asyncio.Semaphore
  per engine; a request goes to the engine with the fewest requests running or queued); a sample of
  L tokens holds a slot for L x `token_seconds` (one asyncio.sleep). L is lognormal (sigma 1.0),
  capped at 16x the median, and a deterministic function of (prompt, sample index), so every driver
  sees the same lengths for the same prompts. Each token carries the weight version the engine held
  when that token was produced (a sample that straddles a push carries both).
- `TimedTrainer`: train_step takes `train_seconds_per_sample` per sample (time.sleep on its own
  thread); push_weights sleeps `push_seconds` and bumps the version the engines read.
The per-sample training time is set so that the mean generation time of a step with every slot
busy equals the training time of a step: T = B x n x E[L] x token_seconds / slots (`--train-ratio`
scales training against that). Nothing CPU-bound is timed: generation and training are sleeps, so a
loaded machine changes only the real overheads (put, commit, drain, hops between threads), which is
what the efficiency line measures.

Budgets: sync and one-step-off keep their defaults (B groups, group granularity: the whole batch is
submitted at once and queues for the slots; the batch ends with its longest sample). Fully async
gets `--async-max-concurrent-samples`, by default slots + n: under sample granularity a new group
starts when in_flight + n <= budget, so slots + n is the least budget that keeps every slot busy.

Printed: time per step of each driver (steady state, after `--warmup-steps`, and the whole run),
the speedup of fully async over sync (AReaL reports 2.77x), the ideal time per step
(generation and training fully overlapped, slots always full: max(generation work / slots,
training time)) and efficiency = ideal / measured, plus where the trainer's step went (wait for a
batch, train, the prefetch wait before the weight update, push, consumption record), slot
utilisation, consumed staleness and the groups dropped as stale at get.
tests/integration/test_drivers.py runs the same harness (`bench_config`, `run_driver`) with tiny times.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import functools
import logging
import math
import os
import random
import sys
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from miles_core.buffer.metrics import STALE_GROUPS_FILTERED  # noqa: E402
from miles_core.config import RunConfig, replace_fields, validate  # noqa: E402
from miles_core.driver.handles import LocalHandle  # noqa: E402
from miles_core.driver.loop import LoopResult, run_loop  # noqa: E402
from miles_core.driver.roles import (Checkpointer, Deadline, MetricsLog, Progress, Roles, TrainerRole,  # noqa: E402
                                     WeightPusher, batch_source)
from miles_core.rollout.builtin_tasks import builtin_rows  # noqa: E402
from miles_core.rollout.manager import RolloutManager, digit_decode  # noqa: E402

DRIVERS = ("sync", "one-step-off", "fully-async")
AREAL_SPEEDUP = 2.77


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
    push_seconds: float = 0.005
    seed: int = 1
    train_ratio: float = 1.0  # training time per step / generation time per step (1: balanced, the benchmark)

    @property
    def slots(self) -> int:
        return self.engines * self.slots_per_engine

    @property
    def cap_tokens(self) -> int:
        return int(round(self.cap_factor * self.median_tokens))

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
        """Per step, generation and training fully overlapped, slots always full."""
        return self.generation_step_seconds * max(1.0, self.train_ratio)


# ----------------------------------------------------------------------------- stand-ins


class WeightClock:
    """The weight version the engines serve, with the time of every change (any thread)."""

    def __init__(self, version: int = 0):
        self.version = version
        self.history: list[tuple[float, int]] = [(float("-inf"), version)]  # appends are atomic

    def publish(self, version: int) -> None:
        self.history.append((time.monotonic(), version))
        self.version = version

    def token_versions(self, t0: float, t1: float, tokens: int) -> list[int]:
        """Versions of `tokens` tokens produced evenly over [t0, t1] (token i done at t0 + (i+1) dt)."""
        history = self.history[:]
        i = bisect.bisect_right(history, (t0, math.inf)) - 1
        current, out, dt = history[i][1], [], (t1 - t0) / tokens
        for t, v in history[i + 1:]:
            if t > t1:
                break
            before = min(tokens, int((t - t0) / dt)) if dt > 0 else 0
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
                await asyncio.sleep(tokens * self.w.token_seconds)
                t1 = time.monotonic()
        finally:
            engine.load -= 1
        self.busy_intervals.append((t0, t1))
        finish = "length" if tokens >= self.w.cap_tokens else "stop"
        return TimedResult([5] * tokens, [-1.0] * tokens, self.clock.token_versions(t0, t1, tokens), finish, t1 - t0)

    def busy_slot_seconds(self, start: float, end: float) -> float:
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b in self.busy_intervals)


class TimedTrainer:
    """The trainer actor's calls, timed: train_step sleeps per sample, push_weights bumps the version."""

    def __init__(self, workload: Workload, clock: WeightClock):
        self.w, self.clock = workload, clock
        self.trained: list[list[str]] = []  # group ids per step
        self.staleness: list[int] = []  # per trained group: version at train time - min token version
        self.tokens: list[int] = []  # response tokens per step
        self.slept: list[tuple[float, float]] = []  # (asked, got) per train_step

    def train_step(self, step: int, groups: list) -> dict:
        t0, version = time.monotonic(), self.clock.version
        samples = [s for g in groups for s in g.samples]
        asked = len(samples) * self.w.train_seconds_per_sample
        self.trained.append([g.group_id for g in groups])
        self.staleness.extend(version - min(s.oldest_version for s in g.samples) for g in groups)
        self.tokens.append(sum(len(s.response_ids) for s in samples))
        time.sleep(max(0.0, t0 + asked - time.monotonic()))  # the bookkeeping above is part of the step
        self.slept.append((asked, time.monotonic() - t0))
        return {"train/samples": float(len(samples))}

    def overshoot(self, skip: int = 0) -> float:
        """Mean seconds time.sleep overslept per train_step (a loaded machine wakes threads late)."""
        tail = self.slept[skip:] or self.slept
        return sum(got - asked for asked, got in tail) / len(tail)

    def push_weights(self, step: int) -> dict:
        time.sleep(self.w.push_seconds)
        self.clock.publish(self.clock.version + 1)
        return {"version": self.clock.version}

    def save_checkpoint(self, step: int, extras: dict) -> None:
        pass


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

    def step_seconds(self, warmup: int) -> float:
        """Steady-state time per step: from the end of step warmup-1 to the end of the last step."""
        ends = self.phases.step_end
        if warmup <= 0 or len(ends) <= warmup:
            return (ends[-1] - self.t_start) / len(ends)
        return (ends[-1] - ends[warmup - 1]) / (len(ends) - warmup)

    def slot_utilisation(self, w: Workload, warmup: int) -> float:
        ends = self.phases.step_end
        start = ends[warmup - 1] if 0 < warmup < len(ends) else self.t_start
        return self.engines.busy_slot_seconds(start, ends[-1]) / (w.slots * (ends[-1] - start))


def bench_config(w: Workload, driver: str, *, storage_root: str, async_max_concurrent_samples: int | None = None,
                 buffer_capacity_factor: float = 2.0, max_weight_staleness: int | None = None) -> RunConfig:
    cfg = replace_fields(
        RunConfig(), run_id=f"bench-{driver}-{uuid.uuid4().hex[:8]}", storage_root=storage_root,
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
    rollout = LocalHandle(RolloutManager(cfg, engine=engines, rows=rows, decode=digit_decode,
                                         consumed_through_step=-1))
    trainer_h = LocalHandle(trainer)
    try:
        version_box = [trainer_h.call("push_weights", -1).result()["version"]]  # engines serve v1, as run_training
        rollout.call("set_version", version_box[0]).result()
        rollout.call("start").result()
        sink, phases = ListSink(), PhaseTimes()
        roles = Roles(
            driver=cfg.driver, start_step=0, end_step=cfg.run.num_rollout, end_reason="num_rollout",
            batches=batch_source(cfg.driver, rollout, version_box, cfg.rollout.update_weights_interval),
            trainer=TrainerRole(trainer_h),
            weights=WeightPusher(trainer_h, rollout, None, cfg.rollout.update_weights_interval, version_box),
            checkpoints=Checkpointer(trainer_h, rollout, cfg.train.save_interval, enabled=False),
            evals=NoEvals(), metrics=MetricsLog(sink), progress=Progress(cfg.run.num_rollout, 0, enabled=False),
            deadline=Deadline(None))
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
        rollout.call("stop", 0.0).result(30)
        rollout.close()
        trainer_h.close()


# ----------------------------------------------------------------------------- report


def summarize(w: Workload, run: DriverRun, warmup: int) -> dict:
    per_step, st, tokens = run.step_seconds(warmup), run.trainer.staleness, run.trainer.tokens
    phases = {k: sum(v[warmup:]) / max(1, len(v[warmup:])) for k, v in run.phases.seconds.items()}
    phases["loop (rest)"] = per_step - sum(phases.values())
    generation = sum(tokens) * w.token_seconds / w.slots  # the consumed batches' work at full slots
    training = w.steps * w.batch_size * w.n * w.train_seconds_per_sample
    return {"step_seconds": per_step, "efficiency": w.ideal_seconds / per_step,
            "whole_run_seconds": run.result.seconds,
            "whole_run_efficiency": max(generation, training) / run.result.seconds,
            "first_batch_wait": run.phases.seconds["wait batch"][0],
            "slot_utilisation": run.slot_utilisation(w, warmup), "phases": phases,
            "train_sleep_overshoot": run.trainer.overshoot(warmup),
            "realized_generation_step_seconds": generation / w.steps,
            "staleness_max": max(st), "staleness_mean": sum(st) / len(st),
            "stale_groups_dropped": sum(m.get(STALE_GROUPS_FILTERED, 0.0) for _, m in run.metrics)}


def report(w: Workload, runs: dict[str, DriverRun], warmup: int, knobs: dict) -> dict:
    T = w.ideal_seconds
    out = {name: summarize(w, run, warmup) for name, run in runs.items()}
    print(f"\nworkload: {w.steps} steps x B={w.batch_size} groups x n={w.n}; {w.engines} engines x "
          f"{w.slots_per_engine} slots = {w.slots}; lengths lognormal(median {w.median_tokens}, sigma {w.sigma}) "
          f"capped at {w.cap_tokens} (E[L] {w.mean_tokens:.1f}); {w.token_seconds * 1e3:.3f} ms/token; "
          f"train {w.train_seconds_per_sample * 1e3:.3f} ms/sample; push {w.push_seconds * 1e3:.0f} ms")
    print(f"knobs: {knobs}")
    print(f"ideal time per step = max(generation work / slots, training) = {T:.3f} s\n")
    print(f"{'driver':<13}{'s/step':>8}{'efficiency':>12}{'whole run':>11}{'(eff)':>7}{'slots busy':>12}"
          f"{'staleness max/mean':>20}{'stale dropped':>15}")
    for name, o in out.items():
        print(f"{name:<13}{o['step_seconds']:>8.3f}{o['efficiency']:>12.2f}{o['whole_run_seconds']:>10.1f}s"
              f"{o['whole_run_efficiency']:>7.2f}{o['slot_utilisation']:>12.2f}"
              f"{o['staleness_max']:>13d} / {o['staleness_mean']:.2f}{o['stale_groups_dropped']:>15.0f}")
    print(f"(s/step and slots busy: steady state, after the first {warmup} step(s); whole run: from the start of "
          "the loop, pipeline fill included, against max(total generation / slots, total training))")
    names = list(next(iter(out.values()))["phases"]) if out else []
    width = {k: max(9, len(k) + 2) for k in names}
    print("\nwhere the trainer's step went (mean seconds per steady-state step):")
    print(f"{'driver':<13}" + "".join(f"{k:>{width[k]}}" for k in names) + f"{'train sleep overshoot':>23}")
    for name, o in out.items():
        print(f"{name:<13}" + "".join(f"{o['phases'][k]:>{width[k]}.3f}" for k in names)
              + f"{o['train_sleep_overshoot']:>23.3f}")
    if "sync" in out and "fully-async" in out:
        out["speedup"] = out["sync"]["step_seconds"] / out["fully-async"]["step_seconds"]
        whole = out["sync"]["whole_run_seconds"] / out["fully-async"]["whole_run_seconds"]
        print(f"\nspeedup of fully async over sync: {out['speedup']:.2f}x per step ({whole:.2f}x whole run); "
              f"AReaL reports {AREAL_SPEEDUP}x")
    if "fully-async" in out:
        fa = out["fully-async"]
        verdict = "meets" if fa["efficiency"] >= 0.9 else "misses"
        print(f"fully async efficiency = {T:.3f} / {fa['step_seconds']:.3f} = {fa['efficiency']:.2f}: {verdict} the "
              f"0.9 target (whole run: {fa['whole_run_efficiency']:.2f}, as it includes the pipeline fill: the "
              f"first batch waited {fa['first_batch_wait']:.2f} s for its {w.batch_size} groups)")
        print(f"workload check: the consumed batches held {fa['realized_generation_step_seconds']:.3f} s of "
              f"generation per step at full slots (E[L] gives {w.generation_step_seconds:.3f} s)")
    return out


def parse_args(argv=None) -> tuple[Workload, argparse.Namespace]:
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
                   help="T: a step's generation time with every slot busy (scales every time)")
    p.add_argument("--push-seconds", type=float, default=d.push_seconds)
    p.add_argument("--train-ratio", type=float, default=d.train_ratio,
                   help="training / generation time per step (default 1: balanced)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--drivers", default=",".join(DRIVERS))
    p.add_argument("--warmup-steps", type=int, default=1)
    p.add_argument("--storage-root", default="memory://miles-bench")
    p.add_argument("--async-max-concurrent-samples", type=int, default=None,
                   help="fully async budget in samples (default: slots + n, the least that keeps every slot busy)")
    p.add_argument("--buffer-capacity-factor", type=float, default=2.0)
    p.add_argument("--max-weight-staleness", type=int, default=None)
    a = p.parse_args(argv)
    w = Workload(a.steps, a.batch_size, a.n, a.engines, a.slots_per_engine, a.median_tokens, a.sigma, a.cap_factor,
                 a.generation_step_seconds, a.push_seconds, a.seed, a.train_ratio)
    return w, a


def main(argv=None) -> dict:
    w, a = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # Each run ends by stopping the producer with no grace: its in-flight groups are cancelled on purpose.
    logging.getLogger("miles_core.rollout.producer").setLevel(logging.ERROR)
    budget = a.async_max_concurrent_samples or w.slots + w.n
    knobs = {"async_max_concurrent_samples (fully async)": budget, "buffer_capacity_factor": a.buffer_capacity_factor,
             "max_weight_staleness": a.max_weight_staleness}
    runs = {}
    for driver in a.drivers.split(","):
        cfg = bench_config(w, driver, storage_root=a.storage_root,
                           async_max_concurrent_samples=budget if driver == "fully-async" else None,
                           buffer_capacity_factor=a.buffer_capacity_factor, max_weight_staleness=a.max_weight_staleness)
        t0 = time.monotonic()
        runs[driver] = run_driver(w, cfg)
        print(f"{driver}: {w.steps} steps in {time.monotonic() - t0:.1f} s", flush=True)
    return report(w, runs, a.warmup_steps, knobs)


if __name__ == "__main__":
    main()

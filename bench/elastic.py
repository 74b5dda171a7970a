"""What producer jobs buy: a run's steps per minute on its own engine, then with one and two producer jobs
joined mid-run, and what SIGKILLing one of them costs (docs/benchmarks.md, "elastic").

    .venv/bin/python bench/elastic.py            # ~6 minutes on 2 cores
    .venv/bin/python bench/elastic.py --quick    # ~3 minutes: 0.1 s tokens, 3-step windows, 15 s claim TTL
    flags: --seconds-per-token --slots --batch-size --n --warmup-steps --window-steps --settle-steps
           --kill-steps --claim-ttl-seconds --timeout --keep --quick --results

What is real: everything but the engines' speed, each part in a process group of its own as in production.
The trainer is `run_training` (miles_core.driver.segment: what the Flyte train task calls) with its own
local Ray (trainer, rollout manager, one CPU engine server) and `--allow-rollout-producers`; each
producer is `run_producer` (miles_core.elastic.job: what workflows/rollout_producer.py's task calls)
with its own local Ray and one engine, joined through the run root alone (file://). So every cost of
the product is paid where it is paid: weight pushes to the run root and each producer's pause-load-resume
of them, the feed, prompt claims and their renewal, heartbeats, the trainer's listing of other writers'
groups every `--producer-poll-seconds` (1 s), the staleness and duplicate filters, three Ray instances
sharing the machine. The producer process is the task's call plus one observer thread that writes its
in-flight group count to a side file every 0.1 s, so the bench knows what a kill interrupted.

The stand-in: every engine (the trainer's and each producer's) runs with
MILES_CPU_ENGINE_SECONDS_PER_TOKEN (miles_core/engines/cpu_server.py): each batching step lasts at least
`--seconds-per-token` S and gives every running request one token, for up to `--slots` requests at once
(`--engine-max-running-requests`), so an engine generates about slots / (L x S) samples a second (L the
response length, at most 5 tokens in the builtin task) whatever the cores do: a GPU engine's regime,
where another engine adds generation. Each writer's submission budget is slots + n samples
(`--async-max-concurrent-samples`, the least that keeps its engine's slots busy), so a producer of one
engine is the trainer's own rollout's equal. A batch's generation on one engine then takes about
B x n x L x S / slots (8 s at the defaults, 2.7 s with three engines) against a trainer step of
0.1-0.5 s (the builtin tiny model; the per-phase medians are printed): generation is the bottleneck.

Phases, timed by the consumption manifests the trainer writes every step (buffer/consumed/):
1. alone: the trainer's engine only, `--window-steps` steps after `--warmup-steps`;
2. one: producer p1 started; `--settle-steps` after its first consumed group, a window;
3. two: producer p2 started likewise, a window;
4. kill: SIGKILL p1's process group and every process under it (its Ray, its engine) at once; then
   `--kill-steps` steps, and on until another writer has generated every prompt p1 held unfinished
   (its claims expire after `--claim-ttl-seconds`) or 2 x TTL + 60 s pass.
Printed and written (bench/results/elastic.json): steps/min of each phase (60 / the median seconds
between consumption manifests) and their ratios to alone (target: two producers >= 2.5x), seconds from a
producer's start to its first consumed group, and the kill's cost: the groups p1 had in flight (lost),
its committed groups and where they went (consumed, rejected, still buffered: none may be missing), its
unfinished claimed prompts and how many other writers generated later, and the seconds until the steps
per minute are back at the one-producer level (3 consecutive steps at >= 90% of it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import results_file  # noqa: E402
from miles_core.buffer.objects import decode_object, prompt_of_id, split_group_key  # noqa: E402
from miles_core.engines.cpu_server import SECONDS_PER_TOKEN_ENV  # noqa: E402
from miles_core.lineage.producers import TRAINER, generated_by  # noqa: E402
from miles_core.metrics.sink import read_metrics  # noqa: E402
from miles_core.storage import ObjectNotFound, Store  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RUN_ID = "elastic"
TARGET_RATIO = 2.5  # two producers of the trainer's size: at least this many times the steps per minute
RECOVERED = 0.9  # back at the one-producer level: this fraction of its steps per minute ...
RECOVERY_STEPS = 3  # ... over this many consecutive steps
TRAINER_SCRIPT = """import sys
from miles_core.config import parse_flags
from miles_core.driver.segment import run_training
run_training(parse_flags(["--preset", "tiny-reverse4", *sys.argv[1:]]))
"""
# The producer task's call (tasks/producer.py), plus an observer of the job's in-flight groups.
PRODUCER_SCRIPT = """import json, os, sys, threading, time
from miles_core.elastic import job
run_uri, producer_id, side = sys.argv[1], sys.argv[2], sys.argv[3]
jobs, init = [], job.ProducerJob.__init__
def capture(self, *a, **k):
    init(self, *a, **k)
    jobs.append(self)
job.ProducerJob.__init__ = capture
def observe():
    while True:
        j = jobs[0] if jobs else None
        p, s = getattr(j, "producer", None), getattr(j, "sink", None)
        rec = {"at": time.time(), "writer": j.writer_id if j else None,
               "in_flight": p.in_flight_groups if p else 0, "committed": s.committed if s else 0}
        with open(side + ".tmp", "w") as f:
            json.dump(rec, f)
        os.replace(side + ".tmp", side)
        time.sleep(0.1)
threading.Thread(target=observe, daemon=True).start()
print(job.run_producer(run_uri, num_engines=1, producer_id=producer_id), flush=True)
"""


# ----------------------------------------------------------------------------- processes


class Proc:
    """A process in a session of its own with a private Ray temp dir (Ray's sockets live under it)."""

    def __init__(self, name: str, argv: list[str], workdir: Path, env: dict[str, str]):
        self.name, self.log = name, workdir / f"{name}.log"
        self.ray_tmp = tempfile.mkdtemp(prefix=f"me{name[:2]}", dir="/tmp")  # short: unix socket paths
        env = dict(os.environ, **env, RAY_TMPDIR=self.ray_tmp, PYTHONUNBUFFERED="1")
        self.started = time.time()
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def kill(self) -> float:
        """SIGKILL its process group, every descendant and every process of its Ray, all at once; the time."""
        victims = self._tree()
        at = time.time()
        with _quiet():
            os.killpg(self.proc.pid, signal.SIGKILL)
        for p in victims:
            with _quiet():
                p.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        return at

    def _tree(self) -> list[psutil.Process]:
        out = []
        with _quiet():
            root = psutil.Process(self.proc.pid)
            out = [root, *root.children(recursive=True)]
        for p in psutil.process_iter(["cmdline"]):
            if self.ray_tmp in " ".join(p.info["cmdline"] or []):
                out.append(p)
        return out

    def close(self) -> None:
        if self.alive():
            self.kill()
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


class _quiet:
    """Ignore a process that is already gone (or not ours to signal)."""

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        return kind is not None and issubclass(kind, (ProcessLookupError, PermissionError, psutil.Error))


# ----------------------------------------------------------------------------- the run root


@dataclass
class Step:
    """One consumption manifest: the step, when it was written, and who generated what it consumed."""

    step: int
    at: float
    consumed: list[str]
    rejected: list[str]

    def by(self, producer: str) -> int:
        return sum(generated_by(g) == producer for g in self.consumed)


@dataclass
class RunWatch:
    """The run root as the bench reads it: steps (manifests), producers' side files."""

    store: Store
    steps: dict[int, Step] = field(default_factory=dict)

    def poll(self) -> list[Step]:
        for key in self.store.list("buffer/consumed/"):
            name = key.rsplit("/", 1)[-1]
            if name.endswith(".json") and name[:-5].isdigit() and int(name[:-5]) not in self.steps:
                self._read(key)
        return self.ordered()

    def _read(self, key: str) -> None:
        try:
            m = self.store.get_json(key)
        except ObjectNotFound:
            return
        self.steps[m["step"]] = Step(m["step"], m["written_at"], list(m.get("consumed", ())),
                                     list(m.get("rejected", ())))

    def ordered(self) -> list[Step]:
        return [self.steps[k] for k in sorted(self.steps)]

    def last(self) -> int:
        return max(self.steps, default=-1)

    def first_consumed(self, producer: str) -> Step | None:
        return next((s for s in self.ordered() if s.by(producer)), None)


def side_file(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return {}


def committed_groups(store: Store, writer: str) -> list[tuple[str, tuple[int, int] | None]]:
    """(group id, (epoch, position)) of every group `writer` committed."""
    out = []
    for key in store.list(f"buffer/groups/{writer}/"):
        if split_group_key(key) is not None:
            out += [(g.group_id, g.position) for g in decode_object(store.get_bytes(key), key)]
    return out


def unfinished_claims(store: Store, holder: str) -> set[tuple[int, int]]:
    """(epoch, position) of every prompt in a claim block `holder` holds and has not finished."""
    out = set()
    for key in store.list("claims/"):
        if not key.endswith(".json"):
            continue
        rec = store.get_json(key)
        if rec.get("holder") == holder and not rec.get("done"):
            out |= {(rec["epoch"], p) for p in range(rec["start"], rec["end"])}
    return out


# ----------------------------------------------------------------------------- the bench


@dataclass(frozen=True)
class Sizes:
    seconds_per_token: float
    slots: int
    batch_size: int
    n: int
    claim_ttl_seconds: float

    @property
    def budget_samples(self) -> int:
        return self.slots + self.n

    def generation_seconds(self, engines: int, tokens: float = 5.0) -> float:
        """A batch's generation at full slots on `engines` engines, samples of `tokens` tokens."""
        return self.batch_size * self.n * tokens * self.seconds_per_token / (self.slots * engines)

    def trainer_flags(self, storage: Path) -> list[str]:
        return ["--storage-root", str(storage), "--run-id", RUN_ID, "--num-rollout", "100000", "--no-progress",
                "--eval-prompt-data", "--eval-interval", "none", "--save-interval", "none",
                "--allow-rollout-producers", "--rollout-batch-size", str(self.batch_size),
                "--n-samples-per-prompt", str(self.n), "--engine-max-running-requests", str(self.slots),
                "--async-max-concurrent-samples", str(self.budget_samples),
                "--prompt-claim-ttl-seconds", str(self.claim_ttl_seconds)]

    def env(self) -> dict[str, str]:
        return {SECONDS_PER_TOKEN_ENV: str(self.seconds_per_token)}


class Bench:
    """The run, its producers and the phases' boundaries (step numbers), as they happen."""

    def __init__(self, a: argparse.Namespace, sizes: Sizes, workdir: Path):
        self.a, self.sizes, self.workdir = a, sizes, workdir
        self.run_uri = f"file://{workdir / 'store'}/runs/{RUN_ID}"
        self.watch = RunWatch(Store(self.run_uri))
        self.procs: dict[str, Proc] = {}
        self.marks: dict[str, int] = {}  # phase boundary -> the last step before it
        self.deadline = time.monotonic() + a.timeout
        self.kill: dict = {}

    def start(self, name: str, argv: list[str]) -> Proc:
        self.procs[name] = Proc(name, argv, self.workdir, self.sizes.env())
        print(f"[{self.elapsed():6.1f} s] started {name} (log {self.procs[name].log})", flush=True)
        return self.procs[name]

    def start_producer(self, name: str) -> Proc:
        side = self.workdir / f"{name}.json"
        return self.start(name, [sys.executable, "-c", PRODUCER_SCRIPT, self.run_uri, name, str(side)])

    def elapsed(self) -> float:
        t0 = self.procs["trainer"].started if "trainer" in self.procs else time.time()
        return time.time() - t0

    def wait_for(self, what: str, done) -> None:
        """Poll the run root until `done()`; fail with the logs when a process dies or time runs out."""
        while True:
            self.watch.poll()
            if done():
                return
            for p in self.procs.values():
                if not p.alive() and p.name not in self.kill.get("killed", ()):
                    raise RuntimeError(f"{p.name} exited ({p.proc.returncode}) waiting for {what}:\n{p.tail()}")
            if time.monotonic() > self.deadline:
                raise RuntimeError(f"no {what} within --timeout {self.a.timeout} s:\n" + "\n".join(
                    f"--- {p.name}\n{p.tail(1500)}" for p in self.procs.values()))
            time.sleep(0.25)

    def steps_past(self, n: int) -> int:
        """Wait until `n` more steps are consumed; the last of them."""
        self.watch.poll()
        target = self.watch.last() + n
        self.wait_for(f"step {target}", lambda: self.watch.last() >= target)
        return self.watch.last()

    def log_phase(self, name: str) -> None:
        self.marks[name] = self.watch.last()
        print(f"[{self.elapsed():6.1f} s] {name}: step {self.watch.last()}", flush=True)

    # ------------------------------------------------------------------ phases
    def run(self) -> None:
        a = self.a
        self.start("trainer", [sys.executable, "-c", TRAINER_SCRIPT, *self.sizes.trainer_flags(self.workdir / "store")])
        self.wait_for(f"{a.warmup_steps} warm-up steps", lambda: self.watch.last() >= a.warmup_steps - 1)
        self.log_phase("alone_from")
        self.steps_past(a.window_steps)
        self.log_phase("alone_to")
        for name, phase in (("p1", "one"), ("p2", "two")):
            self.join(name, phase)
        self.kill_p1()

    def join(self, name: str, phase: str) -> None:
        self.start_producer(name)
        self.wait_for(f"{name}'s first consumed group", lambda: self.watch.first_consumed(name) is not None)
        self.log_phase(f"{name}_joined")
        self.steps_past(self.a.settle_steps)
        self.log_phase(f"{phase}_from")
        self.steps_past(self.a.window_steps)
        self.log_phase(f"{phase}_to")

    def kill_p1(self) -> None:
        p1, side = self.procs["p1"], self.workdir / "p1.json"
        before = side_file(side)
        self.kill = {"killed": ("p1",), "at": p1.kill(), "observed": before}
        self.log_phase("kill")
        store = self.watch.store
        self.kill["orphans"] = unfinished_claims(store, "p1") - {pos for _, pos in committed_groups(
            store, before["writer"])}
        print(f"[{self.elapsed():6.1f} s] killed p1: {before['in_flight']} groups in flight, "
              f"{len(self.kill['orphans'])} claimed prompts unfinished", flush=True)
        self.steps_past(self.a.kill_steps)
        limit = time.monotonic() + 2 * self.sizes.claim_ttl_seconds + 60
        self.wait_for("the unfinished prompts of p1 generated by others",
                      lambda: not self.orphans_left() or time.monotonic() > limit)
        self.log_phase("end")

    def orphans_left(self) -> set[tuple[int, int]]:
        done = {prompt_of_id(g)[:2] for s in self.watch.ordered() if s.at > self.kill["at"]
                for g in s.consumed if generated_by(g) != "p1" and prompt_of_id(g)}
        return self.kill["orphans"] - done

    def close(self) -> None:
        for p in self.procs.values():
            p.close()


# ----------------------------------------------------------------------------- analysis


def intervals(steps: list[Step], first: int, last: int) -> list[float]:
    """Seconds between consecutive manifests, for the steps first..last (each after the one before it)."""
    at = {s.step: s.at for s in steps}
    return [at[k] - at[k - 1] for k in range(max(first, 1), last + 1) if k in at and k - 1 in at]


def per_minute(seconds: list[float]) -> float:
    return 60.0 / statistics.median(seconds) if seconds else float("nan")


def recovery_seconds(steps: list[Step], kill_at: float, level: float) -> float | None:
    """Seconds from the kill until RECOVERY_STEPS consecutive steps run at >= RECOVERED x `level` steps/min
    (0 when the first steps after it already do); None if they never do."""
    after = [s for s in steps if s.at > kill_at]
    before = [s for s in steps if s.at <= kill_at]
    chain = before[-1:] + after
    for i in range(len(chain) - RECOVERY_STEPS):
        span = chain[i + RECOVERY_STEPS].at - chain[i].at
        if 60.0 * RECOVERY_STEPS / span >= RECOVERED * level:
            return max(0.0, chain[i].at - kill_at)
    return None


def phase_row(name: str, steps: list[Step], first: int, last: int, metrics: dict[int, dict]) -> dict:
    seconds = intervals(steps, first, last)
    window = [s for s in steps if first <= s.step <= last]
    train = [metrics[s.step]["perf/train_step_seconds"] for s in window
             if metrics.get(s.step, {}).get("perf/train_step_seconds") is not None]
    writers = {w: sum(s.by(w) for s in window) for w in (TRAINER, "p1", "p2")}
    return {"kind": "phase", "phase": name, "first_step": first, "last_step": last, "steps": len(seconds),
            "step_seconds": statistics.median(seconds) if seconds else None, "steps_per_minute": per_minute(seconds),
            "train_step_seconds": statistics.median(train) if train else None,
            "groups_by_writer": writers, "rejected_at_get": sum(len(s.rejected) for s in window)}


def metrics_by_step(run_uri: str) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for e in read_metrics(run_uri, "trainer"):
        out.setdefault(e["step"], {})[e["name"]] = e["value"]
    return out


def fates(steps: list[Step], groups: list[tuple[str, tuple | None]]) -> dict:
    """Where the committed groups of one writer went: consumed, rejected at get, or still in the buffer."""
    consumed = {g for s in steps for g in s.consumed}
    rejected = {g for s in steps for g in s.rejected}
    ids = {g for g, _ in groups}
    return {"committed": len(ids), "consumed": len(ids & consumed), "rejected_at_get": len(ids & rejected - consumed),
            "still_buffered": len(ids - consumed - rejected)}


def analyse(bench: Bench) -> tuple[dict, list[dict]]:
    steps, m, metrics = bench.watch.ordered(), bench.marks, metrics_by_step(bench.run_uri)
    phases = {"alone": phase_row("alone", steps, m["alone_from"] + 1, m["alone_to"], metrics),
              "one": phase_row("one", steps, m["one_from"] + 1, m["one_to"], metrics),
              "two": phase_row("two", steps, m["two_from"] + 1, m["two_to"], metrics),
              "after_kill": phase_row("after_kill", steps, m["kill"] + 2, m["end"], metrics)}
    joined = {p: producer_row(bench, p) for p in ("p1", "p2")}
    kill = kill_row(bench, steps, phases["one"]["steps_per_minute"])
    rows = [*phases.values(), *joined.values(), kill, *step_rows(bench, steps)]
    return figures_of(bench.sizes, phases, joined, kill), rows


def producer_row(bench: Bench, name: str) -> dict:
    first = bench.watch.first_consumed(name)
    started = bench.procs[name].started
    return {"kind": "producer", "producer": name, "started_s": started - bench.procs["trainer"].started,
            "first_consumed_step": first.step, "first_consumed_seconds": first.at - started}


def kill_row(bench: Bench, steps: list[Step], one_level: float) -> dict:
    k = bench.kill
    store, observed = bench.watch.store, k["observed"]
    committed = committed_groups(store, observed["writer"])
    left = bench.orphans_left()
    landed = max(0, len(committed) - observed["committed"])  # committed between the last observation and the kill
    return {"kind": "kill", "producer": "p1", "in_flight_groups": observed["in_flight"] - landed,
            "in_flight_observed": observed["in_flight"], "observed_before_kill_s": k["at"] - observed["at"],
            "committed_groups": len(committed),
            **{f"committed_{key}": v for key, v in fates(steps, committed).items() if key != "committed"},
            "unfinished_claimed_prompts": len(k["orphans"]),
            "regenerated_by_others": len(k["orphans"]) - len(left),
            "recovery_seconds": recovery_seconds(steps, k["at"], one_level),
            "longest_step_after_kill_s": max(intervals(steps, bench.marks["kill"] + 1, bench.marks["end"]),
                                             default=None)}


def step_rows(bench: Bench, steps: list[Step]) -> list[dict]:
    t0 = bench.procs["trainer"].started
    return [{"kind": "step", "step": s.step, "at_s": s.at - t0, "consumed": {w: s.by(w) for w in (TRAINER, "p1", "p2")},
             "rejected_at_get": len(s.rejected)} for s in steps]


def figures_of(sizes: Sizes, phases: dict, joined: dict, kill: dict) -> dict:
    alone = phases["alone"]["steps_per_minute"]
    figures = {f"{p}_steps_per_minute": r["steps_per_minute"] for p, r in phases.items()}
    figures |= {f"{p}_train_step_seconds": r["train_step_seconds"] for p, r in phases.items()}
    figures |= {"one_ratio": phases["one"]["steps_per_minute"] / alone,
                "two_ratio": phases["two"]["steps_per_minute"] / alone,
                "after_kill_ratio_to_one": phases["after_kill"]["steps_per_minute"] / phases["one"]["steps_per_minute"],
                "target_two_ratio": TARGET_RATIO}
    figures |= {f"{p}_first_consumed_seconds": r["first_consumed_seconds"] for p, r in joined.items()}
    figures |= {f"kill_{k}": v for k, v in kill.items() if k not in ("kind", "producer")}
    figures |= {"generation_seconds_one_engine": sizes.generation_seconds(1),
                "generation_seconds_three_engines": sizes.generation_seconds(3)}
    return figures


# ----------------------------------------------------------------------------- report


def report(sizes: Sizes, figures: dict, rows: list[dict]) -> None:
    print(f"\nengines: {sizes.slots} slots, {sizes.seconds_per_token} s per token; budget {sizes.budget_samples} "
          f"samples a writer; B={sizes.batch_size} groups x n={sizes.n}: a batch's generation at full slots "
          f"~{sizes.generation_seconds(1):.1f} s on one engine, ~{sizes.generation_seconds(3):.1f} s on three")
    print(f"{'phase':<12}{'steps':>6}{'s/step':>8}{'steps/min':>11}{'ratio':>7}{'train s':>9}"
          f"{'groups trainer/p1/p2':>22}{'rejected':>10}")
    alone = figures["alone_steps_per_minute"]
    for r in (r for r in rows if r["kind"] == "phase"):
        g = r["groups_by_writer"]
        print(f"{r['phase']:<12}{r['steps']:>6}{r['step_seconds']:>8.2f}{r['steps_per_minute']:>11.2f}"
              f"{r['steps_per_minute'] / alone:>6.2f}x{_num(r['train_step_seconds']):>9}"
              f"{g[TRAINER]:>12}/{g['p1']}/{g['p2']}{r['rejected_at_get']:>10}")
    verdict = "meets" if figures["two_ratio"] >= TARGET_RATIO else "misses"
    print(f"two producers: {figures['two_ratio']:.2f}x the steps/min alone ({verdict} the {TARGET_RATIO}x target); "
          f"one: {figures['one_ratio']:.2f}x")
    for r in (r for r in rows if r["kind"] == "producer"):
        print(f"{r['producer']}: first group consumed {r['first_consumed_seconds']:.1f} s after its start "
              f"(step {r['first_consumed_step']})")
    k = next(r for r in rows if r["kind"] == "kill")
    print(f"kill of p1: {k['in_flight_groups']} groups in flight lost; of its {k['committed_groups']} committed, "
          f"{k['committed_consumed']} consumed, {k['committed_rejected_at_get']} rejected at get, "
          f"{k['committed_still_buffered']} still buffered; {k['regenerated_by_others']} of its "
          f"{k['unfinished_claimed_prompts']} unfinished claimed prompts generated by others; back at the "
          f"one-producer level after {_num(k['recovery_seconds'], 1)} s (longest step after the kill "
          f"{_num(k['longest_step_after_kill_s'], 2)} s)")


def _num(x, digits: int = 3) -> str:
    return "never" if x is None else f"{x:.{digits}f}"


# ----------------------------------------------------------------------------- command line

QUICK = {"seconds_per_token": 0.05, "batch_size": 8, "n": 4, "warmup_steps": 1, "window_steps": 2, "settle_steps": 1,
         "kill_steps": 2, "claim_ttl_seconds": 10.0}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds-per-token", type=float, default=0.2, help="every engine's step time (the stand-in)")
    p.add_argument("--slots", type=int, default=32, help="requests an engine runs at once")
    p.add_argument("--batch-size", type=int, default=32, help="B: groups per step")
    p.add_argument("--n", type=int, default=8, help="samples per group")
    p.add_argument("--warmup-steps", type=int, default=2, help="steps before the first window (pipeline fill)")
    p.add_argument("--window-steps", type=int, default=8, help="steps timed in each phase")
    p.add_argument("--settle-steps", type=int, default=2, help="steps after a producer's first consumed group")
    p.add_argument("--kill-steps", type=int, default=8, help="steps after the kill, at least")
    p.add_argument("--claim-ttl-seconds", type=float, default=30.0,
                   help="the run's --prompt-claim-ttl-seconds (product default 60): when a killed producer's "
                        "unfinished prompts go to another writer")
    p.add_argument("--timeout", type=float, default=1200.0, help="give up (and kill everything) after this long")
    p.add_argument("--keep", action="store_true", help="keep the run root and logs (printed)")
    p.add_argument("--quick", action="store_true",
                   help="; ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items()))
    results_file.add_results_flag(p, "elastic")
    a = p.parse_args(argv)
    if a.quick:
        for k, v in QUICK.items():
            if getattr(a, k) == p.get_default(k):
                setattr(a, k, v)
    for flag, least in (("warmup_steps", 1), ("window_steps", 2), ("settle_steps", 0), ("kill_steps", 2)):
        if getattr(a, flag) < least:
            p.error(f"--{flag.replace('_', '-')} must be >= {least}")
    if not a.seconds_per_token > 0 or not a.claim_ttl_seconds > 0:
        p.error("--seconds-per-token and --claim-ttl-seconds must be > 0")
    return a


def main(argv=None) -> dict:
    a = parse_args(argv)
    results = results_file.ResultsFile("elastic", vars(a))
    sizes = Sizes(a.seconds_per_token, a.slots, a.batch_size, a.n, a.claim_ttl_seconds)
    workdir = Path(tempfile.mkdtemp(prefix="miles-elastic-"))
    bench = Bench(a, sizes, workdir)
    try:
        bench.run()
    except BaseException:
        print(f"the bench failed: run root and logs kept in {workdir}", flush=True)
        raise
    finally:
        bench.close()
    figures, rows = analyse(bench)
    if a.keep:
        print(f"run root and logs: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    report(sizes, figures, rows)
    return results.write(a.results, figures, rows)


if __name__ == "__main__":
    main()

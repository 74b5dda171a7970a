"""Engines join and leave a running run: 1 -> 3 -> 2 -> 1 while the embedded default trains on CPU.

The real run (`run_training` on a local Ray with CPU engines of --num-cpus-per-engine 0.25, so three
fit beside the trainer on 2 cores) is driven from outside as a user would: `miles engines add RUN 2`
at step 10, `miles engines remove RUN 1` once three serve (graceful: the newest drains), then one
engine is lost like a preempted node (its actor's worker process and its server SIGKILLed; the fleet
starts a replacement for it) and `miles engines remove RUN 1` brings the target to 1. The run must
finish with every group consumed exactly once (the independent reader, tests/chaos/checker.py),
learn by the bar of tests/e2e/test_pyflyte_run.py, log the engine count every step (1, 3, 2, 1 in
that order), and no engine that joined may have generated a token with weights older than the
version it joined at (the per-engine versions the rollout side saw, recorded in engines/fleet.json).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from tests.chaos import checker
from tests.support.timeouts import COMMAND_SECONDS, wait_until

FLEET_GROW_SECONDS = 180  # two engines added by `miles engines add` start and serve
MILESTONE_SECONDS = 300  # a milestone of the run (a step, a fleet record, an engine noticed)
NO_STEP_SECONDS = 5  # the negative check's window: a run of 0 engines trains no step in it

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ("import sys; from miles_core.config import parse_flags; from miles_core.driver.segment import run_training; "
          "run_training(parse_flags(['--preset', 'tiny-reverse4', *sys.argv[1:]]))")
STEPS, BATCH = 150, 32


def _flags(storage: Path, steps: int = STEPS) -> list[str]:
    return ["--storage-root", str(storage), "--run-id", "elastic", "--num-rollout", str(steps),
            "--eval-prompt-data", "--eval-interval", "none", "--no-progress", "--num-cpus-per-engine", "0.25",
            "--save-interval", "50"]


def _start(tmp_path: Path, flags: list[str], log: Path) -> subprocess.Popen:
    ray_tmp = tempfile.mkdtemp(prefix="mr", dir="/tmp")  # short: Ray's unix sockets live under it
    env = dict(os.environ, RAY_TMPDIR=ray_tmp, PYTHONUNBUFFERED="1")
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-c", SCRIPT, *flags], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _finish(proc: subprocess.Popen, log: Path) -> None:
    try:
        assert proc.wait(600) == 0, log.read_text()[-5000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _miles(*args: str) -> None:
    done = subprocess.run([str(Path(sys.executable).with_name("miles")), *args], capture_output=True, text=True,
                          timeout=COMMAND_SECONDS)
    assert done.returncode == 0, done.stderr


def _metric(run: Path, name: str) -> dict[int, float]:
    from miles_core.metrics.sink import read_metrics

    return {e["step"]: e["value"] for e in read_metrics(f"file://{run}", "trainer") if e["name"] == name}


def _fleet(run: Path) -> dict:
    path = run / "engines" / "fleet.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _wait(proc: subprocess.Popen, log: Path, what: str, ready, timeout: float = MILESTONE_SECONDS):
    def running() -> None:
        assert proc.poll() is None, f"the run ended before {what}:\n{log.read_text()[-5000:]}"

    return wait_until(ready, timeout, what, check=running)


def _step(run: Path) -> int:
    return max(_metric(run, "perf/step_seconds"), default=-1)


def _kill_engine(url: str) -> None:
    """SIGKILL an engine's actor worker and its server process, like the loss of their node."""
    port = url.rsplit(":", 1)[1]
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if "miles_core.engines.cpu_server" in cmd and port in cmd:
            actor = p.parent()
            actor.send_signal(signal.SIGKILL)
            p.send_signal(signal.SIGKILL)
            return
    raise AssertionError(f"no engine server on port {port}")


def _drive(run: Path, proc: subprocess.Popen, log: Path) -> None:
    uri = f"file://{run}"
    _wait(proc, log, "step 10", lambda: _step(run) >= 10)
    _miles("engines", "add", uri, "2")
    _wait(proc, log, "3 engines serving", lambda: _fleet(run).get("serving") == 3, timeout=FLEET_GROW_SECONDS)
    _wait(proc, log, "step 50", lambda: _step(run) >= 50)
    _miles("engines", "remove", uri, "1")
    two = _wait(proc, log, "2 engines", lambda: (f := _fleet(run)) and len(f["engines"]) == 2
                and f["serving"] == 2 and f)
    _kill_engine(two["engines"][0]["url"])
    _wait(proc, log, "the lost engine noticed", lambda: any(e["event"] == "lost" for e in _fleet(run)["events"]))
    _miles("engines", "remove", uri, "1")
    _wait(proc, log, "1 engine", lambda: (f := _fleet(run)) and len(f["engines"]) == 1 and f["serving"] == 1)


def _served_by_joiners(fleet: dict) -> list[tuple[str, int, dict]]:
    """(name, version it joined at, what it served) of every engine that joined mid-run."""
    served = {e["name"]: e["served"] for e in fleet["events"] if "served" in e}
    served |= {e["name"]: e["served"] for e in fleet["engines"] if "served" in e}
    return [(e["name"], e["version"], served.get(e["name"], {})) for e in fleet["events"]
            if e["event"] == "serving" and e["step"] >= 0]


def _counts(engines: dict[int, float]) -> list[int]:
    """The engine count over the steps, without repeats."""
    out: list[int] = []
    for step in sorted(engines):
        if not out or out[-1] != int(engines[step]):
            out.append(int(engines[step]))
    return out


def test_engines_join_and_leave_a_running_run(tmp_path):
    started = time.time()
    run, log = tmp_path / "runs" / "elastic", tmp_path / "run.log"
    proc = _start(tmp_path, _flags(tmp_path), log)
    try:
        _drive(run, proc, log)
    finally:
        _finish(proc, log)
    assert checker.check(run, STEPS, BATCH, set()) == []

    counts = _counts(_metric(run, "rollout/engines"))
    it = iter(counts)
    assert all(c in it for c in (1, 3, 2, 1)) and counts[-1] == 1, counts
    rewards = _metric(run, "rollout/reward/mean")
    first, last = [rewards[s] for s in range(5)], [rewards[s] for s in range(STEPS - 5, STEPS)]
    assert sum(last) / 5 >= max(0.25, 2 * sum(first) / 5), (first, last)

    fleet = _fleet(run)
    joiners = _served_by_joiners(fleet)
    assert len(joiners) >= 2, fleet["events"]
    for name, version, served in joiners:
        assert not served or served["min_version"] >= version, (name, version, served)
    assert any(served for _, _, served in joiners), "no engine that joined served a request"
    events = [e["event"] for e in fleet["events"]]
    assert {"draining", "removed", "lost"} <= set(events), events
    print(f"engine counts {counts}; joiners {joiners}; {time.time() - started:.0f} s")


def test_a_run_of_zero_engines_waits_and_trains_once_one_joins(tmp_path):
    """--rollout-num-engines 0 (with --allow-rollout-producers, and no producer job): the run starts and
    trains nothing; `miles engines add RUN 1` gives it an engine, which loads the published weights
    before its first request (no step runs in between to make it join), and the run finishes."""
    started = time.time()
    run, log = tmp_path / "runs" / "elastic", tmp_path / "run.log"
    steps = 20
    proc = _start(tmp_path, _flags(tmp_path, steps) + ["--rollout-num-engines", "0", "--allow-rollout-producers"], log)
    try:
        _wait(proc, log, "the fleet record", lambda: _fleet(run).get("target") == 0)
        # A negative check: nothing would signal a step that should not happen, so give it a window.
        time.sleep(NO_STEP_SECONDS)
        assert _step(run) == -1 and _fleet(run)["serving"] == 0  # nothing generates: no step
        _miles("engines", "add", f"file://{run}", "1")
    finally:
        _finish(proc, log)
    assert checker.check(run, steps, BATCH, set()) == []
    fleet = _fleet(run)
    (engine,) = fleet["engines"]
    assert engine["version"] >= 1 and engine["served"]["min_version"] >= engine["version"], engine
    assert set(_metric(run, "rollout/engines").values()) == {1.0}
    print(f"joined at version {engine['version']}; {time.time() - started:.0f} s")

"""Chaos: a real run SIGKILLed inside its critical sections, resumed each time (issue 16 item 1).

The run (driver, its private local Ray, the rollout and trainer actors, the CPU engine server) is
started as `run_training` in a subprocess with MILES_CHAOS_POINT=name:n (miles_core/failures/chaos.py): when
it reaches that point it blocks there, the test sees the marker and SIGKILLs every process of the
run. The points: a group object encoded but not committed (`buffer.commit`), a step's groups got
but its manifest not written (`buffer.record`), a checkpoint's tensors written without COMPLETE
(`checkpoint.write`), a weight version's delta part written but the version not sealed
(`weights.delta`: the run trains at an RL learning rate, 1e-6, so every push after a trainer's first
three writes a delta), engines paused mid weight push (`weights.push`). After the kills a last
segment runs to the end. Then `checker.py`, which reads the run root without miles_core, checks:
every step consumed exactly its batch once, no group consumed twice, every consumed group committed,
no group committed before a kill lost, the final checkpoint complete and loadable, every sealed
weight version rebuilding (anchor plus deltas) to its checksums and no part left both as an anchor and
a delta; and no process of the run is left. CI runs 3 kills: the delta publish first, then 2 of the
other 4 points (seeded; the seed and the points are printed); MILES_CHAOS_KILLS=20 runs 20.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest

from tests.chaos.checker import check, committed_groups, weight_kinds
from tests.chaos.runner import Segment, orphans
from tests.support.timeouts import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# point -> the range of its n (MILES_CHAOS_POINT=name:n) a kill is drawn from.
POINTS = {"buffer.commit": (3, 12), "buffer.record": (1, 6), "checkpoint.write": (1, 2), "weights.push": (1, 6),
          "weights.delta": (1, 3)}
FIRST = "weights.delta"  # in every plan: a segment's first delta is its 4th push, so the first segment takes it
BATCH = 8
SEGMENT_SECONDS = 420  # one segment, to its end or to its chaos point


def _flags(storage: Path, steps: int) -> list[str]:
    return ["--storage-root", str(storage), "--run-id", "chaos", "--num-rollout", str(steps), "--lr", "1e-6",
            "--rollout-batch-size", str(BATCH), "--save-interval", "2", "--eval-prompt-data", "--eval-interval",
            "none", "--no-progress", "--lease-ttl-seconds", "5", "--lease-renew-seconds", "1"]


def _plan(kills: int, rng: random.Random) -> list[str]:
    """`kills` points: FIRST, then every other point once before any repeats (shuffled), each at a drawn count."""
    plan = [f"{FIRST}:{rng.randint(*POINTS[FIRST])}"]
    while len(plan) < kills:
        names = list(POINTS)
        rng.shuffle(names)
        plan += [f"{n}:{rng.randint(*POINTS[n])}" for n in names if n != FIRST or len(plan) > 1]
    return plan[:kills]


def _segment(storage: Path, log: Path, chaos: str | None, steps: int) -> tuple[str, float, list[str]]:
    """One segment; with `chaos`, SIGKILLed at that point. (outcome, seconds, processes left)."""
    env = dict(os.environ, MILES_CHAOS_DIR=str(storage))
    env.pop("MILES_CHAOS_POINT", None)
    if chaos:
        env["MILES_CHAOS_POINT"] = chaos
    marker = storage / f"reached-{chaos.rpartition(':')[0]}" if chaos else None
    seg = Segment(_flags(storage, steps), log, env)
    try:
        wait_until(lambda: seg.proc.poll() is not None or (marker is not None and marker.exists()), SEGMENT_SECONDS,
                   "end of the segment or its chaos point (segment stuck)", details=lambda: seg.text()[-4000:])
        killed = marker is not None and marker.exists()
        if killed:
            seg.kill()
            marker.unlink()
        else:
            assert seg.proc.returncode == 0, f"segment ended with {seg.proc.returncode}:\n{seg.text()[-4000:]}"
    finally:
        left = seg.close()
    return ("killed" if killed else "finished"), time.monotonic() - seg.started, left


def test_a_run_killed_in_its_critical_sections_resumes_exactly_once(tmp_path):
    kills = int(os.environ.get("MILES_CHAOS_KILLS", "3"))
    seed = int(os.environ.get("MILES_CHAOS_SEED", str(random.SystemRandom().randrange(10**6))))
    plan = _plan(kills, random.Random(seed))
    steps = max(16, 5 * kills)  # room for every kill: a killed segment trains at most ~6 steps
    print(f"chaos seed {seed} (rerun: MILES_CHAOS_SEED={seed}): {plan}")
    run = tmp_path / "runs" / "chaos"
    committed_before: set[str] = set()
    outcomes = []
    for i, chaos in enumerate([*plan, None]):
        outcome, seconds, left = _segment(tmp_path, tmp_path / f"segment{i}.log", chaos, steps)
        outcomes.append((chaos, outcome, round(seconds, 1)))
        assert not left, f"processes of the killed run are left: {left}"
        if (run / "buffer" / "groups").exists():
            committed_before |= set(committed_groups(run))
        if outcome == "finished":
            break
    print(f"chaos outcomes (point, outcome, seconds): {outcomes}")
    hit = [c for c, o, _ in outcomes if o == "killed"]
    assert len(hit) == kills, f"only {len(hit)} of {kills} planned kills landed: {outcomes}"
    if outcomes[-1][1] != "finished":  # every planned kill hit: the last segment runs to the end
        outcome, seconds, left = _segment(tmp_path, tmp_path / "last.log", None, steps)
        assert outcome == "finished" and not left, left
    assert check(run, steps, BATCH, committed_before) == []
    assert "delta" in weight_kinds(run).values(), weight_kinds(run)  # the versions it checked were deltas
    assert not orphans(str(tmp_path)), "a process of the run outlived it"

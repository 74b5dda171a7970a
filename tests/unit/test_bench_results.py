"""The benchmarks' results files, and the models their figures rest on (docs/benchmarks.md).

Pins: every bench run at a tiny size writes one strict-JSON file in the schema of
bench/results_file.py (bench, version, started_at, seconds, machine, config = the flags, figures,
rows) holding its ratio figures; the committed bench/results/*.json follow the same schema. And
what makes the figures honest: a weight push pauses every engine (an in-flight sample stalls for
the pause, one started during it waits, its tokens after the pause carry the new version) and every
driver pays the push; the buffer's raw baseline writes exactly the objects the buffer wrote; the
bucketed transformers baseline keeps every request and pads less than the padded one.
Guards: a bench that prints a ratio but never writes it, a file a reader cannot parse (NaN), a
baseline that does less or different work than the project side, a push the async side alone pays.
Sizes are tiny and nothing asserts on speed. The benches run as a user runs them (their own processes)
are tests/integration/test_bench_runs.py.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from bench import async_speedup, buffer, elastic, results_file
from bench.async_speedup import TimedEngines, WeightClock, Workload
from tests.support.timeouts import COMMAND_SECONDS

ROOT = Path(__file__).resolve().parents[2]


def load_strict(path: Path) -> dict:
    def no_constants(name):
        raise AssertionError(f"{path}: {name} is not JSON")

    return json.loads(path.read_text(), parse_constant=no_constants)


def check_schema(record: dict, bench: str, flags: tuple[str, ...] = ()) -> dict:
    assert set(results_file.KEYS) <= set(record) <= set(results_file.KEYS) | {"notes"}
    assert record["bench"] == bench and record["version"] == results_file.VERSION
    assert datetime.fromisoformat(record["started_at"]).tzinfo is not None
    assert record["seconds"] is None or record["seconds"] > 0
    assert {"cpus", "platform", "python"} <= set(record["machine"])
    assert set(flags) <= set(record["config"])
    assert record["figures"] and all(isinstance(v, (int, float, str, type(None))) for v in record["figures"].values())
    assert isinstance(record["rows"], list) and record["rows"] and all(isinstance(r, dict) for r in record["rows"])
    return record


def run_bench(name: str, *args: str, timeout: float = COMMAND_SECONDS) -> None:
    """`python bench/<name>.py ARGS` as a user runs it (its own process: torch threads, logging)."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / f"{name}.py"), *args], cwd=ROOT,
                          timeout=timeout, capture_output=True, text=True)
    assert proc.returncode == 0, (f"bench/{name}.py {' '.join(args)} exited {proc.returncode}:\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


# ----------------------------------------------------------------------------- async_speedup

TINY = ["--steps", "3", "--batch-size", "4", "--n", "2", "--engines", "2", "--slots-per-engine", "2", "--median-tokens",
        "4", "--generation-step-seconds", "0.03", "--push-seconds", "0.02", "--pause-seconds", "0.01"]


def test_push_costs_come_from_the_weights_results_file(tmp_path):
    """Pins: a weights results row (model, transport, push_s, pause_s) becomes the push cost of that name;
    names it lacks keep the documented defaults; PUSH:PAUSE literals parse."""
    path = tmp_path / "weights.json"
    path.write_text(json.dumps({"rows": [{"model": "smollm", "transport": "store", "push_s": 2.5, "pause_s": 0.3}]}))
    costs = async_speedup.measured_push_costs(str(path))
    assert (costs["smollm-store"].push_seconds, costs["smollm-store"].pause_seconds) == (2.5, 0.3)
    assert costs["tiny-store"] == async_speedup.PUSH_COSTS["tiny-store"]
    literal = async_speedup.push_cost("0.45:0.4", costs)
    assert (literal.push_seconds, literal.pause_seconds) == (0.45, 0.4)


def test_weight_clock_stalls_work_for_every_pause_and_versions_tokens_after_it():
    """Pins the pause model: 1 s of work from t=0 with a pause over [0.5, 0.8] ends at 1.3; work that starts
    inside the pause waits for its end; tokens produced after the pause carry the next version."""
    clock = WeightClock(version=1)
    clock.pauses.append((0.5, 0.8))
    clock.changes.append((0.8, 2))
    assert clock.finish_time(0.0, 1.0) == pytest.approx(1.3)
    assert clock.finish_time(0.6, 1.0) == pytest.approx(1.8)
    assert clock.finish_time(0.9, 1.0) == pytest.approx(1.9)
    assert clock.token_versions(0.0, 1.3, 10) == [1] * 5 + [2] * 5
    assert clock.token_versions(0.6, 1.8, 4) == [2] * 4


def test_an_engine_sample_in_flight_stalls_for_a_push_from_another_thread():
    """Pins: TimedEngines reads pauses announced while a sample sleeps (the trainer's thread), so the sample
    takes its work plus the pause and straddles the versions. Guards: engines that ignore pushes."""
    w = Workload(engines=1, slots_per_engine=1, median_tokens=100, sigma=0.01, batch_size=1, n=1,
                 generation_step_seconds=1.0)  # one sample of ~1 s
    clock = WeightClock(version=1)
    engines = TimedEngines(w, clock)

    async def sample_with_a_push():
        task = asyncio.create_task(engines.generate([1, 2, 3]))
        await asyncio.sleep(0.05)  # the sample holds its slot
        await asyncio.to_thread(clock.pause, 0.2)
        return await task

    result = asyncio.run(sample_with_a_push())
    work = len(result.output_ids) * w.token_seconds
    assert result.seconds >= work + 0.2
    assert result.token_versions[0] == 1 and result.token_versions[-1] == 2


# ----------------------------------------------------------------------------- buffer


def test_the_raw_baseline_writes_the_objects_the_buffer_wrote(tmp_path):
    """Pins: one round's raw store holds as many objects as the buffer committed, of the same sizes.
    Guards: a baseline of one small object per group beside a buffer that coalesces."""
    import argparse
    import random

    groups = [buffer.realistic_group(i, random.Random(i)) for i in range(10)]
    args = argparse.Namespace(producers=4, coalesce_seconds=0.0)
    row = buffer.one_round(f"file://{tmp_path}", groups, args)

    def sizes(sub: str) -> list[int]:
        return sorted(p.stat().st_size for p in tmp_path.glob(f"*/{sub}/**/*.arrow"))

    committed = sizes("buffer/groups")
    assert len(committed) == row["objects"] > 0
    assert sizes("raw") == committed and row["bytes"] == sum(committed)


# ----------------------------------------------------------------------------- elastic


def _steps(times: list[float]) -> list[elastic.Step]:
    return [elastic.Step(k, t, [], []) for k, t in enumerate(times)]


def test_elastic_phase_rates_are_medians_of_the_seconds_between_manifests():
    """Pins: a phase's steps/min is 60 / the median interval of its steps (each measured from the step
    before it), and its groups are counted by who generated them (the id's claim holder)."""
    steps = _steps([0, 4, 8, 12, 14, 16, 30])
    steps[4].consumed = ["e0-p1-a0-trainer", "e0-p2-a0-p1", "e0-p3-a0-p1"]
    steps[5].rejected = ["e0-p4-a0-p2"]
    assert elastic.intervals(steps, 4, 6) == [2, 2, 14]
    row = elastic.phase_row("two", steps, 4, 6, {4: {"perf/train_step_seconds": 0.3}})
    assert row["steps_per_minute"] == 30.0 and row["steps"] == 3 and row["train_step_seconds"] == 0.3
    assert row["groups_by_writer"] == {"trainer": 1, "p1": 2, "p2": 0} and row["rejected_at_get"] == 1


def test_elastic_recovery_is_the_time_from_the_kill_until_three_steps_run_at_the_one_producer_level():
    """Pins: 0 when the steps right after the kill keep the level; the dip's length when they do not;
    None when they never get back. Guards: a recovery measured from the first step after the kill."""
    level = 30.0  # steps/min: 2 s a step
    assert elastic.recovery_seconds(_steps([0, 2, 4, 6, 8, 10, 12]), kill_at=5.0, level=level) == 0.0
    dip = _steps([0, 2, 4, 14, 16, 18, 20])  # killed at 5, a 10 s step, then 2 s steps
    assert elastic.recovery_seconds(dip, kill_at=5.0, level=level) == pytest.approx(9.0)
    assert elastic.recovery_seconds(_steps([0, 2, 4, 10, 16, 22, 28]), kill_at=5.0, level=level) is None


def test_elastic_committed_groups_are_consumed_rejected_or_still_buffered():
    steps = _steps([0, 1])
    steps[0].consumed, steps[1].rejected = ["a", "b"], ["c"]
    fates = elastic.fates(steps, [("a", (0, 1)), ("c", (0, 2)), ("d", (0, 3))])
    assert fates == {"committed": 3, "consumed": 1, "rejected_at_get": 1, "still_buffered": 1}


def test_elastic_quick_mode_fills_only_the_flags_left_at_their_defaults():
    a = elastic.parse_args(["--quick", "--window-steps", "5", "--results", ""])
    assert a.window_steps == 5 and a.seconds_per_token == elastic.QUICK["seconds_per_token"]


# ----------------------------------------------------------------------------- engine, resume


def test_length_buckets_keep_every_request_and_merge_equal_lengths():
    from bench.engine import buckets, padded_tokens

    work = [([1], n) for n in (9, 1, 5, 5, 2, 9, 7)]
    out = buckets(work, 2)
    assert sorted(n for b in out for _, n in b) == sorted(n for _, n in work)
    assert [[n for _, n in b] for b in out] == [[1, 2], [5, 5], [7, 9, 9]]
    assert padded_tokens(work, 2) == 2 * 2 + 2 * 5 + 3 * 9 < padded_tokens(work, None) == 7 * 9
    assert len(buckets([([1], 5)] * 6, 2)) == 1


@pytest.mark.parametrize("path", sorted((ROOT / "bench" / "results").glob("*.json")), ids=lambda p: p.name)
def test_committed_results_follow_the_schema(path):
    check_schema(load_strict(path), path.stem)


@pytest.mark.parametrize("text", ["1458", "964 + 494 = 1458", "The answer is 1,458.", "Sam has 1458 apples.",
                                  "= 1458 and 7", "none", "1458.5", "-12", "12 + 3 = ", "3.0"])
def test_the_tool_bench_plain_check_reads_answers_as_the_project_does(text):
    """bench/tool_learning.py's plain transformers check has its own answer reader and calculator (so a bug
    in the project's cannot agree with itself); they must mean the same as the project's on every form."""
    from bench import tool_learning
    from miles_core.rollout.arith import extract_answer
    from miles_core.rollout.calculator_tool import tool_result

    assert tool_learning.final_number(text) == extract_answer(text)
    calls = [{"name": "calculator", "arguments": {"expression": e}}
             for e in ("964 + 494", "(2 + 3) * 4 / 8", "7 / 3", "1 / 0", "2 ** 3", "x + 1", "", "1 + " * 60 + "1")]
    calls += [{"name": "search", "arguments": {"expression": "1 + 1"}}, {"name": "calculator", "arguments": "1 + 1"}]
    for call in map(json.dumps, calls):
        mine, project = tool_learning.tool_answer(f"<tool_call>{call}</tool_call>"), tool_result(call)
        assert mine.keys() == project.keys() and mine.get("result") == project.get("result"), call
    assert tool_learning.tool_answer("no call") is None

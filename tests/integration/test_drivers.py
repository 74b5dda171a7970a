"""The three drivers end to end in one process: the real loop, roles and rollout side, timed stand-ins.

What is real: `run_loop`, the Roles of `miles_core.driver.roles` (batch source, TrainerRole,
WeightPusher, Checkpointer) behind in-process clients, and the whole RolloutManager (data source,
producer, submission budget, staleness admission, durable buffer on a memory:// run root, drain).
The engines and the trainer are the timed stand-ins of `bench/async_speedup.py` (sleeps; per-token
weight versions from the version the trainer's pushes bump), so this is the benchmark's harness
held to the properties the benchmark's numbers rely on. No Ray.

Pins: sync, one-step-off and fully async each train exactly B groups per step, every group id
distinct across the run (no group trained twice), each group whole (n samples), and the buffer's
consumption record of every step (`buffer/consumed/{step}.json`) names exactly the groups trained
at that step; with `--max-weight-staleness S` no consumed group is staler than S (current version
at train time minus its oldest token version), while without it a fully async run that generates
faster than it trains does consume staler groups (so the bound is the limit's doing).
"""

from __future__ import annotations

import dataclasses

import pytest

from bench.async_speedup import DRIVERS, Workload, bench_config, run_driver
from miles_core.buffer import objects as O
from miles_core.storage import Store

TINY = Workload(steps=5, batch_size=4, n=4, engines=2, slots_per_engine=4, median_tokens=8,
                generation_step_seconds=0.04, push_seconds=0.001)


def run(driver: str, workload: Workload = TINY, **knobs):
    cfg = bench_config(workload, driver, storage_root="memory://miles-test-drivers", **knobs)
    return cfg, run_driver(workload, cfg)


@pytest.mark.parametrize("driver", DRIVERS)
def test_each_driver_trains_b_distinct_whole_groups_per_step(driver):
    cfg, result = run(driver)
    trained = result.trainer.trained
    assert result.result.steps_run == TINY.steps and result.result.stopped_by == "num_rollout"
    assert [len(ids) for ids in trained] == [TINY.batch_size] * TINY.steps
    all_ids = [gid for ids in trained for gid in ids]
    assert len(set(all_ids)) == len(all_ids) == TINY.steps * TINY.batch_size  # no group trained twice
    store = Store(cfg.run_uri)
    for step, ids in enumerate(trained):
        assert store.get_json(O.consumed_key(step))["consumed"] == ids  # the Checkpointer recorded every step
    assert sum(result.trainer.tokens) > 0
    assert [step for step, _ in result.metrics] == list(range(TINY.steps))


@pytest.mark.parametrize("driver,limit", [("fully-async", 1), ("fully-async", 2), ("one-step-off", 1), ("sync", 0)])
def test_consumed_staleness_never_exceeds_max_weight_staleness(driver, limit):
    """Training 3x slower than generation lets a fully async producer run far ahead; the limit holds."""
    workload = dataclasses.replace(TINY, steps=6, train_ratio=3.0)
    _, result = run(driver, workload, max_weight_staleness=limit)
    assert [len(ids) for ids in result.trainer.trained] == [workload.batch_size] * workload.steps
    assert max(result.trainer.staleness) <= limit


def test_without_a_limit_fully_async_consumes_staler_groups():
    """The control for the test above: the same workload, no limit, staleness goes past 2."""
    workload = dataclasses.replace(TINY, steps=6, train_ratio=3.0)
    _, result = run("fully-async", workload)
    assert max(result.trainer.staleness) > 2


def test_sync_trains_on_policy_and_one_step_off_one_version_behind():
    _, sync = run("sync")
    _, off = run("one-step-off")
    assert set(sync.trainer.staleness) == {0}
    first = TINY.batch_size  # batch 0 was generated under the version it is trained under
    assert set(off.trainer.staleness[:first]) == {0} and set(off.trainer.staleness[first:]) == {1}


def reward_that_raises(sample):
    raise ValueError(f"no label in row {sample.prompt_index}")


@pytest.mark.parametrize("driver", ["sync", "fully-async"])
def test_a_reward_raising_on_every_sample_fails_the_run_in_one_line(driver, caplog):
    """The real loop and rollout side with a reward that always raises: the run stops after the window
    (--failed-sample-window-steps 2) with SampleFailuresError naming the exception and the flag, and
    the console shows a handful of lines, not one per sample (2 steps x 4 groups x 4 samples = 32+)."""
    from miles_core.config import replace_fields
    from miles_core.rollout.failures import SampleFailuresError

    cfg = bench_config(TINY, driver, storage_root="memory://miles-test-drivers")
    cfg = replace_fields(cfg, custom_rm_path=f"{__name__}:reward_that_raises", failed_sample_window_steps=2)
    with caplog.at_level("WARNING"), pytest.raises(SampleFailuresError) as e:
        run_driver(TINY, cfg)
    line = str(e.value)
    assert "\n" not in line
    assert "the reward function (--custom-rm-path) failed on" in line and "(100%) over steps 0-1" in line
    assert "first: ValueError: no label in row" in line and "--max-failed-sample-fraction=0.5" in line
    reward_lines = [r for r in caplog.records if r.getMessage().startswith("reward failed")]
    assert 1 <= len(reward_lines) <= 3, [r.getMessage() for r in reward_lines]


async def episode_that_raises(args, sample, sampling_params, evaluation=False):
    raise KeyError("tool")


@pytest.mark.parametrize("driver", ["sync", "fully-async"])
def test_a_generate_function_raising_on_every_episode_fails_the_run(driver):
    """Every failed episode rejects its group, so no batch ever comes: the rollout worker itself fails after a
    window's worth of episodes (2 steps x 4 groups x 4 samples) failed in a row, and the driver's next get
    raises it, naming the function, the first exception and the flag (before: starved for ever)."""
    from miles_core.config import replace_fields
    from miles_core.rollout.failures import SampleFailuresError
    from miles_core.rollout.producer import RolloutWorkerError

    cfg = bench_config(TINY, driver, storage_root="memory://miles-test-drivers")
    cfg = replace_fields(cfg, custom_generate_function_path=f"{__name__}:episode_that_raises",
                         failed_sample_window_steps=2)
    with pytest.raises(RolloutWorkerError) as e:
        run_driver(TINY, cfg)
    assert isinstance(e.value.__cause__, SampleFailuresError)
    line = str(e.value)
    assert "\n" not in line
    assert ("the custom generate function (--custom-generate-function-path) failed on 32 samples in a row" in line)
    assert "raised KeyError: 'tool'" in line and "--max-failed-sample-fraction" in line

"""The benchmarks run as a user runs them (`python bench/<name>.py ...`, their own processes) at tiny
sizes: each writes its results file in the schema of bench/results_file.py with its ratio figures
(tests/unit/test_bench_results.py holds the in-process parts and the schema check). Nothing asserts on
speed; bench/weights.py (~1 min), the elastic quick mode (a trainer and two producer processes, ~5 min
under CI's load) and the gpu_check smoke (~30 s) are `slow`.
"""

from __future__ import annotations

import os

import pytest

from bench import async_speedup, buffer, resume, results_file
from tests.support.timeouts import SLOW_COMMAND_SECONDS, SLOW_RUN_SECONDS
from tests.unit.test_bench_results import TINY, check_schema, load_strict, run_bench


def test_engine_writes_ratios_against_both_baselines(tmp_path):
    out = tmp_path / "engine.json"
    run_bench("engine", "--repeats", "1", "--batch", "6", "--bucket-size", "2", "--no-http", "--cases", "tail",
              "--results", str(out))
    record = check_schema(load_strict(out), "engine", ("bucket_size", "repeats"))
    assert record["figures"]["tail_ratio_vs_padded"] > 0 and record["figures"]["tail_ratio_vs_bucketed"] > 0
    (row,) = record["rows"]
    assert row["useful_tokens"] <= row["bucketed_tokens"] <= row["padded_tokens"]




@pytest.mark.slow
def test_weights_writes_push_pause_and_ratio(tmp_path):
    out = tmp_path / "weights.json"
    run_bench("weights", "--models", "tiny", "--transports", "store", "--repeats", "1", "--versions", "0",
              "--results", str(out), timeout=SLOW_COMMAND_SECONDS)
    record = check_schema(load_strict(out), "weights", ("models", "transports"))
    assert record["figures"]["tiny_store_ratio"] > 0
    costs = async_speedup.measured_push_costs(str(out))
    assert costs["tiny-store"].push_seconds == record["rows"][0]["push_s"]


@pytest.mark.slow
def test_elastic_quick_writes_steps_per_minute_ratios_and_the_kill_cost(tmp_path):
    """Pins: the quick mode runs every phase (a trainer and two producer processes, a SIGKILL) and writes
    the ratios to alone, each producer's time to its first consumed group and the kill's accounting; none
    of the killed producer's committed groups goes missing."""
    out = tmp_path / "elastic.json"
    run_bench("elastic", "--quick", "--results", str(out), timeout=SLOW_RUN_SECONDS)
    record = check_schema(load_strict(out), "elastic", ("seconds_per_token", "window_steps", "claim_ttl_seconds"))
    figures = record["figures"]
    assert figures["one_ratio"] > 0 and figures["two_ratio"] > 0 and figures["p2_first_consumed_seconds"] > 0
    assert figures["kill_in_flight_groups"] >= 0 and figures["kill_committed_groups"] == (
        figures["kill_committed_consumed"] + figures["kill_committed_rejected_at_get"]
        + figures["kill_committed_still_buffered"])
    assert [r["phase"] for r in record["rows"] if r["kind"] == "phase"] == ["alone", "one", "two", "after_kill"]


@pytest.mark.slow
def test_gpu_check_cpu_smoke_writes_results_only_when_asked(tmp_path):
    out = tmp_path / "gpu.json"
    before = os.path.getmtime(results_file.default_path("gpu_check")) \
        if os.path.exists(results_file.default_path("gpu_check")) else None
    run_bench("gpu_check", "--cpu-smoke", "--results", str(out), timeout=SLOW_COMMAND_SECONDS)
    record = check_schema(load_strict(out), "gpu_check", ("cpu_smoke",))
    assert record["figures"]["ratio"] > 0 and record["figures"]["resume_ok"] is True
    run_bench("gpu_check", "--cpu-smoke", "--out", "", timeout=SLOW_COMMAND_SECONDS)
    after = os.path.getmtime(results_file.default_path("gpu_check")) \
        if os.path.exists(results_file.default_path("gpu_check")) else None
    assert before == after  # the smoke run never overwrites the device figures


def test_async_speedup_writes_speedup_efficiency_and_the_sensitivity_table(tmp_path):
    """Pins: speedup and each driver's efficiency are figures; the table has one row per (sigma, push cost)
    with speedup = sync / fully async s/step; the staleness limit is the product default; every driver's
    push phase lasts at least the push (sync and one-step-off pay it too)."""
    out = tmp_path / "async.json"
    async_speedup.main(TINY + ["--table-steps", "2", "--table-sigmas", "0.5,1.5", "--table-push",
                               "0.01:0.005,0.02:0.02", "--results", str(out)])
    record = check_schema(load_strict(out), "async_speedup", ("push_seconds", "max_weight_staleness", "table_push"))
    figures = record["figures"]
    assert figures["speedup"] > 0 and figures["push_seconds"] == 0.02 and figures["pause_seconds"] == 0.01
    assert {f"{d}_efficiency" for d in async_speedup.DRIVERS} <= set(figures)
    assert record["config"]["max_weight_staleness"] == 2 == async_speedup.PRODUCT_MAX_WEIGHT_STALENESS
    drivers = [r for r in record["rows"] if r["kind"] == "driver"]
    assert [r["driver"] for r in drivers] == list(async_speedup.DRIVERS)
    assert all(r["phases"]["push"] >= 0.02 for r in drivers)
    cells = [r for r in record["rows"] if r["kind"] == "sensitivity"]
    assert [(c["sigma"], c["push"]) for c in cells] == [(s, p) for s in (0.5, 1.5) for p in ("0.01:0.005", "0.02:0.02")]
    for c in cells:
        assert c["speedup"] == pytest.approx(c["sync_step_seconds"] / c["fully_async_step_seconds"])
        assert c["efficiency"] == pytest.approx(c["ideal_step_seconds"] / c["fully_async_step_seconds"])


def test_buffer_writes_ratio_tokens_per_second_and_index_memory(tmp_path):
    """Pins: the ratio against raw writes, the buffer's tokens/s beside groups/s, the index measured over
    `--index-groups` reopened groups."""
    out = tmp_path / "buffer.json"
    buffer.main(["--groups", "12", "--producers", "3", "--stores", "file", "--repeats", "1", "--index-groups", "300",
                 "--index-groups-per-object", "16", "--results", str(out)])
    record = check_schema(load_strict(out), "buffer", ("groups", "index_groups", "stores"))
    figures = record["figures"]
    assert figures["file_ratio"] > 0 and figures["file_buffer_tokens_per_s"] > figures["file_buffer_groups_per_s"]
    assert figures["index_groups"] == 300 and figures["index_bytes_per_group"] > 0
    index = record["rows"][-1]
    assert index["kind"] == "index_memory" and index["objects"] == 19


def test_resume_writes_reopen_times_and_their_ratio(tmp_path):
    out = tmp_path / "resume.json"
    resume.main(["--consumed", "96", "--backlogs", "32", "--stores", "file", "--repeats", "1", "--results", str(out)])
    record = check_schema(load_strict(out), "resume", ("consumed", "backlogs"))
    assert record["figures"]["file_backlog_32_ratio_history_over_compacted"] > 0
    assert record["rows"][0]["backlog"] == 32

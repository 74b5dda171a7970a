"""What the timeline trace costs: its size per 100 steps and its share of a step.

    .venv/bin/python bench/trace.py [--steps 40] [--repeats 2] [--results out.json]

1. The recording cost, measured alone: seconds per recorded span (`Tracer.complete`, a list append
   under a lock) and per span written (JSON and one PUT per chunk to a file:// run root), medians of 5.
2. The embedded default, `--steps` steps, run with the trace (default flags) and with `--no-trace`,
   alternating, `--repeats` times each, each run in its own process with its own Ray (as
   `pyflyte run` runs it): median step seconds after the first 5 steps of each, the trace's bytes
   and spans per step from the run root (trace/events/), and bytes per 100 steps.
3. The overhead two ways: the step-time ratio (trace on / off: noisy on a small shared machine,
   printed with its spread) and the bound from the costs (spans per step × seconds per span
   recorded and written ÷ the step's seconds), which does not depend on the noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.results_file import ResultsFile, add_results_flag  # noqa: E402
from miles_core.metrics import trace  # noqa: E402
from miles_core.metrics.names import STEP_SECONDS  # noqa: E402
from miles_core.metrics.sink import read_metrics, series  # noqa: E402
from miles_core.storage import Store  # noqa: E402

RUN = ("import sys; from miles_core.config import parse_flags; from miles_core.driver.segment import run_training; "
       "run_training(parse_flags(['--preset', 'tiny-reverse4', *sys.argv[1:]]))")
WARMUP_STEPS = 5
SPANS = 50_000


def recording_cost(tmp: str) -> tuple[float, float]:
    """(seconds per span recorded, seconds per span written), medians of 5 rounds of SPANS spans."""
    record, write = [], []
    for i in range(5):
        t = trace.Tracer(Store(f"file://{tmp}/cost{i}"), "bench", background=False, max_pending=SPANS + 1)
        t0 = time.perf_counter()
        for k in range(SPANS):
            t.async_span("request", f"e0-p{k}-a0-trainer", 1.0, 2.0, cat="group", engine="http://127.0.0.1:1",
                         tokens=12, finish="stop", first_token_ms=3.5)
        t1 = time.perf_counter()
        t.flush()
        record.append((t1 - t0) / SPANS)
        write.append((time.perf_counter() - t1) / SPANS)
    return statistics.median(record), statistics.median(write)


def run(root: str, run_id: str, steps: int, traced: bool) -> dict:
    flags = ["--storage-root", f"file://{root}", "--run-id", run_id, "--num-rollout", str(steps), "--no-progress",
             "--eval-interval", "none"] + ([] if traced else ["--no-trace"])
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", RUN, *flags], cwd=ROOT, check=True, capture_output=True,
                   env=dict(os.environ, RAY_ADDRESS=""))
    store = Store(f"file://{root}/runs/{run_id}")
    _, step_seconds = series(read_metrics(store, "trainer"), STEP_SECONDS)
    sizes = store.list_sizes(trace.EVENTS_PREFIX + "/")
    spans = sum(len(json.loads(store.get_bytes(k))["events"]) for k in sizes)
    return {"traced": traced, "wall_seconds": time.monotonic() - t0, "steps": len(step_seconds),
            "median_step_seconds": statistics.median(step_seconds[WARMUP_STEPS:]),
            "trace_bytes": sum(sizes.values()), "trace_chunks": len(sizes), "spans": spans}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=2)
    add_results_flag(p, "trace")
    args = p.parse_args()
    results = ResultsFile("trace", vars(args))
    with tempfile.TemporaryDirectory(prefix="bench-trace-") as tmp:
        record_s, write_s = recording_cost(tmp)
        print(f"recording a span: {record_s * 1e6:.2f} µs; writing it: {write_s * 1e6:.2f} µs (medians of 5)")
        rows = []
        for i in range(args.repeats):
            for traced in (False, True):
                row = run(tmp, f"r{i}-{'on' if traced else 'off'}", args.steps, traced)
                rows.append(row)
                print(f"trace {'on ' if traced else 'off'}: median step {row['median_step_seconds']:.3f} s, "
                      f"{row['spans']} spans, {row['trace_bytes'] / 1e6:.2f} MB in {row['trace_chunks']} chunks")
    on = [r["median_step_seconds"] for r in rows if r["traced"]]
    off = [r["median_step_seconds"] for r in rows if not r["traced"]]
    traced = [r for r in rows if r["traced"]]
    spans_per_step = statistics.median(r["spans"] / r["steps"] for r in traced)
    bytes_per_step = statistics.median(r["trace_bytes"] / r["steps"] for r in traced)
    step = statistics.median(off)
    figures = {"record_us_per_span": record_s * 1e6, "write_us_per_span": write_s * 1e6,
               "spans_per_step": spans_per_step, "mb_per_100_steps": bytes_per_step * 100 / 1e6,
               "step_seconds_off": step, "step_seconds_on": statistics.median(on),
               "ratio_on_off": statistics.median(on) / step,
               "bound_fraction_of_step": spans_per_step * (record_s + write_s) / step}
    print(f"\nspans per step {spans_per_step:.0f}; {figures['mb_per_100_steps']:.2f} MB per 100 steps "
          f"(--trace-sample-groups 0.25); step {step:.3f} s without, {figures['step_seconds_on']:.3f} s with the "
          f"trace: ratio {figures['ratio_on_off']:.3f} (runs: off {off}, on {on}); bound from the costs: "
          f"{figures['bound_fraction_of_step']:.3%} of a step")
    results.write(args.results, figures, rows)


if __name__ == "__main__":
    main()

"""Where a step of the embedded default goes: the step against its trainer's own compute, from the trace.

    .venv/bin/python bench/step_overhead.py [--steps 100] [--repeats 2] [--baseline-rev REV] [--results out.json]

1. Runs the embedded default (`--steps` steps, evals off) `--repeats` times, each in its own process with its
   own local Ray as `pyflyte run` runs it. With `--baseline-rev REV`, the same runs of that git revision (a
   worktree of this repository, on the same virtualenv) alternate with them, so both see the same machine.
2. From each run's timeline trace (the last 100 steps): per step, the driver's step span, the trainer's own
   compute (rank 0's `forward+backward` and `optimizer` spans inside it) and each of the driver's calls
   (train_step, the weight push, the checkpointer, the batch waits, ...).
3. Prints, per run, the median step, the median compute and their ratio (median over steps of step ÷
   compute), and the median of each call; writes bench/results/step_overhead.json (one row per run).

The ratio is measured in place: the engine generates beside the trainer on the same cores, so the compute is
the trainer's under that contention, as in every real step.
"""

from __future__ import annotations

import argparse
import collections
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
from miles_core.storage import Store  # noqa: E402

RUN = ("import sys; from miles_core.config import parse_flags; from miles_core.driver.segment import run_training; "
       "run_training(parse_flags(['--preset', 'tiny-reverse4', *sys.argv[1:]]))")
COMPUTE = ("forward+backward", "optimizer")
WARMUP_STEPS = 5


def run(checkout: str, root: str, run_id: str, steps: int) -> str:
    """Run the embedded default from `checkout`'s code; the run root's URI."""
    flags = ["--storage-root", f"file://{root}", "--run-id", run_id, "--num-rollout", str(steps), "--no-progress",
             "--eval-interval", "none"]
    env = dict(os.environ, RAY_ADDRESS="", PYTHONPATH=checkout)
    subprocess.run([sys.executable, "-c", RUN, *flags], cwd=checkout, check=True, capture_output=True, env=env)
    return f"file://{root}/runs/{run_id}"


def step_breakdown(run_uri: str) -> list[dict]:
    """Per traced step after the warm-up: {"step": seconds, "compute": seconds, driver call name: seconds}."""
    events = trace.build_trace(Store(run_uri))["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    steps = sorted((e for e in spans if e["name"] == trace.STEP_SPAN and names.get(e["pid"]) == "driver"),
                   key=lambda e: e["ts"])
    out = []
    for s in steps[WARMUP_STEPS:]:
        inside = [e for e in spans if s["ts"] <= e["ts"] < s["ts"] + s["dur"] and e is not s]
        row = collections.Counter()
        for e in inside:
            if names.get(e["pid"]) == "driver":
                row[e["name"]] += e["dur"] / 1e6
            elif names.get(e["pid"]) == "trainer-rank0" and e["name"] in COMPUTE:
                row["compute"] += e["dur"] / 1e6
        row["step"] = s["dur"] / 1e6
        out.append(dict(row))
    return out


def summarize(label: str, rows: list[dict]) -> dict:
    ratios = [r["step"] / r["compute"] for r in rows if r.get("compute")]
    calls = sorted({k for r in rows for k in r} - {"step", "compute"})
    summary = {"variant": label, "steps": len(rows), "median_step_seconds": statistics.median(r["step"] for r in rows),
               "median_compute_seconds": statistics.median(r.get("compute", 0.0) for r in rows),
               "median_step_over_compute": statistics.median(ratios) if ratios else None}
    summary.update({f"median_{k}_seconds": statistics.median(r.get(k, 0.0) for r in rows) for k in calls})
    return summary


def worktree(rev: str, where: str) -> str:
    path = os.path.join(where, f"baseline-{rev}")
    subprocess.run(["git", "worktree", "add", "--detach", path, rev], cwd=ROOT, check=True, capture_output=True)
    return path


def print_run(s: dict) -> None:
    calls = ", ".join(f"{k[len('median_'):-len('_seconds')]} {v * 1e3:.1f}" for k, v in s.items()
                      if k.startswith("median_") and k.endswith("_seconds")
                      and k not in ("median_step_seconds", "median_compute_seconds") and v >= 0.0005)
    print(f"{s['variant']:>9}: step {s['median_step_seconds'] * 1e3:.1f} ms, trainer compute "
          f"{s['median_compute_seconds'] * 1e3:.1f} ms, step/compute {s['median_step_over_compute']:.2f} "
          f"(medians over {s['steps']} steps; calls in ms: {calls})", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--baseline-rev", default="", help="a git revision to measure beside this checkout")
    add_results_flag(p, "step_overhead")
    args = p.parse_args()
    results = ResultsFile("step_overhead", vars(args))
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-steps-") as tmp:
        variants = [("this", ROOT)] + ([("baseline", worktree(args.baseline_rev, tmp))] if args.baseline_rev else [])
        try:
            for i in range(args.repeats):
                for label, checkout in variants:
                    t0 = time.monotonic()
                    summary = summarize(label, step_breakdown(run(checkout, tmp, f"{label}-{i}", args.steps)))
                    rows.append(summary | {"repeat": i, "wall_seconds": time.monotonic() - t0})
                    print_run(summary)
        finally:
            for label, checkout in variants[1:]:
                subprocess.run(["git", "worktree", "remove", "--force", checkout], cwd=ROOT, capture_output=True)
    figures = {}
    for label, _ in variants:
        mine = [r for r in rows if r["variant"] == label]
        figures[f"{label}_step_seconds"] = statistics.median(r["median_step_seconds"] for r in mine)
        figures[f"{label}_compute_seconds"] = statistics.median(r["median_compute_seconds"] for r in mine)
        figures[f"{label}_step_over_compute"] = statistics.median(r["median_step_over_compute"] for r in mine)
    print("\n" + "; ".join(f"{k} {v:.3f}" for k, v in figures.items()))
    results.write(args.results, figures, rows)


if __name__ == "__main__":
    main()

"""The quickstart's figures (docs/quickstart.md): one `./dev run`, timed and read back.

    .venv/bin/python bench/quickstart.py [--seed 1] [--flags "..."]

Runs what `./dev run` runs with the venv in place (`pyflyte run workflows/fully_async.py
fully_async_rl --flags "--preset tiny-reverse4"`), in a fresh storage root so that nothing is resumed,
and reads the run root back: the wall time, the steps and their median time, the start-up (the wall
time less the steps), the training reward over the first 5 steps and over the last 10% of the steps,
and the held-out greedy exact match (eval/heldout/pass@1) at each eval step. Writes them to
bench/results/quickstart.json (bench/results_file.py's schema); `.venv/bin/python bench/figures.py`
renders them into docs/quickstart.md. Run it on an idle machine: the times are the machine's.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.results_file import ResultsFile, add_results_flag  # noqa: E402

RUN_ID = "quickstart"
HELDOUT = "eval/heldout/pass@1"


def run_embedded_default(storage_root: str, flags: str) -> float:
    """`./dev run`'s command in `storage_root`; its wall time in seconds."""
    cmd = [os.path.join(ROOT, ".venv", "bin", "pyflyte"), "run", "workflows/fully_async.py", "fully_async_rl",
           "--flags", f"--preset tiny-reverse4 --run-id {RUN_ID} {flags}".strip(), "--storage_root", storage_root]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True)
    return time.perf_counter() - t0


def figures_of(run_uri: str, wall_seconds: float) -> tuple[dict, list[dict]]:
    from miles_core.metrics.names import REWARD, STEP_SECONDS
    from miles_core.metrics.sink import read_metrics, series

    events = read_metrics(run_uri)
    steps, rewards = series(events, REWARD)
    step_seconds = series(events, STEP_SECONDS)[1]
    eval_steps, heldout = series(events, HELDOUT)
    tail = max(1, len(rewards) // 10)
    figures = {
        "steps": len(steps), "wall_seconds": wall_seconds, "median_step_seconds": statistics.median(step_seconds),
        "startup_seconds": wall_seconds - sum(step_seconds),
        "reward_first_5": statistics.fmean(rewards[:5]), "reward_last_10_percent": statistics.fmean(rewards[-tail:]),
        "heldout_pass_at_1": ", ".join(f"{v:.2f} at step {s}" for s, v in zip(eval_steps, heldout)),
    }
    rows = [{"step": s, "reward": r} for s, r in zip(steps, rewards)]
    rows += [{"eval_step": s, "heldout_pass_at_1": v} for s, v in zip(eval_steps, heldout)]
    return figures, rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=1, help="the preset's seed (the quickstart quotes seed 1)")
    p.add_argument("--flags", default="", help="more miles flags after the preset")
    add_results_flag(p, "quickstart")
    a = p.parse_args(argv)
    results = ResultsFile("quickstart", vars(a))
    root = tempfile.mkdtemp(prefix="miles-quickstart-")
    flags = f"--seed {a.seed} {a.flags}".strip()
    wall = run_embedded_default(root, flags)
    figures, rows = figures_of(f"file://{root}/runs/{RUN_ID}", wall)
    figures["command"] = "./dev run" + (f" --flags {shlex.quote(flags)}" if flags != "--seed 1" else "")
    for k, v in figures.items():
        print(f"{k}: {v}")
    return results.write(a.results, figures, rows)


if __name__ == "__main__":
    main()

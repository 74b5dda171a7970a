"""How each off-policy correction changes the embedded default's tolerance of stale samples.

    .venv/bin/python bench/corrections.py                       # ~25 minutes on 2 cores: 5 corrections x 2 staleness
    .venv/bin/python bench/corrections.py --arms tis icepop --staleness 8 --steps 60

Each arm is a real run of the embedded default (`pyflyte run workflows/fully_async.py`, `--preset
tiny-reverse4`: the CPU engine, the Megatron trainer, the durable buffer, fully async) for `--steps`
steps, with one correction of docs/algorithms.md and `--max-weight-staleness` S. At S 2 (the preset's)
the consumed samples are about one version old; at a larger S with a buffer of as many batches
(`--async-data-buffer-capacity-factor` S) the producer runs further ahead, so the trainer learns from
samples several versions old, which is what the corrections are for. The arms:

- `rollout-logprobs`: the preset's (the ratio against the engine's log-probs, no correction);
- `tis`: `--no-use-rollout-logprobs --use-tis` (the built-in truncated IS, [0, 2]);
- `icepop`: `--custom-tis-function-path miles_core.train.corrections.icepop_function` (ratio outside
  [0.5, 2] popped);
- `mis`: miles' MIS, mask mode with rejection sampling and its veto (1e-4);
- `opsm`: `--use-opsm` over the preset's loss.

Printed and written to bench/results/corrections.json: per arm and S, the mean consumed staleness
(rollout/fully_async/avg_staleness), the reward over the first 5 steps and the last 10 % of steps,
the first step whose 5-step mean reward reaches 0.9 (the learning bar of the embedded default), the
held-out eval at the end, and the share of loss tokens the correction masked or clipped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.results_file import ResultsFile, add_results_flag  # noqa: E402
from miles_core.metrics import names as N  # noqa: E402
from miles_core.metrics.sink import read_metrics, series  # noqa: E402

ARMS = {
    "rollout-logprobs": [],
    "tis": ["--no-use-rollout-logprobs", "--use-tis"],
    "icepop": ["--no-use-rollout-logprobs", "--use-tis", "--tis-clip-low", "0.5",
               "--custom-tis-function-path", "miles_core.train.corrections.icepop_function"],
    "mis": ["--no-use-rollout-logprobs", "--use-tis", "--custom-tis-function-path",
            "miles_core.train.corrections.compute_mis_weights_with_cp", "--tis-mode", "mask", "--use-rs",
            "--rs-veto-threshold", "1e-4"],
    "opsm": ["--use-opsm"],
}
# the share of loss tokens each correction masked or clipped (token means the trainer logs)
SHARE = {"tis": N.TIS_CLIPFRAC, "icepop": N.TIS_CLIPFRAC, "mis": "train/mis_tis_mask_fraction_high",
         "opsm": N.OPSM_CLIPFRAC}
BAR = 0.9  # the embedded default's learning bar (docs/quickstart.md)


def run_arm(root: Path, arm: str, staleness: int, steps: int) -> dict:
    run_id = f"{arm}-s{staleness}"
    flags = ["--preset", "tiny-reverse4", "--run-id", run_id, "--no-progress", "--num-rollout", str(steps),
             "--max-weight-staleness", str(staleness), "--async-data-buffer-capacity-factor", str(max(2, staleness)),
             "--eval-interval", str(steps), *ARMS[arm]]
    env = {**os.environ, "RAY_TMPDIR": tempfile.mkdtemp(prefix="rc", dir="/tmp")}
    t0 = time.perf_counter()
    proc = subprocess.run([str(ROOT / ".venv/bin/pyflyte"), "run", "workflows/fully_async.py", "fully_async_rl",
                           "--storage_root", f"file://{root}", "--flags", " ".join(flags)],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{run_id} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    events = read_metrics(f"file://{root}/runs/{run_id}")
    _, reward = series(events, N.REWARD)
    _, stale = series(events, N.AVG_STALENESS)
    _, heldout = series(events, "eval/heldout")
    share = series(events, SHARE[arm])[1] if arm in SHARE else []
    tail = max(1, len(reward) // 10)
    smooth = [sum(reward[max(0, i - 4):i + 1]) / len(reward[max(0, i - 4):i + 1]) for i in range(len(reward))]
    return {"arm": arm, "staleness": staleness, "steps": len(reward), "seconds": round(seconds, 1),
            "mean_staleness": round(sum(stale) / len(stale), 3) if stale else None,
            "reward_first5": round(sum(reward[:5]) / 5, 3), "reward_last10pct": round(sum(reward[-tail:]) / tail, 3),
            "first_step_at_bar": next((i for i, r in enumerate(smooth) if r >= BAR), None),
            "heldout_final": round(heldout[-1], 3) if heldout else None,
            "masked_or_clipped": round(sum(share) / len(share), 4) if share else None}


def figures(rows: list[dict]) -> dict:
    """Per arm, at the largest staleness: the last 10 % reward and its difference from the arm without
    a correction (the tolerance a correction adds, or costs)."""
    top = max(r["staleness"] for r in rows)
    last = {r["arm"]: r for r in rows if r["staleness"] == top}
    base = last.get("rollout-logprobs")
    out: dict = {"largest_staleness": top}
    for arm, r in last.items():
        key = arm.replace("-", "_")
        out[f"{key}_last10pct"] = r["reward_last10pct"]
        out[f"{key}_mean_staleness"] = r["mean_staleness"]
        if base is not None and arm != "rollout-logprobs":
            out[f"{key}_minus_uncorrected"] = round(r["reward_last10pct"] - base["reward_last10pct"], 3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--staleness", nargs="+", type=int, default=[2, 8])
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--root", default="", help="storage root of the runs (default: a new temporary directory)")
    add_results_flag(p, "corrections")
    a = p.parse_args()
    results = ResultsFile("corrections", vars(a))
    root = Path(a.root or tempfile.mkdtemp(prefix="corrections-"))
    rows = []
    for s in a.staleness:
        for arm in a.arms:
            row = run_arm(root, arm, s, a.steps)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'arm':18} {'S':>3} {'stale':>6} {'first5':>7} {'last10%':>8} {'bar@':>5} {'heldout':>8} {'masked':>7}")
    for r in rows:
        print(f"{r['arm']:18} {r['staleness']:>3} {r['mean_staleness']!s:>6} {r['reward_first5']:>7} "
              f"{r['reward_last10pct']:>8} {r['first_step_at_bar']!s:>5} {r['heldout_final']!s:>8} "
              f"{r['masked_or_clipped']!s:>7}")
    results.write(a.results, figures(rows), rows)
    print(f"written to {a.results}")


if __name__ == "__main__":
    main()

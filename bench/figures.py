"""The figures of docs/benchmarks.md (and docs/quickstart.md's), rendered from bench/results/*.json:
one source for every number.

    .venv/bin/python bench/figures.py           # after a bench run: rewrite the page's generated sections
    .venv/bin/python bench/figures.py --check   # write nothing; exit 1 naming each stale section (the tests)

Each bench's figures sit in its page (`PAGES`: docs/benchmarks.md but for the quickstart's) between
`<!-- figures-{bench}:begin (generated ...) -->`
and `<!-- figures-{bench}:end -->`: when and on what the bench ran, then its tables, rendered from
bench/results/{bench}.json (the schema of bench/results_file.py). The prose around the sections says
what is measured and how and quotes no figure; other pages link to the page rather than quote it. A
bench without a results file renders one line saying how to make it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = "docs/benchmarks.md"
PAGES = {"quickstart": "docs/quickstart.md"}  # a bench whose figures are not on PAGE
REGENERATE = ".venv/bin/python bench/figures.py"


# ----------------------------------------------------------------------------- formatting


def _f(x: float, digits: int = 3) -> str:
    return f"{x:,.{digits}f}"


def _s(x: float, digits: int = 3) -> str:
    return f"{_f(x, digits)} s"


def _x(x: float) -> str:
    return f"{x:.2f}×"


def _mib(n: float) -> str:
    mib = n / 2 ** 20
    return f"{mib:,.1f} MiB" if mib < 10 else f"{mib:,.0f} MiB"


def _rate(x: float) -> str:
    """4328958 -> '4.33M'; 546.6 -> '547'."""
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x:,.0f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def measured(record: dict) -> str:
    """When, on what and how long: the line every section starts with."""
    m, seconds = record["machine"], record["seconds"]
    where = f"{m['cpus']} CPUs" + (f", {m['platform']}, Python {m['python']}" if m.get("platform") else "")
    took = f"; the whole bench took {seconds:,.0f} s" if seconds else ""
    notes = "".join(f" Note: {n}." for n in record.get("notes", []))
    return f"Measured {record['started_at'][:10]} on {where}{took} (`bench/results/{record['bench']}.json`).{notes}"


def _rows(record: dict, kind: str) -> list[dict]:
    return [r for r in record["rows"] if r.get("kind") == kind]


# ----------------------------------------------------------------------------- async_speedup


def render_async_speedup(results: dict[str, dict]) -> list[str]:
    rec = results["async_speedup"]
    fig, cfg = rec["figures"], rec["config"]
    t = cfg["generation_step_seconds"]
    lines = [measured(rec), "",
             f"The default (σ {cfg['sigma']}, push `{fig['push_model']}` from `{fig['push_source']}`: "
             f"{_s(fig['push_seconds'])} with the engines paused {_s(fig['pause_seconds'])} of it, T = {_s(t, 1)}, "
             f"push ÷ T = {fig['push_seconds'] / t:.2f}), {cfg['steps']} steps, medians of the last "
             f"{cfg['steps'] - cfg['warmup_steps']}:", ""]
    lines += _table(["driver", "s/step", "efficiency", "whole run (fill included)", "slots held",
                     "consumed staleness max / mean"], [_driver_row(r) for r in _rows(rec, "driver")])
    lines += ["", _speedup_line(rec), "", *_push_against_step(rec, results.get("real_model")), ""]
    return lines + _sensitivity(rec)


def _driver_row(r: dict) -> list[str]:
    return [r["driver"].replace("fully-async", "fully async"), _f(r["step_seconds"]), f"{r['efficiency']:.2f}",
            _s(r["whole_run_seconds"], 1),
            f"{r['slot_utilisation']:.2f}", f"{r['staleness_max']} / {r['staleness_mean']:.2f}"]


def _speedup_line(rec: dict) -> str:
    fig, drivers = rec["figures"], {r["driver"]: r for r in _rows(rec, "driver")}
    line = (f"Ideal {_f(fig['ideal_step_seconds'])} s/step; **speedup of fully async over sync "
            f"{_x(fig['speedup'])} per step** ({_x(fig['speedup_whole_run'])} whole run).")
    pushes = [f"{name.replace('-async', ' async')} {_s(r['phases']['push'])}" for name, r in drivers.items()
              if "phases" in r]
    if pushes:
        line += f" Each driver's push (median): {', '.join(pushes)}."
    if {"sync", "one-step-off"} <= drivers.keys():
        line += (f" Sync waited {_s(drivers['sync']['phases']['wait batch'])} per batch, one-step-off "
                 f"{_s(drivers['one-step-off']['phases']['prefetch wait'])} for its prefetched batch before each push.")
    return line


def _push_against_step(rec: dict, real: dict | None) -> list[str]:
    """The default's push ÷ T beside the same push against a real model's step (real_model.json)."""
    if not real or not real["figures"].get("steps_per_minute"):
        return []
    step = 60 / real["figures"]["steps_per_minute"]
    push = rec["figures"]["push_seconds"]
    return [f"Against a real step: `real_model.json`'s SmolLM2-135M run took {_s(step, 1)} a step "
            f"({real['figures']['steps_per_minute']:.2f} steps/min), so the same push there is a push ÷ T of "
            f"{push / step:.2f}, nearer the tiny-store rows below than the default."]


def _sensitivity(rec: dict) -> list[str]:
    rows = _rows(rec, "sensitivity")
    if not rows:
        return []
    cfg, t = rec["config"], rec["config"]["generation_step_seconds"]
    steps = cfg["table_steps"]
    head = (f"Sensitivity ({steps} steps per cell, median of the last {steps - cfg['warmup_steps']}; speedup = "
            "sync ÷ fully async s/step, efficiency = ideal ÷ fully async s/step):")
    table = _table(["σ", "push cost", "push", "pause", "push ÷ T", "sync s/step", "fully async s/step", "ideal",
                    "speedup", "efficiency"],
                   [[f"{r['sigma']}", r["push"], _s(r["push_seconds"]), _s(r["pause_seconds"]),
                     f"{r['push_seconds'] / t:.2f}", _f(r["sync_step_seconds"]), _f(r["fully_async_step_seconds"]),
                     _f(r["ideal_step_seconds"]), _x(r["speedup"]), f"{r['efficiency']:.2f}"] for r in rows])
    return [head, "", *table, ""]


# ----------------------------------------------------------------------------- buffer


def render_buffer(results: dict[str, dict]) -> list[str]:
    rec = results["buffer"]
    cfg = rec["config"]
    lines = [measured(rec), f"Medians of {cfg['repeats']} rounds of {cfg['groups']} groups from "
             f"{cfg['producers']} producer threads:", ""]
    rows = _rows(rec, "throughput")
    lines += _table(["store", "buffer", "raw, same objects", "naive", "ratio raw/buffer", "naive/buffer",
                     "put p50 / p99"], [_throughput_row(r) for r in rows])
    lines += ["", "The buffer's objects per round: " + "; ".join(_objects(r) for r in rows) + "."]
    return lines + [""] + [_index_line(r) for r in _rows(rec, "index_memory")] + [""]


_STORES = {"file": "file://", "s3": "S3 (SeaweedFS)"}


def _throughput_row(r: dict) -> list[str]:
    return [_STORES.get(r["store"], r["store"]),
            f"{_rate(r['buffer_groups_per_s'])} groups/s, {_rate(r['buffer_tokens_per_s'])} tokens/s "
            f"({_rate(r['buffer_response_tokens_per_s'])} response), {r['buffer_mb_per_s']:.0f} MB/s",
            f"{_rate(r['raw_groups_per_s'])} groups/s, {r['raw_mb_per_s']:.0f} MB/s",
            f"{_rate(r['naive_groups_per_s'])} groups/s", f"**{r['ratio']:.2f}**", f"{r['ratio_naive']:.2f}",
            f"{r['put_p50_s'] * 1e3:.1f} / {r['put_p99_s'] * 1e3:.1f} ms"]


def _objects(r: dict) -> str:
    counts = sorted(x["objects"] for x in r["rounds"])
    span = f"{counts[0]}–{counts[-1]}" if counts[0] != counts[-1] else f"{counts[0]}"
    return (f"{_STORES.get(r['store'], r['store'])} {span} objects for {r['groups']} groups (median "
            f"{r['object_bytes_median'] / 1e6:.2f} MB, largest {r['object_bytes_max'] / 1e6:.2f} MB)")


def _index_line(r: dict) -> str:
    return (f"Index at {r['groups']:,} reopened groups ({r['group']}, {r['groups_per_object']} to an object): "
            f"**{r['index_bytes_per_group']:,.0f} B per group of index**, besides the "
            f"{r['object_bytes_per_group']:,.0f} B per group of object bytes its rows view "
            f"({r['python_bytes_per_group']:,.0f} B of Python memory per group in all; {r['objects']:,} objects; "
            f"laid out in {r['layout_seconds']:.0f} s, reopened in {r['reopen_seconds_traced']:.0f} s under "
            "tracemalloc).")


# ----------------------------------------------------------------------------- engine


def render_engine(results: dict[str, dict]) -> list[str]:
    rec = results["engine"]
    cfg = rec["config"]
    lines = [measured(rec), f"Medians of {cfg['repeats']} interleaved repeats, {cfg['threads']} thread each; "
             "ratios are the engine's against padded / against bucketed:", ""]
    lines += _table(["case", "useful tokens (computed: padded / bucketed)", "transformers padded",
                     "transformers bucketed", "engine in-process", "engine over HTTP"],
                    [_engine_row(r) for r in rec["rows"]])
    tail = next((r for r in rec["rows"] if r.get("key") == "tail"), None)
    if tail:
        verdict = "meets" if tail["ratio_vs_padded"] >= 2 else "misses"
        lines += ["", f"The long tail {verdict} its 2× target against padded `generate` in this run."]
    return lines + [""]


def _engine_row(r: dict) -> list[str]:
    tail = r.get("key") == "tail"

    def speed(seconds: float) -> str:  # the long tail in tokens/s, the default batch in ms
        return f"{r['useful_tokens'] / seconds:,.0f} tok/s" if tail else f"{seconds * 1e3:.1f} ms"

    buckets = f"{r['buckets']} bucket" + ("s" if r["buckets"] != 1 else "")
    cells = [r["case"], f"{r['useful_tokens']:,} ({r['padded_tokens']:,} / {r['bucketed_tokens']:,} in {buckets})",
             speed(r["padded_s"]), speed(r["bucketed_s"]),
             f"{speed(r['engine_s'])}: {_bold(_x(r['ratio_vs_padded']), tail)} / {_x(r['ratio_vs_bucketed'])}"]
    http = (f"{speed(r['http_s'])}: {_x(r['http_ratio_vs_padded'])} / {_x(r['http_ratio_vs_bucketed'])}"
            if r.get("http_s") else "not run")
    return cells + [http]


def _bold(text: str, on: bool) -> str:
    return f"**{text}**" if on else text


# ----------------------------------------------------------------------------- weights


_MODELS = {"tiny": "builtin:tiny-gpt", "smollm": "SmolLM2-135M-size"}


def render_weights(results: dict[str, dict]) -> list[str]:
    rec = results["weights"]
    lines = [measured(rec), f"Medians of {rec['config']['repeats']} rounds per page-cache state, each a push and then "
             "its baseline, after two left out (they allocate the engine's buffers; the first distributed push also "
             "forms the group):", ""]
    lines += _table(["model", "transport", "page cache", "push", "engines paused", "baseline", "ratio"],
                    [_weights_row(r, cache) for r in rec["rows"] for cache in ("warm", "cold")
                     if f"push_s{_cache_suffix(cache)}" in r])
    for v in (r for r in rec["rows"] if r.get("transport") == "versions"):
        lines += ["", _versions_line(v), ""]
        lines += _table(["version", "written as", "bytes", "of dense bf16", "elements changed", "export",
                         "reader update", "engines paused", "dense download"],
                        [[str(x["version"]), "anchor" if x["anchor"] else "delta", _mib(x["bytes"]),
                          f"{x['share_of_dense']:.4f}", f"{x['changed_share']:.4f}", _s(x["export_s"]), _s(x["update_s"]),
                          _s(x["pause_s"]), _s(x["dense_download_s"]) if x["dense_download_s"] else ""]
                         for x in v["rounds"]])
    return lines + [""]


def _versions_line(v: dict) -> str:
    late = v["late_joiner"]
    ratio = v.get("update_vs_dense_download")
    return (f"Weight versions as bf16 deltas ({v['model']}, trained at lr {v['lr']:g} between {v['versions']} versions "
            f"published to SeaweedFS S3): steady-state delta {v['steady_share_of_dense']:.4f} of the dense bf16 model "
            f"(goal <= 0.03), {v['steady_changed_share']:.4f} of elements changed; object-store growth per delta version "
            f"{v['stored_share_per_version']:.4f} with its config and tokenizer files (goal <= 0.05); a reader's update (download, apply, verify, write, engine stage) "
            f"{_s(v['update_s'])} against a dense download of {_s(v['dense_download_s'])}"
            + (f" (ratio {ratio:.2f}, goal <= 0.25)" if ratio is not None else "")
            + f"; engines paused {_s(v['pause_s'])} (goal <= 0.1 s); a late joiner read {late['anchors_read']} anchor "
            f"part(s) and {late['deltas_applied']} delta part(s) in {_s(late['seconds'])}.")


def _cache_suffix(cache: str) -> str:
    return "" if cache == "warm" else f"_{cache}"


def _weights_row(r: dict, cache: str = "warm") -> list[str]:
    x = _cache_suffix(cache)
    model = f"{_MODELS.get(r['model'], r['model'])} ({_mib(r['bytes'])})"
    if r["transport"] == "distributed":
        buckets = r.get("buckets", 1)
        transport = (f"distributed, {buckets} bucket" + ("s" if buckets != 1 else "")
                     + (" (flattened)" if r.get("flattened") else ""))
        push = _s(r["push_s" + x]) + (f" (first push {_s(r['first_push_s'])})" if r.get("first_push_s") else "")
    else:
        stage = f", stage {_s(r['stage_s' + x])}" if f"stage_s{x}" in r else ""
        transport, push = r["transport"], f"{_s(r['push_s' + x])} (export {_s(r['export_s' + x])}{stage})"
    return [model, transport, cache, push, _s(r["pause_s" + x]), f"{r['baseline']} {_s(r['baseline_s' + x])}",
            f"{r['ratio' + x]:.2f}"]


# ----------------------------------------------------------------------------- resume


def render_resume(results: dict[str, dict]) -> list[str]:
    rec = results["resume"]
    cfg = rec["config"]
    lines = [measured(rec), f"{cfg['consumed']:,} groups consumed, {cfg['step_groups']} a step, "
             f"{cfg['groups_per_object']} to an object; median of {cfg['repeats']} reopens:", ""]
    lines += _table(["store", "backlog", "history (every manifest)", "compacted", "+ retention",
                     "objects (after retention)", "index bytes per buffered group"],
                    [[_STORES.get(r["store"], r["store"]), f"{r['backlog']:,}", _s(r["history_s"], 2),
                      _s(r["compacted_s"], 2), _s(r["compacted_retention_s"], 2),
                      f"{r['objects']:,} ({r['objects_after_retention']:,})",
                      f"{r['memory']['index_bytes_per_group']:,.0f}"] for r in rec["rows"]])
    return lines + [""]


# ----------------------------------------------------------------------------- real_model


def render_real_model(results: dict[str, dict]) -> list[str]:
    rec = results["real_model"]
    fig = rec["figures"]
    reward = [r["reward_5_step_mean"] for r in rec["rows"] if "step" in r]  # the plain loop's rows have none
    return [measured(rec), "",
            f"`{fig['flags']}`: {fig['steps']} steps in {fig['wall_seconds']:,.0f} s "
            f"({fig['steps_per_minute']:.2f} steps/min; the import took {fig['import_seconds']:.0f} s before it); "
            f"held-out greedy accuracy **{fig['heldout_accuracy_before']:.1%} → {fig['heldout_accuracy_after']:.1%}** "
            f"({fig['heldout_accuracy_gain'] * 100:+.1f} points); the training reward's 5-step mean went "
            f"{reward[4]:.2f} (step 4) → {reward[-1]:.2f} (step {len(reward) - 1}), first past 0.4 at step "
            f"{fig['first_step_5_step_mean_above_0_4']}.", "", *_against_plain_loop(fig)]


def _against_plain_loop(fig: dict) -> list[str]:
    if fig.get("pipeline_to_plain_ratio") is None:
        return ["(This run predates the plain-loop comparison.)", ""]
    return [f"Seconds per step, medians after the first 2 steps, in the same bench run: the pipeline "
            f"{_s(fig['pipeline_seconds_per_step'], 1)}, a plain-torch GRPO loop on the same model, batch and "
            f"sampling {_s(fig['plain_loop_seconds_per_step'], 1)}: **ratio {_x(fig['pipeline_to_plain_ratio'])}**.",
            ""]


# ----------------------------------------------------------------------------- elastic


_PHASES = {"alone": "the trainer's engine alone", "one": "+ 1 producer", "two": "+ 2 producers",
           "after_kill": "after p1's kill (+ 1)"}


def render_elastic(results: dict[str, dict]) -> list[str]:
    rec = results["elastic"]
    fig, cfg = rec["figures"], rec["config"]
    lines = [measured(rec), "",
             f"Engines of {cfg['slots']} slots at {cfg['seconds_per_token']} s per token, B = {cfg['batch_size']} "
             f"groups × n = {cfg['n']}: a batch's generation at full slots ≈ "
             f"{_s(fig['generation_seconds_one_engine'], 1)} on one engine, "
             f"{_s(fig['generation_seconds_three_engines'], 1)} on three; medians over {cfg['window_steps']}-step "
             "windows:", ""]
    lines += _table(["phase", "steps/min", "s/step", "÷ alone", "trainer step", "groups consumed: trainer / p1 / p2",
                     "rejected at get"], [_phase_row(r, fig["alone_steps_per_minute"]) for r in _rows(rec, "phase")])
    return lines + ["", _elastic_line(fig), "", _kill_line(fig, cfg), ""]


def _phase_row(r: dict, alone: float) -> list[str]:
    g = r["groups_by_writer"]
    train = _s(r["train_step_seconds"]) if r["train_step_seconds"] is not None else "—"
    return [_PHASES.get(r["phase"], r["phase"]), f"{r['steps_per_minute']:.2f}", _f(r["step_seconds"], 2),
            _x(r["steps_per_minute"] / alone), train, f"{g['trainer']} / {g['p1']} / {g['p2']}",
            f"{r['rejected_at_get']}"]


def _elastic_line(fig: dict) -> str:
    verdict = "meets" if fig["two_ratio"] >= fig["target_two_ratio"] else "misses"
    return (f"**Two producers: {_x(fig['two_ratio'])} the steps/min of the trainer's engine alone** ({verdict} the "
            f"{fig['target_two_ratio']}× target); one: {_x(fig['one_ratio'])}. A producer's first group was "
            f"consumed {_s(fig['p1_first_consumed_seconds'], 1)} (p1) and {_s(fig['p2_first_consumed_seconds'], 1)} "
            "(p2) after its process started.")


def _kill_line(fig: dict, cfg: dict) -> str:
    recovery = fig["kill_recovery_seconds"]
    back = f"{_s(recovery, 1)} after the kill" if recovery is not None else "not within the bench"
    return (f"SIGKILL of p1: **{fig['kill_in_flight_groups']} groups in flight lost**; of the "
            f"{fig['kill_committed_groups']} it had committed, {fig['kill_committed_consumed']} were consumed, "
            f"{fig['kill_committed_rejected_at_get']} rejected at get and {fig['kill_committed_still_buffered']} "
            f"still in the buffer when the bench stopped; {fig['kill_regenerated_by_others']} of its "
            f"{fig['kill_unfinished_claimed_prompts']} unfinished claimed prompts were generated by the other "
            f"writers once its claims expired (`--prompt-claim-ttl-seconds {cfg['claim_ttl_seconds']:g}`). "
            f"Back at the one-producer level {back}; after the kill the run kept "
            f"{_x(fig['after_kill_ratio_to_one'])} the one-producer steps/min (its longest step "
            f"{_s(fig['kill_longest_step_after_kill_s'], 1)}).")


# ----------------------------------------------------------------------------- trace


def render_trace(results: dict[str, dict]) -> list[str]:
    rec = results["trace"]
    fig, cfg = rec["figures"], rec["config"]
    rows = _rows_by(rec, "traced")
    return [measured(rec), "",
            f"Recording a span: {_f(fig['record_us_per_span'], 2)} µs; writing it to the run root: "
            f"{_f(fig['write_us_per_span'], 2)} µs (medians of 5 rounds). The embedded default, {cfg['steps']} steps, "
            f"{cfg['repeats']} runs each way: **{fig['spans_per_step']:.0f} spans per step, "
            f"{_f(fig['mb_per_100_steps'], 2)} MB per 100 steps** at `--trace-sample-groups 0.25`; median step "
            f"{_s(fig['step_seconds_off'])} without the trace, {_s(fig['step_seconds_on'])} with it (ratio "
            f"{_f(fig['ratio_on_off'], 3)}; runs off {rows[False]}, on {rows[True]}: the spread between runs is "
            f"the machine's noise); bound from the costs: **{fig['bound_fraction_of_step']:.2%} of a step**.", ""]


def _rows_by(rec: dict, key: str) -> dict:
    out: dict = {}
    for r in rec["rows"]:
        out.setdefault(r[key], []).append(_s(r["median_step_seconds"]))
    return {k: ", ".join(v) for k, v in out.items()}


# ----------------------------------------------------------------------------- step_overhead


def _overhead_headline(fig: dict, label: str) -> str:
    return (f"{label}: step {_s(fig[f'{label}_step_seconds'])}, trainer compute {_s(fig[f'{label}_compute_seconds'])}, "
            f"**step ÷ compute {_x(fig[f'{label}_step_over_compute'])}**")


def render_step_overhead(results: dict[str, dict]) -> list[str]:
    rec = results["step_overhead"]
    fig, cfg = rec["figures"], rec["config"]
    against = f" each of this revision and of `{cfg['baseline_rev']}`, alternating" if cfg.get("baseline_rev") else ""
    labels = [label for label in ("this", "baseline") if f"{label}_step_seconds" in fig]
    headline = "; ".join(_overhead_headline(fig, label) for label in labels)
    calls = sorted({k for r in rec["rows"] for k, v in r.items() if k.startswith("median_") and k.endswith("_seconds")
                    and v >= 0.0005} - {"median_step_seconds", "median_compute_seconds"})  # what a step spends time on
    header = ["run", "step", "trainer compute", "step ÷ compute", *[c[len("median_"):-len("_seconds")] for c in calls]]
    rows = [[f"{r['variant']} {r['repeat']}", _f(r["median_step_seconds"] * 1e3, 1),
             _f(r["median_compute_seconds"] * 1e3, 1), _x(r["median_step_over_compute"]),
             *[_f(r.get(c, 0.0) * 1e3, 1) for c in calls]] for r in rec["rows"]]
    return [measured(rec), "", f"The embedded default, {cfg['steps']} steps, {cfg['repeats']} run(s){against} "
            f"(medians of the runs' medians): {headline}. Each run, medians over its traced steps after the first 5, "
            "in ms:", "", *_table(header, rows), ""]


# ----------------------------------------------------------------------------- the page


def render_quickstart(results: dict[str, dict]) -> list[str]:
    rec = results["quickstart"]
    fig = rec["figures"]
    return [f"One run on an idle machine ({rec['started_at'][:10]}, {rec['machine']['cpus']} CPUs, "
            f"Python {rec['machine']['python']}): `{fig['command']}` took {fig['wall_seconds']:,.0f} s with the "
            f"venv in place, {fig['steps']} steps at a median {fig['median_step_seconds']:.2f} s per step after "
            f"~{fig['startup_seconds']:,.0f} s of start-up; the training reward went from "
            f"{fig['reward_first_5']:.3f} over the first 5 steps to {fig['reward_last_10_percent']:.3f} over the "
            f"last 10%, and greedy exact match on the 500 held-out prompts (`eval/heldout/pass@1`) was "
            f"{fig['heldout_pass_at_1']}."]


# ----------------------------------------------------------------------------- tool_learning


_TOOL_ARMS = {"no-tool": "no tool (single-turn RL)", "tool-untrained": "tool, untrained", "tool-rl": "tool + RL",
              "unmasked": "tool + RL, tool messages in the loss (control)"}


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:.1%}"


def render_tool_learning(results: dict[str, dict]) -> list[str]:
    rec = results["tool_learning"]
    fig, cfg = rec["figures"], rec["config"]
    base = {r["arm"]: r for r in rec["rows"] if r["step"] is None}
    curves: dict[str, list[dict]] = {}
    for r in rec["rows"]:
        if r["step"] is not None:
            curves.setdefault(r["arm"], []).append(r)
    lines = [measured(rec), "",
             f"Each trained arm {cfg['minutes']:g} minutes from its launch; held-out greedy accuracy on the first "
             f"{cfg['eval_prompts']} held-out prompts, a snapshot every {cfg['eval_every']} steps, at the time its "
             "step finished:", ""]
    rows = []
    for arm, label in _TOOL_ARMS.items():
        start = base.get("tool-untrained" if arm in ("tool-rl", "unmasked", "tool-untrained") else "no-tool")
        points = curves.get(arm, [])
        if arm != "tool-untrained" and not points:
            continue
        path = " → ".join(f"{p['accuracy']:.0%} ({p['seconds'] / 60:.0f} min)" for p in points) or "(no training)"
        end = points[-1] if points else start
        rows.append([label, _pct(start["accuracy"] if start else None), path, f"**{_pct(end['accuracy'])}**",
                     _pct(end.get("tool_share")), str(fig.get(f"{arm.replace('-', '_')}_steps", "—"))])
    lines += _table(["arm", "start", "held-out accuracy over time", "at the end", "episodes calling the tool",
                     "steps"], rows)
    lines += ["", *_tool_curve(rec, base, curves)]
    if fig.get("tool_rl_gain_over_better_baseline") is not None:
        lines += ["", f"Tool + RL against the better baseline: **{fig['tool_rl_gain_over_better_baseline'] * 100:+.1f} "
                      "points** (goal: >= 60% and >= +30 points within 30 minutes)."]
    if fig.get("plain_check_accuracy") is not None:
        lines += ["", f"The plain transformers loop (its own tool, parser and scoring) on step "
                      f"{fig['plain_check_step']}'s snapshot: {_pct(fig['plain_check_accuracy'])}, the project's eval "
                      f"{_pct(fig['project_eval_accuracy'])} (difference {fig['plain_check_difference'] * 100:+.1f} "
                      "points; goal: within 3)."]
    return lines


def _tool_curve(rec: dict, base: dict, curves: dict[str, list[dict]]) -> list[str]:
    """Each arm's held-out accuracy at every 5 minutes of its budget (the last snapshot evaluated by then;
    the starting model's before the first), as a table and a chart (the lines in the table's order)."""
    minutes = rec["config"]["minutes"]
    marks = [m for m in range(0, int(minutes) + 1, 5)]
    arms = [a for a in _TOOL_ARMS if a == "tool-untrained" or curves.get(a)]

    def at(arm: str, m: float) -> float | None:
        start = base.get("tool-untrained" if arm != "no-tool" else "no-tool")
        value = start["accuracy"] if start else None
        for p in curves.get(arm, []):
            if p["seconds"] <= m * 60:
                value = p["accuracy"]
        return value

    table = _table(["minutes", *(_TOOL_ARMS[a] for a in arms)],
                   [[str(m), *(_pct(at(a, m)) for a in arms)] for m in marks])
    chart = ["```mermaid", "xychart-beta", '    title "Held-out greedy accuracy (%) over each arm\'s minutes"',
             f"    x-axis \"minutes\" [{', '.join(map(str, marks))}]", '    y-axis "accuracy %" 0 --> 100']
    chart += [f"    line [{', '.join(f'{100 * (at(a, m) or 0):.0f}' for m in marks)}]" for a in arms]
    chart += ["```", f"(lines, in order: {'; '.join(_TOOL_ARMS[a] for a in arms)})"]
    return [*table, "", *chart]


def render_corrections(results: dict[str, dict]) -> list[str]:
    rec = results["corrections"]
    lines = [measured(rec), "", f"{rec['config']['steps']} steps per run; reward = the batch mean reward "
             "(the embedded default's bar: 0.9); staleness = the mean consumed staleness in weight versions; "
             "masked = the mean share of loss tokens the correction clipped, popped or rejected.", ""]
    rows = [[r["arm"], str(r["staleness"]), _f(r["mean_staleness"], 2) if r["mean_staleness"] is not None else "—",
             _f(r["reward_first5"]), f"**{_f(r['reward_last10pct'])}**",
             "—" if r["first_step_at_bar"] is None else str(r["first_step_at_bar"]),
             "—" if r["heldout_final"] is None else _f(r["heldout_final"]),
             "—" if r["masked_or_clipped"] is None else _pct(r["masked_or_clipped"])] for r in rec["rows"]]
    return lines + _table(["correction", "--max-weight-staleness", "staleness", "reward, first 5 steps",
                           "reward, last 10 %", "first step at the bar", "held-out at the end", "masked"], rows)


RENDERERS = {
    "quickstart": render_quickstart,
    "async_speedup": render_async_speedup,
    "buffer": render_buffer,
    "engine": render_engine,
    "weights": render_weights,
    "resume": render_resume,
    "real_model": render_real_model,
    "tool_learning": render_tool_learning,
    "corrections": render_corrections,
    "elastic": render_elastic,
    "trace": render_trace,
    "step_overhead": render_step_overhead,
}


def load_results(results_dir: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(results_dir.glob("*.json"))}


def render(bench: str, results: dict[str, dict]) -> str:
    if bench not in results:
        return f"No results committed yet: run `.venv/bin/python bench/{bench}.py`, then `{REGENERATE}`.\n"
    return "\n".join(RENDERERS[bench](results)).rstrip("\n") + "\n"


def markers(bench: str) -> tuple[str, str]:
    return (f"<!-- figures-{bench}:begin (generated by `{REGENERATE}` from bench/results/{bench}.json) -->\n",
            f"<!-- figures-{bench}:end -->")


def page_of(bench: str) -> str:
    return PAGES.get(bench, PAGE)


def with_section(text: str, bench: str, body: str) -> str:
    """`text` with bench's generated section replaced by `body`; ValueError when its markers are missing."""
    begin, end = markers(bench)
    head, found, rest = text.partition(begin)
    _, found_end, tail = rest.partition(end)
    if not found or not found_end:
        raise ValueError(f"{page_of(bench)} has no `{begin.strip()}` ... `{end}` section")
    return head + begin + body + end + tail


def current_pages(root: Path) -> dict[str, str]:
    """What each page must hold: its hand-written text with its sections rendered from the results now."""
    results = load_results(root / "bench" / "results")
    texts = {page: (root / page).read_text() for page in {page_of(b) for b in RENDERERS}}
    for bench in RENDERERS:
        texts[page_of(bench)] = with_section(texts[page_of(bench)], bench, render(bench, results))
    return texts


def current_page(root: Path) -> str:
    """docs/benchmarks.md as it must be."""
    return current_pages(root)[PAGE]


def stale_sections(root: Path) -> list[str]:
    """The benches whose section in its page differs from what their results file renders (or is missing)."""
    results = load_results(root / "bench" / "results")
    stale = []
    for bench in RENDERERS:
        try:
            text = (root / page_of(bench)).read_text()
            if with_section(text, bench, render(bench, results)) != text:
                stale.append(bench)
        except (ValueError, FileNotFoundError):
            stale.append(bench)
    return stale


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a section is stale")
    ap.add_argument("--root", default=str(ROOT), help="repository root")
    args = ap.parse_args(argv)
    root = Path(args.root)
    stale = stale_sections(root)
    if args.check:
        for bench in stale:
            print(f"{page_of(bench)}: the {bench} figures are stale; regenerate with `{REGENERATE}`", file=sys.stderr)
        return 1 if stale else 0
    try:
        pages = current_pages(root)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 1
    for page, text in pages.items():
        (root / page).write_text(text)
    print(f"wrote {', '.join(sorted(pages))} ({', '.join(stale) or 'nothing'} changed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

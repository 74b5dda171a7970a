"""The run report: one self-contained HTML file (plotly, JS inline) built from `metrics/` (and the
heartbeats of producer jobs, `producers/heartbeats/`, for their generation throughput).

    write_report(run_uri, "report.html")     # `miles report RUN_URI -o report.html`
    render_report(run_uri) -> str            # the same HTML (the Flyte Deck uses it)

Panels: reward (with eval means), staleness, buffer queue size against capacity, throughput,
wait times, eval curves, groups committed per minute by each producer job over time (runs that had
producer jobs only), a swimlane of the last steps from the run's timeline trace (engines busy, the
trainer's phases, weight pushes, checkpoints, evals; runs with a trace only); and a bottleneck
reading from the queue: pinned at 0 -> rollout-bound (the trainer drains faster than the producer
fills), pinned at capacity -> train-bound (the producer is blocked on a full buffer).
"""

from __future__ import annotations

import datetime
import html
import os
from dataclasses import dataclass

import fsspec

from miles_core.metrics import names as N
from miles_core.metrics import trace
from miles_core.metrics.sink import _as_store, metric_names, read_metrics, series
from miles_core.storage import StorageError, StorageUnavailable, Store
from miles_core.storage.run_root import read_config, read_status

# A verdict needs the queue to sit at an end this often (after warm-up).
PINNED_FRACTION = 0.6
WARMUP_FRACTION = 0.1
MIN_POINTS = 3


@dataclass(frozen=True)
class Bottleneck:
    verdict: str  # rollout-bound | train-bound | balanced | unknown
    detail: str


def diagnose_bottleneck(events: list[dict], capacity: int | None, max_staleness: int | None = None) -> Bottleneck:
    """Read the bottleneck from the buffer queue size (docs/metrics.md), with the wait times as support.

    An empty queue while consumed groups sit at the --max-weight-staleness limit means admission
    control, not the engines, holds the producer back: more engines would not help."""
    steps, q = series(events, N.QUEUE_SIZE)
    if len(q) < MIN_POINTS:
        return Bottleneck("unknown", f"not enough {N.QUEUE_SIZE} points ({len(q)}) to read a bottleneck.")
    q = q[int(len(q) * WARMUP_FRACTION):]
    cap = capacity if capacity else max(q)
    at_zero = sum(1 for v in q if v <= 0) / len(q)
    at_cap = sum(1 for v in q if cap > 0 and v >= cap) / len(q) if cap else 0.0
    _, wait = series(events, N.TRAIN_WAIT_SECONDS)
    _, blocked = series(events, N.PRODUCER_BLOCKED_SECONDS)
    support = (f" Trainer waited {sum(wait):.1f} s for data in total; the producer was blocked on a full buffer "
               f"{sum(blocked):.1f} s." if wait or blocked else "")
    share = f"queue at 0 in {at_zero:.0%} and at capacity ({cap:g}) in {at_cap:.0%} of the steps after warm-up."
    _, stale = series(events, N.MAX_STALENESS)
    stale = stale[int(len(stale) * WARMUP_FRACTION):]
    at_limit = (sum(1 for v in stale if v >= max_staleness) / len(stale)
                if max_staleness is not None and stale else 0.0)
    if at_zero >= PINNED_FRACTION and at_limit >= PINNED_FRACTION:
        return Bottleneck("staleness-bound", "Admission control keeps the producer within --max-weight-staleness="
                          f"{max_staleness}: consumed groups are at the limit in {at_limit:.0%} of the steps and the "
                          + share + " Raise the limit (more off-policy data) or speed up training; more engines "
                          "would sit idle." + support)
    if at_zero >= PINNED_FRACTION:
        return Bottleneck("rollout-bound", "The trainer drains the buffer as fast as groups arrive: " + share +
                          " Add engines / rollout GPUs or raise --async-max-concurrent-samples." + support)
    if at_cap >= PINNED_FRACTION:
        return Bottleneck("train-bound", "Generation outpaces training and the buffer sits full: " + share +
                          " Add trainer GPUs, or give engines fewer resources." + support)
    return Bottleneck("balanced", "Neither side waits for the other most of the time: " + share + support)


def buffer_capacity(run_config: dict | None) -> int | None:
    """Capacity in groups from the run's resolved config (None when the config is unavailable)."""
    try:
        return max(1, int(run_config["buffer"]["async_data_buffer_capacity_factor"]
                          * run_config["rollout"]["rollout_batch_size"]))
    except (KeyError, TypeError):
        return None


def staleness_limit(run_config: dict | None) -> int | None:
    """--max-weight-staleness from the run's resolved config (None: no limit, or no config)."""
    value = ((run_config or {}).get("rollout") or {}).get("max_weight_staleness")
    return value if isinstance(value, int) else None


# ----------------------------------------------------------------------------- figures


PANELS = [
    ("Reward", [N.REWARD], "mean reward"),
    ("Staleness (weight versions)", [N.AVG_STALENESS, N.MAX_STALENESS, N.BUFFER_AVG_STALENESS,
                                     N.BUFFER_MAX_STALENESS, N.MIXED_VERSION_RATIO], "versions / ratio"),
    ("Buffer queue size (groups)", [N.QUEUE_SIZE], "groups"),
    ("Throughput", [N.TOKENS_PER_SECOND], "tokens / s"),
    ("Step time", [N.STEP_SECONDS], "seconds"),
    ("Wait times", [N.TRAIN_WAIT_SECONDS, N.PRODUCER_BLOCKED_SECONDS, N.WEIGHT_UPDATE_SECONDS], "seconds"),
    ("Tool use", [N.TOOL_EPISODE_SHARE, N.TOOL_CALLS_PER_EPISODE, N.TOOL_ERRORS, N.TOOL_TIMEOUTS], "share / calls"),
    ("Clipped and masked tokens", list(N.CORRECTION_SHARES), "share of loss tokens"),
    ("Weight versions (bf16 deltas)", [N.WEIGHTS_CHANGED_SHARE, N.WEIGHTS_SHARE_OF_DENSE], "share of the bf16 model"),
]


def eval_metric_names(events: list[dict]) -> list[str]:
    return [n for n in metric_names(events) if n.startswith(N.EVAL_PREFIX)
            and not n.startswith((N.EVAL_SKIPPED_PREFIX, N.EVAL_LAG_STEPS, N.EVAL_DURATION_SECONDS, N.EVAL_EXPORT_SECONDS))]


def _figure(title: str, names: list[str], events: list[dict], ytitle: str, hline: float | None = None,
            per_step: tuple[str, ...] = ()):
    """One panel; a series in `per_step` (logged every step it has a value for) is drawn with a gap
    where steps are missing, not a straight line across them."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for name in names:
        steps, values = series(events, name)
        if name in per_step:
            steps, values = with_gaps(steps, values)
        if steps:
            fig.add_trace(go.Scatter(x=steps, y=values, mode="lines+markers", name=name, marker={"size": 4}))
    if hline is not None:
        fig.add_hline(y=hline, line_dash="dash", annotation_text=f"capacity {hline:g}")
    fig.update_layout(title=title, xaxis_title="step", yaxis_title=ytitle, height=360,
                      margin={"l": 50, "r": 20, "t": 50, "b": 40}, legend={"orientation": "h", "y": -0.25})
    return fig


def with_gaps(steps: list[int], values: list[float]) -> tuple[list[int | None], list[float | None]]:
    """`steps`/`values` with a None point between two steps more than one apart (plotly breaks the line there)."""
    xs: list[int | None] = []
    ys: list[float | None] = []
    for i, (step, value) in enumerate(zip(steps, values)):
        if i and step - steps[i - 1] > 1:
            xs.append(None)
            ys.append(None)
        xs.append(step)
        ys.append(value)
    return xs, ys


def report_figures(events: list[dict], capacity: int | None = None) -> list:
    """The report's plotly figures (panels without any data are left out)."""
    figs = []
    present = set(metric_names(events))
    for title, names, ytitle in PANELS:
        names = [n for n in names if n in present]
        per_step = tuple(names)  # the panels' own metrics are logged with steps; evals are sparse by design
        if title == "Reward":
            names += [n for n in eval_metric_names(events) if n.count("/") == 1]  # eval/{ds}: mean reward
        if names:
            hline = capacity if title.startswith("Buffer") else None
            figs.append(_figure(title, names, events, ytitle, hline, per_step))
    figs += eval_figures(events)
    return figs


def eval_figures(events: list[dict]) -> list:
    """The eval curves: rates and rewards on one panel, response lengths (tokens) on their own."""
    rates, lengths = _eval_split(eval_metric_names(events))
    return [f for f in (_figure("Eval", rates, events, "value") if rates else None,
                        _figure("Eval response length", lengths, events, "tokens") if lengths else None) if f]


def _eval_split(names: list[str]) -> tuple[list[str], list[str]]:
    lengths = [n for n in names if "/response_len/" in n]
    return [n for n in names if n not in lengths], lengths


# Written by producer jobs (miles_core.elastic.heartbeat, a layer above this one): read here as plain records.
PRODUCER_HEARTBEATS = "producers/heartbeats/"
THROUGHPUT_WINDOW_SECONDS = 60.0


def producer_histories(store: Store) -> dict[str, list[list[float]]]:
    """producer id -> its heartbeats' [[unix time, groups committed], ...]; a record that does not parse
    is left out (the report never fails on one)."""
    out = {}
    for key in store.list(PRODUCER_HEARTBEATS):
        try:
            record = store.get_json(key)
        except StorageUnavailable:
            raise
        except StorageError:  # gone since the listing, or not JSON
            continue
        if isinstance(record, dict) and isinstance(record.get("producer_id"), str):
            out[record["producer_id"]] = [p for p in record.get("history") or [] if _is_point(p)]
    return out


def _is_point(p) -> bool:
    return isinstance(p, list) and len(p) == 2 and all(isinstance(v, (int, float)) for v in p)


def groups_per_minute(history: list[list[float]]) -> tuple[list[float], list[float]]:
    """(times, groups committed per minute up to each time) over windows of THROUGHPUT_WINDOW_SECONDS
    (half the history's span when shorter): heartbeats come every few seconds, too noisy one by one."""
    if len(history) < 2 or history[-1][0] <= history[0][0]:
        return [], []
    window = min(THROUGHPUT_WINDOW_SECONDS, (history[-1][0] - history[0][0]) / 2)
    times, rates, (t0, n0) = [], [], history[0]
    for t, n in history[1:]:
        if t - t0 >= window:
            times.append(t)
            rates.append((n - n0) * 60.0 / (t - t0))
            t0, n0 = t, n
    return times, rates


def throughput_figure(histories: dict[str, list[list[float]]]):
    """Groups committed per minute by each producer job over wall-clock time; None without any point."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for producer_id, history in sorted(histories.items()):
        times, rates = groups_per_minute(history)
        if times:
            when = [datetime.datetime.fromtimestamp(t, datetime.timezone.utc) for t in times]
            fig.add_trace(go.Scatter(x=when, y=rates, mode="lines+markers", name=producer_id, marker={"size": 4}))
    if not fig.data:
        return None
    fig.update_layout(title="Generation throughput per producer job", xaxis_title="time (UTC)",
                      yaxis_title="groups committed / minute", height=360,
                      margin={"l": 50, "r": 20, "t": 50, "b": 40}, legend={"orientation": "h", "y": -0.25})
    return fig


SWIMLANE_STEPS = 5
# (lane, process, the process's lane, span names; empty = all) from the top of the picture down.
SWIMLANE_ROWS = (
    ("trainer", "driver", "step", ("batches.next_batch",)),
    ("trainer", "trainer-rank0", "train", ()),
    ("weight push", "trainer-rank0", "weights", ()),
    ("checkpoint", "trainer-rank0", "checkpoint", ()),
    ("eval", "trainer-rank0", "eval", ()),
    ("eval", "driver", "eval", ()),
)
SPAN_LABELS = {"batches.next_batch": "wait for data"}


def swimlane_spans(events: list[tuple[str, dict]], steps: int = SWIMLANE_STEPS) -> list[tuple[str, str, float, float]]:
    """(lane, phase, start s, end s) of the last `steps` traced steps, seconds from their start: one lane
    per engine (its requests merged into busy spans), the trainer's phases, weight pushes, checkpoints, evals."""
    windows = trace.step_windows(events)
    if not windows:
        return []
    last = sorted(windows)[-steps:]
    lo, hi = windows[last[0]][0], windows[last[-1]][1]
    spans = []
    for process, e in events:
        end = e["ts"] + e.get("dur", 0)
        if e["ts"] > hi or end < lo:
            continue
        row = _swimlane_row(process, e)
        if row is not None:
            spans.append((row, SPAN_LABELS.get(e["name"], e["name"]), (e["ts"] - lo) / 1e6, (end - lo) / 1e6))
    return _merge_busy(spans)


def _swimlane_row(process: str, e: dict) -> str | None:
    if e.get("ph") == "A":
        engine = (e.get("args") or {}).get("engine")
        return f"engine {engine.split('//')[-1]}" if e.get("name") == "request" and engine else None
    for lane, proc, proc_lane, names in SWIMLANE_ROWS:
        if process == proc and e.get("lane") == proc_lane and e.get("ph") == "X" and (not names or e["name"] in names):
            return lane
    return None


def _merge_busy(spans: list[tuple[str, str, float, float]]) -> list[tuple[str, str, float, float]]:
    """An engine's overlapping requests become one "generating" span per busy stretch."""
    out = [s for s in spans if not s[0].startswith("engine ")]
    by_engine: dict[str, list[tuple[float, float]]] = {}
    for lane, _, start, end in spans:
        if lane.startswith("engine "):
            by_engine.setdefault(lane, []).append((start, end))
    for lane, intervals in by_engine.items():
        intervals.sort()
        cur = list(intervals[0])
        for start, end in intervals[1:]:
            if start > cur[1]:
                out.append((lane, "generating", cur[0], cur[1]))
                cur = [start, end]
            cur[1] = max(cur[1], end)
        out.append((lane, "generating", cur[0], cur[1]))
    return out


def swimlane_steps(events: list[tuple[str, dict]], steps: int = SWIMLANE_STEPS) -> list[tuple[int, float]]:
    """(step, its start in seconds from the first's) of the last `steps` traced steps: the swimlane's
    step boundaries."""
    windows = trace.step_windows(events)
    last = sorted(windows)[-steps:]
    return [(step, (windows[step][0] - windows[last[0]][0]) / 1e6) for step in last]


# Phase colours: the first eight a hue wheel apart (red, orange, olive, green, cyan, blue, purple,
# magenta: at least 25 degrees between any two), then darker ones. The Alphabet palette put two
# purples among its first four, and neighbouring phases looked the same.
SWIMLANE_COLORS = ("#d62728", "#ff7f0e", "#bcbd22", "#2ca02c", "#17becf", "#3b3bd6", "#9467bd", "#e377c2",
                   "#8c564b", "#7f7f7f", "#000000", "#7b1e1e", "#0b5d1e", "#0b3d91", "#5b2a86", "#b35806")


def swimlane_figure(spans: list[tuple[str, str, float, float]], steps: list[tuple[int, float]] = ()):
    """Horizontal bars of `spans`, one row per lane, one legend entry per phase, a dotted line where
    each of `steps` starts; None without spans."""
    import plotly.graph_objects as go

    if not spans:
        return None
    lanes = list(dict.fromkeys(sorted((s[0] for s in spans), key=lambda lane: (not lane.startswith("engine"), lane))))
    fig = go.Figure()
    colors = SWIMLANE_COLORS
    for step, start in steps:
        fig.add_vline(x=start, line_dash="dot", line_color="#444444", line_width=1,
                      annotation_text=f"step {step}", annotation_position="top left")
    for i, phase in enumerate(dict.fromkeys(s[1] for s in spans)):
        mine = [s for s in spans if s[1] == phase]
        fig.add_trace(go.Bar(orientation="h", name=phase, y=[s[0] for s in mine], base=[s[2] for s in mine],
                             marker_color=colors[i % len(colors)],
                             x=[max(s[3] - s[2], 1e-3) for s in mine],
                             hovertemplate="%{y}: " + phase + " %{base:.3f}s + %{x:.3f}s<extra></extra>"))
    fig.update_layout(title=f"Timeline of the last {SWIMLANE_STEPS} steps", barmode="overlay",
                      xaxis_title="seconds", yaxis={"categoryorder": "array", "categoryarray": lanes[::-1]},
                      height=160 + 40 * len(lanes), margin={"l": 160, "r": 20, "t": 50, "b": 40},
                      legend={"orientation": "h", "y": -0.3})
    return fig


def eval_figure(events: list[dict]):
    """Eval curves alone (the backfill Deck): rates and rewards (lengths have their own panel in the report)."""
    return _figure("Eval", _eval_split(eval_metric_names(events))[0], events, "value")


# ----------------------------------------------------------------------------- HTML


def render_report(run, title: str | None = None) -> str:
    """The report of run root `run` (a Store or URI) as one self-contained HTML string."""
    store = _as_store(run)
    events = read_metrics(store)
    run_config = read_config(store)
    capacity = buffer_capacity(run_config)
    status = read_status(store)
    bottleneck = diagnose_bottleneck(events, capacity, staleness_limit(run_config))
    aligned = trace.aligned_events(store)
    return render_html(events, title or f"miles run {store.uri()}", capacity=capacity, bottleneck=bottleneck,
                       summary=_summary_rows(store.uri(), events, status, capacity),
                       producers=producer_histories(store), timeline=swimlane_spans(aligned),
                       timeline_steps=swimlane_steps(aligned))


def render_html(events: list[dict], title: str, *, capacity: int | None = None,
                bottleneck: Bottleneck | None = None, summary: list[tuple[str, str]] | None = None,
                producers: dict[str, list[list[float]]] | None = None,
                timeline: list[tuple[str, str, float, float]] | None = None,
                timeline_steps: list[tuple[int, float]] | None = None) -> str:
    bottleneck = bottleneck or diagnose_bottleneck(events, capacity)
    figs = report_figures(events, capacity)
    extra = (throughput_figure(producers or {}), swimlane_figure(timeline or [], timeline_steps or []))
    figs += [f for f in extra if f is not None]
    # plotly.js inline exactly once (with the first figure): the file opens offline.
    divs = [f.to_html(full_html=False, include_plotlyjs=(i == 0)) for i, f in enumerate(figs)]
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in (summary or []))
    body = "\n".join(f'<div class="panel">{d}</div>' for d in divs) or "<p>No metrics recorded yet.</p>"
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:24px;max-width:1100px}} th{{text-align:left;padding-right:16px}}
.verdict{{padding:10px;background:#f3f3f3;border-left:4px solid #636efa;margin:12px 0}}</style></head>
<body><h1>{html.escape(title)}</h1>
<table>{rows}</table>
<div class="verdict"><b>Bottleneck: {html.escape(bottleneck.verdict)}</b>. {html.escape(bottleneck.detail)}</div>
{body}
</body></html>
"""


def _summary_rows(uri: str, events: list[dict], status, capacity: int | None) -> list[tuple[str, str]]:
    rows = [("run", uri)]
    if status is not None:
        message = f": {status.message}" if status.message else ""
        rows.append(("state", f"{status.state} (segment {status.segment}, last step {status.last_step}){message}"))
    failures = _failure_rows(events)
    rows += failures
    steps, reward = series(events, N.REWARD)
    if not reward and failures:
        rows.append(("reward", "none: no sample was scored"))
    if reward:
        head = reward[:5]
        tail = reward[-max(1, len(reward) // 10):]
        rows.append(("reward", f"first 5 steps {sum(head) / len(head):.3f} -> last 10% {sum(tail) / len(tail):.3f} "
                               f"({len(steps)} steps)"))
    _, random_level = series(events, N.RANDOM_POLICY_REWARD)
    if random_level:
        rows.append(("random-policy level", f"{random_level[0]:.3f} (mean reward of uniformly random tokens)"))
    for name in sorted({e["name"] for e in events if e["name"].startswith(N.EVAL_PREFIX)
                        and e["name"].endswith("/pass@1")}):
        eval_steps, values = series(events, name)
        rows.append((f"{name} (exact match)", f"{values[-1]:.3f} at step {eval_steps[-1]}"))
    if capacity:
        rows.append(("buffer capacity", f"{capacity} groups"))
    return rows


def _failure_rows(events: list[dict]) -> list[tuple[str, str]]:
    """One row per kind of failed sample (reward, custom generate function): how many, over how many steps."""
    rows = []
    for kind, name in (("reward", N.REWARD_FAILED), ("generate", N.GENERATE_FAILED)):
        steps, counts = series(events, name)
        total = sum(counts)
        if total:
            failing = sum(1 for c in counts if c)
            rows.append((f"failed samples ({kind})", f"{total:,.0f} in {failing} of {len(steps)} steps ({name}); "
                                                     "the run's state says the first error when it stopped the run"))
    return rows


def write_report(run_uri: str, out_path: str) -> str:
    """Write the report of `run_uri` to `out_path` (a local path or a URI); returns where it went."""
    return write_text(out_path, render_report(run_uri))


def write_text(out_path: str, text: str) -> str:
    """Write `text` to `out_path` (a local path or a URI); returns where it went."""
    if "://" in out_path and not out_path.startswith("file://"):
        with fsspec.open(out_path, "w", encoding="utf-8") as f:
            f.write(text)
        return out_path
    path = os.path.abspath(out_path[len("file://"):] if out_path.startswith("file://") else out_path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path

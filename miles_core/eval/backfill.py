"""Eval backfill (docs/evaluation.md): evaluate any complete snapshots of a run, after the fact.

    backfill(run_uri, steps=None, datasets=None, sampling=None, force=False) -> rows
        everything in this process: one engine, re-pinned per snapshot.
    backfill_plan(run_uri, steps, datasets, force=False) -> [(step, name, uri)]
    plan_and_skips(...) -> (that, [(step, name or "*", why skipped)])
    evaluate_snapshot(run_uri, step, datasets, ...) -> metrics
        the pieces a Flyte map_task fans out (workflows/eval_backfill.py).
    results_table(run_uri, datasets=None) -> rows;  eval_curves_html(rows) -> HTML (plotly)
    rows_table(rows), backfill_table_uri(run_uri), backfill_text(rows, skipped, uri)   (the Flyte table)

Steps default to every complete snapshot; a (step, dataset) that already has a result is skipped
unless `force`. Datasets default to the run's --eval-prompt-data, sampling to the run's eval
settings (read from the run root's config). Results go to eval/step_{k:08d}/{ds}.json and the
metrics to metrics/eval/, at the snapshot's step, like every other eval.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Sequence

import pyarrow as pa

from miles_core.config import RunConfig
from miles_core.config.sections import EvalSection
from miles_core.config.record import read_run_config
from miles_core.eval.datasets import EvalSampling, load_eval_datasets, parse_dataset_specs, sampling_from_config
from miles_core.eval.local_engine import SnapshotEvaluator
from miles_core.eval.results import all_results, evaluated, requests, result_key
from miles_core.eval.snapshots import SnapshotLayout
from miles_core.metrics.sink import MetricsSink
from miles_core.storage import Store, normalize_uri
from miles_core.storage.run_root import read_status

log = logging.getLogger(__name__)


def run_config_of(run_uri: str):
    """The run's resolved config (latest segment) from its run root; defaults when it has none."""
    cfg = read_run_config(Store(run_uri))
    return cfg if cfg is not None else RunConfig()


def _specs(ev: EvalSection, datasets: Sequence[str] | str | None, dataset_uri: str | None = None) -> list[str]:
    if isinstance(datasets, str):
        return [f"{datasets}={dataset_uri}" if dataset_uri else datasets]
    return list(datasets) if datasets else list(ev.eval_prompt_data)


def _sampling(cfg, sampling: EvalSampling | dict | None, n_samples: int | None, temperature: float | None,
              max_response_len: int | None) -> EvalSampling:
    if isinstance(sampling, dict):
        sampling = EvalSampling.from_dict(sampling)
    s = sampling or sampling_from_config(cfg)
    over = {k: v for k, v in (("n_samples_per_prompt", n_samples), ("temperature", temperature),
                              ("max_response_len", max_response_len)) if v is not None}
    return dataclasses.replace(s, **over)


def backfill_plan(run_uri: str, steps: Sequence[int] | None = None, datasets: Sequence[str] | None = None,
                  force: bool = False) -> list[tuple[int, str, str]]:
    """(step, dataset name, dataset uri) for each complete snapshot x dataset still to evaluate."""
    return plan_and_skips(run_uri, steps, datasets, force)[0]


def plan_and_skips(run_uri: str, steps: Sequence[int] | None = None, datasets: Sequence[str] | None = None,
                   force: bool = False) -> tuple[list[tuple[int, str, str]], list[tuple[int, str, str]]]:
    """`backfill_plan`'s pairs, and what it leaves out as (step, dataset or "*", why)."""
    run_uri = normalize_uri(run_uri)
    cfg = run_config_of(run_uri)
    layout = SnapshotLayout.from_config(cfg, run_uri)
    complete = layout.complete_steps()
    chosen = complete if steps is None else sorted(set(steps) & set(complete))
    missing = [] if steps is None else sorted(set(steps) - set(complete))
    if missing:  # retired by the ring, never exported, or still being written: nothing to evaluate
        log.warning("backfill of %s: no complete snapshot for steps %s under %s; skipped", run_uri, missing,
                    layout.root_uri)
    done = evaluated(Store(run_uri))
    pairs = parse_dataset_specs(_specs(cfg.eval, datasets))
    skipped = [(step, "*", f"no complete snapshot under {layout.root_uri} (retired by the ring, never exported, "
                           "or still being written)") for step in missing]
    plan = []
    for step in chosen:
        for name, uri in pairs:
            if force or name not in done.get(step, set()):
                plan.append((step, name, uri))
            else:
                skipped.append((step, name, f"already evaluated ({result_key(step, name)}; force to redo)"))
    return plan, skipped


def evaluate_snapshot(run_uri: str, step: int, datasets: Sequence[str] | str | None = None,
                      dataset_uri: str | None = None, *, sampling: EvalSampling | dict | None = None,
                      n_samples: int | None = None, temperature: float | None = None,
                      max_response_len: int | None = None, metrics=None) -> dict[str, float]:
    """Evaluate the snapshot of `step` on `datasets` (name=uri items, or one name plus
    `dataset_uri`) on an engine started for it; returns the metrics (eval/skipped_* on failure).
    """
    run_uri = normalize_uri(run_uri)
    cfg = run_config_of(run_uri)
    ds = load_eval_datasets(cfg, _specs(cfg.eval, datasets, dataset_uri), run_uri=run_uri)
    with _sink(run_uri, metrics) as sink, SnapshotEvaluator(
            cfg, store=Store(run_uri), layout=SnapshotLayout.from_config(cfg, run_uri), datasets=ds,
            sampling=_sampling(cfg, sampling, n_samples, temperature, max_response_len), metrics=sink,
            mode="backfill") as evaluator:
        return evaluator.evaluate(step, _version_of(run_uri, step), latest_step=_latest(run_uri)).metrics


def backfill(run_uri: str, steps: Sequence[int] | None = None, datasets: Sequence[str] | None = None,
             sampling: EvalSampling | dict | None = None, force: bool = False, metrics=None) -> list[dict]:
    """Evaluate what `backfill_plan` lists, in this process; returns the table rows of the
    requested steps and datasets (new and earlier results alike)."""
    run_uri = normalize_uri(run_uri)
    cfg = run_config_of(run_uri)
    specs = _specs(cfg.eval, datasets)
    ds = {d.name: d for d in load_eval_datasets(cfg, specs, run_uri=run_uri)}
    by_step: dict[int, list[str]] = {}
    for step, name, _ in backfill_plan(run_uri, steps, specs, force):
        by_step.setdefault(step, []).append(name)
    if by_step:
        with _sink(run_uri, metrics) as sink, SnapshotEvaluator(
                cfg, store=Store(run_uri), layout=SnapshotLayout.from_config(cfg, run_uri), datasets=list(ds.values()),
                sampling=_sampling(cfg, sampling, None, None, None), metrics=sink, mode="backfill") as evaluator:
            latest = _latest(run_uri)
            for step, names in sorted(by_step.items()):
                evaluator.evaluate(step, _version_of(run_uri, step), latest_step=latest,
                                   datasets=[ds[n] for n in names])
    wanted_steps = None if steps is None else set(steps)
    return [r.to_row() for r in all_results(Store(run_uri))
            if r.dataset in ds and (wanted_steps is None or r.step in wanted_steps)]


def results_table(run_uri: str, datasets: Sequence[str] | None = None) -> list[dict]:
    """Every eval result of the run as flat rows (one per step x dataset), sorted by step."""
    keep = None if datasets is None else {n for n, _ in parse_dataset_specs(
        [d if "=" in d else f"{d}=-" for d in datasets])}
    return [r.to_row() for r in all_results(Store(normalize_uri(run_uri))) if keep is None or r.dataset in keep]


BACKFILL_PREFIX = "eval/backfill"
TABLE_SCHEMA = pa.schema([("step", pa.int64()), ("dataset", pa.string()), ("metric", pa.string()),
                          ("value", pa.float64())])


def rows_table(rows: list[dict]) -> pa.Table:
    """The backfill's rows (step, dataset, metric, value) as an Arrow table."""
    return pa.Table.from_pylist(rows, schema=TABLE_SCHEMA)


def backfill_table_uri(run_uri: str) -> str:
    """Where a backfill's table goes: `eval/backfill/{time}/` in the run root (a plain path on file://)."""
    store = Store(run_uri)
    key = f"{BACKFILL_PREFIX}/{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{time.time_ns() % 10**6:06d}"
    return store.local_path(key) or store.uri(key)


def backfill_text(rows: list[dict], skipped: Sequence[str], uri: str) -> str:
    """The table as aligned text (one line per step x dataset x metric), then what was skipped."""
    lines = [f"eval backfill: {len(rows)} rows -> {uri}"]
    if rows:
        width = max(len(r["metric"]) for r in rows)
        lines += [f"  {'step':>6}  {'dataset':<12} {'metric':<{width}}  value"]
        lines += [f"  {r['step']:>6}  {r['dataset']:<12} {r['metric']:<{width}}  {r['value']:.4f}"
                  for r in sorted(rows, key=lambda r: (r["step"], r["dataset"], r["metric"]))]
    lines += [f"skipped {len(skipped)}:"] + [f"  {line}" for line in skipped] if skipped else ["skipped: none"]
    return "\n".join(lines)


def eval_curves_html(rows: list[dict], metric: str = "mean_reward") -> str:
    """A plotly figure (HTML fragment with inline JS) of `metric` by step, one line per dataset."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for name in sorted({r["dataset"] for r in rows}):
        pts = sorted((r["step"], r[metric]) for r in rows if r["dataset"] == name and metric in r)
        fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers", name=name))
    fig.update_layout(title=f"eval {metric} by step", xaxis_title="step", yaxis_title=metric)
    return fig.to_html(full_html=False, include_plotlyjs=True)


def _version_of(run_uri: str, step: int) -> int | None:
    return (requests(Store(run_uri)).get(step) or {}).get("weight_version")


def _latest(run_uri: str) -> int | None:
    status = read_status(Store(run_uri))
    return status.last_step if status is not None else None


class _sink:
    """The caller's metrics sink, or a MetricsSink(run root, "eval") opened and closed here."""

    def __init__(self, run_uri: str, metrics):
        self.run_uri, self.given, self.own = run_uri, metrics, None

    def __enter__(self):
        if self.given is not None:
            return self.given

        self.own = MetricsSink(Store(self.run_uri), "eval", background=False)
        return self.own

    def __exit__(self, *exc):
        if self.own is not None:
            self.own.close()

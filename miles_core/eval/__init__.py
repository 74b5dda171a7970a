"""Evaluation (docs/evaluation.md): three modes over one evaluation core, snapshots, follower, backfill.

For the training driver:
    build_eval_scheduler(cfg, exporter=..., metrics=...) -> EvalScheduler   on_step / retire / close
    start_dedicated_engines(cfg, model_path) -> EngineFleet                 Mode 2's engines
For the Flyte tasks:
    follow_snapshots(cfg) -> summary                                        the eval_follower body
    backfill_plan / evaluate_snapshot / backfill / results_table / eval_curves_html
The core, shared by every mode:
    evaluate(engine_client, dataset, sampling) -> DatasetEval               (miles_core.eval.evaluate)
The eval metric names and skip reasons are in miles_core.metrics.names (`EVAL_METRICS`, `SKIP_REASONS`).
"""

from miles_core.eval.backfill import (backfill, backfill_plan, eval_curves_html, evaluate_snapshot,
                                      results_table)
from miles_core.eval.datasets import EvalDataset, EvalRow, EvalSampling, load_eval_datasets, sampling_from_config
from miles_core.eval.evaluate import DatasetEval, aggregate, evaluate, evaluate_all
from miles_core.eval.follower import follow_snapshots
from miles_core.eval.pass_at_k import pass_at_k, pass_ks
from miles_core.eval.scheduler import EvalScheduler, NoEvals, build_eval_scheduler, start_dedicated_engines
from miles_core.eval.snapshots import SnapshotLayout, retire_snapshots

__all__ = [
    "DatasetEval", "EvalDataset", "EvalRow", "EvalSampling", "EvalScheduler", "NoEvals", "SnapshotLayout", "aggregate", "backfill", "backfill_plan",
    "build_eval_scheduler", "eval_curves_html", "evaluate", "evaluate_all", "evaluate_snapshot",
    "follow_snapshots", "load_eval_datasets", "pass_at_k", "pass_ks", "results_table", "retire_snapshots",
    "sampling_from_config", "start_dedicated_engines",
]

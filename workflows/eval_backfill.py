"""eval_backfill: evaluate any set of past snapshots of a run on any datasets (docs/evaluation.md).

    pyflyte run workflows/eval_backfill.py eval_backfill --run_uri s3://bucket/miles/runs/r1 \\
        --steps '[100, 200]' --datasets '["heldout=builtin:reverse4-heldout"]'

Fans out over (snapshot, dataset) pairs with map_task, writes eval/step_{k}/{dataset}.json in
the run root, and returns one table (StructuredDataset, saved under eval/backfill/{time}/ in
the run root) plus a Deck with the eval curves; the table and the steps it skipped (and why) are
printed, so a local `pyflyte run` shows them.
`eval_backfill_default` is the LaunchPlan to start from the UI.
"""

from __future__ import annotations

from typing import List, Optional

from flytekit import LaunchPlan, StructuredDataset, workflow

from tasks.eval import backfill_table, evaluate_jobs, plan_backfill

DEFAULT_RUN_URI = ".miles/runs/default"  # the embedded default's run root (relative to the working directory)
EVAL_CONCURRENCY = 4


@workflow
def eval_backfill(run_uri: str = DEFAULT_RUN_URI, steps: Optional[List[int]] = None,
                  datasets: Optional[List[str]] = None, n_samples: int = 1, temperature: float = 0.0,
                  max_response_len: int = 0) -> StructuredDataset:
    """Evaluate snapshots of a run; returns one row per (step, dataset, metric).

    :param run_uri: the run root ({storage_root}/runs/{run_id})
    :param steps: snapshot steps to evaluate (default: every complete snapshot without results)
    :param datasets: eval datasets as name=uri (default: the run's --eval-prompt-data)
    :param n_samples: samples per eval prompt (pass@k up to this)
    :param temperature: sampling temperature (0: greedy)
    :param max_response_len: maximum new tokens (0: the run's setting)
    """
    jobs, skipped = plan_backfill(run_uri=run_uri, steps=steps, datasets=datasets, n_samples=n_samples,
                                  temperature=temperature, max_response_len=max_response_len)
    points = evaluate_jobs(run_uri=run_uri, jobs=jobs, concurrency=EVAL_CONCURRENCY)
    return backfill_table(run_uri=run_uri, points=points, skipped=skipped)


eval_backfill_default = LaunchPlan.get_or_create(
    workflow=eval_backfill,
    name="eval_backfill_default",
    default_inputs={"run_uri": DEFAULT_RUN_URI, "n_samples": 1, "temperature": 0.0, "max_response_len": 0},
)

"""rollout_producer: add generation capacity to a running run from anywhere that reaches its run root.

    pyflyte run workflows/rollout_producer.py rollout_producer --run_uri file://$PWD/.miles/runs/default
    pyflyte run --remote workflows/rollout_producer.py rollout_producer \\
        --run_uri s3://bucket/miles/runs/qwen-math --engines 4

The run must allow producers (`--allow-rollout-producers`). The producer brings up its own Ray
cluster with engines, joins the run through the run root alone, and stops by itself when the run
finishes or fails; killing it at any moment loses only its in-flight groups. `rollout_producer_lp`
is the LaunchPlan to start one from the Flyte UI (docs/elastic.md).
"""

from __future__ import annotations

from flytekit import LaunchPlan, workflow

from tasks.producer import rollout_producer as producer_task


@workflow
def rollout_producer(run_uri: str, engines: int = 1, producer_id: str = "") -> int:
    """A producer job for a running run; returns the groups it committed.

    :param run_uri: the run root of a run started with --allow-rollout-producers, e.g. s3://bucket/miles/runs/qwen
    :param engines: engines this producer runs on its own Ray cluster
    :param producer_id: its name in `miles runs show` and the report ("": a random p-xxxxxxxx)
    """
    return producer_task(run_uri=run_uri, engines=engines, producer_id=producer_id)


rollout_producer_lp = LaunchPlan.get_or_create(workflow=rollout_producer, name="rollout_producer_lp")

"""plan: the first lines of a run: what it will do, where its run root and report go, about how long;
or, for a run that already finished, that it did and how to train it further (miles_core.driver.plan).

The workflow calls it first and nothing waits for it: locally it runs (and prints) before any other
task, on a cluster beside the first ones. Its text is also its output, shown in the Flyte console.
"""

from __future__ import annotations

import sys

from flytekit import Resources, task

from images import task_image
from miles_core.driver.plan import describe_plan
from tasks.cluster import TRAIN_CLUSTER
from tasks.failures import one_line_on_the_command_line
from tasks.inputs import run_config
from tasks.secrets import ENGINE_SECRETS


@task(container_image=task_image("cpu"), requests=Resources(cpu="1", mem="1Gi"), secret_requests=ENGINE_SECRETS)
def plan(flags: str, run_id: str, storage_root: str, segment_steps: int) -> str:
    """What this execution of the run will do (printed, and returned)."""
    with one_line_on_the_command_line():  # the first task: a bad command line is said here, in one line
        cfg = run_config(flags, run_id, storage_root, segment_steps, cluster=TRAIN_CLUSTER)
    inputs = {"run_id": run_id, "storage_root": storage_root, "segment_steps": segment_steps or ""}
    text = describe_plan(cfg, flags, inputs)
    print(text, file=sys.stderr, flush=True)
    return text

"""rollout_producer: the Ray task of a producer job that feeds a running run (docs/elastic.md).

Its cluster (tasks/cluster.py PRODUCER_CLUSTER, MILES_PRODUCER_* variables) holds engines only; it
shares nothing with the trainer's cluster but the run root. Locally the Ray plugin starts a local Ray
instance of its own. A lost node or storage outage is recoverable (the task's retries start a new
producer: what the old one committed stays in the buffer); a run that does not allow producers is not.
"""

from __future__ import annotations

from flytekit import Resources, task

from images import task_image
from tasks.cluster import PRODUCER_CLUSTER
from tasks.failures import recoverable_infrastructure
from tasks.secrets import ENGINE_SECRETS


@task(task_config=PRODUCER_CLUSTER, container_image=task_image("gpu"), retries=3,
      requests=Resources(cpu="2", mem="8Gi"), secret_requests=ENGINE_SECRETS)
def rollout_producer(run_uri: str, engines: int, producer_id: str) -> int:
    """Generate for the run at `run_uri` with `engines` engines until the run finishes or fails;
    returns the groups this producer committed."""
    from miles_core.elastic.job import run_producer  # engines and Ray: import on use

    with recoverable_infrastructure():
        result = run_producer(run_uri, num_engines=engines, producer_id=producer_id)
    print(f"[miles] producer {result.producer_id} stopped ({result.stop_reason}): {result.groups_committed} groups "
          f"committed to {result.run_uri} in {result.seconds:.0f} s")
    return result.groups_committed

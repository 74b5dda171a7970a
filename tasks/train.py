"""train: the Ray task that runs one training segment (docs/deployment.md).

The cluster shape lives in tasks/cluster.py (read once, at registration, from MILES_RAY_* variables;
see docs/deployment.md). Locally the plugin starts a local Ray instance itself (`ray.init`):
the driver never calls it again.
"""

from __future__ import annotations

from flytekit import FlyteContextManager, Resources, task

from images import task_image
from miles_core.storage import Store
from miles_core.storage.run_root import read_status
from tasks.cluster import RAY_CLUSTER, TRAIN_CLUSTER
from tasks.failures import one_line_on_the_command_line, recoverable_infrastructure
from tasks.inputs import run_config
from tasks.secrets import TRAIN_SECRETS
from tasks.types import TrainOutcome


@task(task_config=RAY_CLUSTER, container_image=task_image("gpu"), retries=2,
      requests=Resources(cpu="4", mem="16Gi"), secret_requests=TRAIN_SECRETS)
def train(flags: str, run_id: str, storage_root: str, segment_steps: int) -> TrainOutcome:
    """Train one segment of the run: build engines, producer, buffer and trainer on Ray, run the
    driver until --num-rollout (or segment_steps / --deadline-seconds), checkpoint, exit.

    Resumes from the run's latest complete checkpoint when there is one, so a retry after a lost
    node, or the next scheduled segment, continues the same lineage. Infrastructure failures are
    recoverable (tasks.failures), so `retries` fire; on a finished run it returns at once.
    """
    with one_line_on_the_command_line():
        cfg = run_config(flags, run_id, storage_root, segment_steps, cluster=TRAIN_CLUSTER)  # bad flags fail here
    from miles_core.driver.segment import run_training  # pulls in torch and megatron: import on use

    with one_line_on_the_command_line(), recoverable_infrastructure():
        run_training(cfg, eval_follower_after=_local())
        status = read_status(Store(cfg.run_uri))
    if status is None:
        return TrainOutcome(cfg.run_uri, "unknown", -1, 0)
    return TrainOutcome(cfg.run_uri, status.state, status.last_step, status.segment)


def _local() -> bool:
    """A local execution (`pyflyte run` without --remote) runs eval_follower after train, not beside it."""
    state = FlyteContextManager.current_context().execution_state
    return state is None or state.is_local_execution()

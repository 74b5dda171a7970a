"""train: the Ray task that runs one training segment (DESIGN §8.1, §8.3).

The cluster shape lives in RayJobConfig (read once, at registration, from MILES_RAY_* variables;
see docs/deployment.md). Locally the plugin starts a local Ray instance itself (`ray.init`):
the driver never calls it again.
"""

from __future__ import annotations

import os

from flytekit import Resources, task
from flytekitplugins.ray import HeadNodeConfig, RayJobConfig, WorkerNodeConfig

from images import task_image
from miles_core.storage import Store
from miles_core.storage.run_root import read_status
from tasks.failures import recoverable_infrastructure
from tasks.inputs import run_config
from tasks.secrets import TRAIN_SECRETS
from tasks.types import TrainOutcome

GPU_WORKERS = int(os.environ.get("MILES_RAY_GPU_WORKERS", "1"))
GPUS_PER_WORKER = int(os.environ.get("MILES_RAY_GPUS_PER_WORKER", "8"))

RAY_CLUSTER = RayJobConfig(
    head_node_config=HeadNodeConfig(
        ray_start_params={"num-gpus": "0", "log-color": "false"},
        requests=Resources(cpu="4", mem="16Gi"),
    ),
    worker_node_config=[
        WorkerNodeConfig(
            group_name="gpu",
            replicas=GPU_WORKERS,
            requests=Resources(cpu=str(8 * GPUS_PER_WORKER), mem=f"{64 * GPUS_PER_WORKER}Gi", gpu=str(GPUS_PER_WORKER)),
            limits=Resources(gpu=str(GPUS_PER_WORKER)),
        )
    ],
    shutdown_after_job_finishes=True,
    ttl_seconds_after_finished=600,
)


@task(task_config=RAY_CLUSTER, container_image=task_image("gpu"), retries=2,
      requests=Resources(cpu="4", mem="16Gi"), secret_requests=TRAIN_SECRETS)
def train(flags: str, run_id: str, storage_root: str, segment_steps: int) -> TrainOutcome:
    """Train one segment of the run: build engines, producer, buffer and trainer on Ray, run the
    driver until --num-rollout (or segment_steps / --deadline-seconds), checkpoint, exit.

    Resumes from the run's latest complete checkpoint when there is one, so a retry after a lost
    node, or the next scheduled segment, continues the same lineage. Infrastructure failures are
    recoverable (tasks.failures), so `retries` fire; on a finished run it returns at once.
    """
    cfg = run_config(flags, run_id, storage_root, segment_steps)  # bad flags fail here, before any import
    from miles_core.driver.segment import run_training  # pulls in torch and megatron: import on use

    with recoverable_infrastructure():
        run_training(cfg)
        status = read_status(Store(cfg.run_uri))
    if status is None:
        return TrainOutcome(cfg.run_uri, "unknown", -1, 0)
    return TrainOutcome(cfg.run_uri, status.state, status.last_step, status.segment)

"""The Ray cluster of the `train` task, and its shape for validation.

The shape is read once, at registration, from MILES_RAY_* variables (docs/deployment.md):
    MILES_RAY_GPU_WORKERS       GPU worker pods (default 1)
    MILES_RAY_GPUS_PER_WORKER   GPUs per worker pod (default 8)
`TRAIN_CLUSTER` describes the same cluster to `miles_core.prepare.checks.validate`, so the first task
of a remote execution refuses a run whose engines, trainer ranks and eval engines cannot be placed on
it, before the Ray cluster is even requested.

Both clusters are `RayJob` configs: Flyte's Ray plugin, except that a local execution (`pyflyte run`
without --remote, RAY_ADDRESS unset) starts its Ray instance without the dashboard, as the driver's own
local instance does (miles_core.driver.placement.ensure_ray): nothing reads it, and it costs a few CPU
seconds per run. Both start it with `miles_core.driver.local_ray.start_local_ray`, which tries again when
Ray's node takes longer than its fixed 30 s to register on a loaded machine.
"""

from __future__ import annotations

import logging
import os

from flytekit import FlyteContextManager, Resources
from flytekit.core.task import TaskPlugins
from flytekitplugins.ray import HeadNodeConfig, RayJobConfig, WorkerNodeConfig
from flytekitplugins.ray.task import RayFunctionTask

from miles_core.driver.local_ray import start_local_ray
from miles_core.prepare.resources import ClusterShape, Node

GPU_WORKERS = int(os.environ.get("MILES_RAY_GPU_WORKERS", "1"))
GPUS_PER_WORKER = int(os.environ.get("MILES_RAY_GPUS_PER_WORKER", "8"))
HEAD_CPUS = 4
CPUS_PER_GPU = 8

class RayJob(RayJobConfig):
    """A RayJobConfig whose tasks start a local Ray instance without the dashboard (module doc)."""


class RayJobTask(RayFunctionTask):
    """Flyte's Ray task (same type, same cluster spec when registered) for `RayJob` configs."""

    def pre_execute(self, user_params):
        import ray

        if _new_local_ray(self.task_config):
            start_local_ray(include_dashboard=False, logging_level=logging.WARNING)
        if ray.is_initialized():  # started here, or by the caller: the plugin's ray.init would only log
            return user_params   # "Calling ray.init() again after it has already been called"
        return super().pre_execute(user_params)


def _new_local_ray(config: RayJobConfig) -> bool:
    """A local execution that starts its own Ray instance (the plugin's ray.init would start one)."""
    import ray

    state = FlyteContextManager.current_context().execution_state
    local = state is not None and state.is_local_execution()
    return local and not config.address and not os.environ.get("RAY_ADDRESS") and not ray.is_initialized()


TaskPlugins.register_pythontask_plugin(RayJob, RayJobTask)

RAY_CLUSTER = RayJob(
    head_node_config=HeadNodeConfig(
        ray_start_params={"num-gpus": "0", "log-color": "false"},
        requests=Resources(cpu=str(HEAD_CPUS), mem="16Gi"),
    ),
    worker_node_config=[
        WorkerNodeConfig(
            group_name="gpu",
            replicas=GPU_WORKERS,
            requests=Resources(cpu=str(CPUS_PER_GPU * GPUS_PER_WORKER), mem=f"{64 * GPUS_PER_WORKER}Gi",
                               gpu=str(GPUS_PER_WORKER)),
            limits=Resources(gpu=str(GPUS_PER_WORKER)),
        )
    ],
    shutdown_after_job_finishes=True,
    ttl_seconds_after_finished=600,
)


def train_cluster(gpu_workers: int, gpus_per_worker: int) -> ClusterShape:
    """The shape of RAY_CLUSTER registered with these MILES_RAY_* values. Ray counts a pod's CPU request
    as its CPUs, and the head starts with num-gpus 0."""
    workers = (Node(f"gpu worker {i}", CPUS_PER_GPU * gpus_per_worker, gpus_per_worker) for i in range(gpu_workers))
    return ClusterShape((Node("head", HEAD_CPUS, 0), *workers),
                        f"the train task's Ray cluster ({gpu_workers} x {gpus_per_worker}-GPU worker; "
                        "MILES_RAY_GPU_WORKERS, MILES_RAY_GPUS_PER_WORKER)")


TRAIN_CLUSTER = train_cluster(GPU_WORKERS, GPUS_PER_WORKER)


# A producer job's own Ray cluster (workflows/rollout_producer.py): engines only, e.g. on a preemptible
# GPU node pool in another zone; MILES_PRODUCER_* variables, read at registration like the above.
PRODUCER_GPU_WORKERS = int(os.environ.get("MILES_PRODUCER_GPU_WORKERS", "1"))
PRODUCER_GPUS_PER_WORKER = int(os.environ.get("MILES_PRODUCER_GPUS_PER_WORKER", "1"))

PRODUCER_CLUSTER = RayJob(
    head_node_config=HeadNodeConfig(
        ray_start_params={"num-gpus": "0", "log-color": "false"},
        requests=Resources(cpu="2", mem="8Gi"),
    ),
    worker_node_config=[
        WorkerNodeConfig(
            group_name="rollout",
            replicas=PRODUCER_GPU_WORKERS,
            requests=Resources(cpu=str(CPUS_PER_GPU * PRODUCER_GPUS_PER_WORKER),
                               mem=f"{64 * PRODUCER_GPUS_PER_WORKER}Gi", gpu=str(PRODUCER_GPUS_PER_WORKER)),
            limits=Resources(gpu=str(PRODUCER_GPUS_PER_WORKER)),
        )
    ],
    shutdown_after_job_finishes=True,
    ttl_seconds_after_finished=600,
)

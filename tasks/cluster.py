"""The Ray cluster of the `train` task, and its shape for validation.

The shape is read once, at registration, from MILES_RAY_* variables (docs/deployment.md):
    MILES_RAY_GPU_WORKERS       GPU worker pods (default 1)
    MILES_RAY_GPUS_PER_WORKER   GPUs per worker pod (default 8)
    MILES_NODE_DISK, MILES_NODE_DISK_SIZE   the pods' node-local volume (tasks/node_disk.py)
`TRAIN_CLUSTER` describes the same cluster to `miles_core.prepare.checks.validate`, so the first task
of a remote execution refuses a run whose engines, trainer ranks and eval engines cannot be placed on
it, before the Ray cluster is even requested.

Every pod of both clusters is a pod template (tasks/node_disk.py `pod_template`) carrying its resources
and the node-local volume mounted at the node cache and the temp directory: flytekitplugins-ray builds
a pod from requests/limits when those are set and drops a template then, so none are set beside it.

Both clusters are `RayJob` configs: Flyte's Ray plugin, except that a local execution (`pyflyte run`
without --remote, RAY_ADDRESS unset) starts its Ray instance without the dashboard, as the driver's own
local instance does (miles_core.driver.placement.ensure_ray): nothing reads it, and it costs a few CPU
seconds per run. Both start it with `miles_core.driver.local_ray.start_local_ray`, which tries again when
Ray's node takes longer than its fixed 30 s to register on a loaded machine.
"""

from __future__ import annotations

import logging
import os

from flytekit import FlyteContextManager
from flytekit.core.task import TaskPlugins
from flytekitplugins.ray import HeadNodeConfig, RayJobConfig, WorkerNodeConfig
from flytekitplugins.ray.task import RayFunctionTask

from miles_core.driver.local_ray import start_local_ray
from miles_core.prepare.resources import ClusterShape, Node
from tasks.node_disk import NODE_DISK, NodeDiskSpec, pod_template

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

def ray_cluster(gpu_workers: int, gpus_per_worker: int, disk: NodeDiskSpec = NODE_DISK) -> RayJob:
    """The train task's RayJob: a head (4 CPUs, 16 GiB, no GPU) and `gpu_workers` workers of
    `gpus_per_worker` GPUs (8 CPUs and 64 GiB per GPU), every pod with the node-local volume `disk`."""
    gpu = {"nvidia.com/gpu": str(gpus_per_worker)}
    return RayJob(
        head_node_config=HeadNodeConfig(
            ray_start_params={"num-gpus": "0", "log-color": "false"},
            pod_template=pod_template("ray-head", {"cpu": str(HEAD_CPUS), "memory": "16Gi"}, disk=disk, head=True),
        ),
        worker_node_config=[
            WorkerNodeConfig(
                group_name="gpu",
                replicas=gpu_workers,
                pod_template=pod_template("ray-worker", {"cpu": str(CPUS_PER_GPU * gpus_per_worker),
                                                         "memory": f"{64 * gpus_per_worker}Gi", **gpu}, gpu, disk),
            )
        ],
        shutdown_after_job_finishes=True,
        ttl_seconds_after_finished=600,
    )


RAY_CLUSTER = ray_cluster(GPU_WORKERS, GPUS_PER_WORKER, NODE_DISK)


def train_cluster(gpu_workers: int, gpus_per_worker: int, disk: NodeDiskSpec | None = None) -> ClusterShape:
    """The shape of RAY_CLUSTER registered with these MILES_RAY_* values. Ray counts a pod's CPU request
    as its CPUs, and the head starts with num-gpus 0. With `disk`, what each pod's node-local volume
    holds (validation compares the run's bytes per node with it)."""
    workers = (Node(f"gpu worker {i}", CPUS_PER_GPU * gpus_per_worker, gpus_per_worker) for i in range(gpu_workers))
    return ClusterShape((Node("head", HEAD_CPUS, 0), *workers),
                        f"the train task's Ray cluster ({gpu_workers} x {gpus_per_worker}-GPU worker; "
                        "MILES_RAY_GPU_WORKERS, MILES_RAY_GPUS_PER_WORKER)", disk.shape() if disk else None)


TRAIN_CLUSTER = train_cluster(GPU_WORKERS, GPUS_PER_WORKER, NODE_DISK)


# A producer job's own Ray cluster (workflows/rollout_producer.py): engines only, e.g. on a preemptible
# GPU node pool in another zone; MILES_PRODUCER_* variables, read at registration like the above:
#   MILES_PRODUCER_GPU_WORKERS       GPU worker pods (default 1)
#   MILES_PRODUCER_GPUS_PER_WORKER   GPUs per worker pod (default 1)
#   MILES_PRODUCER_NODE_SELECTOR     the workers' node selector: key=value[,key=value] (a spot pool's label)
#   MILES_PRODUCER_TOLERATIONS       their tolerations: key[=value]:Effect[,...] (the pool's taint)
PRODUCER_GPU_WORKERS = int(os.environ.get("MILES_PRODUCER_GPU_WORKERS", "1"))
PRODUCER_GPUS_PER_WORKER = int(os.environ.get("MILES_PRODUCER_GPUS_PER_WORKER", "1"))


def producer_cluster(workers: int, gpus_per_worker: int, node_selector: str = "", tolerations: str = "",
                     disk: NodeDiskSpec = NODE_DISK) -> RayJob:
    """The producer's RayJob. Its workers' pod template carries the resources, the node-local volume
    `disk` and, when given, a node selector and tolerations (a spot pool's)."""
    gpu = {"nvidia.com/gpu": str(gpus_per_worker)}
    requests = {"cpu": str(CPUS_PER_GPU * gpus_per_worker), "memory": f"{64 * gpus_per_worker}Gi", **gpu}
    rollout = WorkerNodeConfig(group_name="rollout", replicas=workers, pod_template=pod_template(
        "ray-worker", requests, gpu, disk, node_selector=_pairs(node_selector, "MILES_PRODUCER_NODE_SELECTOR"),
        tolerations=_tolerations(tolerations)))
    return RayJob(
        head_node_config=HeadNodeConfig(
            ray_start_params={"num-gpus": "0", "log-color": "false"},
            pod_template=pod_template("ray-head", {"cpu": "2", "memory": "8Gi"}, disk=disk, head=True),
        ),
        worker_node_config=[rollout],
        shutdown_after_job_finishes=True,
        ttl_seconds_after_finished=600,
    )


def _pairs(text: str, name: str) -> dict[str, str]:
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, sep, value = item.partition("=")
        if not (sep and key):
            raise ValueError(f"{name}: {item!r} is not key=value")
        out[key] = value
    return out


def _tolerations(text: str) -> list:
    from kubernetes.client import V1Toleration

    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        match, sep, effect = item.rpartition(":")
        if not (sep and match and effect in ("NoSchedule", "PreferNoSchedule", "NoExecute")):
            raise ValueError(f"MILES_PRODUCER_TOLERATIONS: {item!r} is not key[=value]:Effect "
                             "(Effect: NoSchedule, PreferNoSchedule or NoExecute)")
        key, eq, value = match.partition("=")
        out.append(V1Toleration(key=key, operator="Equal" if eq else "Exists", value=value if eq else None,
                                effect=effect))
    return out


PRODUCER_CLUSTER = producer_cluster(PRODUCER_GPU_WORKERS, PRODUCER_GPUS_PER_WORKER,
                                    os.environ.get("MILES_PRODUCER_NODE_SELECTOR", ""),
                                    os.environ.get("MILES_PRODUCER_TOLERATIONS", ""))

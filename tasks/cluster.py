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
# GPU node pool in another zone; MILES_PRODUCER_* variables, read at registration like the above:
#   MILES_PRODUCER_GPU_WORKERS       GPU worker pods (default 1)
#   MILES_PRODUCER_GPUS_PER_WORKER   GPUs per worker pod (default 1)
#   MILES_PRODUCER_NODE_SELECTOR     the workers' node selector: key=value[,key=value] (a spot pool's label)
#   MILES_PRODUCER_TOLERATIONS       their tolerations: key[=value]:Effect[,...] (the pool's taint)
PRODUCER_GPU_WORKERS = int(os.environ.get("MILES_PRODUCER_GPU_WORKERS", "1"))
PRODUCER_GPUS_PER_WORKER = int(os.environ.get("MILES_PRODUCER_GPUS_PER_WORKER", "1"))


def producer_cluster(workers: int, gpus_per_worker: int, node_selector: str = "", tolerations: str = "") -> RayJob:
    """The producer's RayJob. With a node selector or tolerations the workers get a pod template that
    carries them and the resources (flytekitplugins-ray builds the pod from requests/limits when those
    are set and drops a template then; so the resources go into the template's ray-worker container)."""
    cpus, mem = str(CPUS_PER_GPU * gpus_per_worker), f"{64 * gpus_per_worker}Gi"
    if node_selector or tolerations:
        rollout = WorkerNodeConfig(group_name="rollout", replicas=workers, pod_template=_worker_pod_template(
            cpus, mem, gpus_per_worker, _pairs(node_selector, "MILES_PRODUCER_NODE_SELECTOR"),
            _tolerations(tolerations)))
    else:
        rollout = WorkerNodeConfig(group_name="rollout", replicas=workers,
                                   requests=Resources(cpu=cpus, mem=mem, gpu=str(gpus_per_worker)),
                                   limits=Resources(gpu=str(gpus_per_worker)))
    return RayJob(
        head_node_config=HeadNodeConfig(
            ray_start_params={"num-gpus": "0", "log-color": "false"},
            requests=Resources(cpu="2", mem="8Gi"),
        ),
        worker_node_config=[rollout],
        shutdown_after_job_finishes=True,
        ttl_seconds_after_finished=600,
    )


def _worker_pod_template(cpus: str, mem: str, gpus: int, node_selector: dict[str, str], tolerations: list):
    from flytekit import PodTemplate
    from kubernetes.client import V1Container, V1PodSpec, V1ResourceRequirements

    gpu = {"nvidia.com/gpu": str(gpus)}
    return PodTemplate(primary_container_name="ray-worker", pod_spec=V1PodSpec(
        containers=[V1Container(name="ray-worker", resources=V1ResourceRequirements(
            requests={"cpu": cpus, "memory": mem, **gpu}, limits=gpu))],
        node_selector=node_selector or None, tolerations=tolerations or None))


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

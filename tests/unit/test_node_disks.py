"""Node-local storage of the pods that write to disk (tasks/node_disk.py): the train task's Ray pods,
the producer's and the GPU eval tasks, as Flyte serializes them (flytekitplugins-ray's `get_custom`,
flytekit's `get_k8s_pod`: what Kubernetes receives).

Pins: every such pod mounts one node-local volume (emptyDir by default, a hostPath with
MILES_NODE_DISK=/path) at the node cache (MILES_CACHE_DIR) and the temp directory (TMPDIR), an
emptyDir of MILES_NODE_DISK_SIZE is requested as ephemeral storage (so the scheduler places the pod
on a node with that much), and the workers keep their CPU, memory and GPU resources. Guards: the
node cache, push temp files and checkpoint staging in the container's writable layer, where the
pod is evicted for disk; a pod template the Ray plugin drops because requests/limits were set.
"""

from __future__ import annotations

import pytest
from flytekit import task
from flytekit.configuration import Image, ImageConfig, SerializationSettings

from miles_core.config import parse_flags
from tasks.cluster import RAY_CLUSTER, producer_cluster, ray_cluster, train_cluster
from tasks.eval import eval_follower, eval_resources, eval_snapshot
from tasks.node_disk import CACHE_DIR, TEMP_DIR, node_disk

SETTINGS = SerializationSettings(image_config=ImageConfig(default_image=Image(name="d", fqn="img", tag="t")))


def _ray_pods(cluster) -> dict[str, dict]:
    @task(task_config=cluster)
    def job() -> None:  # pragma: no cover - only serialized
        pass

    custom = job.get_custom(SETTINGS)["rayCluster"]
    pods = {"head": custom["headGroupSpec"]["k8sPod"]["podSpec"]}
    for group in custom["workerGroupSpec"]:
        pods[group["groupName"]] = group["k8sPod"]["podSpec"]
    return pods


def _container(pod: dict, name: str) -> dict:
    (c,) = [c for c in pod["containers"] if c["name"] == name]
    return c


def _mounts(pod: dict, container: str) -> dict[str, dict]:
    """mount path -> the volume behind it, with the mount's subPath / subPathExpr."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    return {m["mountPath"]: {**volumes[m["name"]], **{k: m[k] for k in ("subPath", "subPathExpr") if k in m}}
            for m in _container(pod, container).get("volumeMounts", [])}


def _env(pod: dict, container: str) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in _container(pod, container).get("env", [])}


def _assert_node_local(pod: dict, container: str, volume_kind: str) -> None:
    mounts = _mounts(pod, container)
    assert set(mounts) >= {CACHE_DIR, TEMP_DIR}, f"{container}: nothing node-local mounted at the cache and temp dirs"
    assert all(volume_kind in mounts[p] for p in (CACHE_DIR, TEMP_DIR)), mounts
    env = _env(pod, container)
    assert env["MILES_CACHE_DIR"] == CACHE_DIR and env["TMPDIR"] == TEMP_DIR


def test_the_train_tasks_gpu_workers_mount_an_empty_dir_of_the_registered_size_and_keep_their_resources():
    pods = _ray_pods(RAY_CLUSTER)
    _assert_node_local(pods["gpu"], "ray-worker", "emptyDir")
    volume = _mounts(pods["gpu"], "ray-worker")[CACHE_DIR]
    assert volume["emptyDir"] == {"sizeLimit": "200Gi"}
    requests = _container(pods["gpu"], "ray-worker")["resources"]["requests"]
    assert requests == {"cpu": "64", "memory": "512Gi", "nvidia.com/gpu": "8", "ephemeral-storage": "200Gi"}
    assert _container(pods["gpu"], "ray-worker")["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    _assert_node_local(pods["head"], "ray-head", "emptyDir")  # the driver's temp files (metrics mirrors, Ray)
    assert _container(pods["head"], "ray-head")["resources"]["requests"] == {"cpu": "4", "memory": "16Gi"}


def test_a_host_path_disk_is_mounted_with_a_temp_dir_per_pod_and_no_ephemeral_request():
    pods = _ray_pods(ray_cluster(2, 8, node_disk("/mnt/local-ssd", "800Gi")))
    _assert_node_local(pods["gpu"], "ray-worker", "hostPath")
    mounts = _mounts(pods["gpu"], "ray-worker")
    assert mounts[CACHE_DIR]["hostPath"]["path"] == "/mnt/local-ssd" and mounts[CACHE_DIR]["subPath"] == "cache"
    assert mounts[TEMP_DIR]["subPathExpr"] == "tmp/$(MILES_POD_NAME)"  # pods on one node never share a temp dir
    (pod_name,) = [e for e in _container(pods["gpu"], "ray-worker")["env"] if e["name"] == "MILES_POD_NAME"]
    assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert "ephemeral-storage" not in _container(pods["gpu"], "ray-worker")["resources"]["requests"]
    assert _env(pods["gpu"], "ray-worker")["MILES_NODE_DISK_SIZE"] == "800Gi"  # what a run checks at its start


def test_producer_workers_mount_it_with_and_without_a_spot_pool():
    for selector in ("", "cloud.google.com/gke-spot=true"):
        pods = _ray_pods(producer_cluster(1, 2, selector))
        _assert_node_local(pods["rollout"], "ray-worker", "emptyDir")
        assert _container(pods["rollout"], "ray-worker")["resources"]["requests"]["nvidia.com/gpu"] == "2"
        assert _container(pods["rollout"], "ray-worker")["resources"]["requests"]["ephemeral-storage"] == "200Gi"


def test_gpu_eval_tasks_mount_it_and_their_sized_overrides_keep_the_ephemeral_request():
    """(The pod template as the task holds it, in Kubernetes' field names.)"""
    from kubernetes.client import ApiClient

    for t in (eval_follower, eval_snapshot):
        # flytekit puts the task's image, command and requests over the template's primary container
        # (serializing resolves the GPU image, which builds it: not here)
        pod = ApiClient().sanitize_for_serialization(t.pod_template.pod_spec)
        _assert_node_local(pod, t.pod_template.primary_container_name, "emptyDir")
        assert t.resources.requests.ephemeral_storage == "200Gi" and t.resources.requests.cpu == "4"
    sized = eval_resources(parse_flags(["--preset", "tiny-reverse4", "--engine-backend", "sglang"]).engine)
    assert sized["requests"].ephemeral_storage == "200Gi"  # with_overrides replaces the requests whole


def test_the_train_clusters_shape_carries_what_each_pod_gets_and_bad_values_are_refused():
    shape = train_cluster(2, 8, node_disk("emptyDir", "800Gi"))
    assert shape.disk.bytes == 800 * 2**30 and "MILES_NODE_DISK_SIZE=800Gi" in shape.disk.source
    with pytest.raises(ValueError, match="MILES_NODE_DISK: 'local-ssd' is neither emptyDir nor an absolute path"):
        node_disk("local-ssd", "800Gi")
    with pytest.raises(ValueError, match="MILES_NODE_DISK_SIZE: '800GB' is not a size"):
        node_disk("emptyDir", "800GB")

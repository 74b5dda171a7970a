"""The producer's Ray cluster as Flyte registers it (tasks/cluster.py `producer_cluster`): serialized
through flytekitplugins-ray's own `get_custom`, what KubeRay receives."""

from __future__ import annotations

import pytest
from flytekit import task
from flytekit.configuration import Image, ImageConfig, SerializationSettings

from tasks.cluster import producer_cluster


def _worker_pod(cluster) -> dict:
    @task(task_config=cluster)
    def produce() -> None:  # pragma: no cover - only serialized
        pass

    settings = SerializationSettings(image_config=ImageConfig(default_image=Image(name="d", fqn="img", tag="t")))
    custom = produce.get_custom(settings)
    (worker,) = custom["rayCluster"]["workerGroupSpec"]
    assert worker["groupName"] == "rollout"
    return worker["k8sPod"]["podSpec"]


def test_a_spot_pool_selector_and_toleration_reach_the_worker_pods_with_their_resources():
    """Pins: with MILES_PRODUCER_NODE_SELECTOR / MILES_PRODUCER_TOLERATIONS the workers' pod spec, as the
    plugin serializes it, carries the selector, the tolerations and the GPU resources. Guards: the
    plugin dropping a pod template when requests/limits are set, which left no way onto a spot pool."""
    pod = _worker_pod(producer_cluster(2, 1, "cloud.google.com/gke-spot=true",
                                       "cloud.google.com/gke-spot=true:NoSchedule,nvidia.com/gpu:NoSchedule"))
    assert pod["nodeSelector"] == {"cloud.google.com/gke-spot": "true"}
    assert pod["tolerations"] == [
        {"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true", "effect": "NoSchedule"},
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    (container,) = [c for c in pod["containers"] if c["name"] == "ray-worker"]
    assert container["resources"]["requests"] == {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "1",
                                                  "ephemeral-storage": "200Gi"}  # the node-local volume's
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "1"}


def test_without_a_pool_the_workers_keep_plain_requests_and_bad_values_are_refused():
    pod = _worker_pod(producer_cluster(1, 2))
    assert "nodeSelector" not in pod and "tolerations" not in pod
    (container,) = [c for c in pod["containers"] if c["name"] == "ray-worker"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    with pytest.raises(ValueError, match="MILES_PRODUCER_NODE_SELECTOR: 'spot' is not key=value"):
        producer_cluster(1, 1, "spot")
    with pytest.raises(ValueError, match="MILES_PRODUCER_TOLERATIONS: 'spot=true' is not key"):
        producer_cluster(1, 1, "", "spot=true")

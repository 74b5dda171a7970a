"""Node-local storage of the pods that write to disk: the `train` task's Ray head and GPU workers, the
producer's (tasks/cluster.py) and the GPU eval tasks (tasks/eval.py). docs/gpu-cluster.md, "Node-local
disks".

Read once, at registration, like the MILES_RAY_* variables:
    MILES_NODE_DISK        emptyDir (default): a volume of the pod, on the node's ephemeral storage,
                           gone with the pod; or an absolute host path (e.g. /mnt/local-ssd, a node's
                           local SSD): a hostPath volume, shared by the pods on a node and kept
    MILES_NODE_DISK_SIZE   what that volume holds (default 200Gi): an emptyDir's sizeLimit and the
                           pod's ephemeral-storage request (the scheduler places it on a node with that
                           much); for a host path, what the disk has. Validation compares the run's
                           bytes per node with it (miles_core.prepare.disk)

Every such pod mounts the volume twice: its `cache/` at CACHE_DIR (MILES_CACHE_DIR, the node cache of
models, pushed weights and eval snapshots: miles_core.storage.node_local) and a temp directory at
TEMP_DIR (TMPDIR: rank 0's export files, checkpoint staging, Ray's session files). On a host path
each pod gets its own temp directory, `tmp/{pod name}`, so pods on one node never share one; the
cache is shared, as the node cache's locks expect. The pods also get MILES_NODE_DISK and
MILES_NODE_DISK_SIZE, so a run that reads its model only once it starts is checked there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from miles_core.prepare.disk import NodeDisk, parse_size

CACHE_DIR = "/var/cache/miles"
TEMP_DIR = "/tmp"
VOLUME = "miles-local"
POD_NAME = "MILES_POD_NAME"


@dataclass(frozen=True)
class NodeDiskSpec:
    kind: str  # "emptyDir" or the host path
    size: str  # a Kubernetes quantity

    @property
    def host_path(self) -> str | None:
        return None if self.kind == "emptyDir" else self.kind

    def shape(self) -> NodeDisk:
        """What validation compares the run's bytes per node with."""
        return NodeDisk(parse_size(self.size), f"MILES_NODE_DISK_SIZE={self.size} ({self.kind})")

    def ephemeral(self) -> str | None:
        """The ephemeral-storage request of a pod with this volume (an emptyDir counts against it)."""
        return None if self.host_path else self.size

    def volumes(self, *, head: bool = False) -> list:
        """The pod's volume; `head`: an emptyDir without a limit whatever the workers get (the Ray head
        writes small files only, on a node that may have no such host path)."""
        from kubernetes.client import V1EmptyDirVolumeSource, V1HostPathVolumeSource, V1Volume

        if self.host_path and not head:
            return [V1Volume(name=VOLUME, host_path=V1HostPathVolumeSource(path=self.host_path, type="DirectoryOrCreate"))]
        return [V1Volume(name=VOLUME, empty_dir=V1EmptyDirVolumeSource(size_limit=None if head else self.size))]

    def mounts(self, *, head: bool = False) -> list:
        from kubernetes.client import V1VolumeMount

        tmp = {"sub_path_expr": f"tmp/$({POD_NAME})"} if self.host_path and not head else {"sub_path": "tmp"}
        return [V1VolumeMount(name=VOLUME, mount_path=CACHE_DIR, sub_path="cache"),
                V1VolumeMount(name=VOLUME, mount_path=TEMP_DIR, **tmp)]

    def env(self, *, head: bool = False) -> list:
        """The directories, and the workers' volume (a run started on the head checks against it)."""
        from kubernetes.client import V1EnvVar, V1EnvVarSource, V1ObjectFieldSelector

        out = [V1EnvVar(name="MILES_CACHE_DIR", value=CACHE_DIR), V1EnvVar(name="TMPDIR", value=TEMP_DIR),
               V1EnvVar(name="MILES_NODE_DISK", value=self.kind), V1EnvVar(name="MILES_NODE_DISK_SIZE", value=self.size)]
        if self.host_path and not head:
            out.append(V1EnvVar(name=POD_NAME, value_from=V1EnvVarSource(
                field_ref=V1ObjectFieldSelector(field_path="metadata.name"))))
        return out


def node_disk(kind: str, size: str) -> NodeDiskSpec:
    """The volume MILES_NODE_DISK / MILES_NODE_DISK_SIZE describe; ValueError naming the variable."""
    if kind != "emptyDir" and not os.path.isabs(kind):
        raise ValueError(f"MILES_NODE_DISK: {kind!r} is neither emptyDir nor an absolute path (a hostPath "
                         "such as /mnt/local-ssd)")
    parse_size(size)
    return NodeDiskSpec(kind, size)


NODE_DISK = node_disk(os.environ.get("MILES_NODE_DISK", "emptyDir"), os.environ.get("MILES_NODE_DISK_SIZE", "200Gi"))


def pod_template(container: str, requests: dict[str, str], limits: dict[str, str] | None = None,
                 disk: NodeDiskSpec = NODE_DISK, *, head: bool = False, node_selector: dict[str, str] | None = None,
                 tolerations: list | None = None):
    """A pod whose `container` has `requests` / `limits` (and the volume's ephemeral-storage request),
    the node-local volume mounted at CACHE_DIR and TEMP_DIR, and their variables. `head`: the Ray
    head's small unsized emptyDir (`NodeDiskSpec.volumes`)."""
    from flytekit import PodTemplate
    from kubernetes.client import V1Container, V1PodSpec, V1ResourceRequirements

    ephemeral = None if head else disk.ephemeral()
    requests = {**requests, **({"ephemeral-storage": ephemeral} if ephemeral else {})}
    return PodTemplate(primary_container_name=container, pod_spec=V1PodSpec(
        containers=[V1Container(name=container, resources=V1ResourceRequirements(requests=requests, limits=limits),
                                volume_mounts=disk.mounts(head=head), env=disk.env(head=head))],
        volumes=disk.volumes(head=head), node_selector=node_selector or None, tolerations=tolerations or None))

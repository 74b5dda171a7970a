"""The placement check agrees with Ray: on clusters of Ray's logical GPUs (nodes started with
`num_gpus=8`, no GPU needed), a run the check accepts is placed by Ray, bundle for bundle, and a run
it refuses is one Ray cannot place either (miles_core.prepare.resources, driver.placement).

Guards: a check that refuses what Ray would place (a run needlessly refused) or accepts what Ray
cannot place (the 600 s wait it exists to prevent); and `cluster_shape` misreading Ray's nodes.
"""

from __future__ import annotations

import pytest

from miles_core.config import parse_flags
from miles_core.driver.placement import cluster_shape, ray_resources
from miles_core.prepare.resources import demand, fit_problems

PLACE_SECONDS = 20.0  # Ray places the bundles of a run that fits within this
UNPLACEABLE_SECONDS = 5  # a run that cannot fit: the bound passing is the answer under test

pytestmark = pytest.mark.slow  # a Ray cluster of three or four nodes starts in ~20 s on two cores

# One Ray CPU per trainer rank (a GPU run reserves 4 by default): these logical nodes have 2 CPUs per GPU
# (Ray prestarts a worker per logical CPU, so they cannot have the 8 of a real pod here).
SGLANG = ["--engine-backend", "sglang", "--num-cpus-trainer", "1"]


@pytest.fixture
def logical_cluster(monkeypatch):
    """start(nodes) -> a Ray cluster on this machine of those nodes ({num_cpus, num_gpus, resources}),
    connected; the first node is the head.

    Ray's test `Cluster` records its address in /tmp/ray/ray_current_cluster, where every `ray.init()`
    without an address on this machine (a `pyflyte run` in CI's other lane) would join it; it is not
    recorded."""
    import ray
    from ray.cluster_utils import Cluster

    monkeypatch.setattr(ray._private.utils, "write_ray_address", lambda *a, **k: None)

    if ray.is_initialized():
        ray.shutdown()
    clusters = []

    def start(nodes: list[dict]):
        c = Cluster(initialize_head=True, head_node_args={**nodes[0], "include_dashboard": False})
        clusters.append(c)
        for node in nodes[1:]:
            c.add_node(**node)
        ray.init(address=c.address)
        c.wait_for_nodes()
        return c

    yield start
    ray.shutdown()
    for c in clusters:
        c.shutdown()


def ray_places(cfg, timeout_seconds: float = PLACE_SECONDS) -> bool:
    """Ask Ray for every bundle of the run the way the driver does on GPU runs: the trainer's nodes first
    (`TrainerPlacement`: one STRICT_PACK group each), then the engines (one PACK group, as `EngineFleet`
    reserves them), then the eval engines (likewise); True when all are placed."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from miles_core.driver.placement import TrainerPlacement, TrainerPlacementError

    bundles = demand(cfg)
    engines = [ray_resources(b) for b in bundles if b.role.startswith("engine")]
    evals = [ray_resources(b) for b in bundles if b.role.startswith("eval")]
    try:
        trainer = TrainerPlacement(cfg, timeout_seconds=timeout_seconds)
    except TrainerPlacementError:
        return False
    groups = [placement_group(b, strategy="PACK") for b in (engines, evals) if b]
    try:
        ray.get([g.ready() for g in groups], timeout=timeout_seconds)
        return True
    except ray.exceptions.GetTimeoutError:
        return False
    finally:
        for g in groups:
            remove_placement_group(g)
        trainer.remove()


def test_an_eight_gpu_worker_with_engines(logical_cluster):
    logical_cluster([{"num_cpus": 4, "num_gpus": 0}, {"num_cpus": 16, "num_gpus": 8}])
    shape = cluster_shape()
    assert sorted((n.cpus, n.gpus) for n in shape.nodes) == [(4, 0), (16, 8)]
    fits = parse_flags(["--preset", "tiny-reverse4", *SGLANG, "--actor-num-gpus-per-node", "6", "--rollout-num-engines", "2"], check=False)
    too_big = parse_flags(["--preset", "tiny-reverse4", *SGLANG, "--actor-num-gpus-per-node", "8"], check=False)
    assert fit_problems(fits, shape) == [] and ray_places(fits)
    assert "(engine 0)" in fit_problems(too_big, shape)[0]  # the trainer's node is reserved first
    assert not ray_places(too_big, timeout_seconds=UNPLACEABLE_SECONDS)


def test_two_eight_gpu_workers_tp2_dp8_with_an_engine_node(logical_cluster):
    logical_cluster([{"num_cpus": 4, "num_gpus": 0}, {"num_cpus": 16, "num_gpus": 8}, {"num_cpus": 16, "num_gpus": 8},
                     {"num_cpus": 4, "num_gpus": 2, "resources": {"engine_node": 1}}])
    shape = cluster_shape()
    assert sum(n.gpus for n in shape.nodes) == 18 and any("engine_node" in n.custom for n in shape.nodes)
    flags = [*SGLANG, "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "8", "--tensor-model-parallel-size", "2",
             "--rollout-num-engines", "2", "--engine-custom-resource", "engine_node"]
    fits = parse_flags(["--preset", "tiny-reverse4", *flags], check=False)
    assert fit_problems(fits, shape) == [] and ray_places(fits)
    one_more = parse_flags(["--preset", "tiny-reverse4", *flags, "--rollout-num-engines", "3"], check=False)
    assert "engine 2" in fit_problems(one_more, shape)[0]
    assert not ray_places(one_more, timeout_seconds=UNPLACEABLE_SECONDS)

"""Where every TP group and every engine lands, on Ray's logical GPUs: a head (no GPU) and two workers
of 8 GPUs each (`num_gpus=8`, nothing needs CUDA), one cluster for the module.

The roles are placed by the product's own code in the driver's order (`start_cluster` on GPU runs):
the trainer's `TrainerPlacement` (one STRICT_PACK group per trainer node), then an `EngineFleet` (one
PACK group of a bundle per engine). Only the actors are stand-ins, created with exactly the options
the product computed (the fleet's actor class is swapped for one that reports where it runs; the
ranks are created with `TrainerPlacement.options`); each reports its node and its GPU ids.

Guards: engines scattered over both workers and the trainer's ranks packed into what is left, so that a
trainer node (and a TP group in it) spans two workers and TP runs over the pod network; a GPU handed
to two actors; the placement check accepting a layout that Ray does not give.
"""

from __future__ import annotations

import pytest

from miles_core.config import parse_flags
from miles_core.driver.placement import TrainerPlacement, cluster_shape
from miles_core.engines import launcher
from miles_core.engines.launcher import EngineFleet, EngineLaunchSpec
from miles_core.prepare.resources import fit_problems

PLACED_SECONDS = 60  # reserving the trainer's placement, and each reply of the actors placed in it

pytestmark = pytest.mark.slow  # one Ray cluster of three nodes: ~10 s to start on two cores

# One Ray CPU per trainer rank (a GPU run reserves 4 by default): these logical nodes have 2 CPUs per GPU
# (Ray prestarts a worker per logical CPU, so they cannot have the 8 of a real pod here).
SGLANG = ["--preset", "tiny-reverse4", "--engine-backend", "sglang", "--num-cpus-trainer", "1"]


@pytest.fixture(scope="module")
def workers():
    """The two GPU workers' node ids -> "worker 0" / "worker 1". Ray's test `Cluster` would record its
    address in /tmp/ray/ray_current_cluster, where any `ray.init()` on this machine would join it: not
    recorded."""
    import ray
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ray._private.utils, "write_ray_address", lambda *a, **k: None)
        if ray.is_initialized():
            ray.shutdown()
        cluster = Cluster(initialize_head=True,
                          head_node_args={"num_cpus": 2, "num_gpus": 0, "include_dashboard": False})
        try:
            nodes = [cluster.add_node(num_cpus=16, num_gpus=8) for _ in range(2)]
            ray.init(address=cluster.address)
            cluster.wait_for_nodes()
            yield {n.node_id: f"worker {i}" for i, n in enumerate(nodes)}
        finally:
            ray.shutdown()
            cluster.shutdown()


def _stand_in():
    """An actor that reports its node and GPU ids (defined here, so Ray ships it by value)."""
    import ray

    class Where:
        def __init__(self, *args, **kwargs):
            pass

        def start(self) -> str:
            return "http://stand-in"

        def url(self) -> str:
            return "http://stand-in"

        def where(self) -> tuple[str, tuple]:
            return ray.get_runtime_context().get_node_id(), tuple(ray.get_gpu_ids())

        def shutdown(self) -> None:
            pass

    return Where


def layout(cfg, workers: dict, monkeypatch, *, rank_actors: bool = False) -> tuple[list, list]:
    """([(worker, gpu ids)] per engine, [(worker, gpu ids)] per trainer rank), placed as `start_cluster` places
    a GPU run; everything is released before returning. A rank's place is its bundle's node in Ray's
    placement-group table (gpu ids unknown: ()), or, with `rank_actors`, what a stand-in actor created with
    the rank's options reports (each actor is a process: ~0.5 s on two cores)."""
    import ray
    from ray.util import placement_group_table

    monkeypatch.setattr(launcher, "EngineActor", _stand_in())
    reserved = TrainerPlacement(cfg, timeout_seconds=PLACED_SECONDS)
    fleet = EngineFleet(EngineLaunchSpec.from_config(cfg.engine, "s3://bucket/model"), cfg.engine.rollout_num_engines,
                        num_cpus_per_engine=cfg.run.num_cpus_per_engine)
    ranks = []
    try:
        fleet.start()
        engines = ray.get([a.where.remote() for a in fleet.actors], timeout=PLACED_SECONDS)
        if rank_actors:
            ranks = [ray.remote(_stand_in()).options(**o).remote() for o in reserved.options]
            trainer = ray.get([a.where.remote() for a in ranks], timeout=PLACED_SECONDS)
        else:
            slots = [o["scheduling_strategy"] for o in reserved.options]
            trainer = [(placement_group_table(s.placement_group)["bundles_to_node_id"][s.placement_group_bundle_index], ())
                       for s in slots]
    finally:
        for a in ranks:
            ray.kill(a)
        reserved.remove()
        fleet.shutdown()
    named = lambda places: [(workers[node], gpus) for node, gpus in places]  # noqa: E731
    return named(engines), named(trainer)


def _no_gpu_twice(*places: list) -> None:
    """No GPU id held twice on a worker, and no worker holding more than its 8 GPUs."""
    held = [(w, g) for where in places for w, gpus in where for g in gpus]
    assert len(held) == len(set(held)), held
    for worker in ("worker 0", "worker 1"):
        assert sum(max(1, len(gpus)) for where in places for w, gpus in where if w == worker) <= 8, places


def _tp_groups(trainer: list, tp: int) -> list[set[str]]:
    return [{w for w, _ in trainer[k:k + tp]} for k in range(0, len(trainer), tp)]


@pytest.mark.parametrize("tp", [2, 6])
def test_two_trainer_nodes_of_six_beside_four_engines(workers, monkeypatch, tp):
    """docs/gpu-cluster.md's two-worker layout: 2 x 6 ranks (TP 2 or 6) and 4 one-GPU engines on 2 x 8 GPUs.

    Asserted layout: ranks 0-5 on one worker, 6-11 on the other, each TP group inside one; the engines on
    the 2 + 2 GPUs left. Before: the 4 engines took worker 0 and the trainer's one PACK group put ranks 0-7
    on worker 1 and 8-11 on worker 0 (at TP 6, the group of ranks 6-11 across both)."""
    cfg = parse_flags([*SGLANG, "--rollout-num-engines", "4", "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "6",
                       "--tensor-model-parallel-size", str(tp)], check=False)
    assert fit_problems(cfg, cluster_shape()) == []
    engines, trainer = layout(cfg, workers, monkeypatch)
    print(f"\nTP {tp}: trainer ranks {[w for w, _ in trainer]}; engines {[w for w, _ in engines]}")
    first, second = {w for w, _ in trainer[:6]}, {w for w, _ in trainer[6:]}
    assert len(first) == 1 and len(second) == 1 and first != second, trainer
    assert all(len(group) == 1 for group in _tp_groups(trainer, tp)), trainer
    assert sorted(w for w, _ in engines) == ["worker 0", "worker 0", "worker 1", "worker 1"], engines
    _no_gpu_twice(engines, trainer)


def test_eight_engines_fill_one_worker_and_a_tp8_trainer_the_other(workers, monkeypatch):
    """8 one-GPU engines and a trainer node of 8 ranks at TP 8: the trainer on one worker, all 8 engines on
    the other (not 4 + 4 beside a trainer split over both)."""
    cfg = parse_flags([*SGLANG, "--rollout-num-engines", "8", "--actor-num-gpus-per-node", "8",
                       "--tensor-model-parallel-size", "8"], check=False)
    assert fit_problems(cfg, cluster_shape()) == []
    engines, trainer = layout(cfg, workers, monkeypatch, rank_actors=True)
    print(f"\ntrainer ranks {trainer}; engines {engines}")
    assert all(len(gpus) == 1 for _, gpus in engines + trainer)
    (rank_worker,) = {w for w, _ in trainer}
    assert {w for w, _ in engines} == {"worker 0", "worker 1"} - {rank_worker}, engines
    _no_gpu_twice(engines, trainer)


def test_engines_of_two_gpus_pack_into_whole_nodes_beside_a_tp4_trainer(workers, monkeypatch):
    """4 engines of 2 GPUs (SGLang TP 2) and 2 x 4 ranks at TP 4: each engine's 2 GPUs on one worker, each
    TP group of 4 on one worker, 16 GPUs used once each."""
    cfg = parse_flags([*SGLANG, "--rollout-num-engines", "4", "--rollout-num-gpus-per-engine", "2", "--actor-num-nodes", "2",
                       "--actor-num-gpus-per-node", "4", "--tensor-model-parallel-size", "4"], check=False)
    assert fit_problems(cfg, cluster_shape()) == []
    engines, trainer = layout(cfg, workers, monkeypatch)
    print(f"\ntrainer ranks {[w for w, _ in trainer]}; engines {[(w, g) for w, g in engines]}")
    assert all(len(gpus) == 2 for _, gpus in engines), engines
    assert all(len(group) == 1 for group in _tp_groups(trainer, 4)), trainer
    _no_gpu_twice(engines, trainer)

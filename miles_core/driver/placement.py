"""Where every role of a training run is placed on Ray: the engine fleet, the trainer's ranks and
the rollout manager (docs/training.md). The only module that creates Ray actors for a run.

    cluster = start_cluster(cfg, initial_model, stack)   # .fleet, .trainer, .rollout, .start_step, .restored

The trainer is a `TrainerGroup`: one `TrainerWorker` actor per rank (`--actor-num-nodes` x
`--actor-num-gpus-per-node`; one GPU each, or one CPU rank process each on a machine without
GPUs) in the bundles a `TrainerPlacement` reserved. On GPU runs that is one STRICT_PACK placement
group per trainer node (`--actor-num-gpus-per-node` one-GPU bundles on one node), reserved before
any engine starts, so that every tensor-parallel group (consecutive ranks; its size divides the
ranks per node) is inside one node and the engines, packed after it, do not fragment the nodes; on
CPU runs one PACK placement group of all ranks, after the engines, as the check models it
(prepare/resources.py). Rank 0 is created first and gives MASTER_ADDR/MASTER_PORT; every
rank then initialises torch.distributed (NCCL on GPU, gloo on CPU) and Megatron's parallel state.
The driver holds typed clients: every method of `TrainerGroup` and of the rollout side's
`RolloutClient` returns a `Pending` call, waited for in the driver's one wait (switchboard.py). This module never calls `ray.init` except in `ensure_ray` (local runs and
tests, through `local_ray.start_local_ray`; the Flyte Ray task connects its own).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from miles_core.config.rules import raise_problems
from miles_core.driver.clients import Pending, RolloutClient
from miles_core.driver.local_ray import start_local_ray
from miles_core.engines.auth import bind_problem
from miles_core.engines.launcher import EngineFleet, EngineLaunchSpec, custom_resource, end_actors, port_taken
from miles_core.metrics import names as N
from miles_core.prepare.checks import check_device_memory
from miles_core.prepare.resources import (Bundle, ClusterShape, Node, fit_problems, producer_fit_problems,
                                          trainer_bundles, uses_gpus)
from miles_core.rank_batches import data_layout, split_for_run
from miles_core.rollout.manager import rollout_manager_actor


def ensure_ray(num_cpus: int | None = None) -> None:
    """Connect to Ray unless connected (the Flyte Ray task connects its own): the cluster named by
    RAY_ADDRESS when set, else a new local instance."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if os.environ.get("RAY_ADDRESS"):
        ray.init(log_to_driver=True, configure_logging=False, namespace="miles")
        return
    start_local_ray(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, log_to_driver=True,
                    configure_logging=False, namespace="miles")


def ray_resources(bundle: Bundle) -> dict[str, float]:
    """A bundle as Ray resources (a placement-group bundle)."""
    return {"CPU": bundle.cpus, **({"GPU": bundle.gpus} if bundle.gpus else {}), **custom_resource(bundle.custom)}


def cluster_shape() -> ClusterShape:
    """The connected Ray cluster's alive nodes, with their total CPUs, GPUs and custom resources."""
    import ray

    nodes = []
    alive = sorted((n for n in ray.nodes() if n.get("Alive")), key=lambda n: (n.get("NodeManagerAddress", ""),
                                                                            n.get("NodeID", "")))
    for i, n in enumerate(alive):
        res = n.get("Resources", {})
        custom = frozenset(k for k in res
                           if k not in _BUILTIN_RESOURCES and not k.startswith(("node:", "accelerator_type:")))
        name = f"node {i} ({n.get('NodeManagerAddress', '?')})"
        nodes.append(Node(name, float(res.get("CPU", 0)), float(res.get("GPU", 0)), custom))
    where = "the Ray cluster at RAY_ADDRESS" if os.environ.get("RAY_ADDRESS") else "this machine's Ray instance"
    return ClusterShape(tuple(nodes), where)


log = logging.getLogger(__name__)

LIFE = "life"  # the ranks' concurrency group of their `alive` call
RENDEZVOUS_ATTEMPTS = 3  # rank 0's port is picked free, then bound: another process may take it in between
_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


def check_fits(cfg, producer_engines: int | None = None) -> None:
    """ConfigError naming both sides when the run's engines, trainer ranks and eval engines (or a producer
    job's `producer_engines` engines) cannot all be placed on the connected cluster, or when engines
    would bind beyond loopback there (`auto` on more than one node) without the API token (checked
    before any of them starts: Ray would wait for room for ever)."""
    shape = cluster_shape()
    exposure = bind_problem(cfg.engine.engine_bind_host, len(shape.nodes))
    fits = (fit_problems(cfg, shape) if producer_engines is None
            else producer_fit_problems(cfg, producer_engines, shape))
    raise_problems(fits + ([exposure] if exposure else []))


class TrainerPlacementError(RuntimeError):
    def __init__(self, message: str):
        super().__init__(message)


class TrainerPlacement:
    """The trainer's reserved bundles (module doc): `options[r]` are rank r's Ray options. GPU runs: one
    STRICT_PACK placement group per trainer node, rank r in group r // --actor-num-gpus-per-node; CPU
    runs: one PACK placement group. TrainerPlacementError when Ray has not placed them within
    `timeout_seconds` (nothing stays reserved then)."""

    def __init__(self, cfg, timeout_seconds: float = 600.0):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundles = trainer_bundles(cfg)
        self.world_size = len(bundles)
        per_node = max(1, cfg.train.actor_num_gpus_per_node)
        if uses_gpus(cfg.engine):  # one group per trainer node: its TP groups stay in one node
            self.groups = [placement_group([ray_resources(b) for b in bundles[k:k + per_node]], strategy="STRICT_PACK")
                           for k in range(0, len(bundles), per_node)]
            slots = [(self.groups[r // per_node], r % per_node) for r in range(len(bundles))]
        else:
            self.groups = [placement_group([ray_resources(b) for b in bundles], strategy="PACK")]
            slots = [(self.groups[0], r) for r in range(len(bundles))]
        try:
            ray.get([g.ready() for g in self.groups], timeout=timeout_seconds)
        except ray.exceptions.GetTimeoutError:
            self.remove()
            whole = f", {per_node} on each node" if uses_gpus(cfg.engine) else ""
            raise TrainerPlacementError(
                f"the trainer's {self.world_size} ranks ({ray_resources(bundles[0]) if bundles else {}} each{whole}) "
                f"could not be placed within {timeout_seconds:.0f} s; the cluster has {ray.available_resources()} "
                "free. Lower --actor-num-gpus-per-node / --actor-num-nodes or --num-cpus-trainer, or add nodes.") from None
        self.options = [dict(num_cpus=b.cpus, num_gpus=b.gpus,
                             scheduling_strategy=PlacementGroupSchedulingStrategy(g, placement_group_bundle_index=i))
                        for b, (g, i) in zip(bundles, slots)]

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for g in self.groups:
            remove_placement_group(g)
        self.groups = []


class TrainerGroup:
    """The trainer's ranks, a typed client: each method runs `TrainerWorker`'s method of that name on every
    rank (arguments are put in the object store once and read by all ranks) and returns a `Pending` of
    rank 0's answer."""

    def __init__(self, cfg, hf_uri: str, engine_urls: list[str], engine_actors: list | None = None,
                 placement_timeout_seconds: float = 600.0, placement: TrainerPlacement | None = None):
        import ray

        # torch and Megatron: only the trainer's rank processes need them, not the driver
        from miles_core.driver.rendezvous import rendezvous_address
        from miles_core.train.worker import TrainerWorker

        t = cfg.train
        self.cfg = cfg
        self.world_size = t.actor_num_nodes * t.actor_num_gpus_per_node
        self.layout = data_layout(cfg.train)
        self.placement = placement or TrainerPlacement(cfg, placement_timeout_seconds)
        opts = self.placement.options
        worker = ray.remote(concurrency_groups={LIFE: 1})(TrainerWorker)
        for attempt in range(1, RENDEZVOUS_ATTEMPTS + 1):
            where = self._rendezvous(opts[0], rendezvous_address)  # rank 0's node and a free port on it
            self.actors = [worker.options(max_concurrency=1, **opts[r]).remote(cfg, hf_uri, r, self.world_size, where,
                                                                               engine_urls, engine_actors,
                                                                               check_device_memory)
                           for r in range(self.world_size)]
            try:
                self._wait_ready()
                return
            except ray.exceptions.ActorDiedError as e:
                self._kill(graceful=False)  # the others wait in the rendezvous for a rank that is gone
                if not port_taken(e) or attempt == RENDEZVOUS_ATTEMPTS:
                    self.placement.remove()
                    raise
                log.warning("the trainer's rendezvous port %s:%s was taken before rank 0 listened on it; "
                            "starting the ranks again on another (attempt %d of %d)", *where, attempt + 1,
                            RENDEZVOUS_ATTEMPTS)

    def _rendezvous(self, rank0_options: dict, rendezvous_address) -> tuple[str, int]:
        import ray

        return ray.get(ray.remote(rendezvous_address).options(**rank0_options).remote())

    def _wait_ready(self) -> None:
        """Until every rank is built; a rank that failed raises at once (the others may be waiting for it)."""
        import ray

        pending = [a.__ray_ready__.remote() for a in self.actors]
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            ray.get(done)

    def _kill(self, graceful: bool = True) -> None:
        end_actors(self.actors, timeout_seconds=10.0 if graceful else 0.0)
        self.actors = []

    def _on_every_rank(self, method: Callable[[Any], Any], *args) -> Pending:
        import ray

        refs = [ray.put(a) for a in args]
        return Pending([method(actor).remote(*refs) for actor in self.actors])

    def restore_latest(self) -> Pending[tuple[int, dict] | None]:
        return self._on_every_rank(lambda a: a.restore_latest)

    def train_parts(self, step: int, parts: Sequence[Any]) -> Pending[dict]:
        """Train on a rollout given as its data-parallel parts (index = DP rank): references the rollout side
        put in the object store (each rank reads its own; the driver reads none) or `RankBatch`es."""
        if len(parts) != self.layout.dp_size:
            raise ValueError(f"{len(parts)} data-parallel parts for a trainer of DP size {self.layout.dp_size}")
        return Pending([a.train_part.remote(step, parts[self.layout.dp_rank(r)]) for r, a in enumerate(self.actors)])

    def train_step(self, step: int, groups: list) -> Pending[dict]:
        """Train on `groups` (in this process: cut into their parts here, for callers that hold the groups)."""
        return self.train_parts(step, split_for_run(groups, self.layout, self.cfg))

    def push_weights(self, step: int, version: int) -> Pending[dict]:
        """Rank 0's answer, with what every writer rank wrote of the version as its `weights/*` metrics."""
        import ray

        refs = [ray.put(a) for a in (step, version)]
        return Pending([a.push_weights.remote(*refs) for a in self.actors], combine=version_written)

    def save_checkpoint(self, step: int, extras: dict) -> Pending[str | None]:
        return self._on_every_rank(lambda a: a.save_checkpoint, step, extras)

    def export_hf(self, step: int, dest_uri: str) -> Pending[bool]:
        """Every writer rank writes its part of the HF directory; the answer (rank 0's): whether it is sealed
        (else the caller seals it: `miles_core.weights.snapshot.seal_uri`)."""
        return self._on_every_rank(lambda a: a.export_hf, step, dest_uri)

    def set_engines(self, urls: list[str], actors: list) -> Pending[None]:
        return self._on_every_rank(lambda a: a.set_engines, urls, actors)

    def logprobs(self, samples: list) -> Pending[list[list[float]]]:
        return self._on_every_rank(lambda a: a.logprobs, samples)

    def alive(self) -> Pending[None]:
        """Answers only when every rank closed; a rank that dies makes it raise (the driver watches it)."""
        return Pending([a.alive.options(concurrency_group=LIFE).remote() for a in self.actors])

    def close(self) -> Pending[None]:
        return self._on_every_rank(lambda a: a.close)

    def shutdown(self) -> None:
        try:
            if self.actors:
                self.close().result(timeout=120)
        finally:
            self._kill()
            self.placement.remove()


@dataclass
class Cluster:
    fleet: EngineFleet
    trainer: TrainerGroup
    rollout: RolloutClient
    start_step: int
    restored_version: int  # the weight version of the checkpoint resumed from (its weights), 0 when fresh


def start_cluster(cfg, initial_model: str, stack: contextlib.ExitStack) -> Cluster:
    """Engines, trainer ranks (restored from the latest checkpoint) and the rollout manager (not started:
    the driver pushes the trainer's weights first, so the producer starts on them). Teardown goes on
    `stack`."""
    launch = EngineLaunchSpec.from_config(cfg.engine, initial_model, 0,
                                          routed_experts=cfg.train.use_rollout_routing_replay)
    # GPU runs: the trainer's whole-node groups first, the engines packed beside them (module doc)
    reserved = TrainerPlacement(cfg) if uses_gpus(cfg.engine) else None
    if reserved is not None:
        stack.callback(reserved.remove)  # a no-op once the trainer removed it
    fleet = EngineFleet(launch, cfg.engine.rollout_num_engines,
                        num_cpus_per_engine=cfg.run.num_cpus_per_engine,
                        resources=custom_resource(cfg.engine.engine_custom_resource)).start()
    stack.callback(fleet.shutdown)
    trainer = TrainerGroup(cfg, initial_model, fleet.urls(), fleet.actor_handles(), placement=reserved)
    stack.callback(trainer.shutdown)
    restored = trainer.restore_latest().result()
    start_step, extras = (restored[0] + 1, restored[1]) if restored else (0, {})
    actor = rollout_manager_actor(num_cpus=0).remote(
        cfg, engine_urls=fleet.urls(), state=extras.get("rollout_state"),
        consumed_through_step=extras.get("consumed_through_step", start_step - 1))
    rollout = RolloutClient.of_actor(actor)
    stack.callback(lambda: _stop_rollout(rollout, actor))
    return Cluster(fleet, trainer, rollout, start_step, int(extras.get("weight_version", 0)))


ROLLOUT_STOP_SECONDS = 120.0  # the rollout manager's stop (its producer's grace, the buffer's close)


def _stop_rollout(rollout: RolloutClient, actor) -> None:
    """Stop the rollout manager; one that does not stop in time (a failed segment can leave it blocked) is
    ended, so a segment's failure never hangs in its teardown."""
    try:
        rollout.stop().result(timeout=ROLLOUT_STOP_SECONDS)
    except Exception as e:  # noqa: BLE001 - the actor is ended below either way
        log.warning("the rollout manager did not stop cleanly (%s); ending it", e)
        end_actors([actor], timeout_seconds=0.0)


def version_written(answers: list[dict]) -> dict:
    """Rank 0's push answer, its "part" and every other writer rank's replaced by the version's `weights/*`
    metrics: bytes of all parts (and their share of the dense bf16 model), the changed share of all elements,
    the slowest part's seconds, whether any part is an anchor."""
    out = {k: v for k, v in answers[0].items() if k != "part"}
    parts = [a["part"] for a in answers if "part" in a]
    if parts:
        elements = sum(p["elements"] for p in parts)
        written = sum(p["bytes"] for p in parts)
        out |= {N.WEIGHTS_VERSION_BYTES: written, N.WEIGHTS_SHARE_OF_DENSE: written / max(1, 2 * elements),
                N.WEIGHTS_CHANGED_SHARE: sum(p["changed"] for p in parts) / max(1, elements),
                N.WEIGHTS_ENCODE_SECONDS: max(p["encode_seconds"] for p in parts),
                N.WEIGHTS_ANCHOR: float(any(p["anchor"] for p in parts))}
    return out

"""Where every role of a training run is placed on Ray: the engine fleet, the trainer's ranks and
the rollout manager (docs/training.md). The only module that creates Ray actors for a run.

    fleet, trainer, rollout, start_step, version_box = start_cluster(cfg, initial_model, stack)

The trainer is a `TrainerGroup`: one `TrainerWorker` actor per rank (`--actor-num-nodes` x
`--actor-num-gpus-per-node`; one GPU each, or one CPU rank process each on a machine without
GPUs) in one placement group. Rank 0 is created first and gives MASTER_ADDR/MASTER_PORT; every
rank then initialises torch.distributed (NCCL on GPU, gloo on CPU) and Megatron's parallel state.
The driver holds handles; every `call(...)` returns a future whose `result()` blocks (the loop
reads sequentially). This module never calls `ray.init` except in `ensure_ray` (local runs and
tests, through `local_ray.start_local_ray`; the Flyte Ray task connects its own).
"""

from __future__ import annotations

import contextlib
import logging
import os

from miles_core.config.rules import raise_problems
from miles_core.driver.handles import RayActorHandle
from miles_core.driver.local_ray import start_local_ray
from miles_core.engines.auth import bind_problem
from miles_core.engines.launcher import EngineFleet, EngineLaunchSpec, custom_resource, end_actors, port_taken
from miles_core.prepare.checks import check_device_memory
from miles_core.prepare.resources import Bundle, ClusterShape, Node, fit_problems, trainer_bundle
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

RENDEZVOUS_ATTEMPTS = 3  # rank 0's port is picked free, then bound: another process may take it in between
_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


def check_fits(cfg) -> None:
    """ConfigError naming both sides when the run's engines, trainer ranks and eval engines cannot all be
    placed on the connected cluster, or when engines would bind beyond loopback there (`auto` on more
    than one node) without the API token (checked before any of them starts)."""
    shape = cluster_shape()
    exposure = bind_problem(cfg.engine.engine_bind_host, len(shape.nodes))
    problems = fit_problems(cfg, shape) + ([exposure] if exposure else [])
    raise_problems(problems)


class TrainerPlacementError(RuntimeError):
    def __init__(self, message: str):
        super().__init__(message)


class GroupFuture:
    """Every rank's result of one call; `result()` waits for all and returns rank 0's."""

    def __init__(self, refs: list):
        self.refs = refs

    def result(self, timeout: float | None = None):
        import ray

        return ray.get(self.refs, timeout=timeout)[0]

    def done(self) -> bool:
        import ray

        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return len(ready) == len(self.refs)


class TrainerGroup:
    """The trainer's ranks. `call(method, *args)` runs the method on every rank (arguments are put
    in the object store once and read by all ranks) and returns a `GroupFuture`."""

    def __init__(self, cfg, hf_uri: str, engine_urls: list[str], engine_actors: list | None = None,
                 placement_timeout_seconds: float = 600.0):
        import ray

        # torch and Megatron: only the trainer's rank processes need them, not the driver
        from miles_core.train.worker import TrainerWorker, rendezvous_address

        t = cfg.train
        self.world_size = t.actor_num_nodes * t.actor_num_gpus_per_node
        opts = self._place(cfg, placement_timeout_seconds)
        worker = ray.remote(TrainerWorker)
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
                    ray.util.remove_placement_group(self.pg)
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

    def _place(self, cfg, timeout_seconds: float) -> list[dict]:
        """One placement-group bundle per rank (a GPU each on GPU clusters); Ray options per rank."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        spec = trainer_bundle(cfg)
        bundle = ray_resources(spec)
        self.pg = placement_group([bundle] * self.world_size, strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=timeout_seconds)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.pg)
            raise TrainerPlacementError(
                f"the trainer's {self.world_size} ranks ({bundle} each) could not be placed within "
                f"{timeout_seconds:.0f} s; the cluster has {ray.available_resources()} free. Lower "
                "--actor-num-gpus-per-node / --actor-num-nodes or --num-cpus-trainer, or add nodes.") from None
        return [dict(num_cpus=spec.cpus, num_gpus=spec.gpus,
                     scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r))
                for r in range(self.world_size)]

    def call(self, method: str, *args) -> GroupFuture:
        import ray

        refs = [ray.put(a) for a in args]
        return GroupFuture([getattr(a, method).remote(*refs) for a in self.actors])

    def shutdown(self) -> None:
        from ray.util.placement_group import remove_placement_group

        try:
            if self.actors:
                self.call("close").result(timeout=120)
        finally:
            self._kill()
            remove_placement_group(self.pg)


def start_cluster(cfg, initial_model: str, stack: contextlib.ExitStack):
    """Engines, trainer ranks (restored from the latest checkpoint) and the rollout manager, in the
    order that lets the producer start on the trainer's current weights. Teardown goes on `stack`."""
    launch = EngineLaunchSpec.from_config(cfg.engine, initial_model, 0,
                                          routed_experts=cfg.train.use_rollout_routing_replay)
    fleet = EngineFleet(launch, cfg.engine.rollout_num_engines,
                        num_cpus_per_engine=cfg.run.num_cpus_per_engine,
                        resources=custom_resource(cfg.engine.engine_custom_resource)).start()
    stack.callback(fleet.shutdown)
    trainer = TrainerGroup(cfg, initial_model, fleet.urls(), fleet.actor_handles())
    stack.callback(trainer.shutdown)
    restored = trainer.call("restore_latest").result()
    start_step, extras = (restored[0] + 1, restored[1]) if restored else (0, {})
    # The checkpoint holds the weights of its own version (the loop pushes before it saves), so a
    # resume serves them again under that version; a fresh run's first push makes version 1.
    trainer.call("set_version", max(0, int(extras.get("weight_version", 0)) - 1)).result()
    version_box = [trainer.call("push_weights", start_step - 1).result()["version"]]

    rollout = RayActorHandle(rollout_manager_actor(num_cpus=0).remote(
        cfg, engine_urls=fleet.urls(), state=extras.get("rollout_state"),
        consumed_through_step=extras.get("consumed_through_step", start_step - 1)))
    rollout.call("set_version", version_box[0]).result()
    trainer.call("set_rollout", rollout.actor).result()  # told each version its engines serve from now on
    rollout.call("start").result()
    stack.callback(lambda: rollout.call("stop").result())
    return fleet, trainer, rollout, start_step, version_box

"""What a run asks of its Ray cluster, the cluster's shape, and whether the one fits the other.

    need = demand(cfg)                      # one Bundle per actor that reserves resources
    problems = fit_problems(cfg, shape)     # [] when every bundle finds a node; else what is short

A bundle is one actor's share of one node: an engine (its tensor-parallel GPUs on one node), a
trainer rank (one GPU on GPU clusters; a CPU rank process elsewhere), a dedicated eval engine. The
rollout manager reserves no CPU. The bundles are placed in the order the driver starts them (rollout
engines, then the trainer's ranks, then eval engines), each on the first node with room for it and
with the custom resource it asks for, which is how a full cluster fails too: a trainer placement
group that cannot be satisfied waits (600 s) and fails, after every engine has started. Checking
first turns that wait into one refusal that names both sides.

The driver builds its Ray options from the same bundles (`engine_bundle`, `trainer_bundle`), so the
check and the placement cannot disagree about what a role asks for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from miles_core.config import RunConfig
from miles_core.config.sections import EngineSection
from miles_core.prepare.disk import NodeDisk


@dataclass(frozen=True)
class Bundle:
    role: str
    cpus: float
    gpus: int
    custom: str = ""  # a custom resource this actor asks a sliver of ("" = none)


@dataclass(frozen=True)
class Node:
    name: str
    cpus: float
    gpus: float
    custom: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ClusterShape:
    nodes: tuple[Node, ...]
    source: str  # where the shape was read, for the message: "this machine's Ray", "the Flyte Ray task", ...
    disk: NodeDisk | None = None  # what each pod's node-local volume holds (miles_core.prepare.disk); None: unchecked

    def describe(self) -> str:
        return "; ".join(f"{n.name}: {_amount(n.cpus, n.gpus)}" + (f" +{sorted(n.custom)}" if n.custom else "")
                         for n in self.nodes)


def uses_gpus(engine: EngineSection) -> bool:
    """SGLang engines and the trainer beside them run on GPUs; the CPU engine's runs use none."""
    return engine.engine_backend == "sglang"


def engine_bundle(cfg: RunConfig, role: str = "engine") -> Bundle:
    gpus = max(1, cfg.engine.rollout_num_gpus_per_engine) if uses_gpus(cfg.engine) else 0
    return Bundle(role, cfg.run.num_cpus_per_engine, gpus, cfg.engine.engine_custom_resource)


def trainer_bundle(cfg: RunConfig, role: str = "trainer rank") -> Bundle:
    return Bundle(role, cfg.run.num_cpus_trainer, 1 if uses_gpus(cfg.engine) else 0, cfg.engine.trainer_custom_resource)


def eval_engine_count(cfg: RunConfig) -> int:
    """Mode-2 eval engines: --eval-num-gpus worth of engines (one engine on a CPU run)."""
    if cfg.eval.eval_mode != "dedicated" or cfg.eval.eval_num_gpus < 1:
        return 0
    per_engine = max(1, cfg.engine.rollout_num_gpus_per_engine) if uses_gpus(cfg.engine) else 1
    return max(1, cfg.eval.eval_num_gpus // per_engine)


def demand(cfg: RunConfig) -> list[Bundle]:
    """Every bundle of the run, in the order the driver asks Ray for them."""
    t = cfg.train
    ranks = t.actor_num_nodes * t.actor_num_gpus_per_node
    return ([engine_bundle(cfg, f"engine {i}") for i in range(cfg.engine.rollout_num_engines)]
            + [trainer_bundle(cfg, f"trainer rank {r}") for r in range(ranks)]
            + [engine_bundle(cfg, f"eval engine {i}") for i in range(eval_engine_count(cfg))])


@dataclass
class _Free:
    node: Node
    cpus: float
    gpus: float
    holds: list[str] = field(default_factory=list)

    def take(self, b: Bundle) -> bool:
        if b.cpus > self.cpus + 1e-9 or b.gpus > self.gpus + 1e-9 or (b.custom and b.custom not in self.node.custom):
            return False
        self.cpus, self.gpus = self.cpus - b.cpus, self.gpus - b.gpus
        self.holds.append(b.role)
        return True


def unplaced(bundles: list[Bundle], shape: ClusterShape) -> list[Bundle]:
    """The bundles that find no node, placing each on the first node with room, in order."""
    free = [_Free(n, n.cpus, n.gpus) for n in shape.nodes]
    return [b for b in bundles if not any(f.take(b) for f in free)]


def fit_problems(cfg: RunConfig, shape: ClusterShape) -> list[str]:
    """[] when the run's bundles fit `shape`; else one problem naming what is asked, what is there and
    which flags would make it fit."""
    need = demand(cfg)
    missing = unplaced(need, shape)
    if not missing:
        return []
    return [f"the run does not fit {shape.source}: it asks for {_asked(need)}, and {len(missing)} of them "
            f"({_roles(missing)}) cannot be placed; the cluster has {shape.describe()}. "
            + _advice(cfg, shape)]


def producer_fit_problems(cfg: RunConfig, num_engines: int, shape: ClusterShape) -> list[str]:
    """[] when a producer job's `num_engines` engines (the run's engine shape) fit its cluster `shape`;
    else one problem naming what is asked and what is there. Checked before any engine starts: Ray
    would wait for room for ever."""
    need = [engine_bundle(cfg, f"producer engine {i}") for i in range(num_engines)]
    missing = unplaced(need, shape)
    if not missing:
        return []
    return [f"the producer's engines do not fit {shape.source}: it asks for {_asked(need)}, and {len(missing)} of "
            f"them cannot be placed; the cluster has {shape.describe()}. Start it with fewer engines "
            "(--engines) or on a cluster with room for them."]


def _asked(bundles: list[Bundle]) -> str:
    groups: dict[tuple[str, float, int, str], int] = {}
    for b in bundles:
        key = (b.role.rstrip("0123456789 "), b.cpus, b.gpus, b.custom)
        groups[key] = groups.get(key, 0) + 1
    parts = [f"{n} x {role} ({_amount(cpus, gpus)}{f', {custom}' if custom else ''})"
             for (role, cpus, gpus, custom), n in groups.items()]
    total_cpus, total_gpus = sum(b.cpus for b in bundles), sum(b.gpus for b in bundles)
    return f"{', '.join(parts)} = {_amount(total_cpus, total_gpus)}"


def _roles(bundles: list[Bundle]) -> str:
    names = [b.role for b in bundles]
    return ", ".join(names) if len(names) <= 4 else f"{', '.join(names[:3])}, ... {names[-1]}"


def _amount(cpus: float, gpus: float) -> str:
    return f"{cpus:g} CPU" + (f", {gpus:g} GPU" if gpus else "")


def _advice(cfg: RunConfig, shape: ClusterShape) -> str:
    """The flags that would make the run fit this cluster (or more nodes when none would)."""
    if uses_gpus(cfg.engine):
        engines = [b for b in demand(cfg) if not b.role.startswith("trainer")]
        free_gpus = sum(n.gpus for n in shape.nodes) - sum(b.gpus for b in engines)
        ranks = int(max(0, free_gpus))
        return (f"Lower --actor-num-nodes x --actor-num-gpus-per-node to at most {ranks} trainer ranks, or "
                "--rollout-num-engines / --eval-num-gpus, or give the cluster more GPU nodes.")
    ranks = cfg.train.actor_num_nodes * cfg.train.actor_num_gpus_per_node
    engines = cfg.engine.rollout_num_engines + eval_engine_count(cfg)
    cpus = max((n.cpus for n in shape.nodes), default=0.0)
    share = math.floor(100 * max(0.0, cpus - engines * cfg.run.num_cpus_per_engine) / max(1, ranks)) / 100
    hint = (f"set --num-cpus-trainer {share:g} (the largest share that fits {ranks} ranks beside "
            f"{engines} engine(s) of --num-cpus-per-engine {cfg.run.num_cpus_per_engine:g})" if share > 0
            else "lower --num-cpus-per-engine and --num-cpus-trainer")
    return f"On one machine, {hint}, or lower --actor-num-gpus-per-node / --rollout-num-engines."

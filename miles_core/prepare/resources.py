"""What a run asks of its Ray cluster, the cluster's shape, and whether the one fits the other.

    need = demand(cfg)                      # one Bundle per actor that reserves resources
    problems = fit_problems(cfg, shape)     # [] when every bundle finds a node; else what is short

A bundle is one actor's share of one node: an engine (its tensor-parallel GPUs on one node), a
trainer rank (one GPU on GPU clusters; a CPU rank process elsewhere), a dedicated eval engine. The
rollout manager reserves no CPU.

Placement rules (the driver's, driver/placement.py and engines/launcher.py, modelled here):

- GPU runs: the trainer's ranks are reserved first, one Ray placement group per trainer node
  (`--actor-num-gpus-per-node` bundles, STRICT_PACK: on one node), rank r in group
  r // `--actor-num-gpus-per-node`. Megatron's tensor-parallel groups are consecutive ranks and
  `--tensor-model-parallel-size` divides the ranks per node (a config rule), so no TP group crosses
  nodes. They go first because whole-node groups are the hardest to place: engines placed before
  them fragment the nodes (4 one-GPU engines spread over two 8-GPU workers leave no 6 GPUs on either).
  Then the rollout engines (one placement group, PACK: nodes filled in order; an engine is one
  bundle, so its GPUs are on one node), then dedicated eval engines (likewise).
- CPU runs (the CPU engine): as before, the engines (no placement group), then the ranks (one PACK
  placement group), then eval engines.

The check places the bundles in that order, each on the first node with room for it and with the
custom resource it asks for (a trainer node's bundles all on one node). A trainer placement group
that cannot be satisfied waits (600 s) and fails; engines that find no room wait for ever. Checking
first turns that wait into one refusal that names both sides.

The driver builds its Ray options from the same bundles (`engine_bundle`, `trainer_bundles`), so the
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
    group: str = ""  # bundles of one group (a trainer node's ranks) are placed on one node together


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


def trainer_bundle(cfg: RunConfig, role: str = "trainer rank", group: str = "") -> Bundle:
    return Bundle(role, cfg.run.num_cpus_trainer, 1 if uses_gpus(cfg.engine) else 0, cfg.engine.trainer_custom_resource,
                  group)


def trainer_bundles(cfg: RunConfig) -> list[Bundle]:
    """One bundle per rank; on GPU runs rank r belongs to trainer node r // --actor-num-gpus-per-node (a
    group placed on one node: its TP groups with it)."""
    t = cfg.train
    per_node = max(1, t.actor_num_gpus_per_node)
    gpus = uses_gpus(cfg.engine)
    return [trainer_bundle(cfg, f"trainer rank {r}", f"trainer node {r // per_node}" if gpus else "")
            for r in range(t.actor_num_nodes * t.actor_num_gpus_per_node)]


def eval_engine_count(cfg: RunConfig) -> int:
    """Mode-2 eval engines: --eval-num-gpus worth of engines (one engine on a CPU run)."""
    if cfg.eval.eval_mode != "dedicated" or cfg.eval.eval_num_gpus < 1:
        return 0
    per_engine = max(1, cfg.engine.rollout_num_gpus_per_engine) if uses_gpus(cfg.engine) else 1
    return max(1, cfg.eval.eval_num_gpus // per_engine)


def demand(cfg: RunConfig) -> list[Bundle]:
    """Every bundle of the run, in the order the driver asks Ray for them (GPU runs: the trainer's
    nodes first; CPU runs: the engines first)."""
    engines = [engine_bundle(cfg, f"engine {i}") for i in range(cfg.engine.rollout_num_engines)]
    ranks = trainer_bundles(cfg)
    evals = [engine_bundle(cfg, f"eval engine {i}") for i in range(eval_engine_count(cfg))]
    return ranks + engines + evals if uses_gpus(cfg.engine) else engines + ranks + evals


@dataclass
class _Free:
    node: Node
    cpus: float
    gpus: float
    holds: list[str] = field(default_factory=list)

    def take(self, group: list[Bundle]) -> bool:
        """Take every bundle of `group` on this node, or none."""
        cpus, gpus = sum(b.cpus for b in group), sum(b.gpus for b in group)
        if cpus > self.cpus + 1e-9 or gpus > self.gpus + 1e-9 or any(b.custom and b.custom not in self.node.custom
                                                                    for b in group):
            return False
        self.cpus, self.gpus = self.cpus - cpus, self.gpus - gpus
        self.holds.extend(b.role for b in group)
        return True


def _groups(bundles: list[Bundle]) -> list[list[Bundle]]:
    """`bundles` cut into what is placed together: consecutive bundles of one group, else one each."""
    out: list[list[Bundle]] = []
    for b in bundles:
        if b.group and out and out[-1][0].group == b.group:
            out[-1].append(b)
        else:
            out.append([b])
    return out


def placement(bundles: list[Bundle], shape: ClusterShape) -> list[int | None]:
    """The index in `shape.nodes` of the node each bundle lands on (None: no node has room), placing
    each group on the first node with room for all of it, in order."""
    free = [_Free(n, n.cpus, n.gpus) for n in shape.nodes]
    where: list[int | None] = []
    for group in _groups(bundles):
        node = next((i for i, f in enumerate(free) if f.take(group)), None)
        where.extend([node] * len(group))
    return where


def unplaced(bundles: list[Bundle], shape: ClusterShape) -> list[Bundle]:
    """The bundles that find no node (`placement`)."""
    return [b for b, node in zip(bundles, placement(bundles, shape)) if node is None]


def node_size_problems(cfg: RunConfig, shape: ClusterShape, *, trainer: bool = True) -> list[str]:
    """What can never fit one node of `shape`, whatever else runs: an engine's GPUs (its TP) or a
    trainer node's ranks (its TP groups) need more GPUs than the largest node has. Each names its flags."""
    if not uses_gpus(cfg.engine) or not shape.nodes:
        return []
    largest = max(n.gpus for n in shape.nodes)
    p = []
    tp_engine = engine_bundle(cfg).gpus
    if tp_engine > largest:
        p.append(f"an engine's {tp_engine} GPUs (--rollout-num-gpus-per-engine, SGLang's tensor-parallel size) must be "
                 f"on one node, and the largest node of {shape.source} has {largest:g} GPUs; lower "
                 "--rollout-num-gpus-per-engine or use bigger nodes.")
    t = cfg.train
    if trainer and t.actor_num_nodes * t.actor_num_gpus_per_node and t.actor_num_gpus_per_node > largest:
        tp = t.tensor_model_parallel_size
        p.append(f"the trainer's {t.actor_num_gpus_per_node} ranks per node (--actor-num-gpus-per-node) are placed "
                 f"on one node, so that no tensor-parallel group (--tensor-model-parallel-size {tp}) crosses nodes, "
                 f"and the largest node of {shape.source} has {largest:g} GPUs; set --actor-num-gpus-per-node to "
                 f"at most {largest:g} (a multiple of --tensor-model-parallel-size) and raise --actor-num-nodes.")
    return p


def fit_problems(cfg: RunConfig, shape: ClusterShape) -> list[str]:
    """[] when the run's bundles fit `shape`; else one problem naming what is asked, what is there and
    which flags would make it fit."""
    sizes = node_size_problems(cfg, shape)
    if sizes:
        return sizes
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
    sizes = node_size_problems(cfg, shape, trainer=False)
    if sizes:
        return sizes
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
        asked = cfg.train.actor_num_nodes * cfg.train.actor_num_gpus_per_node
        if asked <= ranks:  # the GPUs are there: the ranks' CPUs are not
            share = min((math.floor(100 * n.cpus / n.gpus) / 100 for n in shape.nodes if n.gpus), default=0.0)
            return (f"The GPUs are there but not the CPUs the trainer ranks reserve: set --num-cpus-trainer "
                    f"{share:g} or less (the CPUs per GPU of the smallest GPU node; default 4 on a GPU run), "
                    "or give the GPU nodes more CPUs.")
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

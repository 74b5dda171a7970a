"""What a run asks of its Ray cluster, checked against the cluster's shape before anything starts
(miles_core.prepare.resources).

Guards: `--actor-num-gpus-per-node 2` on a two-core machine waiting 600 s for a placement group that
can never be satisfied, and `--actor-num-gpus-per-node 8` beside an engine on the default 1 x 8-GPU
Flyte cluster doing the same after the engines started.
"""

from __future__ import annotations

import pytest

from miles_core.config import ConfigError, parse_flags
from miles_core.prepare.checks import validate
from miles_core.prepare.resources import ClusterShape, Node, demand, fit_problems

TWO_CORES = ClusterShape((Node("this machine", 2, 0),), "this machine's Ray instance")
FLYTE_DEFAULT = ClusterShape((Node("head", 4, 0), Node("gpu worker 0", 64, 8)), "the train task's Ray cluster")
SGLANG = ["--engine-backend", "sglang"]


def cfg(*flags):
    return parse_flags(["--preset", "tiny-reverse4", *list(flags)], check=False)


def test_the_embedded_default_fits_two_cores():
    assert fit_problems(cfg(), TWO_CORES) == []


def test_a_run_without_engines_asks_for_the_trainer_alone():
    """--rollout-num-engines 0 (producer jobs generate): no engine bundle; two CPU ranks fit two cores."""
    zero = cfg("--rollout-num-engines", "0", "--allow-rollout-producers", "--actor-num-gpus-per-node", "2")
    assert [b.role for b in demand(zero)] == ["trainer rank 0", "trainer rank 1"]
    assert fit_problems(zero, TWO_CORES) == []


def test_two_cpu_ranks_on_two_cores_are_refused_naming_the_share_that_fits():
    """Pins: 1 engine (1 CPU) + 2 ranks (1 CPU each) on 2 CPUs is refused, naming both sides and the
    --num-cpus-trainer that fits; with that share the run fits."""
    problems = fit_problems(cfg("--actor-num-gpus-per-node", "2"), TWO_CORES)
    assert len(problems) == 1
    assert "2 x trainer rank (1 CPU)" in problems[0] and "= 3 CPU" in problems[0]
    assert "this machine: 2 CPU" in problems[0] and "--num-cpus-trainer 0.5" in problems[0]
    assert fit_problems(cfg("--actor-num-gpus-per-node", "2", "--num-cpus-trainer", "0.5"), TWO_CORES) == []


def test_eight_trainer_gpus_beside_an_engine_do_not_fit_one_eight_gpu_worker():
    """The trainer's node is reserved first (whole), so the engine is the one left without room."""
    problems = fit_problems(cfg(*SGLANG, "--actor-num-gpus-per-node", "8"), FLYTE_DEFAULT)
    assert len(problems) == 1 and "= 33 CPU, 9 GPU" in problems[0] and "(engine 0)" in problems[0]
    assert "gpu worker 0: 64 CPU, 8 GPU" in problems[0] and "at most 7 trainer ranks" in problems[0]
    assert fit_problems(cfg(*SGLANG, "--actor-num-gpus-per-node", "7"), FLYTE_DEFAULT) == []


def test_an_engine_keeps_its_gpus_on_one_node():
    """Two nodes of 2 free GPUs each hold 4 GPUs, but not one 4-GPU engine (SGLang's TP is within a node):
    refused naming the flag and the node size."""
    two_small = ClusterShape((Node("a", 8, 2), Node("b", 8, 2)), "two small nodes")
    flags = [*SGLANG, "--rollout-num-gpus-per-engine", "4", "--actor-num-gpus-per-node", "0"]
    (problem,) = fit_problems(cfg(*flags), two_small)
    assert "an engine's 4 GPUs (--rollout-num-gpus-per-engine" in problem and "has 2 GPUs" in problem


def test_custom_resources_pin_roles_to_nodes():
    """Engines asking for `engine_node` go only where it is; the trainer fills the other nodes."""
    shape = ClusterShape((Node("head", 4, 0), Node("t0", 64, 8), Node("t1", 64, 8),
                          Node("e", 8, 2, frozenset({"engine_node"}))), "three workers")
    flags = [*SGLANG, "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "8", "--tensor-model-parallel-size", "2",
             "--rollout-num-engines", "2", "--engine-custom-resource", "engine_node"]
    assert fit_problems(cfg(*flags), shape) == []
    assert "engine 2" in fit_problems(cfg(*flags[:-4], "--rollout-num-engines", "3", *flags[-2:]), shape)[0]
    # A GPU rank reserves 4 CPUs by default: nodes of 2 CPUs per GPU are refused naming the flag that fits.
    lean = ClusterShape((Node("head", 4, 0), Node("t0", 16, 8), Node("t1", 16, 8),
                         Node("e", 8, 2, frozenset({"engine_node"}))), "three lean workers")
    (problem,) = fit_problems(cfg(*flags), lean)
    assert "trainer rank (4 CPU, 1 GPU)" in problem and "--num-cpus-trainer" in problem
    assert fit_problems(cfg(*flags, "--num-cpus-trainer", "2"), lean) == []


def test_dedicated_eval_engines_count():
    flags = [*SGLANG, "--actor-num-gpus-per-node", "6", "--eval-mode", "dedicated", "--eval-num-gpus", "2"]
    roles = [b.role for b in demand(cfg(*flags))]
    assert roles.count("eval engine 0") == 1 and sum(r.startswith("eval engine") for r in roles) == 2
    assert "eval engine 1" in fit_problems(cfg(*flags), FLYTE_DEFAULT)[0]


def test_validate_refuses_with_the_cluster_and_ignores_it_without():
    c = cfg(*SGLANG, "--actor-num-gpus-per-node", "8")
    validate(c)  # no cluster known: nothing to compare
    with pytest.raises(ConfigError, match="does not fit the train task's Ray cluster"):
        validate(c, cluster=FLYTE_DEFAULT)


def test_every_documented_remote_command_fits_the_default_train_cluster():
    """Pins: the `pyflyte run --remote ... --flags "..."` commands in docs/ fit the train task's default
    cluster. Guards: a documented command that the cluster it is documented for cannot place."""
    import re
    import shlex
    from pathlib import Path

    from tasks.cluster import TRAIN_CLUSTER

    docs = Path(__file__).resolve().parents[2] / "docs"
    commands = [m.group(1) for f in sorted(docs.glob("*.md"))
                for block in re.findall(r"```bash\n(.*?)```", f.read_text(), re.S) if "--remote" in block
                for m in re.finditer(r'--flags "([^"]*)"', block.replace("\\\n", " "))]
    assert len(commands) >= 2
    for flags in commands:
        assert fit_problems(parse_flags(["--preset", "tiny-reverse4", *shlex.split(flags)], check=False), TRAIN_CLUSTER) == [], flags


def test_a_producers_engines_are_checked_to_fit_before_they_start():
    """Pins: a producer job of 4 one-GPU engines fits an 8-GPU worker, not a 2-GPU spot worker: the
    problem names what is asked and what the cluster has. Guards: a producer waiting for ever for room
    Ray never has (EngineFleet.start was called unchecked)."""
    from miles_core.prepare.resources import producer_fit_problems

    cfg = parse_flags(["--preset", "tiny-reverse4", "--engine-backend", "sglang", "--allow-rollout-producers"])
    assert producer_fit_problems(cfg, 4, FLYTE_DEFAULT) == []
    spot = ClusterShape((Node("head", 4, 0), Node("spot worker", 16, 2)), "the producer's Ray cluster")
    (problem,) = producer_fit_problems(cfg, 4, spot)
    assert "the producer's engines do not fit the producer's Ray cluster" in problem
    assert "4 x producer engine" in problem and "2 of them cannot be placed" in problem and "fewer engines" in problem


TWO_WORKERS = ClusterShape((Node("head", 4, 0), Node("w0", 64, 8), Node("w1", 64, 8)), "two 8-GPU workers")


def _layout(c, shape=TWO_WORKERS) -> dict[str, str | None]:
    from miles_core.prepare.resources import placement

    need = demand(c)
    return {b.role: (shape.nodes[i].name if i is not None else None) for b, i in zip(need, placement(need, shape))}


def test_each_trainer_node_is_placed_whole_before_the_engines():
    """Pins: on two 8-GPU workers, 2 x 6 trainer ranks (TP 2) take one worker each and the 4 one-GPU engines
    the GPUs left (2 + 2); every TP group is inside one node. Guards: engines placed first (4 on w0 leave
    no 6 GPUs there) and ranks placed one by one (a trainer node, or a TP group, across two workers)."""
    where = _layout(cfg(*SGLANG, "--rollout-num-engines", "4", "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "6",
                        "--tensor-model-parallel-size", "2"))
    assert {where[f"trainer rank {r}"] for r in range(6)} == {"w0"}
    assert {where[f"trainer rank {r}"] for r in range(6, 12)} == {"w1"}
    assert [where[f"engine {i}"] for i in range(4)] == ["w0", "w0", "w1", "w1"]


def test_a_trainer_node_that_no_node_can_hold_is_refused_naming_the_flags():
    """Pins: 8 ranks per trainer node on 4-GPU workers are refused (not split over two), naming
    --actor-num-gpus-per-node, --tensor-model-parallel-size and the node size."""
    shape = ClusterShape((Node("head", 4, 0), Node("w0", 32, 4), Node("w1", 32, 4)), "two 4-GPU workers")
    c = cfg(*SGLANG, "--rollout-num-engines", "0", "--allow-rollout-producers", "--actor-num-gpus-per-node", "8",
            "--tensor-model-parallel-size", "4")
    (problem,) = fit_problems(c, shape)
    assert "8 ranks per node (--actor-num-gpus-per-node)" in problem and "--tensor-model-parallel-size 4" in problem
    assert "has 4 GPUs" in problem and "at most 4" in problem
    fits = cfg(*SGLANG, "--rollout-num-engines", "0", "--allow-rollout-producers", "--actor-num-nodes", "2",
               "--actor-num-gpus-per-node", "4", "--tensor-model-parallel-size", "4")
    assert fit_problems(fits, shape) == []


def test_free_gpus_scattered_over_nodes_do_not_hold_an_engine():
    """Pins: 2 x 5 trainer ranks and one 4-GPU engine (14 of 16 GPUs) are refused: each worker keeps 3 GPUs
    free. Guards: the old check, which placed the engine first and the ranks one by one, accepted it, and Ray
    then split a trainer node over both workers."""
    c = cfg(*SGLANG, "--rollout-num-engines", "1", "--rollout-num-gpus-per-engine", "4", "--actor-num-nodes", "2",
            "--actor-num-gpus-per-node", "5", "--tensor-model-parallel-size", "5")
    (problem,) = fit_problems(c, TWO_WORKERS)
    assert "(engine 0)" in problem
    assert fit_problems(cfg(*SGLANG, "--rollout-num-engines", "1", "--rollout-num-gpus-per-engine", "4",
                            "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "4"), TWO_WORKERS) == []


def test_a_tp_group_may_not_cross_a_trainer_node():
    """Pins: on GPU runs --tensor-model-parallel-size divides --actor-num-gpus-per-node (TP 4 over 2 x 6 ranks
    would put ranks 4-7 on two nodes); CPU runs keep the old rule (TP divides all ranks)."""
    flags = ["--actor-num-nodes", "2", "--actor-num-gpus-per-node", "6", "--tensor-model-parallel-size", "4"]
    with pytest.raises(ConfigError, match=r"--tensor-model-parallel-size=4 must divide the trainer's ranks per node "
                                          r"\(--actor-num-gpus-per-node=6\)"):
        parse_flags(["--preset", "tiny-reverse4", *SGLANG, *flags])
    parse_flags(["--preset", "tiny-reverse4", *flags])


def test_cpu_runs_place_as_before():
    """Pins: without GPUs the ranks are no group (one PACK placement group, after the engines)."""
    from miles_core.prepare.resources import trainer_bundles

    c = cfg("--actor-num-nodes", "2", "--actor-num-gpus-per-node", "2")
    assert [b.group for b in trainer_bundles(c)] == [""] * 4
    assert [b.role for b in demand(c)][0] == "engine 0"

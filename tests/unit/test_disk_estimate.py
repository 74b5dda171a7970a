"""The bytes a run writes per node, estimated before anything starts (miles_core.prepare.disk).

Pins: the estimate counts the model in the node cache, the pushed weight versions the cache may hold
at once (the one in use and the next), dedicated eval engines' snapshots, rank 0's temp file per
export and the checkpoint writers' shards of model + optimizer state staged on one node; validation
refuses a run whose estimate exceeds what each pod's node-local volume holds, naming every figure
and MILES_NODE_DISK_SIZE; a run whose model it could not read at validation is checked when it
starts, against the size its pod was registered with. Guards: a run that fills its node's disk
hours in (the pod evicted at the first checkpoint), with nothing said before it starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles_core.config import ConfigError, parse_flags
from miles_core.prepare.checks import check_disk, validate
from miles_core.prepare.disk import GIB, estimate
from tasks.cluster import train_cluster
from tasks.node_disk import node_disk

QWEN3_8B = json.loads((Path(__file__).resolve().parents[1] / "support" / "model_configs" / "qwen3-8b.json").read_text())
BF16_BYTES = 2 * 8_190_735_360  # Qwen3-8B in bf16: 15.26 GiB
# 2 x 8 GPUs: 4 one-GPU engines, 12 trainer ranks (TP 2 x DP 6)
TWO_BY_EIGHT = ["--engine-backend", "sglang", "--rollout-num-engines", "4", "--actor-num-nodes", "2",
                "--actor-num-gpus-per-node", "6", "--tensor-model-parallel-size", "2", "--max-seq-len", "4096",
                "--micro-batch-size", "1", "--use-distributed-optimizer"]


def cfg(*flags, model: str = ""):
    return parse_flags(["--preset", "tiny-reverse4", *(["--hf-checkpoint", model] if model else []), *flags],
                       check=False)


def test_qwen3_8b_on_two_nodes_of_eight_counts_each_thing_it_writes():
    est = estimate(QWEN3_8B, cfg(*TWO_BY_EIGHT), gpus_per_node=8)
    assert est.model == BF16_BYTES  # the model in the node cache
    assert est.weights == 2 * BF16_BYTES  # the version the engines serve and the one being fetched
    assert est.pushes == BF16_BYTES  # rank 0's temp file of one export
    assert est.snapshots == 0  # evals in their own pods
    assert est.checkpoint == 14 * 8_190_735_360  # both TP writers on one node: bf16 weights + 12 B/param of Adam
    assert 167 * GIB < est.total < 168 * GIB
    text = est.describe()
    assert text == "model 15.3, weights 30.5, pushes 15.3, checkpoint 106.8; total 167.8 GiB per node"
    doc = " ".join((Path(__file__).resolve().parents[2] / "docs" / "gpu-cluster.md").read_text().split())
    assert f'"{text}"' in doc, "docs/gpu-cluster.md gives another figure for this example"


def test_what_a_run_does_not_write_is_not_counted():
    distributed = estimate(QWEN3_8B, cfg(*TWO_BY_EIGHT, "--weight-transport", "distributed"), gpus_per_node=8)
    assert distributed.weights == 0 and distributed.pushes == BF16_BYTES  # NCCL; the eval snapshots' export
    shared = cfg(*TWO_BY_EIGHT, "--weight-transport", "distributed", "--eval-mode", "shared")
    assert estimate(QWEN3_8B, shared, gpus_per_node=8).pushes == 0  # nothing exported to the store at all
    assert estimate(QWEN3_8B, cfg(*TWO_BY_EIGHT, "--save", ""), gpus_per_node=8).checkpoint == 0
    dedicated = estimate(QWEN3_8B, cfg(*TWO_BY_EIGHT, "--eval-mode", "dedicated", "--eval-num-gpus", "1",
                                       "--eval-prompt-data", "d=s3://b/d.jsonl", "--eval-interval", "10"),
                         gpus_per_node=8)
    assert dedicated.snapshots == 2 * BF16_BYTES
    # TP 8 over 4-GPU nodes: each node stages half of the writers' shards
    wide = cfg("--engine-backend", "sglang", "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "8",
               "--tensor-model-parallel-size", "8")
    assert estimate(QWEN3_8B, wide, gpus_per_node=4).checkpoint == pytest.approx(14 * 8_190_735_360 / 2)


def test_validation_refuses_a_run_its_pods_disks_cannot_hold_naming_the_figures_and_the_knob(tmp_path, monkeypatch):
    monkeypatch.setenv("MILES_ENGINE_API_KEY", "k")  # two nodes: the engines listen on their node's address
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B))
    run = cfg(*TWO_BY_EIGHT, model=str(tmp_path))
    with pytest.raises(ConfigError) as e:
        validate(run, cluster=train_cluster(2, 8, node_disk("emptyDir", "100Gi")))
    message = str(e.value)
    for part in ("167.8 GiB per node", "model 15.3", "checkpoint 106.8", "100.0 GiB",
                 "MILES_NODE_DISK_SIZE=100Gi", "MILES_NODE_DISK_SIZE=168Gi"):
        assert part in message, f"{part!r} not in {message}"
    validate(run, cluster=train_cluster(2, 8, node_disk("emptyDir", "200Gi")))  # the default holds it
    validate(run, cluster=train_cluster(2, 8))  # a shape without a disk is not checked


def test_a_model_read_only_at_the_start_is_checked_against_the_registered_size(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B))
    run = cfg(*TWO_BY_EIGHT)
    check_disk(run, f"file://{tmp_path}")  # no MILES_NODE_DISK_SIZE (a local run): nothing to compare
    monkeypatch.setenv("MILES_NODE_DISK_SIZE", "100Gi")  # the pod templates set it
    with pytest.raises(ConfigError, match=r"MILES_NODE_DISK_SIZE=100Gi"):
        check_disk(run, f"file://{tmp_path}")
    monkeypatch.setenv("MILES_NODE_DISK_SIZE", "1Ti")
    check_disk(run, f"file://{tmp_path}")

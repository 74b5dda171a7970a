"""The bytes a run writes to one node's local disk, estimated before anything starts, against what
each pod's node-local volume holds (docs/gpu-cluster.md, "Node-local disks").

    est = estimate(hf_config, cfg, gpus_per_node=8)   # DiskEstimate, bytes on the busiest node
    est.describe()                                    # "model 15.3, weights 30.5, ...; total ... GiB per node"
    disk_problems(hf_config, cfg, NodeDisk(...), 8)   # [] or one problem naming the figures and the knob

What lands on a node's disk (the node cache `$MILES_CACHE_DIR` and the temp directory `$TMPDIR`,
both on the pod's node-local volume: tasks/node_disk.py), counted on the node that holds the most
of it (every role may share one node: the estimate is an upper bound). m is the model's size on disk
(its parameters at config.json's `torch_dtype`: 2 bytes in bf16), x the size of one export of the
trainer's weights (2 bytes/param on GPU or with --bf16, else 4):
- model: the model in the node cache (`models`: the trainer ranks and engines of a node share one
  copy), m;
- weights: with --weight-transport store, the pushed versions the cache may hold at once: the one
  the node's engines serve and the one being fetched (miles_core/storage/node_local.py keeps only
  the versions a live process holds, plus the newest), 2x; none over NCCL (`distributed`);
- snapshots: with --eval-mode dedicated, the eval engines' snapshot in use and the next, 2x
  (eval tasks run in pods of their own, each with its volume; shared evals read the pushed weights);
- pushes: rank 0 writes each export to a temp file before it uploads it (a store-transport push,
  an eval snapshot, --save-hf), one at a time, x;
- checkpoint: each TP (and EP) rank's DP-rank-0 replica stages its shard of the model (w
  bytes/param) and of its optimizer state (the fp32 master copy and Adam's m and v, 12 bytes/param
  in bf16, 8 in fp32, gathered whole on the writer) in a temp file before the upload; the writers
  are consecutive ranks, so one node holds min(1, GPUs per node / (TP x EP)) of the whole.
Not counted: the image, Ray's logs and object spilling under /tmp/ray, the engines' own logs.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields

from miles_core.config import RunConfig
from miles_core.models.families import spec_of

GIB = 1024 ** 3
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
SIZE_VARIABLE = "MILES_NODE_DISK_SIZE"
_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}


@dataclass(frozen=True)
class NodeDisk:
    """What each pod's node-local volume holds, and where that figure was set (for the message)."""
    bytes: float
    source: str  # "MILES_NODE_DISK_SIZE=200Gi (emptyDir)"


@dataclass(frozen=True)
class DiskEstimate:
    model: float
    weights: float
    snapshots: float
    pushes: float
    checkpoint: float

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))

    def describe(self) -> str:
        parts = ", ".join(f"{f.name} {getattr(self, f.name) / GIB:.1f}" for f in fields(self) if getattr(self, f.name))
        return f"{parts}; total {self.total / GIB:.1f} GiB per node"


def parse_size(text: str, name: str = SIZE_VARIABLE) -> float:
    """Bytes of a Kubernetes quantity such as 800Gi, 1Ti or 500G; ValueError naming `name` otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(|k|M|G|T|P|Ki|Mi|Gi|Ti|Pi)\s*", text or "")
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"{name}: {text!r} is not a size (a Kubernetes quantity such as 800Gi, 2Ti or 500G)")
    return float(match.group(1)) * _UNITS[match.group(2)]


def node_disk_from_env() -> NodeDisk | None:
    """The size the pod templates give this pod's volume (they set MILES_NODE_DISK_SIZE); None outside
    such a pod (a local run): nothing to compare."""
    size = os.environ.get(SIZE_VARIABLE)
    if not size:
        return None
    return NodeDisk(parse_size(size), f"{SIZE_VARIABLE}={size} ({os.environ.get('MILES_NODE_DISK', 'emptyDir')})")


def _export_width(cfg: RunConfig) -> int:
    return 2 if cfg.engine.engine_backend == "sglang" or cfg.train.bf16 else 4


def _exports(cfg: RunConfig) -> bool:
    """Rank 0 writes a temp file of the whole model: store pushes, eval snapshots, --save-hf."""
    e = cfg.eval
    snapshots = bool(e.eval_prompt_data) and e.eval_interval is not None and e.eval_mode != "shared"
    return cfg.engine.weight_transport == "store" or snapshots or bool(cfg.train.save_hf)


def estimate(hf_config: dict, cfg: RunConfig, gpus_per_node: int | None = None) -> DiskEstimate:
    """Bytes on the busiest node (module docstring); `gpus_per_node` None: one node may hold every
    checkpoint writer."""
    spec = spec_of(hf_config)
    t = cfg.train
    params = spec.parameters()
    model = DTYPE_BYTES.get(str(hf_config.get("torch_dtype", "bfloat16")), 2) * params
    x = _export_width(cfg) * params
    checkpoint = 0.0
    if t.save:
        width = _export_width(cfg)
        per_param = width + (12 if width == 2 else 8)
        tp, ep = max(1, t.tensor_model_parallel_size), max(1, t.expert_model_parallel_size)
        experts = spec.expert_parameters()
        writers = (tp, tp * ep)  # dense shards, expert shards
        share = [1.0 if not gpus_per_node else min(1.0, gpus_per_node / w) for w in writers]
        checkpoint = per_param * ((params - experts) * share[0] + experts * share[1])
    return DiskEstimate(
        model=float(model),
        weights=2.0 * x if cfg.engine.weight_transport == "store" else 0.0,
        snapshots=2.0 * x if cfg.eval.eval_mode == "dedicated" and cfg.eval.eval_num_gpus > 0 else 0.0,
        pushes=float(x) if _exports(cfg) else 0.0,
        checkpoint=checkpoint)


def disk_problems(hf_config: dict, cfg: RunConfig, disk: NodeDisk, gpus_per_node: int | None = None) -> list[str]:
    """[] when the estimate fits `disk`; else one problem with every figure and what would fit."""
    est = estimate(hf_config, cfg, gpus_per_node)
    if est.total <= disk.bytes:
        return []
    need = -(-est.total // GIB)
    fixes = [f"register the tasks with {SIZE_VARIABLE}={need:.0f}Gi or more (and MILES_NODE_DISK=/path for a "
             "node-local SSD when the nodes' ephemeral storage is smaller)"]
    if est.weights:
        fixes.append("--weight-transport distributed (no pushed versions in the cache)")
    return [f"the run may write about {est.total / GIB:.1f} GiB to one node's disk ({est.describe()}: the model "
            f"in the node cache, the pushed weight versions it may hold at once, eval snapshots, rank 0's temp file "
            f"per export, the checkpoint writers' shards of model and optimizer state), and each pod's node-local "
            f"volume holds {disk.bytes / GIB:.1f} GiB ({disk.source}); past it the pod is evicted. "
            f"To fit: {' or '.join(fixes)}."]

"""Bytes the driver and each trainer rank receive per step, before and after batches travel by reference.

    .venv/bin/python bench/driver_bytes.py

Before: the rollout manager returned the whole drained batch to the driver (deserialized there), which
put it in the object store again, and every rank read all of it. After (miles_core.rank_batches): the
manager cuts the batch into one part per data-parallel rank and puts each in the object store; the
driver receives the group ids, metrics and the references (serialized as Ray serializes an actor's
return value), and each rank reads its own part. Sizes are Ray's serialization of the same objects
(`ray._private.serialization`), measured for three shapes: the embedded default (32 x 8 samples of
5 + 5 tokens), the real-model preset (8 x 4 of ~60 + 16) and a production step (64 x 8 of 1k + 3k
tokens with rollout log-probs), at DP 4.
"""

from __future__ import annotations

import random

import ray

from miles_core.rank_batches import DataLayout, TrainBatch, split_rollout
from miles_core.rollout.drain import DrainedBatch
from miles_core.samples import Group, Sample, SampleStatus

SHAPES = {"embedded default": (32, 8, 5, 5), "real-model preset": (8, 4, 60, 16),
          "production step": (64, 8, 1024, 3072)}
DP = 4


def groups(n_groups: int, n: int, prompt: int, response: int) -> list[Group]:
    rng = random.Random(0)
    out = []
    for g in range(n_groups):
        p = [rng.randrange(50000) for _ in range(prompt)]
        samples = [Sample(f"e0-p{g}-a0", g, i, p, [rng.randrange(50000) for _ in range(response)],
                          [rng.uniform(-5, 0) for _ in range(response)], [1] * response, [1] * response,
                          reward=rng.random(), status=SampleStatus.COMPLETED) for i in range(n)]
        out.append(Group(f"e0-p{g}-a0", g, samples))
    return out


def size(obj) -> int:
    ctx = ray._private.worker.global_worker.get_serialization_context()
    return len(ctx.serialize(obj).to_bytes())


def main() -> None:
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        print(f"{'shape':<20} {'driver before':>14} {'driver after':>13} {'ratio':>8} {'rank before':>12} "
              f"{'rank after':>11}")
        for name, shape in SHAPES.items():
            gs = groups(*shape)
            ids, metrics = [g.group_id for g in gs], {"rollout/reward/mean": 0.5}
            before = size(DrainedBatch(gs, ids, metrics, {}))
            parts = split_rollout(gs, DataLayout(DP), optimizer_steps=1, balance=False, normalize_std=True)
            refs = [ray.put(p) for p in parts]
            after = size(TrainBatch(ids, metrics, {}, refs))
            rank_after = max(size(p) for p in parts)
            print(f"{name:<20} {before:>14,} {after:>13,} {before / after:>7.0f}x {before:>12,} {rank_after:>11,}")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()

"""The gradient norm and clip over a tensor-parallel group (miles_core.train.data_parallel.clip_grad_norm),
exactly, on a real TP group of two: two processes, torch.distributed over gloo on CPU (no Megatron).

Pins: with parameters marked `tensor_model_parallel` (each rank holds one shard) and replicated
ones (identical on every TP rank), the norm every rank returns is the norm of the whole unsharded
model, i.e. sqrt(sum of the shards' squares + the replicated squares counted once), to 1e-9
relative in float64, equal to `torch.nn.utils.clip_grad_norm_` over the unsharded parameters in one
process, and every rank's gradients are scaled by the same clip coefficient.

Guards: replicated parameters counted once per TP rank (their squares all-reduced with the shards',
or the whole sum reduced), and sharded squares not reduced at all (each rank's own shard only),
and a CPU tensor handed to the TP all-reduce (the group stands for NCCL: tests/support/strict_device.py).
The replicated gradients here dominate (x10), so the first regression is off by ~sqrt(2) and the
second by ~0.5% of the norm, both far outside the tolerance; the integration test on a real
TP=2 Llama (tests/integration/test_trainer_ranks.py) saw the first only as 1.08e-4 against 1e-4.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tests.support import strict_device as strict

TP = 2
MAX_NORM = 1.0
RTOL = 1e-9


def _full_grads() -> dict[str, torch.Tensor]:
    """The unsharded model's gradients (float64, the same in every process): two sharded weights
    (column-parallel split on dim 0, row-parallel on dim 1) and replicated norm weights/biases."""
    g = torch.Generator().manual_seed(1234)
    rnd = lambda *shape, scale=1.0: torch.randn(*shape, generator=g, dtype=torch.float64) * scale  # noqa: E731
    return {
        "column.weight": rnd(8, 6),
        "row.weight": rnd(6, 10),
        "norm.weight": rnd(6, scale=10.0),
        "norm.bias": rnd(6, scale=10.0),
        "final_norm.weight": rnd(6, scale=10.0),
    }


SHARD_DIM = {"column.weight": 0, "row.weight": 1}  # the others are replicated


def _rank_params(rank: int) -> list[torch.nn.Parameter]:
    """This TP rank's parameters, as Megatron lays them out: its shard of each sharded weight
    (marked `tensor_model_parallel`), a full copy of each replicated one."""
    out = []
    for name, grad in _full_grads().items():
        if name in SHARD_DIM:
            grad = grad.chunk(TP, dim=SHARD_DIM[name])[rank].contiguous()
        p = torch.nn.Parameter(torch.zeros_like(grad))
        p.grad = grad.clone()
        if name in SHARD_DIM:
            p.tensor_model_parallel = True
        out.append(p)
    return out


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    from miles_core.train.data_parallel import clip_grad_norm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=TP)
    strict.enforce_device_rule("cuda", [None])  # the TP group stands for NCCL: CPU tensors are refused
    try:
        params = _rank_params(rank)
        total = clip_grad_norm(params, MAX_NORM, dist.group.WORLD)
        torch.save({"total": total, "grads": [p.grad for p in params]}, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_tp_grad_norm_counts_shards_summed_and_replicated_params_once(tmp_path):
    """Pins the TP grad norm/clip exactly (see the module docstring); guards against replicated
    parameters being counted once per TP rank."""
    full = _full_grads()
    sq_sharded = sum(float(full[n].pow(2).sum()) for n in SHARD_DIM)
    sq_replicated = sum(float(v.pow(2).sum()) for n, v in full.items() if n not in SHARD_DIM)
    exact = math.sqrt(sq_sharded + sq_replicated)
    # the data discriminate: each known regression misses the exact norm by far more than RTOL
    per_rank_replicated = math.sqrt(sq_sharded + TP * sq_replicated)
    assert per_rank_replicated / exact - 1 > 0.3
    local_shard_only = math.sqrt(sum(float(_rank_params(0)[i].grad.pow(2).sum()) for i in range(2)) + sq_replicated)
    assert abs(local_shard_only / exact - 1) > 1e-3

    ref = [torch.nn.Parameter(torch.zeros_like(v)) for v in full.values()]
    for p, v in zip(ref, full.values()):
        p.grad = v.clone()
    torch_norm = float(torch.nn.utils.clip_grad_norm_(ref, MAX_NORM))
    assert torch_norm == pytest.approx(exact, rel=RTOL)

    init_file = tmp_path / "pg"
    mp.spawn(_worker, args=(str(init_file), str(tmp_path)), nprocs=TP, join=True)
    coef = MAX_NORM / (exact + 1e-6)
    assert coef < 0.1  # the clip applies
    for rank in range(TP):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["total"] == pytest.approx(exact, rel=RTOL), (
            f"rank {rank}: TP grad norm {got['total']!r}, exact single-rank norm {exact!r} "
            f"(replicated counted once per TP rank would give {per_rank_replicated!r})")
        for p, g in zip(_rank_params(rank), got["grads"]):
            torch.testing.assert_close(g, p.grad * coef, rtol=RTOL, atol=0.0)

"""How a batch is split across data-parallel ranks (miles_core.train.data_parallel.shard).

Pins: the shards of all ranks partition the batch (nothing lost or duplicated) and keep batch order;
the default split gives sample counts differing by at most one; --balance-data gives token counts
differing by at most the longest sample and never worse than the default split on skewed lengths.
"""

from __future__ import annotations

import random

import pytest
import torch

from miles_core.rank_batches import shard
from miles_core.train.data_parallel import clip_grad_norm


def _lengths(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice([rng.randint(1, 8), rng.randint(50, 400)]) for _ in range(n)]


@pytest.mark.parametrize("balance", [False, True])
@pytest.mark.parametrize("dp,n", [(1, 7), (2, 7), (3, 10), (4, 3), (2, 0)])
def test_shards_partition_the_batch_in_order(dp, n, balance):
    items = list(range(n))
    lengths = _lengths(n, n)
    parts = [shard(items, dp, r, balance, tokens=lambda i: lengths[i]) for r in range(dp)]
    assert sorted(i for p in parts for i in p) == items
    assert all(p == sorted(p) for p in parts)
    if not balance:
        assert max(map(len, parts)) - min(map(len, parts)) <= 1


@pytest.mark.parametrize("seed", range(5))
def test_balance_data_evens_out_tokens(seed):
    lengths = _lengths(seed, 32)
    tok = lambda i: lengths[i]  # noqa: E731
    load = lambda parts: [sum(lengths[i] for i in p) for p in parts]  # noqa: E731
    balanced = load([shard(range(32), 4, r, True, tokens=tok) for r in range(4)])
    plain = load([shard(range(32), 4, r, False, tokens=tok) for r in range(4)])
    assert max(balanced) - min(balanced) <= max(lengths)
    assert max(balanced) <= max(plain)


def test_clip_grad_norm_matches_torch_on_one_rank():
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4))
    a.grad, b.grad = torch.randn(5, 3) * 3, torch.randn(4) * 3
    ref = [p.detach().clone().requires_grad_() for p in (a, b)]
    for r, p in zip(ref, (a, b)):
        r.grad = p.grad.clone()
    want = float(torch.nn.utils.clip_grad_norm_(ref, 1.0))
    assert clip_grad_norm([a, b], 1.0, None) == pytest.approx(want, rel=1e-6)
    assert torch.allclose(a.grad, ref[0].grad) and torch.allclose(b.grad, ref[1].grad)

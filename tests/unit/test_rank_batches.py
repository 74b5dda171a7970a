"""A rollout cut into the trainer's data-parallel parts on the rollout side (miles_core.rank_batches).

Pins: the parts of every DP size hold each trainable sample exactly once, in batch order within a
part, with the advantage the whole group gives it; every part carries each optimizer step's loss
tokens over the whole rollout (the loss normaliser that makes DP=N the DP=1 update) and the
rollout's sample count; --balance-data evens token loads; a tensor-parallel peer reads its DP rank's
part.
"""

from __future__ import annotations

import pytest

from miles_core.rank_batches import DataLayout, RankBatchError, sequence_length, split_rollout, trainable_samples
from miles_core.samples import SampleStatus
from tests.unit.test_train import make_groups


def _key(item):
    s, adv = item
    return s.group_id, s.sample_index, adv


@pytest.mark.parametrize("dp_size", [1, 2, 3])
@pytest.mark.parametrize("balance", [False, True])
@pytest.mark.parametrize("steps", [1, 2])
def test_parts_hold_every_trainable_sample_once_with_global_tokens(dp_size, balance, steps):
    groups = make_groups(n_groups=5, n=4, seed=3)
    groups[1].samples[0].status = SampleStatus.FAILED  # excluded from training, and from the token count
    everything = trainable_samples(groups, True)
    parts = split_rollout(groups, DataLayout(dp_size), optimizer_steps=steps, balance=balance, normalize_std=True)
    assert [p.dp_rank for p in parts] == list(range(dp_size))
    assert all(p.samples == len(everything) == 19 for p in parts)
    assert all(len(p.steps) == steps for p in parts)
    for k in range(steps):
        got = [it for p in parts for it in p.steps[k].items]
        tokens = {p.steps[k].tokens for p in parts}
        assert len(tokens) == 1  # the same global count on every rank
        assert tokens.pop() == sum(len(s.response_ids) for s, _ in got)
        for p in parts:  # batch order inside a part
            order = [everything.index(it) for it in p.steps[k].items]
            assert order == sorted(order)
    assert sorted(_key(it) for p in parts for st in p.steps for it in st.items) == sorted(map(_key, everything))


def test_balance_data_evens_the_token_loads():
    groups = make_groups(n_groups=8, n=4, seed=5)
    loads = {}
    for balance in (False, True):
        parts = split_rollout(groups, DataLayout(2), optimizer_steps=1, balance=balance, normalize_std=True)
        per_rank = [sum(sequence_length(s) for s, _ in p.steps[0].items) for p in parts]
        loads[balance] = abs(per_rank[0] - per_rank[1])
    longest = max(sequence_length(s) for g in groups for s in g.samples)
    assert loads[True] <= longest and loads[True] <= loads[False]


def test_tensor_parallel_peers_read_their_dp_ranks_part():
    layout = DataLayout.of(world_size=8, tp=2)
    assert layout.dp_size == 4 and [layout.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(RankBatchError, match="do not divide"):
        DataLayout.of(world_size=3, tp=2)


def test_the_driver_hands_each_rank_the_part_of_its_data_parallel_rank():
    """TrainerGroup.train_parts, with TP 2 x DP 2: ranks 0 and 1 (one tensor-parallel group) both get DP
    part 0, ranks 2 and 3 part 1 (tensor-parallel peers must train on the same data); a list of parts
    that is not one per DP rank is refused."""
    from miles_core.driver.placement import TrainerGroup

    class Rank:
        def __init__(self):
            self.train_part = self
            self.got = None

        def remote(self, step, part):
            self.got = (step, part)
            return part

    group = object.__new__(TrainerGroup)
    group.layout, group.actors = DataLayout.of(world_size=4, tp=2), [Rank() for _ in range(4)]
    group.train_parts(7, ["part-0", "part-1"])
    assert [a.got for a in group.actors] == [(7, "part-0"), (7, "part-0"), (7, "part-1"), (7, "part-1")]
    with pytest.raises(ValueError, match="3 data-parallel parts for a trainer of DP size 2"):
        group.train_parts(7, ["a", "b", "c"])


def test_a_part_on_a_rank_with_no_samples_still_has_the_steps_first_item():
    """Under expert parallelism a rank without samples runs idle micro-batches: it needs a stand-in sample."""
    groups = make_groups(n_groups=1, n=2, seed=1)
    parts = split_rollout(groups, DataLayout(4), optimizer_steps=1, balance=False, normalize_std=True)
    empty = [p for p in parts if not p.steps[0].items]
    assert empty and all(p.steps[0].first is not None for p in empty)


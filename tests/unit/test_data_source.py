"""The data source: group shape, seeded order, recycle queue, durable cursor and resume skip set."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_core.buffer import cleared_group
from miles_core.rollout.data_source import DataSource, DataSourceError, position_of


def rows(k=5):
    return [{"prompt": [i, i + 1, 10], "label": str(i), "task": "reverse4", "metadata": json.dumps({"src": i})}
            for i in range(k)]


def test_group_has_n_copies_unique_id_and_position_metadata():
    """Pins the group shape: n samples of one prompt, a group id unique per attempt, and each
    sample's metadata carrying epoch/position (the resume key) plus the row's task and metadata."""
    ds = DataSource(rows(), 3, seed=7)
    g = ds.next_group()
    assert len(g.samples) == 3 and [s.sample_index for s in g.samples] == [0, 1, 2]
    assert g.group_id == "e0-p0-a0" and all(s.group_id == g.group_id for s in g.samples)
    row = rows()[g.prompt_index]
    meta = json.loads(g.samples[0].metadata)
    assert meta == {"epoch": 0, "position": 0, "attempt": 0, "task": "reverse4", "src": g.prompt_index}
    assert g.samples[0].prompt_ids == row["prompt"] and g.samples[0].label == row["label"]
    assert position_of(g) == (0, 0, 0)
    assert len({ds.next_group().group_id for _ in range(12)}) == 12


def test_epochs_cover_every_row_once_in_a_seeded_order():
    """Each epoch serves every row exactly once; the shuffled order depends on (seed, epoch) only."""
    a, b = DataSource(rows(6), 1, seed=3), DataSource(rows(6), 1, seed=3)
    first = [a.next_group().prompt_index for _ in range(12)]
    assert sorted(first[:6]) == list(range(6)) and sorted(first[6:]) == list(range(6))
    assert first == [b.next_group().prompt_index for _ in range(12)]
    assert first[:6] != first[6:] or first[:6] != list(range(6))
    plain = DataSource(rows(6), 1, shuffle=False)
    assert [plain.next_group().prompt_index for _ in range(6)] == list(range(6))


def test_recycled_prompt_is_served_first_under_the_next_attempt():
    """Pins the retry path: the buffer's RetryUnused hands back a cleared group (renamed g#r1);
    the source serves that same prompt next, as attempt 1, before any new position."""
    ds = DataSource(rows(), 2, seed=1)
    g0, g1 = ds.next_group(), ds.next_group()
    ds.recycle(cleared_group(g0))
    again = ds.next_group()
    assert again.prompt_index == g0.prompt_index and again.group_id == "e0-p0-a1"
    assert [s.prompt_ids for s in again.samples] == [s.prompt_ids for s in g0.samples]
    assert ds.next_group().group_id == "e0-p2-a0"
    with pytest.raises(DataSourceError, match="no epoch/position"):
        foreign = cleared_group(g1)
        for s in foreign.samples:
            s.metadata = "{}"
        ds.recycle(foreign)


def test_state_round_trips_through_json_and_continues_identically():
    """The cursor state is JSON-able and a restored source serves what the original would have."""
    ds = DataSource(rows(7), 2, seed=5)
    for _ in range(9):
        ds.settled(ds.next_group())
    state = json.loads(json.dumps(ds.state()))
    twin = DataSource(rows(7), 2)
    twin.restore(state)
    assert [twin.next_group().group_id for _ in range(8)] == [ds.next_group().group_id for _ in range(8)]


def test_restore_reserves_lost_in_flight_groups_and_skips_committed_ones():
    """Pins resume: groups in flight at the checkpoint are served again unless the buffer holds
    them; positions past the cursor that the buffer holds are skipped; nothing twice, nothing lost."""
    ds = DataSource(rows(10), 1, shuffle=False)
    served = [ds.next_group() for _ in range(4)]
    ds.settled(served[0])
    ds.settled(served[1])
    state = ds.state()  # outstanding: positions 2, 3; cursor at 4
    # After the checkpoint, position 3 and positions 4, 6 were committed before the crash.
    twin = DataSource(rows(10), 1, shuffle=False)
    report = twin.restore(state, committed={(0, 3), (0, 4), (0, 6)})
    assert report.reserved_outstanding == 1 and report.committed_outstanding == 1
    assert report.committed_beyond_checkpoint == 2
    got = [twin.next_group().group_id for _ in range(5)]
    assert got == ["e0-p2-a0", "e0-p5-a0", "e0-p7-a0", "e0-p8-a0", "e0-p9-a0"]


def test_restore_refuses_a_different_dataset():
    ds = DataSource(rows(4), 1)
    with pytest.raises(DataSourceError, match="same --prompt-data"):
        DataSource(rows(5), 1).restore(ds.state())


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31), st.integers(1, 3))
def test_exactly_once_across_random_crashes(seed, crashes):
    """Property (docs/architecture.md): serving, committing, recycling (retry) and crashing at random
    points, with a restore from the last checkpoint plus the buffer's committed set, every
    position of the first epochs is committed exactly once."""
    rng = random.Random(seed)
    n_rows = 8
    committed: dict[tuple[int, int], str] = {}  # the durable buffer: position -> group id
    duplicates = []
    ds = DataSource(rows(n_rows), 1, seed=seed)
    checkpoint = ds.state()
    for segment in range(crashes + 1):
        in_flight = []
        for _ in range(rng.randint(3, 12)):
            in_flight.append(ds.next_group())
            while in_flight and rng.random() < 0.5:
                g = in_flight.pop(rng.randrange(len(in_flight)))
                if rng.random() < 0.2:  # aborted: rejected at put, retried
                    ds.recycle(cleared_group(g))
                    continue
                pos = position_of(g)[:2]
                if pos in committed:
                    duplicates.append(pos)
                committed[pos] = g.group_id
                ds.settled(g)
            if rng.random() < 0.3:
                checkpoint = ds.state()
        if segment < crashes:  # crash: in-flight groups are lost; resume from the last checkpoint
            ds = DataSource(rows(n_rows), 1, seed=seed)
            ds.restore(checkpoint, committed={p for p in committed})
    for g in in_flight:  # the last segment ends cleanly: its in-flight groups commit
        pos = position_of(g)[:2]
        if pos in committed:
            duplicates.append(pos)
        committed[pos] = g.group_id
        ds.settled(g)
    # drain the rest of the first epoch
    for _ in range(200):
        if all((0, p) in committed for p in range(n_rows)):
            break
        g = ds.next_group()
        pos = position_of(g)[:2]
        if pos in committed:
            duplicates.append(pos)
        committed[pos] = g.group_id
        ds.settled(g)
    assert not duplicates
    assert all((0, p) in committed for p in range(n_rows))

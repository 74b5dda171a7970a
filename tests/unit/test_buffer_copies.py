"""A copy of a consumed group object is never served again by a reopened buffer (miles_core.buffer.durable).

A reopen does not read the objects consumed entirely (the compaction record names them by writer and seq), so
a copy of one under another key (a restore, a copy by hand: the same bytes under the writer's next seq, or
under a name that is not a group object's) holds group ids it does not know as consumed. Guards: such a copy's
groups trained twice; a rejected prompt's retry (the next attempt) refused; the compaction record losing the
prompts trained before it.
"""

from __future__ import annotations

import json

import pytest

from miles_core.buffer import BufferTimeout, DropUnused
from miles_core.buffer.durable import DurableBuffer, TrainedPrompts
from miles_core.buffer.inspect import inspect_buffer
from miles_core.samples import Group, Sample, SampleStatus
from miles_core.storage import Store

STALE_GET_SECONDS = 0.2  # a get that finds only a stale group: it rejects it and times out


def group(position: int, attempt: int = 0, epoch: int = 0) -> Group:
    gid = f"e{epoch}-p{position}-a{attempt}-trainer"
    meta = json.dumps({"epoch": epoch, "position": position, "attempt": attempt})
    return Group(gid, position, [Sample(gid, position, j, [1, 2], [3], [-0.1], [1], [1], 0.5,
                                        SampleStatus.COMPLETED, "stop", "{}", meta) for j in range(2)])


@pytest.fixture
def store(tmp_path):
    return Store(f"file://{tmp_path}/run")


def reopen(store: Store, step: int) -> DurableBuffer:
    return DurableBuffer.open(store, capacity_groups=16, unused_handler=DropUnused(), consumed_through_step=step)


def trained_run(store: Store, compact: bool) -> list[str]:
    """Groups of positions 0..5, one object each; step 0 trains positions 0 and 1, step 1 positions 2 and 3;
    compacted through step 1 when asked. The object keys, in commit order."""
    with reopen(store, -1) as buf:
        for i in range(6):
            buf.put(group(i))
        for step in range(2):
            buf.record_consumed(step, [buf.get().group_id, buf.get().group_id])
        if compact:
            buf.compact(1)
    return store.list("buffer/groups/")


@pytest.mark.parametrize("compact", [True, False], ids=["compacted", "manifests-only"])
def test_a_copy_of_a_consumed_object_under_the_next_seq_is_not_served(store, compact):
    keys = trained_run(store, compact)
    writer_dir = keys[0].rsplit("/", 1)[0]
    store.put_bytes(f"{writer_dir}/000000000006.arrow", store.get_bytes(keys[0]))  # position 0 again
    with reopen(store, 1) as buf:
        assert buf.available_group_ids() == ["e0-p4-a0-trainer", "e0-p5-a0-trainer"]
        buf.record_consumed(2, [buf.get().group_id, buf.get().group_id])
        buf.compact(2)
    record = store.get_json("buffer/compacted/upto_00000002.json")
    assert record["trained_positions"] == {"0": [[0, 5]]}
    assert record["objects_done"] == {writer_dir.rsplit("/", 1)[1]: [[0, 6]]}  # the copy is done with
    with reopen(store, 2) as buf:
        assert buf.available_group_ids() == []


def test_a_file_that_is_not_a_group_object_is_never_read(store):
    keys = trained_run(store, compact=True)
    store.put_bytes(keys[1].replace(".arrow", ".copy.arrow"), store.get_bytes(keys[1]))
    store.put_bytes("buffer/groups/notes.txt", b"restored from the 2am backup")
    with reopen(store, 1) as buf:
        assert buf.available_group_ids() == ["e0-p4-a0-trainer", "e0-p5-a0-trainer"]
        assert buf.quarantined_total == 0  # not read at all, so not quarantined either
    counts = inspect_buffer(store.root_uri)
    assert (counts["objects"], counts["committed"], counts["consumed"]) == (6, 6, 4)


def test_a_retry_of_a_rejected_prompt_is_served(store):
    """Only trained prompts are skipped: a group rejected at get (too stale) is retried as the next attempt of
    its prompt, and that retry is served after a reopen."""
    with DurableBuffer.open(store, capacity_groups=16, unused_handler=DropUnused(), consumed_through_step=-1,
                            max_weight_staleness=0) as buf:
        buf.put(group(0))
        with pytest.raises(BufferTimeout):
            buf.get(current_version=5, timeout_seconds=STALE_GET_SECONDS)  # stale: rejected
        buf.record_consumed(0, [])
        buf.compact(0)
        buf.put(group(0, attempt=1))
    assert store.get_json("buffer/consumed/00000000.json")["rejected"] == ["e0-p0-a0-trainer"]
    assert store.get_json("buffer/compacted/upto_00000000.json")["trained_positions"] == {}
    with reopen(store, 0) as buf:
        assert buf.available_group_ids() == ["e0-p0-a1-trainer"]


def test_trained_prompts_merge_into_few_ranges():
    trained = TrainedPrompts({"0": [[0, 3]], "1": [[0, 0]]})
    trained.add_ids(["e0-p5-a0-trainer", "e0-p4-a1-prod", "e0-p9-a0-trainer", "e2-p0-a0", "g0001"])
    assert trained.has(0, 4) and trained.has(0, 9) and trained.has(1, 0) and not trained.has(0, 6)
    assert trained.ranges() == {"0": [[0, 5], [9, 9]], "1": [[0, 0]], "2": [[0, 0]]}
    assert trained.has(0, 5) and not trained.has(0, 8) and not trained.has(3, 0)

"""The trainer's buffer takes in groups other writers (producer jobs) commit to the run root
(miles_core.buffer.durable `foreign_poll_seconds`), and a producer's writer commits without serving
(`index_commits=False`).

Guards: a producer's groups never reaching the trainer (or reaching it twice), a duplicate prompt
attempt from a block taken over being trained twice, a retry (next attempt) refused as a duplicate,
a producer's writer that fills up because nothing ever gets from it, the consumption manifest not
saying whose groups were consumed.
"""

from __future__ import annotations

import json
import time

import pytest

from miles_core.buffer import DropUnused
from miles_core.buffer.durable import DurableBuffer
from miles_core.buffer.objects import consumed_key
from miles_core.metrics import names as N
from miles_core.samples import Group, Sample, SampleStatus
from miles_core.storage import Store
from tests.support.timeouts import WAIT_SECONDS, wait_until

GET_SECONDS = 1  # a get of a group the test made available (the tail indexes within a poll)
WAITING_GET_SECONDS = 60  # a get the test leaves waiting until a later group wakes it


def group(position: int, holder: str, attempt: int = 0, epoch: int = 0) -> Group:
    gid = f"e{epoch}-p{position}-a{attempt}-{holder}"
    meta = json.dumps({"epoch": epoch, "position": position, "attempt": attempt, "writer": holder})
    return Group(gid, position, [Sample(gid, position, j, [1, 2], [3], [-0.1], [1], [1], 0.5,
                                        SampleStatus.COMPLETED, "stop", "{}", meta) for j in range(2)])


@pytest.fixture
def store(tmp_path):
    return Store(f"file://{tmp_path}/run")


def trainer_buffer(store, capacity=8, poll=0.05):
    return DurableBuffer.open(store, capacity_groups=capacity, unused_handler=DropUnused(), consumed_through_step=-1,
                              foreign_poll_seconds=poll, writer_id="wtrainer")


def producer_writer(store, name="wprod"):
    return DurableBuffer(store, capacity_groups=2, unused_handler=DropUnused(), writer_id=name, index_commits=False)


def test_a_producers_commits_reach_the_trainer_once_each(store):
    with trainer_buffer(store) as buf, producer_writer(store) as w:
        for i in range(5):  # more than the writer's capacity of 2: it never serves, so it never fills
            w.put(group(i, "prod"))
        assert w.committed_total == 5 and w.queue_size == 0
        wait_until(lambda: buf.queue_size == 5, WAIT_SECONDS, "5 groups queued", interval=0.02)
        time.sleep(0.2)  # more polls: nothing is indexed twice
        got = [buf.get(timeout_seconds=GET_SECONDS).group_id for _ in range(5)]
        assert sorted(got) == sorted(f"e0-p{i}-a0-prod" for i in range(5)) and buf.queue_size == 0
        buf.record_consumed(0, got)
    manifest = store.get_json(consumed_key(0))
    assert manifest["writers"] == {"wprod": 5}


def test_a_duplicate_prompt_attempt_is_refused_and_a_retry_is_not(store):
    with trainer_buffer(store) as buf, producer_writer(store) as w:
        buf.put(group(3, "trainer"))
        w.put(group(3, "prod"))  # the same prompt attempt from a block taken over: a duplicate
        w.put(group(3, "prod", attempt=1))  # a retry of a rejected group: the next attempt, not a duplicate
        w.put(group(4, "prod"))
        wait_until(lambda: buf.queue_size == 3, WAIT_SECONDS, "3 groups queued", interval=0.02)
        got = sorted(buf.get(timeout_seconds=GET_SECONDS).group_id for _ in range(3))
        assert got == ["e0-p3-a0-trainer", "e0-p3-a1-prod", "e0-p4-a0-prod"]
        assert buf.get_metrics()[N.DUPLICATE_GROUPS_FILTERED] == 1
        buf.record_consumed(0, got)
    assert store.get_json(consumed_key(0))["rejected"] == ["e0-p3-a0-prod"]


def test_a_reopened_buffer_refuses_a_duplicate_of_a_consumed_group(store):
    with trainer_buffer(store) as buf:
        buf.put(group(1, "trainer"))
        buf.record_consumed(0, [buf.get(timeout_seconds=GET_SECONDS).group_id])
    with producer_writer(store) as w:
        w.put(group(1, "late"))
        w.put(group(2, "late"))
    with DurableBuffer.open(store, capacity_groups=8, unused_handler=DropUnused(), consumed_through_step=0) as buf:
        assert buf.available_group_ids() == ["e0-p2-a0-late"]


def test_other_writers_groups_hold_back_the_trainers_own_puts(store):
    with trainer_buffer(store, capacity=2) as buf, producer_writer(store) as w:
        w.put(group(0, "prod"))
        w.put(group(1, "prod"))
        wait_until(lambda: buf.queue_size == 2, WAIT_SECONDS, "2 groups queued", interval=0.02)
        import threading

        done = threading.Event()
        threading.Thread(target=lambda: (buf.put(group(9, "trainer")), done.set()), daemon=True).start()
        assert not done.wait(0.3)  # full of the producer's groups: backpressure on the trainer's own
        buf.get(timeout_seconds=GET_SECONDS)
        assert done.wait(2)


def test_without_polling_other_writers_are_only_found_on_reopen(store):
    with DurableBuffer.open(store, capacity_groups=8, unused_handler=DropUnused(), consumed_through_step=-1) as buf:
        with producer_writer(store) as w:
            w.put(group(0, "prod"))
        time.sleep(0.2)
        assert buf.queue_size == 0


def test_an_outage_while_reading_other_writers_groups_only_delays_them(store, monkeypatch):
    from miles_core.storage import StorageUnavailable

    with producer_writer(store) as w:
        w.put(group(0, "prod"))
    with trainer_buffer(store, poll=3600) as buf:  # polled by hand below
        assert buf.queue_size == 1  # found by the reopen's own listing
        with producer_writer(store, "wprod2") as w:
            w.put(group(1, "prod2"))
        real = store.get_bytes
        monkeypatch.setattr(store, "get_bytes", lambda key: (_ for _ in ()).throw(StorageUnavailable("outage")))
        with pytest.raises(StorageUnavailable):
            buf._tail.poll()
        monkeypatch.setattr(store, "get_bytes", real)
        assert buf._tail.poll() == 1 and buf.queue_size == 2


def test_the_feed_counts_usable_groups_and_recent_writers(store):
    with DurableBuffer.open(store, capacity_groups=8, unused_handler=DropUnused(), consumed_through_step=-1,
                            foreign_poll_seconds=0.05, writer_id="wtrainer", max_weight_staleness=1) as buf:
        with producer_writer(store) as w:
            w.put(group(0, "prod"))  # token version 1
        wait_until(lambda: buf.queue_size == 1, WAIT_SECONDS, "1 groups queued", interval=0.02)
        assert buf.usable_queue_size(2) == 1 and buf.usable_queue_size(3) == 0  # staleness 2 > 1 at v3
        assert buf.usable_queue_size(None) == 1
        assert buf.recent_foreign_writers() == 1 and buf.recent_foreign_writers(seconds=0) == 0


def test_groups_indexed_while_the_trainer_gets_wake_it_and_count_in_full(store, monkeypatch):
    """Pins: a poll counts and announces every group it indexed, also when the trainer took groups
    while the poll read objects unlocked. Guards the stall a CI run hit (tests/e2e/test_elastic_netns.py,
    step 51 of 80): the poll counted `len(available) - before`, so the trainer's gets during its reads
    cancelled out its new groups; it notified nobody and under-counted the slots taken, the trainer
    waited on an empty-looking buffer that held 64 groups, and the producers, seeing the buffer full,
    waited for it."""
    import threading

    with trainer_buffer(store, poll=3600) as buf, producer_writer(store) as w:  # polled by hand below
        w.put(group(0, "prod"))
        assert buf._tail.poll() == 1
        w.put(group(1, "prod"))
        reading, release = threading.Event(), threading.Event()
        real = buf._fetch

        def slow_fetch(key):
            reading.set()
            assert release.wait(10)
            return real(key)

        monkeypatch.setattr(buf, "_fetch", slow_fetch)
        polled = []
        poller = threading.Thread(target=lambda: polled.append(buf._tail.poll()), daemon=True)
        poller.start()
        assert reading.wait(5)  # the poll reads group 1's object, unlocked
        assert buf.get(timeout_seconds=GET_SECONDS).group_id == "e0-p0-a0-prod"  # meanwhile the trainer takes group 0
        got = []
        getter = threading.Thread(target=lambda: got.append(buf.get(timeout_seconds=WAITING_GET_SECONDS).group_id), daemon=True)
        getter.start()
        wait_until(lambda: len(buf._not_empty._waiters) == 1, WAIT_SECONDS, "a get waiting",
                   interval=0.02)  # and waits for the next
        release.set()
        poller.join(5)
        getter.join(5)
        assert polled == [1] and got == ["e0-p1-a0-prod"]  # woken at once, not at its timeout
        assert buf._reserved == 0  # every slot the poll took was given back by a get

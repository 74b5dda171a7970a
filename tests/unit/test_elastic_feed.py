"""The feed a producer job reads (miles_core.rollout.feed_record) and the heartbeat it writes
(miles_core.elastic.heartbeat).

Guards: a producer running past the buffer's capacity or the staleness bound, a feed or heartbeat
record that does not parse crashing a reader, throughput accounting that cannot be plotted.
"""

from __future__ import annotations

import pytest

from miles_core.elastic import heartbeat as H
from miles_core.rollout.feed_record import FEED_KEY, Feed, FeedError, read_feed, write_feed
from miles_core.storage import Store


def feed(**kw) -> Feed:
    base = dict(version=5, weights="file:///w", step=3, segment=0, queue_size=2, capacity=8, consumed_groups=16,
                groups_per_version=4, max_weight_staleness=None, first_version=1, written_at=0.0)
    return Feed(**{**base, **kw})


def test_room_is_the_buffers_capacity_less_what_is_queued_committed_and_in_flight():
    assert feed().room(in_flight=0, committed_unseen=0) == 6
    assert feed().room(in_flight=3, committed_unseen=2) == 1
    assert feed().room(in_flight=5, committed_unseen=2) == 0  # never negative


def test_room_follows_staleness_admission():
    # S=1 at version 5 (4 versions after the first): (1 + 4 + 1) * 4 = 24 groups may have started;
    # 16 consumed + 2 queued + 1 in flight = 19 started, so 5 more.
    assert feed(max_weight_staleness=1, capacity=100).room(in_flight=1, committed_unseen=0) == 5
    assert feed(max_weight_staleness=0, capacity=100).room(in_flight=0, committed_unseen=0) == 2


def test_room_ends_with_the_groups_the_run_needs():
    # --num-rollout 5 of 4 groups: 20 in all; 16 consumed + 2 queued, so 2 more, shared by 2 producers
    assert feed(groups_needed=20).room(in_flight=0, committed_unseen=0) == 2
    assert feed(groups_needed=20, producers=2).room(in_flight=0, committed_unseen=0) == 1
    assert feed(groups_needed=18).room(in_flight=0, committed_unseen=0) == 0


def test_feed_round_trips_and_bad_records_are_named(tmp_path):
    store = Store(f"file://{tmp_path}")
    assert read_feed(store) is None
    write_feed(store, feed())
    assert read_feed(store) == feed()
    write_feed(store, feed(groups_needed=20))
    assert read_feed(store) == feed(groups_needed=20)
    store.put_bytes(FEED_KEY, b"{not json")
    with pytest.raises(FeedError, match="FEED.json"):
        read_feed(store)
    store.put_json(FEED_KEY, {"version": 1})
    with pytest.raises(FeedError, match="not a miles feed record"):
        read_feed(store)


def test_heartbeats_record_throughput_and_skip_bad_records(tmp_path, caplog):
    store = Store(f"file://{tmp_path}")
    beat = H.Heartbeat.start("spot-a", "w1")
    beat = beat.update(state=H.GENERATING, groups_committed=3, tokens=300)
    H.write_heartbeat(store, beat)
    H.write_heartbeat(store, H.Heartbeat.start("spot-b", "w2"))
    store.put_bytes(f"{H.HEARTBEATS}broken.json", b"[1, 2")
    beats = H.list_heartbeats(store)
    assert [b.producer_id for b in beats] == ["spot-a", "spot-b"]
    assert beats[0].tokens_per_second > 0 and beats[0].history[-1][1] == 3
    assert "broken.json" in caplog.text
    with pytest.raises(ValueError, match="producer id"):
        H.heartbeat_key("../etc")


def test_producers_share_the_room():
    assert feed(producers=2).room(in_flight=0, committed_unseen=0) == 3  # (8 - 2) // 2
    assert feed(producers=2).room(in_flight=2, committed_unseen=1) == 0
    assert feed(producers=0).room(in_flight=0, committed_unseen=0) == 6  # none seen yet: the newcomer takes it


class _Call:
    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


class _Rollout:
    def __init__(self):
        self.queue = 5

    def feed_state(self, version):
        return _Call({"queue_size": self.queue, "capacity": 8, "producers": 1})


def test_the_feed_is_rewritten_while_a_step_waits_and_never_without_the_lease(tmp_path):
    """A trainer starved inside a step still tells producers that room opened (else both wait for ever):
    the refresh is a duty of the driver's wait for the batch; a trainer that lost the run's lease writes
    nothing."""
    import concurrent.futures

    from miles_core.config import parse_flags
    from miles_core.driver.clients import Pending
    from miles_core.driver.feed_publisher import feed_publisher
    from miles_core.driver.pushes import WeightVersion
    from miles_core.driver.switchboard import Switchboard

    store = Store(f"file://{tmp_path}")
    cfg = parse_flags(["--preset", "tiny-reverse4", "--allow-rollout-producers", "--producer-poll-seconds", "0.05"])
    rollout, lost = _Rollout(), []

    def check():
        if lost:
            raise RuntimeError("lease lost")

    pub = feed_publisher(cfg, store, rollout, WeightVersion(exported=5, snapshot="file:///w"), 0, check)
    pub.publish(3)
    assert read_feed(store).queue_size == 5 and read_feed(store).step == 3 and read_feed(store).version == 5
    rollout.queue = 0  # the waiting step's get dropped stale groups: room opened
    board = Switchboard()
    board.every(cfg.buffer.producer_poll_seconds, pub.refresh)
    batch: concurrent.futures.Future = concurrent.futures.Future()

    def refreshed_then_batch():
        if read_feed(store).queue_size == 0:
            batch.set_result("batch")

    board.every(0.01, refreshed_then_batch)
    assert board.wait(Pending(future=batch)) == "batch"  # the wait ran the refresh
    assert read_feed(store).step == 3
    lost.append(1)
    rollout.queue = 7
    with pytest.raises(RuntimeError, match="lease lost"):  # the duty logs it; nothing is written
        pub.refresh()
    assert read_feed(store).queue_size == 0

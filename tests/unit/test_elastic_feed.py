"""The feed a producer job reads (miles_core.rollout.feed) and the heartbeat it writes
(miles_core.elastic.heartbeat).

Guards: a producer running past the buffer's capacity or the staleness bound, a feed or heartbeat
record that does not parse crashing a reader, throughput accounting that cannot be plotted.
"""

from __future__ import annotations

import pytest

from miles_core.elastic import heartbeat as H
from miles_core.rollout.feed import FEED_KEY, Feed, FeedError, read_feed, write_feed
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


def test_feed_round_trips_and_bad_records_are_named(tmp_path):
    store = Store(f"file://{tmp_path}")
    assert read_feed(store) is None
    write_feed(store, feed())
    assert read_feed(store) == feed()
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

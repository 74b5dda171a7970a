"""The feed: one record the trainer rewrites after every step for producer jobs (`producers/FEED.json`).

    write_feed(store, Feed(...))          # the trainer, under its lease, after each step's push
    feed = read_feed(store)               # a producer, every --producer-poll-seconds
    feed.room(in_flight, committed)       # groups this producer may start now

It names the weights the engines must serve (`version`, the run-root URI of their snapshot) and the
buffer's state that bounds generation: its capacity and queue, the groups consumed so far, and the
staleness bound. A producer reads nothing else of the trainer: no connection between the two.

`room` is the producer's side of two rules the trainer's own rollout applies exactly: the buffer's
capacity (groups committed and not consumed, plus those in flight, stay within it) and staleness
admission (a group may start only while the groups started beyond those consumed fit in
`(S + v + 1) * B`, v versions after the first). The room is shared equally by the producers whose
groups reached the trainer lately (`producers`); each takes its share less its own in-flight groups
and the commits the trainer had not seen at the feed's writing. A producer that just joined counts
only once its groups arrive, so the total may overshoot briefly; the trainer's get-side staleness
filter still holds the bound. The queue counts only groups a step can still use: stale ones are about
to be dropped and hold no room.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from miles_core.storage import ObjectNotFound, StorageError, StorageUnavailable, Store

FEED_KEY = "producers/FEED.json"


@dataclass(frozen=True)
class Feed:
    version: int  # the weight version producers must serve
    weights: str  # run-root URI of the snapshot holding `version` (`.complete` inside)
    step: int  # the last step trained (-1 before the first)
    segment: int
    queue_size: int  # committed groups not yet consumed, as the trainer's buffer holds them
    capacity: int  # the buffer's capacity in groups
    consumed_groups: int  # groups consumed since the run began
    groups_per_version: int  # B: groups consumed between two weight versions
    max_weight_staleness: int | None
    first_version: int
    written_at: float
    producers: int = 1  # producer jobs whose groups reached the trainer lately: they share the room
    groups_needed: int | None = None  # groups the run's --num-rollout steps take in all (None: no bound)

    def room(self, in_flight: int, committed_unseen: int) -> int:
        """Groups this producer may start now, with `in_flight` of its own running and
        `committed_unseen` committed since the trainer wrote this feed."""
        room = self.capacity - self.queue_size
        if self.max_weight_staleness is not None:
            versions = max(0, self.version - self.first_version)
            limit = (self.max_weight_staleness + versions + 1) * self.groups_per_version
            room = min(room, limit - self.consumed_groups - self.queue_size)
        if self.groups_needed is not None:  # no group past the run's last step
            room = min(room, self.groups_needed - self.consumed_groups - self.queue_size)
        share = room // max(1, self.producers) if room > 0 else 0
        return max(0, share - committed_unseen - in_flight)


class FeedError(ValueError):
    def __init__(self, message: str):
        super().__init__(message)


def write_feed(store: Store, feed: Feed) -> None:
    store.put_json(FEED_KEY, asdict(feed))


def read_feed(store: Store) -> Feed | None:
    """The current feed; None before the trainer wrote one. FeedError for a record that is not one."""
    try:
        raw = store.get_json(FEED_KEY)
    except ObjectNotFound:
        return None
    except StorageUnavailable:
        raise
    except StorageError as e:  # not JSON
        raise FeedError(f"{e}; the trainer rewrites it after its next step") from e
    try:
        return Feed(**raw)
    except TypeError as e:
        raise FeedError(f"{store.uri(FEED_KEY)} is not a miles feed record ({e})") from e


def feed_age(feed: Feed, now: float | None = None) -> float:
    """Seconds since the trainer wrote `feed` (wall clocks of two hosts: for messages, never for decisions)."""
    return (time.time() if now is None else now) - feed.written_at

"""The trainer's side of producer jobs: the feed they read (miles_core.rollout.feed).

    feed = feed_publisher(cfg, store, rollout, pusher, segment, lease.check)   # NoFeed unless producers
    feed.publish(step, version)     # the loop, after each step's weight push
    feed.close()                    # the segment's end

Besides every step, it is rewritten every --producer-poll-seconds with the buffer's current state:
a trainer waiting for groups inside a step (its get-side filter dropping stale ones) must still tell
producers that room opened, or both sides would wait for each other. Every write checks the run's
lease first, so only the trainer that holds the run writes it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from miles_core.rollout.feed import Feed, write_feed

log = logging.getLogger(__name__)


class NoFeed:
    """A run without producers publishes nothing."""

    def publish(self, step: int, version: int) -> None:
        pass

    def close(self) -> None:
        pass


class FeedPublisher:
    def __init__(self, cfg, store, rollout, pusher, segment: int, check: Callable[[], None] = lambda: None):
        self.cfg, self.store, self.rollout, self.pusher, self.segment = cfg, store, rollout, pusher, segment
        self.check = check
        self.last: tuple[int, int] | None = None  # (step, version) of the last publish
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh_loop, name="feed-refresh", daemon=True)

    def publish(self, step: int, version: int) -> None:
        """The feed after `step` (-1: at start), naming the run-root weights of `version` (the pusher's
        last snapshot: a step without a push names the previous one, which holds `version`)."""
        with self._lock:
            self.last = (step, version)
            self._write()
        if not self._thread.is_alive() and not self._stop.is_set():
            self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.cfg.buffer.producer_poll_seconds):
            try:
                with self._lock:
                    self._write()
            except Exception as e:  # noqa: BLE001 - a lost lease or an outage: the step's own commit says so
                log.warning("producer feed not refreshed: %s", e)

    def _write(self) -> None:
        if self.pusher.snapshot is None or self.last is None:
            return
        step, version = self.last
        r = self.cfg.rollout
        room = self.rollout.call("feed_state", version).result()
        self.check()
        write_feed(self.store, Feed(
            version=version, weights=self.pusher.snapshot, step=step, segment=self.segment,
            queue_size=room["queue_size"], capacity=room["capacity"],
            consumed_groups=(step + 1) * r.rollout_batch_size,
            groups_per_version=r.rollout_batch_size * r.update_weights_interval,
            max_weight_staleness=r.max_weight_staleness, first_version=1, written_at=time.time(),
            producers=room["producers"]))


def feed_publisher(cfg, store, rollout, pusher, segment: int, check: Callable[[], None] = lambda: None):
    if not cfg.buffer.allow_rollout_producers:
        return NoFeed()
    return FeedPublisher(cfg, store, rollout, pusher, segment, check)

"""The trainer's side of producer jobs: the feed they read (miles_core.rollout.feed_record).

    feed = feed_publisher(cfg, store, rollout, version, segment, lease.check)   # NoFeed unless producers
    feed.publish(step)      # the loop, after each step's weight push
    feed.refresh()          # a duty of the driver's waits (switchboard), every --producer-poll-seconds

Besides every step, it is rewritten every --producer-poll-seconds with the buffer's current state:
a trainer waiting for groups inside a step (its get-side filter dropping stale ones) must still tell
producers that room opened, or both sides would wait for each other; the driver's wait for the batch
runs `refresh`. Every write checks the run's lease first, so only the trainer that holds the run writes it.
The version and its weights are the driver's `WeightVersion`'s (the newest exported, whose snapshot the
run root holds).
"""

from __future__ import annotations

import time
from typing import Callable

from miles_core.driver.clients import RolloutClient
from miles_core.driver.pushes import WeightVersion
from miles_core.rollout.feed_record import Feed, write_feed


class NoFeed:
    """A run without producers publishes nothing."""

    def publish(self, step: int) -> None:
        pass

    def refresh(self) -> None:
        pass


class FeedPublisher:
    def __init__(self, cfg, store, rollout: RolloutClient, version: WeightVersion, segment: int,
                 check: Callable[[], None] = lambda: None):
        self.cfg, self.store, self.rollout, self.version, self.segment = cfg, store, rollout, version, segment
        self.check = check
        self.step: int | None = None  # the step of the last publish (-1: at start)

    def publish(self, step: int) -> None:
        """The feed after `step` (-1: at start), naming the run-root weights of the newest version."""
        self.step = step
        self._write()

    def refresh(self) -> None:
        """The last publish again, with the buffer's room now."""
        self._write()

    def _write(self) -> None:
        version, weights = self.version.exported, self.version.snapshot
        if weights is None or self.step is None:
            return
        r = self.cfg.rollout
        room = self.rollout.feed_state(version).result()
        self.check()
        write_feed(self.store, Feed(
            version=version, weights=weights, step=self.step, segment=self.segment,
            queue_size=room["queue_size"], capacity=room["capacity"],
            consumed_groups=(self.step + 1) * r.rollout_batch_size,
            groups_per_version=r.rollout_batch_size * r.update_weights_interval,
            max_weight_staleness=r.max_weight_staleness, first_version=1, written_at=time.time(),
            producers=room["producers"], groups_needed=self.cfg.run.total_steps * r.rollout_batch_size))


def feed_publisher(cfg, store, rollout: RolloutClient, version: WeightVersion, segment: int,
                   check: Callable[[], None] = lambda: None) -> FeedPublisher | NoFeed:
    if not cfg.buffer.allow_rollout_producers:
        return NoFeed()
    return FeedPublisher(cfg, store, rollout, version, segment, check)

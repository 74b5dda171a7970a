"""The trainer's side of producer jobs: after every step, the feed they read (miles_core.rollout.feed).

    feed = feed_publisher(cfg, store, rollout, pusher, segment)   # NoFeed unless --allow-rollout-producers
    feed.publish(step, version)                                   # the loop, after the step's weight push

Written under the run's lease (the loop wraps it like every other commit), so only the trainer
that holds the run writes it.
"""

from __future__ import annotations

import time

from miles_core.rollout.feed import Feed, write_feed


class NoFeed:
    """A run without producers publishes nothing."""

    def publish(self, step: int, version: int) -> None:
        pass


class FeedPublisher:
    def __init__(self, cfg, store, rollout, pusher, segment: int):
        self.cfg, self.store, self.rollout, self.pusher, self.segment = cfg, store, rollout, pusher, segment

    def publish(self, step: int, version: int) -> None:
        """The feed after `step` (-1: at start), naming the run-root weights of `version` (the pusher's
        last snapshot: a step without a push names the previous one, which holds `version`)."""
        if self.pusher.snapshot is None:
            return
        r = self.cfg.rollout
        room = self.rollout.call("feed_state").result()
        write_feed(self.store, Feed(
            version=version, weights=self.pusher.snapshot, step=step, segment=self.segment,
            queue_size=room["queue_size"], capacity=room["capacity"],
            consumed_groups=(step + 1) * r.rollout_batch_size,
            groups_per_version=r.rollout_batch_size * r.update_weights_interval,
            max_weight_staleness=r.max_weight_staleness, first_version=1, written_at=time.time()))


def feed_publisher(cfg, store, rollout, pusher, segment: int):
    return FeedPublisher(cfg, store, rollout, pusher, segment) if cfg.buffer.allow_rollout_producers else NoFeed()

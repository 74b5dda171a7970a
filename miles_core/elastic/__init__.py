"""Elastic, disaggregated rollout: producer jobs that feed a run's buffer through its run root alone.

- what the trainer publishes for producers (weights, version, buffer room) is the feed
  (miles_core.rollout.feed_record), written by the driver;
- `heartbeat`: what each producer publishes about itself (accounting, liveness);
- `job`: a producer job's life (join, generate, follow the weights, stop).
"""

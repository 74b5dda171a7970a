"""Metric names owned here (DESIGN §12), with their meaning: the source of docs/metrics.md.

Names are interface: dashboards and the report read them, so renaming one breaks users.
Other components own their own names (the buffer: `rollout/fully_async/*`, DESIGN §6.3; the
trainer: `train/*`; eval: `eval/*`); the report reads those by the constants below.
"""

from __future__ import annotations

# perf/*: where the time goes. Logged once per training step at that step.
PERF_METRICS: dict[str, str] = {
    "perf/tokens_per_second": "Generated (response) tokens per wall-clock second over the step window, all engines together.",
    "perf/train_wait_seconds": "Seconds the trainer waited for data from the buffer during the step (high: rollout-bound, the trainer is starved).",
    "perf/producer_blocked_seconds": "Seconds the producer was blocked on a full buffer during the step window (high: train-bound, backpressure).",
    "perf/weight_update_seconds": "Seconds of the weight update: pause engines, transfer weights, resume.",
    "perf/step_seconds": "Wall-clock seconds of the whole training step (drain, train, weight update, save).",
    "perf/weight_export_seconds": "Seconds of the weight update spent writing the snapshot the engines load (engines keep generating meanwhile).",
    "perf/engine_pause_seconds": "Seconds the engines were paused during the weight update (flush, load, resume).",
}

# Logged once, at step 0 of a run on a builtin task: the level learning has to beat.
RANDOM_POLICY_REWARD = "rollout/random_policy_reward"
PUBLISHED_VERSION = "rollout/published_version"
RUN_METRICS: dict[str, str] = {
    RANDOM_POLICY_REWARD: "Mean reward of a uniformly random policy on the builtin task (logged once at step 0).",
    PUBLISHED_VERSION: "Weight version published to the rollout side after the step's weight update.",
}

# The names this module owns (checked against docs/metrics.md).
METRIC_NAMES: tuple[str, ...] = tuple(PERF_METRICS) + tuple(RUN_METRICS)

# Names the report reads (owned by other components; listed so the report has one place to change).
REWARD = "rollout/reward/mean"
QUEUE_SIZE = "rollout/fully_async/queue_size"
AVG_STALENESS = "rollout/fully_async/avg_staleness"
MAX_STALENESS = "rollout/fully_async/max_staleness"
BUFFER_AVG_STALENESS = "rollout/fully_async/buffer_avg_staleness"
BUFFER_MAX_STALENESS = "rollout/fully_async/buffer_max_staleness"
MIXED_VERSION_RATIO = "rollout/weight_version/mixed_version_ratio"
TOKENS_PER_SECOND = "perf/tokens_per_second"
STEP_SECONDS = "perf/step_seconds"
WEIGHT_EXPORT_SECONDS = "perf/weight_export_seconds"
ENGINE_PAUSE_SECONDS = "perf/engine_pause_seconds"
TRAIN_WAIT_SECONDS = "perf/train_wait_seconds"
PRODUCER_BLOCKED_SECONDS = "perf/producer_blocked_seconds"
WEIGHT_UPDATE_SECONDS = "perf/weight_update_seconds"
EVAL_PREFIX = "eval/"

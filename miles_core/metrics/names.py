"""Every metric name miles logs, with its meaning, grouped by the component that logs it: the source
of the metric reference (docs/reference/metrics.md, `python -m miles_core.cli.docs_gen`) and of the
tables docs/metrics.md, docs/data-path.md and docs/evaluation.md are checked against.

Names are interface: dashboards, `miles report`, Prometheus and users' plots read them, so renaming
one breaks users. Components import the constants (and the builders of names with a `{placeholder}`)
from here; no other module of miles_core spells a metric name (storage keys such as
`eval/requests` or `buffer/groups/` are not metric names and live with their owners).

    from miles_core.metrics import names as N
    metrics[N.TRAIN_WAIT_SECONDS] = wait_seconds
    N.eval_pass_at_k_metric("heldout", 4)        # "eval/heldout/pass@4"

Each component's `*_METRICS` mapping {name or pattern: meaning} is what the reference lists (a name
logged by two components is in both mappings, with one meaning); `*_METRIC_NAMES` are their names.
"""

from __future__ import annotations

import re

# ----------------------------------------------------------------------------- perf/* (driver, trainer, rollout)
# Where the time goes. Logged once per training step at that step.
TOKENS_PER_SECOND = "perf/tokens_per_second"
TRAIN_WAIT_SECONDS = "perf/train_wait_seconds"
PRODUCER_BLOCKED_SECONDS = "perf/producer_blocked_seconds"
WEIGHT_UPDATE_SECONDS = "perf/weight_update_seconds"
WEIGHT_DELIVERY_WAIT_SECONDS = "perf/weight_delivery_wait_seconds"
STEP_SECONDS = "perf/step_seconds"
WEIGHT_EXPORT_SECONDS = "perf/weight_export_seconds"
ENGINE_PAUSE_SECONDS = "perf/engine_pause_seconds"
PERF_METRICS: dict[str, str] = {
    TOKENS_PER_SECOND: "Generated (response) tokens per wall-clock second over the step window, all engines together.",
    TRAIN_WAIT_SECONDS: "Seconds the trainer waited for data from the buffer during the step (high: rollout-bound, the trainer is starved).",
    PRODUCER_BLOCKED_SECONDS: "Seconds the producer was blocked on a full buffer during the step window (high: train-bound, backpressure).",
    WEIGHT_UPDATE_SECONDS: "Seconds of the weight update: export, stage, pause engines, load, resume, publish. "
                           "Under the fully async driver the delivery after the export overlaps the next step, "
                           "and this is logged with the next push's metrics (the last step's push waits and "
                           "logs its own).",
    WEIGHT_DELIVERY_WAIT_SECONDS: "Seconds a weight push waited for the previous push's delivery to the engines, "
                                  "which overlapped the step in between (fully async driver; about 0 when the "
                                  "delivery finished within the step).",
    STEP_SECONDS: "Wall-clock seconds of the whole training step (drain, train, weight update, save).",
    WEIGHT_EXPORT_SECONDS: "Seconds of the weight update spent writing the snapshot the engines load (engines keep generating meanwhile).",
    ENGINE_PAUSE_SECONDS: "Seconds the engines were paused during the weight update (flush, load, resume).",
}

# ----------------------------------------------------------------------------- weights/* (versions in the run root)
# Each published version (docs/weight-versions.md): what its writer ranks wrote, logged with the step's
# push; what the readers (the engines' nodes) read to rebuild it, logged with its delivery.
WEIGHTS_VERSION_BYTES = "weights/version_bytes"
WEIGHTS_CHANGED_SHARE = "weights/changed_share"
WEIGHTS_SHARE_OF_DENSE = "weights/share_of_dense"
WEIGHTS_ENCODE_SECONDS = "weights/encode_seconds"
WEIGHTS_ANCHOR = "weights/anchor"
WEIGHTS_READ_BYTES = "weights/read_bytes"
WEIGHTS_APPLY_SECONDS = "weights/apply_seconds"
WEIGHTS_ANCHOR_READS = "weights/anchor_reads"
WEIGHTS_CHECKSUM_FAILURES = "weights/checksum_failures"
WEIGHTS_METRICS: dict[str, str] = {
    WEIGHTS_VERSION_BYTES: "Bytes the trainer wrote to the run root for the version's weights, all parts together "
                           "(an anchor: the bf16 model; a delta: its compressed changes).",
    WEIGHTS_CHANGED_SHARE: "Share of the model's bf16 elements that differ from the version before (1 at a first anchor).",
    WEIGHTS_SHARE_OF_DENSE: "The version's bytes written over the dense bf16 model's (1 for an anchor, a few hundredths "
                            "for a delta at a real learning rate).",
    WEIGHTS_ENCODE_SECONDS: "Seconds the slowest writer rank took to cast, diff, compress and write its part.",
    WEIGHTS_ANCHOR: "1 when the version was written as an anchor (the whole bf16 model), 0 as a delta.",
    WEIGHTS_READ_BYTES: "Bytes the engines' nodes read from the run root to rebuild the delivered version, all nodes together.",
    WEIGHTS_APPLY_SECONDS: "Seconds the slowest engine node took to rebuild the delivered version (download, apply, verify, write), before the pause.",
    WEIGHTS_ANCHOR_READS: "Engine nodes that read an anchor to rebuild the delivered version (a node that joined late, fell behind or found a failed checksum).",
    WEIGHTS_CHECKSUM_FAILURES: "Checksums that failed while the engines' nodes rebuilt the delivered version (each then rebuilt from its anchor; never served).",
}

# ----------------------------------------------------------------------------- the run (driver)
# Logged once, at step 0 of a run on a builtin task: the level learning has to beat.
RANDOM_POLICY_REWARD = "rollout/random_policy_reward"
PUBLISHED_VERSION = "rollout/published_version"
ENGINES = "rollout/engines"
RUN_METRICS: dict[str, str] = {
    RANDOM_POLICY_REWARD: "Mean reward of a uniformly random policy on the builtin task (logged once at step 0).",
    PUBLISHED_VERSION: "Weight version published to the rollout side after the step's weight update.",
    ENGINES: "Rollout engines serving at the end of the step (the fleet moves toward engines/target.json: "
             "`miles engines add|remove`).",
}

# ----------------------------------------------------------------------------- producer jobs (rollout.batch_metrics)
# Logged with every step's batch of a run that allows producer jobs (--allow-rollout-producers): who
# generated what the step trained on (read from the group ids: a producer job's id, or the run's own rollout).
PRODUCERS_CONSUMED_GROUPS = "rollout/producers/consumed_groups"
PRODUCERS_COUNT = "rollout/producers/count"
PRODUCER_CONSUMED_GROUPS = "rollout/producers/{producer_id}/consumed_groups"
PRODUCER_METRICS: dict[str, str] = {
    PRODUCERS_CONSUMED_GROUPS: "Groups of the step's batch generated by producer jobs (the rest came from the "
                               "run's own engines).",
    PRODUCERS_COUNT: "Producer jobs whose groups the step trained on (`miles runs show` lists every producer "
                     "that joined, with its heartbeat).",
    PRODUCER_CONSUMED_GROUPS: "Groups of the step's batch generated by producer job {producer_id}.",
}

# ----------------------------------------------------------------------------- rollout/* (rollout: batch, producer)
# The per-batch metrics of `rollout.batch_metrics.batch_metrics`, the producer's window metrics
# (`Producer.metrics`, with its gauges rollout/producer/*) and the drain's wait time.
REWARD = "rollout/reward/mean"
RESPONSE_LEN_MEAN = "rollout/response_len/mean"
RESPONSE_LEN_MAX = "rollout/response_len/max"
TRUNCATED_RATIO = "rollout/truncated_ratio"
ZERO_STD_RATIO = "rollout/zero_std/ratio"
WEIGHT_VERSION_MEAN = "rollout/weight_version/mean"
WEIGHT_VERSION_MIN = "rollout/weight_version/min"
WEIGHT_VERSION_MAX = "rollout/weight_version/max"
MIXED_VERSION_RATIO = "rollout/weight_version/mixed_version_ratio"
REWARD_FAILED = "rollout/reward_failed"
GENERATE_FAILED = "rollout/generate_failed"  # episodes of --custom-generate-function-path that raised
PRODUCER_GROUPS_PER_SECOND = "rollout/producer/groups_per_second"
PRODUCER_IN_FLIGHT_GROUPS = "rollout/producer/in_flight_groups"
PRODUCER_STARTED_GROUPS = "rollout/producer/started_groups"
# tool use of the batch's episodes (logged only when an episode reports `"tool"` counts in its
# metadata, as miles_core.rollout.calculator_tool does)
TOOL_EPISODE_SHARE = "rollout/tool/episode_share"
TOOL_CALLS_PER_EPISODE = "rollout/tool/calls_per_episode"
TOOL_ERRORS = "rollout/tool/errors"
TOOL_TIMEOUTS = "rollout/tool/timeouts"
ROLLOUT_METRICS: dict[str, str] = {
    REWARD: "Mean reward of the scored samples of the consumed batch.",
    RESPONSE_LEN_MEAN: "Mean response length (tokens) of the consumed batch.",
    RESPONSE_LEN_MAX: "Maximum response length (tokens) of the consumed batch.",
    TRUNCATED_RATIO: "Fraction of samples of the batch cut at --rollout-max-response-len.",
    ZERO_STD_RATIO: "Fraction of groups whose rewards are all equal (GRPO learns nothing from them).",
    WEIGHT_VERSION_MEAN: "Mean engine weight version over the response tokens of the batch.",
    WEIGHT_VERSION_MIN: "Oldest engine weight version among the response tokens of the batch.",
    WEIGHT_VERSION_MAX: "Newest engine weight version among the response tokens of the batch.",
    MIXED_VERSION_RATIO: "Fraction of samples whose tokens straddle a weight update (more than one version).",
    TOKENS_PER_SECOND: PERF_METRICS[TOKENS_PER_SECOND],
    TRAIN_WAIT_SECONDS: PERF_METRICS[TRAIN_WAIT_SECONDS],
    REWARD_FAILED: "Samples whose reward function raised (they carry no reward).",
    GENERATE_FAILED: "Episodes of --custom-generate-function-path that raised (their groups are rejected: the "
                     "unused-samples handler applies).",
    PRODUCER_GROUPS_PER_SECOND: "Groups the producer finished per second.",
    PRODUCER_IN_FLIGHT_GROUPS: "Groups submitted to the engines and not finished.",
    PRODUCER_STARTED_GROUPS: "Groups admitted since the run began (drives --max-weight-staleness admission control).",
    TOOL_EPISODE_SHARE: "Fraction of the batch's episodes that called a tool at least once (episodes reporting tool "
                        "counts in their metadata: docs/agentic.md).",
    TOOL_CALLS_PER_EPISODE: "Mean tool calls per episode of the batch (of those reporting tool counts).",
    TOOL_ERRORS: "Tool calls of the batch answered with an error: a bad call or a tool that raised.",
    TOOL_TIMEOUTS: "Tool calls of the batch that did not answer within the tool's timeout.",
}
ROLLOUT_METRIC_NAMES: tuple[str, ...] = tuple(ROLLOUT_METRICS)

# ----------------------------------------------------------------------------- rollout/fully_async/* (buffer)
# The buffer's `get_metrics()` window (buffer.window.Window) and the built-in unused-samples handlers
# (docs/data-path.md lists exactly BUFFER_METRIC_NAMES). DYNAMIC_FILTER_DROP is a pattern with `{reason}`.
QUEUE_SIZE = "rollout/fully_async/queue_size"
ABORTED_GROUPS_FILTERED = "rollout/fully_async/aborted_groups_filtered"
STALE_GROUPS_FILTERED = "rollout/fully_async/stale_groups_filtered"
AVG_STALENESS = "rollout/fully_async/avg_staleness"
MAX_STALENESS = "rollout/fully_async/max_staleness"
BUFFER_AVG_STALENESS = "rollout/fully_async/buffer_avg_staleness"
BUFFER_MAX_STALENESS = "rollout/fully_async/buffer_max_staleness"
PUT_SECONDS = "rollout/fully_async/put_seconds"
BYTES_WRITTEN = "rollout/fully_async/bytes_written"
QUARANTINED = "rollout/fully_async/quarantined"
DUPLICATE_GROUPS_FILTERED = "rollout/fully_async/duplicate_groups_filtered"
UNUSED_DROPPED = "rollout/fully_async/unused_dropped"
UNUSED_RECYCLED = "rollout/fully_async/unused_recycled"
DYNAMIC_FILTER_DROP = "rollout/dynamic_filter/drop_{reason}"
BUFFER_METRICS: dict[str, str] = {
    QUEUE_SIZE: "Groups committed to the buffer and not yet consumed (pinned at 0: rollout-bound; at capacity: "
                "train-bound).",
    ABORTED_GROUPS_FILTERED: "Groups rejected at put because a sample was aborted; handed to the unused-samples handler.",
    STALE_GROUPS_FILTERED: "Groups rejected at get because their staleness exceeded --max-weight-staleness.",
    AVG_STALENESS: "Mean staleness of the groups examined at get in this window (when any).",
    MAX_STALENESS: "Maximum staleness of the groups examined at get in this window (when any).",
    BUFFER_AVG_STALENESS: "Mean staleness of the groups still buffered.",
    BUFFER_MAX_STALENESS: "Maximum staleness of the groups still buffered.",
    PUT_SECONDS: "Seconds spent committing groups to object storage in this window.",
    BYTES_WRITTEN: "Bytes of sample batches committed to object storage in this window.",
    QUARANTINED: "Buffer objects that failed to decode and were moved to buffer/quarantine/.",
    DUPLICATE_GROUPS_FILTERED: "Groups refused at the buffer because another writer's group for the same prompt "
                               "attempt was committed first (a prompt block taken over from a producer still "
                               "committing).",
    UNUSED_DROPPED: "Rejected groups discarded by --async-unused-samples-handler=drop.",
    UNUSED_RECYCLED: "Rejected groups whose prompt went back to the data source (--async-unused-samples-handler=retry).",
    PRODUCER_BLOCKED_SECONDS: PERF_METRICS[PRODUCER_BLOCKED_SECONDS],
    DYNAMIC_FILTER_DROP: "Groups dropped at put by --dynamic-sampling-filter-path, per reason it returned.",
}
BUFFER_METRIC_NAMES: tuple[str, ...] = tuple(BUFFER_METRICS)

_REASON_RE = re.compile(r"[^a-z0-9_]+")


def dynamic_filter_drop_metric(reason: str) -> str:
    """`rollout/dynamic_filter/drop_{reason}` with the reason folded to [a-z0-9_] (metric-name safe)."""
    clean = _REASON_RE.sub("_", str(reason).strip().lower()).strip("_") or "unspecified"
    return DYNAMIC_FILTER_DROP.format(reason=clean)


# ----------------------------------------------------------------------------- train/* (trainer: the loss)
# The policy loss's metrics (train.losses: summed over micro-batches, divided by the batch's tokens;
# docs/fully-async.md). GRAD_NORM is the trainer's, the mean over the step's optimizer steps.
TIS_MEAN = "train/tis_mean"
TIS_CLIPFRAC = "train/tis_clipfrac"
PPO_KL = "train/ppo_kl"
PG_CLIPFRAC = "train/pg_clipfrac"
TRAIN_ROLLOUT_LOGPROB_ABS_DIFF = "train/train_rollout_logprob_abs_diff"
GRAD_NORM = "train/grad_norm"
ENTROPY = "train/entropy"
LOSS = "train/loss"
KL_LOSS = "train/kl_loss"  # summed and logged only under --use-kl-loss; not in the reference
OPSM_CLIPFRAC = "train/opsm_clipfrac"  # summed and logged only under --use-opsm; not in the reference
# a --custom-tis-function-path correction's metrics are logged as TRAIN_PREFIX + the name it returns
# (miles_core.train.corrections; docs/algorithms.md lists the built-ins'); not in the reference
TRAIN_PREFIX = "train/"
REWARD_KL = "train/kl_in_reward"  # summed and logged only under --kl-coef; not in the reference
# shares of loss tokens the built-in corrections mask, pop or truncate (the report's corrections panel)
CORRECTION_SHARES = (PG_CLIPFRAC, TIS_CLIPFRAC, OPSM_CLIPFRAC, "train/mis_tis_truncate_fraction",
                     "train/mis_tis_mask_fraction_low", "train/mis_tis_mask_fraction_high",
                     "train/mis_rs_mask_fraction_low", "train/mis_rs_mask_fraction_high",
                     "train/mis_rs_catastrophic_seq_fraction")
LOSS_METRICS: dict[str, str] = {
    TIS_MEAN: "Mean truncated importance weight clamp(exp(logp_old - logp_rollout), tis_clip_low, tis_clip).",
    TIS_CLIPFRAC: "Fraction of tokens whose importance weight was clamped.",
    PPO_KL: "Mean approximate KL between the trainer's policy and the ratio's denominator policy.",
    PG_CLIPFRAC: "Fraction of tokens where the PPO ratio was clipped.",
    TRAIN_ROLLOUT_LOGPROB_ABS_DIFF: "Mean |trainer log-prob - engine log-prob| of the response tokens.",
    GRAD_NORM: "Gradient norm before clipping (--clip-grad).",
    ENTROPY: "Mean token entropy of the policy on the response tokens.",
    LOSS: "Training loss of the step.",
}
LOSS_METRIC_NAMES: tuple[str, ...] = tuple(LOSS_METRICS)

# ----------------------------------------------------------------------------- train/* (trainer: the step)
# What the trainer logs beside the loss metrics: the step's counts and time, and a MoE model's routing.
TRAIN_SAMPLES = "train/samples"
TRAIN_TOKENS = "train/tokens"
TRAIN_STEP_SECONDS = "perf/train_step_seconds"
OPTIMIZER_STEPS = "train/optimizer_steps"
MICRO_BATCHES = "train/micro_batches"
PADDING_FRACTION = "train/padding_fraction"
MOE_AUX_LOSS = "train/moe_aux_loss"
ROUTING_MISMATCH = "train/routing_mismatch"
ROUTING_MISMATCH_OWN = "train/routing_mismatch_own"
# the sums the two shares are made of (summed over micro-batches, DP and sequence-parallel ranks; not logged)
ROUTING_DIFFER, ROUTING_DIFFER_OWN, ROUTING_COMPARED = "routing/differ", "routing/differ_own", "routing/compared"
TRAIN_STEP_METRICS: dict[str, str] = {
    TRAIN_SAMPLES: "Samples that entered the loss this step (failed, aborted and fully masked samples excluded).",
    TRAIN_TOKENS: "Response tokens that entered the loss this step (after the loss mask).",
    OPTIMIZER_STEPS: "Optimizer steps taken on this rollout: rollout_batch_size x n_samples_per_prompt / --global-batch-size (train/grad_norm is their mean).",
    MICRO_BATCHES: "Forward/backward micro-batches DP rank 0 ran this step (--micro-batch-size samples each, or packed to --max-tokens-per-gpu under --use-dynamic-batch-size).",
    PADDING_FRACTION: "Share of the token positions DP rank 0 computed that were padding (right padding to a micro-batch's longest sample; 0 under --use-dynamic-batch-size).",
    TRAIN_STEP_SECONDS: "Seconds of the trainer's forward, backward and optimizer step.",
    MOE_AUX_LOSS: "A mixture-of-experts model's load-balancing loss (transformers' load_balancing_loss_func of each MoE layer's router logits, mean over the MoE layers; balanced routing gives top-k), token-weighted over the micro-batches; the loss adds router_aux_loss_coef times it (--moe-aux-loss-coeff: Megatron's coefficient instead, per MoE layer, summed). Absent for dense models and without an aux loss.",
    ROUTING_MISMATCH: "A mixture-of-experts model's share of (token, MoE layer) pairs whose top-k experts in the trainer's forward differ from those the engine routed the token to (samples carrying the engine's routed experts: --use-rollout-routing-replay). 0 under replay; absent when no sample carries routes.",
    ROUTING_MISMATCH_OWN: "The same share for the trainer's router's own choice (what it would route without replay): how far the trainer's routing drifts from the engine's, with or without replay.",
}

# ----------------------------------------------------------------------------- eval/* (eval)
# docs/evaluation.md. Every eval metric is logged at the evaluated snapshot's own step, under
# metrics/eval/. `{ds}` is an eval dataset name (--eval-prompt-data name=uri), `{k}` a pass@k sample
# count (powers of two up to --n-samples-per-eval-prompt, and n itself), `{reason}` one of SKIP_REASONS.
EVAL_PREFIX = "eval/"
EVAL_REWARD = "eval/{ds}"
EVAL_PASS_AT_K = "eval/{ds}/pass@{k}"
EVAL_TRUNCATED_RATIO = "eval/{ds}/truncated_ratio"
EVAL_RESPONSE_LEN_MEAN = "eval/{ds}/response_len/mean"
EVAL_TOOL_EPISODE_SHARE = "eval/{ds}/tool/episode_share"
EVAL_TOOL_CALLS_PER_EPISODE = "eval/{ds}/tool/calls_per_episode"
EVAL_LAG_STEPS = "eval/lag_steps"
EVAL_DURATION_SECONDS = "eval/duration_seconds"
EVAL_EXPORT_SECONDS = "eval/export_seconds"
EVAL_SKIPPED_PREFIX = "eval/skipped_"
EVAL_SKIPPED = EVAL_SKIPPED_PREFIX + "{reason}"

# Why an eval did not happen (or did not count). Every one becomes `eval/skipped_{reason}` = 1 at
# the step it concerns; none of them ever stops training.
SKIP_REASONS = (
    "busy",           # --eval-max-in-flight evals pending and --eval-overflow-policy=skip
    "export_failed",  # writing the snapshot failed
    "ckpt_missing",   # the snapshot/checkpoint to evaluate has no completion marker
    "crashed",        # the eval itself raised (engine died, reward raised, storage down)
    "unhealthy",      # the eval engine did not come up or did not answer /model_info (liveness)
    "pin_violation",  # an eval engine reported a weight version other than the pinned snapshot's
)

# Pattern -> meaning. docs/evaluation.md and tests are checked against EVAL_METRIC_PATTERNS, so
# renaming one here breaks that check on purpose.
EVAL_METRICS: dict[str, str] = {
    EVAL_REWARD: "Mean reward over all eval samples of dataset ds.",
    EVAL_PASS_AT_K: "Unbiased pass@k over the prompts of ds (a sample passes when its reward >= --eval-pass-threshold).",
    EVAL_TRUNCATED_RATIO: "Fraction of eval samples of ds cut at --eval-max-response-len (finish_reason length).",
    EVAL_RESPONSE_LEN_MEAN: "Mean response length in tokens of the eval samples of ds.",
    EVAL_TOOL_EPISODE_SHARE: "Fraction of the eval episodes of ds that called a tool (only for episodes reporting tool counts).",
    EVAL_TOOL_CALLS_PER_EPISODE: "Mean tool calls per eval episode of ds (only for episodes reporting tool counts).",
    EVAL_LAG_STEPS: "How late the eval point landed: the latest trained step when the result was written, minus the snapshot's step.",
    EVAL_DURATION_SECONDS: "Seconds one snapshot's eval took (all datasets, including pinning or starting the engine).",
    EVAL_EXPORT_SECONDS: "Seconds the trainer spent exporting the snapshot for this eval step.",
    EVAL_SKIPPED: "1 at a step whose eval did not happen; reason: busy, export_failed, ckpt_missing, crashed, unhealthy, pin_violation.",
}
EVAL_METRIC_PATTERNS: tuple[str, ...] = tuple(EVAL_METRICS)


def eval_reward_metric(ds: str) -> str:
    return EVAL_REWARD.format(ds=ds)


def eval_pass_at_k_metric(ds: str, k: int) -> str:
    return EVAL_PASS_AT_K.format(ds=ds, k=k)


def eval_truncated_ratio_metric(ds: str) -> str:
    return EVAL_TRUNCATED_RATIO.format(ds=ds)


def eval_response_len_metric(ds: str) -> str:
    return EVAL_RESPONSE_LEN_MEAN.format(ds=ds)


def eval_tool_metric(ds: str, pattern: str) -> str:
    """EVAL_TOOL_EPISODE_SHARE or EVAL_TOOL_CALLS_PER_EPISODE of dataset ds."""
    return pattern.format(ds=ds)


def eval_skipped_metric(reason: str) -> str:
    if reason not in SKIP_REASONS:
        raise ValueError(f"unknown eval skip reason {reason!r}; known: {', '.join(SKIP_REASONS)}")
    return EVAL_SKIPPED.format(reason=reason)


# ----------------------------------------------------------------------------- all of them
# Every name and pattern above that is logged (the reference lists exactly these).
METRIC_NAMES: tuple[str, ...] = tuple(dict.fromkeys(
    [*PERF_METRICS, *WEIGHTS_METRICS, *RUN_METRICS, *PRODUCER_METRICS, *ROLLOUT_METRICS, *BUFFER_METRICS, *LOSS_METRICS,
     *TRAIN_STEP_METRICS, *EVAL_METRICS]))

"""Eval metric names (docs/evaluation.md). Names are interface: docs/evaluation.md and the metric
reference are checked against `EVAL_METRIC_PATTERNS`, so renaming one here breaks that check
on purpose.
"""

from __future__ import annotations

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

# Pattern -> meaning. `{ds}` is an eval dataset name (--eval-prompt-data name=uri), `{k}` a
# pass@k sample count (powers of two up to --n-samples-per-eval-prompt, and n itself), `{reason}`
# one of SKIP_REASONS. Every eval metric is logged at the evaluated snapshot's own step, under
# metrics/eval/.
EVAL_METRICS: dict[str, str] = {
    "eval/{ds}": "Mean reward over all eval samples of dataset ds.",
    "eval/{ds}/pass@{k}": "Unbiased pass@k over the prompts of ds (a sample passes when its reward >= --eval-pass-threshold).",
    "eval/{ds}/truncated_ratio": "Fraction of eval samples of ds cut at --eval-max-response-len (finish_reason length).",
    "eval/{ds}/response_len/mean": "Mean response length in tokens of the eval samples of ds.",
    "eval/lag_steps": "How late the eval point landed: the latest trained step when the result was written, minus the snapshot's step.",
    "eval/duration_seconds": "Seconds one snapshot's eval took (all datasets, including pinning or starting the engine).",
    "eval/export_seconds": "Seconds the trainer spent exporting the snapshot for this eval step.",
    "eval/skipped_{reason}": "1 at a step whose eval did not happen; reason: busy, export_failed, ckpt_missing, crashed, unhealthy, pin_violation.",
}
EVAL_METRIC_PATTERNS: tuple[str, ...] = tuple(EVAL_METRICS)


def mean_reward_metric(ds: str) -> str:
    return f"eval/{ds}"


def pass_at_k_metric(ds: str, k: int) -> str:
    return f"eval/{ds}/pass@{k}"


def skipped_metric(reason: str) -> str:
    if reason not in SKIP_REASONS:
        raise ValueError(f"unknown eval skip reason {reason!r}; known: {', '.join(SKIP_REASONS)}")
    return f"eval/skipped_{reason}"


LAG_STEPS = "eval/lag_steps"
DURATION_SECONDS = "eval/duration_seconds"
EXPORT_SECONDS = "eval/export_seconds"

"""Metric names the trainer logs beside the loss metrics (train/losses.py METRIC_NAMES), with meanings.

A light module (no torch), so the docs reference can read it cheaply.
"""

SAMPLES = "train/samples"
TOKENS = "train/tokens"
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
    SAMPLES: "Samples that entered the loss this step (failed, aborted and fully masked samples excluded).",
    TOKENS: "Response tokens that entered the loss this step (after the loss mask).",
    OPTIMIZER_STEPS: "Optimizer steps taken on this rollout: rollout_batch_size x n_samples_per_prompt / --global-batch-size (train/grad_norm is their mean).",
    MICRO_BATCHES: "Forward/backward micro-batches DP rank 0 ran this step (--micro-batch-size samples each, or packed to --max-tokens-per-gpu under --use-dynamic-batch-size).",
    PADDING_FRACTION: "Share of the token positions DP rank 0 computed that were padding (right padding to a micro-batch's longest sample; 0 under --use-dynamic-batch-size).",
    TRAIN_STEP_SECONDS: "Seconds of the trainer's forward, backward and optimizer step.",
    MOE_AUX_LOSS: "A mixture-of-experts model's load-balancing loss (transformers' load_balancing_loss_func of each MoE layer's router logits, mean over the MoE layers; balanced routing gives top-k), token-weighted over the micro-batches; the loss adds router_aux_loss_coef times it (--moe-aux-loss-coeff: Megatron's coefficient instead, per MoE layer, summed). Absent for dense models and without an aux loss.",
    ROUTING_MISMATCH: "A mixture-of-experts model's share of (token, MoE layer) pairs whose top-k experts in the trainer's forward differ from those the engine routed the token to (samples carrying the engine's routed experts: --use-rollout-routing-replay). 0 under replay; absent when no sample carries routes.",
    ROUTING_MISMATCH_OWN: "The same share for the trainer's router's own choice (what it would route without replay): how far the trainer's routing drifts from the engine's, with or without replay.",
}

"""Off-policy corrections with miles' `--custom-tis-function-path` contract, and the ones miles ships.

A correction is called by the policy loss (miles_core.train.losses) on every micro-batch when
`--use-tis` (or `--get-mismatch-metrics`) is set, in place of the built-in truncated importance
sampling:

    fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths,
       **kwargs) -> (pg_loss, loss_masks, metrics)

- `args`: the run's train settings by miles' names (`args.tis_clip`, `args.tis_level`, ...);
- `pg_loss`: 1-D, the clipped policy-gradient term of every sample's response tokens, back to back;
- `train_log_probs`, `rollout_log_probs`, `loss_masks`: one 1-D tensor per sample over its response
  tokens (the trainer's log-probs before the step, the engine's, and 1 where the token is trained);
- returns the reweighted `pg_loss`, one (possibly narrowed) loss mask per sample (a token masked to 0
  leaves the numerator of the loss only; the token count it is divided by stays the rollout's), and
  `metrics`: name -> a 1-D tensor over the same tokens (or a list, one per sample), logged as
  `train/<name>`, the mean over the original loss tokens.

Built in, by the names miles' recipes use (miles' own paths of them are accepted as they are:
miles_core.config.plugins.MILES_CORRECTION_PATHS;
docs/algorithms.md#off-policy-corrections---custom-tis-function-path):
- `vanilla_tis_function`: truncated IS, clamp(exp(old - rollout), tis_clip_low, tis_clip);
- `icepop_function`: tokens whose ratio is outside [tis_clip_low, tis_clip] get weight 0 (popped),
  the others their ratio;
- `compute_mis_weights_with_cp` (also `compute_mis_weights_fsdp`): miles' masked / truncated / clipped
  importance sampling at token, sequence or geometric level, rejection sampling with a veto, and batch
  normalization of the weights (its `mis.py` example; the keys of its `mis.yaml` are flags here).
"""

from __future__ import annotations

from typing import Any

import torch

Tensor = torch.Tensor

SAFETY_BOUND = 20.0  # |log-ratio| bound before exp (miles' value)



def vanilla_tis_function(args, *, pg_loss: Tensor, train_log_probs: list[Tensor], rollout_log_probs: list[Tensor],
                         loss_masks: list[Tensor], **kwargs: Any) -> tuple[Tensor, list[Tensor], dict[str, Tensor]]:
    """Truncated importance sampling: pg_loss x clamp(exp(old - rollout), tis_clip_low, tis_clip)."""
    ratio = torch.exp(torch.cat(train_log_probs) - torch.cat(rollout_log_probs))
    weight = ratio.clamp(args.tis_clip_low, args.tis_clip)
    metrics = {"tis": ratio.detach(), "tis_clipfrac": (weight != ratio).float(), "tis_abs": (ratio - 1).abs().detach()}
    return pg_loss * weight, loss_masks, metrics


def icepop_function(args, *, pg_loss: Tensor, train_log_probs: list[Tensor], rollout_log_probs: list[Tensor],
                    loss_masks: list[Tensor], **kwargs: Any) -> tuple[Tensor, list[Tensor], dict[str, Tensor]]:
    """IcePop: a token whose exp(old - rollout) lies outside [tis_clip_low, tis_clip] gets weight 0,
    the others their ratio unclamped."""
    ratio = torch.exp(torch.cat(train_log_probs) - torch.cat(rollout_log_probs))
    weight = torch.where((ratio >= args.tis_clip_low) & (ratio <= args.tis_clip), ratio, torch.zeros_like(ratio))
    metrics = {"tis": ratio.detach(), "tis_clipfrac": (weight != ratio).float(), "tis_abs": (ratio - 1).abs().detach()}
    return pg_loss * weight, loss_masks, metrics


# ----------------------------------------------------------------------------- miles' MIS


def _masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum()


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return _masked_sum(x, mask) / mask.sum().clamp_min(1)


def _masked_extreme(x: Tensor, mask: Tensor, fn) -> Tensor:
    m = mask.bool()
    return fn(x[m]) if m.any() else x.new_zeros(())


def _log_ratio(raw: Tensor, mask: Tensor, level: str) -> Tensor:
    """The log IS ratio of each token at `level`: its own (token), its sequence's sum (sequence: the
    product of the ratios), or its sequence's mean (geometric: their geometric mean)."""
    if level == "token":
        return raw
    if level == "sequence":
        return _masked_sum(raw, mask).expand_as(raw)
    if level == "geometric":
        return _masked_mean(raw, mask).expand_as(raw)
    raise ValueError(f"unknown IS level {level!r} (token, sequence or geometric)")


def _append(metrics: dict[str, list[Tensor]], key: str, value: Tensor) -> None:
    metrics.setdefault(key, []).append(value.detach().float())


def _reject(weights: Tensor, mask: Tensor, metrics, low: float, high: float, prefix: str) -> Tensor:
    """`mask` with the tokens whose weight is outside [low, high] set to 0 (miles' `mask` mode)."""
    _append(metrics, f"{prefix}mask_fraction_low", (weights < low).int())
    _append(metrics, f"{prefix}mask_fraction_high", (weights > high).int())
    return mask * ((weights >= low) & (weights <= high)).float()


def _mismatch_metrics(train: Tensor, rollout: Tensor, mask: Tensor, metrics) -> None:
    """How far the trainer's log-probs are from the engine's (miles' `add_ppl_metrics`)."""
    log_ratio = train - rollout
    mean_train, mean_rollout = _masked_mean(train, mask), _masked_mean(rollout, mask)
    _append(metrics, "training_log_ppl", (-mean_train).expand_as(train))
    _append(metrics, "rollout_log_ppl", (-mean_rollout).expand_as(train))
    _append(metrics, "kl", rollout - train)
    _append(metrics, "k3_kl", torch.exp(log_ratio) - log_ratio - 1)
    diff = mean_rollout - mean_train
    _append(metrics, "log_ppl_diff", diff.expand_as(train))
    _append(metrics, "log_ppl_abs_diff", diff.abs().expand_as(train))
    rho = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    _append(metrics, "chi2_token", (_masked_mean(rho.square(), mask) - 1.0).expand_as(train))
    seq = _masked_sum(log_ratio, mask).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    _append(metrics, "chi2_seq", (torch.exp(2.0 * seq) - 1.0).expand_as(train))


def compute_mis_weights(args, *, train_log_probs: list[Tensor], rollout_log_probs: list[Tensor],
                        loss_masks: list[Tensor]) -> tuple[list[Tensor] | None, list[Tensor], dict[str, list[Tensor]]]:
    """miles' MIS on whole sequences: (IS weight per sample or None without --use-tis, the loss mask
    per sample after rejection, metrics per sample).

    IS (`--use-tis`): w = exp(log-ratio at `tis_level`, bounded to +-20), then by `tis_mode`: truncate
    (min(w, tis_upper_bound)), clip (clamp to [tis_lower_bound, tis_upper_bound]) or mask (w kept,
    tokens outside the bounds rejected); `tis_lower_bound` defaults to 1 / tis_upper_bound.
    RS (`--use-rs`): tokens whose ratio at `rs_level` lies outside [rs_lower_bound, rs_upper_bound]
    (default: the IS bounds) are rejected; with `rs_veto_threshold` a sequence holding any loss token
    whose own ratio is below it is rejected whole. `tis_batch_normalize` divides the weights by their
    mean over the micro-batch's loss tokens (token level) or sequences (sequence level).
    """
    if not len(train_log_probs) == len(rollout_log_probs) == len(loss_masks):
        raise ValueError(f"{len(train_log_probs)} train, {len(rollout_log_probs)} rollout log-prob sequences and "
                         f"{len(loss_masks)} loss masks")
    metrics: dict[str, list[Tensor]] = {}
    for train, rollout, mask in zip(train_log_probs, rollout_log_probs, loss_masks):
        if not train.shape == rollout.shape == mask.shape:
            raise ValueError(f"a sequence's shapes differ: train {tuple(train.shape)}, rollout "
                             f"{tuple(rollout.shape)}, loss mask {tuple(mask.shape)}")
        _mismatch_metrics(train, rollout, mask.float(), metrics)
    if not args.use_tis:
        return None, loss_masks, metrics

    tis_low = args.tis_lower_bound if args.tis_lower_bound is not None else 1.0 / args.tis_upper_bound
    rs_low = args.rs_lower_bound if args.rs_lower_bound is not None else tis_low
    rs_high = args.rs_upper_bound if args.rs_upper_bound is not None else args.tis_upper_bound
    weights, masks = [], []
    for train, rollout, loss_mask in zip(train_log_probs, rollout_log_probs, loss_masks):
        loss_mask = loss_mask.float()
        raw = train - rollout
        kept = loss_mask.clone()
        log_tis = _log_ratio(raw, loss_mask, args.tis_level)
        w = torch.exp(log_tis.clamp(-SAFETY_BOUND, SAFETY_BOUND))
        _append(metrics, "tis_weight_before_bound", w)
        if args.tis_mode == "truncate":
            _append(metrics, "tis_truncate_fraction", (w > args.tis_upper_bound).int())
            w = w.clamp(0, args.tis_upper_bound) * loss_mask
        elif args.tis_mode == "clip":
            _append(metrics, "tis_clip_fraction_low", (w < tis_low).int())
            _append(metrics, "tis_clip_fraction_high", (w > args.tis_upper_bound).int())
            w = w.clamp(tis_low, args.tis_upper_bound) * loss_mask
        elif args.tis_mode == "mask":
            kept = _reject(w, loss_mask, metrics, tis_low, args.tis_upper_bound, "tis_")
            w = w * loss_mask
        else:
            raise ValueError(f"unknown tis_mode {args.tis_mode!r} (truncate, clip or mask)")
        _append(metrics, "tis_weight_after_bound", w)
        if args.use_rs:
            log_rs = log_tis if args.rs_level == args.tis_level else _log_ratio(raw, loss_mask, args.rs_level)
            kept = _reject(torch.exp(log_rs.clamp(-SAFETY_BOUND, SAFETY_BOUND)), kept, metrics, rs_low, rs_high, "rs_")
            if args.rs_veto_threshold is not None:
                bad = (raw < torch.log(torch.tensor(args.rs_veto_threshold))) & loss_mask.bool()
                _append(metrics, "rs_catastrophic_token_fraction", bad.int())
                _append(metrics, "rs_catastrophic_seq_fraction", bad.any().int().expand_as(loss_mask))
                kept = kept * (~bad.any()).float()
        _append(metrics, "is_ratio_mean_after_tis_rs", w)
        weights.append(w.detach())
        masks.append(kept.detach())

    if args.tis_batch_normalize:
        if args.tis_level == "token":
            mean = (sum(_masked_sum(w, m.float()) for w, m in zip(weights, loss_masks))
                    / sum(m.float().sum() for m in loss_masks).clamp_min(1))
        elif args.tis_level == "sequence":
            mean = sum(_masked_mean(w, m.float()) for w, m in zip(weights, loss_masks)) / len(weights)
        else:
            raise ValueError(f"tis_batch_normalize needs tis_level token or sequence, not {args.tis_level!r}")
        norm = mean if mean > 1e-8 else torch.ones(())
        weights = [w / norm for w in weights]
        for w in weights:
            _append(metrics, "batch_norm_factor", norm.expand_as(w))
    for w, m in zip(weights, loss_masks):
        m = m.float()
        _append(metrics, "is_ratio_mean_final", _masked_mean(w, m).expand_as(w))
        _append(metrics, "is_ratio_min_final", _masked_extreme(w, m, torch.min).expand_as(w))
        _append(metrics, "is_ratio_max_final", _masked_extreme(w, m, torch.max).expand_as(w))
    return weights, masks, metrics


def compute_mis_weights_with_cp(args, *, pg_loss: Tensor, train_log_probs: list[Tensor],
                                rollout_log_probs: list[Tensor], loss_masks: list[Tensor],
                                **kwargs: Any) -> tuple[Tensor, list[Tensor], dict[str, list[Tensor]]]:
    """miles' MIS as a correction (`compute_mis_weights` on whole sequences; context parallel size is
    1 here, so nothing is gathered): pg_loss x the weights, the rejection masks, metrics as `mis_<name>`."""
    weights, masks, metrics = compute_mis_weights(args, train_log_probs=train_log_probs,
                                                  rollout_log_probs=rollout_log_probs, loss_masks=loss_masks)
    if weights is not None:
        pg_loss = pg_loss * torch.cat(weights)
    return pg_loss, masks, {f"mis_{k}": v for k, v in metrics.items()}


compute_mis_weights_fsdp = compute_mis_weights_with_cp

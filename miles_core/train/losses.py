"""The PPO-clip policy loss with the off-policy corrections of docs/training.md and the algorithms of
docs/algorithms.md (the advantages it is given are computed in miles_core.rank_batches).

All token tensors are [batch, tokens] with a 0/1 `mask` (response tokens whose `loss_mask` is 1).
The ratio denominator ("old" log-probs) is chosen once per config:
- `use_decoupled_loss`: proximal = the trainer's log-probs before the step (detached), so the
  clipped ratio is exp(logp - prox); the behaviour correction w = clamp(exp(prox - rollout),
  tis_clip_low, tis_clip) multiplies the clipped loss (AReaL's decoupled PPO, truncated);
- `use_rollout_logprobs` (default): old = the engine's log-probs, ratio exp(logp - rollout);
- `use_tis`: old = the trainer's log-probs before the step; w = clamp(exp(old - rollout),
  tis_clip_low, tis_clip) multiplies the clipped loss;
- none: old = the trainer's log-probs before the step (on-policy PPO).
With `correction` (--custom-tis-function-path, miles_core.train.corrections) `use_tis`'s weight is the
function's: it reweights the clipped terms and may narrow the loss mask; its metrics are logged as
train/<name>. With `get_mismatch_metrics` alone it is called for its metrics, the loss unchanged.
One optimizer step per batch means "before the step" is the same forward, detached.
gspo (`sequence_ratio`) replaces each token's log-ratio by its sequence's mean over loss tokens;
`use_opsm` leaves out tokens with a negative advantage whose sequence's mean log(old / current)
exceeds `opsm_delta`; the KL term is `approx_kl` of `kl_loss_type`. Both sequence-level terms read
each token's sequence from `segments` (its sample's number in the micro-batch, 0 elsewhere).
Sums are returned (not means) so micro-batches add up; `finalize_metrics` divides by the
batch's token count. Token-mean aggregation over the whole batch, as in slime.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from types import SimpleNamespace
from typing import Any, Callable

import torch

from miles_core.config.plugins import correction_path, load_plugin
from miles_core.metrics import names as N

Tensor = torch.Tensor


@dataclass(frozen=True)
class LossConfig:
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    use_tis: bool = False
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    use_rollout_logprobs: bool = True
    use_decoupled_loss: bool = False
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    entropy_coef: float = 0.0
    kl_loss_type: str = "k1"
    sequence_ratio: bool = False  # gspo: one importance ratio per sequence
    use_opsm: bool = False
    opsm_delta: float = 1e-4
    # --custom-tis-function-path (miles_core.train.corrections' contract), called with `correction_args`
    correction: Callable | None = None
    correction_args: Any = None
    get_mismatch_metrics: bool = False  # call `correction` for its metrics only, the loss unchanged

    @classmethod
    def from_section(cls, t) -> "LossConfig":
        correction = None
        if t.custom_tis_function_path:
            correction = load_plugin(correction_path(t.custom_tis_function_path), "--custom-tis-function-path")
        args = SimpleNamespace(**{"qkv_format": "thd", "calculate_per_token_loss": True,
                                  **{f.name: getattr(t, f.name) for f in fields(t)}})
        return cls(t.eps_clip, t.eps_clip_high, t.use_tis, t.tis_clip, t.tis_clip_low, t.use_rollout_logprobs,
                   t.use_decoupled_loss, t.use_kl_loss, t.kl_loss_coef, t.entropy_coef, t.kl_loss_type,
                   t.advantage_estimator == "gspo", t.use_opsm, t.opsm_delta, correction, args,
                   t.get_mismatch_metrics)

    @property
    def needs_rollout_logprobs(self) -> bool:
        return self.use_decoupled_loss or self.use_rollout_logprobs or self.use_tis or self.get_mismatch_metrics

    @property
    def corrects(self) -> bool:
        """The correction function runs (on every micro-batch)."""
        return self.correction is not None and (self.use_tis or self.get_mismatch_metrics)


LOG_RATIO_CLAMP = 20.0  # low_var_kl's clamp of the log-ratio (miles' _safe_clamp_log_ratio)


def approx_kl(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled tokens, miles' --kl-loss-type (Schulman's k1/k2/k3):
    with d = logp - ref_logp, k1 = d, k2 = d^2 / 2, k3 = exp(-d) - 1 + d; low_var_kl = k3 with -d clamped
    to [-20, 20] and the value to [-10, 10]."""
    d = logp.float() - ref_logp.float()
    if kind == "k1":
        return d
    if kind == "k2":
        return d * d / 2.0
    if kind not in ("k3", "low_var_kl"):
        raise ValueError(f"--kl-loss-type={kind!r}: not one of k1, k2, k3, low_var_kl")
    neg = -d
    if kind == "low_var_kl":
        neg = torch.nan_to_num(neg, nan=0.0, posinf=LOG_RATIO_CLAMP, neginf=-LOG_RATIO_CLAMP).clamp(
            -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    kl = neg.exp() - 1.0 - neg
    return kl.clamp(-10.0, 10.0) if kind == "low_var_kl" else kl


def sequence_mean(values: Tensor, mask: Tensor, segments: Tensor) -> Tensor:
    """Each token's value replaced by the mean over the loss tokens of its sequence (`segments`: the
    sequence's number on its tokens, 0 elsewhere); differentiable (gspo's sequence-level log-ratio)."""
    seg = segments.long().flatten()
    n = int(seg.max()) + 1 if seg.numel() else 1
    total = values.new_zeros(n).index_add(0, seg, (values * mask).flatten())
    count = mask.new_zeros(n).index_add(0, seg, mask.flatten()).clamp(min=1.0)
    return (total / count)[seg].view_as(values)


def token_entropy(logits: Tensor) -> Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def policy_loss(cfg: LossConfig, logp: Tensor, advantages: Tensor, mask: Tensor, *, total_tokens: float,
                rollout_logp: Tensor | None = None, ref_logp: Tensor | None = None,
                entropy: Tensor | None = None, segments: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """(loss to backprop, metric sums) for one micro-batch.

    `advantages` is per token (the sample's advantage broadcast over its response). The loss is
    sum over masked tokens / `total_tokens` (the whole batch's count), so micro-batch gradients
    add up to the batch's token mean.
    """
    mask = mask.to(logp.dtype)
    current = logp.detach()
    if cfg.needs_rollout_logprobs and rollout_logp is None:
        raise ValueError("this loss needs the rollout log-probs (response_logprobs) of every sample")
    weight = None
    if cfg.use_decoupled_loss:
        old = current
        weight_raw = torch.exp(current - rollout_logp)
    elif cfg.use_rollout_logprobs:
        old, weight_raw = rollout_logp, None
    elif cfg.use_tis:
        old = current
        weight_raw = None if cfg.correction is not None else torch.exp(current - rollout_logp)
    else:
        old, weight_raw = current, None
    eps_high = cfg.eps_clip if cfg.eps_clip_high is None else cfg.eps_clip_high
    log_ratio = logp - old
    if (cfg.sequence_ratio or cfg.use_opsm) and segments is None:
        raise ValueError("gspo and --use-opsm need each token's sequence (segments)")
    opsm_keep = None
    if cfg.use_opsm:  # a sequence pushed down (A < 0) while far from the policy that generated it is left out
        seq_kl = sequence_mean((old - current), mask, segments)
        opsm_keep = 1.0 - ((advantages < 0) & (seq_kl > cfg.opsm_delta)).to(logp.dtype)
    if cfg.sequence_ratio:  # gspo: exp of the sequence's mean log-ratio on each of its tokens
        log_ratio = sequence_mean(log_ratio, mask, segments)
    ratio = torch.exp(log_ratio)
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - cfg.eps_clip, 1.0 + eps_high)
    pg = torch.maximum(pg1, pg2)
    clipped = (pg2 > pg1).to(logp.dtype)
    if opsm_keep is not None:
        pg = pg * opsm_keep
    corrected: dict[str, Tensor] = {}
    if cfg.corrects:
        if segments is None:
            raise ValueError("--custom-tis-function-path needs each token's sequence (segments)")
        new_pg, keep, corrected = apply_correction(cfg, pg, current, rollout_logp, mask, segments)
        if cfg.use_tis:  # --get-mismatch-metrics alone: the metrics, the loss unchanged
            pg = new_pg * keep
    if weight_raw is not None:
        weight = weight_raw.clamp(cfg.tis_clip_low, cfg.tis_clip)
        tis_clipped = ((weight_raw < cfg.tis_clip_low) | (weight_raw > cfg.tis_clip)).to(logp.dtype)
        pg = pg * weight
    else:
        weight, tis_clipped = torch.ones_like(logp), torch.zeros_like(logp)
    per_token = pg
    if entropy is not None and cfg.entropy_coef:
        per_token = per_token - cfg.entropy_coef * entropy
    kl_sum = 0.0
    if cfg.use_kl_loss and ref_logp is not None:
        kl = approx_kl(logp, ref_logp, cfg.kl_loss_type)
        per_token = per_token + cfg.kl_loss_coef * kl
        kl_sum = float((kl.detach() * mask).sum())
    loss = (per_token * mask).sum() / max(total_tokens, 1.0)

    def s(x: Tensor) -> float:
        return float((x.detach() * mask).sum())

    sums = {
        N.TIS_MEAN: s(weight),
        N.TIS_CLIPFRAC: s(tis_clipped),
        N.PPO_KL: s(-log_ratio),
        N.PG_CLIPFRAC: s(clipped),
        N.TRAIN_ROLLOUT_LOGPROB_ABS_DIFF: s((current - rollout_logp).abs()) if rollout_logp is not None else 0.0,
        N.ENTROPY: s(entropy) if entropy is not None else 0.0,
        N.LOSS: float(loss.detach()) * max(total_tokens, 1.0),
    }
    if cfg.use_kl_loss:
        sums[N.KL_LOSS] = kl_sum
    if opsm_keep is not None:
        sums[N.OPSM_CLIPFRAC] = s(1.0 - opsm_keep)
    for name, value in corrected.items():
        sums[N.TRAIN_PREFIX + name] = s(value)
    return loss, sums


def response_positions(segments: Tensor) -> tuple[Tensor, list[int]]:
    """(where the flattened micro-batch holds response tokens, each sample's count of them in order):
    `segments` is the sample's number on its response tokens, 0 elsewhere."""
    flat = segments.flatten().long()
    resp = flat > 0
    numbers, counts = torch.unique_consecutive(flat[resp], return_counts=True)
    if len(set(numbers.tolist())) != len(numbers):
        raise ValueError("a sample's response tokens are not contiguous in the micro-batch")
    return resp, counts.tolist()


def apply_correction(cfg: LossConfig, pg: Tensor, current: Tensor, rollout_logp: Tensor, mask: Tensor,
                     segments: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """`cfg.correction` called as miles calls it (miles_core.train.corrections): per sample, its response
    tokens (`segments` > 0, in order); returns the corrected pg, the kept tokens (0/1) and the metrics,
    each laid back out as `pg`'s shape (0 off the responses)."""
    resp, sizes = response_positions(segments)

    def per_sample(x: Tensor) -> list[Tensor]:
        return list(torch.split(x.flatten()[resp], sizes))

    pg_flat = pg.flatten()[resp]
    out, masks, metrics = cfg.correction(
        cfg.correction_args, pg_loss=pg_flat, train_log_probs=per_sample(current),
        rollout_log_probs=per_sample(rollout_logp), loss_masks=per_sample(mask), total_lengths=None,
        response_lengths=sizes, max_seq_lens=None, parallel_state=None)
    where = f"{getattr(cfg.correction, '__qualname__', cfg.correction)} (--custom-tis-function-path)"
    if out.shape != pg_flat.shape or len(masks) != len(sizes) or any(m.numel() != n for m, n in zip(masks, sizes)):
        raise ValueError(f"{where} returned pg_loss of shape {tuple(out.shape)} and {len(masks)} masks "
                         f"for {len(sizes)} samples of {sizes} tokens")

    def laid_out(values: Tensor, like: Tensor) -> Tensor:
        return torch.zeros_like(like).flatten().masked_scatter(resp, values.to(like.dtype)).view_as(like)

    kept = laid_out(torch.cat([m.flatten() for m in masks]).detach(), mask)
    named = {}
    for name, value in metrics.items():
        value = torch.cat([v.flatten() for v in value]) if isinstance(value, (list, tuple)) else value.flatten()
        if value.numel() != pg_flat.numel():
            raise ValueError(f"{where} returned metric {name!r} with {value.numel()} values for {pg_flat.numel()} tokens")
        named[name] = laid_out(value.detach().float(), mask)
    return pg.flatten().masked_scatter(resp, out.to(pg.dtype)).view_as(pg), kept, named


SUM_KEYS = (N.TIS_MEAN, N.TIS_CLIPFRAC, N.PPO_KL, N.PG_CLIPFRAC, N.TRAIN_ROLLOUT_LOGPROB_ABS_DIFF, N.ENTROPY, N.LOSS)


def sum_keys(cfg: LossConfig) -> tuple[str, ...]:
    """The keys of `policy_loss`'s sums under `cfg` (ranks without samples report zeros for them)."""
    return (SUM_KEYS + ((N.KL_LOSS,) if cfg.use_kl_loss else ()) + ((N.OPSM_CLIPFRAC,) if cfg.use_opsm else ())
            + correction_keys(cfg))


def correction_keys(cfg: LossConfig) -> tuple[str, ...]:
    """The metric names `cfg.correction` returns, read from one call on a two-token sample (a
    correction's metric names depend on its settings, not on the data)."""
    if not cfg.corrects:
        return ()
    one = torch.zeros(1, 2)
    _, _, metrics = apply_correction(cfg, one, one, one, torch.ones(1, 2), torch.ones(1, 2))
    return tuple(N.TRAIN_PREFIX + name for name in metrics)


def finalize_metrics(sums: dict[str, float], total_tokens: float) -> dict[str, float]:
    """Token means over the batch from the summed micro-batch metrics."""
    n = max(total_tokens, 1.0)
    return {k: v / n for k, v in sums.items()}

"""Losses against hand-computed values on small tensors (docs/fully-async.md).

Each case spells out the arithmetic in its docstring; the expected numbers are computed by hand,
not by the code under test. Pins: GRPO normalisation (unbiased std, singleton groups), PPO-clip
asymmetry (the clip only binds on the side that would increase the objective), eps_clip_high,
the rollout log-probs as denominator, TIS truncation and its metrics, decoupled weights, the
k3 KL, the entropy bonus, masking and the batch-level token mean across micro-batches.
"""

from __future__ import annotations

import math

import pytest
import torch

from miles_core.metrics.names import LOSS_METRIC_NAMES as METRIC_NAMES
from miles_core.rank_batches import grpo_advantages
from miles_core.train.losses import LossConfig, finalize_metrics, policy_loss

torch.set_num_threads(1)
ln = math.log


def _t(*xs):
    return torch.tensor([list(xs)], dtype=torch.float64)


def test_grpo_advantages_by_hand():
    """[1,0,0,1]: mean 0.5, unbiased std sqrt(1/3) -> ±0.8660; without std ±0.5; n=1 or equal -> 0."""
    adv = grpo_advantages([1.0, 0.0, 0.0, 1.0])
    assert adv == pytest.approx([0.8660254, -0.8660254, -0.8660254, 0.8660254], abs=1e-5)
    assert grpo_advantages([1.0, 0.0, 0.0, 1.0], False) == [0.5, -0.5, -0.5, 0.5]
    assert grpo_advantages([0.7]) == [0.0]
    assert max(abs(a) for a in grpo_advantages([0.3, 0.3, 0.3])) < 1e-6
    # torch's float32 arithmetic (slime's): within a few float32 steps
    for rewards in ([0.1, 0.7, 0.3, 0.9, 0.2, 0.25, 0.6, 1.0], [1.0, 0.0, 0.0, 0.0], [0.5, 0.51]):
        t = torch.tensor(rewards, dtype=torch.float32)
        want = ((t - t.mean()) / (t.std() + 1e-6)).tolist()
        assert grpo_advantages(rewards) == pytest.approx(want, rel=5e-7, abs=1e-7)


def _ppo(cfg, logp, rollout, adv, mask, total=None, **kw):
    logp = logp.clone().requires_grad_(True)
    loss, sums = policy_loss(cfg, logp, adv, mask, total_tokens=total or float(mask.sum()), rollout_logp=rollout, **kw)
    loss.backward()
    return loss.item(), finalize_metrics(sums, float(mask.sum())), logp.grad


def test_ppo_clip_with_rollout_denominator_positive_advantage():
    """ratio = [0.6/0.4, 0.3/0.3] = [1.5, 1]; A=+1, eps 0.2: token 0 clips at 1.2 -> loss (-1.2-1)/2 = -1.1.

    The third token is masked. pg_clipfrac 1/2; ppo_kl = mean(old - logp) = ln(0.4/0.6)/2;
    |trainer - rollout| = ln(1.5)/2; gradient only through the unclipped token: [0, -1/2, 0].
    """
    cfg = LossConfig(use_rollout_logprobs=True)
    loss, m, grad = _ppo(cfg, _t(ln(.6), ln(.3), ln(.9)), _t(ln(.4), ln(.3), ln(.1)), _t(1, 1, 1), _t(1, 1, 0))
    assert loss == pytest.approx(-1.1)
    assert m["train/pg_clipfrac"] == pytest.approx(0.5)
    assert m["train/ppo_kl"] == pytest.approx(ln(0.4 / 0.6) / 2)
    assert m["train/train_rollout_logprob_abs_diff"] == pytest.approx(ln(1.5) / 2)
    assert m["train/tis_mean"] == pytest.approx(1.0) and m["train/tis_clipfrac"] == 0.0
    assert torch.allclose(grad, _t(0, -0.5, 0))


def test_ppo_clip_negative_advantage_is_not_clipped_above():
    """A=-1, ratio 1.5: max(1.5, 1.2) = 1.5 (pessimistic side), so loss = (1.5 + 1)/2 = 1.25, clipfrac 0."""
    loss, m, grad = _ppo(LossConfig(), _t(ln(.6), ln(.3)), _t(ln(.4), ln(.3)), _t(-1, -1), _t(1, 1))
    assert loss == pytest.approx(1.25)
    assert m["train/pg_clipfrac"] == 0.0
    assert torch.allclose(grad, _t(1.5 / 2, 0.5))


def test_eps_clip_high_widens_the_upper_side():
    """eps_clip_high 0.6: ratio 1.5 < 1.6 is not clipped -> loss (-1.5 - 1)/2 = -1.25."""
    loss, m, _ = _ppo(LossConfig(eps_clip_high=0.6), _t(ln(.6), ln(.3)), _t(ln(.4), ln(.3)), _t(1, 1), _t(1, 1))
    assert loss == pytest.approx(-1.25)
    assert m["train/pg_clipfrac"] == 0.0


def test_tis_truncates_the_importance_weight():
    """use_tis: old = trainer (ratio 1); w = clamp(exp(old - rollout), 0, 2) = clamp([3, 1]) = [2, 1].

    loss = (-2 - 1)/2 = -1.5; tis_mean = 1.5; tis_clipfrac = 1/2; grad = -w/2 = [-1, -0.5].
    """
    cfg = LossConfig(use_tis=True, use_rollout_logprobs=False, tis_clip=2.0, tis_clip_low=0.0)
    loss, m, grad = _ppo(cfg, _t(ln(.6), ln(.3)), _t(ln(.2), ln(.3)), _t(1, 1), _t(1, 1))
    assert loss == pytest.approx(-1.5)
    assert m["train/tis_mean"] == pytest.approx(1.5)
    assert m["train/tis_clipfrac"] == pytest.approx(0.5)
    assert m["train/ppo_kl"] == 0.0 and m["train/pg_clipfrac"] == 0.0
    assert torch.allclose(grad, _t(-1.0, -0.5))


def test_tis_lower_clamp():
    """tis_clip_low 0.5: w_raw = 0.15/0.6 = 0.25 is raised to 0.5; loss = -0.5, clipfrac 1."""
    cfg = LossConfig(use_tis=True, use_rollout_logprobs=False, tis_clip_low=0.5)
    loss, m, _ = _ppo(cfg, _t(ln(.15)), _t(ln(.6)), _t(1), _t(1))
    assert loss == pytest.approx(-0.5)
    assert m["train/tis_mean"] == pytest.approx(0.5) and m["train/tis_clipfrac"] == 1.0


def test_decoupled_loss_uses_proximal_ratio_and_behaviour_weight():
    """Decoupled: prox = trainer before the step (ratio 1), w = clamp(prox/behaviour) = clamp([3, 0.5]) = [2, 0.5].

    A=+1: loss = (-2 - 0.5)/2 = -1.25 even though use_rollout_logprobs is also set (decoupled wins).
    """
    cfg = LossConfig(use_decoupled_loss=True, use_rollout_logprobs=True)
    loss, m, grad = _ppo(cfg, _t(ln(.6), ln(.3)), _t(ln(.2), ln(.6)), _t(1, 1), _t(1, 1))
    assert loss == pytest.approx(-1.25)
    assert m["train/tis_mean"] == pytest.approx(1.25)
    assert torch.allclose(grad, _t(-1.0, -0.25))


def test_on_policy_without_corrections():
    """No rollout log-probs: old = trainer's own log-probs, ratio 1, loss = -mean(A) = -(2 - 1)/2."""
    cfg = LossConfig(use_rollout_logprobs=False)
    logp = _t(ln(.6), ln(.3)).requires_grad_(True)
    loss, sums = policy_loss(cfg, logp, _t(2, -1), _t(1, 1), total_tokens=2.0)
    assert loss.item() == pytest.approx(-0.5)
    assert sums["train/train_rollout_logprob_abs_diff"] == 0.0


def test_kl_and_entropy_terms():
    """k3 KL with ref/logp = 0.5: 0.5 - ln 0.5 - 1 = 0.19315, times coef 0.5; entropy ln 2 times -0.1.

    logp = ln .5, rollout = ln .5, A = 0: loss = 0.5 * 0.19315 - 0.1 * ln 2.
    """
    cfg = LossConfig(use_kl_loss=True, kl_loss_coef=0.5, entropy_coef=0.1, kl_loss_type="k3")
    loss, m, _ = _ppo(cfg, _t(ln(.5)), _t(ln(.5)), _t(0), _t(1), ref_logp=_t(ln(.25)), entropy=_t(ln(2)))
    kl = 0.5 - ln(0.5) - 1
    assert loss == pytest.approx(0.5 * kl - 0.1 * ln(2))
    assert m["train/kl_loss"] == pytest.approx(kl)
    assert m["train/entropy"] == pytest.approx(ln(2))


def test_micro_batches_add_up_to_the_batch_token_mean():
    """Two micro-batches normalised by the batch token count equal one batch (loss, grads, metrics)."""
    cfg = LossConfig()
    logp, roll = _t(ln(.6), ln(.3), ln(.2), ln(.7)), _t(ln(.4), ln(.3), ln(.5), ln(.7))
    adv, mask = _t(1, 1, -1, -1), _t(1, 1, 1, 0)
    whole, m_whole, g_whole = _ppo(cfg, logp, roll, adv, mask)
    parts, grads, sums = 0.0, [], {}
    for sl in (slice(0, 2), slice(2, 4)):
        l, s = policy_loss(cfg, (lp := logp[:, sl].clone().requires_grad_(True)), adv[:, sl], mask[:, sl],
                           total_tokens=3.0, rollout_logp=roll[:, sl])
        l.backward()
        parts += l.item()
        grads.append(lp.grad)
        for k, v in s.items():
            sums[k] = sums.get(k, 0.0) + v
    assert parts == pytest.approx(whole)
    assert torch.allclose(torch.cat(grads, 1), g_whole)
    for k, v in finalize_metrics(sums, 3.0).items():
        assert v == pytest.approx(m_whole[k])


def test_metric_names_are_the_interface():
    """The metric names are part of the interface (docs/fully-async.md)."""
    _, m, _ = _ppo(LossConfig(), _t(ln(.5)), _t(ln(.5)), _t(1), _t(1))
    assert set(METRIC_NAMES) - {"train/grad_norm"} <= set(m)


def test_rollout_logprobs_required_when_the_loss_needs_them():
    """The default loss without rollout log-probs fails loudly instead of training on zeros."""
    with pytest.raises(ValueError, match="rollout log-probs"):
        policy_loss(LossConfig(), _t(ln(.5)), _t(1), _t(1), total_tokens=1.0)

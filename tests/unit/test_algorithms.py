"""miles' advantage estimators, KL estimators and GSPO's sequence-level ratio against hand computations
(docs/algorithms.md). Every expected number is worked out in the docstring, not by the code under test.

Pins: grpo/gspo divide by the group's unbiased std, reinforce_plus_plus_baseline only subtracts the group
mean, reinforce_plus_plus puts the reward on the last loss token and discounts it backwards with gamma;
--normalize-advantages whitens over the rollout's loss tokens (unbiased std, 1e-8 under the root), a
sample weighted by its token count; k1/k2/k3/low_var_kl are Schulman's estimators with miles' clamps;
gspo's ratio is exp of the sequence's mean log-ratio, shared by its tokens, clipped per token, with the
gradient spread over the sequence. The flags are refused by name where they are not implemented
(--kl-coef) or need a companion (--normalize-advantages for the reinforce_plus_plus estimators).
"""

from __future__ import annotations

import math

import pytest
import torch

from miles_core.config import ConfigError, parse_flags
from miles_core.rank_batches import AdvantageSettings, trainable_samples
from miles_core.samples import Group, Sample, SampleStatus
from miles_core.train.losses import LossConfig, approx_kl, finalize_metrics, policy_loss

ln = math.log


def _group(gid: str, rewards: list[float], lengths: list[int], masks: list[list[int]] | None = None) -> Group:
    samples = []
    for j, (r, n) in enumerate(zip(rewards, lengths)):
        mask = masks[j] if masks else [1] * n
        samples.append(Sample(gid, 0, j, [1, 2], list(range(3, 3 + n)), reward=r, loss_mask=mask,
                              response_logprobs=[0.0] * n, status=SampleStatus.COMPLETED))
    return Group(gid, 0, samples)


def _adv(groups, **kw):
    return [a for _, a in trainable_samples(groups, settings=AdvantageSettings(**kw))]


def test_estimators_by_hand():
    """One group, rewards [1, 0, 0, 1], responses of 1, 2, 1 and 2 tokens.

    grpo/gspo: mean 0.5, unbiased std sqrt(1/3) = 0.57735 -> +-0.5 / (0.57735 + 1e-6) = +-0.866024;
    reinforce_plus_plus_baseline: +-0.5 (no std); reinforce_plus_plus, gamma 1: the raw rewards 1, 0, 0, 1;
    gamma 0.5: on the last loss token r, one token earlier r/2 -> [1], [0, 0], [0], [0.5, 1]; the
    second sample's mask [1, 0] ends at its first token -> [0, 0] with reward 0, and for reward 1 it
    would be [1, 0] (nothing after the last loss token)."""
    g = _group("g", [1.0, 0.0, 0.0, 1.0], [1, 2, 1, 2])
    for est in ("grpo", "gspo"):
        a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
        assert _adv([g], estimator=est) == pytest.approx([a, -a, -a, a], abs=1e-7)
    assert _adv([g], estimator="reinforce_plus_plus_baseline") == pytest.approx([0.5, -0.5, -0.5, 0.5])
    assert _adv([g], estimator="reinforce_plus_plus") == [1.0, 0.0, 0.0, 1.0]
    got = _adv([g], estimator="reinforce_plus_plus", gamma=0.5)
    assert got == [[1.0], [0.0, 0.0], [0.0], [0.5, 1.0]]
    masked = _group("m", [1.0, 1.0], [2, 3], masks=[[1, 0], [1, 0, 1]])
    assert _adv([masked], estimator="reinforce_plus_plus", gamma=0.5) == [[1.0, 0.0], [0.25, 0.5, 1.0]]


def test_whitening_over_loss_tokens_by_hand():
    """rewards [1, 0] as reinforce_plus_plus_baseline: +0.5 on 1 token, -0.5 on 3 tokens (one of them
    masked out: 2 loss tokens). Loss tokens: [0.5, -0.5, -0.5]: mean -1/6, E[x^2] = 0.25, var = 0.25 -
    1/36 = 2/9, unbiased x 3/2 = 1/3, std = 0.57735 -> (0.5 + 1/6) / 0.57735 = 1.154701,
    (-0.5 + 1/6) / 0.57735 = -0.577350."""
    g = _group("g", [1.0, 0.0], [1, 3], masks=[[1], [1, 0, 1]])
    got = _adv([g], estimator="reinforce_plus_plus_baseline", whiten=True)
    assert got == pytest.approx([1.154701, -0.577350], abs=1e-6)
    per_token = _adv([g], estimator="reinforce_plus_plus", whiten=True, gamma=0.5)
    # returns [1], [0, 0, 0] -> loss tokens [1, 0, 0]: mean 1/3, var (1/3 - 1/9) x 3/2 = 1/3
    assert per_token[0] == pytest.approx([(1 - 1 / 3) / math.sqrt(1 / 3)], abs=1e-6)
    assert per_token[1] == pytest.approx([(0 - 1 / 3) / math.sqrt(1 / 3)] * 3, abs=1e-6)


@pytest.mark.parametrize("kind, expected", [
    ("k1", [ln(2), -ln(2), 0.0]),                                  # d = logp - ref
    ("k2", [ln(2) ** 2 / 2, ln(2) ** 2 / 2, 0.0]),                 # d^2 / 2
    ("k3", [0.5 - 1 + ln(2), 2 - 1 - ln(2), 0.0]),                 # exp(-d) - 1 + d
    ("low_var_kl", [0.5 - 1 + ln(2), 2 - 1 - ln(2), 0.0]),         # k3, within the clamps
])
def test_kl_estimators_by_hand(kind, expected):
    """logp = ln[0.5, 0.25, 0.3], ref = ln[0.25, 0.5, 0.3]: d = [ln 2, -ln 2, 0]."""
    logp, ref = torch.log(torch.tensor([0.5, 0.25, 0.3])), torch.log(torch.tensor([0.25, 0.5, 0.3]))
    assert approx_kl(logp, ref, kind).tolist() == pytest.approx(expected, abs=1e-6)


def test_low_var_kl_clamps_where_k3_does_not():
    """d = -30: k3 = exp(30) - 1 - 30 (huge); low_var_kl clamps -d to 20, then the value to 10."""
    logp, ref = torch.tensor([-30.0]), torch.tensor([0.0])
    assert approx_kl(logp, ref, "k3").item() == pytest.approx(math.exp(30) - 31, rel=1e-5)
    assert approx_kl(logp, ref, "low_var_kl").item() == 10.0


def test_the_kl_loss_uses_the_configured_estimator():
    """A = 0, logp = rollout: the loss is coef x mean KL; k1 with d = [ln 2, -ln 2] averages to 0,
    k2 to ln(2)^2 / 2."""
    logp = torch.log(torch.tensor([[0.5, 0.25]])).requires_grad_(True)
    ref = torch.log(torch.tensor([[0.25, 0.5]]))
    for kind, mean_kl in (("k1", 0.0), ("k2", ln(2) ** 2 / 2)):
        cfg = LossConfig(use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type=kind)
        loss, sums = policy_loss(cfg, logp, torch.zeros(1, 2), torch.ones(1, 2), total_tokens=2.0,
                                 rollout_logp=logp.detach(), ref_logp=ref)
        assert loss.item() == pytest.approx(0.5 * mean_kl, abs=1e-6)
        assert finalize_metrics(sums, 2.0)["train/kl_loss"] == pytest.approx(mean_kl, abs=1e-6)


def test_gspo_ratio_is_the_sequence_mean_by_hand():
    """Two sequences in one row (packed), A = +1 for both, eps 0.2, rollout log-probs as the old policy.

    Sequence 1 (2 tokens): log-ratios [ln 1.5, ln 1.0] -> mean ln(1.5)/2, ratio sqrt(1.5) = 1.224745 >
    1.2: clipped on both tokens (loss -1.2 each, no gradient). Sequence 2 (1 token + a masked one):
    log-ratio ln 0.9 (the masked token's ln 3 is left out) -> ratio 0.9, unclipped for A > 0: loss -0.9,
    gradient -ratio = -0.9 on its loss token. Token mean over 3 loss tokens: (-1.2 - 1.2 - 0.9) / 3 =
    -1.1; per-token PPO would have clipped only the first token: (-1.2 - 1.0 - 0.9) / 3."""
    logp = torch.log(torch.tensor([[0.6, 0.3, 0.45, 0.9]], dtype=torch.float64)).requires_grad_(True)
    old = torch.log(torch.tensor([[0.4, 0.3, 0.5, 0.3]], dtype=torch.float64))
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    segments = torch.tensor([[1.0, 1.0, 2.0, 2.0]], dtype=torch.float64)
    adv = torch.ones(1, 4, dtype=torch.float64)
    gspo = LossConfig(use_rollout_logprobs=True, sequence_ratio=True)
    loss, sums = policy_loss(gspo, logp, adv, mask, total_tokens=3.0, rollout_logp=old, segments=segments)
    loss.backward()
    assert loss.item() == pytest.approx(-1.1)
    assert finalize_metrics(sums, 3.0)["train/pg_clipfrac"] == pytest.approx(2 / 3)
    assert logp.grad.tolist()[0] == pytest.approx([0.0, 0.0, -0.9 / 3, 0.0])
    ppo, _ = policy_loss(LossConfig(use_rollout_logprobs=True), logp.detach(), adv, mask, total_tokens=3.0,
                         rollout_logp=old, segments=segments)
    assert ppo.item() == pytest.approx((-1.2 - 1.0 - 0.9) / 3)


def test_gspo_gradient_is_spread_over_the_sequence():
    """One unclipped sequence of 2 tokens, A = +1, log-ratios [0.1, -0.1]: mean 0, ratio 1, the loss is
    the token mean of -ratio = -1; ratio = exp((lr_1 + lr_2) / 2), so d loss / d logp_t = -ratio / 2 =
    -0.5 for each token (per-token PPO: -ratio_t / 2 = -0.553, -0.452)."""
    logp = torch.tensor([[0.1, -0.1]], dtype=torch.float64).requires_grad_(True)
    old = torch.zeros(1, 2, dtype=torch.float64)
    cfg = LossConfig(use_rollout_logprobs=True, sequence_ratio=True, eps_clip=0.5)
    loss, _ = policy_loss(cfg, logp, torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64),
                          total_tokens=2.0, rollout_logp=old, segments=torch.ones(1, 2, dtype=torch.float64))
    loss.backward()
    assert loss.item() == pytest.approx(-1.0)
    assert logp.grad.tolist()[0] == pytest.approx([-0.5, -0.5])


def test_flags_refused_or_required_by_name():
    with pytest.raises(ConfigError, match=r"--kl-coef=0.1 .*reinforce_plus_plus estimators only .*miles' grpo ignores it"):
        parse_flags(["--preset", "tiny-reverse4", "--kl-coef", "0.1"])
    with pytest.raises(ConfigError, match=r"--kl-coef=-0.1 must be >= 0"):
        parse_flags(["--preset", "tiny-reverse4", "--advantage-estimator", "reinforce_plus_plus",
                     "--normalize-advantages", "--kl-coef", "-0.1"])
    with pytest.raises(ConfigError, match=r"reinforce_plus_plus needs --normalize-advantages"):
        parse_flags(["--preset", "tiny-reverse4", "--advantage-estimator", "reinforce_plus_plus"])
    with pytest.raises(ConfigError, match=r"--gamma=0.0 must be in"):
        parse_flags(["--preset", "tiny-reverse4", "--gamma", "0"])
    cfg = parse_flags(["--preset", "tiny-reverse4", "--advantage-estimator", "reinforce_plus_plus_baseline",
                       "--normalize-advantages", "--kl-loss-type", "low_var_kl"])
    assert AdvantageSettings.from_section(cfg.train) == AdvantageSettings("reinforce_plus_plus_baseline", True, True, 1.0, 0.0)
    assert LossConfig.from_section(cfg.train).kl_loss_type == "low_var_kl"
    assert LossConfig.from_section(parse_flags(["--preset", "tiny-reverse4", "--advantage-estimator", "gspo"]).train).sequence_ratio


def test_opsm_masks_pushed_down_stale_sequences_by_hand():
    """Three sequences, old = rollout log-probs, delta 0.1.
    Sequence 1 (2 tokens, A = -1): old - logp = [ln 2, 0] -> seq_kl ln(2)/2 = 0.347 > 0.1: masked.
    Sequence 2 (1 token, A = -1): old - logp = ln(1.05) = 0.049 < 0.1: kept, ratio 1/1.05 = 0.952 (inside
    [0.8, 1.2]): loss +0.952. Sequence 3 (1 token, A = +1): old - logp = ln 2 > 0.1 but A > 0: kept;
    ratio 0.5, and for A > 0 only the upper clip binds: loss -0.5.
    Loss over 4 loss tokens: (0 + 0 + 0.952381 - 0.5) / 4 = 0.113095; opsm_clipfrac 2/4."""
    logp = torch.log(torch.tensor([[0.25, 0.5, 0.5, 0.25]], dtype=torch.float64)).requires_grad_(True)
    old = torch.log(torch.tensor([[0.5, 0.5, 0.525, 0.5]], dtype=torch.float64))
    adv = torch.tensor([[-1.0, -1.0, -1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.float64)
    segments = torch.tensor([[1.0, 1.0, 2.0, 3.0]], dtype=torch.float64)
    cfg = LossConfig(use_rollout_logprobs=True, use_opsm=True, opsm_delta=0.1)
    loss, sums = policy_loss(cfg, logp, adv, mask, total_tokens=4.0, rollout_logp=old, segments=segments)
    loss.backward()
    assert loss.item() == pytest.approx((0.5 / 0.525 - 0.5) / 4)
    assert finalize_metrics(sums, 4.0)["train/opsm_clipfrac"] == pytest.approx(0.5)
    assert logp.grad.tolist()[0][:2] == [0.0, 0.0]  # the masked sequence gets no gradient
    plain, _ = policy_loss(LossConfig(use_rollout_logprobs=True), logp.detach(), adv, mask, total_tokens=4.0,
                           rollout_logp=old, segments=segments)
    assert plain.item() == pytest.approx((0.8 + 1.0 + 0.5 / 0.525 - 0.5) / 4)  # ratio 0.5 clipped to 0.8 for A < 0
